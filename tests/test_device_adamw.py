"""The device (jitted JAX) AdamW step equals the host numba kernels bit for bit on the CPU backend, in
every moment mode; one compilation serves every step; a bf16 gradient is its exact f32 upcast; the
int8 lookup equals the host's for every kind of float; subnormals are the documented CPU difference."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megatrain_jax.optim import compact_adamw as ca
from megatrain_jax.optim import device_adamw as da
from megatrain_jax.optim.fused_adamw import fused_adamw_step

N = 3 * ca.BLOCK + 517  # a partial last block
KW = dict(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, eps_root=0.0)
MODES = ("float32", "bfloat16", "int8")


def _grads(rng, n, count):
    g = (rng.standard_normal(n) * 10 ** rng.uniform(-4, 0, n)).astype(np.float32)
    g[rng.random(n) < 0.05] = 0.0  # scattered zeros
    g[:ca.BLOCK] = 0.0  # a block of zeros: its int8 moments stay all zero (absmax 0)
    if count == 2:
        g[ca.BLOCK:ca.BLOCK + 50] *= 1e3  # an outlier: a block whose absmax jumps
    return g


def _state(mode, n):
    nb = -(-n // ca.BLOCK)
    return {"float32": {"mu": np.zeros(n, np.float32), "nu": np.zeros(n, np.float32)},
            "bfloat16": {"mu_bf16": np.zeros(n, np.uint16), "nu_bf16": np.zeros(n, np.uint16)},
            "int8": {"mu_q": np.zeros(n, np.uint8), "nu_q": np.zeros(n, np.uint8),
                     "mu_scale": np.zeros(nb, np.float32), "nu_scale": np.zeros(nb, np.float32)}}[mode]


def _host_step(mode, p, g, st, **kw):
    if mode == "float32":
        fused_adamw_step(p, g, st["mu"], st["nu"], None, **kw)
    elif mode == "bfloat16":
        ca.adamw_bf16_step(p, g, st, None, **kw)
    else:
        ca.adamw_int8_step(p, g, st, None, **kw)


def _device(p, st):
    return jnp.asarray(p.copy()), {k: jnp.asarray(v.copy()) for k, v in st.items()}


ON_GPU = jax.default_backend() == "gpu"


def _assert_same(p_dev, st_dev, p, st):
    """Bit for bit on the CPU. On a GPU (not bit-identical there, measured on an H100: a few int8 codes
    in thousands one step apart) within a float tolerance and 1% of codes off by one."""
    if ON_GPU:
        np.testing.assert_allclose(np.asarray(p_dev), p, rtol=1e-4, atol=1e-7)
        for k, v in st.items():
            got = np.asarray(st_dev[k])
            if v.dtype == np.uint8:
                diff = np.abs(got.astype(int) - v.astype(int))
                assert diff.max() <= 1 and (diff > 0).mean() <= 0.01, k
            elif v.dtype == np.uint16:
                np.testing.assert_allclose(got.astype(np.uint32) << 16, v.astype(np.uint32) << 16, err_msg=k)
            else:
                np.testing.assert_allclose(got, v, rtol=1e-4, atol=1e-7, err_msg=k)
        return
    np.testing.assert_array_equal(np.asarray(p_dev).view(np.uint32), p.view(np.uint32))
    assert set(st_dev) == set(st)
    for k, v in st.items():
        got = np.asarray(st_dev[k])
        assert got.dtype == v.dtype and got.shape == v.shape, k
        np.testing.assert_array_equal(got.view(np.uint8), v.view(np.uint8), err_msg=k)


@pytest.mark.parametrize("wd", [0.1, 0.0])
@pytest.mark.parametrize("mode", MODES)
def test_equals_host_kernel_bit_for_bit(mode, wd):
    rng = np.random.default_rng(0)
    p, st = rng.standard_normal(N).astype(np.float32), _state(mode, N)
    p_dev, st_dev = _device(p, st)
    p_ref, st_ref = p.copy(), {k: v.copy() for k, v in st.items()}  # int8: the numpy reference too
    for count in (1, 2, 3):
        g = _grads(rng, N, count)
        kw = dict(KW, weight_decay=wd, count=count, grad_scale=0.7)
        _host_step(mode, p, g, st, **kw)
        p_dev, st_dev = da.device_adamw_step(mode, p_dev, jnp.asarray(g), st_dev,
                                             ca.adamw_scalars(weight_decay=wd, count=count, grad_scale=0.7, **KW))
        _assert_same(p_dev, st_dev, p, st)
        if mode == "int8":
            ca.reference_int8_step(p_ref, g, st_ref, **kw)
            _assert_same(p_dev, st_dev, p_ref, st_ref)
    if mode == "int8":
        zero_s, zero_u = np.flatnonzero(ca.CODE_SIGNED == 0)[0], np.flatnonzero(ca.CODE_UNSIGNED == 0)[0]
        assert st["mu_scale"][0] == 0 and st["nu_scale"][0] == 0  # the block of zero gradients
        assert np.all(st["mu_q"][:ca.BLOCK] == zero_s) and np.all(st["nu_q"][:ca.BLOCK] == zero_u)
        assert np.all(st["mu_scale"][1:] > 0) and np.count_nonzero(st["mu_q"]) > N // 2
    elif mode == "float32":
        assert np.count_nonzero(st["mu"]) > N // 2


def test_one_compilation_serves_every_step():
    n = 1000  # a shape no other test uses: a fresh cache entry
    for mode in MODES:
        fn = da._JITS[mode]
        before = fn._cache_size()
        p, st = _device(np.ones(n, np.float32), _state(mode, n))
        for count, lr in ((1, 1e-3), (2, 5e-4)):
            g = jnp.full(n, 0.01, jnp.float32)
            p, st = da.device_adamw_step(mode, p, g, st, ca.adamw_scalars(lr, 0.9, 0.999, 1e-8, 0.0, 0.1, count, 1.0))
        assert fn._cache_size() == before + 1, mode


@pytest.mark.parametrize("mode", MODES)
def test_bf16_grad_equals_its_f32_upcast(mode):
    rng = np.random.default_rng(3)
    g16 = jnp.asarray(_grads(rng, N, 1)).astype(jnp.bfloat16)
    g32 = g16.astype(jnp.float32)
    assert np.count_nonzero(np.asarray(g32)) > N // 2
    p, st = rng.standard_normal(N).astype(np.float32), _state(mode, N)
    sc = ca.adamw_scalars(weight_decay=0.1, count=1, grad_scale=0.7, **KW)
    p16, st16 = da.device_adamw_step(mode, _device(p, st)[0], g16, _device(p, st)[1], sc)
    p32, st32 = da.device_adamw_step(mode, _device(p, st)[0], g32, _device(p, st)[1], sc)
    _assert_same(p16, st16, np.asarray(p32), {k: np.asarray(v) for k, v in st32.items()})


def test_param_and_state_are_donated_without_warnings():
    p, st = _device(np.ones(N, np.float32), _state("float32", N))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new_p, new_st = da.device_adamw_step("float32", p, jnp.zeros(N, jnp.float32), st,
                                             ca.adamw_scalars(weight_decay=0.1, count=1, grad_scale=1.0, **KW))
    assert p.is_deleted() and st["mu"].is_deleted() and st["nu"].is_deleted()
    assert new_p.shape == (N,) and new_p.dtype == jnp.float32


def test_lookup_equals_host_for_every_kind_of_float():
    """``nearest_code`` works on bits only: NaNs of either sign, +-0.0, +-inf, subnormals, random bit
    patterns and the code values and midpoints all give the host kernel's index."""
    rng = np.random.default_rng(4)
    mids = (ca.CODE_SIGNED[1:] + ca.CODE_SIGNED[:-1]) / 2
    special = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, 1e-40, -1e-40, 2.0 ** -24, -(2.0 ** -24)], np.float32)
    xs = np.concatenate([rng.integers(0, 2 ** 32, 100_000, dtype=np.uint64).astype(np.uint32).view(np.float32),
                         rng.uniform(-1, 1, 50_000).astype(np.float32), ca.CODE_SIGNED, mids.astype(np.float32),
                         special, np.array([0x7FC00000, 0xFFC00000, 0x7F800001], np.uint32).view(np.float32)])
    for tab in ca.lookup_tables():
        want = np.zeros(xs.size, np.uint8)
        ca.nearest_index(tab, xs, want)
        got = jax.jit(da.nearest_code)(jnp.asarray(tab), jnp.asarray(xs))
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="documents XLA:CPU's flush-to-zero")
def test_subnormals_are_the_cpu_difference():
    """XLA:CPU flushes subnormals (its runtime sets FTZ/DAZ): g*g of |g| ~ 1e-20 is a subnormal ``nu``
    on the host and 0 here; nothing else differs (the square root of it vanishes next to eps)."""
    rng = np.random.default_rng(5)
    g = _grads(rng, N, 1)
    tiny = rng.random(N) < 0.1
    g[tiny] = np.float32(1e-20)
    p, st = rng.standard_normal(N).astype(np.float32), _state("float32", N)
    p_dev, st_dev = _device(p, st)
    fused_adamw_step(p, g, st["mu"], st["nu"], None, weight_decay=0.1, count=1, grad_scale=1.0, **KW)
    p_dev, st_dev = da.device_adamw_step("float32", p_dev, jnp.asarray(g), st_dev,
                                         ca.adamw_scalars(weight_decay=0.1, count=1, grad_scale=1.0, **KW))
    np.testing.assert_array_equal(np.asarray(p_dev), p)
    np.testing.assert_array_equal(np.asarray(st_dev["mu"]), st["mu"])
    nu = np.asarray(st_dev["nu"])
    diff = nu != st["nu"]
    assert np.array_equal(diff, tiny)
    assert np.all(nu[tiny] == 0) and np.all((st["nu"][tiny] > 0) & (st["nu"][tiny] < np.finfo(np.float32).tiny))


