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
  code value (ties to the lower code: what a binary search finds; here one table gather and one add
  per value, ``_lookup_table``). The block's new moments live in a 2 x 2048-value scratch row in
  cache, so memory is still read and written once.

How the int8 kernel is shaped, and why (profiled on a 2-core AMD EPYC (Zen 1) VM: cycles per value
of each loop on L1-resident data, and LLVM's assembly for Zen 1, Skylake-X, Ice Lake and Sapphire
Rapids targets; the H100 machine's host is an Intel Xeon with 16 cores):

- Four gathers per value are inherent: the code values of the old m and v indices, and the table
  entries of the new ones (a code value cannot be computed from its index bit-exactly for less than a
  load; the nearest index cannot be found without a load either). Everything else is SIMD: no
  fastmath, so each operation is the IEEE one the reference does; the AdamW update's sqrt and divide
  alone take ~2 cycles per value on Zen 1 (its divider), ~1.4 on recent Intel cores.
- The kernel before (2.15 G values/s on the 16-core host) did the gathers in scalar loops apart from
  the SIMD ones (LLVM vectorizes a gather only where it may assume the arrays do not overlap, which
  numba tells it for a parfor body only), requantized each moment in three passes with a 2-compare
  lookup (~3.5 cycles per value and moment), and called a function per block, which increfs and
  decrefs 12 arrays on refcounts that all threads share (atomic, contended cache lines at 16 threads).
  Now: all the work sits in the parfor body (``noalias``, no calls with arrays), so every loop is
  vectorized with its gathers (dequantize fused into the update: ~4.1 cycles per value for both
  moments, down from 2.5 for the separate gathers plus 2.8 for the update); the table entry is
  additive (index = (entry + word) >> 16: the carry is the compare), so requantization is one SIMD
  pass for the words of both moments (~1 cycle per value) and one gather-and-add pass per moment
  (~1 cycle each): ~3 cycles per value in all, down from ~7. Zen 1: ~13 -> ~7.7 cycles per value
  in cache, 1.5x on the whole kernel (``experiments/bench_compact_adamw.py`` runs both).
- Gathers: LLVM emits AVX2/AVX-512 gather instructions where its cost model calls them fast (Intel
  Skylake-X and later) and scalar loads into vector lanes elsewhere (AMD Zen). On Intel CPUs with
  the GDS ("Downfall") microcode, gather instructions are several times slower, which LLVM does not
  know; so there are two variants of the kernel, ``hw`` (LLVM's choice) and ``sw`` (compiled with the
  tuning flag ``prefer-no-gather``), and the first calls time both and keep the faster
  (``_GatherChoice``; ``MEGATRAIN_INT8_GATHER`` forces one). Both give the same bits.
- The bfloat16 copy of the params is a loop of its own (fused into the update it spills registers
  on AVX2's 16 and ran slower on Zen 1); the lookup words are written over the moments in place
  (half the scratch); word and gather loops stay apart (fused, LLVM computes the words of gathered
  lanes in scalar code wherever it has no gather instruction).
- Threads take chunks of ``CHUNK_BLOCKS`` blocks from an atomic counter, not a static share: the
  engine runs the update next to its own threads, and a static share waits for the slowest core.
- The block size (2048, the state format) costs nothing measurable: the per-block work outside the
  loops (two horizontal maxima, two reciprocals, loop set-up) is ~0.1 cycle per value.

``reference_int8_step`` is a plain numpy implementation of the same scheme; the numba kernel equals
it bit for bit (tests/test_compact_adamw.py).
"""
from __future__ import annotations

import os
import platform
import time

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from megatrain_jax.optim.fused_adamw import adamw_elem, bf16_rne, bias_correction, grad_f32, launch

BLOCK = 2048
CHUNK_BLOCKS = 16  # blocks a thread takes from the kernel's work queue at a time (32768 values)


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
# table), so one table entry per bucket and sign gives the index with one add and no compare or loop.
# Outside the buckets the index is a constant: every |x| < 2**-24 has code 0.0 nearest (the smallest
# nonzero code magnitude is 3.25e-7), every x > 1 has code 1.0 (index 255) and every x < -1 index 0
# (the clamp reproduces both), and a NaN sorts last in the binary search (index 255), which the lookup
# treats as a positive x > 1.
#
# The word of x (``_slot_word``, a few SIMD integer operations): ``w = (slot << 16) | key``, with
# ``a`` the clamped magnitude bits, ``slot`` its bucket (``(a - LO) >> 16``; ``| LOOKUP_NEG`` when
# x < 0) and ``key`` the low 16 bits of ``a - LO``, inverted when x < 0, so that the index grows with
# the key in every slot. Both come from one XOR: ``w = (a - LO) ^ (x < 0 ? NEG << 16 | 0xFFFF : 0)``
# (every bucket is below LOOKUP_NEG, so XOR adds it). The table entry of the slot is
# ``E = (i0 << 16) + (0x10000 - step) - (slot << 16)`` (mod 2**32), with ``i0`` the index at key 0 and
# ``step`` the first key of index ``i0 + 1`` (0x10000: none), so that
# ``E + w = (i0 << 16) + 0x10000 + (key - step)`` and the index is ``(E + w) >> 16`` (truncated to 8
# bits): the carry out of the low half is the compare. One gather and two integer operations per value.
LOOKUP_SHIFT = 16
LOOKUP_LO = 0x33800000  # float32 bits of 2**-24
LOOKUP_HI = 0x3F800000  # float32 bits of 1.0
LOOKUP_BUCKETS = ((LOOKUP_HI - LOOKUP_LO) >> LOOKUP_SHIFT) + 1  # per sign: 3073
LOOKUP_NEG = 1 << 12  # slot of a negative x: its bucket | LOOKUP_NEG
LOOKUP_SLOTS = LOOKUP_NEG + LOOKUP_BUCKETS  # table entries (slots 3073..4095 are never used)
_KEYS = 1 << LOOKUP_SHIFT


def _slot_floats(slot: np.ndarray, key: np.ndarray) -> np.ndarray:
    """The float32 x of table slot ``slot`` and key ``key`` (int64 arrays; see above); keys past the
    clamp (the last bucket holds one float per sign) give the clamped float, as the kernel does."""
    neg = slot >= LOOKUP_NEG
    low = np.where(neg, key ^ (_KEYS - 1), key)
    a = np.minimum(LOOKUP_LO + ((slot & (LOOKUP_NEG - 1)) << LOOKUP_SHIFT) + low, LOOKUP_HI)
    return (a.astype(np.uint32) | (neg.astype(np.uint32) << np.uint32(31))).view(np.float32)


def _lookup_table(code: np.ndarray) -> np.ndarray:
    """uint32 entries by slot: ``E = (i0 << 16) + (0x10000 - step) - (slot << 16)`` (see above), built
    from ``_nearest_np`` itself (the reference): the index at each slot's first and last key and,
    where they differ, a binary search for the key where it steps; monotonicity makes the two-valued
    step function equal to it everywhere (tests/test_compact_adamw.py proves it for every float)."""
    slots = np.concatenate([np.arange(LOOKUP_BUCKETS), LOOKUP_NEG + np.arange(LOOKUP_BUCKETS)]).astype(np.int64)

    def f(key):
        return _nearest_np(code, _slot_floats(slots, key)).astype(np.int64)

    k0 = np.zeros_like(slots)
    i0, i1 = f(k0), f(k0 + _KEYS - 1)
    if not np.all((i1 == i0) | (i1 == i0 + 1)):
        raise AssertionError("a lookup bucket holds more than one step of the nearest index")
    lo, hi = k0, k0 + _KEYS - 1  # where it steps: f(lo) == i0 != f(hi); find the first key with f != i0
    while True:
        active = (i1 != i0) & (hi - lo > 1)
        if not active.any():
            break
        mid = (lo + hi) // 2
        same = f(mid) == i0
        lo = np.where(active & same, mid, lo)
        hi = np.where(active & ~same, mid, hi)
    step = np.where(i1 != i0, hi, _KEYS)
    tab = np.zeros(LOOKUP_SLOTS, np.int64)
    tab[slots] = ((i0 << LOOKUP_SHIFT) + (_KEYS - step) - (slots << LOOKUP_SHIFT)) & 0xFFFFFFFF
    return tab.astype(np.uint32)


def _table_steps(tab: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decode a table: (slots, index at key 0, first key of the next index or 0x10000), int64 arrays."""
    slots = np.concatenate([np.arange(LOOKUP_BUCKETS), LOOKUP_NEG + np.arange(LOOKUP_BUCKETS)]).astype(np.int64)
    c = (tab[slots].astype(np.int64) + (slots << LOOKUP_SHIFT)) & 0xFFFFFFFF
    part = c & (_KEYS - 1)
    return slots, c >> LOOKUP_SHIFT, np.where(part == 0, _KEYS, _KEYS - part)


@intrinsic
def _slot_word(typingctx, x):
    """float32 x -> its lookup word ``(slot << 16) | key`` (uint32), in 32-bit integer IR."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        (v,) = args
        a = builder.and_(builder.bitcast(v, i32), ir.Constant(i32, 0x7FFFFFFF))
        lo, hi = ir.Constant(i32, LOOKUP_LO), ir.Constant(i32, LOOKUP_HI)
        a = builder.select(builder.icmp_signed("<", a, lo), lo, a)
        a = builder.select(builder.icmp_signed(">", a, hi), hi, a)  # NaN magnitudes too: index 255
        neg = builder.fcmp_ordered("<", v, ir.Constant(ir.FloatType(), 0.0))  # false for -0.0 and NaN
        flip = builder.select(neg, ir.Constant(i32, (LOOKUP_NEG << LOOKUP_SHIFT) | (_KEYS - 1)), ir.Constant(i32, 0))
        return builder.xor(builder.sub(a, lo), flip)

    return types.uint32(types.float32), codegen


@intrinsic
def _word_slot(typingctx, w):
    """lookup word -> table slot (uint32)."""
    if w != types.uint32:
        return None

    def codegen(context, builder, signature, args):
        return builder.lshr(args[0], ir.Constant(ir.IntType(32), LOOKUP_SHIFT))

    return types.uint32(types.uint32), codegen


@intrinsic
def _word_index(typingctx, entry, w):
    """(table entry of the word's slot, lookup word) -> the nearest code index (uint8)."""
    if entry != types.uint32 or w != types.uint32:
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        s = builder.lshr(builder.add(args[0], args[1]), ir.Constant(i32, LOOKUP_SHIFT))
        return builder.trunc(s, ir.IntType(8))

    return types.uint8(types.uint32, types.uint32), codegen


@njit(inline="always")
def _nearest(tab, x):
    """Index of the code value nearest ``x`` (ties: the lower one), ``tab = _lookup_table(code)``:
    equal to ``_nearest_np`` for every float32."""
    w = _slot_word(x)
    return _word_index(tab[_word_slot(w)], w)


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


# --------------------------------------------------------------------------- gathers: hw or sw

# The kernel's loops gather (code values by the old indices, table entries by slot); see the module
# docstring for why there are two variants: "hw" (LLVM's choice of gather instructions) and "sw"
# (the parfor body compiled with the x86 tuning flag ``prefer-no-gather``: scalar loads into vector
# lanes everywhere). ``adamw_int8_step`` times both on its first calls and keeps the faster one
# (``int8_gather_mode``); both give the same bits.
GATHER_MODES = ("hw", "sw")
_POLICY = {"hw": np.uint8(0), "sw": np.uint16(0)}  # the type of the policy argument selects the variant


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


@intrinsic
def _gather_policy(typingctx, policy):
    """No run-time effect. With a uint16 ``policy`` (mode "sw") it marks the function being compiled
    (the parfor body) ``prefer-no-gather`` on x86: numba's target features plus that tuning flag."""
    if policy not in (types.uint8, types.uint16):
        return None
    no_gather = policy == types.uint16

    def codegen(context, builder, signature, args):
        if no_gather and _x86():
            try:
                feats = context.codegen()._tm_features  # what numba's target machine uses (host ISA)
                attr = '"target-features"="%s"' % ",".join(f for f in (feats, "+prefer-no-gather") if f)
                set.add(builder.function.attributes, attr)  # llvmlite accepts only known attribute names
            except Exception:  # noqa: BLE001 - another numba or llvmlite: the variant compiles as "hw"
                pass
        return context.get_dummy_value()

    return types.none(policy), codegen


@intrinsic
def _fetch_add(typingctx, arr, idx, val):
    """``old = arr[idx]; arr[idx] += val`` as one atomic operation (int64 array): the work queue."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and isinstance(idx, types.Integer)
            and val == types.int64):
        return None

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        i = context.cast(builder, args[1], signature.args[1], types.intp)
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [i])
        return builder.atomic_rmw("add", ptr, args[2], "monotonic")

    return types.int64(arr, idx, val), codegen


# ----------------------------------------------------------------------------- the int8 kernel


@njit(parallel=True, fastmath=False, cache=True, nogil=True, error_model="numpy")
def _adamw_int8_core(param, grad, mq, ms, vq, vs, bf16_out, code_s, code_u, tab_s, tab_u, queue, nthreads, policy,
                     nlr, b1, omb1, b2, omb2, rbc1, rbc2, eps, eps_root, wd, gs):
    """One parfor iteration per thread; each takes chunks of ``CHUNK_BLOCKS`` blocks from ``queue[0]``
    (an atomic counter, zero at the start) until none is left, and has one scratch row pair (2 x 2048
    float32, in L1/L2) that holds a block's new moments and then, in place, their lookup words.
    Everything is in the parfor body: a call that passes arrays increfs each of them, atomically on a
    refcount that all threads share (and a view per block would do the same); and only the parfor
    body gets ``noalias`` arguments, which LLVM needs to vectorize the gathers. Arrays must not
    overlap. Per block, five loops that LLVM vectorizes:

    1. dequantize (gather the code values of the old indices) and update: the AdamW arithmetic of
       ``adamw_elem`` (sqrt and divide are IEEE vector instructions, no fastmath), the new params,
       the new moments into the scratch rows, their absmax as an integer max of the magnitude bits;
    2. the bfloat16 copy of the new params;
    3. the lookup words of m * (1 / absmax) and v * (1 / absmax), in place;
    4, 5. the new indices of m, then of v: one table gather and an add per value.
    ``policy`` (uint8: "hw", uint16: "sw") only selects the compiled variant."""
    n = param.shape[0]
    nblocks = (n + BLOCK - 1) // BLOCK
    nchunks = (nblocks + CHUNK_BLOCKS - 1) // CHUNK_BLOCKS
    write_bf16 = bf16_out.shape[0] == n
    decay = wd != np.float32(0.0)
    zero = np.float32(0.0)
    for t in prange(min(nthreads, nchunks)):
        _gather_policy(policy)
        sc = np.empty(2 * BLOCK, np.float32)  # m at [0, BLOCK), v at [BLOCK, 2 * BLOCK)
        ws = sc.view(np.uint32)  # the same rows, reused for the lookup words
        while True:
            c = _fetch_add(queue, 0, np.int64(1))
            if c >= nchunks:
                break
            for b in range(c * CHUNK_BLOCKS, min((c + 1) * CHUNK_BLOCKS, nblocks)):
                lo = np.uint64(b) * np.uint64(BLOCK)
                cnt = min(np.uint64(BLOCK), np.uint64(n) - lo)
                am, av = ms[b], vs[b]
                mx_m = np.uint32(0)
                mx_v = np.uint32(0)
                for j in range(cnt):
                    p, m, v = adamw_elem(param[lo + j], grad[lo + j], code_s[mq[lo + j]] * am, code_u[vq[lo + j]] * av,
                                          gs, nlr, b1, omb1, b2, omb2, rbc1, rbc2, eps, eps_root, wd, decay)
                    param[lo + j] = p
                    sc[j] = m
                    sc[BLOCK + j] = v
                    mx_m = max(mx_m, _abs_bits(m))
                    mx_v = max(mx_v, _abs_bits(v))
                if write_bf16:
                    for j in range(cnt):
                        bf16_out[lo + j] = bf16_rne(param[lo + j])
                am, av = _bits_f32(mx_m), _bits_f32(mx_v)
                rm = np.float32(1.0) / am if am > zero else zero
                rv = np.float32(1.0) / av if av > zero else zero
                for j in range(cnt):
                    ws[j] = _slot_word(sc[j] * rm)
                    ws[BLOCK + j] = _slot_word(sc[BLOCK + j] * rv)
                for j in range(cnt):
                    w = ws[j]
                    mq[lo + j] = _word_index(tab_s[_word_slot(w)], w)
                for j in range(cnt):
                    w = ws[BLOCK + j]
                    vq[lo + j] = _word_index(tab_u[_word_slot(w)], w)
                ms[b], vs[b] = am, av


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
        g = grad_f32(grad[i]) * gs
        m = omb1 * g + b1 * _bf16_bits_to_f32(mu[i])
        v = omb2 * (g * g) + b2 * _bf16_bits_to_f32(nu[i])
        u = (m * rbc1) / (np.sqrt(v * rbc2 + eps_root) + eps)
        p = param[i]
        if decay:
            u = u + wd * p
        p = p + nlr * u
        param[i] = p
        mu[i] = bf16_rne(m)
        nu[i] = bf16_rne(v)
        if write_bf16:
            bf16_out[i] = bf16_rne(p)


def adamw_scalars(lr, b1, b2, eps, eps_root, weight_decay, count, grad_scale):
    """The step's 11 float32 scalars as the kernels take them (negated lr, betas and their complements,
    inverse bias corrections, eps, eps_root, weight decay, gradient scale). Public: optim/host.py hands them
    to the device-side update."""
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


class _GatherChoice:
    """Which kernel variant (``GATHER_MODES``) ``adamw_int8_step`` runs. ``MEGATRAIN_INT8_GATHER`` =
    hw | sw forces one; unset or ``auto``: the calls alternate between the two until each has been
    timed on ``TRIALS`` calls of at least ``MIN_ELEMS`` values (the first call of each is left out:
    it loads or compiles the kernel), then the one with the higher median rate stays. All of it runs
    under the kernel lock. The variants give the same bits, so the choice changes only the speed."""

    TRIALS = 3
    MIN_ELEMS = 1 << 20

    def __init__(self):
        env = os.environ.get("MEGATRAIN_INT8_GATHER", "auto")
        # a bad value must not fail the import with a traceback: ``check_gather_env`` refuses it in one
        # line when an int8 optimizer is built
        self.bad_env = None if env in GATHER_MODES + ("auto",) else env
        self.reset("auto" if self.bad_env else env)

    def reset(self, mode: str = "auto") -> None:
        if mode not in GATHER_MODES + ("auto",):
            raise ValueError(f"MEGATRAIN_INT8_GATHER must be auto, hw or sw, got {mode!r}")
        self.chosen = None if mode == "auto" else mode
        self.calls = {m: 0 for m in GATHER_MODES}
        self.rates: dict[str, list[float]] = {m: [] for m in GATHER_MODES}

    def next(self) -> str:
        if self.chosen is not None:
            return self.chosen
        return min(GATHER_MODES, key=lambda m: (self.calls[m], GATHER_MODES.index(m)))

    def record(self, mode: str, n: int, seconds: float) -> None:
        if self.chosen is not None:
            return
        self.calls[mode] += 1
        if self.calls[mode] > 1 and n >= self.MIN_ELEMS and seconds > 0:
            self.rates[mode].append(n / seconds)
        if all(len(r) >= self.TRIALS for r in self.rates.values()):
            self.chosen = max(GATHER_MODES, key=lambda m: float(np.median(self.rates[m])))


_GATHER = _GatherChoice()


def check_gather_env() -> None:
    """``MEGATRAIN_INT8_GATHER`` must be auto, hw or sw: a ``UserError`` (one line, exit 2) otherwise."""
    if _GATHER.bad_env is not None:
        from megatrain_jax.errors import UserError

        raise UserError("MEGATRAIN_INT8_GATHER", f"must be auto, hw or sw, got {_GATHER.bad_env!r}",
                        "unset it (auto: the faster variant is timed and kept) or set hw or sw")


def int8_gather_mode(mode: str | None = None) -> str | None:
    """The int8 kernel variant in use: "hw" or "sw", or None while ``auto`` is still timing them.
    ``mode`` (hw, sw or auto) sets it, as ``MEGATRAIN_INT8_GATHER`` does at import."""
    with launch:
        if mode is not None:
            _GATHER.reset(mode)
        return _GATHER.chosen


def int8_gather_rates() -> dict[str, list[float]]:
    """The elements/s that ``auto`` measured per variant (diagnostics)."""
    return {m: list(r) for m, r in _GATHER.rates.items()}


def adamw_int8_step(param, grad, state, bf16_out, *, lr, b1, b2, eps, eps_root, weight_decay, count,
                    grad_scale=1.0, gather: str | None = None) -> None:
    """One in-place step; ``state``: ``mu_q``/``nu_q`` uint8 (n,), ``mu_scale``/``nu_scale`` float32
    (ceil(n / BLOCK),). ``param`` must start at a block boundary of the group (slices from the
    engine are BLOCK-aligned: ``chunk_align``). No two of the arrays may overlap (the kernel is
    compiled assuming they do not). ``gather`` ("hw" or "sw") runs that variant of the kernel
    (default: ``int8_gather_mode``)."""
    if gather is not None and gather not in GATHER_MODES:
        raise ValueError(f"gather must be one of {GATHER_MODES} or None, got {gather!r}")
    args = (param, grad, state["mu_q"], state["mu_scale"], state["nu_q"], state["nu_scale"],
            _EMPTY_U16 if bf16_out is None else bf16_out, CODE_SIGNED, CODE_UNSIGNED)
    scalars = adamw_scalars(lr, b1, b2, eps, eps_root, weight_decay, count, grad_scale)
    with launch:
        tab_s, tab_u = lookup_tables()
        mode = _GATHER.next() if gather is None else gather
        t = time.perf_counter()
        queue = np.zeros(1, np.int64)
        _adamw_int8_core(*args, tab_s, tab_u, queue, numba.get_num_threads(), _POLICY[mode], *scalars)
        if gather is None:
            _GATHER.record(mode, param.shape[0], time.perf_counter() - t)


def adamw_bf16_step(param, grad, state, bf16_out, *, lr, b1, b2, eps, eps_root, weight_decay, count,
                    grad_scale=1.0) -> None:
    """One in-place step; ``state``: ``mu_bf16``/``nu_bf16`` uint16 bf16 bits (n,)."""
    with launch:
        _adamw_bf16_core(param, grad, state["mu_bf16"], state["nu_bf16"], _EMPTY_U16 if bf16_out is None else bf16_out,
                         *adamw_scalars(lr, b1, b2, eps, eps_root, weight_decay, count, grad_scale))


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
    nlr, b1f, omb1, b2f, omb2, rbc1, rbc2, epsf, eps_rootf, wd, gs = adamw_scalars(lr, b1, b2, eps, eps_root,
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
