"""Compact Adam moments: the int8 kernel equals its numpy reference bit for bit; bf16 moments track
optax's bf16 first moment; slab-sized slices update exactly like the whole group; training works
through the engine and checkpoints, and a checkpoint of one mode is refused by another."""
import os
import numpy as np
import optax
import pytest

from megatrain_jax.config import ModelConfig, OptimConfig, load_config
from megatrain_jax.engine import Batch, StreamedTrainer
from megatrain_jax.errors import UserError
from megatrain_jax.models.llama import init_host_store
from megatrain_jax.optim import CompactAdamW, FusedAdamW, build_host_optimizer
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


@pytest.mark.parametrize("gather", ca.GATHER_MODES)
@pytest.mark.parametrize("n", [ca.BLOCK * 3 + 517, 100])
def test_int8_kernel_equals_numpy_reference_bit_for_bit(n, gather):
    rng = np.random.default_rng(0)
    p = rng.standard_normal(n).astype(np.float32)
    p_ref, st, st_ref = p.copy(), _int8_state(n), _int8_state(n)
    for count in range(1, 7):
        g = _grads(rng, n)
        bits = np.zeros(n, np.uint16)
        ca.adamw_int8_step(p, g, st, bits, count=count, grad_scale=0.7, gather=gather, **KW)
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
        s = ca.adamw_scalars(KW["lr"], 0.9, 0.95, 1e-8, 0.0, 0.1, count, 1.0)
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


@pytest.mark.parametrize("moments", ["float32", "int8", "bfloat16"])
def test_kernels_take_a_bf16_gradients_bits_exactly_as_its_widened_fp32(moments):
    """A gradient held in bf16 reaches the kernel as its bits (uint16), widened as it is read: the same
    update, bit for bit, as the fp32 values a widening pass would have made first."""
    rng = np.random.default_rng(5)
    n = ca.BLOCK * 3 + 211
    opt = FusedAdamW(1e-3, b1=0.9, b2=0.95, weight_decay=0.1) if moments == "float32" else \
        CompactAdamW(1e-3, moments, b1=0.9, b2=0.95, weight_decay=0.1)
    assert opt.bf16_grads
    p0 = rng.standard_normal(n).astype(np.float32)
    pa, pb = p0.copy(), p0.copy()
    sa, sb = opt.init_state(pa), opt.init_state(pb)
    oa, ob = np.zeros(n, np.uint16), np.zeros(n, np.uint16)
    for count in (1, 2, 3):
        g_bits = f32_to_bf16_bits(_grads(rng, n))
        opt.update(pa, bf16_bits_to_f32(g_bits), sa, count, 0.5, oa)
        opt.update(pb, g_bits, sb, count, 0.5, ob)
        np.testing.assert_array_equal(pa, pb)
        np.testing.assert_array_equal(oa, ob)
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k])
    assert not np.array_equal(pa, p0)


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


def _special_floats(code):
    """Floats where a nearest-code lookup can go wrong: each code value and each midpoint (rounded
    both ways) and a few ulps around them, zeros, +-1, the lookup's clamp bounds, denormals,
    infinities, NaNs, values of every magnitude of both signs."""
    f = np.float32
    c = code.astype(np.float64)
    mids = (c[1:] + c[:-1]) / 2
    pts = np.concatenate([c, -c, mids, -mids]).astype(f)
    pts = np.concatenate([pts, np.nextafter(pts.astype(f), f(np.inf)), np.nextafter(pts.astype(f), f(-np.inf)),
                          mids.astype(np.float32), (mids * (1 + 1e-12)).astype(f), (mids * (1 - 1e-12)).astype(f)])
    near = pts.view(np.int32)[:, None] + np.arange(-4, 5, dtype=np.int32)[None, :]
    rng = np.random.default_rng(7)
    extra = np.array([0.0, -0.0, 1.0, -1.0, 2.0 ** -24, -(2.0 ** -24), 2.0 ** -25, 1e-45, -1e-45, 1.17e-38,
                      np.finfo(f).max, -np.finfo(f).max, np.inf, -np.inf, np.nan, -np.nan], np.float32)
    denorm = (rng.integers(1, 1 << 23, 2000, dtype=np.uint32) | (rng.integers(0, 2, 2000, dtype=np.uint32) << 31))
    mags = (rng.choice([-1, 1], 200000) * 10 ** rng.uniform(-12, 0.3, 200000)).astype(f)
    return np.concatenate([near.ravel().view(np.float32), extra, denorm.view(np.float32), mags,
                           rng.uniform(-1.2, 1.2, 200000).astype(f),
                           np.frombuffer(bytes([0x01, 0x00, 0xC0, 0x7F, 0x01, 0x00, 0xC0, 0xFF]), np.float32)])


