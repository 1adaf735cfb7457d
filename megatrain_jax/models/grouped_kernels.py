"""Grouped matmuls on NVIDIA Hopper GPUs: our warp-specialized kernel (``models/hopper_grouped_matmul.py``) for
the projections and their input gradients where the shape suits its tiles, else the Pallas Mosaic GPU kernels that
ship with JAX (``jax.experimental.pallas.ops.gpu``: ``ragged_dot_mgpu``), and ``transposed_ragged_dot_mgpu`` for
the weight gradients, run over the tile-padded layout of ``grouped_experts.DispatchLayout``: every group is a whole
number of tiles, so no tile straddles two experts and the kernels' edge masks never cut a row.

``grouped_experts.backend_for`` asks ``mosaic_backend`` on a GPU; JAX's kernels are imported only there.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from megatrain_jax.models import hopper_grouped_matmul
from megatrain_jax.models.hopper_grouped_matmul import WarpTiles


@dataclasses.dataclass(frozen=True)
class MatmulTiles:
    """One kernel's tile sizes (``ragged_dot_mgpu``'s and ``transposed_ragged_dot_mgpu``'s names)."""

    block_m: int
    block_n: int
    block_k: int
    max_concurrent_steps: int = 4
    grid_block_n: int = 1


# The warp-specialized kernel's tiles (models/hopper_grouped_matmul.py): blocks of 128 x 256, one 128 x 128
# accumulator per consumer warpgroup. With it the layer (experiments/bench_moe.py layer --variants mgpu,warp, one
# H100, 16,384 tokens, same call) ran OLMoE in 10.48 ms against 12.65 on ragged_dot_mgpu, Qwen3-30B-A3B 9.25 against
# 13.09, Mixtral-8x7B 63.94 against 65.23; gpt-oss-120b (2880 = 11.25 blocks of 256) stays on ragged_dot_mgpu.
WARP_TILES = WarpTiles(128, 128, 64, 4, False, 8)
WARP_DTYPES = (jnp.bfloat16, jnp.float16)  # wgmma's 16-bit inputs; other compute dtypes take ragged_dot_mgpu


@dataclasses.dataclass(frozen=True)
class MosaicGroupedMatmul:
    """``grouped_experts.GroupedMatmul``'s two methods on Hopper kernels. ``gmm`` (the projections and the input
    gradients): ``warp``'s kernel where it takes the shape, else ``ragged_dot_mgpu`` at ``fwd``'s tiles; ``tgmm``
    (the weight gradients): ``transposed_ragged_dot_mgpu`` at ``wgrad``'s tiles. Group sizes handed to the
    kernels are the padded ones (whole tiles)."""

    fwd: MatmulTiles | None = None
    wgrad: MatmulTiles | None = None
    # gate and up as one matmul of twice the width: slower at every shape measured (experiments/bench_moe.py layer
    # --variants fused,apart, one H100, 16,384 tokens: Qwen3-30B-A3B 27.3 ms against 13.0 apart, gpt-oss-120b 39.2
    # against 34.2, Mixtral-8x7B 69.3 against 65.5, OLMoE 12.65 against 12.59)
    fuse_gate_up: bool = False
    # the projections and input gradients on the warp-specialized kernel (models/hopper_grouped_matmul.py) where
    # the shape and dtype suit it; None: JAX's ragged_dot_mgpu for every shape
    warp: WarpTiles | None = WARP_TILES
    name: str = "mosaic"

    def _sizes(self, lay) -> jax.Array:
        return lay.tiles_per_expert * lay.tile

    def gmm(self, a, w, lay, transpose_w=False):
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

        n = w.shape[1] if transpose_w else w.shape[2]
        if (self.warp is not None and a.dtype in WARP_DTYPES and self.warp.block_m == lay.tile
                and self.warp.takes(a.shape[0], a.shape[1], n)):
            return hopper_grouped_matmul.grouped_matmul(a, w, lay.tile_expert, lay.used_tiles, self.warp,
                                                        transpose_rhs=transpose_w)
        t = self.fwd or FWD_TILES
        return ragged_dot_mgpu.ragged_dot(a, w.astype(a.dtype), group_sizes=self._sizes(lay), block_m=t.block_m,
                                          block_n=t.block_n, block_k=t.block_k,
                                          max_concurrent_steps=t.max_concurrent_steps, grid_block_n=t.grid_block_n,
                                          transpose_rhs=transpose_w)

    def tgmm(self, a, b, lay, experts):
        from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

        km, n = a.shape[-1], b.shape[-1]
        t = self.wgrad or next(x for x in WGRAD_TILES if km % x.block_m == 0 and n % x.block_n == 0)
        out = transposed_ragged_dot_mgpu.transposed_ragged_dot(
            a, b.astype(a.dtype), group_sizes=self._sizes(lay), block_m=t.block_m, block_n=t.block_n,
            block_k=t.block_k, max_concurrent_steps=t.max_concurrent_steps, grid_block_n=t.grid_block_n)
        return out  # in the compute dtype, as the dense block's weight gradients


# The fastest tiles measured (experiments/bench_moe.py kernels mode, one H100, 16,384 tokens): the projections and
# input gradients at 128 x 128 x 64 with 4 stages, in bands of 4 column tiles: 578-609 TFLOP/s at the Mixtral-8x7B
# shape, 428-484 at OLMoE's, 306-318 at gpt-oss-120b's, against 374, 228-293 and 245-281 with single bands.
FWD_TILES = MatmulTiles(128, 128, 64, 4, 4)
# The weight gradients: 128 x 128 x 64 (446 TFLOP/s at OLMoE's shape, 539 at Mixtral's). Dimensions that 128 does
# not divide (gpt-oss: 2880) take 64 x 192 tiles, as the 64 x 64 ones ran at 18 TFLOP/s there: with them the whole
# gpt-oss-120b layer runs in 34.2 ms (286 active TFLOP/s, bench_moe.py layer), against 88.4 before.
WGRAD_TILES = (MatmulTiles(128, 128, 64, 4, 1), MatmulTiles(64, 192, 64, 4, 1), MatmulTiles(64, 64, 64, 4, 1))


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

