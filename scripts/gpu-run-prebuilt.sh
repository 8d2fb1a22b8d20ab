#!/usr/bin/env bash
# On the GPU machine: unpacks .gpubin/gpu.tar.xz (scripts/gpu-prebuild.sh) and runs
# scripts/gpu-verify.sh stages on those binaries under one deadline, then packs every log into
# $OUT/logs.tgz beside summary.txt (the device tool returns at most 8 files).
#   bash scripts/gpu-run-prebuilt.sh DEADLINE_SECONDS stage...
# Stages: test bench profile peer python sanitize (python's build starts in the background at
# once). Each stage gets at most what is left before the deadline.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
deadline=$1
shift
out=${OUT:-build/gpu/out}
mkdir -p build/pre "$out" && tar xJf .gpubin/gpu.tar.xz -C build/pre || exit 1
export TROLL_GPU_PREBUILT=build/pre OUT="$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
left() { echo $((deadline - SECONDS)); }
pypid=
for s in "$@"; do
  [ "$s" = python ] && { timeout "$deadline" bash scripts/gpu-verify.sh python-build >/dev/null 2>&1 & pypid=$!; }
done
for s in "$@"; do
  l=$(left)
  [ "$l" -lt 20 ] && { echo "skip $s (deadline)"; continue; }
  case $s in
    test) TROLL_TEST_TIMEOUT=$((l - 5)) timeout "$l" bash scripts/gpu-verify.sh test ;;
    bench) TROLL_BENCH_ARGS=${TROLL_BENCH_ARGS:---benchmark_min_time=0.1} timeout "$l" bash scripts/gpu-verify.sh bench ;;
    profile | peer) timeout "$l" bash scripts/gpu-verify.sh "$s" ;;
    python)
      [ -n "$pypid" ] && wait "$pypid"
      l=$(left)
      timeout "$l" bash scripts/gpu-verify.sh python-test
      ;;
    sanitize)
      TROLL_SANITIZE_SKIP=${TROLL_SANITIZE_SKIP:-test_cuda_gaussian_full_derivatives} TROLL_SANITIZE_JOBS=${TROLL_SANITIZE_JOBS:-8} \
        TROLL_TEST_TIMEOUT=$((l - 15)) timeout "$((l - 10))" bash scripts/gpu-verify.sh sanitize
      ;;
    *) echo "unknown stage $s" ;;
  esac
done
wait
(cd "$out" && tar czf logs.tgz --exclude=summary.txt --exclude=logs.tgz . &&
  find . -type f ! -name logs.tgz ! -name summary.txt -delete)
echo "==== summary"
cat "$out/summary.txt"
