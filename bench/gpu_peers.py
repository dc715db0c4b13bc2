#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
"""The peers of meshlib's GPU benchmark (issue 38 item 5): the two flagships' models trained with JAX
(`jit`, donated state) and PyTorch (eager, and `torch.compile` where PyTorch has it) on one GPU,
written as a user of each framework would, with the flagships' hyperparameters:

  mlp  train_fashion_mnist's model: 784-1024-1024-10, ReLU, Adam with meshlib's warm-up of
       min(100, total / 10) steps and a cosine decay to 2% at the last step, batch 256, float32,
       Fashion-MNIST (60,000 images scaled to [0, 1], reshuffled each epoch) already on the GPU.
       Timed: epochs 2 to N (samples/s), the first one compiling and warming up.
  gpt  train_gpt_chars's default model: bytes (vocabulary 256), width 128, 4 pre-norm blocks of 4
       heads and an MLP of 512 (tanh GELU), learned positions, a tied head, context 64, batch 16
       windows, AdamW (b1 0.9, b2 0.99, weight decay 0.01 on matrices) after clipping to a global
       norm of 1, warm-up over steps / 20 and cosine decay to 10%. Timed: the steps after 20
       (tokens/s).

Each run prints one JSON line: {"framework", "model", "device", "samples_per_s" or "tokens_per_s",
"first_losses" (the first 10), "last_loss", "seconds"}. scripts/gpu-check.sh runs it beside the
flagships in one call and prints the ratios. A framework that is not installed is reported as
{"framework": ..., "skipped": "<why>"}, not an error.

  gpu_peers.py --framework jax,torch,torch-compile --model mlp,gpt --data DIR --text DIR
  gpu_peers.py --table PEERS_LOG --meshlib-mlp LOG --meshlib-gpt LOG     (the table, with the ratios)
"""

import argparse
import gzip
import json
import math
import os
import sys
import time

# The benchmarks' option errors ("gpu_peers.py: <what is wrong>", the usage, status 2): scaling.py's
# parser, which sits beside this file in bench/ and in the GPU bundle.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scaling import Parser  # noqa: E402


def load_idx(path):
    import numpy as np
    with gzip.open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def fashion_mnist(directory):
    x = load_idx(os.path.join(directory, "train-images-idx3-ubyte.gz")).reshape(-1, 784).astype("float32") / 255.0
    y = load_idx(os.path.join(directory, "train-labels-idx1-ubyte.gz")).astype("int32")
    return x, y


def text_bytes(directory, limit=4 << 20):
    """The fortunes files as one byte string (as train_gpt_chars reads them: every regular file)."""
    out = bytearray()
    for root, _, files in sorted(os.walk(directory)):
        for name in sorted(files):
            path = os.path.join(root, name)
            if name.endswith((".dat", ".u8")) or os.path.islink(path):
                continue
            with open(path, "rb") as f:
                out += f.read()
            if len(out) >= limit:
                return bytes(out[:limit])
    return bytes(out)


