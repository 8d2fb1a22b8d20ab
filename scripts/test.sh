#!/usr/bin/env bash
# The full check: install the dependencies, build the release preset (tests, benchmarks,
# examples; warnings are errors) and run ctest and a smoke run of every benchmark binary
# (scripts/bench-smoke.sh), then the tests of the kernels with per-ISA branches built for
# baseline x86-64 and x86-64-v3 (scripts/arch-test.sh), then build the asan preset (AddressSanitizer +
# UBSan, tests only) and run ctest again, then run the libFuzzer target for ~60 s
# (scripts/fuzz.sh; FUZZ_SECONDS overrides), and last the Python package (scripts/python-test.sh:
# a venv under build/, pip install ./python, pytest). Exits non-zero at the first failure.
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
fi

stage "release: configure"
cmake --preset release "${cuda_flags[@]}"
stage "release: build (-j$jobs)"
cmake --build --preset release -j "$jobs"
stage "release: ctest"
ctest --preset release -j "$jobs"
stage "release: benchmark smoke run (every bench_* binary, a few ms per benchmark)"
bash scripts/bench-smoke.sh build/release

stage "arch: the per-ISA kernels' tests built for baseline x86-64 (SSE2) and x86-64-v3 (AVX2 + FMA)"
bash scripts/arch-test.sh

stage "asan: configure"
cmake --preset asan
stage "asan: build (-j$jobs)"
cmake --build --preset asan -j "$jobs"
stage "asan: ctest"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --preset asan -j "$jobs"

stage "fuzz: libFuzzer + ASan + UBSan over sparse rows, alignment and shard states (${FUZZ_SECONDS:-60} s)"
bash scripts/fuzz.sh

stage "python: venv, pip install ./python, pytest"
bash scripts/python-test.sh

stage "python: TRL GRPO with troll's loss, the tiny-LM run (--quick)"
bash scripts/python-trl-test.sh

stage "all stages passed"
