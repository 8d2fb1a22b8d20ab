# Sourced by scripts/test.sh and scripts/python-test.sh (not run on its own). Where no NVIDIA
# device can run what is built here (CI: nvcc but no GPU), every CUDA test, benchmark, example
# and the Python CUDA extension is built only to check that it compiles (the CUDA tests skip at
# run time). There the CUDA sources take cheaper optimisation flags: host code -O0 (nvcc's -O is
# the host compiler's) and device code --Ofast-compile=max (fewer device optimisations in cicc
# and ptxas). Every source still goes through nvcc's front end, cicc, ptxas and the host
# compiler. On the 2-core VM this took test_cuda_dense_group from ~367 s of compile to ~170 s
# (nvcc --time: host 186 → 98 s, cicc 94 → 51 s, ptxas 67 → 11 s). Builds that run on a GPU
# keep the release flags: scripts/gpu-prebuild.sh and scripts/gpu-verify.sh configure their
# own, and a machine with a device gets none of this.
#   TROLL_CUDA_COMPILE_ONLY  1 or 0 to force the choice (default: 1 where no device is found)
# Sets troll_cuda_compile_only (1 or 0) and troll_cuda_compile_only_flags (CMAKE_CUDA_FLAGS_RELEASE
# for a compile-only build).
troll_cuda_compile_only=${TROLL_CUDA_COMPILE_ONLY:-}
if [ -z "$troll_cuda_compile_only" ]; then
  troll_cuda_compile_only=1
  if ls /dev/nvidia[0-9]* >/dev/null 2>&1 ||
     { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; }; then
    troll_cuda_compile_only=0
  fi
fi
troll_cuda_compile_only_flags="-O0 -DNDEBUG -Ofc=max"
