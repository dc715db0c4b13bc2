#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
"""How training scales with cores (issue 39, item 4), in one call and one table.

For k = 1, 2, 4, 8, ... up to the cores this process may run on (and that count itself when it is
not a power of two), every program below runs pinned to the first k of them (taskset):

  - the hand-written peer (bench/handwritten_mlp: one cblas_sgemm per product on k OpenBLAS threads,
    Adam on k threads, no framework), MLP 784-1024-1024-10, Adam, batch 256;
  - meshlib's MLP flagship (train_fashion_mnist) on the same model and batch at up to three shapes
    that use all k cores: --mesh kx1 with one BLAS thread per device, --mesh 1x1 with k threads, and
    one in between (--mesh dx1 with k/d threads; data axes are powers of two, so that they divide
    the batch); the best is kept;
  - the GPT flagship (train_gpt_chars) and the ResNet flagship (train_resnet_fashion_mnist) at
    --mesh kx1, one thread each, their batch the same at every k (a multiple of the largest k).

Every rate is the program's own: the samples/s of the peer's training steps, the flagships' epoch
samples/s (data loading included), GPT's tokens/s over its steps. Each run is short (tens of steps;
the first, with its allocations, included) and runs once: the table shows how the rates scale, not
a rate to three digits. Scaling efficiency is the rate at k cores / (k x the rate at 1 core).

  cmake --build build --target handwritten_mlp train_fashion_mnist train_resnet_fashion_mnist train_gpt_chars
  python3 bench/scaling.py [--build build] [--max-cores N] [--quick] [--data DIR] [--text PATH]
                           [--timeout S] [--budget S]

--build is a build folder (the programs under bench/ and examples/...) or a folder that holds them
all by name (scripts/gpu-check.sh's bundle). --quick: tiny models and a few steps (the ctest
bench_scaling_quick), numbers that say nothing about speed. Prints the table last, in Markdown.
Bad options: a message and exit status 2; a program that fails: its output's tail and status 1.
Budget: 3 minutes (--budget 180), meant to be enough for 16 cores (5 core counts); a run that would
pass it is stopped, the table shows the core counts measured, and the exit status is 1.
"""
import argparse
import math
import os
import re
import shutil
import subprocess
import sys
import time

PROGRAMS = {
    "peer": "bench/handwritten_mlp",
    "mlp": "examples/train_fashion_mnist/train_fashion_mnist",
    "gpt": "examples/train_gpt_chars/train_gpt_chars",
    "resnet": "examples/train_resnet_fashion_mnist/train_resnet_fashion_mnist",
}


class UsageError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    """argparse with the benchmarks' error form (bench/bench_options.hpp): "scaling.py: <what is
    wrong>" first on stderr, then the usage, exit status 2."""

    def error(self, message):
        print(f"{self.prog}: {message}", file=sys.stderr)
        self.print_usage(sys.stderr)
        sys.exit(2)


class RunError(Exception):
    pass


