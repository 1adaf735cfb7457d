"""The grouped expert computation (``models/grouped_experts.py``) against the dense reference: values and
every gradient in fp32 on Mixtral-like and Qwen3-MoE-like tiny shapes with uneven and empty expert groups,
with biases and gpt-oss's clamped activation; the layout's invariants; and that the grouped path never
computes an expert for a token not routed to it (the compiled program's FLOPs)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megatrain_jax.models import grouped_experts
from megatrain_jax.models.grouped_experts import dispatch_layout, experts_dense, padded_rows, routed_experts


def _inputs(t, h, f, e, k, *, empty=0, seed=0, biases=False):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(t, e))
    logits[:, :empty] -= 100.0  # the first `empty` experts get no token: zero-size groups
    logits[: t // 2, -1] += 3.0  # one expert gets far more than the others: uneven groups
    idx = jnp.asarray(np.argsort(-logits, axis=1)[:, :k], jnp.int32)
    x = jnp.asarray(rng.normal(size=(t, h)), jnp.float32)
    w = jnp.asarray(rng.random((t, k)), jnp.float32)
    ws = [jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for s in ((e, h, f), (e, h, f), (e, f, h))]
    b = tuple(jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for s in ((e, f), (e, f), (e, h))) if biases else None
    return x, w, idx, ws, b


def clamped_swiglu(gate, up, alpha=1.702, limit=7.0):
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(alpha * gate)


CASES = {  # name: (tokens, hidden, width, experts, top-k, empty experts, biases, activation)
    "mixtral_like_top2of4": (23, 8, 12, 4, 2, 1, False, None),
    "qwen3moe_like_top3of8": (19, 8, 6, 8, 3, 3, False, None),
    "gptoss_like_bias_clamped": (17, 8, 6, 8, 2, 2, True, clamped_swiglu),
    "top_k_equals_experts": (9, 8, 6, 3, 3, 0, False, None),
}


@pytest.mark.parametrize("fused", [True, False], ids=["gate_up_fused", "gate_up_apart"])
@pytest.mark.parametrize("case", list(CASES))
def test_grouped_equals_dense_in_value_and_every_gradient(case, fused, monkeypatch):
    monkeypatch.setattr(grouped_experts.XLA, "fuse_gate_up", fused)
    t, h, f, e, k, empty, biases, act = CASES[case]
    x, w, idx, ws, b = _inputs(t, h, f, e, k, empty=empty, biases=biases)

    def run(impl):
        def loss(x, w, ws, b):
            y = routed_experts(x, w, idx, *ws, impl=impl, act=act, biases=b)
            return jnp.sum(y * jnp.cos(y))

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, w, ws, b)

    dense = run("dense")
    for impl in ("sorted", "ragged"):
        for a, d in zip(jax.tree_util.tree_leaves(run(impl)), jax.tree_util.tree_leaves(dense)):
            np.testing.assert_allclose(a, d, rtol=2e-4, atol=2e-4, err_msg=impl)


def test_layout_puts_every_pair_once_in_a_tile_of_its_own_expert():
    t, k, e, tile = 37, 3, 6, 4
    _, _, idx, _, _ = _inputs(t, 4, 4, e, k, empty=2)
    lay = dispatch_layout(idx, e, tile)
    rows = padded_rows(t * k, e, tile)
    assert lay.rows == rows and rows % tile == 0
    row_of_pair = np.asarray(lay.row_of_pair)
    assert len(set(row_of_pair.tolist())) == t * k  # no two pairs share a row
    pair_of_row = np.asarray(lay.pair_of_row)
    np.testing.assert_array_equal(pair_of_row[row_of_pair], np.arange(t * k))
    tile_expert = np.asarray(lay.tile_expert)
    flat = np.asarray(idx).reshape(-1)
    np.testing.assert_array_equal(tile_expert[row_of_pair // tile], flat)  # each pair in a tile of its expert
    sizes = np.bincount(flat, minlength=e)
    np.testing.assert_array_equal(np.asarray(lay.tiles_per_expert), -(-sizes // tile))
    assert int(lay.used_tiles) == int(np.sum(-(-sizes // tile)))
    padding = pair_of_row == t * k
    assert np.all(np.asarray(lay.token_of_row)[padding] == t)  # padding rows read the zero row


def test_grouped_path_never_densifies():
    """The compiled forward + backward of the grouped layer does about the routed work (T*k rows plus tile
    padding per projection), far below every expert on every token: read from XLA's cost analysis."""
    t, h, f, e, k = 64, 32, 32, 32, 2
    x, w, idx, ws, _ = _inputs(t, h, f, e, k)

    def flops(impl):
        def loss(x, w, ws):
            return jnp.sum(routed_experts(x, w, idx, *ws, impl=impl) ** 2)

        cost = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, w, ws).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return cost["flops"]

    routed = 9 * 2 * padded_rows(t * k, e, 8) * h * f  # 3 projections x (forward, input grad, weight grad)
    dense = 9 * 2 * t * e * h * f
    grouped = flops("sorted")
    assert grouped < 1.5 * routed < 0.5 * dense, (grouped, routed, dense)
    assert flops("dense") > 0.9 * dense  # (the reference does densify: the measure can tell them apart)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False], ids=["gate_up_fused", "gate_up_apart"])
