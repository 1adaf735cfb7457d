"""Every attention path equals plain softmax attention, forward and gradients (issue 18).

CPU: the paths that run without cuDNN (``xla``, ``xla_padded``: the padded computation through
XLA, ``xla_blockwise``) against an independent reference (k/v repeated per query head, a dense
mask, softmax), for head dimensions 64, 100, 128, 256 and 288, with GQA, with and without a
sliding window, with document segments, soft-capping and non-causal attention. GPU (skipped
without one): the cuDNN kernel, padded and not, against the XLA paths on the same inputs.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megatrain_jax.attention import (XLA_MAX_SEQ, _cudnn, _padded, attention, blockwise, choose_impl, describe,
                                     working_set_bytes)
from megatrain_jax.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5  # the engine tests' relative tolerance
B, T, N, K = 2, 40, 4, 2  # GQA: two query heads per kv head; T is not a multiple of the blocks below
BLOCKS = dict(block_q=16, block_k=8)  # several blocks, ragged last ones


def reference(q, k, v, *, causal=True, segment_ids=None, window=None, softcap=None):
    """Plain softmax attention, written independently of megatrain_jax.attention."""
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("btnd,bsnd->bnts", q.astype(jnp.float32), k.astype(jnp.float32)) / np.sqrt(q.shape[-1])
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    i, j = np.arange(q.shape[1])[:, None], np.arange(k.shape[1])[None, :]
    ok = np.ones((q.shape[1], k.shape[1]), bool)
    if causal:
        ok &= j <= i
    if window is not None:
        ok &= j > i - window
    ok = jnp.asarray(ok)[None, None]
    if segment_ids is not None:
        ok = ok & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    p = jax.nn.softmax(jnp.where(ok, s, -1e30), axis=-1)
    return jnp.einsum("bnts,bsnd->btnd", p, v.astype(jnp.float32))


def _inputs(d: int, seed: int = 0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q, k, v, w = (jnp.asarray(rng.standard_normal((B, T, n, d)), dtype) for n in (N, K, K, N))
    return q, k, v, w


def _check_all(fns: dict, q, k, v, w, tol=TOL):
    """Outputs and (q, k, v) gradients of every fn against its reference, in one compile: a fn
    named ``impl/x`` is compared with ``reference/x``, any other with ``reference``."""

    def run(q, k, v):
        out = {}
        for name, fn in fns.items():
            o, vjp = jax.vjp(fn, q, k, v)
            out[name] = (o, vjp(w.astype(o.dtype)))  # the gradient of sum(o * w)
        return out

    with jax.default_matmul_precision("float32"):  # no TF32 where these run on a GPU
        res = jax.jit(run)(q, k, v)
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))  # noqa: E731
    for name, (o, g) in res.items():
        if name.startswith("reference"):
            continue
        want_o, want_g = res["reference" + name[name.index("/"):] if "/" in name else "reference"]
        assert o.shape == want_o.shape and o.dtype == q.dtype
        assert rel(o, want_o) < tol, (name, "output", rel(o, want_o))
        for which, a, b in zip("qkv", g, want_g):
            assert rel(a, b) < tol, (name, f"d{which}", rel(a, b))


@pytest.mark.parametrize("d", [64, 100, 128, 256, 288])
def test_every_path_equals_plain_softmax(d):
    q, k, v, w = _inputs(d, seed=d)
    fns = {}
    for window in (None, 9):
        fns.update({f"{impl}/{window}": (lambda q, k, v, impl=impl, window=window: attention(
            q, k, v, impl=impl, window=window, **BLOCKS)) for impl in ("xla", "xla_padded", "xla_blockwise")})
        fns[f"reference/{window}"] = lambda q, k, v, window=window: reference(q, k, v, window=window)
    _check_all(fns, q, k, v, w)


def test_segments_softcap_and_noncausal():
    """Document masks (with a window), soft-capping, and bidirectional attention on every path."""
    q, k, v, w = _inputs(100, seed=7)
    seg = jnp.asarray(np.sort(np.random.default_rng(3).integers(0, 3, (B, T)), axis=1))
    fns = {}
    for case, kw in {"segments": dict(segment_ids=seg, window=9), "softcap": dict(softcap=3.0),
                     "bidirectional": dict(causal=False)}.items():
        fns.update({f"{impl}/{case}": (lambda q, k, v, impl=impl, kw=kw: attention(q, k, v, impl=impl, **kw, **BLOCKS))
                    for impl in ("xla", "xla_blockwise")})
        fns[f"reference/{case}"] = lambda q, k, v, kw=kw: reference(q, k, v, **kw)
    _check_all(fns, q, k, v, w)


def test_blockwise_bf16_tracks_fp32():
    """bf16 inputs: fp32 statistics and accumulators keep the blockwise path at bf16 accuracy."""
    q, k, v, w = _inputs(64, seed=1, dtype=jnp.bfloat16)
    fns = {"blockwise": lambda q, k, v: attention(q, k, v, impl="xla_blockwise", window=9, **BLOCKS),
           "reference": lambda q, k, v: reference(q, k, v, window=9).astype(jnp.bfloat16)}
    _check_all(fns, q, k, v, w.astype(jnp.bfloat16), tol=2e-2)


def _largest_array(fn, *args) -> int:
    """Elements of the largest array anywhere in fn's jaxpr (sub-jaxprs of loops included)."""
    biggest = 0

    def walk(jaxpr):
        nonlocal biggest
        for eqn in jaxpr.eqns:
            for var in list(eqn.invars) + list(eqn.outvars):
                if hasattr(var.aval, "shape"):
                    biggest = max(biggest, int(np.prod(var.aval.shape)))
            for p in eqn.params.values():
                for sub in p if isinstance(p, (list, tuple)) else [p]:
                    if hasattr(sub, "eqns"):
                        walk(sub)
                    elif hasattr(getattr(sub, "jaxpr", None), "eqns"):  # a closed jaxpr
                        walk(sub.jaxpr)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return biggest


