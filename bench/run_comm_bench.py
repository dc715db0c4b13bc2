#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
"""Runs the thread communicator's benchmark and its pure-MPI peer in one run, several launches
each (interleaved, so both see the same machine), and writes the medians: an nccl-tests style
table on stdout, the "## Communicators" section of docs/benchmarks.md (replaced in place when
present, appended otherwise; the other sections are left alone) and docs/benchmarks_comm.png.

    bench/run_comm_bench.py --build build-comm [--launches 5] [--participants 2,4,8] [--max 64M]

Launch-to-launch noise on a small shared machine is 2-3x, so every number is the median of the
launches, and every ratio is computed from two medians of the same run.
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run(cmd, env=None):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return [l.split() for l in out.stdout.splitlines() if l and not l.startswith("#")]


def mpirun_prefix(n):
    cmd = ["mpirun", "-np", str(n)]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd.append("--oversubscribe")
    return cmd


def human(b):
    for unit, f in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= f:
            return f"{b // f} {unit}"
    return f"{b} B"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build-comm"), help="CMake build folder")
    ap.add_argument("--launches", type=int, default=5)
    ap.add_argument("--participants", default="2,4,8")
    ap.add_argument("--ops", default="all")
    ap.add_argument("--min", default="8")
    ap.add_argument("--max", default="64M")
    ap.add_argument("--no-mpi", action="store_true")
    ap.add_argument("--no-unpinned", action="store_true", help="skip the 8 B all_reduce on unpinned threads")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs"), help="where benchmarks.md and benchmarks_comm.png go")
    ap.add_argument("--no-docs", action="store_true", help="print only")
    ap.add_argument("--raw", default=None, help="save the raw samples to this JSON file (default: <build>/comm_bench_raw.json)")
    ap.add_argument("--from-raw", default=None, help="skip the runs; rebuild table and docs from a saved JSON file")
    args = ap.parse_args()

    comm_bench = os.path.join(args.build, "bench", "comm_bench")
    mpi_bench = os.path.join(args.build, "bench", "mpi_bench")
    parts = [int(p) for p in args.participants.split(",")]
    common = ["--ops", args.ops, "--min", args.min, "--max", args.max]

    # samples[(impl, op, nominal, n)] = [time_us...]; bytes[(op, nominal, n)] = bytes per rank
    samples = defaultdict(list)
    nbytes = {}
    args.load = os.getloadavg()[0]
    if args.from_raw:
        with open(args.from_raw) as f:
            raw = json.load(f)
        args.load, args.launches, parts = raw["load"], raw["launches"], raw["participants"]
        for k, v in raw["samples"]:
            samples[tuple(k)] = v
        for k, v in raw["bytes"]:
            nbytes[tuple(k)] = v
    unpinned = args.ops in ("all", "all_reduce") or "all_reduce" in args.ops.split(",")
    unpinned = unpinned and args.min.isdigit() and int(args.min) <= 8 and not args.no_unpinned
    for launch in range(0 if args.from_raw else args.launches):
        print(f"launch {launch + 1}/{args.launches}", file=sys.stderr, flush=True)
        for n in parts:
            rows = run([comm_bench, "--participants", str(n)] + common)
            if unpinned:  # the 8 B all_reduce between threads no one pinned (a user's own threads)
                rows += run([comm_bench, "--participants", str(n), "--ops", "all_reduce", "--min", "8", "--max", "8",
                             "--pin", "0"])
            if not args.no_mpi and os.path.exists(mpi_bench):
                rows += run(mpirun_prefix(n) + [mpi_bench] + common)
            for impl, op, nominal, b, nn, iters, t_us, algbw, busbw in rows:
                samples[(impl, op, int(nominal), int(nn))].append(float(t_us))
                nbytes[(op, int(nominal), int(nn))] = int(b)

    if not args.from_raw:
        raw_path = args.raw or os.path.join(args.build, "comm_bench_raw.json")
        with open(raw_path, "w") as f:
            json.dump({"load": args.load, "launches": args.launches, "participants": parts,
                       "samples": [[list(k), v] for k, v in samples.items()],
                       "bytes": [[list(k), v] for k, v in nbytes.items()]}, f)
        print(f"raw samples in {raw_path}", file=sys.stderr)

    ops = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"]
    factor = {"all_reduce": lambda n: 2 * (n - 1) / n, "broadcast": lambda n: 1.0}
    table = []  # (op, nominal, bytes, n, t_thread, algbw_t, busbw_t, t_mpi, algbw_m, ratio)
    for op in ops:
        for n in parts:
            for nominal in sorted({k[2] for k in samples if k[1] == op and k[3] == n}):
                b = nbytes[(op, nominal, n)]
                tt = statistics.median(samples[("thread", op, nominal, n)])
                tm = statistics.median(samples[("mpi", op, nominal, n)]) if samples.get(("mpi", op, nominal, n)) else None
                alg_t = b / tt / 1e3
                bus_t = alg_t * factor.get(op, lambda n: (n - 1) / n)(n)
                alg_m = b / tm / 1e3 if tm else None
                table.append((op, nominal, b, n, tt, alg_t, bus_t, tm, alg_m, (alg_t / alg_m) if tm else None))

    global table_unpinned
    for n in parts:
        tu = samples.get(("thread_unpinned", "all_reduce", 8, n))
        tm = samples.get(("mpi", "all_reduce", 8, n))
        if tu:
            table_unpinned.append((n, statistics.median(tu), statistics.median(tm) if tm else None))
    hdr = f"{'op':<15}{'bytes/rank':>12}{'ranks':>6}{'time us':>11}{'algbw GB/s':>12}{'busbw GB/s':>12}" \
          f"{'MPI us':>11}{'MPI algbw':>11}{'speedup':>9}"
    print(hdr)
    for op, nominal, b, n, tt, at, bt, tm, am, r in table:
        print(f"{op:<15}{b:>12}{n:>6}{tt:>11.2f}{at:>12.3f}{bt:>12.3f}"
              + (f"{tm:>11.2f}{am:>11.3f}{r:>8.2f}x" if tm else ""))

    for n, tu, tm in table_unpinned:
        print(f"{'all_reduce':<15}{8:>12}{n:>6}{tu:>11.2f}  (threads not pinned)" + (f"{tm:>11.2f}  {tu / tm:.2f}x OpenMPI's time" if tm else ""))
    if args.no_docs:
        return
    write_docs(args, table, parts, ops)


table_unpinned = []  # (ranks, median time of the 8 B all_reduce on unpinned threads, OpenMPI's or None)


def targets(table):
    """The issue's targets, each with the measured value; speedup = thread algbw / MPI algbw."""
    t = {(op, nominal, n): (tt, tm, r) for op, nominal, b, n, tt, at, bt, tm, am, r in table}
    out = []

    def lat(n, limit):
        v = t.get(("all_reduce", 8, n))
        if v and v[1]:
            out.append((f"{n} ranks: 8 B all_reduce latency <= {limit}x OpenMPI's",
                        f"{v[0]:.2f} us vs {v[1]:.2f} us = {v[0] / v[1]:.2f}x", v[0] / v[1] <= limit))

    def bw(n, nominal, at_least):
        v = t.get(("all_reduce", nominal, n))
        if v and v[1]:
            out.append((f"{n} ranks: {human(nominal)} all_reduce algbw >= {at_least}x OpenMPI's",
                        f"{v[2]:.2f}x", v[2] >= at_least))

    lat(2, 0.6)
    for n, tu, tm in table_unpinned:
        if n == 2 and tm:
            out.append((f"{n} ranks, unpinned threads (a user's own): 8 B all_reduce latency <= 0.6x OpenMPI's",
                        f"{tu:.2f} us vs {tm:.2f} us = {tu / tm:.2f}x", tu / tm <= 0.6))
    bw(2, 64 << 10, 10)
    bw(2, 16 << 20, 2.5)
    bw(2, 64 << 20, 4.5)
    lat(4, 0.8)
    bw(4, 16 << 20, 3)
    lat(8, 0.6)
    bw(8, 16 << 20, 2.5)
    slower = [(op, n, nominal, r) for (op, nominal, n), (tt, tm, r) in t.items() if tm and nominal >= 64 << 10 and r < 1]
    out.append(("no op, size >= 64 KiB or participant count slower than OpenMPI",
                "none slower" if not slower else
                "; ".join(f"{op} {n} ranks {human(s)}: {r:.2f}x" for op, n, s, r in sorted(slower)), not slower))
    return out