def parse_args(argv):
    ap = Parser(
        prog="scaling.py",
        description="Training throughput at 1, 2, 4, ... cores: the hand-written MLP peer against meshlib's "
                    "best shape, and the GPT and ResNet flagships' scaling efficiency.")
    ap.add_argument("--build", default="build", help="build folder, or a folder with the four programs (default build)")
    ap.add_argument("--max-cores", type=int, default=None,
                    help="largest core count (default: every core this process may run on)")
    ap.add_argument("--quick", action="store_true", help="tiny models, a few steps: a check that it runs, not a measurement")
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist", help="Fashion-MNIST folder")
    ap.add_argument("--text", default="/usr/share/games/fortunes", help="the GPT flagship's text (file or folder)")
    ap.add_argument("--timeout", type=int, default=120, help="seconds one run may take (default 120)")
    ap.add_argument("--budget", type=int, default=180,
                    help="seconds for the whole benchmark (default 180): a run that would pass it is stopped, and "
                         "the table shows the core counts measured by then")
    a = ap.parse_args(argv)  # argparse: a bad option is a message and status 2

    cpus = sorted(os.sched_getaffinity(0))
    if a.max_cores is None:
        a.max_cores = len(cpus)
    if a.max_cores < 1:
        raise UsageError(f"--max-cores {a.max_cores}: wants a positive integer")
    if a.max_cores > len(cpus):
        raise UsageError(f"--max-cores {a.max_cores}: this process may run on {len(cpus)} cores only "
                         f"(CPUs {','.join(map(str, cpus))}); use at most {len(cpus)}")
    if a.timeout < 1:
        raise UsageError(f"--timeout {a.timeout}: wants a positive number of seconds")
    if a.budget < 1:
        raise UsageError(f"--budget {a.budget}: wants a positive number of seconds")
    a.cpus = cpus[:a.max_cores]
    a.programs = {}
    for name, path in PROGRAMS.items():
        for p in (os.path.join(a.build, path), os.path.join(a.build, os.path.basename(path))):
            if os.access(p, os.X_OK):
                a.programs[name] = p
                break
        else:
            raise UsageError(f"--build {a.build}: no {os.path.basename(path)} there (nor {path}); build it with "
                             f"cmake --build {a.build} --target {os.path.basename(path)}")
    if not os.path.isdir(a.data):
        raise UsageError(f"--data {a.data}: no such folder (Debian's package dataset-fashion-mnist installs it)")
    if not os.path.exists(a.text):
        raise UsageError(f"--text {a.text}: no such file or folder (Debian's package fortunes provides one)")
    if shutil.which("taskset") is None:
        raise UsageError("taskset not found (util-linux): the runs are pinned to k cores with it")
    return a


def core_counts(n):
    """1, 2, 4, ... up to n, and n itself."""
    ks = [1 << i for i in range(n.bit_length()) if (1 << i) <= n]
    return ks if ks[-1] == n else ks + [n]


