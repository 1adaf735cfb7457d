"""A warp-specialized grouped matmul for NVIDIA Hopper GPUs, over the tile-padded layout of
``grouped_experts.DispatchLayout``: row tile ``i`` (``WarpTiles.block_m`` rows) is multiplied by expert
``tile_expert[i]``'s weights.

Why our own: JAX's ``ragged_dot_mgpu`` runs one warpgroup per block, which holds it near 600 TFLOP/s at
the Mixtral-8x7B shape (experiments/bench_moe.py kernels: 578-609 TFLOP/s), where one plain matmul runs
at 750-800. This kernel is JAX's ``hopper_matmul_mgpu`` (two consumer warpgroups fed by a producer
warpgroup through a TMA pipeline, persistent over the SMs) with one change: each row tile reads its
expert from ``tile_expert`` and streams that expert's weights. Because the layout pads every group to
whole tiles, no tile straddles two experts and no row needs a mask; tiles past ``used_tiles`` (padding
only) are skipped and their rows left unwritten, which the layer never reads (as with
``ragged_dot_mgpu``, whose rows past the groups stay unwritten too).

Run only on a Hopper GPU (``grouped_kernels.mosaic_backend``); Pallas's interpreter does not take its
warp-specialized pipeline, so the tests that run it need the GPU.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jax.extend import backend


@dataclasses.dataclass(frozen=True)
class WarpTiles:
    """``tile_m`` x ``tile_n`` per consumer warpgroup; the two warpgroups split the block along N
    (``split_m`` False: blocks of tile_m x 2 tile_n) or along M (blocks of 2 tile_m x tile_n). The
    block's rows must equal the layout's tile."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    max_concurrent_steps: int = 4
    split_m: bool = False
    grid_tile_width: int = 4
    skip_unused: bool = True

    @property
    def block_m(self) -> int:
        return self.tile_m * (2 if self.split_m else 1)

    @property
    def block_n(self) -> int:
        return self.tile_n * (1 if self.split_m else 2)

    def takes(self, m: int, k: int, n: int) -> bool:
        """Whether the shape suits these tiles (every dimension whole blocks; the epilogue's 64-wide pieces)."""
        return m % self.block_m == 0 and n % self.block_n == 0 and k % self.tile_k == 0 and self.tile_n % 64 == 0


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, tile_expert: jax.Array, used_tiles: jax.Array,
                   tiles: WarpTiles, transpose_rhs: bool = False) -> jax.Array:
    """lhs (M, K); rhs (E, K, N), or (E, N, K) with ``transpose_rhs``; tile_expert (M / block_m,) int32;
    used_tiles () int32. Returns (M, N) in lhs's dtype, fp32 accumulation."""
    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    if not tiles.takes(m, k, n):
        raise ValueError(f"grouped_matmul: shape {(m, k, n)} does not suit tiles {tiles}")
    dtype = lhs.dtype
    rhs = rhs.astype(dtype)
    tm, tn, tk = tiles.tile_m, tiles.tile_n, tiles.tile_k
    bm, bn = tiles.block_m, tiles.block_n
    m_iters, n_iters, k_iters = m // bm, n // bn, k // tk
    swizzle = plgpu.find_swizzle(tk * jnp.dtype(dtype).itemsize * 8)
    swizzle_elems = swizzle // jnp.dtype(dtype).itemsize
    transforms = (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(swizzle))
    epi_m, epi_n = 64, 64
    out_swizzle = plgpu.find_swizzle(epi_n * jnp.dtype(dtype).itemsize * 8)
    out_transforms = (plgpu.TilingTransform((8, out_swizzle // jnp.dtype(dtype).itemsize)),
                      plgpu.SwizzleTransform(out_swizzle))
    b_block = (bn, tk) if transpose_rhs else (tk, bn)
    b_index = (lambda kk: (0, kk)) if transpose_rhs else (lambda kk: (kk, 0))

    def pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_iters,), memory_registers=40,
            in_specs=[plgpu.BlockSpec((bm, tk), lambda kk: (0, kk), transforms=transforms, memory_space=plgpu.SMEM),
                      plgpu.BlockSpec(b_block, b_index, transforms=transforms, memory_space=plgpu.SMEM)],
            wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=tiles.max_concurrent_steps,
            compute_context=compute_context)

    def kernel(expert_gmem, used_gmem, a_gmem, b_gmem, out_gmem):
        ignore = lambda *_, **__: None  # noqa: E731  (the allocations do not depend on the bodies)
        b_example = b_gmem.at[0]

        @functools.partial(pl.run_scoped,
                           pipeline_allocs=pipeline(ignore, ignore).get_allocations(a_gmem, b_example),
                           out_smem=plgpu.SMEM((2, 2, epi_m, epi_n), dtype, transforms=out_transforms),
                           collective_axes="wg")
        def scope(pipeline_allocs, out_smem):
            wg = lax.axis_index("wg")
            used = used_gmem[0]

            @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
            def mn_loop(info):
                (lin,) = info.index
                mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), 1, tiles.grid_tile_width)
                expert = expert_gmem[mi]
                m_slice, n_slice = pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)
                wg_m = pl.ds(wg * tm, tm) if tiles.split_m else slice(None)
                wg_n = slice(None) if tiles.split_m else pl.ds(wg * tn, tn)

                def compute_context(eval_pipeline):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, tn), jnp.float32))
                    def acc_scope(acc_ref):
                        eval_pipeline(acc_ref)
                        acc = acc_ref[...].astype(dtype)
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        for i in range(tm // epi_m):
                            for j in range(tn // epi_n):
                                rows, cols = slice(i * epi_m, (i + 1) * epi_m), slice(j * epi_n, (j + 1) * epi_n)
                                slot = (i * (tn // epi_n) + j) % 2
                                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                                out_smem[wg, slot] = acc[rows, cols]
                                plgpu.commit_smem()
                                plgpu.copy_smem_to_gmem(
                                    out_smem.at[wg, slot],
                                    out_gmem.at[m_slice, n_slice].at[wg_m, wg_n].at[rows, cols])

                def mma(_, a_smem, b_smem, acc_ref):
                    if transpose_rhs:
                        b = b_smem.at[wg_n].transpose((1, 0))
                    else:
                        b = b_smem.at[:, wg_n]
                    plgpu.wgmma(acc_ref, a_smem.at[wg_m], b)
                    plgpu.wgmma_wait(0)
                    return acc_ref

                b_rows = b_gmem.at[expert]
                b_part = b_rows.at[n_slice, :] if transpose_rhs else b_rows.at[:, n_slice]

                def run():
                    pipeline(mma, compute_context)(a_gmem.at[m_slice, :], b_part, allocations=pipeline_allocs)

                if tiles.skip_unused:
                    pl.when(mi < used)(run)
                else:
                    run()

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    sms = getattr(backend.get_default_device(), "core_count", 132)  # 132 on an H100 SXM
    call = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((m, n), dtype), grid=(sms,), grid_names=("sm",),
        num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    return call(tile_expert.astype(jnp.int32), jnp.reshape(used_tiles, (1,)).astype(jnp.int32), lhs, rhs)
