#!/usr/bin/env bash
# Installs what building and testing troll needs (Debian/Ubuntu, apt). Idempotent: packages
# already present are skipped, and nothing is fetched when all are. Runs as root, or via sudo
# when that exists. gnuplot-nox (for the plots in docs/) and ninja-build are optional.
set -euo pipefail

# clang + libclang-rt-14-dev: libFuzzer and the sanitizer runtimes for scripts/fuzz.sh.
required=(build-essential cmake libeigen3-dev doctest-dev libbenchmark-dev clang libclang-rt-14-dev)
# ninja-build: scripts/arch-test.sh builds its targets in parallel with it (Makefiles otherwise).
optional=(gnuplot-nox ninja-build)

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q '^install ok installed$'; }

missing=()
for pkg in "${required[@]}" "${optional[@]}"; do
  installed "$pkg" || missing+=("$pkg")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all packages present"
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1; then
  as_root=(sudo)
else
  echo "install-deps: missing ${missing[*]} and not root (no sudo); install them first" >&2
  exit 1
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update
need=()
for pkg in "${required[@]}"; do
  installed "$pkg" || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  "${as_root[@]}" apt-get install -y --no-install-recommends "${need[@]}"
fi
for pkg in "${optional[@]}"; do
  if ! installed "$pkg"; then
    "${as_root[@]}" apt-get install -y --no-install-recommends "$pkg" ||
      echo "install-deps: optional package $pkg unavailable; continuing" >&2
  fi
done
