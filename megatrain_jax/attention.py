"""One attention entry point that picks its implementation per shape and dtype at trace time.

Why: the cuDNN flash kernel behind ``jax.nn.dot_product_attention(implementation="cudnn")`` only
accepts some shapes (fp16/bf16, head dimension a multiple of 8 and at most 256 on Hopper or later,
128 before; no soft-capping), and asking it for anything else ends the run inside the first step
(an OpenLLaMA-3B shape, head dimension 100, did exactly that). So every shape goes to the fastest
path that accepts it, and every path computes the same function:

``cudnn``
    The cuDNN flash kernel as is (GPU, bf16/fp16, head dim % 8 == 0 and <= the kernel's limit).
``cudnn_padded``
    The same kernel on q, k, v whose head dimension is zero-padded to the next multiple of 8:
    zero columns add nothing to q·kᵀ, so the scores are unchanged as long as the scale uses the
    *true* head dimension; v's zero columns only produce zero output columns, which are sliced off.
    Gradients of the padding are sliced off by the pad's own VJP, so the result is exact.
``xla``
    Plain softmax attention in XLA (fp32 scores and softmax, like ``jax.nn``'s XLA path). It
    materialises the B·N·T·S scores, so it is chosen only for short sequences.
``xla_blockwise``
    Online-softmax (flash-style) attention in pure JAX: a loop over query blocks, inside it a loop
    over only the key blocks that the causal / window mask leaves visible, with a custom VJP that
    recomputes each block's scores from the saved log-sum-exp (FlashAttention-2's backward). No
    T x T array exists in the forward or the backward, so a 64k sequence fits, at any head
    dimension (above 256 too), with soft-capping and with document (segment) masks.

Every path takes grouped-query inputs (q: (B, T, N, D), k/v: (B, S, K, D), N a multiple of K),
a causal flag, an optional causal sliding window (``window`` = W: a query at position i sees keys
i-W < j <= i, the ``transformers`` convention), optional soft-capping of the scores
(``softcap * tanh(s / softcap)``, Gemma 2), optional document ``segment_ids`` (attention stays
inside a document of a packed sequence) and optional attention ``sinks`` (gpt-oss: one learned logit
per query head that joins every row's softmax denominator and attends to nothing; the XLA paths
only, cuDNN's kernel has no such input).

``choose_impl`` is the decision, ``describe`` the decision for a model config (what the trainer
prints once at start and ``megatrain-jax plan`` shows), ``working_set_bytes`` the transient
memory each path needs in one block's forward + backward (the memory plan adds it).
"""
from __future__ import annotations

import functools
import math
import os
import subprocess
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

IMPLS = ("cudnn", "cudnn_padded", "xla", "xla_blockwise")
# "xla_padded": the padded computation through XLA; never chosen, there so that the padding math
# can be tested on machines without cuDNN
FORCEABLE = IMPLS + ("xla_padded",)
BLOCK_Q = 512  # query rows per block of the blockwise path
BLOCK_K = 512  # key columns per block of the blockwise path
XLA_MAX_SEQ = 1024  # up to this length the plain XLA path's T x T scores are small (4 MiB per head)
_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# ------------------------------------------------------------------------------------ the choice


def _jax_backend_ready() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge._backends)  # noqa: SLF001 - only to avoid initialising it early
    except Exception:  # noqa: BLE001
        return False


@functools.lru_cache(maxsize=None)
def _cudnn_limit_from_jax() -> int | None:
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa

        if jax.default_backend() != "gpu":
            return None
        from jax._src import xla_bridge

        if "cuda" not in xla_bridge.get_backend().platform_version:
            return None  # ROCm: no cuDNN
        fa.check_cudnn_version()  # raises when cuDNN is not there
        return 256 if fa.check_compute_capability("9.0") else 128
    except Exception:  # noqa: BLE001 - no usable cuDNN: the non-cuDNN paths are exact anyway
        return None


