"""Where a training process's host memory goes, beyond the state the plan counts.

Runs ``megatrain-jax train CONFIG`` in a child and, once ``--at-step`` steps are in metrics.jsonl, reads
the child's ``/proc/PID/smaps``: resident bytes summed by mapping (anonymous, heap, each shared
library, pinned/device mappings), plus ``/proc/PID/status`` (VmHWM, RssAnon, RssFile, RssShmem). The
plan's "runtime" row is what is left after the state; this says what it is made of.

    PYTHONPATH=. python experiments/probe_host_runtime.py --out $OUT configs/qwen2.5-7b.yaml \\
        --set optim.moments=int8 --set train.stream_copy=device
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def smaps_by_mapping(pid: int) -> tuple[dict[str, int], list[int]]:
    """Resident bytes by mapping name, and the resident bytes of each anonymous mapping."""
    out: dict[str, int] = collections.Counter()
    anon: list = []
    name, size, rng = "?", 0, ""
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if not parts:
                continue
            if "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:  # a mapping header
                name = parts[5] if len(parts) > 5 else "[anon]"
                rng = parts[0]
            elif parts[0] == "Size:":
                size = int(parts[1]) * 1024
            elif parts[0] == "Rss:":
                out[name] += int(parts[1]) * 1024
                if name == "[anon]":
                    anon.append((int(parts[1]) * 1024, size, rng))
    return dict(out), sorted(anon, reverse=True)


def status(pid: int) -> dict[str, float]:
    res = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem", "VmLck", "VmPin"):
                res[k] = int(v.split()[0]) * 1024 / 1e9
    return res


def inventory() -> dict:
    """Large numpy arrays reachable from Python (by base buffer, with a referrer's type) and live JAX
    arrays by platform and memory kind: what the resident anonymous memory is made of."""
    import gc

    import jax
    import numpy as np

    seen: dict[int, dict] = {}
    arrays = {}
    for c in gc.get_objects():  # ndarrays are not GC-tracked themselves: find them in their containers
        for o in gc.get_referents(c):
            if isinstance(o, np.ndarray) and o.nbytes >= 1e6:
                arrays[id(o)] = (o, type(c).__name__)
    for o, holder in arrays.values():
        if True:
            base = o
            while isinstance(getattr(base, "base", None), np.ndarray):
                base = base.base
            key = id(base)
            if key in seen or base.nbytes < 20e6:
                continue
            refs = [holder]
            seen[key] = {"gb": round(base.nbytes / 1e9, 3), "dtype": str(base.dtype), "shape": list(base.shape),
                         "owner": type(base.base).__name__ if base.base is not None else "numpy", "referrers": refs}
    live: dict[str, float] = collections.Counter()
    for a in jax.live_arrays():
        try:
            kinds = {s.data.platform() + ":" + str(getattr(a.sharding, "memory_kind", None)) for s in a.addressable_shards}
        except Exception:  # noqa: BLE001
            kinds = {"?"}
        for k in kinds:
            live[k] += a.nbytes / 1e9
    return {"numpy_over_50mb": sorted(seen.values(), key=lambda d: -d["gb"])[:25],
            "numpy_total_gb": sum(d["gb"] for d in seen.values()), "jax_live_gb_by_kind": dict(live)}


def main_inprocess(args) -> None:
    """Train in this process; at step ``--at-step`` take the smaps snapshot and the inventory."""
    from megatrain_jax.config import load_config
    from megatrain_jax.train import train

    out_dir = tempfile.mkdtemp(prefix="probe_rt_")
    sets = args.set + [f"train.out_dir={out_dir}", "train.final_checkpoint=false", "model.init=fast",
                       f"train.steps={args.at_step + 1}", "optim.schedule.kind=constant",
                       "optim.schedule.warmup_steps=0", "train.log_every=1"]
    cfg = load_config(args.config, sets)
    res: dict = {}

    def log(msg: str) -> None:
        print(msg, flush=True)
        if msg.startswith("step") and f" {args.at_step}/" in msg and not res:
            by, anon = smaps_by_mapping(os.getpid())
            res.update({"status_gb": status(os.getpid()), "inventory": inventory(),
                        "anon_mappings_rss_size_gb": [(round(r / 1e9, 3), round(z / 1e9, 3), a) for r, z, a in anon[:12]]})

    train(cfg, log=log)
    with open(os.path.join(args.out, "probe_host_runtime_inprocess.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--at-step", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--inprocess", action="store_true", help="train in this process and list its big arrays")
    args = ap.parse_args()
    if args.inprocess:
        return main_inprocess(args)
    out_dir = tempfile.mkdtemp(prefix="probe_rt_")
    sets = args.set + [f"train.out_dir={out_dir}", "train.final_checkpoint=false", "model.init=fast",
                       f"train.steps={args.at_step + 1}", "optim.schedule.kind=constant",
                       "optim.schedule.warmup_steps=0", "train.log_every=1"]
    cmd = [sys.executable, "-m", "megatrain_jax", "train", args.config] + [x for s in sets for x in ("--set", s)]
    log = open(os.path.join(args.out, "probe_train.log"), "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    mpath = os.path.join(out_dir, "metrics.jsonl")
    snap = None
    while proc.poll() is None:
        n = sum(1 for _ in open(mpath)) if os.path.exists(mpath) else 0
        if n >= args.at_step and snap is None:
            by, anon = smaps_by_mapping(proc.pid)
            snap = {"status_gb": status(proc.pid),
                    "anon_mappings_rss_size_gb": [(round(r / 1e9, 3), round(z / 1e9, 3), a) for r, z, a in anon[:12]],
                    "anon_count": len(anon), "anon_size_total_gb": sum(z for _, z, _ in anon) / 1e9,
                    "anon_small_total_gb": sum(r for r, _, _ in anon if r < 100e6) / 1e9,
                    "rss_by_mapping_gb": {
                k: round(v / 1e9, 3) for k, v in sorted(by.items(), key=lambda kv: -kv[1])[:40]},
                "total_rss_gb": sum(by.values()) / 1e9}
        time.sleep(0.2)
    res = {"cmd": " ".join(cmd), "rc": proc.returncode, "snapshot": snap}
    with open(os.path.join(args.out, "probe_host_runtime.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
