"""One MoE SwiGLU layer, forward + backward (router, top-k, experts, weighted combine), this engine's
expert computation at the five shapes of the MoE issue, 16,384 tokens, bf16.

    python experiments/bench_moe.py layer [--tokens 16384] [--variants apart,mgpu,fused,sorted] [--out FILE]
    python experiments/bench_moe.py kernels [--tokens 16384] [--sweep warp]  # each grouped matmul alone, tiles
    python experiments/bench_moe.py tune [--shapes a,b]        # the sweep, then the layer at the best tiles
    python experiments/bench_moe.py cpu                        # a small shape, fp32 (runs anywhere)

The transformers side of the comparison is ``experiments/bench_moe_torch.py`` (run in the same call,
with the GPU image's torch). Active TFLOPS count only the routed work: 3 matmuls x 2 x T x k x H x F,
x3 for forward + backward. Results: ``experiments/results/bench_moe_<device>_<date>/``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.models import grouped_experts as ge
from megatrain_jax.models.moe import route

SHAPES = {  # hidden, experts, top-k, expert width
    "olmoe": (2048, 64, 8, 1024),
    "qwen3_30b_a3b": (2048, 128, 8, 768),
    "gpt_oss_120b": (2880, 128, 4, 2880),
    "mixtral_8x7b": (4096, 8, 2, 14336),
    "qwen3_235b_a22b": (4096, 128, 8, 1536),
}


def timed(fn, args, reps):
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps


def layer_inputs(t, h, e, k, f, dtype, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    x = jax.random.normal(ks[0], (t, h), dtype)
    wr = (jax.random.normal(ks[1], (h, e)) * 0.02).astype(dtype)
    ws = [(jax.random.normal(kk, s) * 0.02).astype(dtype) for kk, s in zip(ks[2:], ((e, h, f), (e, h, f), (e, f, h)))]
    return x, wr, ws


def layer_step(k, impl):
    """jit(grad) of sum(layer(x)^2) with respect to x, the router and the three expert weights."""
    def loss(x, wr, ws):
        weights, idx = route(x @ wr, k, True)
        y = ge.routed_experts(x, weights, idx, *ws, impl=impl)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def best_tiles(kernel_rows, name):
    """The fastest measured tiles of a shape: (fwd, wgrad), each summed over its cases."""
    from megatrain_jax.models.grouped_kernels import MatmulTiles

    def best(prefixes):
        total: dict = {}
        for r in kernel_rows:
            if r["shape"] == name and r.get("tiles") and r.get("kernel") == "MatmulTiles" and any(r["case"].startswith(p) for p in prefixes):
                key = tuple(r["tiles"].values())
                total.setdefault(key, []).append(r.get("ms", float("inf")))
        n = max((len(v) for v in total.values()), default=0)
        full = {kk: sum(v) for kk, v in total.items() if len(v) == n}
        return MatmulTiles(*min(full, key=full.get)) if full else None

    return best(("fwd", "dx")), best(("dw",))


VARIANTS = {  # name: (moe impl, the Hopper kernels' gate/up fusion (None where they do not run), the projections'
    # kernel: "default" as shipped, "warp" the warp-specialized one (models/hopper_grouped_matmul.py), "mgpu" JAX's)
    "fused": ("auto", True, "default"),
    "apart": ("auto", False, "default"),
    "warp": ("auto", False, "warp"),
    "mgpu": ("auto", False, "mgpu"),
    "sorted": ("sorted", None, None),
    "ragged": ("ragged", None, None),
}


def bench_layer(tokens, variants, reps, shapes, kernel_rows=None):
    """The layer per shape and variant (``VARIANTS``): the Hopper kernels with gate and up fused into one
    matmul or apart, the portable grouped form (``sorted``) and XLA's ragged dot (``ragged``)."""
    from megatrain_jax.models import grouped_kernels as gk

    rows = []
    for name in shapes:
        h, e, k, f = SHAPES[name]
        fwd = wgrad = None
        if kernel_rows:
            fwd, wgrad = best_tiles(kernel_rows, name)
        for variant in variants:
            impl, fused, proj = VARIANTS[variant]
            row = {"shape": name, "variant": variant, "tokens": tokens, "H": h, "E": e, "k": k, "F": f, "impl": impl}
            warp = {"default": gk.MosaicGroupedMatmul().warp, "warp": gk.WARP_TILES, "mgpu": None}.get(proj)
            gk.OVERRIDE = None if fused is None else gk.MosaicGroupedMatmul(fwd=fwd, wgrad=wgrad, fuse_gate_up=fused,
                                                                            warp=warp)
            if kernel_rows:
                row["tiles"] = {"fwd": fwd and fwd.__dict__, "wgrad": wgrad and wgrad.__dict__}
            try:
                x, wr, ws = layer_inputs(tokens, h, e, k, f, jnp.bfloat16)
                sec = timed(layer_step(k, impl), (x, wr, ws), reps)
                active = 3 * 2 * tokens * k * h * f
                row.update(ours_ms=round(sec * 1e3, 2), active_tflops=round(3 * active / sec / 1e12, 1))
            except Exception as err:  # noqa: BLE001  (out of memory at one shape: say so, go on)
                row["error"] = (str(err).splitlines() or [repr(err)])[0][:300]
            print(json.dumps(row), flush=True)
            rows.append(row)
    gk.OVERRIDE = None
    return rows


