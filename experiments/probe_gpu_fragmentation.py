"""How the GPU pool fragments during a streamed step: the train command run in this process while a thread
samples XLA's allocator (``memory_stats``) every few milliseconds. Reported: the most bytes in use, the least
``largest_free_block_bytes`` (the biggest single allocation that could still succeed) and the free bytes at that
moment, and the XLA_/TF_ environment the backend started with (a run once started without the plan's budgets).

Measured (one H200, a 12-layer slice of the 110B lean shape): the per-step allocation of the GPU-held gradients left the
least largest free block at 18.7 GB (30.7 GB free); a tried alternative, one buffer per held group made before the
first step and rewritten in place, left 7.2 GB (17.9 GB free: the buffers outlive the updates that used to free them
during the forward) and was dropped.

    PYTHONPATH=. python experiments/probe_gpu_fragmentation.py --out $OUT -- train CONFIG --set ...
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time


def _sampler(stats: dict, stop: threading.Event, every_s: float) -> None:
    from jax._src import xla_bridge

    while not stop.is_set() and not xla_bridge._backends:  # noqa: SLF001 - the plan sets XLA's budgets first
        time.sleep(0.05)
    import jax

    import os

    dev = jax.local_devices()[0]
    stats["env"] = {k: v for k, v in os.environ.items() if k.startswith(("XLA_", "TF_"))}
    while not stop.wait(every_s):
        m = dev.memory_stats() or {}
        use, free_block, limit = m.get("bytes_in_use", 0), m.get("largest_free_block_bytes"), m.get("bytes_limit", 0)
        stats["samples"] += 1
        stats["max_in_use"] = max(stats["max_in_use"], use)
        stats["largest_alloc"] = max(stats["largest_alloc"], m.get("largest_alloc_size", 0))
        stats["limit"] = limit
        if free_block is not None and use > 1e9 and free_block < stats["min_largest_free_block"]:
            stats["min_largest_free_block"] = free_block
            stats["free_then"] = limit - use


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="fragmentation")
    ap.add_argument("--every-ms", type=float, default=5.0)
    ap.add_argument("argv", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    argv = a.argv[1:] if a.argv[:1] == ["--"] else a.argv
    from megatrain_jax.cli import main as cli_main

    stats = {"samples": 0, "max_in_use": 0, "largest_alloc": 0, "min_largest_free_block": float("inf"),
             "free_then": None, "limit": 0}
    stop = threading.Event()
    t = threading.Thread(target=_sampler, args=(stats, stop, a.every_ms / 1e3), daemon=True)
    t.start()
    rc = cli_main(argv)
    stop.set()
    t.join()
    rec = {"name": a.name, "rc": rc, "argv": argv,
           **{k: (v / 1e9 if isinstance(v, (int, float)) and k != "samples" and v != float("inf") else v)
              for k, v in stats.items()}}
    print("fragmentation:", json.dumps(rec), flush=True)
    if a.out:
        with open(f"{a.out}/{a.name}.json", "w") as f:
            json.dump(rec, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
