"""Grouped matmuls on NVIDIA Hopper GPUs: the Pallas Mosaic GPU kernels that ship with JAX
(``jax.experimental.pallas.ops.gpu``: ``ragged_dot_mgpu`` for the projections and their input
gradients, ``transposed_ragged_dot_mgpu`` for the weight gradients), run over the tile-padded
layout of ``grouped_experts.DispatchLayout``: every group is a whole number of tiles, so no tile
straddles two experts and the kernels' edge masks never cut a row.

Imported only on a GPU (``grouped_experts.backend_for``); registers ``GPU_BACKENDS["mosaic"]``.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from megatrain_jax.models import grouped_experts as ge


@dataclasses.dataclass(frozen=True)
class MatmulTiles:
    """One kernel's tile sizes (``ragged_dot_mgpu``'s and ``transposed_ragged_dot_mgpu``'s names)."""

    block_m: int
    block_n: int
    block_k: int
    max_concurrent_steps: int = 4
    grid_block_n: int = 1


def _divides(block: int, n: int) -> bool:
    return n % block == 0


def _pick(n: int, options=(256, 192, 128, 64)) -> int:
    return next(b for b in options if _divides(b, n))


@dataclasses.dataclass(frozen=True)
class MosaicGroupedMatmul(ge.GroupedMatmul):
    """``GroupedMatmul`` on JAX's Hopper ragged-dot kernels. ``fwd``: the projections and the input
    gradients (``gmm``); ``wgrad``: the weight gradients (``tgmm``). Group sizes handed to the
    kernels are the padded ones (whole tiles)."""

    fwd: MatmulTiles | None = None
    wgrad: MatmulTiles | None = None
    name: str = "mosaic"

    def _sizes(self, lay: ge.DispatchLayout) -> jax.Array:
        return lay.tiles_per_expert * lay.tile

    def gmm(self, a, w, lay, transpose_w=False):
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

        k = a.shape[-1]
        n = w.shape[1] if transpose_w else w.shape[2]
        t = self.fwd or MatmulTiles(block_m=min(lay.tile, 128), block_n=_pick(n, (128, 192, 64)),
                                    block_k=_pick(k, (64,)))
        return ragged_dot_mgpu.ragged_dot(a, w.astype(a.dtype), group_sizes=self._sizes(lay), block_m=t.block_m,
                                          block_n=t.block_n, block_k=t.block_k,
                                          max_concurrent_steps=t.max_concurrent_steps, grid_block_n=t.grid_block_n,
                                          transpose_rhs=transpose_w)

    def tgmm(self, a, b, lay, experts):
        from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

        km, n = a.shape[-1], b.shape[-1]
        t = self.wgrad or MatmulTiles(block_m=_pick(km, (128, 64)), block_n=_pick(n, (128, 64)),
                                      block_k=min(lay.tile, 64))
        out = transposed_ragged_dot_mgpu.transposed_ragged_dot(
            a, b.astype(a.dtype), group_sizes=self._sizes(lay), block_m=t.block_m, block_n=t.block_n,
            block_k=t.block_k, max_concurrent_steps=t.max_concurrent_steps, grid_block_n=t.grid_block_n)
        return out.astype(jnp.float32)


def _on_hopper() -> bool:
    dev = jax.devices()[0]
    return dev.platform == "gpu" and getattr(dev, "compute_capability", "") in ("9.0", "9.0a")


OVERRIDE: MosaicGroupedMatmul | None = None  # experiments/bench_moe.py's tile sweep sets it


def mosaic_backend(hidden: int, width: int, experts: int, pairs: int):
    """The Mosaic GPU grouped matmul where the shapes suit its tiles (every dimension a multiple of
    64), with tiles of 128 rows; None elsewhere (the portable path then runs)."""
    if not _on_hopper() or hidden % 64 or width % 64:
        return None
    return (OVERRIDE or MosaicGroupedMatmul()), 128


ge.GPU_BACKENDS["mosaic"] = mosaic_backend
