"""A GPT-2-style model in Flax NNX, written as the Flax docs write one, trained by megatrain-jax unchanged.

    .venv/bin/python examples/gpt2_nnx.py --steps 20            # tiny shape, CPU, ~10 s
    .venv/bin/python examples/gpt2_nnx.py --shape 1b --steps 10   # a GPU: 64 x 1024 tokens, 2 micro-batches, bf16

LayerNorm with bias, learned positional embedding, GELU MLP, dropout inside the blocks, and a head
tied to the token embedding (``wte.attend``). ``stream(model)`` finds the parts by itself: the blocks
are the list ``h``, the embedding is ``wte`` + ``wpe`` (run through the model's own ``__call__`` up
to the first block, which also shows it the causal mask the blocks are given), and the head is
``ln_f`` tied to ``wte``. Data: the bytes of tinyshakespeare when found, else random tokens.

The optimizer (``--optimizer``): ``fused`` (the default) is the CLI's ``OptimConfig``, the fused numba
AdamW kernel on the host, about 10x faster than optax on the CPU (4.9 against 0.49 G elements/s on a
16-core GPU host: for the 1b shape ~0.23 s a step against ~2.3 s, most of the 2.8 s step measured
with optax at 32k tokens); it is the same AdamW arithmetic as ``optax.adamw``
(b1 0.9, b2 0.95, weight decay 0.1 on every weight, global-norm clipping 1.0), equal to it within
1e-5 in the tests. ``optax`` runs ``optax.adamw`` per group on the host: exact for any element-wise
optax optimizer, so it is the one to use when swapping in another optax transformation.

Each step prints its time, the host optimizer's busy time (on its own thread, overlapped with the
device's work: mostly the previous step's deferred updates), tokens/s and model TFLOPS (6 x block
parameters x tokens/s: the embedding and head, attention scores and the backward's recompute are not
counted); the last line is the median of the steps after the first two (compilation).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


@dataclass
class GPT2Config:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0


SHAPES = {
    "tiny": GPT2Config(),
    "124m": GPT2Config(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),  # GPT-2 small
    "1b": GPT2Config(vocab_size=50304, block_size=1024, n_layer=20, n_head=16, n_embd=2048),  # 1.11B params
}
# per-shape run defaults: the 1b shape is for a GPU, and 64 x 1024 tokens per step keep it busy
# while the blocks stream and the host optimizer runs (flags override them)
RUN_DEFAULTS = {
    "tiny": dict(batch=8, micro_batches=1, compute="float32"),
    "124m": dict(batch=32, micro_batches=1, compute="bfloat16"),
    "1b": dict(batch=64, micro_batches=2, compute="bfloat16"),
}


class CausalSelfAttention(nnx.Module):
    def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.c_attn = nnx.Linear(cfg.n_embd, 3 * cfg.n_embd, kernel_init=init, rngs=rngs)
        self.c_proj = nnx.Linear(cfg.n_embd, cfg.n_embd, kernel_init=init, rngs=rngs)
        self.attn_dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.resid_dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.n_head = cfg.n_head

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        b, t, c = x.shape
        q, k, v = jnp.split(self.c_attn(x), 3, axis=-1)
        q, k, v = (a.reshape(b, t, self.n_head, c // self.n_head).transpose(0, 2, 1, 3) for a in (q, k, v))
        att = (q @ k.transpose(0, 1, 3, 2)) / jnp.sqrt(jnp.asarray(c // self.n_head, x.dtype))
        att = jnp.where(mask, att, jnp.finfo(att.dtype).min)
        att = self.attn_dropout(jax.nn.softmax(att.astype(jnp.float32), axis=-1).astype(x.dtype))
        y = (att @ v).transpose(0, 2, 1, 3).reshape(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class MLP(nnx.Module):
    def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.c_fc = nnx.Linear(cfg.n_embd, 4 * cfg.n_embd, kernel_init=init, rngs=rngs)
        self.c_proj = nnx.Linear(4 * cfg.n_embd, cfg.n_embd, kernel_init=init, rngs=rngs)
        self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.dropout(self.c_proj(nnx.gelu(self.c_fc(x), approximate=True)))


class Block(nnx.Module):
    def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs):
        self.ln_1 = nnx.LayerNorm(cfg.n_embd, epsilon=1e-5, rngs=rngs)
        self.attn = CausalSelfAttention(cfg, rngs)
        self.ln_2 = nnx.LayerNorm(cfg.n_embd, epsilon=1e-5, rngs=rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class GPT2(nnx.Module):
    def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.wte = nnx.Embed(cfg.vocab_size, cfg.n_embd, embedding_init=init, rngs=rngs)
        self.wpe = nnx.Embed(cfg.block_size, cfg.n_embd, embedding_init=init, rngs=rngs)
        self.h = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layer)])
        self.ln_f = nnx.LayerNorm(cfg.n_embd, epsilon=1e-5, rngs=rngs)

    def __call__(self, idx: jax.Array) -> jax.Array:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(jnp.arange(t))
        mask = nnx.make_causal_mask(idx)  # (B, 1, T, T), from the shape only
        for block in self.h:
            x = block(x, mask)
        return self.wte.attend(self.ln_f(x))  # tied head


def build_model(cfg: GPT2Config, seed: int = 0) -> GPT2:
    return GPT2(cfg, nnx.Rngs(params=seed, dropout=seed + 1))


def batches(n: int, batch: int, seq: int, vocab: int, seed: int = 0):
    """(batch, seq + 1) token arrays: windows of tinyshakespeare's bytes, or random tokens."""
    rng = np.random.default_rng(seed)
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "tinyshakespeare.txt")
    data = np.frombuffer(open(path, "rb").read(), np.uint8).astype(np.int32) if os.path.isfile(path) else None
    for _ in range(n):
        if data is not None and vocab >= 256:
            starts = rng.integers(0, len(data) - seq - 1, batch)
            yield np.stack([data[s:s + seq + 1] for s in starts])
        else:
            yield rng.integers(0, vocab, (batch, seq + 1)).astype(np.int32)


