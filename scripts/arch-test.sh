#!/usr/bin/env bash
# The CPU kernels' other instruction sets: troll's own builds use -march=native (AVX-512 or AVX2, by CI
# machine), but a consumer may compile <troll/...> for baseline x86-64 (SSE2: Eigen's generic
# packets and troll's portable paths) or x86-64-v3 (AVX2 + FMA: the Python package's flags).
# Builds the tests whose kernels have per-ISA branches (packet exponentials, tilted reductions,
# sparse fast checks, the float tail sums) with TROLL_NATIVE_ARCH=OFF and each set of flags, in
# build/arch-<name>, and runs them. ARCH_TEST_SETS picks the sets. The default is "baseline v3",
# less v3 where -march=native defines the same instruction-set macros as -march=x86-64-v3 (an
# AVX2 + FMA machine without AVX-512): there the release build (-march=native) has already built
# and run the same branches of these kernels, and a second build of them would repeat it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/cmake-generator.sh
. scripts/cmake-generator.sh

jobs=$(nproc 2>/dev/null || echo 2)
tests=(test_exp_kernels test_tilt_kernels test_end_passes test_sparse_fast_checks test_sparsify_rows
       test_sparse_fast_paths test_hard_rows test_float_vs_double test_solver_prediction test_adversarial_sparse
       test_kl_precision)

# The predefined macros that select a branch in troll's kernels or in Eigen's packet code.
isa_macros() {
  echo | "${CXX:-c++}" "$@" -dM -E - 2>/dev/null |
    grep -oE '^#define __(SSE[0-9_]*|SSSE3|AVX[0-9A-Z_]*|FMA|F16C)__ ' | sort | tr -d '\n'
}
default_sets="baseline v3"
if [ -z "${ARCH_TEST_SETS:-}" ] && [ "$(uname -m)" = x86_64 ] &&
   [ "$(isa_macros -march=native)" = "$(isa_macros -march=x86-64-v3)" ]; then
  default_sets="baseline"
  echo "-- arch-test: v3 skipped: -march=native here defines the same ISA macros as x86-64-v3," \
       "so the release build's tests already ran these kernels' AVX2 + FMA branches"
fi

for set in ${ARCH_TEST_SETS:-$default_sets}; do
  case "$set" in
    baseline) flags="" ;;                  # x86-64: SSE2 only
    v3)                                     # AVX2 + FMA, no AVX-512
      if [ "$(uname -m)" != x86_64 ]; then echo "-- arch-test: v3 skipped (not x86-64)"; continue; fi
      flags="-march=x86-64-v3" ;;
    *) echo "arch-test.sh: unknown set '$set' (baseline or v3)" >&2; exit 2 ;;
  esac
  dir="build/arch-$set"
  echo "-- arch-test: $set (CXXFLAGS '${flags}') in $dir"
  # Ninja builds the listed targets in parallel (scripts/cmake-generator.sh).
  # shellcheck disable=SC2207
  generator=($(troll_generator_for "$dir"))
  cmake -S . -B "$dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS="$flags" -DTROLL_NATIVE_ARCH=OFF \
    -DTROLL_WARNINGS_AS_ERRORS=ON -DTROLL_ENABLE_CUDA=OFF -DTROLL_BUILD_BENCH=OFF -DTROLL_BUILD_EXAMPLES=OFF \
    -DTROLL_BUILD_PACKAGING_TESTS=OFF -DTROLL_GROUP_TESTS=OFF >/dev/null
  # Each listed file alone (TROLL_GROUP_TESTS=OFF; their groups, compiled whole, took longer:
  # 281 s against 254 s for both sets). The manifest written at configure time names each
  # test's executable, one "<test> <target>" line per test.
  targets=()
  for t in "${tests[@]}"; do
    target=$(awk -v t="$t" '$1 == t { print $2; exit }' "$dir/tests/test_targets.txt")
    if [ -z "$target" ]; then echo "arch-test.sh: no target holds $t" >&2; exit 1; fi
    case " ${targets[*]} " in *" $target "*) ;; *) targets+=("$target") ;; esac
  done
  cmake --build "$dir" -j "$jobs" --target "${targets[@]}"
  regex="^($(IFS='|'; echo "${tests[*]}"))\$"
  ctest --test-dir "$dir" -R "$regex" -j "$jobs" --output-on-failure
done