def sweep_tiles(h, f):
    """The tile sizes tried per grouped matmul (``grouped_kernels.MatmulTiles``): the projections and
    input gradients (fwd), the weight gradients (wgrad); block sizes that divide the shape."""
    from megatrain_jax.models.grouped_kernels import MatmulTiles as T

    fwd = [T(128, 128, 64, 4, 4), T(128, 128, 64, 4, 8), T(128, 128, 64, 6, 4), T(128, 256, 64, 3, 2)]
    if h % 128 == 0 and f % 128 == 0:
        wg = [T(128, 128, 64, 4, 1), T(128, 128, 64, 4, 4), T(128, 128, 64, 6, 2), T(128, 256, 64, 3, 2)]
    else:
        wg = [T(64, 192, 64, 4, 1), T(64, 192, 64, 4, 2), T(192, 192, 64, 3, 1), T(64, 64, 64, 4, 1)]
    return fwd, wg


def bench_kernels(tokens, reps, shapes, sweep="full"):
    """Each grouped matmul of the layer alone at a few tile sizes, and one plain matmul of the same
    routed size (the ceiling)."""
    from megatrain_jax.models.grouped_kernels import MosaicGroupedMatmul
    from megatrain_jax.models.hopper_grouped_matmul import WarpTiles

    warp_tiles = [WarpTiles(128, 128, 64, 4, False, 4), WarpTiles(128, 128, 64, 4, False, 8),
                  WarpTiles(128, 128, 64, 4, False, 16), WarpTiles(128, 128, 64, 5, False, 8),
                  WarpTiles(64, 256, 64, 4, True, 8), WarpTiles(128, 128, 64, 4, False, 8, skip_unused=False)]
    rows = []
    for name in shapes:
        h, e, k, f = SHAPES[name]
        x, wr, ws = layer_inputs(tokens, h, e, k, f, jnp.bfloat16)
        _, idx = route(x @ wr, k, True)
        lay = jax.jit(lambda i: ge.dispatch_layout(i, e, 128))(idx)
        xs = jax.random.normal(jax.random.PRNGKey(1), (lay.rows, h), jnp.bfloat16)
        hs = jax.random.normal(jax.random.PRNGKey(2), (lay.rows, f), jnp.bfloat16)
        work = 2 * tokens * k * h * f
        cases = {
            "fwd_up (R,H)x(E,H,F)": (lambda mm: (lambda a, w: mm.gmm(a, w, lay)), (xs, ws[0])),
            "fwd_down (R,F)x(E,F,H)": (lambda mm: (lambda a, w: mm.gmm(a, w, lay)), (hs, ws[2])),
            "dx (R,F)x(E,H,F)^T": (lambda mm: (lambda a, w: mm.gmm(a, w, lay, transpose_w=True)), (hs, ws[0])),
            "dw (R,H)^T(R,F)": (lambda mm: (lambda a, b: mm.tgmm(a, b, lay, e)), (xs, hs)),
        }
        fwd_tiles, wg_tiles = sweep_tiles(h, f)
        if sweep == "warp":  # the warp-specialized kernel's tiles against the shipped ones only
            from megatrain_jax.models.grouped_kernels import FWD_TILES, WGRAD_TILES
            wg_default = next(x for x in WGRAD_TILES if h % x.block_m == 0 and f % x.block_n == 0)
            fwd_tiles, wg_tiles = [FWD_TILES], [wg_default]
        for case, (make, args) in cases.items():
            tries = wg_tiles if case.startswith("dw") else fwd_tiles + warp_tiles
            ref = None if case.startswith("dw") else jax.jit(make(ge.XLA))(*args)
            for tiles in tries:
                if case.startswith("dw") and (h % tiles.block_m or f % tiles.block_n):
                    continue
                if isinstance(tiles, WarpTiles):
                    mm = MosaicGroupedMatmul(warp=tiles)
                else:
                    mm = MosaicGroupedMatmul(wgrad=tiles) if case.startswith("dw") else MosaicGroupedMatmul(fwd=tiles)
                row = {"shape": name, "case": case, "kernel": type(tiles).__name__,
                       "tiles": None if tiles is None else tiles.__dict__}
                try:
                    fn = jax.jit(make(mm))
                    if ref is not None:  # the rows the layer reads, against the portable form
                        real = (jnp.arange(lay.rows) // 128 < lay.used_tiles)[:, None]
                        diff = jnp.where(real, fn(*args).astype(jnp.float32) - ref.astype(jnp.float32), 0)
                        row["max_abs_err"] = float(jnp.max(jnp.abs(diff)))
                        row["ref_max"] = float(jnp.max(jnp.abs(ref.astype(jnp.float32))))
                    sec = timed(fn, args, reps)
                    row.update(ms=round(sec * 1e3, 3), tflops=round(work / sec / 1e12, 1))
                except Exception as err:  # noqa: BLE001
                    row["error"] = (str(err).splitlines() or [repr(err)])[0][:200]
                print(json.dumps(row), flush=True)
                rows.append(row)
        a = jax.random.normal(jax.random.PRNGKey(3), (tokens * k, h), jnp.bfloat16)
        sec = timed(jax.jit(lambda a, b: a @ b), (a, ws[0][0]), reps)
        row = {"shape": name, "case": "one plain matmul (T*k,H)x(H,F)", "ms": round(sec * 1e3, 3),
               "tflops": round(work / sec / 1e12, 1)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["layer", "kernels", "tune", "cpu"])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--variants", default="apart", help="layer variants, comma-separated: " + ",".join(VARIANTS))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", choices=["full", "warp"], default="full",
                    help="kernels: every tile size, or the warp-specialized kernel's against the shipped tiles")
    a = ap.parse_args()
    shapes = a.shapes.split(",")
    head = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
            "date": datetime.date.today().isoformat(), "mode": a.mode}
    print(json.dumps(head), flush=True)
    if a.mode == "cpu":
        rows = []
        for impl in ("sorted", "dense"):
            x, wr, ws = layer_inputs(1024, 128, 32, 8, 64, jnp.float32)
            sec = timed(layer_step(8, impl), (x, wr, ws), 3)
            rows.append({"shape": "cpu-32x8", "impl": impl, "ms": round(sec * 1e3, 2)})
            print(json.dumps(rows[-1]), flush=True)
    elif a.mode == "layer":
        rows = bench_layer(a.tokens, a.variants.split(","), a.reps, shapes)
    elif a.mode == "tune":  # each kernel's tile sweep, then the layer with the fastest tiles per shape
        kern = bench_kernels(a.tokens, a.reps, shapes)
        rows = kern + bench_layer(a.tokens, a.variants.split(","), a.reps, shapes, kernel_rows=kern)
    else:
        rows = bench_kernels(a.tokens, a.reps, shapes, a.sweep)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({**head, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
