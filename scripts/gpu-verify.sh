#!/usr/bin/env bash
# The CUDA checks that need a GPU, in one command per stage, for a machine that has a GPU, nvcc
# and CMake but perhaps no package manager (run scripts/gpu-bundle.sh first on a Debian machine
# and bring .gpu-deps/ along; without it the system's Eigen / doctest / Benchmark are used).
#
#   bash scripts/gpu-verify.sh [stage ...]      stages: build test sanitize bench peer (default: all but peer)
#
# build     configures build/gpu (Release, CUDA on, CMAKE_CUDA_ARCHITECTURES from
#           TROLL_GPU_ARCH, default "native") and builds every CUDA test, benchmark and example;
#           every other stage builds first, so one stage alone is a complete command.
# test      runs each CUDA test (the manifest build/.../tests/cuda_tests.txt says how); a test that
#           prints "SKIPPED: no CUDA device" fails.
# sanitize  compute-sanitizer memcheck, racecheck, synccheck and initcheck on each CUDA test
#           (TROLL_SANITIZE_FILTER: a doctest -tc filter to keep racecheck short).
# bench     the CUDA benchmarks, console and JSON.
# profile   Nsight Compute (ncu) sections for the slowest kernels (sparsify, dense fwd+bwd).
# peer      the plain-PyTorch peers of the benchmarks (bench/torch/peer_gpu.py; needs torch).
# python-gdb  a native backtrace (cuda-gdb) of a crashing Python test (after python-build).
# python    (= python-build python-test) builds the Python package with its CUDA extension into build/gpu-python (no network:
#           the machine's own scikit-build-core, nanobind and torch) and runs python/tests there,
#           the CUDA tests on torch CUDA tensors included.
#
# TROLL_GPU_PREBUILT=DIR: use the binaries already in DIR/{tests,bench,examples} (built on another
# machine for the device's architecture, e.g. by `scripts/gpu-verify.sh build` with
# TROLL_GPU_ARCH=90, and carried along) instead of configuring and building.
# TROLL_TEST_TIMEOUT: seconds one test, sanitizer or benchmark run may take (default 600).
# TROLL_TEST_SKIP: CUDA tests (space-separated names) the test stage leaves out.
# TROLL_SANITIZE_JOBS: how many compute-sanitizer runs share the GPU at once (default 4).
# TROLL_SANITIZE_SKIP: CUDA tests (space-separated names) the sanitize stage leaves out.
# TROLL_SANITIZE_TOOLS: which compute-sanitizer tools (default: memcheck racecheck synccheck initcheck).
# TROLL_BENCH_ARGS: extra arguments for every benchmark binary (e.g. --benchmark_repetitions=5).
# TROLL_GPU_PACK=1: at the end, pack every log into $OUT/logs.tgz and keep only it and
#           summary.txt (the device tool returns at most 8 files).
#
# Logs and JSON go to $OUT when set (the device tool's output folder), else build/gpu/out.
# Exits non-zero when a stage fails; the remaining stages still run and a summary is printed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/cmake-generator.sh
. scripts/cmake-generator.sh

out=${OUT:-build/gpu/out}
mkdir -p "$out"
build=${TROLL_GPU_PREBUILT:-build/gpu}
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

# The CUDA ctest tests and how to run each: <build>/tests/cuda_tests.txt, written at configure
# time, one line "<test> <binary> <args>" (tests/CMakeLists.txt compiles the files in groups; a
# test runs its own file's cases of the group binary through doctest's --source-file filter).
manifest() { cat "$build/tests/cuda_tests.txt"; }
cuda_tests() { manifest | cut -d' ' -f1; }
cuda_test_binaries() { manifest | cut -d' ' -f2 | sort -u; }
# test_command <test>: fills the array `cmd` with the binary's path and the test's arguments
# (read -a: no pathname expansion of the filter's '*').
test_command() {
  local name binary args
  read -r name binary args < <(manifest | awk -v t="$1" '$1 == t')
  read -r -a cmd <<<"$args"
  cmd=("$build/tests/$binary" "${cmd[@]}")
}
cuda_benches() { for f in bench/cuda/bench_*.cu; do basename "$f" .cu; done; }

