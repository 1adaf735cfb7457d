"""AdamW with compact moments on the host: bfloat16 (4 bytes/param) or blockwise int8 (about 2).

The fp32 master weights stay fp32; only the two Adam moments shrink. Both kernels are one fused,
in-place numba pass over memory, like the fp32 kernel (``fused_adamw.py``), with the same AdamW
arithmetic in float32 (so the same bias corrections, learning rate, clipping factor, decay).

- ``bfloat16``: each moment is stored as bf16 bits, rounded to nearest even after every update.
  Round-to-nearest rather than stochastic rounding: it is deterministic (a resumed run is bit-exact,
  which the checkpoint tests demand), and it is what optax does with ``mu_dtype=bfloat16``.
- ``int8``: blockwise 8-bit state (Dettmers et al., "8-bit Optimizers via Block-wise Quantization",
  2022): independent blocks of ``BLOCK`` values, one fp32 absmax scale per block and moment, the
  signed dynamic (nonlinear) code for the first moment and an unsigned dynamic code for the second.
  Per block: dequantize (code[q] * absmax), update, find the new absmax, requantize to the nearest
  code value (binary search, ties to the lower code): the block's new moments live in a 2048-value
  local buffer, so memory is still read and written once.

``reference_int8_step`` is a plain numpy implementation of the same scheme; the numba kernel equals
it bit for bit (tests/test_compact_adamw.py).
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from megatrain_jax.optim.fused_adamw import _adamw_elem, _bf16_rne, bias_correction, launch

BLOCK = 2048


def dynamic_code(signed: bool) -> np.ndarray:
    """The 256-value dynamic quantization code (bitsandbytes' ``create_dynamic_map`` construction:
    7 decades of exponent, linearly spaced fractions within each, denser near zero), sorted, float32.
    Signed: 127 positive, 127 negative, 0 and 1. Unsigned: 254 positive, 0 and 1."""
    vals = [0.0, 1.0]
    for i in range(7):
        n = 2 ** i if signed else 2 ** (i + 1)
        b = np.linspace(0.1, 1.0, n + 1)
        means = (b[:-1] + b[1:]) / 2.0 * 10.0 ** (i - 6)
        vals += means.tolist()
        if signed:
            vals += (-means).tolist()
    code = np.sort(np.asarray(vals, np.float64)).astype(np.float32)
    assert code.shape == (256,) and len(np.unique(code)) == 256
    return code


CODE_SIGNED = dynamic_code(True)
CODE_UNSIGNED = dynamic_code(False)


TABLE_SHIFT = 16  # the top 16 bits of an order-preserving key of the float32 select a table entry


def _start_table(code: np.ndarray) -> np.ndarray:
    """For every bucket of float32 values (top 16 bits of an order-preserving key: a 128 KiB table that stays in cache), the first code
    index whose value is >= the bucket's smallest value: every code before it is smaller than any x
    in the bucket, so a short forward scan from there finds exactly what a binary search finds."""
    keys = np.arange(1 << (32 - TABLE_SHIFT), dtype=np.uint64) << np.uint64(TABLE_SHIFT)
    keys = keys.astype(np.uint32)
    neg = keys < np.uint32(0x80000000)
    bits = np.where(neg, ~keys, keys & np.uint32(0x7FFFFFFF))
    # a negative bucket's smallest value is its most negative one: the key's largest member
    bits = np.where(neg, bits - np.uint32((1 << TABLE_SHIFT) - 1), bits)
    lows = bits.view(np.float32)
    lows = np.where(np.isnan(lows), np.float32(0.0), lows)
    return np.searchsorted(code, lows, side="left").astype(np.uint16)


@intrinsic
def _f32_bits(typingctx, x):
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@njit(inline="always")
def _nearest(code, table, x):
    """Index of the code value nearest ``x`` (ties: the lower one); ``code`` sorted ascending.
    Equal to a binary search for the first code >= x followed by the neighbour comparison."""
    b = _f32_bits(x)
    key = ~b if (b >> np.uint32(31)) else (b | np.uint32(0x80000000))
    lo = np.int64(table[key >> np.uint32(TABLE_SHIFT)])
    n = code.shape[0]
    while lo < n and code[lo] < x:
        lo += 1
    if lo == n:
        return lo - 1
    if lo > 0 and (x - code[lo - 1]) <= (code[lo] - x):
        return lo - 1
    return lo


@njit(parallel=True, fastmath=False, cache=True, nogil=True)
def _adamw_int8_core(param, grad, mq, ms, vq, vs, bf16_out, code_s, code_u, tab_s, tab_u, scratch, nlr, b1, omb1,
                     b2, omb2, rbc1, rbc2, eps, eps_root, wd, gs):
    """Per block: update the params and keep the block's new moments in this thread's scratch row
    (2 x 2048 float32, in cache), then quantize them against the block's new absmax. Memory is
    read and written once."""
    n = param.shape[0]
    nblocks = (n + BLOCK - 1) // BLOCK
    decay = wd != np.float32(0.0)
    write_bf16 = bf16_out.shape[0] == n
    zero = np.float32(0.0)
    one = np.float32(1.0)
    for b in prange(nblocks):
        # no array views in this loop: each view increfs its parent's shared refcount atomically,
        # and sixteen threads doing that serialise on one cache line (measured: no scaling at all)
        t = numba.get_thread_id()
        lo = b * BLOCK
        cnt = min(BLOCK, n - lo)
        am, av = ms[b], vs[b]
        for j in range(cnt):  # dequantize into this thread's scratch rows (a gather)
            scratch[t, 0, j] = code_s[mq[lo + j]] * am
            scratch[t, 1, j] = code_u[vq[lo + j]] * av
        for j in range(cnt):  # the AdamW update, as the fp32 kernel does it
            p, m, v = _adamw_elem(param[lo + j], grad[lo + j], scratch[t, 0, j], scratch[t, 1, j], gs, nlr, b1,
                                  omb1, b2, omb2, rbc1, rbc2, eps, eps_root, wd, decay)
            param[lo + j] = p
            scratch[t, 0, j] = m
            scratch[t, 1, j] = v
        if write_bf16:
            for j in range(cnt):
                bf16_out[lo + j] = _bf16_rne(param[lo + j])
        mx_m = zero
        mx_v = zero
        for j in range(cnt):
            mx_m = max(mx_m, abs(scratch[t, 0, j]))
            mx_v = max(mx_v, scratch[t, 1, j])
        rm = one / mx_m if mx_m > zero else zero
        rv = one / mx_v if mx_v > zero else zero
        for j in range(cnt):
            mq[lo + j] = _nearest(code_s, tab_s, scratch[t, 0, j] * rm)
            vq[lo + j] = _nearest(code_u, tab_u, scratch[t, 1, j] * rv)
        ms[b], vs[b] = mx_m, mx_v


@intrinsic
def _bf16_bits_to_f32(typingctx, bits):
    """bfloat16 bits (uint16) -> float32, exactly."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        (v,) = args
        i32 = ir.IntType(32)
        w = builder.shl(builder.zext(v, i32), ir.Constant(i32, 16))
        return builder.bitcast(w, ir.FloatType())

    return types.float32(types.uint16), codegen


