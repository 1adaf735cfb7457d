"""Host optimizers against optax computed independently, on fresh random data."""
from __future__ import annotations

import mmap
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from megatrain_jax.config import OptimConfig, ScheduleConfig
from megatrain_jax.errors import UserError
from megatrain_jax.optim import (FusedAdamW, OptaxHostOptimizer, alloc_aligned, build_host_optimizer,
                                 build_reference_tx, build_schedule, global_norm_scale)
from megatrain_jax.optim.fused_adamw import (adamw_update_, bf16_bits_to_f32, f32_to_bf16_bits,
                                             fused_adamw_step, to_bf16_bits_)

CPU = jax.devices("cpu")[0]


@pytest.fixture(autouse=True)
def _on_cpu():
    with jax.default_device(CPU):  # the optax references run on the CPU, as the host optimizer does
        yield


def _rng():
    return np.random.default_rng()  # fresh data every run


def _bf16_ref(x: np.ndarray) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.bfloat16)).view(np.uint16)


def _optax_steps(tx, p, grads):
    """optax applied op by op to a single array; returns params, mu, nu after every step."""
    p = jnp.asarray(p)
    state = tx.init(p)
    out = []
    for g in grads:
        u, state = tx.update(jnp.asarray(g), state, p)
        p = optax.apply_updates(p, u)
        adam = state[0]
        out.append((np.asarray(p), np.asarray(adam.mu), np.asarray(adam.nu)))
    return out


def _close(a, b, rtol=1e-6):
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * float(np.max(np.abs(b))))


CASES = {
    "wd": dict(lr=1e-3, wd=0.1, b2=0.999, eps=1e-8, scale=1.0),
    "warmup_cosine": dict(lr=optax.warmup_cosine_decay_schedule(0.0, 3e-3, 2, 6, 3e-4), wd=0.01,
                          b2=0.95, eps=1e-8, scale=1.0),
    "grad_scale": dict(lr=1e-3, wd=0.0, b2=0.95, eps=1e-8, scale=0.37),
    "large_eps_lr": dict(lr=0.1, wd=0.05, b2=0.99, eps=1e-2, scale=0.8),  # eps placement matters here
}


@pytest.mark.parametrize("case", CASES)
def test_fused_adamw_matches_optax(case):
    c = CASES[case]
    rng = _rng()
    n = 10_007
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = [(rng.standard_normal(n) * rng.uniform(0.1, 3)).astype(np.float32) for _ in range(6)]
    ref_tx = optax.adamw(c["lr"], b1=0.9, b2=c["b2"], eps=c["eps"], weight_decay=c["wd"])
    ref = _optax_steps(ref_tx, p0, [g * np.float32(c["scale"]) for g in grads])

    opt = FusedAdamW(c["lr"], b1=0.9, b2=c["b2"], eps=c["eps"], weight_decay=c["wd"])
    p = alloc_aligned(n)
    p[:] = p0
    state = opt.init_state(p)
    bf16 = alloc_aligned(n, np.uint16)
    for count, (g, (rp, rm, rv)) in enumerate(zip(grads, ref), start=1):
        opt.update(p, g, state, count, grad_scale=c["scale"], bf16_out=bf16)
        _close(p, rp)
        _close(state["mu"], rm)
        _close(state["nu"], rv)
        np.testing.assert_array_equal(bf16, _bf16_ref(p))
        # the kernel is the optax arithmetic op for op: bit-identical to optax run eagerly
        np.testing.assert_array_equal(p, rp)
        np.testing.assert_array_equal(state["nu"], rv)


def test_raw_kernel_matches_optax():
    rng = _rng()
    n = 4099
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(4)]
    ref = _optax_steps(optax.adamw(2e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1), p0, grads)
    p, m, v = p0.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
    no_bf16 = np.zeros(0, np.uint16)
    for count, (g, (rp, rm, rv)) in enumerate(zip(grads, ref), start=1):
        adamw_update_(p, g, m, v, no_bf16, 2e-3, 0.9, 0.999, 1e-8, 0.0, 0.1, count, 1.0)
        _close(p, rp)
        _close(m, rm)
        _close(v, rv)


def test_fused_step_rejects_bad_buffers():
    p = np.zeros(8, np.float32)
    kw = dict(lr=1e-3, b1=0.9, b2=0.99, eps=1e-8, eps_root=0.0, weight_decay=0.0, count=1)
    with pytest.raises(TypeError, match="grad"):
        fused_adamw_step(p, np.zeros(8, np.float64), p.copy(), p.copy(), None, **kw)
    with pytest.raises(TypeError, match="mu"):
        fused_adamw_step(p, p.copy(), np.zeros(16, np.float32)[::2], p.copy(), None, **kw)
    with pytest.raises(ValueError, match="nu"):
        fused_adamw_step(p, p.copy(), p.copy(), np.zeros(9, np.float32), None, **kw)
    with pytest.raises(ValueError, match="count"):
        fused_adamw_step(p, p.copy(), p.copy(), p.copy(), None, **{**kw, "count": 0})


