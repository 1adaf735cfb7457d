"""Probe: how much host RSS XLA's pinned-host memory costs per byte asked for, in the patterns the
engine uses (activations parked per micro-batch, whole-group gradient holds, 128 MiB slabs), first
step and steady state. Prints one JSON. Usage: PYTHONPATH=. python experiments/probe_pinned_host.py --out F"""
import argparse, json, os, time

os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "110")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax, jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding


def rss():
    d = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM"):
            d[k] = int(v.split()[0]) * 1024 / 1e9
    return d


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = jax.devices()[0]
    host = SingleDeviceSharding(dev, memory_kind="pinned_host")
    out = {"device": str(dev.device_kind), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cases": []}
    base = rss()
    out["base"] = base

    def case(name, sizes_bytes, steps=3):
        rec = {"name": name, "asked_gb": sum(sizes_bytes) / 1e9, "arrays": len(sizes_bytes), "steps": []}
        r0 = rss()["VmRSS"]
        srcs = {}
        for s in set(sizes_bytes):
            srcs[s] = jnp.ones((s // 2,), jnp.bfloat16, device=dev)
        for st in range(steps):
            held = [jax.device_put(srcs[s], host) for s in sizes_bytes]
            jax.block_until_ready(held)
            r = rss()
            rec["steps"].append({"rss_gb": r["VmRSS"], "delta_gb": r["VmRSS"] - r0, "hwm_gb": r["VmHWM"]})
            del held
        r = rss()
        rec["after_free_gb"] = r["VmRSS"] - r0
        del srcs
        out["cases"].append(rec)
        print(json.dumps(rec), flush=True)

    case("slabs 24 x 128MiB", [128 << 20] * 24)
    case("activations 512 x 33.5MB (8B, 16 mb, 32 layers)", [4096 * 4096 * 2] * 512)
    case("activations 32 x 537MB (8B, 1 mb, 32 layers)", [16 * 4096 * 4096 * 2] * 32)
    case("grad hold 32 x 0.87GB + 2 x 2.1GB (8B fp32)", [218_112_000 * 4] * 32 + [525_336_576 * 4] * 2, steps=2)
    out["final"] = rss()
    json.dump(out, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
