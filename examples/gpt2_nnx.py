"""A GPT-2-style model in Flax NNX, written as the Flax docs write one, trained by megatrain-jax unchanged.

    .venv/bin/python examples/gpt2_nnx.py --steps 20            # tiny shape, CPU, ~10 s
    .venv/bin/python examples/gpt2_nnx.py --shape 1b --steps 10 --batch 8 --compute bfloat16   # a GPU

LayerNorm with bias, learned positional embedding, GELU MLP, dropout inside the blocks, and a head
tied to the token embedding (``wte.attend``). ``stream(model)`` finds the parts by itself: the blocks
are the list ``h``, the embedding is ``wte`` + ``wpe`` (run through the model's own ``__call__`` up
to the first block, which also shows it the causal mask the blocks are given), and the head is
``ln_f`` tied to ``wte``. Data: the bytes of tinyshakespeare when found, else random tokens.
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
    "1b": GPT2Config(vocab_size=50304, block_size=1024, n_layer=20, n_head=16, n_embd=2048),  # 1.11B params
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
    path = "/work/shared/data/tinyshakespeare.txt"
    data = np.frombuffer(open(path, "rb").read(), np.uint8).astype(np.int32) if os.path.isfile(path) else None
    for _ in range(n):
        if data is not None and vocab >= 256:
            starts = rng.integers(0, len(data) - seq - 1, batch)
            yield np.stack([data[s:s + seq + 1] for s in starts])
        else:
            yield rng.integers(0, vocab, (batch, seq + 1)).astype(np.int32)


def main(argv=None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=None, help="default: the model's block_size")
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--compute", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args(argv)

    import optax

    from megatrain_jax.trainer import Trainer

    cfg = SHAPES[args.shape]
    cfg = GPT2Config(**{**cfg.__dict__, "dropout": args.dropout})
    seq = args.seq or cfg.block_size
    model = build_model(cfg)
    tr = Trainer(model, optax.adamw(args.lr, b1=0.9, b2=0.95, weight_decay=0.1), clip_norm=1.0,
                 micro_batches=args.micro_batches, compute_dtype=args.compute, loss_chunk=1024)
    n_params = sum(g.size for g in tr.engine.store)
    n_blocks = sum(g.size for g in tr.engine.store if g.name.startswith("block_"))  # 6 N T counts these
    print(f"GPT-2 NNX, {n_params / 1e6:.2f}M parameters ({n_blocks / 1e6:.2f}M in blocks); "
          f"streamed: {tr.parts.summary}")
    losses = []
    t_last = time.perf_counter()
    for step, toks in enumerate(batches(args.steps, args.batch, seq, cfg.vocab_size), 1):
        res = tr.step(toks)
        now = time.perf_counter()
        losses.append(res.loss)
        tps = toks[:, :-1].size / (now - t_last)
        print(f"step {step:4d}  loss {res.loss:.4f}  grad_norm {res.grad_norm:.3f}  "
              f"tokens/s {tps:,.0f}  model TFLOPS {6 * n_blocks * tps / 1e12:.1f}", flush=True)
        t_last = now
    tr.close()
    return losses


if __name__ == "__main__":
    main()
