"""The routed experts of a mixture-of-experts layer, each computed only for the tokens routed to it.

``routed_experts(x, weights, idx, wg, wu, wd)`` is what every MoE family calls: ``x`` (T, H) the
layer's tokens, ``idx`` (T, k) the experts each token is routed to and ``weights`` (T, k) their
router weights; the experts' SwiGLU weights are stacked ``wg``, ``wu`` (E, H, F) and ``wd``
(E, F, H). It returns ``sum_j weights[t, j] * expert_{idx[t, j]}(x[t])`` exactly, for every token:
no capacity, no token dropped (transformers' result).

**The grouped layout.** The T*k (token, expert) pairs are sorted by expert, and each expert's group
is padded to a multiple of ``tile`` rows, so every tile of rows belongs to one expert
(``DispatchLayout``). The static row count is ``T*k + E*(tile-1)`` rounded up to a tile: padding
rows read a zero token and are never read back. The three projections are then *grouped matmuls*:
tile ``i`` multiplies by the weights of expert ``tile_expert[i]``; the weight gradients are, per
expert, the product over that expert's tiles only. Work is ``(T*k + padding) * H * F`` per
projection, never ``T * E * H * F`` (``impl="dense"``, the test reference).

**One custom VJP for the whole layer**: the dispatch and the combine are gathers by the layout's
permutation both ways (no scatter-add, whose bf16 atomics are slow on the GPU), the backward runs
the transposed grouped matmuls, and nothing densifies. The activation between the projections is a
function ``act(gate, up) -> h`` (SwiGLU by default; gpt-oss passes its clamped form), differentiated
by ``jax.vjp`` inside the backward; optional per-expert biases ``(bg, bu, bd)`` are added per row.

The grouped matmul itself is a backend (``GroupedMatmul``): ``xla`` (portable: each tile's expert
weights gathered, then one batched matmul; the CPU path) and, on NVIDIA GPUs, a Pallas kernel
(``models/grouped_kernels.py``). ``impl``: ``auto`` picks the fastest measured for the device,
``sorted`` is the grouped path with the portable backend, ``dense`` computes every expert on every token
(the reference the tests compare with); ``ragged`` (not a config choice: a benchmark candidate) runs XLA's own
``ragged_dot`` (``RaggedDot``).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.models import grouped_kernels

Act = Callable[[jax.Array, jax.Array], jax.Array]


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """transformers' experts: ``silu(gate) * up``."""
    return jax.nn.silu(gate) * up


# ------------------------------------------------------------------------------- the reference


def experts_dense(x, weights, idx, wg, wu, wd, *, act: Act | None = None, biases=None) -> jax.Array:
    """Every expert on every token, the outputs weighted by the router weights (zero for the experts
    not chosen): E/k times the routed work. The reference the grouped path is tested against."""
    act = act or swiglu
    e = wg.shape[0]
    combine = jnp.einsum("tk,tke->te", weights, jax.nn.one_hot(idx, e, dtype=weights.dtype))  # (T, E)
    g = jnp.einsum("th,ehf->tef", x, wg)
    u = jnp.einsum("th,ehf->tef", x, wu)
    if biases is not None:
        g, u = g + biases[0].astype(g.dtype), u + biases[1].astype(u.dtype)
    y = jnp.einsum("tef,efh->teh", act(g, u), wd)
    if biases is not None:
        y = y + biases[2].astype(y.dtype)
    return jnp.einsum("teh,te->th", y, combine)


# ------------------------------------------------------------------------------- the layout


@dataclasses.dataclass(frozen=True)
class DispatchLayout:
    """Where each (token, expert) pair sits in the grouped, tile-padded row order.

    ``row_of_pair`` (T*k,): the padded row of pair ``t*k + j``; ``token_of_row`` (R,): the token a
    row reads (T, the zero row, for padding); ``pair_of_row`` (R,): the pair a row holds (T*k for
    padding); ``tile_expert`` (R/tile,): each tile's expert; ``tiles_per_expert`` (E,) and
    ``tile_start`` (E,): each expert's run of tiles; ``used_tiles``: tiles holding any pair."""

    row_of_pair: jax.Array
    token_of_row: jax.Array
    pair_of_row: jax.Array
    tile_expert: jax.Array
    tiles_per_expert: jax.Array
    tile_start: jax.Array
    used_tiles: jax.Array
    tile: int

    @property
    def rows(self) -> int:
        return self.token_of_row.shape[0]


