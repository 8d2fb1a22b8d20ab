#!/usr/bin/env bash
# Quick start: install the dependencies, build the examples (release preset, no tests or
# benchmarks) and run the `quickstart` example.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/install-deps.sh

build=build/quickstart
cmake --preset release -B "$build" -DTROLL_BUILD_TESTS=OFF -DTROLL_BUILD_BENCH=OFF \
  -DTROLL_BUILD_EXAMPLES=ON
cmake --build "$build" -j "$(nproc 2>/dev/null || echo 2)"

if [ -x "$build/examples/quickstart" ]; then
  echo "==== running examples/quickstart ===="
  "$build/examples/quickstart"
else
  echo "examples/quickstart is not there yet; built: $(ls "$build/examples" 2>/dev/null | tr '\n' ' ')"
fi
