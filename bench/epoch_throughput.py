#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
"""The whole epoch as a user runs it (issue 23, item 6): the MLP flagship's own printed epoch
throughput (data loading included, evaluation excluded) against the hand-written cblas_sgemm trainer
of the same model (bench/handwritten_mlp), interleaved, same OpenBLAS kernels on both sides.

  cmake --build build --target train_fashion_mnist handwritten_mlp
  python3 bench/epoch_throughput.py [--build build] [--reps 3] [--epochs 2]

Pairs: flagship --mesh 2x1 (2 thread devices) against the hand-written trainer on 2 BLAS threads,
and --mesh 1x1 against 1 thread. Prints a Markdown table of medians and the ratios.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys


def flagship(build, mesh, epochs):
    out = subprocess.run([f"{build}/examples/train_fashion_mnist/train_fashion_mnist", "--mesh", mesh,
                          "--epochs", str(epochs)], check=True, capture_output=True, text=True).stdout
    # "epoch 2: loss ... test acc 87.44%  14799 samples/s  4.0 s (sync 6%)": the epoch's samples/s.
    rates = [float(m) for m in re.findall(r"epoch \d+: .*?(\d+) samples/s", out)]
    if len(rates) != epochs:
        sys.exit(f"could not read the flagship's epoch lines:\n{out}")
    return statistics.mean(rates)


def handwritten(build, threads, epochs):
    out = subprocess.run([f"{build}/bench/handwritten_mlp", "--epochs", str(epochs), "--threads", str(threads)],
                         check=True, capture_output=True, text=True).stdout
    m = re.search(r"summary: .*?(\d+) samples/s", out)
    if not m:
        sys.exit(f"could not read the hand-written trainer's summary:\n{out}")
    return float(m.group(1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=2)
    a = ap.parse_args()
    print(f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}, load before: "
          f"{os.getloadavg()[0]:.2f}")
    results = {k: [] for k in ("f21", "h2", "f11", "h1")}
    for rep in range(a.reps):
        results["f21"].append(flagship(a.build, "2x1", a.epochs))
        results["h2"].append(handwritten(a.build, 2, a.epochs))
        results["f11"].append(flagship(a.build, "1x1", a.epochs))
        results["h1"].append(handwritten(a.build, 1, a.epochs))
        print(f"rep {rep + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in results.items()), flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    print()
    print("| pair | flagship samples/s | hand-written samples/s | ratio (each rep) | median ratio |")
    print("| --- | ---: | ---: | --- | ---: |")
    for name, f, h in (("--mesh 2x1 vs 2 BLAS threads", "f21", "h2"), ("--mesh 1x1 vs 1 BLAS thread", "f11", "h1")):
        ratios = [x / y for x, y in zip(results[f], results[h])]
        print(f"| {name} | {med[f]:.0f} | {med[h]:.0f} | {' '.join(f'{r:.2f}' for r in ratios)} | "
              f"**{statistics.median(ratios):.2f}x** |")
    print(f"\n(2,1) over (1,1): {med['f21'] / med['f11']:.2f}x; load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