def lr_at(step, peak, warmup, total, final_fraction):
    """meshlib's warmup_cosine (nn/schedule.hpp), step counted from 0: peak (step + 1) / warmup during
    the warm-up (optax's warmup_cosine_decay_schedule starts at 0 instead), then a cosine to
    peak * final_fraction at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (min(step, total) - warmup) / max(1, total - warmup)
    return peak * (final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * t)))


def jax_schedule(peak, warmup, total, final_fraction):
    """`lr_at` as an optax schedule (a function of the update count, traced by jit)."""
    import jax.numpy as jnp

    def schedule(count):
        t = jnp.clip((count - warmup) / max(1, total - warmup), 0.0, 1.0)
        cosine = peak * (final_fraction + (1 - final_fraction) * 0.5 * (1 + jnp.cos(jnp.pi * t)))
        return jnp.where(count < warmup, peak * (count + 1) / warmup, cosine)

    return schedule


# ---- JAX ------------------------------------------------------------------------------------------

def jax_mlp(x_host, y_host, epochs, batch, seed):
    import jax
    import jax.numpy as jnp
    import optax
    steps = x_host.shape[0] // batch
    total = steps * epochs
    opt = optax.adam(jax_schedule(1e-3, min(100, total // 10), total, 0.02))
    key = jax.random.PRNGKey(seed)
    sizes = [784, 1024, 1024, 10]
    params = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        k = jax.random.fold_in(key, i)
        params.append((jax.random.uniform(k, (a, b), jnp.float32, -1, 1) * math.sqrt(6 / (a + b)), jnp.zeros(b)))
    state = opt.init(params)

    def loss_fn(p, x, y):
        h = x
        for i, (w, b) in enumerate(p):
            h = h @ w + b
            if i + 1 < len(p):
                h = jax.nn.relu(h)
        return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()

    def step(p, s, xs, ys, i):
        x = jax.lax.dynamic_slice_in_dim(xs, i * batch, batch)
        y = jax.lax.dynamic_slice_in_dim(ys, i * batch, batch)
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    step = jax.jit(step, donate_argnums=(0, 1))
    x = jax.device_put(x_host)
    y = jax.device_put(y_host)
    def permute(x, y, k):
        p = jax.random.permutation(k, x.shape[0])
        return x[p], y[p]

    permute = jax.jit(permute)
    losses, timed, t_start = [], 0.0, 0.0
    for epoch in range(epochs):
        xs, ys = permute(x, y, jax.random.fold_in(key, 1000 + epoch))
        xs.block_until_ready()
        t0 = time.perf_counter()
        epoch_losses = []
        for i in range(steps):
            params, state, loss = step(params, state, xs, ys, i)
            epoch_losses.append(loss)
        jax.block_until_ready(params)
        if epoch > 0:
            timed += time.perf_counter() - t0
        losses += [float(v) for v in jnp.stack(epoch_losses)]
    return {"samples_per_s": steps * batch * (epochs - 1) / timed if epochs > 1 else None, "losses": losses,
            "device": str(jax.devices()[0])}


def gpt_config():
    return {"vocab": 256, "width": 128, "layers": 4, "heads": 4, "hidden": 512, "context": 64, "batch": 16}


def windows(text, steps, cfg, seed):
    import numpy as np
    rng = np.random.default_rng(seed)
    data = np.frombuffer(text, dtype=np.uint8)
    starts = rng.integers(0, len(data) - cfg["context"] - 1, size=(steps, cfg["batch"]))
    idx = starts[..., None] + np.arange(cfg["context"] + 1)
    w = data[idx].astype("int32")
    return w[..., :-1], w[..., 1:]


def jax_gpt(text, steps, seed, warm=20):
    import jax
    import jax.numpy as jnp
    import optax
    c = gpt_config()
    d, hd = c["width"], c["width"] // c["heads"]
    key = jax.random.PRNGKey(seed)
    keys = iter(jax.random.split(key, 64))
    normal = lambda shape: 0.02 * jax.random.normal(next(keys), shape, jnp.float32)  # noqa: E731
    params = {"tok": normal((c["vocab"], d)), "pos": normal((c["context"], d)),
              "ln_f": (jnp.ones(d), jnp.zeros(d)), "blocks": []}
    for _ in range(c["layers"]):
        params["blocks"].append({"ln1": (jnp.ones(d), jnp.zeros(d)), "qkv": (normal((d, 3 * d)), jnp.zeros(3 * d)),
                                 "out": (normal((d, d)), jnp.zeros(d)), "ln2": (jnp.ones(d), jnp.zeros(d)),
                                 "fc1": (normal((d, c["hidden"])), jnp.zeros(c["hidden"])),
                                 "fc2": (normal((c["hidden"], d)), jnp.zeros(d))})

    def norm(x, p):
        m = x.mean(-1, keepdims=True)
        v = ((x - m) ** 2).mean(-1, keepdims=True)
        return (x - m) / jnp.sqrt(v + 1e-5) * p[0] + p[1]

    mask = jnp.tril(jnp.ones((c["context"], c["context"]), bool))

    def forward(p, ids):
        b, t = ids.shape
        h = p["tok"][ids] + p["pos"][:t]
        for blk in p["blocks"]:
            q, k, v = jnp.split(norm(h, blk["ln1"]) @ blk["qkv"][0] + blk["qkv"][1], 3, axis=-1)
            q, k, v = (z.reshape(b, t, c["heads"], hd).transpose(0, 2, 1, 3) for z in (q, k, v))
            s = jnp.where(mask[:t, :t], q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd), -jnp.inf)
            o = (jax.nn.softmax(s, -1) @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
            h = h + o @ blk["out"][0] + blk["out"][1]
            m = jax.nn.gelu(norm(h, blk["ln2"]) @ blk["fc1"][0] + blk["fc1"][1], approximate=True)
            h = h + m @ blk["fc2"][0] + blk["fc2"][1]
        return norm(h, p["ln_f"]) @ p["tok"].T

    def loss_fn(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(forward(p, x), y).mean()

    sched = jax_schedule(3e-3, max(1, steps // 20), steps, 0.1)
    decay = jax.tree_util.tree_map(lambda a: a.ndim >= 2, params)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, b1=0.9, b2=0.99, weight_decay=0.01, mask=decay))
    state = opt.init(params)

    def step(p, s, xs, ys, i):
        x = jax.lax.dynamic_index_in_dim(xs, i, keepdims=False)
        y = jax.lax.dynamic_index_in_dim(ys, i, keepdims=False)
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    step = jax.jit(step, donate_argnums=(0, 1))
    xs, ys = windows(text, steps, c, seed)
    xs, ys = jax.device_put(xs), jax.device_put(ys)
    losses = []
    t0 = None
    for i in range(steps):
        if i == warm:
            jax.block_until_ready(params)
            t0 = time.perf_counter()
        params, state, loss = step(params, state, xs, ys, i)
        losses.append(loss)
    jax.block_until_ready(params)
    dt = time.perf_counter() - t0
    return {"tokens_per_s": (steps - warm) * c["batch"] * c["context"] / dt, "losses": [float(v) for v in losses],
            "device": str(jax.devices()[0])}


# ---- PyTorch --------------------------------------------------------------------------------------

def torch_device(torch):
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def torch_sync(torch, dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def torch_mlp(x_host, y_host, epochs, batch, seed, compiled):
    import torch
    dev = torch_device(torch)
    torch.manual_seed(seed)
    steps = x_host.shape[0] // batch
    total = steps * epochs
    warmup = min(100, total // 10)
    model = torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                torch.nn.ReLU(), torch.nn.Linear(1024, 10)).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, 1.0, warmup, total, 0.02))
    forward = torch.compile(model) if compiled else model
    x = torch.from_numpy(x_host).to(dev)
    y = torch.from_numpy(y_host.astype("int64")).to(dev)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    losses, timed = [], 0.0
    for epoch in range(epochs):
        perm = torch.randperm(x.shape[0], generator=gen).to(dev)
        xs, ys = x[perm], y[perm]
        torch_sync(torch, dev)
        t0 = time.perf_counter()
        epoch_losses = []
        for i in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(forward(xs[i * batch:(i + 1) * batch]), ys[i * batch:(i + 1) * batch])
            loss.backward()
            opt.step()
            sched.step()
            epoch_losses.append(loss.detach())
        torch_sync(torch, dev)
        if epoch > 0:
            timed += time.perf_counter() - t0
        losses += torch.stack(epoch_losses).tolist()
    return {"samples_per_s": steps * batch * (epochs - 1) / timed if epochs > 1 else None, "losses": losses,
            "device": str(dev)}


def torch_gpt(text, steps, seed, compiled, warm=20):
    import torch
    import torch.nn.functional as F
    dev = torch_device(torch)
    torch.manual_seed(seed)
    c = gpt_config()
    d = c["width"]

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
            self.qkv, self.out = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
            self.fc1, self.fc2 = torch.nn.Linear(d, c["hidden"]), torch.nn.Linear(c["hidden"], d)

        def forward(self, h):
            b, t, _ = h.shape
            q, k, v = self.qkv(self.ln1(h)).split(d, dim=-1)
            q, k, v = (z.view(b, t, c["heads"], d // c["heads"]).transpose(1, 2) for z in (q, k, v))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True) if hasattr(F, "scaled_dot_product_attention") \
                else torch.softmax((q @ k.transpose(-1, -2) / math.sqrt(d // c["heads"])).masked_fill(
                    torch.ones(t, t, dtype=torch.bool, device=h.device).triu(1), float("-inf")), -1) @ v
            h = h + self.out(o.transpose(1, 2).reshape(b, t, d))
            return h + self.fc2(F.gelu(self.fc1(self.ln2(h)), approximate="tanh"))

    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = torch.nn.Embedding(c["vocab"], d)
            torch.nn.init.normal_(self.tok.weight, std=0.02)  # GPT-2's: the tied head's logits start near 0
            self.pos = torch.nn.Parameter(0.02 * torch.randn(c["context"], d))
            self.blocks = torch.nn.ModuleList(Block() for _ in range(c["layers"]))
            self.ln_f = torch.nn.LayerNorm(d)

        def forward(self, ids):
            h = self.tok(ids) + self.pos[:ids.shape[1]]
            for blk in self.blocks:
                h = blk(h)
            return self.ln_f(h) @ self.tok.weight.T

    model = GPT().to(dev)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, 1.0, max(1, steps // 20), steps, 0.1))
    forward = torch.compile(model) if compiled else model
    xs, ys = windows(text, steps, c, seed)
    xs, ys = torch.from_numpy(xs.astype("int64")).to(dev), torch.from_numpy(ys.astype("int64")).to(dev)
    losses = []
    t0 = None
    for i in range(steps):
        if i == warm:
            torch_sync(torch, dev)
            t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(forward(xs[i]).reshape(-1, c["vocab"]), ys[i].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.detach())
    torch_sync(torch, dev)
    dt = time.perf_counter() - t0
    return {"tokens_per_s": (steps - warm) * c["batch"] * c["context"] / dt, "losses": torch.stack(losses).tolist(),
            "device": str(dev)}


# ---- driver ---------------------------------------------------------------------------------------

def available(framework):
    """None when `framework` can run here, else why not."""
    try:
        if framework == "jax":
            import jax  # noqa: F401
            import optax  # noqa: F401
        else:
            import numpy  # noqa: F401
            import torch
            if framework == "torch-compile" and not hasattr(torch, "compile"):
                return f"PyTorch {torch.__version__} has no torch.compile"
        return None
    except ImportError as e:
        return f"{framework} is not installed ({e})"


def meshlib_mlp_rate(log):
    """Samples/s of epochs 2 and later from train_fashion_mnist's epoch lines (`... N samples/s  T s`)."""
    import re
    samples = seconds = 0.0
    for line in open(log, errors="replace").read().replace("\r", "\n").splitlines():
        m = re.match(r"\s*epoch (\d+): .* ([0-9.]+) samples/s\s+([0-9.]+) s", line)
        if m and int(m.group(1)) >= 2:
            samples += float(m.group(2)) * float(m.group(3))
            seconds += float(m.group(3))
    return samples / seconds if seconds > 0 else None


