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
  code value (ties to the lower code; what a binary search finds, here one table load and one
  compare per value: ``_lookup_table``): the block's new moments live in 2048-value scratch rows in
  cache, so memory is still read and written once. The passes over a block are separate loops that
  LLVM vectorizes (SIMD update, sqrt and divide included; no fastmath, so every operation is the
  IEEE one the reference does); only the code and table loads are scalar.

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


# ---------------------------------------------------------------- nearest code index, by table

# The nearest-code function is monotone in x (a binary search, then one rounded float32 comparison
# between the two neighbours), so over an interval of floats it is a step function. Split |x| in
# [2**-24, 1] into buckets by its top float32 bits (exponent and 7 mantissa bits): in every bucket the
# nearest index of both codes changes at most once (``_lookup_table`` checks this when it builds the
# table), so one table entry per bucket and sign, the index at the bucket's start and the low bits
# where it steps, give the index with one compare and no loop. Outside the buckets the index is a
# constant: every |x| < 2**-24 has code 0.0 nearest (the smallest nonzero code magnitude is 3.25e-7),
# every x > 1 has code 1.0 (index 255) and every x < -1 index 0 (the clamp reproduces both), and a
# NaN sorts last in the binary search (index 255), which the lookup treats as a positive x > 1.
LOOKUP_SHIFT = 16
LOOKUP_LO = 0x33800000  # float32 bits of 2**-24
LOOKUP_HI = 0x3F800000  # float32 bits of 1.0
LOOKUP_BUCKETS = ((LOOKUP_HI - LOOKUP_LO) >> LOOKUP_SHIFT) + 1  # per sign: 3073
_LOW = (1 << LOOKUP_SHIFT) - 1


def _lookup_table(code: np.ndarray) -> np.ndarray:
    """int32 entries, positive buckets first then negative ones: ``(base << 17) | thr``. For an x
    whose clamped magnitude bits ``a`` fall in the bucket, with ``low = a & 0xFFFF`` and ``s`` the sign
    (NaN counts as positive): nearest index = ``base + ((low >= thr) ^ s)``. ``thr`` is 0x10000 where
    the index does not change inside the bucket. Built from ``_nearest_np`` itself (the reference):
    the index at each bucket's first and last float and, where they differ, a binary search for the
    float where it steps; monotonicity makes the two-valued step function equal to it everywhere."""
    nb = LOOKUP_BUCKETS
    tab = np.empty(2 * nb, np.int32)
    for s in (0, 1):
        a0 = LOOKUP_LO + (np.arange(nb, dtype=np.int64) << LOOKUP_SHIFT)
        a1 = np.minimum(a0 + _LOW, LOOKUP_HI)

        def f(a):
            x = (a.astype(np.uint32) | np.uint32(s << 31)).view(np.float32)
            return _nearest_np(code, x).astype(np.int64)

        f0, f1 = f(a0), f(a1)
        step = f1 - f0 if s == 0 else f0 - f1  # a grows away from zero: the index falls for x < 0
        if not np.all((step == 0) | (step == 1)):
            raise AssertionError("a lookup bucket holds more than one step of the nearest index")
        lo, hi = a0.copy(), a1.copy()  # where step: f(lo) == f0 != f(hi); find the first a with f(a) != f0
        while True:
            active = (step == 1) & (hi - lo > 1)
            if not active.any():
                break
            mid = (lo + hi) // 2
            same = f(mid) == f0
            lo = np.where(active & same, mid, lo)
            hi = np.where(active & ~same, mid, hi)
        thr = np.where(step == 1, hi - a0, _LOW + 1)
        base = f0 if s == 0 else f0 - 1  # x < 0: f = (f0 - 1) + ((low >= thr) ^ 1)
        tab[s * nb:(s + 1) * nb] = ((base << 17) | thr).astype(np.int32)
    return tab