def test_bf16_bits_special_values():
    bits = np.array([0x7F800001, 0xFF800001, 0x7FC00000, 0x7F812345, 0x7F7FFFFF, 0xFF7FFFFF,
                     0x7F800000, 0xFF800000, 0x00000001, 0x00008000, 0x00018000, 0x80008001,
                     0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F807FFF, 0, 0x80000000], np.uint32)
    x = np.concatenate([bits.view(np.float32), _rng().standard_normal(1000).astype(np.float32)])
    ref = _bf16_ref(x)
    np.testing.assert_array_equal(f32_to_bf16_bits(x), ref)
    out = np.zeros(x.shape[0], np.uint16)
    to_bf16_bits_(x, out)
    np.testing.assert_array_equal(out, ref)
    back = bf16_bits_to_f32(ref)
    np.testing.assert_array_equal(back, np.asarray(jnp.asarray(ref.view(jnp.bfloat16)).astype(jnp.float32)))


def _two_leaf_group(rng):
    shapes = {"b": (7,), "w": (13, 5)}
    sizes = {k: int(np.prod(s)) for k, s in shapes.items()}
    n = sum(sizes.values())

    def unflatten(flat):
        out, off = {}, 0
        for k in sorted(shapes):
            out[k] = flat[off:off + sizes[k]].reshape(shapes[k])
            off += sizes[k]
        return out

    flat = alloc_aligned(n)
    flat[:] = rng.standard_normal(n).astype(np.float32)
    return flat, unflatten


TXS = {
    "adamw_masked": lambda: optax.adamw(1e-2, b1=0.9, b2=0.95, weight_decay=0.1,
                                        mask=lambda t: {"b": False, "w": True}),
    "lion": lambda: optax.lion(optax.cosine_decay_schedule(1e-3, 10), weight_decay=0.01),
}


@pytest.mark.parametrize("name", TXS)
def test_optax_host_optimizer_matches_optax(name):
    rng = _rng()
    flat, unflatten = _two_leaf_group(rng)
    ref_tx = TXS[name]()
    ref_p = jax.tree.map(lambda a: jnp.asarray(a.copy()), unflatten(flat))
    ref_state = ref_tx.init(ref_p)

    opt = OptaxHostOptimizer(TXS[name](), cpu_device=CPU)
    state = opt.init_state(flat, unflatten)
    bf16 = alloc_aligned(flat.shape[0], np.uint16)
    for count in range(1, 5):
        grad = rng.standard_normal(flat.shape[0]).astype(np.float32)
        scale = 0.5 if count == 3 else 1.0
        g_tree = jax.tree.map(lambda a: jnp.asarray(a * np.float32(scale)), unflatten(grad))
        u, ref_state = ref_tx.update(g_tree, ref_state, ref_p)
        ref_p = optax.apply_updates(ref_p, u)
        opt.update(flat, grad, state, count, grad_scale=scale, bf16_out=bf16, unflatten=unflatten)
        for k, leaf in unflatten(flat).items():
            _close(leaf, np.asarray(ref_p[k]))
        np.testing.assert_array_equal(bf16, _bf16_ref(flat))


def test_optax_host_optimizer_requires_views():
    rng = _rng()
    flat, unflatten = _two_leaf_group(rng)
    opt = OptaxHostOptimizer(optax.sgd(0.1), cpu_device=CPU)
    copies = lambda a: {k: v.copy() for k, v in unflatten(a).items()}  # noqa: E731
    with pytest.raises(ValueError, match="views"):
        opt.init_state(flat, copies)
    backwards = lambda a: {"b": a[65:].reshape(7), "w": a[:65].reshape(13, 5)}  # noqa: E731  not in leaf order
    with pytest.raises(ValueError, match="leaf order"):
        opt.init_state(flat, backwards)


@pytest.mark.parametrize("clip", [0.5, 1e6])
def test_global_norm_scale_matches_optax(clip):
    rng = _rng()
    tree = {"a": rng.standard_normal((31, 7)).astype(np.float32) * 3,
            "b": rng.standard_normal(101).astype(np.float32)}
    ref, _ = optax.clip_by_global_norm(clip).update(jax.tree.map(jnp.asarray, tree), optax.EmptyState())
    sq = sum(float(np.sum(np.square(x, dtype=np.float64))) for x in tree.values())
    s = global_norm_scale(sq, clip)
    assert (s == 1.0) == (clip > 100)
    for k in tree:
        _close(tree[k] * np.float32(s), np.asarray(ref[k]))
    assert global_norm_scale(sq, None) == 1.0