def meshlib_gpt_rate(log):
    """Tokens/s of train_gpt_chars's last progress line (all its steps since the start)."""
    import re
    rates = re.findall(r"([0-9.]+) tokens/s", open(log, errors="replace").read())
    return float(rates[-1]) if rates else None


def table(peers_log, mlp_log, gpt_log):
    """The benchmark's table: each run's throughput and meshlib's ratio to it."""
    ours = {"mlp": meshlib_mlp_rate(mlp_log) if mlp_log and os.path.exists(mlp_log) else None,
            "gpt": meshlib_gpt_rate(gpt_log) if gpt_log and os.path.exists(gpt_log) else None}
    unit = {"mlp": "samples/s (epochs 2-6)", "gpt": "tokens/s"}
    rows = [json.loads(line) for line in open(peers_log) if line.startswith("{")] if os.path.exists(peers_log) else []
    print("| model | run | throughput | meshlib / run | last loss |")
    print("| --- | --- | --- | --- | --- |")
    for model in ("mlp", "gpt"):
        mine = ours[model]
        print(f"| {model} | meshlib --gpu, mesh 1x1 | {f'{mine:,.0f}' if mine else 'no run'} {unit[model]} | 1.00 | |")
        for r in (r for r in rows if r.get("model") == model):
            rate = r.get("samples_per_s") or r.get("tokens_per_s")
            if rate is None:
                print(f"| {model} | {r['framework']} | {r.get('skipped') or r.get('error')} | | |")
                continue
            ratio = f"{mine / rate:.2f}" if mine else "-"
            print(f"| {model} | {r['framework']} ({r.get('device', '?')}) | {rate:,.0f} {unit[model]} | {ratio} | {r['last_loss']} |")
    return 0


