#!/usr/bin/env bash
# Builds tests/fuzz/fuzz_sparse.cpp with clang's libFuzzer under AddressSanitizer + UBSan and
# runs it for a bounded time (FUZZ_SECONDS, default 60) from the committed seed corpus
# (tests/fuzz/corpus/, read only; new inputs go to a scratch folder under build/fuzz/). Exits
# non-zero when the fuzzer finds a crash, a sanitizer report or a broken invariant; the input
# that did it is left in build/fuzz/ (crash-*, leak-*, timeout-*) and printed as hex.
#   scripts/fuzz.sh                  # 60 s
#   FUZZ_SECONDS=600 scripts/fuzz.sh # longer, locally
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

seconds=${FUZZ_SECONDS:-60}
cxx=${FUZZ_CXX:-}
if [ -z "$cxx" ]; then
  for candidate in clang++ clang++-14 clang++-15 clang++-16; do
    if command -v "$candidate" >/dev/null 2>&1; then cxx=$candidate; break; fi
  done
fi
[ -n "$cxx" ] || { echo "fuzz.sh: clang++ not found (scripts/install-deps.sh installs it)" >&2; exit 1; }

eigen_dir=$(pkg-config --cflags-only-I eigen3 2>/dev/null | sed 's/^-I//; s/ .*//')
[ -n "$eigen_dir" ] || eigen_dir=/usr/include/eigen3
work=build/fuzz
mkdir -p "$work/corpus"
"$cxx" -std=c++17 -O1 -g -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined \
  -fno-sanitize-recover=undefined ${FUZZ_FLAGS:-} -Iinclude -isystem "$eigen_dir" \
  tests/fuzz/fuzz_sparse.cpp -o "$work/fuzz_sparse"

# -timeout: one input may take at most 10 s; -rss_limit_mb bounds memory; the scratch corpus
# comes first so the committed one is only read.
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  "$work/fuzz_sparse" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
  -artifact_prefix="$work/" "$work/corpus" tests/fuzz/corpus
