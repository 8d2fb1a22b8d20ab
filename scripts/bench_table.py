#!/usr/bin/env python3
"""Turns Google Benchmark JSON files from scripts/bench.sh into the markdown of docs/performance.md.

    python3 scripts/bench_table.py build/bench/*.json              # markdown on stdout
    python3 scripts/bench_table.py --update docs/performance.md build/bench/*.json

--update replaces the text between the BEGIN/END markers of the document and leaves the rest.
bench_dense's names (<op>/<type>/[activeNN/]<serial|parallel>/V:<V>/rows:<N>[/arrays:<k>]) get
the dense tables; any other benchmark gets a plain table. Medians of the repetitions are used
when the file has aggregates; single-threaded runs are timed in CPU time, parallel ones in real
time, as the benchmarks report them.
"""
import argparse
import json
import os
import platform
import re
import subprocess
import sys

BEGIN = "<!-- BEGIN bench_table.py output: regenerate, do not edit by hand -->"
END = "<!-- END bench_table.py output -->"
DENSE_OPS = {"project", "project_vjp", "log_softmax", "kl", "kl_backward", "read"}
VJP_ARRAYS = 8
FORWARD_ARRAYS = 3


def load_runs(path):
    """The runs of one file: medians when aggregated, else the plain iteration runs."""
    with open(path) as f:
        data = json.load(f)
    # Runs that reported an error (e.g. a CUDA benchmark without a device) measured nothing.
    benches = [b for b in data.get("benchmarks", []) if not b.get("error_occurred")]
    medians = [b for b in benches if b.get("aggregate_name") == "median"]
    if medians:
        cvs = {b["run_name"]: b for b in benches if b.get("aggregate_name") == "cv"}
        for b in medians:
            b["_cv"] = cvs.get(b["run_name"])
        return data.get("context", {}), medians
    return data.get("context", {}), [b for b in benches if b.get("run_type", "iteration") == "iteration"]


def seconds(b, use_real):
    scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[b.get("time_unit", "ns")]
    return b["real_time" if use_real else "cpu_time"] * scale


def parse_dense(b):
    """Fields of a bench_dense name, or None for a name it does not follow."""
    name = b.get("run_name", b["name"])
    parts = name.split("/")
    if parts[0] not in DENSE_OPS or len(parts) < 3:
        return None
    fields = {"op": parts[0], "type": parts[1], "mix": None, "threads": None}
    for part in parts[2:]:
        if part in ("serial", "parallel"):
            fields["threads"] = part
        elif re.fullmatch(r"active\d+|nearly_equal", part):
            fields["mix"] = part
        elif ":" in part:
            key, value = part.split(":", 1)
            if key in ("V", "rows", "arrays"):
                fields[key] = int(value)
    if fields["threads"] is None or "V" not in fields or "rows" not in fields:
        return None
    fields["real"] = "real_time" in parts or fields["threads"] == "parallel"
    fields["time"] = seconds(b, fields["real"])
    fields["bench"] = b
    return fields


def fmt(x, digits=3):
    if x is None:
        return "–"
    if x == 0:
        return "0"
    if abs(x) >= 1e6:
        return f"{x / 1e6:.{digits}g} M"
    if abs(x) >= 1e3:
        return f"{x / 1e3:.{digits}g} k"
    return f"{x:.{digits}g}"


def cv_percent(b):
    cv = b.get("_cv")
    if not cv:
        return "–"
    key = "real_time" if "real_time" in b["run_name"] else "cpu_time"
    return f"{100 * cv[key]:.0f}%"


