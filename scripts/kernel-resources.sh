#!/usr/bin/env bash
# Registers, spills and static shared memory of every troll kernel, as ptxas reports them for one
# architecture (default sm_90): compiles the device code of each tests/cuda/*.cu to a cubin (no
# host compilation, no GPU needed) and prints one line per kernel instantiation, sorted.
#
#   bash scripts/kernel-resources.sh [arch]        e.g. 90, 80
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
arch=${1:-90}
[ -x /usr/local/cuda/bin/nvcc ] && export PATH="/usr/local/cuda/bin:$PATH"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

for f in tests/cuda/test_*.cu; do
  nvcc -std=c++17 -arch=sm_"$arch" -cubin --resource-usage -DEIGEN_NO_CUDA -I include -I tests/support \
    -I /usr/include/eigen3 -o "$tmp/out.cubin" "$f" 2>&1 |
    grep -E 'Function properties for|spill stores|Used [0-9]+ registers' >>"$tmp/raw.txt"
done

# ptxas prints, per function: "Function properties for NAME", "N bytes stack frame, S bytes spill
# stores, L bytes spill loads", "Used R registers, ... N bytes smem ...".
awk '
  /Function properties for/ { name = $NF; next }
  /spill stores/ { for (i = 1; i <= NF; ++i) if ($i == "spill" && $(i + 1) == "stores,") spills = $(i - 2); next }
  /Used [0-9]+ registers/ {
    regs = ""; smem = "0";
    for (i = 1; i <= NF; ++i) { if ($(i + 1) == "registers,") regs = $i; if ($(i + 1) == "bytes" && $(i + 2) ~ /^smem/) smem = $i }
    print name, regs, spills, smem
  }' "$tmp/raw.txt" | sort -u >"$tmp/table.txt"

printf '%-72s %5s %7s %7s\n' "kernel (sm_$arch)" regs spills smem
while read -r name regs spills smem; do
  pretty=$(echo "$name" | c++filt | sed -E 's/troll::v0::detail::cuda:://g; s/troll::v0:://g; s/\(.*$//; s/^void //')
  case "$pretty" in *troll* | *_kernel* | *jacobian_entry*) ;; *) continue ;; esac
  pretty=$(echo "$pretty" | sed -E 's/cub::CUB_[0-9_A-Z]+::detail::for_each::static_kernel<.*op_wrapper_t<unsigned long, ([a-z_]+<[a-z]+>).*/thrust for_each_n: \1/')
  printf '%-72s %5s %7s %7s\n' "${pretty:0:72}" "$regs" "$spills" "$smem"
done <"$tmp/table.txt" | sort -u