@functools.lru_cache(maxsize=None)
def _cudnn_limit_from_nvidia_smi() -> int | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        cap = float(out.stdout.strip().splitlines()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    return 256 if cap >= 9.0 else 128


def cudnn_head_dim_limit() -> int | None:
    """The largest head dimension the cuDNN flash kernel takes here (256 on Hopper and later, 128
    before), or None where there is no cuDNN. Once JAX is initialised, JAX's own checks decide;
    before that (the memory plan must not initialise JAX: its allocator settings come first),
    ``nvidia-smi``'s compute capability; where neither answers, Hopper is assumed (the machines
    this trainer targets) and the trace-time choice corrects it."""
    if _jax_backend_ready():
        return _cudnn_limit_from_jax()
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        return None
    return _cudnn_limit_from_nvidia_smi() or 256


def choose_impl(head_dim: int, dtype: Any, backend: str, window: int | None = None,
                softcap: float | None = None, has_mask: bool = False, *, seq_len: int | None = None,
                causal: bool = True, cudnn_max_head_dim: int | None = None, sinks: bool = False) -> str:
    """The attention path for one shape: ``cudnn``, ``cudnn_padded``, ``xla`` or ``xla_blockwise``.

    cuDNN (``backend == "gpu"``) takes bf16/fp16 only (fp32 never goes there), no soft-capping and
    no document mask (``jax.nn`` would turn the mask into a dense T x T bias with a gradient);
    a causal sliding window it takes. Its head dimension must be a multiple of 8 and at most
    ``cudnn_max_head_dim`` (detected when None): otherwise zero-padding to the next multiple of 8
    is tried. Everything else goes to XLA: the plain path for sequences of up to ``XLA_MAX_SEQ``
    tokens, the blockwise one beyond (``seq_len=None`` counts as long).
    """
    dtype = jnp.dtype(dtype)
    if backend == "gpu" and dtype in _HALF and softcap is None and not has_mask and not sinks and (window is None or causal):
        limit = cudnn_max_head_dim if cudnn_max_head_dim is not None else cudnn_head_dim_limit()
        if limit:
            if head_dim % 8 == 0 and head_dim <= limit:
                return "cudnn"
            if _round_up(head_dim, 8) <= limit:
                return "cudnn_padded"
    if seq_len is not None and seq_len <= XLA_MAX_SEQ:
        return "xla"
    return "xla_blockwise"


def _reason(impl: str, head_dim: int, dtype: Any, backend: str, softcap: float | None, has_mask: bool,
            limit: int | None, sinks: bool = False) -> str:
    dtype = jnp.dtype(dtype)
    if impl == "cudnn":
        return "cuDNN flash attention"
    if impl == "cudnn_padded":
        return "cuDNN flash attention on q/k/v zero-padded to a multiple of 8 (exact)"
    why = []
    if backend != "gpu":
        why.append(f"no cuDNN on the {backend} backend")
    elif dtype not in _HALF:
        why.append(f"cuDNN takes bf16/fp16, not {dtype.name}")
    elif not limit:
        why.append("no cuDNN found")
    elif softcap is not None:
        why.append("cuDNN has no soft-capping")
    elif sinks:
        why.append("cuDNN has no attention sinks")
    elif has_mask:
        why.append("document masks would be a dense bias for cuDNN")
    else:
        why.append(f"head dim {head_dim} is above cuDNN's {limit}")
    if impl == "xla":
        return f"plain XLA softmax attention ({'; '.join(why)}; short sequence)"
    return f"blockwise online-softmax attention, no T x T matrix ({'; '.join(why)})"


# ----------------------------------------------------------------------------------- memory


def working_set_bytes(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, dtype_bytes: int,
                      impl: str, *, block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> int:
    """Transient bytes the attention path needs in one block's forward + backward, beyond q, k, v,
    the output and their gradients at the model's head dimension (those are in the block's
    per-token working set). Estimates from the arrays each path creates:

    - ``cudnn``: the softmax statistics (fp32 log-sum-exp saved by the forward, rowsum(dO·O) in the
      backward) and cuDNN's fp32 dQ accumulator: O(B·T·N·D).
    - ``cudnn_padded``: the same at the padded head dim, plus the padded copies of q, k, v, the
      output, its cotangent and the padded q/k/v gradients.
    - ``xla``: the B·N·T·S scores: fp32 softmax saved for the backward and its compute-dtype cast,
      then the probabilities' cotangent and the fp32 score gradient.
    - ``xla_blockwise``: one query block x key block of scores, probabilities and their gradients
      (fp32), the fp32 running output/statistics, the saved output and log-sum-exp, the fp32 dQ
      accumulator and the dK/dV blocks, and head-major copies of q, k, v and dO.
    """
    B, S, N, K, e = batch, seq, heads, kv_heads, dtype_bytes
    if impl in ("cudnn", "cudnn_padded", "xla_padded"):
        D = _round_up(head_dim, 8)
        ws = B * N * S * 8 + B * S * N * D * 4
        if impl != "cudnn":
            ws += B * S * D * e * (2 * (N + 2 * K) + 2 * N)
        return int(ws)
    D = head_dim
    if impl == "xla":
        return int(B * N * S * S * (8 + 2 * e))
    if impl == "xla_blockwise":
        bq, bk = min(block_q, S), min(block_k, S)
        Sp = _round_up(S, max(bq, bk))
        scores = B * N * bq * bk * 4 * 4  # s, p, dp, ds of one block pair
        running = B * N * bq * (D + 2) * 4  # acc, m, l of one query block
        saved = B * N * Sp * (D * e + 4)  # output (head-major) + log-sum-exp
        bwd = B * N * Sp * (D * 4 + 4) + 2 * B * K * Sp * D * 4  # dq accumulator, delta; dk, dv (fp32)
        copies = B * Sp * (N + 2 * K) * D * e + B * N * Sp * D * e  # head-major q, k, v and dO
        return int(scores + running + saved + bwd + copies)
    raise ValueError(f"unknown attention implementation {impl!r}; use one of {', '.join(FORCEABLE)}")


def describe(model_cfg: Any, seq_len: int, dtype: Any, backend: str, *, batch: int = 1,
             doc_masking: bool = False, cudnn_max_head_dim: int | None = None) -> dict[str, Any]:
    """The attention path a model config gets: what the trainer prints once at start and the
    memory plan shows. ``batch`` is the sequences per micro-batch (the working set is linear in it).

    Returns ``impl``, ``head_dim``, ``kernel_head_dim`` (padded where padding is used), ``window``,
    ``reason``, ``working_set_bytes`` (``working_set_bytes`` for this batch),
    ``extra_over_cudnn_bytes`` (the same minus what the cuDNN kernel would need at the model's head
    dim: the plan's per-token coefficients were calibrated with cuDNN) and ``summary`` (one line).
    """
    d, dtype = model_cfg.dim_per_head, jnp.dtype(dtype)
    window = getattr(model_cfg, "sliding_window", None)
    sinks = _has_sinks(model_cfg)
    softcap = getattr(model_cfg, "attn_softcap", None)
    if window is not None and window >= seq_len:
        window = None  # identical to full causal attention at this length (attention() drops it too)
    limit = cudnn_max_head_dim if cudnn_max_head_dim is not None else (
        cudnn_head_dim_limit() if backend == "gpu" else None)
    impl = choose_impl(d, dtype, backend, window, softcap, doc_masking, seq_len=seq_len, cudnn_max_head_dim=limit or 0,
                       sinks=sinks)
    args = (batch, seq_len, model_cfg.num_heads, model_cfg.kv_heads, d, dtype.itemsize)
    ws = working_set_bytes(*args, impl)
    base = working_set_bytes(*args[:4], _round_up(d, 8), dtype.itemsize, "cudnn")
    reason = _reason(impl, d, dtype, backend, softcap, doc_masking, limit, sinks)
    kd = _round_up(d, 8) if impl == "cudnn_padded" else d
    win = f", window {window}" if window else ""
    summary = (f"attention: {impl} (head dim {d}{f' -> {kd}' if kd != d else ''}, {dtype.name}{win}; {reason}); "
               f"working set {ws / 2**30:.2f} GiB per block for {batch} x {seq_len} tokens")
    return {"impl": impl, "head_dim": d, "kernel_head_dim": kd, "window": window, "softcap": softcap,
            "reason": reason, "working_set_bytes": ws, "extra_over_cudnn_bytes": max(0, ws - base),
            "summary": summary}


def _has_sinks(model_cfg: Any) -> bool:
    """Whether the model's family has attention sinks (its ``Family.extra["attention_sinks"]``)."""
    try:
        from megatrain_jax.families import get_family

        return bool(get_family(model_cfg.family).extra.get("attention_sinks"))
    except Exception:  # noqa: BLE001 - not a family's config (tests pass bare namespaces)
        return False


# ---------------------------------------------------------------------------------- the entry


_FALLBACK_WARNED: set[tuple] = set()


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
              segment_ids: jax.Array | None = None, window: int | None = None, softcap: float | None = None,
              scale: float | None = None, impl: str | None = None, block_q: int = BLOCK_Q,
              block_k: int = BLOCK_K, sinks: jax.Array | None = None) -> jax.Array:
    """softmax(q·kᵀ·scale [soft-capped, masked]) · v for grouped-query inputs; (B, T, N, D) out.

    q: (B, T, N, D); k, v: (B, S, K, D) with N a multiple of K (GQA; K == N is plain multi-head).
    ``segment_ids`` (B, T) ints: a query only sees keys of its own document (self-attention).
    ``window`` W (causal only): keys i-W < j <= i. ``scale`` defaults to 1/sqrt(D). ``sinks`` (N,):
    per query head a logit added to each row's softmax denominator, exp(sink) next to the exp(score)s
    (no value: the probabilities sum to less than 1), differentiable; the XLA paths only.
    ``impl`` forces a path (tests); None chooses at trace time with ``choose_impl``. A cuDNN path
    that the kernel refuses anyway at trace time falls back to the exact XLA paths with a warning.
    """
    B, T, N, D = q.shape
    if k.ndim != 4 or k.shape != v.shape or k.shape[0] != B or k.shape[3] != D or N % k.shape[2]:
        raise ValueError(f"attention: q {q.shape}, k {k.shape}, v {v.shape}: need q (B,T,N,D), k = v (B,S,K,D), "
                         "N a multiple of K")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if window is not None:
        if not causal:
            raise ValueError("attention: a sliding window needs causal=True")
        if window <= 0:
            raise ValueError(f"attention: window must be positive, got {window}")
        if window >= k.shape[1]:
            window = None  # every visible key is inside the window
    if segment_ids is not None and T != k.shape[1]:
        raise ValueError("attention: segment_ids need self-attention (T == S)")
    scale = float(1.0 / math.sqrt(D) if scale is None else scale)
    if impl is None:
        impl = choose_impl(D, q.dtype, jax.default_backend(), window, softcap, segment_ids is not None,
                           seq_len=max(T, k.shape[1]), causal=causal, sinks=sinks is not None)
    if impl not in FORCEABLE:
        raise ValueError(f"attention: unknown impl {impl!r}; use one of {', '.join(FORCEABLE)}")
    kw = dict(causal=causal, segment_ids=segment_ids, window=window, softcap=softcap, scale=scale)
    if sinks is not None:
        if sinks.shape != (N,):
            raise ValueError(f"attention: sinks {sinks.shape}: need one per query head ({N},)")
        if impl in ("cudnn", "cudnn_padded"):
            raise ValueError(f"attention: {impl} takes no sinks")
        kw["sinks"] = sinks
    if impl in ("cudnn", "cudnn_padded"):
        if softcap is not None or segment_ids is not None:
            raise ValueError(f"attention: {impl} takes neither soft-capping nor segment_ids")
        try:
            if impl == "cudnn":
                return _cudnn(q, k, v, **kw)
            return _padded(_cudnn, q, k, v, **kw)
        except (NotImplementedError, RuntimeError) as e:
            key = (impl, D, str(q.dtype))
            if key not in _FALLBACK_WARNED:
                _FALLBACK_WARNED.add(key)
                warnings.warn(f"attention: cuDNN refused head dim {D} {q.dtype} ({e}); using the exact XLA "
                              "blockwise path instead", RuntimeWarning, stacklevel=2)
            impl = "xla_blockwise"
    if impl == "xla":
        return _xla(q, k, v, **kw)
    if impl == "xla_padded":
        return _padded(_xla, q, k, v, **kw)
    return blockwise(q, k, v, **kw, block_q=block_q, block_k=block_k)


def _padded(inner, q, k, v, *, head_dim_to: int | None = None, **kw) -> jax.Array:
    """``inner`` on head dims zero-padded to the next multiple of 8 (or to ``head_dim_to``: tests);
    the scale (already in ``kw``) stays 1/sqrt(true D), so q·kᵀ is unchanged; v's zero columns
    give zero output columns, which are sliced off."""
    D = q.shape[-1]
    pad = [(0, 0)] * 3 + [(0, (head_dim_to or _round_up(D, 8)) - D)]
    out = inner(jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad), **kw)
    return out[..., :D]


