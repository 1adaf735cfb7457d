"""A fused, multi-threaded AdamW step on host fp32 buffers that matches ``optax.adamw`` exactly.

One pass over memory: per element it reads p, g, m, v and writes p, m, v and the bfloat16 copy of the
new p (the copy the engine streams to the GPU). The arithmetic follows optax 0.2.8 operation by
operation, in float32, with every scalar rounded to float32 the way JAX rounds a weakly typed Python
float (``optax/_src/transform.py: scale_by_adam``, ``optax/tree_utils/_tree_math.py``)::

    g   = g * grad_scale                          # clipping factor, 1.0 when not clipping
    mu  = f32(1 - b1) * g     + f32(b1) * mu      # tree_update_moment, order 1
    nu  = f32(1 - b2) * (g*g) + f32(b2) * nu      # tree_update_moment_per_elem_norm, order 2
    u   = (mu * (1/bc1)) / (sqrt(nu * (1/bc2) + eps_root) + eps)  # bc = 1 - b**count, float32
    u   = u + f32(wd) * p                         # add_decayed_weights (skipped when wd == 0.0)
    p   = p + f32(-lr) * u                        # scale_by_learning_rate, apply_updates

The bias corrections ``1 - b**count`` are computed by XLA in float32 inside optax; ``bias_correction``
asks JAX's CPU backend for the very same value (cached per count), so it is bit-identical. XLA's
algebraic simplifier turns optax's ``mu / bc`` (a divide by a broadcast scalar) into ``mu * (1 / bc)``,
so the kernel multiplies by the float32 reciprocal too. With that, the kernel is bit-identical to
optax run eagerly (op by op); a jitted optax step differs by 1 ulp here and there, because XLA fuses
``a*b + c`` into FMAs.

Thread safety: numba's ``workqueue`` layer aborts when two Python threads launch parallel kernels at
once, and with ``omp`` or ``tbb`` concurrent launches only oversubscribe the cores of a kernel that is
memory-bound anyway. So every launch from this module goes through one lock (``KERNEL_LOCK``); the
kernels are compiled ``nogil=True``, so other Python threads run while one kernel runs.
"""
from __future__ import annotations

import functools
import threading

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

KERNEL_LOCK = threading.Lock()
_num_threads: int | None = None  # None: numba's default (NUMBA_NUM_THREADS, i.e. all cores)


def set_num_threads(n: int | None) -> None:
    """Threads for every kernel launched from this module, from any Python thread (None: all cores).

    ``numba.set_num_threads`` is thread-local, so the launch wrapper re-applies this setting in the
    calling thread."""
    global _num_threads
    if n is not None and not 1 <= n <= numba.config.NUMBA_NUM_THREADS:
        raise ValueError(f"threads must be in 1..{numba.config.NUMBA_NUM_THREADS}, got {n}")
    _num_threads = n


def get_num_threads() -> int:
    return _num_threads or numba.config.NUMBA_NUM_THREADS


class _Launch:
    """Context manager: take the kernel lock and set the thread count in this thread."""

    def __enter__(self):
        KERNEL_LOCK.acquire()
        n = get_num_threads()
        if numba.get_num_threads() != n:
            numba.set_num_threads(n)

    def __exit__(self, *exc):
        KERNEL_LOCK.release()


launch = _Launch()


# ------------------------------------------------------------------------------------- bfloat16 bits


