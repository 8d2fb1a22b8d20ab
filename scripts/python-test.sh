#!/usr/bin/env bash
# The Python package's check: the test environment of scripts/python-deps.sh (build/venv: the
# pinned build and test dependencies and CPU-usable torch; skipped where TROLL_PYTHON_DEPS_READY=1
# says it is ready), `pip install ./python` (the CPU extension, and the CUDA extension where nvcc
# is present), then pytest on python/tests. Exits non-zero on any failure, and when pytest
# collects no tests.
#   TROLL_PYTHON_VENV   where the environment lives (default build/venv)
#   TROLL_TORCH_VERSION the torch release python-deps.sh installs
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

venv=${TROLL_PYTHON_VENV:-build/venv}
started=$SECONDS
step() { printf '\n---- [python-test.sh %4ds] %s ----\n' "$((SECONDS - started))" "$*"; }

if [ "${TROLL_PYTHON_DEPS_READY:-0}" != 1 ]; then
  step "dependencies: scripts/python-deps.sh"
  bash scripts/python-deps.sh
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)

# The CUDA extension (troll._troll_cuda) is compiled too where nvcc is present (about 1.5 min on
# 2 cores, one architecture); its tests skip without a GPU. TROLL_PYTHON_CUDA=0 skips it.
cuda_defines=()
nvcc=${CUDACXX:-/usr/local/cuda/bin/nvcc}
if [ "${TROLL_PYTHON_CUDA:-1}" != 0 ] && [ -x "$nvcc" ]; then
  cuda_defines=(-Ccmake.define.TROLL_ENABLE_CUDA=ON "-Ccmake.define.CMAKE_CUDA_COMPILER=$nvcc"
                "-Ccmake.define.CMAKE_CUDA_ARCHITECTURES=${TROLL_PYTHON_CUDA_ARCHITECTURES:-90}")
  # No device here: the extension is a compile check (its tests skip), with cheaper flags
  # (scripts/cuda-compile-only.sh; TROLL_CUDA_COMPILE_ONLY=0 keeps the release flags).
  # shellcheck source=scripts/cuda-compile-only.sh
  . scripts/cuda-compile-only.sh
  if [ "$troll_cuda_compile_only" = 1 ]; then
    cuda_defines+=("-Ccmake.define.CMAKE_CUDA_FLAGS_RELEASE=$troll_cuda_compile_only_flags")
  fi
else
  cuda_defines=(-Ccmake.define.TROLL_ENABLE_CUDA=OFF)
fi

# A CPU without AVX-512 never imports troll._troll_avx512 (troll/_cpu.py): there it is built
# as a compile check at -O0 (python/CMakeLists.txt; TROLL_PYTHON_AVX512_COMPILE_ONLY=0|1 forces
# the choice).
isa_defines=()
avx512_only_compiled=${TROLL_PYTHON_AVX512_COMPILE_ONLY:-}
if [ -z "$avx512_only_compiled" ]; then
  avx512_only_compiled=0
  if [ "$(uname -m)" = x86_64 ] && ! grep -qw avx512f /proc/cpuinfo 2>/dev/null; then avx512_only_compiled=1; fi
fi
if [ "$avx512_only_compiled" = 1 ]; then
  echo "python-test.sh: no AVX-512 here: troll._troll_avx512 is a compile check (-O0)"
  isa_defines=(-Ccmake.define.TROLL_PYTHON_AVX512_COMPILE_ONLY=ON)
fi

step "pip install ./python (CPU extension${cuda_defines[1]:+ and CUDA extension})"
# Build isolation off: the pinned scikit-build-core and nanobind of python-deps.sh are the build
# backend.
"${pip[@]}" install -q --no-build-isolation -Ccmake.define.CMAKE_BUILD_PARALLEL_LEVEL=2 "${cuda_defines[@]}" \
  "${isa_defines[@]}" ./python

step "pytest python/tests"
status=0
# The TRL adapter's tests need python/requirements-trl.txt: scripts/python-trl-test.sh runs them.
(cd python && "../$venv/bin/pytest" -q tests --ignore=tests/test_trl.py) || status=$?
if [ "$status" -eq 5 ]; then
  echo "python-test.sh: pytest collected no tests" >&2
  exit 1
fi
[ "$status" -eq 0 ] || exit "$status"
# Where the AVX-512 build ran the tests above (troll.cpu_isa() == "avx512"), the baseline build
# (AVX2 + FMA) takes the same tests again: both modules ship in the package (troll/_cpu.py).
isa=$(cd python/tests && "../../$venv/bin/python" -c "import troll; print(troll.cpu_isa())")
if [ "$isa" = avx512 ]; then
  step "pytest python/tests with TROLL_CPU_ISA=baseline"
  (cd python && TROLL_CPU_ISA=baseline "../$venv/bin/pytest" -q tests --ignore=tests/test_trl.py)
fi
step "python tests passed"
