"""Chunked cross-entropy: the LM head's loss without the (tokens x vocab) logits at once."""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

F32 = jnp.float32


def chunked_cross_entropy(normed: jax.Array, out_matrix: jax.Array, labels: jax.Array,
                          mask: jax.Array, chunk: int, softcap: float | None = None) -> jax.Array:
    """sum(mask * CE(normed @ out_matrix, labels)), computed ``chunk`` tokens at a time.

    normed: (B, S, H); out_matrix: (H, V); labels, mask: (B, S). Peak memory is one chunk of
    logits, forward and backward: the forward keeps only each token's log-sum-exp, and the backward
    recomputes a chunk's logits and forms softmax - onehot directly (a hand-written VJP: XLA's
    autodiff of the gather and logsumexp was 4x slower than the matmuls on an H200).
    ``softcap``: logits are ``softcap * tanh(logits / softcap)`` (Gemma 2's final soft-capping).
    """
    h = normed.shape[-1]
    x, y, m = normed.reshape(-1, h), labels.reshape(-1), mask.reshape(-1).astype(F32)
    n = x.shape[0]
    c = min(chunk, n)
    pad = (-n) % c
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
        y, m = jnp.pad(y, (0, pad)), jnp.pad(m, (0, pad))
    return _ce_sum(x.reshape(-1, c, h), out_matrix, y.reshape(-1, c), m.reshape(-1, c), softcap)


def capped(logits: jax.Array, softcap: float | None) -> jax.Array:
    """Final-logit soft-capping (Gemma 2): ``softcap * tanh(logits / softcap)``; None: unchanged."""
    return logits if softcap is None else softcap * jnp.tanh(logits / softcap)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ce_sum(xs, w, ys, ms, softcap):
    """Forward only (no gradient asked for): one matmul per chunk."""
    def body(total, inp):
        xc, yc, mc = inp
        logits = capped(jnp.dot(xc, w, preferred_element_type=F32), softcap)  # (c, V)
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, yc[:, None], axis=-1)[:, 0]
        return total + jnp.sum((lse - picked) * mc), None

    return jax.lax.scan(body, jnp.zeros((), F32), (xs, ys, ms))[0]


def _ce_forward(xs, w, ys, ms, softcap):
    """Value and gradient in one pass over the chunks: each chunk's logits are made once, and its
    share of d(sum)/dx and d(sum)/dw (for a cotangent of 1) is formed from them at once, instead of
    remaking the logits in the backward (three matmuls per chunk instead of four: the loss is always
    differentiated right away, inside the same jitted piece). The backward only scales them."""
    vocab = w.shape[1]

    def body(carry, inp):
        total, dw = carry
        xc, yc, mc = inp
        logits = capped(jnp.dot(xc, w, preferred_element_type=F32), softcap)  # (c, V)
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, yc[:, None], axis=-1)[:, 0]
        p = jnp.exp(logits - lse[:, None]) - jax.nn.one_hot(yc, vocab, dtype=F32)
        if softcap is not None:  # through cap * tanh(raw / cap): times 1 - tanh^2
            p = p * (1.0 - jnp.square(logits / softcap))
        p = (p * mc[:, None]).astype(xc.dtype)  # d total / d logits
        dx = jnp.dot(p, w.T, preferred_element_type=F32)  # kept in fp32 until the cotangent scales it
        return (total + jnp.sum((lse - picked) * mc), dw + jnp.dot(xc.T, p, preferred_element_type=F32)), dx

    (total, dw), dxs = jax.lax.scan(body, (jnp.zeros((), F32), jnp.zeros(w.shape, F32)), (xs, ys, ms))
    dtypes = (jnp.zeros((), xs.dtype), jnp.zeros((), w.dtype))  # the input dtypes, for the backward's casts
    return total, (dxs, dw, dtypes)


def _ce_backward(softcap, res, g):
    dxs, dw, (x0, w0) = res
    return (dxs * g).astype(x0.dtype), (dw * g).astype(w0.dtype), None, None


_ce_sum.defvjp(_ce_forward, _ce_backward)