@intrinsic
def bf16_rne(typingctx, x):
    """float32 -> bfloat16 bits, round to nearest even, as XLA converts (NaN -> sign | 0x7fc0).

    Written in LLVM IR so the integer work stays in 32-bit lanes (numba would widen it to 64 bits)::

        b = bits(x); r = (b + 0x7fff + ((b >> 16) & 1)) >> 16; nan: ((b >> 16) & 0x8000) | 0x7fc0

    Public: compact_adamw.py's kernels round the same way."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        (v,) = args
        i32, i16 = ir.IntType(32), ir.IntType(16)
        b = builder.bitcast(v, i32)
        hi = builder.lshr(b, ir.Constant(i32, 16))
        r = builder.add(builder.add(b, ir.Constant(i32, 0x7FFF)), builder.and_(hi, ir.Constant(i32, 1)))
        r = builder.lshr(r, ir.Constant(i32, 16))
        nan = builder.or_(builder.and_(hi, ir.Constant(i32, 0x8000)), ir.Constant(i32, 0x7FC0))
        isnan = builder.fcmp_unordered("uno", v, v)
        return builder.trunc(builder.select(isnan, nan, r), i16)

    return types.uint16(types.float32), codegen


@njit(parallel=True, fastmath=False, cache=True, nogil=True)
def _to_bf16_kernel(src, out):
    for i in prange(src.shape[0]):
        out[i] = bf16_rne(src[i])


# --------------------------------------------------------------------------------------- the kernel


@intrinsic
def grad_f32(typingctx, g):
    """A gradient value as float32: float32 as it is, or bfloat16 bits (uint16, a bf16 hold read as it
    waits) widened exactly, so the kernels take a bf16 gradient without a widening pass over it first."""
    if g == types.float32:
        return types.float32(types.float32), lambda context, builder, signature, args: args[0]
    if g != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        return builder.bitcast(builder.shl(builder.zext(args[0], i32), ir.Constant(i32, 16)), ir.FloatType())

    return types.float32(types.uint16), codegen


@njit(inline="always")
def adamw_elem(p, g, m, v, gs, nlr, b1, omb1, b2, omb2, rbc1, rbc2, eps, eps_root, wd, decay):
    """One element's AdamW step: (new param, new m, new v) in float32. Public: compact_adamw.py's kernels
    run the same element step."""
    g = grad_f32(g) * gs
    m = omb1 * g + b1 * m
    v = omb2 * (g * g) + b2 * v
    u = (m * rbc1) / (np.sqrt(v * rbc2 + eps_root) + eps)
    if decay:
        u = u + wd * p
    return p + nlr * u, m, v


@njit(parallel=True, fastmath=False, cache=True, nogil=True)
def _adamw_core(param, grad, mu, nu, bf16_out, nlr, b1, omb1, b2, omb2, rbc1, rbc2, eps, eps_root, wd,
                gs):
    """All scalars float32 and already rounded as optax rounds them: ``nlr`` is ``-lr``, ``rbc`` is
    ``f32(1) / bc`` (XLA rewrites ``x / broadcast(bc)`` as ``x * (1 / bc)``, so optax multiplies)."""
    n = param.shape[0]
    decay = wd != np.float32(0.0)
    if bf16_out.shape[0] == n:
        for i in prange(n):
            p, m, v = adamw_elem(param[i], grad[i], mu[i], nu[i], gs, nlr, b1, omb1, b2, omb2, rbc1,
                                  rbc2, eps, eps_root, wd, decay)
            param[i] = p
            mu[i] = m
            nu[i] = v
            bf16_out[i] = bf16_rne(p)
    else:
        for i in prange(n):
            p, m, v = adamw_elem(param[i], grad[i], mu[i], nu[i], gs, nlr, b1, omb1, b2, omb2, rbc1,
                                  rbc2, eps, eps_root, wd, decay)
            param[i] = p
            mu[i] = m
            nu[i] = v


@njit(cache=True, nogil=True)
def _bias_correction_f32(decay, count):
    # XLA's float32 pow of f32(decay) agrees with the correctly rounded power almost always (2 counts in
    # 20000 differ by 1 ulp for b=0.999); ``bias_correction`` below gives the exact XLA value.
    return np.float32(1.0) - np.float32(np.float64(np.float32(decay)) ** count)


@njit(nogil=True, cache=True)
def adamw_update_(param, grad, mu, nu, bf16_out, lr, b1, b2, eps, eps_root, weight_decay, count,
                  grad_scale):
    """One AdamW step in place on ``param``, ``mu``, ``nu`` (1-D contiguous float32) and, when
    ``bf16_out`` (uint16) has the same length, the bfloat16 bits of the new ``param``; a zero-length
    ``bf16_out`` means "don't write". ``count`` is the 1-based step (bias correction), ``grad_scale``
    multiplies the gradient first (global-norm clipping). Scalars are Python floats.

    No checks and no lock here: use ``fused_adamw_step`` unless you call it from numba."""
    _adamw_core(param, grad, mu, nu, bf16_out, np.float32(-lr), np.float32(b1), np.float32(1.0 - b1),
                np.float32(b2), np.float32(1.0 - b2), np.float32(1.0) / _bias_correction_f32(b1, count),
                np.float32(1.0) / _bias_correction_f32(b2, count), np.float32(eps), np.float32(eps_root),
                np.float32(weight_decay), np.float32(grad_scale))


# ------------------------------------------------------------------------------- exact constants


@functools.lru_cache(maxsize=None)
def _cpu_device():
    import jax

    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS excludes cpu
        return None


@functools.lru_cache(maxsize=64)
def _bias_correction_fn(decay: float):
    import jax

    return jax.jit(lambda c: 1 - decay ** c)  # the expression of optax.tree.bias_correction


@functools.lru_cache(maxsize=4096)
def bias_correction(decay: float, count: int) -> np.float32:
    """``1 - decay**count`` exactly as optax computes it (XLA, float32, on the CPU device)."""
    dev = _cpu_device()
    if dev is None:
        return np.float32(_bias_correction_f32(decay, count))
    import jax

    c = jax.device_put(np.int32(min(count, np.iinfo(np.int32).max)), dev)
    return np.float32(_bias_correction_fn(float(decay))(c))


# ----------------------------------------------------------------------------------- checked entry


def _check(name: str, a: np.ndarray, dtype, n: int | None) -> None:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(a).__name__}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if a.dtype not in dtypes or a.ndim != 1 or not a.flags.c_contiguous:
        raise TypeError(f"{name} must be a 1-D contiguous {' or '.join(str(np.dtype(d)) for d in dtypes)} array, "
                        f"got {a.dtype} with shape {a.shape} (contiguous: {a.flags.c_contiguous})")
    if n is not None and a.shape[0] != n:
        raise ValueError(f"{name} has {a.shape[0]} elements, expected {n}")
    if not a.flags.writeable and name != "grad":
        raise ValueError(f"{name} is read-only; the update writes it in place")


_EMPTY_U16 = np.zeros(0, np.uint16)


def fused_adamw_step(param: np.ndarray, grad: np.ndarray, mu: np.ndarray, nu: np.ndarray,
                     bf16_out: np.ndarray | None, *, lr: float, b1: float, b2: float, eps: float,
                     eps_root: float, weight_decay: float, count: int, grad_scale: float = 1.0) -> None:
    """Checked, locked ``adamw_update_`` with optax-exact bias corrections. ``lr`` is the learning rate
    of this step (a float, or a float32 that a schedule returned). ``grad``: float32, or the bfloat16 bits
    of a bf16 gradient as uint16 (widened in the kernel: no pass over it first)."""
    n = param.shape[0] if isinstance(param, np.ndarray) else None
    _check("param", param, np.float32, None)
    _check("grad", grad, (np.float32, np.uint16), n)  # uint16: bfloat16 bits (grad_f32)
    _check("mu", mu, np.float32, n)
    _check("nu", nu, np.float32, n)
    if bf16_out is None:
        bf16_out = _EMPTY_U16
    elif bf16_out.shape[0] != 0:
        _check("bf16_out", bf16_out, np.uint16, n)
    if count < 1:
        raise ValueError(f"count is the 1-based step number, got {count}")
    with launch:
        _adamw_core(param, grad, mu, nu, bf16_out, np.float32(-np.float32(lr)), np.float32(b1),
                    np.float32(1.0 - b1), np.float32(b2), np.float32(1.0 - b2),
                    np.float32(1.0) / bias_correction(b1, count),
                    np.float32(1.0) / bias_correction(b2, count), np.float32(eps),
                    np.float32(eps_root), np.float32(weight_decay), np.float32(grad_scale))


def to_bf16_bits_(src: np.ndarray, out: np.ndarray) -> None:
    """Parallel float32 -> bfloat16 bits (round to nearest even, as XLA), into ``out`` (uint16)."""
    _check("src", src, np.float32, None)
    _check("out", out, np.uint16, src.shape[0])
    with launch:
        _to_bf16_kernel(src, out)


# --------------------------------------------------------------------------- numpy helpers (tests)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even, NaN -> sign | 0x7fc0."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = ((b + np.uint32(0x7FFF) + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (((b >> 16) & 0x8000) | 0x7FC0).astype(np.uint16)
    return np.where(np.isnan(x), nan, r)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