def _clamped_magnitude(builder, x):
    """LLVM IR: float32 x -> (clamped magnitude bits a, sign as i1 with NaN positive), all i32."""
    i32 = ir.IntType(32)
    b = builder.bitcast(x, i32)
    a = builder.and_(b, ir.Constant(i32, 0x7FFFFFFF))
    neg = builder.and_(builder.icmp_signed("<", b, ir.Constant(i32, 0)),
                       builder.icmp_unsigned("<=", a, ir.Constant(i32, 0x7F800000)))
    lo, hi = ir.Constant(i32, LOOKUP_LO), ir.Constant(i32, LOOKUP_HI)
    a = builder.select(builder.icmp_unsigned("<", a, lo), lo, a)
    a = builder.select(builder.icmp_unsigned(">", a, hi), hi, a)
    return a, neg


@intrinsic
def _lookup_slot(typingctx, x):
    """float32 -> the table slot of x (uint32; see ``_lookup_table``), in 32-bit integer IR."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        a, neg = _clamped_magnitude(builder, args[0])
        k = builder.lshr(builder.sub(a, ir.Constant(i32, LOOKUP_LO)), ir.Constant(i32, LOOKUP_SHIFT))
        k = builder.add(k, builder.select(neg, ir.Constant(i32, LOOKUP_BUCKETS), ir.Constant(i32, 0)))
        return k

    return types.uint32(types.float32), codegen


@intrinsic
def _lookup_index(typingctx, x, entry):
    """(float32 x, table entry of its slot: int32, or the same bits as uint32) -> the nearest code
    index (uint8)."""
    if x != types.float32 or entry not in (types.int32, types.uint32):
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        a, neg = _clamped_magnitude(builder, args[0])
        e = args[1]
        ge = builder.icmp_unsigned(">=", builder.and_(a, ir.Constant(i32, _LOW)),
                                   builder.and_(e, ir.Constant(i32, (1 << 17) - 1)))
        step = builder.zext(builder.xor(ge, neg), i32)
        return builder.trunc(builder.add(builder.ashr(e, ir.Constant(i32, 17)), step), ir.IntType(8))

    return types.uint8(types.float32, entry), codegen


@njit(inline="always")
def _nearest(tab, x):
    """Index of the code value nearest ``x`` (ties: the lower one), ``tab = _lookup_table(code)``:
    equal to ``_nearest_np`` for every float32."""
    return _lookup_index(x, tab[_lookup_slot(x)])


@njit(cache=True, nogil=True)
def nearest_index(tab, x, out):
    """``out[i] = _nearest(tab, x[i])`` (uint8): the kernel's lookup, callable from Python (tests)."""
    for i in range(x.shape[0]):
        out[i] = _nearest(tab, x[i])