@pytest.mark.parametrize("window", [None, 4096])
def test_blockwise_never_materialises_t_by_t(window):
    """Forward and backward of a 16k-token sequence: nothing as large as one head's T x T scores."""
    t, d = 16384, 8
    shapes = [jax.ShapeDtypeStruct((1, t, 2, d), jnp.bfloat16), jax.ShapeDtypeStruct((1, t, 1, d), jnp.bfloat16)]

    def loss(impl):
        return jax.grad(lambda q, k: jnp.sum(attention(q, k, k, impl=impl, window=window).astype(jnp.float32)),
                        argnums=(0, 1))

    assert _largest_array(loss("xla_blockwise"), *shapes) < t * t // 16
    assert _largest_array(loss("xla"), *shapes) >= t * t  # the check can see a T x T array


def test_choice():
    bf16, f32 = jnp.bfloat16, jnp.float32
    hopper = dict(cudnn_max_head_dim=256, seq_len=4096)
    assert choose_impl(128, bf16, "gpu", **hopper) == "cudnn"
    assert choose_impl(100, bf16, "gpu", **hopper) == "cudnn_padded"  # OpenLLaMA-3B
    assert choose_impl(256, bf16, "gpu", **hopper) == "cudnn"
    assert choose_impl(252, bf16, "gpu", **hopper) == "cudnn_padded"
    assert choose_impl(288, bf16, "gpu", **hopper) == "xla_blockwise"
    assert choose_impl(256, bf16, "gpu", cudnn_max_head_dim=128, seq_len=4096) == "xla_blockwise"  # pre-Hopper
    assert choose_impl(128, bf16, "gpu", window=4096, **hopper) == "cudnn"  # cuDNN's sliding window
    assert choose_impl(128, f32, "gpu", **hopper) == "xla_blockwise"  # fp32 never goes to cuDNN
    assert choose_impl(128, bf16, "gpu", softcap=50.0, **hopper) == "xla_blockwise"
    assert choose_impl(128, bf16, "gpu", has_mask=True, **hopper) == "xla_blockwise"
    assert choose_impl(128, bf16, "gpu", cudnn_max_head_dim=0, seq_len=4096) == "xla_blockwise"  # no cuDNN
    assert choose_impl(128, bf16, "cpu", seq_len=XLA_MAX_SEQ) == "xla"
    assert choose_impl(128, bf16, "cpu", seq_len=XLA_MAX_SEQ + 1) == "xla_blockwise"
    assert choose_impl(128, bf16, "gpu", cudnn_max_head_dim=256) == "cudnn"  # no length needed for cuDNN
    assert choose_impl(288, bf16, "gpu", cudnn_max_head_dim=256, seq_len=256) == "xla"  # short: plain XLA


def test_working_set():
    args = (4, 4096, 32, 32, 100, 2)
    xla, bw = working_set_bytes(*args, "xla"), working_set_bytes(*args, "xla_blockwise")
    cudnn, padded = working_set_bytes(*args[:4], 104, 2, "cudnn"), working_set_bytes(*args, "cudnn_padded")
    assert xla > 4 * 32 * 4096 * 4096 * 8  # the fp32 scores alone
    assert cudnn < padded < bw < xla
    # blockwise and flash grow linearly in the sequence, plain XLA quadratically
    grow = lambda impl: working_set_bytes(1, 65536, 32, 8, 128, 2, impl) / working_set_bytes(1, 32768, 32, 8, 128, 2, impl)  # noqa: E731
    assert grow("xla_blockwise") == pytest.approx(2, rel=0.05) and grow("cudnn") == pytest.approx(2)
    assert grow("xla") == pytest.approx(4)


