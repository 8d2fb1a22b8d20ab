#!/usr/bin/env bash
# The toy RL demo in one command: install the dependencies (gnuplot-nox optional), build the
# release preset's `toy_rl` example only, run it (TROLL vs PPO clip vs DPPO on a V = 1,024 task)
# and list the CSVs and plots it left in build/toy_rl/ (or the folder given as $1).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

out=${1:-build/toy_rl}

bash scripts/install-deps.sh

cmake --preset release
cmake --build --preset release --target toy_rl -j "$(nproc 2>/dev/null || echo 2)"

echo "==== running examples/toy_rl -> $out ===="
status=0
build/release/examples/toy_rl "$out" || status=$?

echo "==== files in $out ===="
ls -l "$out"/*.csv "$out"/*.png 2>/dev/null || ls -l "$out"
exit $status