def optimizer(kind: str, lr: float):
    """``(optimizer, clip_norm)`` for ``Trainer``: AdamW (b1 0.9, b2 0.95, eps 1e-8, weight decay 0.1)
    with global-norm clipping at 1.0, as the fused host kernel (``OptimConfig``) or as optax."""
    hp = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    if kind == "fused":
        from megatrain_jax.config import OptimConfig

        return OptimConfig(lr=lr, clip_norm=1.0, **hp), 1.0
    if kind == "optax":
        import optax

        return optax.adamw(lr, **hp), 1.0
    raise ValueError(f"--optimizer {kind!r}: use fused or optax")


def main(argv=None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default: tiny 8, 124m 32, 1b 64)")
    ap.add_argument("--seq", type=int, default=None, help="default: the model's block_size")
    ap.add_argument("--micro-batches", type=int, default=None, help="default: tiny 1, 124m 1, 1b 2")
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--compute", choices=["float32", "bfloat16"], default=None,
                    help="default: tiny float32, else bfloat16")
    ap.add_argument("--optimizer", choices=["fused", "optax"], default="fused",
                    help="fused: the numba AdamW host kernel (fast); optax: optax.adamw per group (see the docstring)")
    args = ap.parse_args(argv)
    for k, v in RUN_DEFAULTS[args.shape].items():
        if getattr(args, k) is None:
            setattr(args, k, v)

    from megatrain_jax.trainer import Trainer

    cfg = SHAPES[args.shape]
    cfg = GPT2Config(**{**cfg.__dict__, "dropout": args.dropout})
    seq = args.seq or cfg.block_size
    model = build_model(cfg)
    opt, clip = optimizer(args.optimizer, args.lr)
    tr = Trainer(model, opt, clip_norm=clip, micro_batches=args.micro_batches, compute_dtype=args.compute,
                 loss_chunk=1024)
    n_params = sum(g.size for g in tr.engine.store)
    n_blocks = sum(g.size for g in tr.engine.store if g.name.startswith("block_"))  # 6 N T counts these
    print(f"GPT-2 NNX, {n_params / 1e6:.2f}M parameters ({n_blocks / 1e6:.2f}M in blocks); "
          f"streamed: {tr.parts.summary}")
    print(f"{args.batch} x {seq} = {args.batch * seq:,} tokens per step, {args.micro_batches} micro-batch(es), "
          f"{args.compute} compute, optimizer {args.optimizer} ({type(tr.opt).__name__}), devices "
          f"{jax.devices()[0].platform}", flush=True)
    # the host optimizer's busy time (it runs on its own thread, overlapped with the device's work)
    opt_busy, update = [0.0], tr.opt.update

    def timed_update(*a, **kw):
        t0 = time.perf_counter()
        update(*a, **kw)
        opt_busy[0] += time.perf_counter() - t0

    tr.opt.update = timed_update
    losses, times, opt_times = [], [], []
    t_last = time.perf_counter()
    for step, toks in enumerate(batches(args.steps, args.batch, seq, cfg.vocab_size), 1):
        res = tr.step(toks)
        now = time.perf_counter()
        losses.append(res.loss)
        times.append(now - t_last)
        opt_times.append(opt_busy[0])
        opt_busy[0] = 0.0
        tps = toks[:, :-1].size / times[-1]
        print(f"step {step:4d}  loss {res.loss:.4f}  grad_norm {res.grad_norm:.3f}  step {times[-1]:.3f} s  "
              f"host optimizer {opt_times[-1]:.3f} s  tokens/s {tps:,.0f}  "
              f"model TFLOPS {6 * n_blocks * tps / 1e12:.1f}", flush=True)
        t_last = now
    tr.close()
    if len(times) > 2:
        t = float(np.median(times[2:]))
        tps = args.batch * seq / t
        print(f"median of steps 3-{len(times)}: {t:.3f} s/step  host optimizer {np.median(opt_times[2:]):.3f} s  "
              f"tokens/s {tps:,.0f}  model TFLOPS {6 * n_blocks * tps / 1e12:.1f}", flush=True)
    return losses


if __name__ == "__main__":
    main()