@pytest.mark.parametrize("signed", [True, False])
def test_table_lookup_equals_binary_search_on_special_and_random_floats(signed):
    code = ca.CODE_SIGNED if signed else ca.CODE_UNSIGNED
    tab = ca.lookup_tables()[0 if signed else 1]
    x = _special_floats(code)
    # plus every float32 in [0.5, 1] and [-1, -0.5] (the densest part of both codes) and a stride
    # through all 2**32 bit patterns
    dense = np.arange(0x3F000000, 0x3F800001, dtype=np.uint32)
    x = np.concatenate([x, dense.view(np.float32), (dense | np.uint32(1 << 31)).view(np.float32),
                        np.arange(0, 1 << 32, 4099, dtype=np.uint64).astype(np.uint32).view(np.float32)])
    out = np.empty(x.size, np.uint8)
    ca.nearest_index(tab, x, out)
    with np.errstate(invalid="ignore"):  # inf - inf, NaN
        want = ca._nearest_np(code, x)
    bad = np.flatnonzero(out != want)
    assert bad.size == 0, (x[bad[:5]], out[bad[:5]], want[bad[:5]])


@pytest.mark.parametrize("signed", [True, False])
def test_table_lookup_equals_binary_search_for_every_float(signed):
    """A proof, not a sample: the nearest index is a monotone function of x (a binary search, then
    one rounded compare of the two neighbours), and the key of x grows with x in every slot (the
    negative slots invert it). The table gives, per slot, ``((E + w) >> 16) & 0xFF``: a two-valued step
    function of the key, stepping where the key carries into the slot bits (decoded from the table
    itself). Where both agree at the first and last key of a slot and on both sides of the table's
    step, they agree on every float of the slot; the clamps cover the rest (all |x| below the first
    bucket, all x beyond +-1, NaN)."""
    code = ca.CODE_SIGNED if signed else ca.CODE_UNSIGNED
    tab = ca.lookup_tables()[0 if signed else 1]
    assert tab.dtype == np.uint32 and tab.shape == (ca.LOOKUP_SLOTS,)
    slots, first, step = ca._table_steps(tab)
    assert np.all(first <= 255) and np.all(step >= 1) and np.all(step <= 1 << 16)
    keys = [np.zeros_like(slots), np.full_like(slots, (1 << 16) - 1)]
    inside = step < 1 << 16
    keys += [np.where(inside, step, 0), np.where(inside, step - 1, 0)]
    x = np.concatenate([ca._slot_floats(slots, k) for k in keys])
    assert np.all(np.isfinite(x)) and np.all(np.abs(x) <= 1.0)
    out = np.empty(x.size, np.uint8)
    ca.nearest_index(tab, x, out)
    np.testing.assert_array_equal(out, ca._nearest_np(code, x))
    # the decoded step function is the kernel's: an index at key 0 and one more from the step on
    np.testing.assert_array_equal(out[: slots.size], first)
    np.testing.assert_array_equal(out[2 * slots.size: 3 * slots.size], np.where(inside, first + 1, first))
    # the clamps: constant beyond them, by monotonicity of the reference
    zero = int(np.flatnonzero(code == 0.0)[0])
    lo = np.float32(np.uint32(ca.LOOKUP_LO).view(np.float32))
    edge = np.array([-lo, -0.0, 0.0, lo], np.float32)
    np.testing.assert_array_equal(ca._nearest_np(code, edge), zero)
    big = np.array([1.0, np.finfo(np.float32).max, np.inf, np.nan], np.float32)
    with np.errstate(invalid="ignore"):  # inf - inf, NaN
        np.testing.assert_array_equal(ca._nearest_np(code, big), 255)
        np.testing.assert_array_equal(ca._nearest_np(code, np.array([-1.0, -np.inf], np.float32)), 0)
    out = np.empty(8, np.uint8)
    ca.nearest_index(tab, np.concatenate([edge, big]), out)
    np.testing.assert_array_equal(out, [zero] * 4 + [255] * 4)


