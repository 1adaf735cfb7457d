"""A model that is in no example: a pre-norm decoder with RMSNorm and its own rotary embeddings,
written as a user would, and streamed with the adapters docs/porting.md describes. Also the plain
(whole-model jax.grad + optax) trainer the streamed runs are compared with."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx


def rotary(positions, dim: int, theta: float = 10000.0):
    inv = 1.0 / theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    ang = positions.astype(jnp.float32)[..., None] * inv
    return jnp.cos(ang), jnp.sin(ang)  # (B, S, dim/2)


def rotate(x, cos, sin):
    x1, x2 = jnp.split(x, 2, axis=-1)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


class RoPEBlock(nnx.Module):
    def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
        self.heads = heads
        self.norm1 = nnx.RMSNorm(d, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.norm2 = nnx.RMSNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 2 * d, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(2 * d, d, use_bias=False, rngs=rngs)

    def __call__(self, x, cos, sin):
        b, s, d = x.shape
        q, k, v = (a.reshape(b, s, self.heads, d // self.heads) for a in jnp.split(self.qkv(self.norm1(x)), 3, -1))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // self.heads)
        att = jnp.where(jnp.tril(jnp.ones((s, s), bool)), att, -1e30)
        y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att, -1), v).reshape(b, s, d)
        x = x + self.out(y)
        return x + self.down(jax.nn.silu(self.up(self.norm2(x))))


class RoPEDecoder(nnx.Module):
    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 2, layers: int = 2, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.heads = heads
        self.tok = nnx.Embed(vocab, d, rngs=rngs)
        self.layers = nnx.List([RoPEBlock(d, heads, rngs) for _ in range(layers)])
        self.final_norm = nnx.RMSNorm(d, rngs=rngs)
        self.unembed = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens, positions=None):
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        cos, sin = rotary(positions, self.tok.features // self.heads)
        x = self.tok(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.unembed(self.final_norm(x))


def stream_rope(model: RoPEDecoder):
    """Streamed with the adapters of docs/porting.md: the batch's positions reach the rotary tables."""
    from megatrain_jax.stream import stream

    dim = model.tok.features // model.heads
    return stream(model, blocks="layers", embed="tok", head=["final_norm", "unembed"],
                  embed_fn=lambda m, tokens, positions: m.tok(tokens),
                  aux_fn=lambda positions, segment_ids=None: rotary(positions, dim),
                  block_fn=lambda block, x, aux: block(x, *aux),
                  head_fn=lambda m, h: (m.final_norm(h), m.unembed.kernel[...]))


def ce_mean(logits, labels):
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels))


def plain_train(apply, params, tx, batches):
    """Whole-model jax.grad + optax: ``apply(params, tokens) -> logits``. Returns losses, params."""
    state = tx.init(params)

    @jax.jit
    def step(params, state, toks):
        loss, g = jax.value_and_grad(lambda p: ce_mean(apply(p, toks[:, :-1]), toks[:, 1:]))(params)
        upd, state = tx.update(g, state, params)
        return optax.apply_updates(params, upd), state, loss

    losses = []
    for toks in batches:
        params, state, loss = step(params, state, jnp.asarray(toks))
        losses.append(float(loss))
    return losses, params


def nnx_apply(model):
    g, _ = nnx.split(model, nnx.Param, ...)[0], None
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def apply(p, toks):
        return nnx.merge(graphdef, p, rest)(toks)

    return apply, nnx.to_pure_dict(params)


def group_errors(want, got) -> dict:
    """relative ||a - b|| / ||a|| per top-level entry (per block for lists)."""
    out = {}

    def flat(t):
        return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree_util.tree_leaves(t)])

    def walk(a, b, name, depth):
        if depth and isinstance(a, dict):
            for k in a:
                walk(a[k], b[k], f"{name}/{k}", depth - 1)
            return
        x, y = flat(a), flat(b)
        out[name] = float(np.linalg.norm(x - y) / max(np.linalg.norm(x), 1e-30))

    for k in want:
        walk(want[k], got[k], str(k), 1 if isinstance(want[k], dict) and all(isinstance(i, int) for i in want[k])
             else 0)
    return out
