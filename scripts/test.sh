#!/usr/bin/env bash
# The full check: install the dependencies, build the release preset (tests, benchmarks,
# examples; warnings are errors) and run ctest; then, side by side, a smoke run of every
# benchmark binary (scripts/bench-smoke.sh), the libFuzzer target for ~60 s (scripts/fuzz.sh;
# FUZZ_SECONDS overrides) and the Python test environment (scripts/python-deps.sh); then the
# tests of the kernels with per-ISA branches built for baseline x86-64 (and x86-64-v3 where the
# release build is not already that: scripts/arch-test.sh); then the asan preset (AddressSanitizer
# + UBSan, tests only) and its ctest; last the Python package (scripts/python-test.sh: pip install
# ./python, pytest) and TRL with troll's loss (scripts/python-trl-test.sh). Exits non-zero at the
# first failure.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

jobs=$(nproc 2>/dev/null || echo 2)
started=$SECONDS
stage() { printf '\n==== [test.sh %4ds] %s ====\n' "$((SECONDS - started))" "$*"; }
trap 'status=$?; [ $status -eq 0 ] || printf "\n==== test.sh FAILED (exit %d) ====\n" $status >&2' EXIT

stage "dependencies"
bash scripts/install-deps.sh

# CI has nvcc but no GPU: every CUDA test, benchmark and example must still compile. Put the
# toolkit on PATH when it is installed in the usual place, and then require it.
cuda_flags=()
if [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
  # One device architecture (sm_90, the H100 / H200 the GPU sessions use) rather than the default
  # 80;90: every kernel still goes through nvcc's front end, cicc and ptxas, at half the device
  # compile time. TROLL_TEST_CUDA_ARCHITECTURES overrides (e.g. "80;90").
  cuda_flags=(-DTROLL_ENABLE_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${TROLL_TEST_CUDA_ARCHITECTURES:-90}")
  # Without a device the CUDA code is a compile check: cheaper optimisation flags for it
  # (scripts/cuda-compile-only.sh says which and why; TROLL_CUDA_COMPILE_ONLY=0 keeps -O3).
  # shellcheck source=scripts/cuda-compile-only.sh
  . scripts/cuda-compile-only.sh
  if [ "$troll_cuda_compile_only" = 1 ]; then
    echo "test.sh: no NVIDIA device here: CUDA sources compile as a check ($troll_cuda_compile_only_flags)"
    cuda_flags+=("-DCMAKE_CUDA_FLAGS_RELEASE=$troll_cuda_compile_only_flags")
  fi
fi

# Ninja where it is installed (scripts/cmake-generator.sh).
# shellcheck source=scripts/cmake-generator.sh
. scripts/cmake-generator.sh

# Runs the named commands side by side, each one's output into build/logs/<name>.log, and then
# prints every log in turn; fails when any of them failed. For the stages that use one core each.
side_by_side() {
  mkdir -p build/logs
  local names=() pids=() begun=$SECONDS failed=0 i
  while [ $# -ge 2 ]; do
    names+=("$1")
    bash -euo pipefail -c "$2" > "build/logs/$1.log" 2>&1 &
    pids+=($!)
    shift 2
  done
  for i in "${!pids[@]}"; do
    local outcome=passed
    wait "${pids[$i]}" || { outcome="FAILED (exit $?)"; failed=1; }
    printf -- '---- %s: %s (side by side, %d s so far) ----\n' "${names[$i]}" "$outcome" "$((SECONDS - begun))"
    cat "build/logs/${names[$i]}.log"
  done
  return "$failed"
}

stage "release: configure"
# shellcheck disable=SC2046
cmake --preset release $(troll_generator_for build/release) "${cuda_flags[@]}"
stage "release: build (-j$jobs)"
cmake --build --preset release -j "$jobs"
stage "release: ctest"
ctest --preset release -j "$jobs"
# Three stages that each keep one core busy, side by side: the benchmark smoke run (every
# bench_* binary, a few ms per benchmark), the libFuzzer target (one clang build, then ~60 s of
# fuzzing over sparse rows, alignment and shard states; FUZZ_SECONDS overrides) and the Python
# test environment (venv, pinned wheels from pip's cache: scripts/python-deps.sh).
stage "side by side: benchmark smoke run | fuzz (${FUZZ_SECONDS:-60} s) | Python dependencies"
side_by_side bench-smoke "bash scripts/bench-smoke.sh build/release" \
             fuzz "bash scripts/fuzz.sh" \
             python-deps "bash scripts/python-deps.sh --trl"
export TROLL_PYTHON_DEPS_READY=1

stage "arch: the per-ISA kernels' tests built for baseline x86-64 (SSE2), and x86-64-v3 (AVX2 + FMA) where native is not that"
bash scripts/arch-test.sh

stage "asan: configure"
# shellcheck disable=SC2046
cmake --preset asan $(troll_generator_for build/asan)
stage "asan: build (-j$jobs)"
cmake --build --preset asan -j "$jobs"
stage "asan: ctest"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --preset asan -j "$jobs"

stage "python: venv, pip install ./python, pytest"
bash scripts/python-test.sh

stage "python: TRL GRPO with troll's loss, the tiny-LM run (--quick)"
bash scripts/python-trl-test.sh

stage "all stages passed"