@njit(parallel=True, fastmath=False, cache=True, nogil=True)
def _adamw_bf16_core(param, grad, mu, nu, bf16_out, nlr, b1, omb1, b2, omb2, rbc1, rbc2, eps, eps_root, wd, gs):
    n = param.shape[0]
    decay = wd != np.float32(0.0)
    write_bf16 = bf16_out.shape[0] == n
    for i in prange(n):
        g = grad[i] * gs
        m = omb1 * g + b1 * _bf16_bits_to_f32(mu[i])
        v = omb2 * (g * g) + b2 * _bf16_bits_to_f32(nu[i])
        u = (m * rbc1) / (np.sqrt(v * rbc2 + eps_root) + eps)
        p = param[i]
        if decay:
            u = u + wd * p
        p = p + nlr * u
        param[i] = p
        mu[i] = _bf16_rne(m)
        nu[i] = _bf16_rne(v)
        if write_bf16:
            bf16_out[i] = _bf16_rne(p)


def _scalars(lr, b1, b2, eps, eps_root, weight_decay, count, grad_scale):
    return (np.float32(-np.float32(lr)), np.float32(b1), np.float32(1.0 - b1), np.float32(b2), np.float32(1.0 - b2),
            np.float32(1.0) / bias_correction(b1, count), np.float32(1.0) / bias_correction(b2, count),
            np.float32(eps), np.float32(eps_root), np.float32(weight_decay), np.float32(grad_scale))


_EMPTY_U16 = np.zeros(0, np.uint16)
_TABLES = (_start_table(CODE_SIGNED), _start_table(CODE_UNSIGNED))
_SCRATCH: list[np.ndarray] = []