HEADING = "## Communicators: the thread communicator against OpenMPI"


def write_section(path, section):
    """Replaces this script's section of `path` (from HEADING to the next '## '), or appends it."""
    lines = open(path).read().splitlines() if os.path.exists(path) else ["# meshlib benchmarks", ""]
    try:
        start = lines.index(HEADING)
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        lines[start:end] = section
    except ValueError:
        if lines and lines[-1] != "":
            lines.append("")
        lines += section
    with open(path, "w") as f:
        f.write("\n".join(lines).rstrip("\n") + "\n")


def write_docs(args, table, parts, ops):
    os.makedirs(args.out, exist_ok=True)
    png = os.path.join(args.out, "benchmarks_comm.png")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, len(ops), figsize=(5 * len(ops), 4.2), sharey=True)
        for ax, op in zip(axes, ops):
            for n, color in zip(parts, ["tab:blue", "tab:orange", "tab:green", "tab:red"]):
                rows = [r for r in table if r[0] == op and r[3] == n]
                xs = [r[2] for r in rows]
                ax.plot(xs, [r[5] for r in rows], "-o", color=color, ms=3, label=f"thread, {n} ranks")
                if rows and rows[0][8]:
                    ax.plot(xs, [r[8] for r in rows], "--x", color=color, ms=3, label=f"OpenMPI, {n} ranks")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(op)
            ax.set_xlabel("bytes per rank")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel("algbw (GB/s), median of launches")
        axes[-1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(png, dpi=100)
    except ImportError:
        print("matplotlib not found: no plot (run with a Python that has it, e.g. /usr/bin/python3)", file=sys.stderr)
        png = None

    mpi_version = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout.splitlines()
    lines = [HEADING, ""]
    lines.append("Generated by `bench/run_comm_bench.py` (rerun it rather than editing). "
                 f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average "
                 f"{args.load:.1f} when the run started (other builds were running: treat single rows as noisy); "
                 f"{datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC; {args.launches} launches of each program, "
                 f"interleaved, median of each; {mpi_version[0] if mpi_version else 'OpenMPI'}.")
    lines.append("")
    lines.append("Rows are nccl-tests style: `bytes/rank` is the per-rank buffer (all_gather: the gathered "
                 "output; reduce_scatter: the scattered input; all_to_all: the whole send buffer), "
                 "`algbw` = bytes/rank / time, `busbw` = algbw x 2(n-1)/n (all_reduce), (n-1)/n "
                 "(all_gather, reduce_scatter, all_to_all), 1 (broadcast). `speedup` is the thread "
                 "communicator's algbw over OpenMPI's (`mpirun -np N --oversubscribe`, shared memory, "
                 "`MPI_Allreduce`, `MPI_Allgather`, `MPI_Reduce_scatter_block`, `MPI_Alltoall`, `MPI_Bcast`) "
                 "in the same run: above 1, meshlib is faster. float32, sum. Time: in each launch, the "
                 "iterations run in 9 batches; a batch's time is the slowest rank's mean time per call, "
                 "the launch's time the median batch (a preemption by another job spoils a batch, not "
                 "the row), and the table's time the median over launches. Threads are pinned to cores "
                 "when every rank has one (`thread_comm_options::pin_threads`), as OpenMPI binds its "
                 "ranks by default; oversubscribed, neither binds.")
    lines.append("")
    lines.append("Note: `MPI_Bcast` of a few bytes returns on the root before the others have the data "
                 "(eager send), while the thread communicator's broadcast synchronises every rank "
                 "(mismatch detection needs every rank's call), so small broadcasts compare different things.")
    lines.append("")
    lines.append("### Targets")
    lines.append("")
    lines.append("| target | measured | met |")
    lines.append("| --- | --- | --- |")
    for what, measured, ok in targets(table):
        lines.append(f"| {what} | {measured} | {'yes' if ok else '**no**'} |")
    lines.append("")
    if png:
        lines.append(f"![algbw per operation]({os.path.basename(png)})")
        lines.append("")
    if table_unpinned:
        lines.append("### all_reduce between a user's own threads (not pinned)")
        lines.append("")
        lines.append("The 8 B all_reduce with `--pin 0`: threads that no one binds, where the scheduler puts them "
                     "(two of them may share a core for a while), against OpenMPI's bound ranks. Waiters spin for "
                     "at most 50 us, then block; one whose peer last ran on its own CPU yields to it instead of "
                     "spinning (docs/benchmarks.md, \"Waiting and the large all_reduce\").")
        lines.append("")
        lines.append("| ranks | time (us) | OpenMPI time (us) | time / OpenMPI's |")
        lines.append("| ---: | ---: | ---: | ---: |")
        for n, tu, tm in table_unpinned:
            lines.append(f"| {n} | {tu:.2f} | " + (f"{tm:.2f} | {tu / tm:.2f}x |" if tm else "- | - |"))
        lines.append("")
    # Every operation's full table goes to its own page, benchmarks_comm.md (written whole), so that
    # benchmarks.md stays a page a user reads; the section there links to it.
    full = ["# meshlib benchmarks: every collective's table", "",
            "Generated by `bench/run_comm_bench.py` with the section \"" + HEADING[3:] + "\" of "
            "[benchmarks.md](benchmarks.md), which says how the rows are measured.", ""]
    for op in ops:
        full.append(f"## {op}")
        full.append("")
        full.append("| bytes/rank | ranks | time (us) | algbw (GB/s) | busbw (GB/s) | OpenMPI time (us) | OpenMPI algbw | speedup |")
        full.append("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for o, nominal, b, n, tt, at, bt, tm, am, r in table:
            if o != op:
                continue
            mpi = f"{tm:.2f} | {am:.3f} | {r:.2f}x" if tm else "- | - | -"
            full.append(f"| {human(b)} | {n} | {tt:.2f} | {at:.3f} | {bt:.3f} | {mpi} |")
        full.append("")
    lines.append("Every operation's table (" + ", ".join(ops) + ", each size and rank count): "
                 "[benchmarks_comm.md](benchmarks_comm.md).")
    lines.append("")
    path = os.path.join(args.out, "benchmarks.md")
    write_section(path, lines)
    full_path = os.path.join(args.out, "benchmarks_comm.md")
    with open(full_path, "w") as f:
        f.write("\n".join(full).rstrip("\n") + "\n")
    print(f"wrote the comm section of {path}, {full_path}" + (f" and {png}" if png else ""), file=sys.stderr)


if __name__ == "__main__":
    main()