@pytest.mark.parametrize("signed", [True, False])
def test_every_code_index_is_reached_by_its_own_value(signed):
    """Each of the 256 code values maps to its own index through the table, and every index is the
    value at key 0 or after the step of some slot (no index is lost between slots)."""
    code = ca.CODE_SIGNED if signed else ca.CODE_UNSIGNED
    tab = ca.lookup_tables()[0 if signed else 1]
    out = np.empty(256, np.uint8)
    ca.nearest_index(tab, code, out)
    np.testing.assert_array_equal(out, np.arange(256))
    slots, first, step = ca._table_steps(tab)
    reached = set(first.tolist()) | set((first + (step < 1 << 16)).tolist())
    assert reached == set(range(256))


@pytest.mark.parametrize("gather", ca.GATHER_MODES)
def test_int8_kernel_bit_exact_with_extreme_moments(gather):
    """Zero gradients (absmax 0), a block with one huge gradient, tiny ones near the code's smallest
    values, eps_root > 0, no weight decay, more threads' worth of blocks: still the reference."""
    rng = np.random.default_rng(8)
    n = ca.BLOCK * 37 + 5
    p = rng.standard_normal(n).astype(np.float32)
    p_ref, st, st_ref = p.copy(), _int8_state(n), _int8_state(n)
    kw = dict(KW, eps_root=1e-12, weight_decay=0.0)
    for count in range(1, 5):
        g = _grads(rng, n)
        g[: ca.BLOCK] = 0.0
        g[ca.BLOCK + 3] = 1e30
        g[2 * ca.BLOCK: 3 * ca.BLOCK] *= np.float32(1e-7)
        bits = np.zeros(n, np.uint16)
        ca.adamw_int8_step(p, g, st, bits, count=count, gather=gather, **kw)
        with np.errstate(over="ignore", invalid="ignore"):  # 1e30 squared: v is inf, then NaN codes
            ref_bits = ca.reference_int8_step(p_ref, g, st_ref, count=count, **kw)
        np.testing.assert_array_equal(p, p_ref)
        np.testing.assert_array_equal(bits, ref_bits)
        for k in st:
            np.testing.assert_array_equal(st[k], st_ref[k], err_msg=k)


def test_int8_gather_choice_times_both_variants_then_keeps_the_faster(monkeypatch):
    """auto alternates hw and sw (the first call of each is not timed), then keeps the one with the
    higher median rate; a forced mode is kept from the start; the bits never depend on the choice."""
    c = ca._GatherChoice()
    c.reset("auto")
    seen = []
    for i in range(2 * (c.TRIALS + 1)):
        m = c.next()
        seen.append(m)
        c.record(m, c.MIN_ELEMS, 1.0 if m == "hw" else 0.5)  # sw twice as fast
    assert seen[:4] == ["hw", "sw", "hw", "sw"] and c.chosen == "sw" and c.next() == "sw"
    assert all(len(r) == c.TRIALS for r in c.rates.values())
    c.reset("hw")
    assert c.next() == "hw" and c.chosen == "hw"
    with pytest.raises(ValueError):
        c.reset("avx")
    # through adamw_int8_step: small calls are not timed; the result equals the forced variants'
    monkeypatch.setattr(ca, "_GATHER", ca._GatherChoice())
    ca._GATHER.reset("auto")
    rng = np.random.default_rng(9)
    n = ca.BLOCK * 2 + 3
    p0, g = rng.standard_normal(n).astype(np.float32), _grads(rng, n)
    res = []
    for gather in (None, None, "hw", "sw"):
        p, st = p0.copy(), _int8_state(n)
        ca.adamw_int8_step(p, g, st, None, count=1, gather=gather, **KW)
        res.append((p, st))
    assert ca._GATHER.calls == {"hw": 1, "sw": 1} and ca._GATHER.rates == {"hw": [], "sw": []}
    for p, st in res[1:]:
        np.testing.assert_array_equal(p, res[0][0])
        for k in st:
            np.testing.assert_array_equal(st[k], res[0][1][k])


def test_a_bad_gather_variable_is_a_one_line_error(tmp_path):
    """``MEGATRAIN_INT8_GATHER=avx``: the import still works; training with int8 moments stops before
    anything is written with one line naming the variable (exit 2)."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "megatrain_jax", "train", os.path.join(repo, "configs/tiny.yaml"),
                        "--set", "optim.moments=int8", "--set", "train.steps=2", "--set", "optim.schedule.warmup_steps=0", "--set", f"train.out_dir={out}"],
                       cwd=repo, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, MEGATRAIN_INT8_GATHER="avx", JAX_PLATFORMS="cpu"))
    err = r.stderr.strip()
    assert r.returncode == 2 and err.count("\n") == 0 and "MEGATRAIN_INT8_GATHER" in err, (r.returncode, err)
    assert not (out / "checkpoints").exists()