def _cudnn(q, k, v, *, causal, segment_ids, window, softcap, scale) -> jax.Array:
    del segment_ids, softcap  # refused before
    # jax.nn's (left, right) window is inclusive: (W-1, 0) is the W keys i-W < j <= i
    lws = (window - 1, 0) if window is not None else None
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, local_window_size=lws,
                                        implementation="cudnn")


def _visible(q_pos, k_pos, *, causal, window, q_len, k_len, seg_q=None, seg_k=None) -> jax.Array:
    """Which (query, key) pairs attend: positions (..., Tq, 1) and (..., 1, Tk) broadcast."""
    ok = (q_pos < q_len) & (k_pos < k_len)
    if causal:
        ok = ok & (k_pos <= q_pos)
    if window is not None:
        ok = ok & (k_pos > q_pos - window)
    if seg_q is not None:
        ok = ok & (seg_q == seg_k)
    return ok


def _softcap(s: jax.Array, softcap: float | None) -> jax.Array:
    return s if softcap is None else softcap * jnp.tanh(s / softcap)


def _xla(q, k, v, *, causal, segment_ids, window, softcap, scale, sinks=None) -> jax.Array:
    """Plain softmax attention: fp32 scores and softmax, probabilities in v's dtype (as jax.nn); a
    sink is one more column of the softmax, dropped after it."""
    B, T, N, D = q.shape
    S, K = k.shape[1], k.shape[2]
    qg = q.reshape(B, T, K, N // K, D)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    s = _softcap(s, softcap)
    seg_q = seg_k = None
    if segment_ids is not None:
        seg_q, seg_k = segment_ids[:, None, None, :, None], segment_ids[:, None, None, None, :]
    ok = _visible(jnp.arange(T)[:, None], jnp.arange(S)[None, :], causal=causal, window=window, q_len=T, k_len=S,
                  seg_q=seg_q, seg_k=seg_k)
    s = jnp.where(ok, s, -0.7 * jnp.finfo(jnp.float32).max)
    if sinks is not None:
        sk = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, K, N // K, 1, 1), (*s.shape[:-1], 1))
        p = jax.nn.softmax(jnp.concatenate([s, sk], axis=-1), axis=-1)[..., :S].astype(v.dtype)
    else:
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", p, v)
    return out.reshape(B, T, N, D).astype(q.dtype)


# ------------------------------------------------------------------------------- blockwise path


class _Cfg(NamedTuple):
    causal: bool
    window: int | None
    softcap: float | None
    scale: float
    bq: int
    bk: int
    q_len: int  # true lengths (the arrays are padded to whole blocks)
    k_len: int
    has_seg: bool
    has_sinks: bool = False


def blockwise(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
              segment_ids: jax.Array | None = None, window: int | None = None, softcap: float | None = None,
              scale: float | None = None, block_q: int = BLOCK_Q, block_k: int = BLOCK_K,
              sinks: jax.Array | None = None) -> jax.Array:
    """Flash-style attention in pure JAX (see the module docstring); same arguments as ``attention``.
    A sink starts each row's running softmax (max = sink, sum = 1, nothing accumulated).

    Sequences are padded to whole blocks (padded queries and keys are masked); the output and all
    gradients are exact within fp32 rounding of a different summation order.
    """
    B, T, N, D = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    scale = float(1.0 / math.sqrt(D) if scale is None else scale)
    bq, bk = min(block_q, T), min(block_k, S)
    Tp, Sp = _round_up(T, bq), _round_up(S, bk)
    cfg = _Cfg(causal, window, None if softcap is None else float(softcap), scale, bq, bk, T, S,
               segment_ids is not None, sinks is not None)
    # head-major layouts: a block is a contiguous slice of the sequence axis
    qh = jnp.pad(q, [(0, 0), (0, Tp - T), (0, 0), (0, 0)]).reshape(B, Tp, K, G, D).transpose(0, 2, 3, 1, 4)
    kh = jnp.pad(k, [(0, 0), (0, Sp - S), (0, 0), (0, 0)]).transpose(0, 2, 1, 3)
    vh = jnp.pad(v, [(0, 0), (0, Sp - S), (0, 0), (0, 0)]).transpose(0, 2, 1, 3)
    if segment_ids is None:
        seg_q = jnp.zeros((B, Tp), jnp.int32)
        seg_k = jnp.zeros((B, Sp), jnp.int32)
    else:
        seg = segment_ids.astype(jnp.int32)
        seg_q = jnp.pad(seg, [(0, 0), (0, Tp - T)], constant_values=-1)
        seg_k = jnp.pad(seg, [(0, 0), (0, Sp - S)], constant_values=-2)
    sk = jnp.zeros((K, G), jnp.float32) if sinks is None else sinks.astype(jnp.float32).reshape(K, G)
    out = _flash(qh, kh, vh, seg_q, seg_k, sk, cfg)  # (B, K, G, Tp, D)
    return out.transpose(0, 3, 1, 2, 4).reshape(B, Tp, N, D)[:, :T]


def _key_range(i, cfg: _Cfg, nk: int):
    """Key blocks [lo, hi) that query block ``i`` can see."""
    first_q, last_q = i * cfg.bq, i * cfg.bq + cfg.bq - 1
    hi = jnp.minimum(nk, last_q // cfg.bk + 1) if cfg.causal else nk
    lo = jnp.maximum(0, first_q - cfg.window + 1) // cfg.bk if cfg.window is not None else 0
    return lo, hi


def _query_range(j, cfg: _Cfg, nq: int):
    """Query blocks [lo, hi) that can see key block ``j``."""
    first_k, last_k = j * cfg.bk, j * cfg.bk + cfg.bk - 1
    lo = first_k // cfg.bq if cfg.causal else 0
    hi = jnp.minimum(nq, (last_k + cfg.window - 1) // cfg.bq + 1) if cfg.window is not None else nq
    return lo, hi


def _block_mask(i, j, seg_q_blk, seg_k_blk, cfg: _Cfg) -> jax.Array:
    """(B, 1, 1, bq, bk) visibility of query block i x key block j."""
    q_pos = (i * cfg.bq + jnp.arange(cfg.bq))[:, None]
    k_pos = (j * cfg.bk + jnp.arange(cfg.bk))[None, :]
    seg_q = seg_q_blk[:, None, None, :, None] if cfg.has_seg else None
    seg_k = seg_k_blk[:, None, None, None, :] if cfg.has_seg else None
    ok = _visible(q_pos, k_pos, causal=cfg.causal, window=cfg.window, q_len=cfg.q_len, k_len=cfg.k_len,
                  seg_q=seg_q, seg_k=seg_k)
    return jnp.broadcast_to(ok, (seg_q_blk.shape[0], 1, 1, cfg.bq, cfg.bk))


def _scores(qi, kj, cfg: _Cfg):
    """Scaled, soft-capped scores (B, K, G, bq, bk) in fp32, and tanh (for the backward) or None."""
    s = jnp.einsum("bkgqd,bksd->bkgqs", qi, kj, preferred_element_type=jnp.float32) * cfg.scale
    if cfg.softcap is None:
        return s, None
    t = jnp.tanh(s / cfg.softcap)
    return cfg.softcap * t, t


def _flash_fwd_impl(qh, kh, vh, seg_q, seg_k, sinks, cfg: _Cfg):
    B, K, G, Tp, D = qh.shape
    nq, nk = Tp // cfg.bq, kh.shape[2] // cfg.bk

    def q_block(i):
        qi = lax.dynamic_slice_in_dim(qh, i * cfg.bq, cfg.bq, axis=3)
        sq = lax.dynamic_slice_in_dim(seg_q, i * cfg.bq, cfg.bq, axis=1)

        def body(j, carry):
            m, l, acc = carry
            kj = lax.dynamic_slice_in_dim(kh, j * cfg.bk, cfg.bk, axis=2)
            vj = lax.dynamic_slice_in_dim(vh, j * cfg.bk, cfg.bk, axis=2)
            sk = lax.dynamic_slice_in_dim(seg_k, j * cfg.bk, cfg.bk, axis=1)
            s, _ = _scores(qi, kj, cfg)
            s = jnp.where(_block_mask(i, j, sq, sk, cfg), s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # rows with nothing visible yet
            p = jnp.exp(s - m_safe[..., None])
            corr = jnp.exp(m - m_safe)
            l = l * corr + jnp.sum(p, axis=-1)
            pv = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(vh.dtype), vj, preferred_element_type=jnp.float32)
            return m_new, l, acc * corr[..., None] + pv

        if cfg.has_sinks:  # the sink as a first key: max = sink, sum = exp(0), no value
            m0 = jnp.broadcast_to(sinks[None, :, :, None], (B, K, G, cfg.bq))
            init = (m0, jnp.ones((B, K, G, cfg.bq), jnp.float32), jnp.zeros((B, K, G, cfg.bq, D), jnp.float32))
        else:
            init = (jnp.full((B, K, G, cfg.bq), -jnp.inf, jnp.float32), jnp.zeros((B, K, G, cfg.bq), jnp.float32),
                    jnp.zeros((B, K, G, cfg.bq, D), jnp.float32))
        lo, hi = _key_range(i, cfg, nk)
        m, l, acc = lax.fori_loop(lo, hi, body, init)
        empty = l == 0  # padded query rows: nothing visible
        l_safe = jnp.where(empty, 1.0, l)
        o = (acc / l_safe[..., None]).astype(qh.dtype)
        lse = jnp.where(empty, jnp.inf, m + jnp.log(l_safe))  # +inf: p = exp(s - lse) = 0 in the backward
        return o, lse

    o, lse = lax.map(q_block, jnp.arange(nq))  # (nq, B, K, G, bq, D), (nq, B, K, G, bq)
    o = jnp.moveaxis(o, 0, 3).reshape(B, K, G, Tp, D)
    lse = jnp.moveaxis(lse, 0, 3).reshape(B, K, G, Tp)
    return o, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(qh, kh, vh, seg_q, seg_k, sinks, cfg: _Cfg):
    return _flash_fwd_impl(qh, kh, vh, seg_q, seg_k, sinks, cfg)[0]


def _flash_fwd(qh, kh, vh, seg_q, seg_k, sinks, cfg: _Cfg):
    o, lse = _flash_fwd_impl(qh, kh, vh, seg_q, seg_k, sinks, cfg)
    return o, (qh, kh, vh, seg_q, seg_k, sinks, o, lse)


def _flash_bwd(cfg: _Cfg, res, do):
    """FlashAttention-2's backward: per key block, loop over the query blocks that see it,
    recompute p = exp(s - lse), accumulate dK, dV for the block and dQ in a running fp32 array."""
    qh, kh, vh, seg_q, seg_k, sinks, o, lse = res
    B, K, G, Tp, D = qh.shape
    Sp = kh.shape[2]
    nq, nk = Tp // cfg.bq, Sp // cfg.bk
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)  # rowsum(dO * O)

    def k_block(dq, j):
        kj = lax.dynamic_slice_in_dim(kh, j * cfg.bk, cfg.bk, axis=2)
        vj = lax.dynamic_slice_in_dim(vh, j * cfg.bk, cfg.bk, axis=2)
        sk = lax.dynamic_slice_in_dim(seg_k, j * cfg.bk, cfg.bk, axis=1)

        def body(i, carry):
            dq, dk, dv = carry
            sl = functools.partial(lax.dynamic_slice_in_dim, start_index=i * cfg.bq, slice_size=cfg.bq)
            qi, doi = sl(qh, axis=3), sl(do, axis=3)
            lse_i, delta_i, sq = sl(lse, axis=3), sl(delta, axis=3), sl(seg_q, axis=1)
            s, t = _scores(qi, kj, cfg)
            p = jnp.where(_block_mask(i, j, sq, sk, cfg), jnp.exp(s - lse_i[..., None]), 0.0)
            dv = dv + jnp.einsum("bkgqs,bkgqd->bksd", p.astype(do.dtype), doi, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bkgqd,bksd->bkgqs", doi, vj, preferred_element_type=jnp.float32)
            ds = p * (dp - delta_i[..., None])
            if t is not None:
                ds = ds * (1.0 - t * t)  # d(c·tanh(x/c))/dx
            ds = ds * cfg.scale
            dk = dk + jnp.einsum("bkgqs,bkgqd->bksd", ds.astype(qh.dtype), qi, preferred_element_type=jnp.float32)
            dq_i = jnp.einsum("bkgqs,bksd->bkgqd", ds.astype(kh.dtype), kj, preferred_element_type=jnp.float32)
            dq = lax.dynamic_update_slice_in_dim(dq, sl(dq, axis=3) + dq_i, i * cfg.bq, axis=3)
            return dq, dk, dv

        zeros = jnp.zeros((B, K, cfg.bk, D), jnp.float32)
        lo, hi = _query_range(j, cfg, nq)
        dq, dk, dv = lax.fori_loop(lo, hi, body, (dq, zeros, zeros))
        return dq, (dk, dv)

    dq, (dk, dv) = lax.scan(k_block, jnp.zeros((B, K, G, Tp, D), jnp.float32), jnp.arange(nk))
    dk = jnp.moveaxis(dk, 0, 2).reshape(B, K, Sp, D).astype(kh.dtype)
    dv = jnp.moveaxis(dv, 0, 2).reshape(B, K, Sp, D).astype(vh.dtype)
    # a sink's probability is exp(sink - lse) and its value zero: d sink = -sum p_sink * rowsum(dO * O)
    dsinks = (-jnp.sum(jnp.exp(sinks[None, :, :, None] - lse) * delta, axis=(0, 3)) if cfg.has_sinks
              else jnp.zeros_like(sinks))
    return dq.astype(qh.dtype), dk, dv, None, None, dsinks


_flash.defvjp(_flash_fwd, _flash_bwd)
