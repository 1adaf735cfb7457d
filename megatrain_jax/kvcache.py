"""Attention over a KV cache, for generation: a context that the blocks' attention consults while a decoding kernel
traces a block.

The blocks are the training templates, unchanged: ``(weights, hidden, aux) -> hidden``. Generation traces one inside
``with KVContext(k_cache, v_cache, start, pad):``; ``models.common.Attention.attend`` finds the context and, instead
of attending over its own sequence, writes its new keys and values into the cache at slots ``start ..
start + S - 1`` and attends over the cache. The kernel returns the updated cache with the block's output. Each block
has one attention, so one context serves one block call.

Slots: every row of a batch is left-padded to the same prompt length, so slot ``j`` is the same step for every row;
row ``b``'s real tokens start at slot ``pad[b]``. A query at slot ``t`` sees slots ``pad[b] <= j <= t`` (and, with a
sliding window W, ``j > t - W``: the training attention's rule); a padding query sees only itself (finite, never
used), so nothing is ever NaN.
"""
from __future__ import annotations

import threading
from typing import Any

import jax
import jax.numpy as jnp

_LOCAL = threading.local()


def current() -> "KVContext | None":
    """The context a decoding kernel is tracing under (None: ordinary full-sequence attention)."""
    return getattr(_LOCAL, "ctx", None)


class KVContext:
    """One block's cache while its decoding kernel is traced: ``k``/``v`` (B, T, kv_heads, D), ``start`` the first
    slot of this call's tokens (a traced int32 scalar), ``pad`` (B,) the first real slot of each row."""

    def __init__(self, k: jax.Array, v: jax.Array, start: jax.Array, pad: jax.Array):
        self.k, self.v, self.start, self.pad = k, v, start, pad
        self.used = 0

    def __enter__(self) -> "KVContext":
        self._prev = current()
        _LOCAL.ctx = self
        return self

    def __exit__(self, *exc) -> None:
        _LOCAL.ctx = self._prev

    def attend(self, module: Any, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        """``module``'s attention (its window, softcap and scale) of ``q`` over the cache with ``k``, ``v`` written
        in: (B, S, heads x D)."""
        if self.used:
            raise RuntimeError("a block attended twice under one KV context")
        self.used += 1
        b, s, n, d = q.shape
        kvh = k.shape[2]
        zero = jnp.zeros((), jnp.int32)
        self.k = jax.lax.dynamic_update_slice(self.k, k.astype(self.k.dtype), (zero, self.start, zero, zero))
        self.v = jax.lax.dynamic_update_slice(self.v, v.astype(self.v.dtype), (zero, self.start, zero, zero))
        return cached_attention(q, self.k, self.v, self.start, self.pad, window=module.window,
                                softcap=module.softcap, scale=module.scale).reshape(b, s, n * d)


def cached_attention(q: jax.Array, kc: jax.Array, vc: jax.Array, start: jax.Array, pad: jax.Array, *,
                     window: int | None = None, softcap: float | None = None, scale: float | None = None) -> jax.Array:
    """(B, S, heads, D): queries at slots ``start + i`` over cache slots, causal, inside each row's real tokens."""
    b, s, n, d = q.shape
    t, kvh = kc.shape[1], kc.shape[2]
    scale = d ** -0.5 if scale is None else scale
    qs = q.reshape(b, s, kvh, n // kvh, d)
    scores = jnp.einsum("bsgrd,btgd->bgrst", qs, kc, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    slots = jnp.arange(t, dtype=jnp.int32)
    qslots = start + jnp.arange(s, dtype=jnp.int32)
    visible = (slots[None, None, :] <= qslots[None, :, None]) & (slots[None, None, :] >= pad[:, None, None])
    if window is not None:
        visible &= slots[None, None, :] > qslots[None, :, None] - window
    visible |= slots[None, None, :] == qslots[None, :, None]  # a padding query sees itself: never all masked
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    p = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bgrst,btgd->bsgrd", p.astype(vc.dtype), vc, preferred_element_type=jnp.float32)
    return out.astype(q.dtype).reshape(b, s, n, d)
