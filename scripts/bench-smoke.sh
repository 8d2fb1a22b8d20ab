#!/usr/bin/env bash
# Runs every benchmark binary of a build once, briefly: each benchmark for a few milliseconds
# (--benchmark_min_time, one repetition), so that CI notices a benchmark that crashes, throws or
# no longer builds, without timing anything (the numbers of a smoke run mean nothing; the
# recorded ones come from scripts/bench.sh). CUDA benchmarks skip themselves without a GPU.
#   scripts/bench-smoke.sh [build dir, default build/release] [extra Google Benchmark flags]
# Bounded: each binary gets at most TROLL_BENCH_SMOKE_SECONDS (default 300) before it fails: a
# guard against a hang, not a timing (bench_gaussian's full d = 128 cases take seconds an
# iteration, and scripts/test.sh runs this beside other stages).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

build_dir=${1:-build/release}
shift || true
limit=${TROLL_BENCH_SMOKE_SECONDS:-300}

mapfile -t binaries < <(find "$build_dir/bench" -maxdepth 2 -type f -name 'bench_*' -perm -u+x | sort)
if [ "${#binaries[@]}" -eq 0 ]; then
  echo "bench-smoke.sh: no bench_* executables under $build_dir/bench" >&2
  exit 1
fi

started=$SECONDS
for binary in "${binaries[@]}"; do
  printf '  %-32s ' "$(basename "$binary")"
  before=$SECONDS
  if ! out=$(timeout "$limit" "$binary" --benchmark_min_time=0.001 --benchmark_repetitions=1 "$@" 2>&1); then
    echo "FAILED"
    echo "$out" | tail -20 >&2
    exit 1
  fi
  printf 'ok, %ds\n' "$((SECONDS - before))"
done
echo "bench-smoke.sh: ${#binaries[@]} binaries in $((SECONDS - started)) s"
