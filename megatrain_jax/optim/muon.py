"""Muon as it is meant to be used (``optim.name=muon``): Newton-Schulz-orthogonalized momentum on the blocks'
hidden matrices, AdamW on everything else (the embedding, the output head, norms and biases).

Why our own and not ``optax.contrib.muon`` as is: that one Muons every 2-D leaf, the 128256-row embedding
and the head included (slow, and not Keller Jordan's Muon, which gives those to Adam), and runs the
Newton-Schulz iterations in the momentum's dtype (fp32; TF32 on the GPU). Here:

- which leaves are Muon'd is decided by name, so a group's pytree (``embed``, ``block_i``, ``head``) and
  the whole model's pytree label each leaf the same way (the streamed engine and the reference trainer
  run one transformation): leaves named ``embedding`` or ``lm_head`` and leaves of rank < 2 go to AdamW;
  rank-3 expert stacks are a batch of matrices;
- the iterations run in ``ns_dtype`` (bfloat16 by default, as Keller Jordan's Muon: the GPU's bf16
  matmul rate, about twice TF32's), after a Frobenius normalization in fp32;
- matrices of one shape (after orienting each wide: rows <= columns) are orthogonalized as one batch, so
  a block's gate, up and (transposed) down projections are one batched matmul chain.

With ``ns_dtype=float32`` it equals ``optax.contrib.muon`` given the same labels
(``muon_weight_dimension_numbers=muon_dims``; tests/test_muon.py), state layout included.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers, MuonState

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic (optax.contrib.muon's default)
ADAM_NAMES = frozenset({"embedding", "lm_head"})  # 2-D leaves that Muon is not for


def _name(path) -> str:
    last = path[-1] if path else None
    return str(getattr(last, "key", getattr(last, "name", last)))


def muon_dims(params: Any) -> Any:
    """Per leaf: ``MuonDimensionNumbers`` for a Muon'd matrix (batch axes first), None for AdamW."""
    def dims(path, x):
        if x.ndim < 2 or _name(path) in ADAM_NAMES:
            return None
        return MuonDimensionNumbers(reduction_axis=x.ndim - 2, output_axis=x.ndim - 1)

    return jax.tree_util.tree_map_with_path(dims, params)


def labels(params: Any) -> Any:
    """Per leaf: ``"muon"`` or ``"adam"`` (``muon_dims``)."""
    return jax.tree.map(lambda d: "adam" if d is None else "muon", muon_dims(params),
                        is_leaf=lambda d: d is None or isinstance(d, MuonDimensionNumbers))


def newton_schulz(xs: jax.Array, steps: int, eps: float, dtype) -> jax.Array:
    """Orthogonalize a batch of wide matrices ``(b, m, n)``, ``m <= n`` (optax's quintic iteration):
    normalized in fp32, iterated in ``dtype``, returned in fp32."""
    a, b, c = NS_COEFFS
    norm = jnp.sqrt(jnp.sum(jnp.square(xs), axis=(1, 2), keepdims=True))
    x = (xs / (norm + eps)).astype(dtype)
    for _ in range(steps):
        g = x @ jnp.swapaxes(x, 1, 2)
        x = a * x + (b * g + c * (g @ g)) @ x
    return x.astype(jnp.float32)


def _orthogonalize_all(tree: Any, steps: int, eps: float, dtype) -> Any:
    """Every leaf (a matrix, or a stack of them on the leading axes) orthogonalized; leaves of one
    oriented shape as one batch."""
    leaves, treedef = jax.tree.flatten(tree)
    batches: dict[tuple, list[tuple[int, jax.Array, bool]]] = {}
    for i, x in enumerate(leaves):
        m, n = x.shape[-2:]
        wide = x.reshape((-1, m, n))
        tall = m > n
        if tall:
            wide = jnp.swapaxes(wide, 1, 2)
        batches.setdefault(wide.shape[1:], []).append((i, wide, tall))
    out = [None] * len(leaves)
    for items in batches.values():
        stacked = jnp.concatenate([w for _, w, _ in items]) if len(items) > 1 else items[0][1]
        done = newton_schulz(stacked, steps, eps, dtype)
        off = 0
        for i, w, tall in items:
            y = done[off:off + w.shape[0]]
            off += w.shape[0]
            out[i] = (jnp.swapaxes(y, 1, 2) if tall else y).reshape(leaves[i].shape)
    return jax.tree.unflatten(treedef, out)


def scale_by_muon(ns_steps: int = 5, beta: float = 0.95, eps: float = 1e-8, nesterov: bool = True,
                  ns_dtype=jnp.bfloat16) -> optax.GradientTransformation:
    """``optax.contrib.scale_by_muon`` for Muon'd leaves only (every leaf it is given is one), with the
    iterations in ``ns_dtype``."""

    def init_fn(params):
        return MuonState(count=jnp.zeros([], jnp.int32), mu=optax.tree.zeros_like(params),
                                ns_coeffs=jnp.asarray(NS_COEFFS))

    def update_fn(updates, state, params=None):
        del params
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count = optax.safe_increment(state.count)
        if nesterov:
            mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                                  optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                                  optax.tree.bias_correction(updates, beta, count))
        else:
            mu_hat = optax.tree.bias_correction(mu, beta, count)
        return _orthogonalize_all(mu_hat, ns_steps, eps, ns_dtype), MuonState(count, mu, state.ns_coeffs)

    return optax.GradientTransformation(init_fn, update_fn)


def scale_by_shape() -> optax.GradientTransformation:
    """Muon's width scaling ``sqrt(max(1, fan_out / fan_in))`` (``optax.contrib.scale_by_shape``'s default)."""
    return optax.stateless(lambda updates, params=None: jax.tree.map(
        lambda u: u * jnp.sqrt(jnp.maximum(1.0, u.shape[-1] / u.shape[-2])), updates))


def muon(learning_rate, *, ns_steps: int = 5, beta: float = 0.95, eps: float = 1e-8, weight_decay: float = 0.0,
         nesterov: bool = True, adam_b1: float = 0.9, adam_b2: float = 0.999, adam_weight_decay: float = 0.0,
         adam_learning_rate=None, ns_dtype=jnp.bfloat16) -> optax.GradientTransformation:
    """Muon on the hidden matrices, AdamW (optax.contrib.muon's: its ``nesterov`` and ``eps``) elsewhere."""
    adam_lr = learning_rate if adam_learning_rate is None else adam_learning_rate
    return optax.partition(
        {"muon": optax.chain(scale_by_muon(ns_steps, beta, eps, nesterov, ns_dtype), scale_by_shape(),
                             optax.add_decayed_weights(weight_decay), optax.scale_by_learning_rate(learning_rate)),
         "adam": optax.adamw(adam_lr, b1=adam_b1, b2=adam_b2, eps=eps, weight_decay=adam_weight_decay,
                             nesterov=nesterov)},
        labels)


def newton_schulz_flops(shape: tuple[int, ...], steps: int) -> float:
    """Matmul flops of orthogonalizing one leaf of this shape (``m <= n`` after orienting):
    per iteration ``X X^T`` (2 m^2 n), ``A A`` (2 m^3) and ``B X`` (2 m^2 n)."""
    if len(shape) < 2:
        return 0.0
    m, n = sorted(shape[-2:])
    batch = 1
    for d in shape[:-2]:
        batch *= d
    return float(batch * steps * (4.0 * m * m * n + 2.0 * m ** 3))
