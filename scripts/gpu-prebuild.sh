#!/usr/bin/env bash
# Builds every CUDA test, benchmark and quickstart_cuda for a GPU machine's architecture on this
# (GPU-less) machine and packs them into .gpubin/gpu.tar.xz (~13 MB), so that a device lease is
# spent running, not compiling (docs/cuda.md, "Running the CUDA checks on a GPU"). Carry
# .gpu-deps (written by scripts/gpu-bundle.sh when missing) and .gpubin to the GPU machine and run
# scripts/gpu-run-prebuilt.sh there.
#   TROLL_GPU_ARCH  CUDA architecture (default 90: H100 / H200)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ -x /usr/local/cuda/bin/nvcc ] && export PATH="/usr/local/cuda/bin:$PATH"
arch=${TROLL_GPU_ARCH:-90}
build=build/gpu$arch
[ -d .gpu-deps/usr ] || bash scripts/gpu-bundle.sh
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTROLL_ENABLE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" \
  -DTROLL_BUILD_TESTS=ON -DTROLL_BUILD_BENCH=ON -DTROLL_BUILD_EXAMPLES=ON -DTROLL_BUILD_PACKAGING_TESTS=OFF >/dev/null
# The CUDA test binaries (a group binary holds several test files) from the configure-time
# manifest, and the benchmarks.
targets=($(cut -d' ' -f2 "$build/tests/cuda_tests.txt" | sort -u))
for f in bench/cuda/bench_*.cu; do targets+=("$(basename "$f" .cu)"); done
ninja -C "$build" -j "$(nproc)" "${targets[@]}" quickstart_cuda
mkdir -p .gpubin
# Paths relative to the build tree (tar -C does not expand globs; the shell would expand them here).
files=(tests/cuda_tests.txt examples/quickstart_cuda)
for t in "${targets[@]}"; do
  if [ -f "$build/tests/$t" ]; then files+=("tests/$t"); else files+=("bench/$t"); fi
done
tar -C "$build" -cf - "${files[@]}" | xz -T0 -6 >.gpubin/gpu.tar.xz
du -h .gpubin/gpu.tar.xz