@intrinsic
def _abs_bits(typingctx, x):
    """float32 -> its bits without the sign (uint32): for non-NaN values, ordered as |x| is."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        return builder.and_(builder.bitcast(args[0], i32), ir.Constant(i32, 0x7FFFFFFF))

    return types.uint32(types.float32), codegen


@intrinsic
def _bits_f32(typingctx, bits):
    if bits != types.uint32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@njit(inline="always")
def _requantize(s, si, r, tab, q, lo, cnt):
    """``q[lo + j] = _nearest(tab, s[j] * r)`` in three passes: the scaled values and their table
    slots (vector code), the table loads (a gather: scalar where the CPU has no fast gathers), the
    final compare (vector code)."""
    for j in range(cnt):
        x = s[j] * r
        s[j] = x
        si[j] = _lookup_slot(x)
    for j in range(cnt):
        si[j] = tab[si[j]]
    for j in range(cnt):
        q[lo + j] = _lookup_index(s[j], si[j])


@njit(nogil=True, cache=True, error_model="numpy")
def _int8_block(param, grad, mq, ms, vq, vs, bf16_out, write_bf16, code_s, code_u, tab_s, tab_u, sm, sv, si, b, n,
                nlr, b1, omb1, b2, omb2, rbc1, rbc2, eps, eps_root, wd, gs):
    """One block, in passes over it that LLVM can vectorize (unsigned indices: no negative-index
    fix-ups): gather the old codes into the scratch rows, the AdamW update (the new moments stay in
    the scratch rows, their absmax is an integer max over the magnitude bits), the bf16 copy, then
    the requantization by table."""
    decay = wd != np.float32(0.0)
    lo = np.uint64(b) * np.uint64(BLOCK)
    cnt = min(np.uint64(BLOCK), np.uint64(n) - lo)
    for j in range(cnt):
        sm[j] = code_s[mq[lo + j]]
        sv[j] = code_u[vq[lo + j]]
    am, av = ms[b], vs[b]
    mx_m = np.uint32(0)
    mx_v = np.uint32(0)
    for j in range(cnt):
        p, m, v = _adamw_elem(param[lo + j], grad[lo + j], sm[j] * am, sv[j] * av, gs, nlr, b1, omb1, b2, omb2,
                              rbc1, rbc2, eps, eps_root, wd, decay)
        param[lo + j] = p
        sm[j] = m
        sv[j] = v
        mx_m = max(mx_m, _abs_bits(m))
        mx_v = max(mx_v, _abs_bits(v))
    if write_bf16:
        for j in range(cnt):
            bf16_out[lo + j] = _bf16_rne(param[lo + j])
    am, av = _bits_f32(mx_m), _bits_f32(mx_v)
    zero = np.float32(0.0)
    rm = np.float32(1.0) / am if am > zero else zero
    rv = np.float32(1.0) / av if av > zero else zero
    _requantize(sm, si, rm, tab_s, mq, lo, cnt)
    _requantize(sv, si, rv, tab_u, vq, lo, cnt)
    ms[b], vs[b] = am, av


@njit(parallel=True, fastmath=False, cache=True, nogil=True)
def _adamw_int8_core(param, grad, mq, ms, vq, vs, bf16_out, code_s, code_u, tab_s, tab_u, nthreads, nlr, b1, omb1,
                     b2, omb2, rbc1, rbc2, eps, eps_root, wd, gs):
    """Blocks in a few contiguous runs per thread; each run has its own scratch rows (2 x 2048
    float32, in cache). No array views per block: a view increfs its parent's shared refcount
    atomically, and sixteen threads doing that per block serialise on one cache line."""
    n = param.shape[0]
    nblocks = (n + BLOCK - 1) // BLOCK
    write_bf16 = bf16_out.shape[0] == n
    nruns = min(nblocks, 4 * nthreads)
    for r in prange(nruns):
        sm = np.empty(BLOCK, np.float32)
        sv = np.empty(BLOCK, np.float32)
        si = np.empty(BLOCK, np.uint32)
        for b in range(r * nblocks // nruns, (r + 1) * nblocks // nruns):
            _int8_block(param, grad, mq, ms, vq, vs, bf16_out, write_bf16, code_s, code_u, tab_s, tab_u, sm, sv,
                        si, b, n, nlr, b1, omb1, b2, omb2, rbc1, rbc2, eps, eps_root, wd, gs)


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
_TABLES: list[np.ndarray] = []


def lookup_tables() -> tuple[np.ndarray, np.ndarray]:
    """``_lookup_table`` of CODE_SIGNED and CODE_UNSIGNED, built on first use (a few ms)."""
    if not _TABLES:
        _TABLES.extend((_lookup_table(CODE_SIGNED), _lookup_table(CODE_UNSIGNED)))
    return _TABLES[0], _TABLES[1]


def adamw_int8_step(param, grad, state, bf16_out, *, lr, b1, b2, eps, eps_root, weight_decay, count,
                    grad_scale=1.0) -> None:
    """One in-place step; ``state``: ``mu_q``/``nu_q`` uint8 (n,), ``mu_scale``/``nu_scale`` float32
    (ceil(n / BLOCK),). ``param`` must start at a block boundary of the group (slices from the
    engine are BLOCK-aligned: ``chunk_align``)."""
    with launch:
        tab_s, tab_u = lookup_tables()
        _adamw_int8_core(param, grad, state["mu_q"], state["mu_scale"], state["nu_q"], state["nu_scale"],
                         _EMPTY_U16 if bf16_out is None else bf16_out, CODE_SIGNED, CODE_UNSIGNED, tab_s, tab_u,
                         numba.get_num_threads(), *_scalars(lr, b1, b2, eps, eps_root, weight_decay, count, grad_scale))


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