def main(argv=None):
    ap = Parser(prog="gpu_peers.py", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--framework", default="jax,torch,torch-compile", help="comma-separated: jax, torch, torch-compile")
    ap.add_argument("--model", default="mlp,gpt", help="comma-separated: mlp, gpt")
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist", help="Fashion-MNIST's IDX .gz files")
    ap.add_argument("--text", default="/usr/share/games/fortunes", help="the GPT's text (a directory of files)")
    ap.add_argument("--epochs", type=int, default=6, help="MLP epochs (the first is not timed); default 6")
    ap.add_argument("--gpt-steps", type=int, default=300, help="GPT steps (the first 20 are not timed); default 300")
    ap.add_argument("--limit-samples", type=int, default=0, help="use only this many training images (a quick check)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--table", metavar="PEERS_LOG", help="print the table of a run's JSON lines (no training)")
    ap.add_argument("--meshlib-mlp", metavar="LOG", help="with --table: train_fashion_mnist --gpu's output")
    ap.add_argument("--meshlib-gpt", metavar="LOG", help="with --table: train_gpt_chars --gpu's output")
    a = ap.parse_args(argv)
    if a.table:
        return table(a.table, a.meshlib_mlp, a.meshlib_gpt)
    if a.limit_samples < 0:
        ap.error("--limit-samples must not be negative")
    frameworks = [f for f in a.framework.split(",") if f]
    models = [m for m in a.model.split(",") if m]
    for f in frameworks:
        if f not in ("jax", "torch", "torch-compile"):
            ap.error(f"unknown framework '{f}' (jax, torch, torch-compile)")
    for m in models:
        if m not in ("mlp", "gpt"):
            ap.error(f"unknown model '{m}' (mlp, gpt)")
    if a.epochs < 2:
        ap.error("--epochs must be at least 2 (the first epoch is not timed)")
    if a.gpt_steps <= 20:
        ap.error("--gpt-steps must be more than 20 (the first 20 are not timed)")
    mnist = text = None
    status = 0
    for model in models:
        for f in frameworks:
            why = available(f)
            if why:
                print(json.dumps({"framework": f, "model": model, "skipped": why}), flush=True)
                continue
            t0 = time.perf_counter()
            try:
                if model == "mlp":
                    if mnist is None:
                        mnist = fashion_mnist(a.data)
                        if a.limit_samples:
                            mnist = (mnist[0][:a.limit_samples], mnist[1][:a.limit_samples])
                    r = jax_mlp(*mnist, a.epochs, 256, a.seed) if f == "jax" else \
                        torch_mlp(*mnist, a.epochs, 256, a.seed, f == "torch-compile")
                else:
                    if text is None:
                        text = text_bytes(a.text)
                    r = jax_gpt(text, a.gpt_steps, a.seed) if f == "jax" else \
                        torch_gpt(text, a.gpt_steps, a.seed, f == "torch-compile")
            except Exception as e:  # one framework's failure is reported, the others still run
                print(json.dumps({"framework": f, "model": model, "error": f"{type(e).__name__}: {e}"}), flush=True)
                status = 1
                continue
            losses = r.pop("losses")
            r.update({"framework": f, "model": model, "first_losses": [round(v, 6) for v in losses[:10]],
                      "last_loss": round(losses[-1], 6), "seconds": round(time.perf_counter() - t0, 1)})
            print(json.dumps(r), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