built=0
do_build() {
  [ $built -eq 1 ] && return 0
  if [ -n "${TROLL_GPU_PREBUILT:-}" ]; then
    [ -f "$build/tests/cuda_tests.txt" ] || { log "prebuilt: $build/tests/cuda_tests.txt missing"; return 1; }
    for t in $(cuda_test_binaries); do [ -x "$build/tests/$t" ] || { log "prebuilt: $build/tests/$t missing"; return 1; }; done
    log "device: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo 'nvidia-smi not available')"
    built=1
    return 0
  fi
  log "device: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo 'nvidia-smi not available')"
  log "nvcc: $(nvcc --version 2>/dev/null | tail -n 1)"
  # Ninja builds the listed targets in parallel (scripts/cmake-generator.sh; the Makefile
  # generator built 9 of 19 binaries in 575 s on an H100 machine, one after another).
  # shellcheck disable=SC2207
  local generator=($(troll_generator_for "$build"))
  cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DTROLL_ENABLE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" \
    -DTROLL_BUILD_TESTS=ON -DTROLL_BUILD_BENCH=ON -DTROLL_BUILD_EXAMPLES=ON -DTROLL_BUILD_PACKAGING_TESTS=OFF \
    "${deps[@]}" >"$out/configure.log" 2>&1 || { log "configure FAILED (see configure.log)"; return 1; }
  # shellcheck disable=SC2046
  cmake --build "$build" -j "$jobs" --target $(cuda_test_binaries) $(cuda_benches) quickstart_cuda \
    >"$out/build.log" 2>&1 || { log "build FAILED (see build.log)"; return 1; }
  built=1
  log "build: ok ($(cuda_test_binaries | wc -l) test binaries for $(cuda_tests | wc -l) tests, $(cuda_benches | wc -l) benchmarks)"
}

# One test binary: writes <binary>.log and a verdict line.
test_one() {
  local t=$1 cmd
  test_command "$t"
  if timeout "${TROLL_TEST_TIMEOUT:-600}" "${cmd[@]}" >"$out/$t.log" 2>&1 && ! grep -q "SKIPPED: no CUDA device" "$out/$t.log"; then
    log "test $t: passed ($(grep -m1 'test cases:' "$out/$t.log" | tr -s ' '))"
  else
    log "test $t: FAILED (see $t.log)"
    return 1
  fi
}

# Every test binary at once (they share the GPU; the CPU references use the other cores).
do_test() {
  local status=0 pids=()
  for t in $(cuda_tests); do
    case " ${TROLL_TEST_SKIP:-} " in *" $t "*) log "test $t: skipped (TROLL_TEST_SKIP)"; continue ;; esac
    test_one "$t" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || status=1; done
  "$build/examples/quickstart_cuda" >"$out/quickstart_cuda.log" 2>&1 && log "quickstart_cuda: ok" ||
    { log "quickstart_cuda: FAILED"; status=1; }
  return $status
}

# One compute-sanitizer run: tool, binary. Writes sanitize-<tool>-<binary>.log and a verdict line.
sanitize_one() {
  local tool=$1 t=$2 filter=() cmd
  test_command "$t"
  [ -n "${TROLL_SANITIZE_FILTER:-}" ] && filter=(-tc="$TROLL_SANITIZE_FILTER")
  # (compute-sanitizer 2025's --track-unused-memory takes no value: "no" after it was read as
  # the program, so initcheck never ran on the first GPU machine. Its default is off.)
  local extra=()
  if timeout "${TROLL_TEST_TIMEOUT:-600}" compute-sanitizer --tool "$tool" "${extra[@]}" --error-exitcode 99 "${cmd[@]}" "${filter[@]}" \
    >"$out/sanitize-$tool-$t.log" 2>&1; then
    log "compute-sanitizer $tool $t: clean ($(grep -m1 'ERROR SUMMARY' "$out/sanitize-$tool-$t.log"))"
  else
    log "compute-sanitizer $tool $t: FAILED (see sanitize-$tool-$t.log)"
    return 1
  fi
}

