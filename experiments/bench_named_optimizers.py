"""Per-group update speed of each named optimizer (``optim.name``), in elements/s.

One Llama-shaped block (q, k, v, o, gate, up, down, two norms) is one group (``--vocab V`` adds an
embedding group of V x hidden); each optimizer updates it as the engine does, the fused AdamW included
as the yardstick:

- ``--path host`` (default): ``opt.update(master, grad, state, count, scale, bf16_out, unflatten)`` on
  this CPU (numba for the fused AdamW, XLA on the jax CPU device for optax).
- ``--path device``: ``opt.device_step(param, grad, state, scalars, unflatten=...)`` on the default
  backend (the GPU: ``train.update_on=device``), the group's arrays resident there (PCIe not counted).
- ``--cpu-devices N`` (host path): also an elementwise optimizer's flat buffer sharded over N jax CPU
  devices (XLA_FLAGS=--xla_force_host_platform_device_count=N), rows ``<name>_sharded``: is XLA on
  several CPU devices faster than one?

Writes JSON to --out.

    python experiments/bench_named_optimizers.py --hidden 1024 --intermediate 4096
    python experiments/bench_named_optimizers.py --path device --hidden 3072 --intermediate 8192 --heads 24 \
        --kv-heads 8 --vocab 128256
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

if "--cpu-devices" in sys.argv:  # before jax starts: the number of CPU devices is fixed then
    _n = sys.argv[sys.argv.index("--cpu-devices") + 1]
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={_n}"
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
    "muon": dict(name="muon", kernel="optax"),  # Newton-Schulz in bf16 on the block's matrices; the embedding: AdamW
    "muon_fp32": dict(name="muon", kernel="optax", ns_dtype="float32"),  # the iterations in fp32 (TF32 on the GPU)
    "lion_int8": dict(name="lion", kernel="optax", moments="int8"),
}
ELEMENTWISE = ("adamw_optax", "lion", "sgd_momentum")  # a flat buffer is as good as the tree for these


def block_tree(h: int, inter: int, heads: int, kv_heads: int) -> dict:
    """One Llama block's weights: shapes as the engine's group tree holds them."""
    d = h // heads
    z = lambda *s: jax.ShapeDtypeStruct(s, np.float32)  # noqa: E731
    return {"input_layernorm": {"scale": z(h)}, "post_attention_layernorm": {"scale": z(h)},
            "mlp": {"down_proj": {"kernel": z(inter, h)}, "gate_proj": {"kernel": z(h, inter)},
                    "up_proj": {"kernel": z(h, inter)}},
            "self_attn": {"k_proj": {"kernel": z(h, kv_heads * d)}, "o_proj": {"kernel": z(h, h)},
                          "q_proj": {"kernel": z(h, h)}, "v_proj": {"kernel": z(h, kv_heads * d)}}}


def _timed(fn, reps: int, warmup: int) -> list[float]:
    times = []
    for c in range(1, warmup + reps + 1):
        t = time.perf_counter()
        fn(c)
        if c > warmup:
            times.append(time.perf_counter() - t)
    return times


def bench(fields: dict, tree: dict, reps: int, warmup: int, path: str = "host") -> dict:
    layout = Layout(tree)
    n = layout.size
    rng = np.random.default_rng(0)
    p, g, bits = alloc_aligned(n), alloc_aligned(n), alloc_aligned(n, np.uint16)
    p[:] = rng.standard_normal(n, dtype=np.float32) * 0.02
    g[:] = rng.standard_normal(n, dtype=np.float32) * 1e-3
    cfg = OptimConfig(lr=1e-4, weight_decay=0.1, **fields)
    opt = build_host_optimizer(cfg, 1000)
    state = opt.init_state(p, layout.unflatten)
    if path == "host":
        times = _timed(lambda c: opt.update(p, g, state, c, 0.9, bits, layout.unflatten), reps, warmup)
    else:
        dev = jax.devices()[0]
        box = [jax.device_put(p, dev), {k: jax.device_put(v, dev) for k, v in opt.state_to_arrays(state).items()}]
        gd = jax.device_put(g, dev)

        def step(c):
            box[0], box[1] = opt.device_step(box[0], gd, box[1], opt.device_scalars(c, 0.9), None,
                                             unflatten=layout.unflatten)
            jax.block_until_ready(box)

        times = _timed(step, reps, warmup)
    med = statistics.median(times)
    out = {"elements": n, "median_s": med, "times_s": times, "elements_per_s": n / med, "path": path,
           "state_bytes_per_param": state_bytes_per_param(cfg, tree, 1000)}
    if fields["name"] == "muon":  # the Newton-Schulz matmuls' rate
        from megatrain_jax.optim.muon import muon_dims, newton_schulz_flops

        dims = jax.tree.leaves(muon_dims(tree), is_leaf=lambda d: d is None)
        flops = sum(newton_schulz_flops(x.shape, 5) for x, d in zip(jax.tree.leaves(tree), dims) if d is not None)
        out.update(ns_flops=flops, ns_tflops=flops / med / 1e12)
    return out


def bench_sharded(fields: dict, tree: dict, reps: int, warmup: int) -> dict:
    """An elementwise optax update of the group's flat buffer sharded over every jax CPU device."""
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    n = Layout(tree).size
    devs = jax.devices("cpu")
    mesh = Mesh(np.array(devs), ("x",))
    shard, rep = NamedSharding(mesh, PartitionSpec("x")), NamedSharding(mesh, PartitionSpec())
    pad = -(-n // len(devs)) * len(devs)
    p, g = alloc_aligned(pad), alloc_aligned(pad)
    rng = np.random.default_rng(0)
    p[:] = rng.standard_normal(pad, dtype=np.float32) * 0.02
    g[:] = rng.standard_normal(pad, dtype=np.float32) * 1e-3
    tx = build_host_optimizer(OptimConfig(lr=1e-4, weight_decay=0.1, **fields), 1000).tx

    def step(pp, gg, st, sc):
        u, st = tx.update(gg * sc, st, pp)
        return optax.apply_updates(pp, u), st

    jstep = jax.jit(step, donate_argnums=(2,))
    box = [jax.jit(tx.init)(jax.device_put(p, shard))]
    scale = jax.device_put(np.float32(0.9), rep)

    def run(c):
        new_p, box[0] = jstep(jax.device_put(p, shard), jax.device_put(g, shard), box[0], scale)
        np.copyto(p, np.asarray(new_p))

    times = _timed(run, reps, warmup)
    med = statistics.median(times)
    return {"elements": n, "median_s": med, "times_s": times, "elements_per_s": n / med, "path": "host",
            "cpu_devices": len(devs), "note": "state resident on the CPU devices (not in the host store)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)  # an OptaxHostOptimizer compiles at its first two updates
    ap.add_argument("--only", default="", help="comma-separated optimizers (default: all)")
    ap.add_argument("--path", choices=("host", "device"), default="host")
    ap.add_argument("--vocab", type=int, default=0, help="also an embedding group of vocab x hidden")
    ap.add_argument("--cpu-devices", type=int, default=0, help="host path: also shard over N jax CPU devices")
    ap.add_argument("--out", default=None, help="JSON path (default: experiments/results/named_optimizers_<host>.json)")
    args = ap.parse_args()
    tree = block_tree(args.hidden, args.intermediate, args.heads, args.kv_heads)
    names = [x for x in args.only.split(",") if x] or list(OPTIMIZERS)
    load_before = list(os.getloadavg())  # other processes on the cores skew every figure
    results = {}
    groups = {"block": tree}
    if args.vocab:
        groups["embed"] = {"embedding": jax.ShapeDtypeStruct((args.vocab, args.hidden), np.float32)}
    for name in names:
        for gname, gtree in groups.items():
            key = name if gname == "block" else f"{name}@{gname}"
            runs = [(key, lambda: bench(OPTIMIZERS[name], gtree, args.reps, args.warmup, args.path))]
            if args.cpu_devices and args.path == "host" and name in ELEMENTWISE:
                runs.append((f"{key}_sharded", lambda: bench_sharded(OPTIMIZERS[name], gtree, args.reps, args.warmup)))
            for k, fn in runs:
                r = results[k] = fn()
                print(f"{k:24s} {r['elements_per_s'] / 1e6:9.1f} M elements/s  ({r['median_s'] * 1e3:8.1f} ms per "
                      f"{r['elements'] / 1e6:.1f}M-element {gname})"
                      + (f", Newton-Schulz at {r['ns_tflops']:.0f} TFLOP/s" if r.get("ns_flops") else ""), flush=True)
    base = results.get("adamw_fused", {}).get("elements_per_s")
    if base:
        for k, r in results.items():
            r["vs_fused_adamw"] = r["elements_per_s"] / base
            print(f"{k:24s} {r['vs_fused_adamw']:6.3f}x the fused AdamW's rate ({args.path})")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"named_optimizers_{args.path}_{socket.gethostname()}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"when": datetime.datetime.now(datetime.timezone.utc).isoformat(), "host": socket.gethostname(),
                   "cpu_count": os.cpu_count(), "machine": platform.machine(), "jax": jax.__version__, "backend": jax.default_backend(), "path": args.path,
                   "load_before": load_before, "load_after": list(os.getloadavg()),
                   "block": {"hidden": args.hidden, "intermediate": args.intermediate, "heads": args.heads,
                             "kv_heads": args.kv_heads}, "results": results}, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
