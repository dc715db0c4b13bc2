#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
"""CTest bench_gpu_peers_table: gpu_peers.py --table on logs written as the flagships print them
(train_fashion_mnist's epoch lines after a progress line ending in a carriage return,
train_gpt_chars's progress lines) and as gpu_peers.py writes its runs (a result, a skipped
framework, an error): meshlib's MLP rate is the samples of epochs 2 and later over their seconds,
the GPT's the last progress line's, each ratio meshlib's rate over the run's. No GPU, JAX or
PyTorch needed."""
import contextlib
import io
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_peers  # noqa: E402

with tempfile.TemporaryDirectory() as d:
    mlp, gpt, peers = (os.path.join(d, n) for n in ("mlp.log", "gpt.log", "peers.log"))
    with open(mlp, "w") as f:
        f.write("  epoch 1  [ 20%] step 47/234  loss 0.9000  1000 samples/s"
                "\r  epoch 1: loss 0.6000  train acc 78.00%  test loss 0.5000  test acc 82.00%  50000 samples/s  1.2 s (sync 0%)\n"
                "\r  epoch 2: loss 0.4000  train acc 85.00%  test loss 0.4000  test acc 85.00%  100000 samples/s  0.6 s (sync 0%)\n"
                "\r  epoch 3: loss 0.4000  train acc 85.00%  test loss 0.4000  test acc 85.00%  50000 samples/s  1.2 s (sync 0%)\n")
    with open(gpt, "w") as f:
        f.write("\r  step 25/300  loss 3.1000  lr 1.00e-03  5000 tokens/s (sync 0%)  [1 s]"
                "\r  step 300/300  loss 2.1000  lr 3.00e-04  20000 tokens/s (sync 0%)  [10 s]\n")
    with open(peers, "w") as f:
        f.write('{"samples_per_s": 200000.0, "device": "cuda:0", "framework": "jax", "model": "mlp", '
                '"first_losses": [2.3], "last_loss": 0.31, "seconds": 3.0}\n'
                '{"framework": "torch-compile", "model": "mlp", "skipped": "PyTorch 1.13.1 has no torch.compile"}\n'
                '{"framework": "jax", "model": "gpt", "error": "RuntimeError: out of memory"}\n'
                '{"tokens_per_s": 40000.0, "device": "cuda:0", "framework": "torch", "model": "gpt", '
                '"first_losses": [5.5], "last_loss": 2.0, "seconds": 5.0}\n')
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = gpu_peers.main(["--table", peers, "--meshlib-mlp", mlp, "--meshlib-gpt", gpt])
    want = """| model | run | throughput | meshlib / run | last loss |
| --- | --- | --- | --- | --- |
| mlp | meshlib --gpu, mesh 1x1 | 66,667 samples/s (epochs 2-6) | 1.00 | |
| mlp | jax (cuda:0) | 200,000 samples/s (epochs 2-6) | 0.33 | 0.31 |
| mlp | torch-compile | PyTorch 1.13.1 has no torch.compile | | |
| gpt | meshlib --gpu, mesh 1x1 | 20,000 tokens/s | 1.00 | |
| gpt | jax | RuntimeError: out of memory | | |
| gpt | torch (cuda:0) | 40,000 tokens/s | 0.50 | 2.0 |
"""
    if status != 0 or out.getvalue() != want:
        print("FAILED: gpu_peers.py --table printed\n" + out.getvalue() + "instead of\n" + want)
        sys.exit(1)
    # The learning rate the peers use is meshlib's warmup_cosine (nn/schedule.hpp): peak (step + 1) /
    # warmup over the warm-up, then a cosine to final_fraction * peak at total.
    checks = [(0, 0.01), (49, 0.5), (99, 1.0), (100, 1.0), (550, 0.51), (1000, 0.02), (2000, 0.02)]
    for step, want_lr in checks:
        got = gpu_peers.lr_at(step, 1.0, 100, 1000, 0.02)
        if abs(got - want_lr) > 1e-12:
            print(f"FAILED: lr_at({step}) = {got}, want {want_lr}")
            sys.exit(1)
print("gpu_peers.py: table and schedule OK")