@pytest.mark.parametrize("hf,warp", [((128, 192), False), ((192, 128), False), ((256, 512), True)],
                         ids=["h128_f192", "h192_f128", "h256_f512_warp_specialized"])
def test_hopper_kernels_equal_dense(hf, warp, fused, monkeypatch):
    """On a Hopper GPU, ``auto`` runs Mosaic GPU grouped matmuls (``models/grouped_kernels.py``; at the last
    shape the projections take the warp-specialized kernel, ``models/hopper_grouped_matmul.py``): the same values
    and gradients as the dense reference, in bf16 tolerance, gate and up fused or apart."""
    from megatrain_jax.models import grouped_kernels

    h, f = hf
    mm = grouped_kernels.MosaicGroupedMatmul(fuse_gate_up=fused, warp=grouped_kernels.WARP_TILES if warp else None)
    monkeypatch.setattr(grouped_kernels, "OVERRIDE", mm)
    if grouped_experts.backend_for("auto", h, f, 8, 256 * 2)[0] is grouped_experts.XLA:
        pytest.skip("not a Hopper GPU")
    x, w, idx, ws, _ = _inputs(256, h, f, 8, 2, empty=1)
    x, ws = x.astype(jnp.bfloat16), [a.astype(jnp.bfloat16) for a in ws]

    def run(impl):
        def loss(x, ws):
            return jnp.sum(routed_experts(x, w.astype(jnp.bfloat16), idx, *ws, impl=impl).astype(jnp.float32) ** 2)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, ws)

    for a, d in zip(jax.tree_util.tree_leaves(run("auto")), jax.tree_util.tree_leaves(run("dense"))):
        a, d = np.asarray(a, np.float32), np.asarray(d, np.float32)
        assert np.max(np.abs(a - d)) <= 0.03 * np.max(np.abs(d)) + 1e-3


@pytest.mark.parametrize("transpose", [False, True], ids=["w", "w_transposed"])
@pytest.mark.parametrize("split_m", [False, True], ids=["warpgroups_split_n", "warpgroups_split_m"])
def test_warp_specialized_kernel_traces(transpose, split_m):
    """The warp-specialized grouped matmul (``models/hopper_grouped_matmul.py``) builds its kernel for both weight
    layouts and both warpgroup splits (it runs only on a Hopper GPU: ``test_hopper_kernels_equal_dense``), and
    refuses a shape its tiles do not divide."""
    from megatrain_jax.models import hopper_grouped_matmul as hg

    tiles = hg.WarpTiles(tile_m=64 if split_m else 128, tile_n=256 if split_m else 128, split_m=split_m)
    m, k, n, e = 1024, 256, 512, 4
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
            jax.ShapeDtypeStruct((e, n, k) if transpose else (e, k, n), jnp.bfloat16),
            jax.ShapeDtypeStruct((m // 128,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
    traced = jax.jit(lambda a, w, te, u: hg.grouped_matmul(a, w, te, u, tiles, transpose_rhs=transpose)).trace(*args)
    assert traced.out_info.shape == (m, n)
    with pytest.raises(ValueError, match="does not suit"):
        hg.grouped_matmul(jnp.zeros((1024, 256), jnp.bfloat16), jnp.zeros((4, 256, 320), jnp.bfloat16),
                          jnp.zeros((8,), jnp.int32), jnp.int32(8), tiles)


@pytest.mark.parametrize("dtype,hf,expect", [
    (jnp.bfloat16, (256, 512), "warp"),  # whole blocks of 256, a 16-bit dtype: the warp-specialized kernel
    (jnp.bfloat16, (2880, 2880), "mgpu"),  # gpt-oss-120b's 2880 is 11.25 blocks: JAX's ragged_dot_mgpu
    (jnp.float32, (256, 512), "mgpu"),  # fp32 compute: not wgmma's 16-bit inputs
], ids=["bf16_whole_blocks", "bf16_2880", "fp32"])
def test_hopper_projection_kernel_choice(dtype, hf, expect, monkeypatch):
    """Which kernel ``MosaicGroupedMatmul.gmm`` hands a projection to (the kernels themselves run only on a Hopper
    GPU: ``test_hopper_kernels_equal_dense``)."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    from megatrain_jax.models import grouped_kernels, hopper_grouped_matmul

    called = []
    monkeypatch.setattr(hopper_grouped_matmul, "grouped_matmul", lambda a, w, *_, **__: called.append("warp") or a)
    monkeypatch.setattr(ragged_dot_mgpu, "ragged_dot", lambda a, w, **_: called.append("mgpu") or a)
    h, f = hf
    _, _, idx, _, _ = _inputs(64, 8, 8, 4, 2)
    lay = dispatch_layout(idx, 4, 128)
    mm = grouped_kernels.MosaicGroupedMatmul()
    mm.gmm(jnp.zeros((lay.rows, h), dtype), jnp.zeros((4, h, f), dtype), lay)
    mm.gmm(jnp.zeros((lay.rows, h), dtype), jnp.zeros((4, f, h), dtype), lay, transpose_w=True)
    assert called == [expect, expect]