@pytest.mark.parametrize("dtype", [np.float32, np.uint16, np.int8])
def test_alloc_aligned(dtype):
    for n in (0, 1, 1000, mmap.PAGESIZE + 3, (4 << 20) // np.dtype(dtype).itemsize + 1):  # last: huge pages
        a = alloc_aligned(n, dtype)
        assert a.shape == (n,) and a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable
        assert a.ctypes.data % mmap.PAGESIZE == 0
        assert not a.any()
        a[:] = 1
    b = alloc_aligned(10)
    assert not np.shares_memory(a[:10].view(np.uint8), b.view(np.uint8))


def _roundtrip(opt, flat, unflatten, rng, steps_before=2, steps_after=2):
    state = opt.init_state(flat, unflatten)
    grads = [rng.standard_normal(flat.shape[0]).astype(np.float32) for _ in range(steps_before + steps_after)]
    for count in range(1, steps_before + 1):
        opt.update(flat, grads[count - 1], state, count, unflatten=unflatten)
    saved = {k: np.array(v, copy=True) for k, v in opt.state_to_arrays(state).items()}
    assert all(isinstance(v, np.ndarray) for v in saved.values())
    flat2 = alloc_aligned(flat.shape[0])
    flat2[:] = flat
    state2 = opt.state_from_arrays(saved, flat2, unflatten)
    for count in range(steps_before + 1, steps_before + steps_after + 1):
        opt.update(flat, grads[count - 1], state, count, unflatten=unflatten)
        opt.update(flat2, grads[count - 1], state2, count, unflatten=unflatten)
    np.testing.assert_array_equal(flat, flat2)
    a, b = opt.state_to_arrays(state), opt.state_to_arrays(state2)
    assert a.keys() == b.keys() == saved.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    with pytest.raises(ValueError, match="keys"):
        opt.state_from_arrays({}, flat2, unflatten)
    return saved


def test_state_roundtrip_fused():
    rng = _rng()
    flat, unflatten = _two_leaf_group(rng)
    saved = _roundtrip(FusedAdamW(optax.linear_schedule(1e-2, 1e-3, 5), weight_decay=0.1), flat,
                       unflatten, rng)
    assert set(saved) == {"mu", "nu"}


def test_state_roundtrip_optax():
    rng = _rng()
    flat, unflatten = _two_leaf_group(rng)
    opt = OptaxHostOptimizer(TXS["adamw_masked"](), cpu_device=CPU)
    state = opt.init_state(flat, unflatten)
    assert opt.state_to_arrays(state)["float32"] is state["float32"]  # the buffers themselves: written in place
    saved = _roundtrip(opt, flat, unflatten, rng)
    # one flat buffer per dtype: mu and nu of both leaves, and the count
    assert {k: v.shape for k, v in saved.items()} == {"float32": (2 * 72,), "int32": (1,)}
    tree = opt.state_tree(saved, flat, unflatten)
    assert tree[0].mu["w"].shape == (13, 5) and int(tree[0].count) == 2  # saved after two steps


def test_state_roundtrip_named_keys_carry_the_optimizer():
    """A named optimizer's state keys start with its name: another optimizer's state is refused by
    name; unprefixed keys (an ``OptaxHostOptimizer`` checkpoint) still load."""
    rng = _rng()
    flat, unflatten = _two_leaf_group(rng)
    opt = build_host_optimizer(OptimConfig(name="adafactor", kernel="optax", min_dim_size_to_factor=4), 10)
    saved = _roundtrip(opt, flat, unflatten, rng)
    assert saved and all(k.startswith("adafactor/") for k in saved)
    # factored: the leaf's real shape reached optax (a row and a column statistic of the 13 x 5 matrix)
    tree = opt.state_tree(saved, flat, unflatten)
    v = [x for x in jax.tree.leaves(tree, is_leaf=lambda x: hasattr(x, "v_row")) if hasattr(x, "v_row")][0]
    assert {v.v_row["w"].shape, v.v_col["w"].shape} == {(13,), (5,)}
    legacy = opt.state_from_arrays({k.split("/", 1)[1]: v for k, v in saved.items()}, flat, unflatten)
    assert {k: v.shape for k, v in opt.state_to_arrays(legacy).items()} == {k: v.shape for k, v in saved.items()}
    with pytest.raises(ValueError, match="holds lion optimizer state, this run's optimizer is adafactor"):
        opt.state_from_arrays({"lion/" + k.split("/", 1)[1]: v for k, v in saved.items()}, flat, unflatten)
    with pytest.raises(ValueError, match="not adafactor state"):
        opt.state_from_arrays({"mu": flat.copy(), "nu": flat.copy()}, flat, unflatten)


@pytest.mark.parametrize("kernel", ["fused", "optax"])
def test_concurrent_updates_match_sequential(kernel):
    """The engine updates different groups from a thread pool at once."""
    rng = _rng()
    cfg = OptimConfig(kernel=kernel, weight_decay=0.1)
    opt = build_host_optimizer(cfg, 10)
    sizes = [50_000, 70_001, 50_000, 3, 70_001, 50_000]
    p0 = [rng.standard_normal(s).astype(np.float32) for s in sizes]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in sizes] for _ in range(3)]
    results = []
    for threads in (1, 4):
        ps = [alloc_aligned(s) for s in sizes]
        outs = [alloc_aligned(s, np.uint16) for s in sizes]
        for p, x in zip(ps, p0):
            p[:] = x
        states = [opt.init_state(p) for p in ps]
        with ThreadPoolExecutor(threads) as pool:
            for count, gs in enumerate(grads, start=1):
                list(pool.map(lambda i: opt.update(ps[i], gs[i], states[i], count, 0.9, outs[i]),
                              range(len(sizes))))
        results.append((ps, outs))
    for a, b in zip(*(r[0] for r in results)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(*(r[1] for r in results)):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------------- config builders


@pytest.mark.parametrize("kind", ["constant", "cosine", "warmup_cosine", "linear"])
def test_build_schedule(kind):
    cfg = OptimConfig(lr=2e-3, schedule=ScheduleConfig(kind=kind, warmup_steps=3, end_lr_ratio=0.1))
    sched = build_schedule(cfg, total_steps=20)
    vals = np.array([float(sched(i)) for i in range(21)])
    assert vals[0] == 0.0 and abs(vals[3] - 2e-3) < 1e-9  # linear warmup from 0 to lr
    expected_end = 2e-3 if kind == "constant" else 2e-4
    assert abs(vals[20] - expected_end) < 1e-9
    assert np.all(np.diff(vals[3:]) <= 1e-12)
    opt = build_host_optimizer(cfg, 20)
    assert isinstance(opt, FusedAdamW)
    assert [float(opt.lr_at(c)) for c in (1, 2, 5)] == [float(np.float32(sched(c - 1))) for c in (1, 2, 5)]


def test_build_schedule_errors():
    with pytest.raises(UserError, match="warmup"):
        build_schedule(OptimConfig(schedule=ScheduleConfig(kind="cosine", warmup_steps=10)), 10)


def test_build_host_optimizer_kinds():
    assert isinstance(build_host_optimizer(OptimConfig(), 10), FusedAdamW)
    for name, extra in [("adamw", {}), ("sgd", {"weight_decay": 0.1}), ("optax", {"optax_name": "lion"})]:
        opt = build_host_optimizer(OptimConfig(kernel="optax", name=name, **extra), 10)
        assert isinstance(opt, OptaxHostOptimizer)
    with pytest.raises(UserError, match="optax_name"):
        build_host_optimizer(OptimConfig(kernel="optax", name="optax", optax_name="nope"), 10)
    with pytest.raises(UserError, match="fused"):
        build_host_optimizer(OptimConfig(kernel="fused", name="sgd"), 10)


def test_reference_tx_matches_host_updates_with_clipping():
    """What the streamed engine does per group (clip factor from the global norm, then the host
    update) equals the reference trainer's optax chain on the whole model."""
    rng = _rng()
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, clip_norm=1.0,
                      schedule=ScheduleConfig(kind="warmup_cosine", warmup_steps=2))
    groups = [rng.standard_normal(n).astype(np.float32) for n in (300, 501)]
    ref_tx = build_reference_tx(cfg, 8)
    ref_p = {str(i): jnp.asarray(g) for i, g in enumerate(groups)}
    ref_state = ref_tx.init(ref_p)
    opt = build_host_optimizer(cfg, 8)
    ps = [alloc_aligned(g.shape[0]) for g in groups]
    for p, g in zip(ps, groups):
        p[:] = g
    states = [opt.init_state(p) for p in ps]
    for count in range(1, 6):
        grads = [(rng.standard_normal(p.shape[0]) * 0.2).astype(np.float32) for p in ps]
        u, ref_state = ref_tx.update({str(i): jnp.asarray(g) for i, g in enumerate(grads)}, ref_state, ref_p)
        ref_p = optax.apply_updates(ref_p, u)
        s = global_norm_scale(sum(float(np.sum(np.square(g, dtype=np.float64))) for g in grads), cfg.clip_norm)
        for p, g, st in zip(ps, grads, states):
            opt.update(p, g, st, count, grad_scale=s)
        for i, p in enumerate(ps):
            _close(p, np.asarray(ref_p[str(i)]))