def test_refuses_bad_arguments():
    p, st = _device(np.ones(10, np.float32), _state("float32", 10))
    sc = ca.adamw_scalars(weight_decay=0.1, count=1, grad_scale=1.0, **KW)
    with pytest.raises(ValueError, match="moments"):
        da.device_adamw_step("fp8", p, p, st, sc)
    with pytest.raises(ValueError, match="keys"):
        da.device_adamw_step("bfloat16", p, p, st, sc)
    with pytest.raises(TypeError, match="float32"):
        da.device_adamw_step("float32", p, p.astype(jnp.float16), st, sc)
    with pytest.raises(ValueError, match="11"):
        da.device_adamw_step("float32", p, p, st, sc[:10])


@pytest.mark.parametrize("mode", MODES)
def test_chunked_step_equals_host_kernel(mode, monkeypatch):
    """Groups longer than ``CHUNK`` are stepped slice by slice in place (bounded temporaries): the same
    bits as the host kernel over the whole group, a partial last slice and block included."""
    monkeypatch.setattr(da, "CHUNK", 2 * ca.BLOCK)
    n = 5 * ca.BLOCK + 300  # two full slices and a partial one (a new shape: traced with the small CHUNK)
    rng = np.random.default_rng(7)
    p = rng.standard_normal(n).astype(np.float32)
    st = _state(mode, n)
    for count in (1, 2):
        g = _grads(rng, n, count)
        p_dev, st_dev = _device(p, st)
        scal = ca.adamw_scalars(weight_decay=0.1, count=count, grad_scale=0.5, **KW)
        p_dev, st_dev = da.device_adamw_step(mode, p_dev, jnp.asarray(g), st_dev, scal)
        _host_step(mode, p, g, st, weight_decay=0.1, count=count, grad_scale=0.5, **KW)
        _assert_same(p_dev, st_dev, p, st)
