"""What holds the GPU at a step's peak: the user's ``megatrain-jax train`` run in this process, with a
thread that samples XLA's ``bytes_in_use`` and, at each new high (by ``--every-mb``), records the live
device arrays grouped by shape and dtype, their sum (the rest is executables' temporaries), and the
main thread's Python stack (which phase of the step it is in). The plan's figures for comparison.

    PYTHONPATH=. python experiments/probe_gpu_peak.py CONFIG --out $OUT/name.json [--set k=v ...] [--pool-whole]

``--pool-whole``: XLA gets 95% of the GPU whatever ``train.gpu_memory_gb`` says, so a plan made for a small
budget shows what it really needs instead of running out of memory.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--out", required=True)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--pool-whole", action="store_true")
    ap.add_argument("--every-mb", type=float, default=256.0)
    ap.add_argument("--period-ms", type=float, default=2.0)
    args = ap.parse_args()
    if args.pool_whole:
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.95"
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    import jax

    from megatrain_jax import cli

    snaps: list[dict] = []
    state = {"max": 0, "stop": False}
    main_ident = threading.get_ident()

    def sample():
        dev = None
        while not state["stop"]:
            try:
                dev = dev or next(d for d in jax.devices() if d.platform == "gpu")
                used = dev.memory_stats()["bytes_in_use"]
            except Exception:  # backend not up yet
                time.sleep(0.05)
                continue
            if used > state["max"] + args.every_mb * 2**20:
                state["max"] = used
                groups: dict = collections.defaultdict(lambda: [0, 0])
                live = 0
                for a in jax.live_arrays():
                    try:
                        if a.sharding.memory_kind != "device" or a.is_deleted():
                            continue
                        key = f"{a.dtype}{list(a.shape)}"
                        groups[key][0] += 1
                        groups[key][1] += a.nbytes
                        live += a.nbytes
                    except Exception:
                        continue
                frame = sys._current_frames().get(main_ident)
                stack = [f"{f.filename.split('megatrain_jax/')[-1]}:{f.lineno} {f.name}"
                         for f in traceback.extract_stack(frame)][-12:] if frame else []
                top = sorted(groups.items(), key=lambda kv: -kv[1][1])[:25]
                snaps.append({"t": time.time(), "bytes_in_use_gb": used / 1e9, "live_arrays_gb": live / 1e9,
                              "temporaries_gb": (used - live) / 1e9, "stack": stack,
                              "arrays": [{"key": k, "count": c, "gb": b / 1e9} for k, (c, b) in top]})
            time.sleep(args.period_ms / 1000)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    flags = [x for s in args.set for x in ("--set", s)]
    t0 = time.time()
    try:
        rc = cli.main(["train", args.config] + flags)
    except BaseException as e:  # an OOM surfaces as an error line and rc 2; anything else is recorded
        rc = f"{type(e).__name__}: {e}"[:500]
    state["stop"] = True
    th.join()
    stats = {}
    try:
        stats = next(d for d in jax.devices() if d.platform == "gpu").memory_stats()
    except Exception:
        pass
    plan = None
    try:
        from megatrain_jax.config import load_config
        from megatrain_jax.plan import make_plan

        p = make_plan(load_config(args.config, args.set))
        plan = {"gpu_need_gb": (p.gpu_need or 0) / 1e9, "host_need_gb": p.host_need / 1e9,
                "gpu_phases_gb": {k: v / 1e9 for k, v in p.gpu_phases.items()},
                "rows": [str(r) for r in p.rows], "decisions": {k: str(v) for k, v in p.decisions.items()}}
    except Exception as e:
        plan = {"error": str(e)[:300]}
    best = max(snaps, key=lambda s: s["bytes_in_use_gb"]) if snaps else None
    hwm = 0.0
    with open("/proc/self/status") as f:  # this process's peak RSS (the run is in-process)
        hwm = next((float(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM")), 0.0)
    out = {"config": args.config, "sets": args.set, "rc": rc, "wall_s": time.time() - t0,
           "peak_host_rss_gb": hwm / 1e9, "device": getattr(jax.devices()[0], "device_kind", "?"),
           "date": time.strftime("%Y-%m-%d"),
           "peak_bytes_in_use_gb": stats.get("peak_bytes_in_use", 0) / 1e9, "bytes_limit_gb": stats.get("bytes_limit", 0) / 1e9,
           "plan": plan, "peak_snapshot": best, "snapshots": snaps[-12:]}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"probe: rc={rc} peak {out['peak_bytes_in_use_gb']:.2f} GB (limit {out['bytes_limit_gb']:.1f}); "
          f"plan GPU {plan.get('gpu_need_gb', float('nan')):.2f} GB; host peak RSS {hwm / 1e9:.2f} GB "
          f"(plan {plan.get('host_need_gb', float('nan')):.2f})")
    if best:
        print(f"  at the highest sample {best['bytes_in_use_gb']:.2f} GB: live arrays {best['live_arrays_gb']:.2f}, "
              f"temporaries {best['temporaries_gb']:.2f}; {best['stack'][-3:]}")
        for a in best["arrays"][:12]:
            print(f"    {a['count']:4d} x {a['key']:40s} {a['gb']:.2f} GB")
    os._exit(0)  # the engine's threads


if __name__ == "__main__":
    main()
