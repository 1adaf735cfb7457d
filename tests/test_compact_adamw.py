"""Compact Adam moments: the int8 kernel equals its numpy reference bit for bit; bf16 moments track
optax's bf16 first moment; slab-sized slices update exactly like the whole group; training works
through the engine and checkpoints, and a checkpoint of one mode is refused by another."""
import numpy as np
import optax
import pytest

from megatrain_jax.config import ModelConfig, OptimConfig, load_config
from megatrain_jax.engine import Batch, StreamedTrainer
from megatrain_jax.errors import UserError
from megatrain_jax.models.llama import init_host_store
from megatrain_jax.optim import CompactAdamW, build_host_optimizer
from megatrain_jax.optim import compact_adamw as ca
from megatrain_jax.optim.fused_adamw import bf16_bits_to_f32, f32_to_bf16_bits

KW = dict(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, eps_root=0.0, weight_decay=0.1)


def _grads(rng, n):
    # magnitudes over four decades, as real gradients have, so every part of the code is used
    return (rng.standard_normal(n) * 10 ** rng.uniform(-4, 0, n)).astype(np.float32)


def _int8_state(n):
    nb = -(-n // ca.BLOCK)
    return {"mu_q": np.zeros(n, np.uint8), "nu_q": np.zeros(n, np.uint8),
            "mu_scale": np.zeros(nb, np.float32), "nu_scale": np.zeros(nb, np.float32)}


def test_codes_are_sorted_dynamic_maps():
    for code, signed in ((ca.CODE_SIGNED, True), (ca.CODE_UNSIGNED, False)):
        assert code.shape == (256,) and np.all(np.diff(code) > 0) and code.max() == 1.0
        assert 0.0 in code and (code.min() < 0) == signed
        assert np.sum(np.abs(code) < 1e-3) > 20  # dense near zero: the dynamic code's point


@pytest.mark.parametrize("n", [ca.BLOCK * 3 + 517, 100])
def test_int8_kernel_equals_numpy_reference_bit_for_bit(n):
    rng = np.random.default_rng(0)
    p = rng.standard_normal(n).astype(np.float32)
    p_ref, st, st_ref = p.copy(), _int8_state(n), _int8_state(n)
    for count in range(1, 7):
        g = _grads(rng, n)
        bits = np.zeros(n, np.uint16)
        ca.adamw_int8_step(p, g, st, bits, count=count, grad_scale=0.7, **KW)
        ref_bits = ca.reference_int8_step(p_ref, g, st_ref, count=count, grad_scale=0.7, **KW)
        np.testing.assert_array_equal(p, p_ref)
        np.testing.assert_array_equal(bits, ref_bits)
        for k in st:
            np.testing.assert_array_equal(st[k], st_ref[k], err_msg=k)
    assert np.count_nonzero(st["mu_q"]) > n // 2 and np.all(st["nu_scale"] > 0)


def test_nearest_code_equals_binary_search():
    rng = np.random.default_rng(1)
    xs = np.concatenate([rng.uniform(-1, 1, 20000), rng.standard_normal(5000) * 1e-5, ca.CODE_SIGNED,
                         (ca.CODE_SIGNED[1:] + ca.CODE_SIGNED[:-1]) / 2, [0.0, -0.0, 1.0, -1.0]]).astype(np.float32)
    p = np.zeros(xs.size, np.float32)
    # route xs through the kernel's quantizer: one block per value, so each block's absmax is 1
    for code, key in ((ca.CODE_SIGNED, "signed"), (ca.CODE_UNSIGNED, "unsigned")):
        x = np.abs(xs) if key == "unsigned" else xs
        want = ca._nearest_np(code, x)
        got = np.array([code[i] for i in want])
        # the nearest value by brute force (ties to the lower index)
        d = np.abs(x[:, None] - code[None, :])
        brute = np.argmin(d, axis=1)
        np.testing.assert_array_equal(want, brute)
        assert got.shape == x.shape and p.shape == x.shape


def test_int8_round_trip_error_is_blockwise_small():
    rng = np.random.default_rng(2)
    n = ca.BLOCK * 4
    g = _grads(rng, n)
    p, st = np.zeros(n, np.float32), _int8_state(n)
    ca.adamw_int8_step(p, g, st, None, count=1, **KW)
    m = (1 - 0.9) * g
    deq = ca.CODE_SIGNED[st["mu_q"]] * np.repeat(st["mu_scale"], ca.BLOCK)
    rel = np.abs(deq - m) / np.repeat(st["mu_scale"], ca.BLOCK)
    assert rel.max() < 0.08 and np.median(rel) < 0.01


def test_bf16_moments_kernel_equals_numpy_and_tracks_optax_bf16_mu():
    rng = np.random.default_rng(3)
    n = 5000
    p = rng.standard_normal(n).astype(np.float32)
    st = {"mu_bf16": np.zeros(n, np.uint16), "nu_bf16": np.zeros(n, np.uint16)}
    pn, mn, vn = p.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
    tx = optax.adamw(KW["lr"], b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mu_dtype="bfloat16")
    po = p.copy()
    so = tx.init(po)
    f = np.float32
    for count in range(1, 6):
        g = _grads(rng, n)
        ca.adamw_bf16_step(p, g, st, None, count=count, **KW)
        # numpy, same operations: moments rounded to bf16 after each update
        s = ca._scalars(KW["lr"], 0.9, 0.95, 1e-8, 0.0, 0.1, count, 1.0)
        nlr, b1, omb1, b2, omb2, rbc1, rbc2, eps, eps_root, wd, gs = s
        gg = g * gs
        m = omb1 * gg + b1 * mn
        v = omb2 * (gg * gg) + b2 * vn
        u = (m * rbc1) / (np.sqrt(v * rbc2 + eps_root) + eps) + wd * pn
        pn = pn + nlr * u
        mn, vn = bf16_bits_to_f32(f32_to_bf16_bits(m)), bf16_bits_to_f32(f32_to_bf16_bits(v))
        up, so = tx.update(g, so, po)
        po = np.asarray(optax.apply_updates(po, up))
    np.testing.assert_array_equal(p, pn)
    np.testing.assert_array_equal(bf16_bits_to_f32(st["mu_bf16"]), mn)
    # optax keeps nu in fp32: close, not equal (relative to the size of the update)
    step = np.abs(po - p).max() / (5 * KW["lr"])
    assert step < 0.05, step


@pytest.mark.parametrize("moments", ["int8", "bfloat16"])
def test_slab_slices_update_exactly_like_the_whole_group(moments):
    rng = np.random.default_rng(4)
    n = ca.BLOCK * 5 + 77
    opt = CompactAdamW(1e-3, moments, b1=0.9, b2=0.95, weight_decay=0.1)
    p0 = rng.standard_normal(n).astype(np.float32)
    pa, pb = p0.copy(), p0.copy()
    sa, sb = opt.init_state(pa), opt.init_state(pb)
    for count in (1, 2, 3):
        g = _grads(rng, n)
        opt.update(pa, g, sa, count, 0.5)
        cut = ca.BLOCK * 2
        for lo, hi in ((0, cut), (cut, n)):
            opt.update(pb[lo:hi], g[lo:hi], opt.state_slice(sb, lo, hi), count, 0.5)
    np.testing.assert_array_equal(pa, pb)
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k])
    if moments == "int8":
        with pytest.raises(ValueError, match="block boundary"):
            opt.state_slice(sa, 5, 100)