def _scratch() -> np.ndarray:
    """One (2, BLOCK) float32 row per numba thread (indexed by ``numba.get_thread_id()``)."""
    if not _SCRATCH:
        _SCRATCH.append(np.zeros((numba.config.NUMBA_NUM_THREADS + 1, 2, BLOCK), np.float32))
    return _SCRATCH[0]


def adamw_int8_step(param, grad, state, bf16_out, *, lr, b1, b2, eps, eps_root, weight_decay, count,
                    grad_scale=1.0) -> None:
    """One in-place step; ``state``: ``mu_q``/``nu_q`` uint8 (n,), ``mu_scale``/``nu_scale`` float32
    (ceil(n / BLOCK),). ``param`` must start at a block boundary of the group (slices from the
    engine are BLOCK-aligned: ``chunk_align``)."""
    with launch:
        scratch = _scratch()
        _adamw_int8_core(param, grad, state["mu_q"], state["mu_scale"], state["nu_q"], state["nu_scale"],
                         _EMPTY_U16 if bf16_out is None else bf16_out, CODE_SIGNED, CODE_UNSIGNED, _TABLES[0], _TABLES[1],
                         scratch,
                         *_scalars(lr, b1, b2, eps, eps_root, weight_decay, count, grad_scale))


def adamw_bf16_step(param, grad, state, bf16_out, *, lr, b1, b2, eps, eps_root, weight_decay, count,
                    grad_scale=1.0) -> None:
    """One in-place step; ``state``: ``mu_bf16``/``nu_bf16`` uint16 bf16 bits (n,)."""
    with launch:
        _adamw_bf16_core(param, grad, state["mu_bf16"], state["nu_bf16"], _EMPTY_U16 if bf16_out is None else bf16_out,
                         *_scalars(lr, b1, b2, eps, eps_root, weight_decay, count, grad_scale))


# ------------------------------------------------------------------------- the numpy reference


def _nearest_np(code: np.ndarray, x: np.ndarray) -> np.ndarray:
    idx = np.searchsorted(code, x, side="left")
    top = idx == code.shape[0]
    idx = np.minimum(idx, code.shape[0] - 1)
    lower = np.maximum(idx - 1, 0)
    take_lower = (idx > 0) & ((x - code[lower]) <= (code[idx] - x))
    out = np.where(take_lower | top, np.where(top, code.shape[0] - 1, lower), idx)
    return out.astype(np.uint8)


def reference_int8_step(param, grad, state, *, lr, b1, b2, eps, eps_root, weight_decay, count,
                        grad_scale=1.0) -> np.ndarray:
    """The same blockwise int8 AdamW step written as plain numpy, block by block (for the tests).
    Updates ``param`` and ``state`` in place; returns the bf16 bits of the new params."""
    f = np.float32
    nlr, b1f, omb1, b2f, omb2, rbc1, rbc2, epsf, eps_rootf, wd, gs = _scalars(lr, b1, b2, eps, eps_root,
                                                                                weight_decay, count, grad_scale)
    n = param.shape[0]
    for b in range(-(-n // BLOCK)):
        sl = slice(b * BLOCK, min((b + 1) * BLOCK, n))
        g = grad[sl] * gs
        m = omb1 * g + b1f * (CODE_SIGNED[state["mu_q"][sl]] * state["mu_scale"][b])
        v = omb2 * (g * g) + b2f * (CODE_UNSIGNED[state["nu_q"][sl]] * state["nu_scale"][b])
        u = (m * rbc1) / (np.sqrt(v * rbc2 + eps_rootf) + epsf)
        p = param[sl]
        if wd != f(0.0):
            u = u + wd * p
        param[sl] = p + nlr * u
        am, av = f(np.max(np.abs(m))), f(np.max(v))
        state["mu_scale"][b], state["nu_scale"][b] = am, av
        rm = f(1.0) / am if am > 0 else f(0.0)
        rv = f(1.0) / av if av > 0 else f(0.0)
        xm, xv = (m * rm).astype(f), (v * rv).astype(f)
        state["mu_q"][sl] = _nearest_np(CODE_SIGNED, xm)
        state["nu_q"][sl] = _nearest_np(CODE_UNSIGNED, xv)
    from megatrain_jax.optim.fused_adamw import f32_to_bf16_bits

    return f32_to_bf16_bits(param)