do_sanitize() {
  local status=0 jobs=${TROLL_SANITIZE_JOBS:-4} pids=()
  for tool in ${TROLL_SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}; do
    for t in $(cuda_tests); do
      case " ${TROLL_SANITIZE_SKIP:-} " in *" $t "*) continue ;; esac
      sanitize_one "$tool" "$t" &
      pids+=($!)
      if [ ${#pids[@]} -ge "$jobs" ]; then
        wait "${pids[0]}" || status=1
        pids=("${pids[@]:1}")
      fi
    done
  done
  for p in "${pids[@]}"; do wait "$p" || status=1; done
  return $status
}

do_bench() {
  local status=0
  for b in $(cuda_benches); do
    # shellcheck disable=SC2086
    timeout "${TROLL_TEST_TIMEOUT:-600}" "$build/bench/$b" ${TROLL_BENCH_ARGS:-} --benchmark_out="$out/$b.json" --benchmark_out_format=json >"$out/$b.log" 2>&1 &&
      log "bench $b: ok" || { log "bench $b: FAILED"; status=1; }
  done
  return $status
}

# Nsight Compute on the slowest kernels: sparsify (bf16 → top-64), the sparse projection and its
# backward at 2^20 rows, the dense projection and its backward at 1,024 rows. One launch each,
# the full section set (speed of light, memory, occupancy, warp-state and source-level stall
# samples), as text: ncu-<name>.txt (details) and ncu-<name>-sass.csv (per-instruction stall
# samples). --clock-control none: the card's clocks are left as found.
profile_one() {
  local name=$1 bench=$2 filter=$3 kernels=$4 count=$5
  ncu --clock-control none --set full --import-source no --kernel-name "regex:$kernels" --launch-skip 1 \
    --launch-count "$count" -f -o "$out/ncu-$name" "$build/bench/$bench" --benchmark_filter="$filter" \
    --benchmark_min_time=0.01 >"$out/ncu-$name.log" 2>&1 || return 1
  ncu --import "$out/ncu-$name.ncu-rep" --page details >"$out/ncu-$name.txt" 2>&1
  ncu --import "$out/ncu-$name.ncu-rep" --page source --print-source sass --csv >"$out/ncu-$name-sass.csv" 2>&1
  rm -f "$out/ncu-$name.ncu-rep"
  return 0
}

do_profile() {
  local status=0
  profile_one sparsify bench_cuda_sparse 'bm_sparsify_bf16/64' 'sparsify_kernel' 1 || status=1
  profile_one sparse bench_cuda_sparse 'bm_sparse_project_fwd_bwd' 'sparse_project' 2 || status=1
  profile_one dense bench_cuda_projection 'cuda_project_forward_backward/float/active:100%/V:151936/rows:1024' \
    'project_kernel|project_backward_kernel' 2 || status=1
  [ $status -eq 0 ] && log "profile: ok (ncu-*.txt, ncu-*-sass.csv)" || log "profile: FAILED (see ncu-*.log)"
  return $status
}

do_peer() {
  PYTHONUNBUFFERED=1 python3 bench/torch/peer_gpu.py --json "$out/peer_gpu.json" >"$out/peer_gpu.log" 2>&1 &&
    log "peer: ok" || { log "peer: FAILED (see peer_gpu.log)"; return 1; }
}

do_python_build() {
  local site=build/gpu-python
  rm -rf "$site"
  local prefix=()
  [ -d .gpu-deps/usr ] && prefix=("-Ccmake.define.CMAKE_PREFIX_PATH=$PWD/.gpu-deps/usr")
  # A pip-installed nanobind is not on CMake's search path without build isolation.
  local nb
  nb=$(python3 -m nanobind --cmake_dir 2>/dev/null) && prefix+=("-Ccmake.define.nanobind_DIR=$nb")
  python3 -m pip install -q --no-build-isolation --no-deps --no-index --target "$site" \
    -Ccmake.define.TROLL_ENABLE_CUDA=ON "-Ccmake.define.CMAKE_CUDA_ARCHITECTURES=${arch/native/90}" \
    "-Ccmake.define.CMAKE_BUILD_PARALLEL_LEVEL=$jobs" "${prefix[@]}" ./python \
    >"$out/python-build.log" 2>&1 || { log "python: build FAILED (see python-build.log)"; return 1; }
  log "python: built"
}

do_python_test() {
  local site=build/gpu-python
  # pytest-xdist where the machine has it: a test that crashes the interpreter (a SIGSEGV on the
  # first H200 run) then fails alone instead of ending the session, and -rfE names every failure.
  local par=()
  python3 -c "import xdist" 2>/dev/null && par=(-n 8)
  # Run from build/ so that `python3 -m pytest` (which puts its working directory first on
  # sys.path) imports the installed package, not the source tree's python/troll.
  (cd build && PYTHONPATH="$PWD/../$site" timeout "${TROLL_TEST_TIMEOUT:-600}" \
    python3 -m pytest -q -rfE -p no:cacheprovider "${par[@]}" ../python/tests --ignore=../python/tests/test_trl.py) >"$out/python-test.log" 2>&1 &&
    log "python: $(tail -n 1 "$out/python-test.log")" ||
    { log "python: FAILED ($(tail -n 1 "$out/python-test.log"))"; return 1; }
}

# A native backtrace of a Python test that crashes the interpreter (the CUDA extension's SIGSEGV
# on the H100 and the H200): cuda-gdb (the device machines have no gdb) in batch mode on one test
# file (TROLL_PYTEST_FILE, default test_cuda_gaussian.py) and -k filter (TROLL_PYTEST_K). Needs
# python-build first.
do_python_gdb() {
  local site=build/gpu-python
  (cd build && PYTHONPATH="$PWD/../$site" timeout "${TROLL_TEST_TIMEOUT:-600}" \
    cuda-gdb -batch -ex run -ex bt -ex "info sharedlibrary" --args python3 -m pytest -q -p no:cacheprovider -x \
    "../python/tests/${TROLL_PYTEST_FILE:-test_cuda_gaussian.py}" -k "${TROLL_PYTEST_K:-bad_row}") \
    >"$out/python-gdb.log" 2>&1
  log "python-gdb: done (python-gdb.log)"
}

pack() {
  [ "${TROLL_GPU_PACK:-0}" = 1 ] || return 0
  (cd "$out" && tar czf logs.tgz --exclude=logs.tgz --exclude=summary.txt . &&
    find . -type f ! -name logs.tgz ! -name summary.txt -delete)
}
trap pack EXIT
trap 'exit 143' TERM INT

for stage in "${stages[@]}"; do
  case "$stage" in
    build) do_build || failed+=(build) ;;
    peer) do_peer || failed+=(peer) ;;
    profile) { do_build && do_profile; } || failed+=(profile) ;;
    python) { do_python_build && do_python_test; } || failed+=(python) ;;
    python-build) do_python_build || failed+=(python-build) ;;
    python-test) do_python_test || failed+=(python-test) ;;
    python-gdb) do_python_gdb || failed+=(python-gdb) ;;
    test | sanitize | bench)
      if ! do_build; then
        failed+=("$stage")
        continue
      fi
      "do_$stage" || failed+=("$stage")
      ;;
    *)
      echo "gpu-verify: unknown stage '$stage' (build, test, sanitize, bench, profile, peer, python, python-build, python-test, python-gdb)" >&2
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
