#!/usr/bin/env bash
# Packs what a GPU machine without a package manager needs to build troll's CUDA tests and
# benchmarks: the Eigen, doctest and Google Benchmark headers, CMake package files and
# libbenchmark, copied from this (Debian) machine into .gpu-deps/usr with their /usr layout, so
# that CMAKE_PREFIX_PATH=.gpu-deps/usr finds them. .gpu-deps/ is git-ignored; hand it to the GPU
# machine alongside the working tree and run scripts/gpu-verify.sh there (docs/cuda.md,
# "Running the CUDA checks on a GPU"). About 11 MB.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/install-deps.sh
dest=.gpu-deps
rm -rf "$dest"
mkdir -p "$dest"

# doctest goes without its CMake files (they hard-code /usr); tests/CMakeLists.txt then finds the
# bare header on CMAKE_PREFIX_PATH. Eigen's and Benchmark's CMake files are relocatable.
multiarch=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
paths=(
  /usr/include/eigen3
  /usr/share/eigen3/cmake
  /usr/include/doctest
  /usr/include/benchmark
  /usr/lib/"$multiarch"/cmake/benchmark
)
for p in "${paths[@]}"; do
  if [ ! -e "$p" ]; then
    echo "gpu-bundle: $p is missing (is the matching -dev package installed?)" >&2
    exit 1
  fi
done
# The shared library with its links (libbenchmark.so -> .so.1debian -> .so.1.x.y).
paths+=(/usr/lib/"$multiarch"/libbenchmark.so* /usr/lib/"$multiarch"/libbenchmark_main.a)
# tar keeps the /usr layout (and the links) below $dest.
tar -C / -cf - "${paths[@]#/}" | tar -C "$dest" -xf -

du -sh "$dest"
echo "gpu-bundle: wrote $dest (CMAKE_PREFIX_PATH=$PWD/$dest/usr, LD_LIBRARY_PATH=$PWD/$dest/usr/lib/$multiarch)"