def test_describe_openllama_3b():
    cfg = load_config(str(ROOT / "configs" / "openllama-3b.yaml"))
    m = cfg.model
    assert (m.hidden_size, m.num_layers, m.num_heads, m.kv_heads, m.dim_per_head) == (3200, 26, 32, 32, 100)
    assert (m.intermediate_size, m.vocab_size, m.tie_embeddings) == (8640, 32000, False)
    assert (cfg.data.seq_len, cfg.train.batch_size, cfg.train.micro_batches) == (4096, 16, 4)
    info = describe(m, cfg.data.seq_len, "bfloat16", "gpu", batch=4, cudnn_max_head_dim=256)
    assert info["impl"] == "cudnn_padded" and info["kernel_head_dim"] == 104
    assert "100 -> 104" in info["summary"] and info["extra_over_cudnn_bytes"] > 0
    assert info["working_set_bytes"] == working_set_bytes(4, 4096, 32, 32, 100, 2, "cudnn_padded")
    info = describe(m, cfg.data.seq_len, "float32", "gpu", batch=4, cudnn_max_head_dim=256)
    assert info["impl"] == "xla_blockwise" and "float32" in info["reason"]
    assert describe(m, 128, "float32", "cpu")["impl"] == "xla"


def test_cudnn_refusal_falls_back_to_an_exact_path():
    """Where the kernel refuses at trace time anyway (here: no cuDNN on CPU), the result is still
    exact attention, with a warning instead of a traceback from inside the step."""
    if jax.default_backend() == "gpu":
        pytest.skip("cuDNN is present")
    q, k, v, _ = _inputs(64, seed=5, dtype=jnp.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = attention(q, k, v, impl="cudnn_padded", window=9)
    assert any("cuDNN" in str(c.message) for c in caught)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(reference(q, k, v, window=9)), atol=2e-2)


def test_rejects_bad_arguments():
    q, k, v, _ = _inputs(64)
    with pytest.raises(ValueError, match="causal"):
        attention(q, k, v, causal=False, window=4)
    with pytest.raises(ValueError, match="impl"):
        attention(q, k, v, impl="flash")
    with pytest.raises(ValueError, match="N a multiple of K"):
        attention(q[:, :, :3], k, v)


# ------------------------------------------------------------------------------------------- GPU


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _gpu_out_and_grads(fn, q, k, v, w):
    f = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * w), argnums=(0, 1, 2)))
    return jax.jit(fn)(q, k, v), f(q, k, v)[1]


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 256])
def test_gpu_padded_and_cudnn_agree(window):
    """On the GPU, same bf16 inputs: cuDNN at head dim 128 = cuDNN on 128 zero-padded to 136 = XLA;
    at head dim 100 (the OpenLLaMA-3B shape) the padded cuDNN path = XLA = blockwise."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    assert choose_impl(100, jnp.bfloat16, "gpu", seq_len=1024) == "cudnn_padded"
    assert choose_impl(128, jnp.bfloat16, "gpu", seq_len=1024) == "cudnn"
    b, t, n, kv = 2, 1024, 8, 2
    for d in (128, 100):
        rng = np.random.default_rng(d)
        q, k, v, w = (jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16) for h in (n, kv, kv, n))
        w = w.astype(jnp.float32)
        kw = dict(causal=True, segment_ids=None, window=window, softcap=None, scale=1.0 / np.sqrt(d))
        fns = {"xla": lambda q, k, v: attention(q, k, v, impl="xla", window=window),
               "blockwise": lambda q, k, v: blockwise(q, k, v, window=window, block_q=256, block_k=256)}
        if d == 128:
            fns["cudnn"] = lambda q, k, v: attention(q, k, v, impl="cudnn", window=window)
            fns["cudnn_pad136"] = lambda q, k, v: _padded(_cudnn, q, k, v, head_dim_to=136, **kw)
        else:
            fns["cudnn_padded"] = lambda q, k, v: attention(q, k, v, impl="cudnn_padded", window=window)
        want_o = reference(q, k, v, window=window)
        want_g = jax.grad(lambda q, k, v: jnp.sum(reference(q, k, v, window=window) * w), argnums=(0, 1, 2))(
            q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
        outs = {name: _gpu_out_and_grads(fn, q, k, v, w) for name, fn in fns.items()}
        for name, (o, g) in outs.items():  # every path within bf16 rounding of the fp32 reference
            assert o.dtype == jnp.bfloat16 and _rel(o, want_o) < 1e-2, (d, name, _rel(o, want_o))
            for which, a, r in zip("qkv", g, want_g):
                assert _rel(a, r) < 3e-2, (d, name, which, _rel(a, r))
        cud = "cudnn" if d == 128 else "cudnn_padded"
        other = "cudnn_pad136" if d == 128 else "xla"
        assert _rel(outs[cud][0], outs[other][0]) < 1e-2  # and against each other, directly
        if d == 128:  # the same kernel on zero-padded inputs: the padding changes nothing but rounding
            assert _rel(outs["cudnn_pad136"][0], outs["cudnn"][0]) < 5e-3