jax.tree_util.register_dataclass(
    DispatchLayout, data_fields=["row_of_pair", "token_of_row", "pair_of_row", "tile_expert", "tiles_per_expert",
                                 "tile_start", "used_tiles"], meta_fields=["tile"])


def padded_rows(pairs: int, experts: int, tile: int) -> int:
    """The grouped layout's static row count: every pair plus each group's padding, in whole tiles."""
    return -(-(pairs + experts * (tile - 1)) // tile) * tile


def dispatch_layout(idx: jax.Array, experts: int, tile: int) -> DispatchLayout:
    """The grouped layout of ``idx`` (T, k): integer work only (sort, cumulative sums, one scatter)."""
    t, k = idx.shape
    pairs = t * k
    flat = idx.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True)  # sorted position -> pair
    sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)
    tiles = (sizes + tile - 1) // tile
    start = jnp.cumsum(sizes) - sizes  # each group's first sorted position
    tile_start = (jnp.cumsum(tiles) - tiles).astype(jnp.int32)
    sorted_expert = flat[order]
    rank = jnp.arange(pairs, dtype=jnp.int32) - start[sorted_expert]
    row_sorted = tile_start[sorted_expert] * tile + rank
    rows = padded_rows(pairs, experts, tile)
    row_of_pair = jnp.zeros((pairs,), jnp.int32).at[order].set(row_sorted, unique_indices=True)
    pair_of_row = jnp.full((rows,), pairs, jnp.int32).at[row_sorted].set(order.astype(jnp.int32),
                                                                         unique_indices=True)
    token_of_row = jnp.where(pair_of_row < pairs, pair_of_row // k, t)
    n_tiles = rows // tile
    used = jnp.sum(tiles)
    # tile i belongs to the last expert whose run starts at or before it (empty experts own no tile)
    tile_expert = jnp.searchsorted(jnp.cumsum(tiles), jnp.arange(n_tiles, dtype=jnp.int32), side="right")
    tile_expert = jnp.minimum(tile_expert, experts - 1).astype(jnp.int32)
    return DispatchLayout(row_of_pair, token_of_row, pair_of_row, tile_expert, tiles.astype(jnp.int32), tile_start,
                          used.astype(jnp.int32), tile)


# ------------------------------------------------------------------------------- grouped matmuls


class GroupedMatmul:
    """The portable grouped matmuls over a ``DispatchLayout``'s tiles (plain XLA): each tile's expert
    weights are gathered and one batched matmul runs over the tiles. Right for the CPU and small
    shapes; a GPU backend overrides the three methods with kernels that read the weights in place."""

    name = "xla"
    fuse_gate_up = False  # gate and up as one matmul of twice the width (``gate_up``): grouped_kernels says why not

    def gmm(self, a: jax.Array, w: jax.Array, lay: DispatchLayout, transpose_w: bool = False) -> jax.Array:
        """Rows of tile i times expert ``tile_expert[i]``'s weight: a (R, K), w (E, K, N) -> (R, N);
        ``transpose_w``: w (E, N, K), used as its transpose."""
        nt = lay.rows // lay.tile
        at = a.reshape(nt, lay.tile, a.shape[-1])
        wt = jnp.take(w, lay.tile_expert, axis=0)
        spec = "tmk,tnk->tmn" if transpose_w else "tmk,tkn->tmn"
        out = jnp.einsum(spec, at, wt, preferred_element_type=jnp.float32)
        return out.astype(a.dtype).reshape(lay.rows, -1)

    def tgmm(self, a: jax.Array, b: jax.Array, lay: DispatchLayout, experts: int) -> jax.Array:
        """Per expert, the sum over its tiles of a_tile^T b_tile: a (R, K), b (R, N) -> (E, K, N) in fp32.
        Tiles past ``used_tiles`` hold only zero rows, so they add nothing."""
        nt = lay.rows // lay.tile
        at = a.reshape(nt, lay.tile, a.shape[-1])
        bt = b.reshape(nt, lay.tile, b.shape[-1])
        per_tile = jnp.einsum("tmk,tmn->tkn", at, bt, preferred_element_type=jnp.float32)
        return jax.ops.segment_sum(per_tile, lay.tile_expert, num_segments=experts)


XLA = GroupedMatmul()


class RaggedDot(GroupedMatmul):
    """XLA's own grouped matmul, ``jax.lax.ragged_dot`` (and ``ragged_dot_general`` for the transposed and the
    per-expert weight products), over the layout's padded groups: the compiler's lowering, where the portable
    form gathers each tile's weights. A candidate at few wide experts, where the Hopper kernels trail one plain
    matmul's rate (``experiments/bench_moe.py layer --variants ragged``); not a config choice, as XLA's CPU
    lowering computes every group for every row (33x the portable form's FLOPs in the tests' never-densifies
    shape, by XLA's cost analysis)."""

    name = "ragged"

    def gmm(self, a, w, lay, transpose_w=False):
        sizes = lay.tiles_per_expert * lay.tile
        if transpose_w:  # w (E, N, K): contract a's K with w's last dimension
            dims = jax.lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
                                                     rhs_group_dimensions=[0])
            out = jax.lax.ragged_dot_general(a, w.astype(a.dtype), sizes, dims, preferred_element_type=jnp.float32)
        else:
            out = jax.lax.ragged_dot(a, w.astype(a.dtype), sizes, preferred_element_type=jnp.float32)
        return out.astype(a.dtype)

    def tgmm(self, a, b, lay, experts):
        """Per expert a_g^T b_g over its rows (the ragged dimension contracted): (E, K, N) in fp32."""
        dims = jax.lax.RaggedDotDimensionNumbers((([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
                                                 rhs_group_dimensions=[])
        return jax.lax.ragged_dot_general(a, b.astype(a.dtype), lay.tiles_per_expert * lay.tile, dims,
                                          preferred_element_type=jnp.float32)


RAGGED = RaggedDot()
RAGGED_TILE = 8  # XLA's ragged dot takes groups of any size: the layout pads each only to 8 rows


def row_sum_by_expert(a: jax.Array, lay: DispatchLayout, experts: int) -> jax.Array:
    """Per expert, the sum of its rows (a bias's gradient): a (R, N) -> (E, N) fp32."""
    per_tile = jnp.sum(a.reshape(lay.rows // lay.tile, lay.tile, -1).astype(jnp.float32), axis=1)
    return jax.ops.segment_sum(per_tile, lay.tile_expert, num_segments=experts)


def expert_of_row(lay: DispatchLayout) -> jax.Array:
    return jnp.repeat(lay.tile_expert, lay.tile, total_repeat_length=lay.rows)


# ------------------------------------------------------------------------------- the grouped layer


def _gather_rows(x: jax.Array, rows: jax.Array) -> jax.Array:
    """x (N, H) with a zero row appended, read at ``rows`` (N = padding)."""
    return jnp.take(jnp.concatenate([x, jnp.zeros((1, x.shape[-1]), x.dtype)]), rows, axis=0)


def gate_up(wg: jax.Array, wu: jax.Array) -> jax.Array:
    """The gate and up projections side by side, (E, H, 2F): one grouped matmul of twice the width instead
    of two (``GroupedMatmul.fuse_gate_up``; off by default, measured slower: models/grouped_kernels.py)."""
    return jnp.concatenate([wg, wu], axis=-1)


def _project_gate_up(xs, wg, wu, lay: DispatchLayout, mm: GroupedMatmul):
    if not mm.fuse_gate_up:
        return mm.gmm(xs, wg, lay), mm.gmm(xs, wu, lay)
    gu = mm.gmm(xs, gate_up(wg.astype(xs.dtype), wu.astype(xs.dtype)), lay)
    f = wg.shape[-1]
    return gu[:, :f], gu[:, f:]


def _forward(x, weights, wg, wu, wd, biases, lay: DispatchLayout, mm: GroupedMatmul, act: Act):
    t, k = weights.shape
    xs = _gather_rows(x, lay.token_of_row)  # (R, H)
    g, u = _project_gate_up(xs, wg, wu, lay, mm)
    if biases is not None:
        rows_e = expert_of_row(lay)
        g = g + jnp.take(biases[0], rows_e, axis=0).astype(g.dtype)
        u = u + jnp.take(biases[1], rows_e, axis=0).astype(u.dtype)
    h = act(g, u).astype(x.dtype)
    ys = mm.gmm(h, wd, lay)  # (R, H)
    if biases is not None:
        ys = ys + jnp.take(biases[2], rows_e, axis=0).astype(ys.dtype)
    y_pairs = jnp.take(ys, lay.row_of_pair, axis=0).reshape(t, k, -1)
    y = jnp.einsum("tkh,tk->th", y_pairs, weights, preferred_element_type=jnp.float32).astype(x.dtype)
    return y, (xs, g, u, y_pairs)


def _grouped_bwd(lay_meta, mm: GroupedMatmul, act: Act, res, dy):
    """The layer's backward: transposed grouped matmuls, gathers only."""
    (xs, g, u, y_pairs, weights, wg, wu, wd, biases, *lay_fields) = res
    lay = DispatchLayout(*lay_fields, tile=lay_meta.tile)
    t, k = weights.shape
    e = wg.shape[0]
    dweights = jnp.einsum("th,tkh->tk", dy, y_pairs, preferred_element_type=jnp.float32).astype(weights.dtype)
    dpairs = (dy[:, None, :].astype(jnp.float32) * weights[:, :, None].astype(jnp.float32)).astype(dy.dtype)
    dys = _gather_rows(dpairs.reshape(t * k, -1), lay.pair_of_row)  # (R, H); padding rows zero
    # h is recomputed here, not kept from the forward: kept, the layer ran 2.2-2.8x slower at the OLMoE and
    # gpt-oss-120b shapes (experiments/bench_moe.py layer, one H100: 28.4 ms against 12.6, 94.5 against 34.2)
    h, act_vjp = jax.vjp(lambda g_, u_: act(g_, u_).astype(xs.dtype), g, u)
    dwd = mm.tgmm(h, dys, lay, e)
    dh = mm.gmm(dys, wd, lay, transpose_w=True)
    dg, du = act_vjp(dh)
    dg, du = dg.astype(xs.dtype), du.astype(xs.dtype)
    if mm.fuse_gate_up:
        dgu = jnp.concatenate([dg, du], axis=-1)
        dwgu = mm.tgmm(xs, dgu, lay, e)
        f = wg.shape[-1]
        dwg, dwu = dwgu[..., :f], dwgu[..., f:]
        dxs = mm.gmm(dgu, gate_up(wg.astype(xs.dtype), wu.astype(xs.dtype)), lay, transpose_w=True)
    else:
        dwg, dwu = mm.tgmm(xs, dg, lay, e), mm.tgmm(xs, du, lay, e)
        dxs = (mm.gmm(dg, wg, lay, transpose_w=True).astype(jnp.float32)
               + mm.gmm(du, wu, lay, transpose_w=True).astype(jnp.float32))
    dx = jnp.sum(jnp.take(dxs, lay.row_of_pair, axis=0).reshape(t, k, -1), axis=1).astype(xs.dtype)
    dbiases = None
    if biases is not None:
        # padding rows of dg/du are not zero (act' of a zero row times a zero dh is zero; bias rows
        # are read per expert), so mask them before summing
        real = (lay.pair_of_row < t * k)[:, None]
        dbiases = tuple(row_sum_by_expert(jnp.where(real, d, 0), lay, e).astype(b.dtype)
                        for d, b in zip((dg, du, dys), biases))
    return (dx, dweights, dwg.astype(wg.dtype), dwu.astype(wu.dtype), dwd.astype(wd.dtype), dbiases)


class _LayoutMeta:
    """The static part of a layout, hashable (custom_vjp's non-differentiable arguments)."""

    def __init__(self, tile: int):
        self.tile = tile

    def __hash__(self):
        return hash(("layout", self.tile))

    def __eq__(self, other):
        return isinstance(other, _LayoutMeta) and other.tile == self.tile


def routed_experts(x: jax.Array, weights: jax.Array, idx: jax.Array, wg: jax.Array, wu: jax.Array, wd: jax.Array,
                   *, impl: str = "auto", act: Act | None = None, biases=None) -> jax.Array:
    """The MoE layer's expert computation (module docstring). x (T, H); weights, idx (T, k);
    wg, wu (E, H, F); wd (E, F, H); ``biases``: None or (bg (E, F), bu (E, F), bd (E, H))."""
    act = act or swiglu
    if impl == "dense":
        return experts_dense(x, weights, idx, wg, wu, wd, act=act, biases=biases)
    mm, tile = backend_for(impl, x.shape[-1], wg.shape[-1], wg.shape[0], idx.size)
    lay = dispatch_layout(idx, wg.shape[0], tile)
    return _grouped_call(x, weights, wg, wu, wd, biases, lay, mm, act)


def _grouped_call(x, weights, wg, wu, wd, biases, lay, mm, act):
    fields = (lay.row_of_pair, lay.token_of_row, lay.pair_of_row, lay.tile_expert, lay.tiles_per_expert,
              lay.tile_start, lay.used_tiles)
    return _grouped_entry(x, weights, wg, wu, wd, biases, fields, _LayoutMeta(lay.tile), mm, act)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _grouped_entry(x, weights, wg, wu, wd, biases, fields, meta, mm, act):
    lay = DispatchLayout(*fields, tile=meta.tile)
    return _forward(x, weights, wg, wu, wd, biases, lay, mm, act)[0]


def _entry_fwd(x, weights, wg, wu, wd, biases, fields, meta, mm, act):
    lay = DispatchLayout(*fields, tile=meta.tile)
    y, (xs, g, u, y_pairs) = _forward(x, weights, wg, wu, wd, biases, lay, mm, act)
    return y, (xs, g, u, y_pairs, weights, wg, wu, wd, biases, fields)


def _entry_bwd(meta, mm, act, res, dy):
    xs, g, u, y_pairs, weights, wg, wu, wd, biases, fields = res
    grads = _grouped_bwd(meta, mm, act, (xs, g, u, y_pairs, weights, wg, wu, wd, biases, *fields), dy)
    dfields = jax.tree.map(lambda f: None if f is None else _int_zero(f), fields)
    return grads + (dfields,)


def _int_zero(f):
    return np.zeros(f.shape, jax.dtypes.float0)


_grouped_entry.defvjp(_entry_fwd, _entry_bwd)


# ------------------------------------------------------------------------------- backends

def backend_for(impl: str, hidden: int, width: int, experts: int, pairs: int):
    """(grouped matmul, tile rows) for ``impl`` at this shape: the Hopper kernels where ``auto`` runs on
    a GPU whose shapes they take (models/grouped_kernels.py), else the portable XLA form (``xla_tile``)."""
    if impl == "ragged":
        return RAGGED, RAGGED_TILE
    if impl == "auto" and jax.default_backend() == "gpu":
        chosen = grouped_kernels.mosaic_backend(hidden, width, experts, pairs)
        if chosen is not None:
            return chosen
    return XLA, xla_tile(experts, pairs)


def xla_tile(experts: int, pairs: int) -> int:
    """Rows per tile of the portable form, which gathers each tile's expert weights: 8 on the CPU (little
    padding; tests and small models); on an accelerator, tiles of about ``pairs / 2E`` rows (a power of
    two), so the gathered weights stay near twice the experts' own bytes at about 1.5x the routed rows."""
    if jax.default_backend() == "cpu":
        return 8
    return int(min(1024, max(8, 2 ** int(np.ceil(np.log2(max(pairs / (2 * experts), 1)))))))