def test_engine_trains_with_int8_moments_in_slabs():
    """Through the streamed engine with slabs smaller than a group (block-aligned): the loss falls,
    and the result equals the same run with whole-group updates bit for bit."""
    cfg = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=96)
    rng = np.random.default_rng(5)
    batches = []
    for _ in range(8):
        toks = rng.integers(0, 64, (4, 33))
        batches.append(Batch(toks[:, :-1], toks[:, 1:]))
    runs = []
    for slab in (ca.BLOCK * 2, None):
        parts, store = init_host_store(cfg, 0, bf16_stream=False)
        opt = build_host_optimizer(OptimConfig(lr=3e-3, moments="int8"), 8)
        st = StreamedTrainer(parts, opt, compute_dtype="float32", store=store, clip_norm=1.0, grad_slab_elems=slab)
        losses = [st.step(b).loss for b in batches]
        st.close()
        runs.append((losses, {g.name: g.master.copy() for g in st.store}))
    assert runs[0][0] == runs[1][0] and runs[0][0][-1] < runs[0][0][0] - 0.3
    for k in runs[0][1]:
        np.testing.assert_array_equal(runs[0][1][k], runs[1][1][k])


def test_moments_config_errors():
    with pytest.raises(UserError) as e:
        build_host_optimizer(OptimConfig(kernel="optax", moments="int8"), 10)
    assert e.value.field == "optim.moments"
    with pytest.raises(UserError) as e:
        load_config(None, ["optim.moments=int4"])
    assert e.value.field == "optim.moments"
    with pytest.raises(UserError) as e:
        CompactAdamW(1e-3, "int8").as_optax()
    assert e.value.field == "optim.moments"
