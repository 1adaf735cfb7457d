"""Lean optimizer state: Lion with a blockwise 8-bit momentum (``optim.name=lion``, ``optim.moments=int8``).

Why: with fp32 master weights (4 bytes/param) Lion's fp32 momentum brings the host store to 8 bytes
per parameter; its momentum in 8 bits brings it to 4 + 1 + 4/2048 = 5.002 bytes/param. Lion only
reads its momentum through ``sign(b1*m + (1-b1)*g)`` and its own moving average, which is why 8 bits
suffice (the same dynamic code as the int8 AdamW moments: bitsandbytes' dynamic map, absmax per
2048-value block).

It is an ordinary ``optax.GradientTransformation`` (``lion_int8``), so the reference trainer and the
streamed engine (on the host or the device) run the same arithmetic; against fp32 Lion it differs by the
quantization of the momentum (tests/test_device_optax.py measures it).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import megatrain_jax.optim.compact_adamw as _ca
from megatrain_jax.optim.compact_adamw import BLOCK, CODE_SIGNED
from megatrain_jax.optim.device_adamw import nearest_code

ZERO_CODE = int(np.flatnonzero(CODE_SIGNED == 0)[0])  # the code of 0.0: a fresh momentum


class ScaleByLionInt8State(NamedTuple):
    count: jax.Array
    mu_q: Any  # per leaf: uint8 codes, (size,)
    mu_scale: Any  # per leaf: float32 absmax per block, (ceil(size / block),)


def _blocks(n: int, block: int) -> int:
    return max(-(-n // block), 1)


def quantize(x: jax.Array, block: int = BLOCK) -> tuple[jax.Array, jax.Array]:
    """A float array -> (uint8 codes of x / absmax of its block, float32 absmax per block)."""
    flat = jnp.ravel(x).astype(jnp.float32)
    n, nb = flat.shape[0], _blocks(flat.shape[0], block)
    blocks = jnp.pad(flat, (0, nb * block - n)).reshape(nb, block)
    absmax = jnp.max(jnp.abs(blocks), axis=1)
    inv = jnp.where(absmax > 0, 1.0 / jnp.where(absmax > 0, absmax, 1.0), 0.0)
    # the nearest code by the int8 AdamW's lookup table (a word per 16 high bits of the float, then an
    # add): the same codes as a search of the code's midpoints, 12x faster on the CPU
    codes = nearest_code(jnp.asarray(_ca.lookup_tables()[0]), (blocks * inv[:, None]).reshape(-1)[:n])
    return codes, absmax


def dequantize(codes: jax.Array, absmax: jax.Array, shape, block: int = BLOCK) -> jax.Array:
    n = codes.shape[0]
    nb = absmax.shape[0]
    scale = jnp.broadcast_to(absmax[:, None], (nb, block)).reshape(-1)[:n]
    return (jnp.take(jnp.asarray(CODE_SIGNED), codes.astype(jnp.int32)) * scale).reshape(shape)


def scale_by_lion_int8(b1: float = 0.9, b2: float = 0.99, block: int = BLOCK) -> optax.GradientTransformation:
    """``optax.scale_by_lion`` with its momentum stored as 8-bit codes and a scale per block."""

    def init_fn(params):
        q = jax.tree.map(lambda p: jnp.full((p.size,), ZERO_CODE, jnp.uint8), params)
        s = jax.tree.map(lambda p: jnp.zeros((_blocks(p.size, block),), jnp.float32), params)
        return ScaleByLionInt8State(count=jnp.zeros([], jnp.int32), mu_q=q, mu_scale=s)

    def update_fn(updates, state, params=None):
        del params
        mu = jax.tree.map(lambda g, q, s: dequantize(q, s, g.shape, block), updates, state.mu_q, state.mu_scale)
        new_updates = jax.tree.map(lambda g, m: jnp.sign((1.0 - b1) * g + b1 * m), updates, mu)
        mu = optax.tree.update_moment(updates, mu, b2, 1)
        packed = jax.tree.map(lambda m: quantize(m, block), mu)
        is_pair = lambda x: isinstance(x, tuple)  # noqa: E731
        q = jax.tree.map(lambda t: t[0], packed, is_leaf=is_pair)
        s = jax.tree.map(lambda t: t[1], packed, is_leaf=is_pair)
        return new_updates, ScaleByLionInt8State(count=optax.safe_increment(state.count), mu_q=q, mu_scale=s)

    return optax.GradientTransformation(init_fn, update_fn)


def lion_int8(learning_rate, b1: float = 0.9, b2: float = 0.99, weight_decay: float = 1e-3,
              block: int = BLOCK) -> optax.GradientTransformation:
    """``optax.lion`` (same chain: direction, decoupled weight decay, learning rate) with an 8-bit momentum."""
    return optax.chain(scale_by_lion_int8(b1, b2, block), optax.add_decayed_weights(weight_decay),
                       optax.scale_by_learning_rate(learning_rate))


def int8_bytes_per_param(block: int = BLOCK) -> float:
    """Host bytes/param of the int8 momentum (codes and one float32 scale per block)."""
    return 1.0 + 4.0 / block