def dense_tables(runs):
    rows = [f for f in (parse_dense(b) for b in runs) if f]
    if not rows:
        return []
    index = {}
    for f in rows:
        index[(f["op"], f["type"], f["mix"], f["threads"], f["V"], f["rows"], f.get("arrays"))] = f

    def time_of(op, f, arrays=None, mix=None):
        hit = index.get((op, f["type"], mix, f["threads"], f["V"], f["rows"], arrays))
        return hit["time"] if hit else None

    out = []
    titles = {"project": "Forward: `troll::project`",
              "project_vjp": "Forward + backward: `troll::project` then `troll::project_backward` "
                             "(∂L/∂z̃ only)"}
    for op in ("project", "project_vjp"):
        arrays = FORWARD_ARRAYS if op == "project" else VJP_ARRAYS
        for type_ in ("float", "double"):
            sel = [f for f in rows if f["op"] == op and f["type"] == type_]
            if not sel:
                continue
            out.append(f"#### {titles[op]}, {type_}\n")
            out.append("| V | rows | threads | active rows | rows/s | GB/s | ns/element | "
                       "Newton its/active row | cv | × log_softmax | × read bound |")
            out.append("|---:|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|")
            sel.sort(key=lambda f: (f["V"], f["rows"], f["threads"] != "serial", f["mix"]))
            for f in sel:
                b = f["bench"]
                lsm = time_of("log_softmax", f)
                read = time_of("read", f, arrays=arrays)
                out.append("| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
                    f["V"], f["rows"], f["threads"],
                    f"{100 * b.get('active', 0):.0f}%",
                    fmt(b.get("items_per_second")),
                    f"{b.get('bytes_per_second', 0) / 1e9:.3g}",
                    f"{1e9 * f['time'] / (f['V'] * f['rows']):.3g}",
                    f"{b.get('newton_iters', 0):.2f}" if b.get("active", 0) > 0 else "–",
                    cv_percent(b),
                    f"{f['time'] / lsm:.2f}" if lsm else "–",
                    f"{f['time'] / read:.1f}" if read else "–"))
            out.append("")

    base = [f for f in rows if f["op"] in ("log_softmax", "kl", "kl_backward", "read")]
    if base:
        out.append("#### Baselines: `troll::log_softmax`, `troll::kl`, plain read\n")
        out.append("| op | type | V | rows | threads | rows/s | GB/s | ns/element | cv | "
                   "× log_softmax |")
        out.append("|:---|:---|---:|---:|:---|---:|---:|---:|---:|---:|")
        order = {"log_softmax": 0, "kl": 1, "kl_backward": 2, "read": 3}
        base.sort(key=lambda f: (f["type"] != "float", f["V"], f["rows"], f["threads"] != "serial",
                                 order[f["op"]], f.get("arrays") or 0))
        for f in base:
            b = f["bench"]
            label = f["op"] if f["op"] != "read" else f"read ×{f['arrays']} arrays"
            lsm = time_of("log_softmax", f)
            out.append("| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
                label, f["type"], f["V"], f["rows"], f["threads"],
                fmt(b.get("items_per_second")),
                f"{b.get('bytes_per_second', 0) / 1e9:.3g}",
                f"{1e9 * f['time'] / (f['V'] * f['rows']):.3g}",
                cv_percent(b),
                f"{f['time'] / lsm:.2f}" if lsm else "–"))
        out.append("")
    return out


def generic_table(title, runs):
    out = [f"#### {title}\n", "| benchmark | time | CPU | rows/s (items/s) | GB/s | counters |",
           "|:---|---:|---:|---:|---:|:---|"]
    skip = {"name", "run_name", "run_type", "repetitions", "repetition_index", "threads",
            "iterations", "real_time", "cpu_time", "time_unit", "items_per_second",
            "bytes_per_second", "aggregate_name", "aggregate_unit", "family_index",
            "per_family_instance_index", "_cv", "error_occurred", "error_message"}
    for b in runs:
        counters = ", ".join(f"{k}={v:.3g}" for k, v in b.items()
                             if k not in skip and isinstance(v, (int, float)))
        unit = b.get("time_unit", "ns")
        out.append("| `{}` | {:.4g} {} | {:.4g} {} | {} | {} | {} |".format(
            b.get("run_name", b["name"]), b["real_time"], unit, b["cpu_time"], unit,
            fmt(b.get("items_per_second")),
            f"{b['bytes_per_second'] / 1e9:.3g}" if "bytes_per_second" in b else "–",
            counters))
    out.append("")
    return out


