"""The AdamW step of the host kernels as jitted JAX functions, for arrays already on the device.

Why: with the optimizer state streamed, the GPU can update a layer itself while that layer's state
crosses PCIe, instead of the host's numba kernel (``fused_adamw.py``, ``compact_adamw.py``) updating
it in host memory. A run must not change its numbers with where the update ran, so every mode
reproduces its host kernel operation by operation, in float32, with the scalars of
``compact_adamw.adamw_scalars`` (one float32 array argument, not static: one compilation serves every step):

- ``float32``: ``fused_adamw._adamw_core`` (state ``mu``, ``nu`` float32);
- ``bfloat16``: ``compact_adamw._adamw_bf16_core`` (``mu_bf16``, ``nu_bf16``: bf16 bits, RNE);
- ``int8``: ``compact_adamw.reference_int8_step`` / ``_adamw_int8_core`` (``mu_q``, ``nu_q`` uint8,
  ``mu_scale``, ``nu_scale`` float32 per 2048-value block; the last block may be partial): the same
  absmax (an integer max of the magnitude bits), reciprocal, lookup words and table
  (``lookup_tables``) in uint32 arithmetic, so the codes are the host's codes.

What XLA would change, and what this module does about it (each at no memory traffic):

- FMA contraction: XLA's CPU and GPU backends let LLVM fuse ``a*b + c`` into one FMA (no flag turns
  that off; ``xla_cpu_enable_fast_math`` is already false), which changes the last bits of ``m``,
  ``v``, ``u`` and ``p`` (a plain jnp version, on this CPU: 13-18% of the moments and 0.3% of the
  params differ from step 2 on, ``m`` by up to 1600 ulp where ``omb1*g`` and ``b1*m`` cancel). So
  every product that feeds an add is passed through ``r`` in ``_update``: its bits XOR a zero the
  compiler cannot see (the 12th scalar), so it is rounded to float32 first, as the host rounds it.
  One integer op per product; without it the bit-exactness tests fail.
- Division and square root: XLA:GPU compiles float32 ``/`` to ``div.full.f32`` (up to 2 ulp:
  ``-nvptx-prec-divf32=1`` in xla/service/gpu/llvm_gpu_backend/nvptx_backend.cc), and its float32
  sqrt has been reported not correctly rounded (pearu/functional_algorithms#53). Both are computed
  in float64 and rounded once to float32: the float64 quotient or root of float32 operands, rounded
  to float32, is the correctly rounded float32 result (53 >= 2*24 + 2: double rounding is innocuous
  for / and sqrt), and float64 / and sqrt are IEEE on CUDA. On the CPU this changes nothing (XLA:CPU's
  float32 / and sqrt are IEEE already). Cost: ~two float64 sequences per value, far below the
  memory time on an H100 (FP64 at half the FP32 rate); a GPU with 1/64-rate FP64 would feel it. It
  needs 64-bit types while tracing: the calls run under ``jax.enable_x64(True)`` (thread-local).
- Comparisons that depend on the sign or NaN-ness of a value (``_slot_word``, bf16 NaN) are done on
  the bits (``wd != 0``, ``absmax > 0`` too), so every branch and lookup takes the host's path for
  -0.0, NaN and subnormal values alike; only arithmetic is left to the backend.

Exactness, established on the CPU backend (tests/test_device_adamw.py): params, moments, bf16 bits,
int8 codes and scales are bit-identical to the host kernels and to ``reference_int8_step`` for normal
float32 values, weight decay zero or not, a float32 or bfloat16 gradient (upcast exactly). What
differs on CPU: XLA:CPU runs with flush-to-zero and denormals-are-zero (set by its runtime, not by a
flag: ``--xla_cpu_ftz=false`` does not change it), so any subnormal input or intermediate (|x| <
1.2e-38, e.g. ``g*g`` for |g| < 1.1e-19) becomes 0 where the host keeps it. The differences stay
in the elements (int8: the blocks) where a subnormal occurs; for ``nu`` of |g| ~ 1e-20 (tested) only
that ``nu`` differs, by the subnormal itself (its root vanishes next to eps). NaN payloads and signs
follow the backend's arithmetic, not the host's (only where a value is NaN anyway). On the GPU
(``xla_gpu_ftz`` defaults to false, mul/add are IEEE, FMA blocked, / and sqrt as above) it was expected
bit-identical, and measured on an H100 it is not quite: after three steps of a tiny model
~7% of master values differ from the host kernel's by at most 1.6e-5 relative (fp32 moments), and 4 of
6,661 int8 codes by one step. Where the GPU still differs is not found yet; the tests take a tolerance
on a GPU and stay bit-exact on the CPU.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import megatrain_jax.optim.compact_adamw as _ca

BLOCK = _ca.BLOCK
STATE_KEYS = {"float32": ("mu", "nu"), "bfloat16": ("mu_bf16", "nu_bf16"),
              "int8": ("mu_q", "nu_q", "mu_scale", "nu_scale")}
_f32, _f64, _u32 = jnp.float32, jnp.float64, jnp.uint32


def _bits(x):
    return lax.bitcast_convert_type(x, _u32)


def _flt(b):
    return lax.bitcast_convert_type(b, _f32)


def _div(a, b):  # correctly rounded float32 a / b on every backend (see the docstring)
    return (a.astype(_f64) / b.astype(_f64)).astype(_f32)


def _sqrt(a):
    return jnp.sqrt(a.astype(_f64)).astype(_f32)


def _bf16_bits(x):
    """float32 -> bfloat16 bits (uint16), round to nearest even, NaN -> sign | 0x7fc0 (``fused_adamw.bf16_rne``)."""
    b = _bits(x)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    nan = ((b >> 16) & 0x8000) | 0x7FC0
    return jnp.where((b & 0x7FFFFFFF) > 0x7F800000, nan, r).astype(jnp.uint16)


def _update(p, g, m, v, s):
    """``fused_adamw.adamw_elem`` on whole arrays; ``s``: the 11 scalars of ``compact_adamw.adamw_scalars`` and a zero."""
    nlr, b1, omb1, b2, omb2, rbc1, rbc2, eps, eps_root, wd, gs, zero = (s[i] for i in range(12))
    z = _bits(zero)

    def r(x):  # x rounded to float32 before an add uses it: no FMA
        return _flt(_bits(x) ^ z)

    g = g.astype(_f32) * gs
    m = r(omb1 * g) + r(b1 * m)
    v = r(omb2 * (g * g)) + r(b2 * v)
    u = _div(m * rbc1, _sqrt(r(v * rbc2) + eps_root) + eps)
    u = jnp.where((_bits(wd) & 0x7FFFFFFF) != 0, u + r(wd * p), u)  # decay = wd != 0.0 (NaN: true)
    return p + r(nlr * u), m, v


def _step_f32(p, g, st, s):
    p, m, v = _update(p, g, st["mu"], st["nu"], s)
    return p, {"mu": m, "nu": v}


def _step_bf16(p, g, st, s):
    def up(b):
        return _flt(b.astype(_u32) << 16)

    p, m, v = _update(p, g, up(st["mu_bf16"]), up(st["nu_bf16"]), s)
    return p, {"mu_bf16": _bf16_bits(m), "nu_bf16": _bf16_bits(v)}


def nearest_code(tab, x):
    """``compact_adamw._nearest`` on the device: the lookup word of x, then one table entry and an add.
    Public: optim/lean.py quantizes with the same lookup."""
    b = _bits(x)
    a = jnp.clip(b & 0x7FFFFFFF, _ca.LOOKUP_LO, _ca.LOOKUP_HI)  # NaN magnitudes clamp to HI
    neg = (b > _u32(0x80000000)) & (b <= _u32(0xFF800000))  # x < 0 ordered: not -0.0, not NaN
    w = (a - _ca.LOOKUP_LO) ^ jnp.where(neg, _u32((_ca.LOOKUP_NEG << 16) | 0xFFFF), _u32(0))
    e = jnp.take(tab, (w >> 16).astype(jnp.int32), mode="clip")
    return (((e + w) >> 16) & 0xFF).astype(jnp.uint8)


def _step_int8(p, g, st, s):
    n = p.shape[0]
    nb = -(-n // BLOCK)
    code_s, code_u = jnp.asarray(_ca.CODE_SIGNED), jnp.asarray(_ca.CODE_UNSIGNED)
    tab_s, tab_u = (jnp.asarray(t) for t in _ca.lookup_tables())

    def per_value(scale):  # (nb,) -> (n,): each block's scale for its values (a broadcast: no constant
        # index array, which XLA spent seconds constant-folding per shape with jnp.repeat)
        return jnp.broadcast_to(scale[:, None], (nb, BLOCK)).reshape(nb * BLOCK)[:n]

    def absmax(x):  # max magnitude bits per block; the zero padding of a partial block is neutral
        return _flt(jnp.pad(_bits(x) & 0x7FFFFFFF, (0, nb * BLOCK - n)).reshape(nb, BLOCK).max(axis=1))

    def recip(a):  # a > 0 ? 1 / a : 0, for an absmax (no sign bit)
        return jnp.where((_bits(a) > 0) & (_bits(a) <= 0x7F800000), _div(jnp.ones_like(a), a), jnp.zeros_like(a))

    m = jnp.take(code_s, st["mu_q"].astype(jnp.int32), mode="clip") * per_value(st["mu_scale"])
    v = jnp.take(code_u, st["nu_q"].astype(jnp.int32), mode="clip") * per_value(st["nu_scale"])
    p, m, v = _update(p, g, m, v, s)
    am, av = absmax(m), absmax(v)
    mq = nearest_code(tab_s, m * per_value(recip(am)))
    vq = nearest_code(tab_u, v * per_value(recip(av)))
    return p, {"mu_q": mq, "nu_q": vq, "mu_scale": am, "nu_scale": av}


CHUNK = 8192 * BLOCK  # values per pass (16M, whole int8 blocks): bounds the step's temporaries


def _chunked(step):
    """``step`` over ``chunk``-value slices of the group, in place (a loop of dynamic slices and
    updates of the donated buffers): the temporaries of one slice (the int8 step's fp32 moments
    before requantization: up to 16 bytes per value) instead of the whole group's (12 GB for a 14B
    model's 0.78B-parameter embedding). The arithmetic is elementwise and blockwise, so slicing at
    block boundaries changes no value."""
    def run(p, g, st, s, chunk):
        n = p.shape[0]
        if n <= chunk:
            return step(p, g, st, s)
        per_block = {k: a.shape[0] != n for k, a in st.items()}

        def piece(lo, size, p, st):
            sl = {k: lax.dynamic_slice_in_dim(a, lo // BLOCK if per_block[k] else lo,
                                              -(-size // BLOCK) if per_block[k] else size) for k, a in st.items()}
            pn, sn = step(lax.dynamic_slice_in_dim(p, lo, size), lax.dynamic_slice_in_dim(g, lo, size), sl, s)
            p = lax.dynamic_update_slice_in_dim(p, pn, lo, 0)
            st = {k: lax.dynamic_update_slice_in_dim(a, sn[k], lo // BLOCK if per_block[k] else lo, 0)
                  for k, a in st.items()}
            return p, st

        full = n // chunk
        p, st = lax.fori_loop(0, full, lambda i, c: piece(i * chunk, chunk, *c), (p, st))
        if n % chunk:
            p, st = piece(full * chunk, n % chunk, p, st)
        return p, st
    return run


_STEPS = {"float32": _step_f32, "bfloat16": _step_bf16, "int8": _step_int8}
# elementwise over whole groups: not autotuned (the autotuner's redzone copies of a 2 GB group: engine/kernels.py)
_NO_AUTOTUNE = {"xla_gpu_autotune_level": 0}
_JITS = {mode: jax.jit(_chunked(fn), donate_argnums=(0, 2), static_argnums=(4,), compiler_options=_NO_AUTOTUNE)
         for mode, fn in _STEPS.items()}


@functools.lru_cache(maxsize=None)
def _sharded_jit(moments: str, mesh: Any, chunk: int, keys: tuple[str, ...]):
    """The same step on each device's share of a group (``engine/shards.py``): elementwise and blockwise, so
    every device updates its whole blocks alone, with no collective."""
    step, dat = _chunked(_STEPS[moments]), P("data")
    body = jax.shard_map(lambda p, g, st, s: step(p, g, st, s, chunk), mesh=mesh,
                         in_specs=(dat, dat, {k: dat for k in keys}, P()), out_specs=(dat, {k: dat for k in keys}),
                         check_vma=False)
    return jax.jit(body, donate_argnums=(0, 2), compiler_options=_NO_AUTOTUNE)


def device_adamw_step(moments: str, param, grad, state: dict, scalars, chunk: int | None = None,
                      mesh: Any = None) -> tuple[jax.Array, dict]:
    """moments: 'float32' | 'bfloat16' | 'int8'. param: f32 (n,) device array; grad f32/bf16 (n,);
    state: dict of device arrays with the keys above; scalars: the 11-tuple from compact_adamw.adamw_scalars (numpy f32).
    Returns (new param f32 (n,), new state dict with the same keys, dtypes, shapes).

    ``chunk``: values per slice (default ``CHUNK``; the plan's ``device_update_chunk``), whole blocks.

    ``mesh``: the arrays are split over its devices in equal shares of whole blocks (``engine/shards.py``), and
    each device updates its own share.

    ``param`` and the state arrays are donated: do not use them after the call."""
    chunk = CHUNK if chunk is None else int(chunk)
    if chunk < BLOCK or chunk % BLOCK:
        raise ValueError(f"chunk must be a positive multiple of {BLOCK} values, got {chunk}")
    if moments not in _JITS:
        raise ValueError(f"moments must be one of {tuple(_JITS)}, got {moments!r}")
    if set(state) != set(STATE_KEYS[moments]):
        raise ValueError(f"{moments} state needs keys {STATE_KEYS[moments]}, got {sorted(state)}")
    if param.dtype != jnp.float32 or grad.dtype not in (jnp.float32, jnp.bfloat16) or param.shape != grad.shape \
            or param.ndim != 1:
        raise TypeError(f"param must be float32 (n,) and grad float32 or bfloat16 of its shape, got "
                        f"{param.dtype} {param.shape} and {grad.dtype} {grad.shape}")
    if len(scalars) != 11:
        raise ValueError(f"scalars: the 11 values of compact_adamw.adamw_scalars, got {len(scalars)}")
    s = np.array([*scalars, 0.0], np.float32)  # the zero: see ``_update``
    with jax.enable_x64(True):  # float64 / and sqrt inside; thread-local
        if mesh is not None:
            return _sharded_jit(moments, mesh, chunk, tuple(sorted(state)))(param, grad, dict(state), s)
        return _JITS[moments](param, grad, dict(state), s, chunk)
