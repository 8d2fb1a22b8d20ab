#!/usr/bin/env bash
# Builds the release preset's benchmark targets and runs every bench_* binary: a console table on
# stdout and JSON in build/bench/<name>.json. Then prints the markdown tables of
# docs/performance.md (scripts/bench_table.py), or rewrites them in place with --update-docs.
#
#   scripts/bench.sh [--update-docs] [--no-build] [extra Google Benchmark flags, e.g.
#                    --benchmark_filter=project/float]
#
# Defaults: --benchmark_repetitions=3 --benchmark_report_aggregates_only=true (later flags win).
# TROLL_BENCH_JOBS sets the build parallelism (default: nproc).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

update_docs=0
build=1
extra=()
for arg in "$@"; do
  case "$arg" in
    --update-docs) update_docs=1 ;;
    --no-build) build=0 ;;
    *) extra+=("$arg") ;;
  esac
done

build_dir=build/release
out_dir=build/bench
mkdir -p "$out_dir"

if [ "$build" -eq 1 ]; then
  cmake --preset release >/dev/null
  # Every benchmark target the build system knows (bench/bench_*.cpp, CUDA ones when enabled).
  mapfile -t targets < <(cmake --build --preset release --target help |
                           grep -oE '\bbench_[A-Za-z0-9_]+' | sort -u)
  if [ "${#targets[@]}" -eq 0 ]; then
    echo "bench.sh: no bench_* targets in $build_dir (is TROLL_BUILD_BENCH on?)" >&2
    exit 1
  fi
  cmake --build --preset release --target "${targets[@]}" -j "${TROLL_BENCH_JOBS:-$(nproc)}"
fi

mapfile -t binaries < <(find "$build_dir/bench" -maxdepth 2 -type f -name 'bench_*' -perm -u+x |
                          sort)
if [ "${#binaries[@]}" -eq 0 ]; then
  echo "bench.sh: no bench_* executables under $build_dir/bench" >&2
  exit 1
fi

status=0
jsons=()
for binary in "${binaries[@]}"; do
  name=$(basename "$binary")
  json="$out_dir/$name.json"
  printf '\n==== %s -> %s ====\n' "$name" "$json"
  if "$binary" --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
      --benchmark_out="$json" --benchmark_out_format=json "${extra[@]}"; then
    jsons+=("$json")
  else
    echo "bench.sh: $name failed (exit $?); continuing" >&2
    status=1
  fi
done

if [ "${#jsons[@]}" -gt 0 ]; then
  if [ "$update_docs" -eq 1 ]; then
    python3 scripts/bench_table.py --update docs/performance.md "${jsons[@]}"
    echo "bench.sh: rewrote the measured section of docs/performance.md"
  else
    python3 scripts/bench_table.py "${jsons[@]}" > "$out_dir/tables.md"
    echo "bench.sh: markdown tables in $out_dir/tables.md (--update-docs writes them into docs/performance.md)"
  fi
fi
exit "$status"