def command_output(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""


def machine_section(context, cache_path="build/release/CMakeCache.txt"):
    lscpu = command_output(["lscpu"])
    model = re.search(r"Model name:\s*(.+)", lscpu)
    cache = {}
    if os.path.exists(cache_path):
        with open(cache_path) as f:
            for line in f:
                m = re.match(r"([A-Za-z_0-9]+):[A-Z]+=(.*)", line.strip())
                if m:
                    cache[m.group(1)] = m.group(2)
    compiler = cache.get("CMAKE_CXX_COMPILER", "c++")
    version = command_output([compiler, "--version"]).splitlines()
    flags = " ".join(x for x in (cache.get("CMAKE_CXX_FLAGS", ""),
                                 cache.get(f"CMAKE_CXX_FLAGS_{cache.get('CMAKE_BUILD_TYPE', 'RELEASE').upper()}", ""))
                     if x)
    # TROLL_NATIVE_ARCH adds -march=native (AVX-512 included) to troll's own targets.
    if cache.get("TROLL_NATIVE_ARCH", "OFF").upper() in ("ON", "1", "TRUE", "YES"):
        flags += " -march=native"
    cpu_flags = set(command_output(["sh", "-c", "grep -m1 '^flags' /proc/cpuinfo"]).split())
    isa = next((x for x in ("avx512f", "avx2", "avx", "sse4_2") if x in cpu_flags), "")
    caches = ", ".join(f"L{c['level']} {c['type'].lower()} {c['size'] // 1024} KiB ×{c['num_sharing'] and context.get('num_cpus', 1) // c['num_sharing']}"
                       for c in context.get("caches", []))
    lines = [
        "| | |", "|:---|:---|",
        f"| date (benchmark start) | {context.get('date', '?')} |",
        f"| CPU | {model.group(1).strip() if model else platform.processor() or '?'} |",
        f"| hardware threads (`nproc`) | {command_output(['nproc']).strip() or '?'} "
        f"(benchmark saw {context.get('num_cpus', '?')} CPUs at {context.get('mhz_per_cpu', '?')} MHz) |",
        f"| caches | {caches or '?'} |",
        f"| load average at start | {', '.join(f'{x:.2f}' for x in context.get('load_avg', [])) or '?'} |",
        f"| OS | {platform.system()} {platform.release()} |",
        f"| compiler | {version[0] if version else compiler} |",
        f"| flags | `{flags}` (CMake preset `release`; widest vector ISA the CPU reports: {isa or '?'}) |",
        f"| Google Benchmark library | built as {context.get('library_build_type', '?')} "
        f"(the distribution package; it only times, the measured code is `{flags}`) |",
        "",
    ]
    return lines


def render(paths):
    out = []
    first_context = None
    for path in paths:
        context, runs = load_runs(path)
        if first_context is None:
            first_context = context
        name = os.path.splitext(os.path.basename(path))[0]
        dense = dense_tables(runs)
        other = [b for b in runs if not parse_dense(b)]
        out.append(f"### {name}\n")
        out.extend(dense)
        if other:
            out.extend(generic_table(f"{name}: other benchmarks" if dense else name, other))
    head = ["### Machine and build\n"] + machine_section(first_context or {})
    return "\n".join(head + out).rstrip() + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="+", help="Google Benchmark JSON files")
    parser.add_argument("--update", metavar="DOC", help="rewrite the marked section of DOC")
    args = parser.parse_args()
    text = render(args.json)
    if not args.update:
        sys.stdout.write(text)
        return 0
    with open(args.update) as f:
        doc = f.read()
    if BEGIN not in doc or END not in doc:
        sys.exit(f"bench_table.py: {args.update} has no '{BEGIN}' ... '{END}' markers")
    before, rest = doc.split(BEGIN, 1)
    _, after = rest.split(END, 1)
    with open(args.update, "w") as f:
        f.write(before + BEGIN + "\n\n" + text + "\n" + END + after)
    return 0


if __name__ == "__main__":
    sys.exit(main())
