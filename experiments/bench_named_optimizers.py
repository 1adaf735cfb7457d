"""Per-group host update speed of each named optimizer (``optim.name``) on this CPU, in elements/s.

One Llama-shaped block (q, k, v, o, gate, up, down, two norms) is one group; each optimizer updates it
as the engine does (``build_host_optimizer(OptimConfig(...)).update(master, grad, state, count, scale,
bf16_out, unflatten)``), the fused numba AdamW included as the yardstick. The gap between the optax
rows and ``adamw_fused`` is what issue 29's fast path must close. Writes JSON to --out.

    python experiments/bench_named_optimizers.py --hidden 1024 --intermediate 4096
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402

from megatrain_jax.config import OptimConfig  # noqa: E402
from megatrain_jax.optim import alloc_aligned, build_host_optimizer, state_bytes_per_param  # noqa: E402
from megatrain_jax.templates import Layout  # noqa: E402

# name -> OptimConfig fields (kernel=optax unless fused); lr/wd as a run would set them
OPTIMIZERS = {
    "adamw_fused": dict(name="adamw", kernel="fused"),
    "adamw_optax": dict(name="adamw", kernel="optax"),
    "lion": dict(name="lion", kernel="optax"),
    "adafactor": dict(name="adafactor", kernel="optax"),
    "sgd_momentum": dict(name="sgd", kernel="optax", momentum=0.9),
    "muon": dict(name="muon", kernel="optax"),
}


def block_tree(h: int, inter: int, heads: int, kv_heads: int) -> dict:
    """One Llama block's weights: shapes as the engine's group tree holds them."""
    d = h // heads
    z = lambda *s: jax.ShapeDtypeStruct(s, np.float32)  # noqa: E731
    return {"input_layernorm": {"scale": z(h)}, "post_attention_layernorm": {"scale": z(h)},
            "mlp": {"down_proj": {"kernel": z(inter, h)}, "gate_proj": {"kernel": z(h, inter)},
                    "up_proj": {"kernel": z(h, inter)}},
            "self_attn": {"k_proj": {"kernel": z(h, kv_heads * d)}, "o_proj": {"kernel": z(h, h)},
                          "q_proj": {"kernel": z(h, h)}, "v_proj": {"kernel": z(h, kv_heads * d)}}}


def bench(fields: dict, tree: dict, reps: int, warmup: int) -> dict:
    layout = Layout(tree)
    n = layout.size
    rng = np.random.default_rng(0)
    p, g, bits = alloc_aligned(n), alloc_aligned(n), alloc_aligned(n, np.uint16)
    p[:] = rng.standard_normal(n, dtype=np.float32) * 0.02
    g[:] = rng.standard_normal(n, dtype=np.float32) * 1e-3
    cfg = OptimConfig(lr=1e-4, weight_decay=0.1, **fields)
    opt = build_host_optimizer(cfg, 1000)
    state = opt.init_state(p, layout.unflatten)
    times = []
    for c in range(1, warmup + reps + 1):
        t = time.perf_counter()
        opt.update(p, g, state, c, 0.9, bits, layout.unflatten)
        if c > warmup:
            times.append(time.perf_counter() - t)
    med = statistics.median(times)
    return {"elements": n, "median_s": med, "times_s": times, "elements_per_s": n / med,
            "state_bytes_per_param": state_bytes_per_param(cfg, tree, 1000)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)  # an OptaxHostOptimizer compiles at its first two updates
    ap.add_argument("--only", default="", help="comma-separated optimizers (default: all)")
    ap.add_argument("--out", default=None, help="JSON path (default: experiments/results/named_optimizers_<host>.json)")
    args = ap.parse_args()
    tree = block_tree(args.hidden, args.intermediate, args.heads, args.kv_heads)
    names = [x for x in args.only.split(",") if x] or list(OPTIMIZERS)
    load_before = list(os.getloadavg())  # other processes on the cores skew every figure
    results = {}
    for name in names:
        r = bench(OPTIMIZERS[name], tree, args.reps, args.warmup)
        results[name] = r
        print(f"{name:14s} {r['elements_per_s'] / 1e6:9.1f} M elements/s  ({r['median_s'] * 1e3:8.1f} ms per "
              f"{r['elements'] / 1e6:.1f}M-element block; state {r['state_bytes_per_param']:.2f} B/param)", flush=True)
    base = results.get("adamw_fused", {}).get("elements_per_s")
    if base:
        for r in results.values():
            r["vs_fused_adamw"] = r["elements_per_s"] / base
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"named_optimizers_{socket.gethostname()}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"when": datetime.datetime.now(datetime.timezone.utc).isoformat(), "host": socket.gethostname(),
                   "cpu_count": os.cpu_count(), "machine": platform.machine(), "jax": jax.__version__,
                   "load_before": load_before, "load_after": list(os.getloadavg()),
                   "block": {"hidden": args.hidden, "intermediate": args.intermediate, "heads": args.heads,
                             "kv_heads": args.kv_heads}, "results": results}, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