def mlp_shapes(k):
    """(data devices, threads per device) to try at k cores, every core used: the most data devices,
    one, and one count in between, each a power of two dividing k (and so the batch of 256):
    (k, 1), (1, k), (sqrt k, sqrt k) for k a power of four; (4, 3), (1, 12), (2, 6) for 12."""
    ds = [d for d in (1 << i for i in range(k.bit_length())) if k % d == 0]
    picks = [ds[-1], ds[0], ds[len(ds) // 2]]
    return [(d, k // d) for d in dict.fromkeys(picks)]  # k = 1: one shape


def common_batch(ks, base):
    """The smallest multiple of every k that is at least `base`: one batch for the whole column."""
    m = 1
    for k in ks:
        m = m * k // math.gcd(m, k)
    return m * -(-base // m)


def run(args, cmd, cores, pattern, what):
    """Runs `cmd` pinned to the first `cores` CPUs; the last match of `pattern` in its output, a number."""
    pinned = ["taskset", "-c", ",".join(map(str, args.cpus[:cores]))] + cmd
    left = args.deadline - time.monotonic()
    if left < 1:
        raise RunError(f"the budget of {args.budget} s is spent (--budget) before {what}")
    limit = min(args.timeout, left)
    try:
        p = subprocess.run(pinned, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        cause = "the budget (--budget) is spent" if limit < args.timeout else f"timed out after {args.timeout} s"
        raise RunError(f"{what}: {cause}: {' '.join(pinned)}")
    out = p.stdout.replace("\r", "\n")
    found = re.findall(pattern, out)
    if p.returncode != 0 or not found:
        tail = "\n".join((out + p.stderr).strip().splitlines()[-8:])
        raise RunError(f"{what}: exit status {p.returncode}, {'no' if not found else 'a'} rate in its output: "
                       f"{' '.join(pinned)}\n{tail}")
    return float(found[-1])


def measure(args, k, batches):
    """One row: the rates at k cores."""
    q = args.quick
    hidden = "128" if q else "1024"
    mlp_steps = "4" if q else "30"
    row = {}
    row["peer"] = run(args, [args.programs["peer"], "--epochs", "1", "--steps", mlp_steps, "--hidden", hidden,
                             "--threads", str(k), "--elementwise-threads", str(k), "--no-floor", "--data", args.data],
                      k, r"summary: .*? (\d+) samples/s", f"handwritten_mlp on {k} cores")
    best = None
    for d, t in mlp_shapes(k):
        rate = run(args, [args.programs["mlp"], "--mesh", f"{d}x1", "--threads-per-device", str(t), "--epochs", "1",
                          "--steps", mlp_steps, "--hidden", hidden, "--data", args.data],
                   k, r"epoch 1: .*? (\d+) samples/s", f"train_fashion_mnist --mesh {d}x1 --threads-per-device {t}")
        if best is None or rate > best[1]:
            best = (f"{d}x1, {t} thread{'s' if t > 1 else ''}", rate)
    row["mlp_shape"], row["mlp"] = best
    gpt_model = ["--width", "32", "--heads", "2", "--layers", "1", "--context", "16"] if q else []
    row["gpt"] = run(args, [args.programs["gpt"], "--mesh", f"{k}x1", "--threads-per-device", "1",
                            "--steps", "3" if q else "20", "--batch", str(batches["gpt"]), "--eval-every", "1000000",
                            "--final-windows", "1", "--generate", "0", "--data", args.text] + gpt_model,
                     k, r"(\d+) tokens/s", f"train_gpt_chars --mesh {k}x1")
    resnet_model = ["--width", "4"] if q else []
    row["resnet"] = run(args, [args.programs["resnet"], "--mesh", f"{k}x1", "--threads-per-device", "1", "--epochs", "1",
                               "--steps", "3" if q else "20", "--batch", str(batches["resnet"]), "--data", args.data]
                        + resnet_model, k, r"epoch 1: .*? (\d+) samples/s", f"train_resnet_fashion_mnist --mesh {k}x1")
    return row


def table(rows):
    one = rows[0][1]
    lines = ["| cores | peer samples/s | meshlib best shape | meshlib samples/s | meshlib / peer | GPT tokens/s | "
             "GPT efficiency | ResNet images/s | ResNet efficiency |",
             "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for k, r in rows:
        lines.append(f"| {k} | {r['peer']:.0f} | {r['mlp_shape']} | {r['mlp']:.0f} | {r['mlp'] / r['peer']:.2f} | "
                     f"{r['gpt']:.0f} | {r['gpt'] / (k * one['gpt']):.2f} | {r['resnet']:.0f} | "
                     f"{r['resnet'] / (k * one['resnet']):.2f} |")
    return "\n".join(lines)


def main(argv):
    try:
        args = parse_args(argv)
    except UsageError as e:
        print(f"scaling.py: {e}", file=sys.stderr)
        return 2
    ks = core_counts(args.max_cores)
    # One batch for every k, so that k divides it and the work per step is the same along a column.
    batches = {"gpt": common_batch(ks, 16), "resnet": common_batch(ks, 32 if args.quick else 128)}
    start = time.monotonic()
    args.deadline = start + args.budget
    print(f"scaling.py: core counts {', '.join(map(str, ks))} on CPUs {','.join(map(str, args.cpus))}; "
          f"load average {os.getloadavg()[0]:.1f}{'; --quick: tiny models, not a measurement' if args.quick else ''}",
          flush=True)
    print(f"  MLP 784-{'128' if args.quick else '1024'}x2-10, Adam, batch 256; GPT and ResNet at --mesh kx1 "
          f"(batch {batches['gpt']} windows, {batches['resnet']} images)", flush=True)
    rows = []
    try:
        for k in ks:
            rows.append((k, measure(args, k, batches)))
            print(f"  {k} core{'s' if k > 1 else ''} done after {time.monotonic() - start:.0f} s", flush=True)
    except RunError as e:
        print(f"scaling.py: {e}", file=sys.stderr)
        if rows:  # what was measured is still worth its table
            print(f"\nthe core counts measured before the failure above:\n\n{table(rows)}")
        return 1
    print()
    print(table(rows))
    print(f"\n{time.monotonic() - start:.0f} s in all; load average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
