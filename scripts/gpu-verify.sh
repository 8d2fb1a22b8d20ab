#!/usr/bin/env bash
# The CUDA checks that need a GPU, in one command per stage, for a machine that has a GPU, nvcc
# and CMake but perhaps no package manager (run scripts/gpu-bundle.sh first on a Debian machine
# and bring .gpu-deps/ along; without it the system's Eigen / doctest / Benchmark are used).
#
#   bash scripts/gpu-verify.sh [stage ...]      stages: build test sanitize bench (default: all)
#
# build     configures build/gpu (Release, CUDA on, CMAKE_CUDA_ARCHITECTURES from
#           TROLL_GPU_ARCH, default "native") and builds every CUDA test, benchmark and example;
#           every other stage builds first, so one stage alone is a complete command.
# test      runs each tests/cuda binary; a binary that prints "SKIPPED: no CUDA device" fails.
# sanitize  compute-sanitizer memcheck, racecheck, synccheck and initcheck on each test binary
#           (TROLL_SANITIZE_FILTER: a doctest -tc filter to keep racecheck short).
# bench     the CUDA benchmarks, console and JSON.
#
# Logs and JSON go to $OUT when set (the device tool's output folder), else build/gpu/out.
# Exits non-zero when a stage fails; the remaining stages still run and a summary is printed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

out=${OUT:-build/gpu/out}
mkdir -p "$out"
build=build/gpu
jobs=$(nproc 2>/dev/null || echo 4)
arch=${TROLL_GPU_ARCH:-native}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(build test sanitize bench)
[ -x /usr/local/cuda/bin/nvcc ] && export PATH="/usr/local/cuda/bin:$PATH"

deps=()
if [ -d .gpu-deps/usr ]; then
  deps=(-DCMAKE_PREFIX_PATH="$PWD/.gpu-deps/usr")
  multiarch=$(ls .gpu-deps/usr/lib | grep -- -linux- | head -n 1)
  export LD_LIBRARY_PATH="$PWD/.gpu-deps/usr/lib/$multiarch${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

failed=()
log() { printf '[gpu-verify %4ds] %s\n' "$SECONDS" "$*" | tee -a "$out/summary.txt"; }

cuda_tests() { for f in tests/cuda/test_*.cu; do basename "$f" .cu; done; }
cuda_benches() { for f in bench/cuda/bench_*.cu; do basename "$f" .cu; done; }

built=0
do_build() {
  [ $built -eq 1 ] && return 0
  log "device: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo 'nvidia-smi not available')"
  log "nvcc: $(nvcc --version 2>/dev/null | tail -n 1)"
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DTROLL_ENABLE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" \
    -DTROLL_BUILD_TESTS=ON -DTROLL_BUILD_BENCH=ON -DTROLL_BUILD_EXAMPLES=ON -DTROLL_BUILD_PACKAGING_TESTS=OFF \
    "${deps[@]}" >"$out/configure.log" 2>&1 || { log "configure FAILED (see configure.log)"; return 1; }
  # shellcheck disable=SC2046
  cmake --build "$build" -j "$jobs" --target $(cuda_tests) $(cuda_benches) quickstart_cuda \
    >"$out/build.log" 2>&1 || { log "build FAILED (see build.log)"; return 1; }
  built=1
  log "build: ok ($(cuda_tests | wc -l) test binaries, $(cuda_benches | wc -l) benchmarks)"
}

do_test() {
  local status=0
  for t in $(cuda_tests); do
    if "$build/tests/$t" >"$out/$t.log" 2>&1 && ! grep -q "SKIPPED: no CUDA device" "$out/$t.log"; then
      log "test $t: passed ($(grep -m1 'test cases:' "$out/$t.log" | tr -s ' '))"
    else
      log "test $t: FAILED (see $t.log)"
      status=1
    fi
  done
  "$build/examples/quickstart_cuda" >"$out/quickstart_cuda.log" 2>&1 && log "quickstart_cuda: ok" ||
    { log "quickstart_cuda: FAILED"; status=1; }
  return $status
}

do_sanitize() {
  local status=0 filter=()
  [ -n "${TROLL_SANITIZE_FILTER:-}" ] && filter=(-tc="$TROLL_SANITIZE_FILTER")
  for tool in memcheck racecheck synccheck initcheck; do
    for t in $(cuda_tests); do
      if compute-sanitizer --tool "$tool" --error-exitcode 99 "$build/tests/$t" "${filter[@]}" \
        >"$out/sanitize-$tool-$t.log" 2>&1; then
        log "compute-sanitizer $tool $t: clean ($(grep -m1 'ERROR SUMMARY' "$out/sanitize-$tool-$t.log"))"
      else
        log "compute-sanitizer $tool $t: FAILED (see sanitize-$tool-$t.log)"
        status=1
      fi
    done
  done
  return $status
}

do_bench() {
  local status=0
  for b in $(cuda_benches); do
    "$build/bench/$b" --benchmark_out="$out/$b.json" --benchmark_out_format=json >"$out/$b.log" 2>&1 &&
      log "bench $b: ok" || { log "bench $b: FAILED"; status=1; }
  done
  return $status
}

for stage in "${stages[@]}"; do
  case "$stage" in
    build) do_build || failed+=(build) ;;
    test | sanitize | bench)
      if ! do_build; then
        failed+=("$stage")
        continue
      fi
      "do_$stage" || failed+=("$stage")
      ;;
    *)
      echo "gpu-verify: unknown stage '$stage' (build, test, sanitize, bench)" >&2
      exit 2
      ;;
  esac
done

if [ ${#failed[@]} -eq 0 ]; then
  log "all stages passed: ${stages[*]}"
else
  log "FAILED stages: ${failed[*]}"
  exit 1
fi
