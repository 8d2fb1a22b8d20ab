#!/usr/bin/env bash
# Quick start: install the dependencies, build the examples (release preset, no tests or
# benchmarks), run `quickstart` (project a batch of LLM-like rows, print the stats) and then the
# main demo `toy_rl` (TROLL vs PPO clip vs DPPO; CSVs and PNG plots in build/toy_rl/).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/install-deps.sh

build=build/quickstart
cmake --preset release -B "$build" -DTROLL_BUILD_TESTS=OFF -DTROLL_BUILD_BENCH=OFF \
  -DTROLL_BUILD_EXAMPLES=ON
cmake --build "$build" -j "$(nproc 2>/dev/null || echo 2)" --target quickstart toy_rl

echo "==== running examples/quickstart ===="
"$build/examples/quickstart"

out=build/toy_rl
echo "==== running examples/toy_rl -> $out ===="
"$build/examples/toy_rl" "$out"
echo "==== files in $out ===="
ls -l "$out"
