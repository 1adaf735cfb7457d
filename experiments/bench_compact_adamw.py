"""Host AdamW kernels per thread count: blockwise int8 moments, bf16 moments, fp32 moments (FusedAdamW).

Each kernel does what the engine asks of it per group: update the fp32 params and the moments in place
and write the bfloat16 copy of the params. Reported: median G elements/s over --reps runs after
--warmup runs, per kernel and per thread count (numba.set_num_threads through the optimizer's own
``set_num_threads``), and the implied memory traffic (int8: 17 B/element, bf16: 22, fp32: 30).

    PYTHONPATH=. python experiments/bench_compact_adamw.py --threads 1,4,16 --out /tmp/x.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numba  # noqa: E402

from megatrain_jax.optim import FusedAdamW, alloc_aligned, set_num_threads  # noqa: E402
from megatrain_jax.optim import compact_adamw as ca  # noqa: E402

HP = dict(lr=1e-4, b1=0.9, b2=0.95, eps=1e-8, eps_root=0.0, weight_decay=0.1)
BYTES = {"int8": 17, "bf16": 22, "fp32": 30}  # read p g m v, write p m v bf16 (per element)


def _buffers(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    p, g = alloc_aligned(n), alloc_aligned(n)
    p[:] = rng.standard_normal(n, dtype=np.float32)
    # magnitudes over four decades, as real gradients have, so every part of the int8 code is used
    g[:] = rng.standard_normal(n, dtype=np.float32) * (10.0 ** rng.uniform(-4, 0, n)).astype(np.float32)
    return p, g, alloc_aligned(n, np.uint16)


def _time(step, reps: int, warmup: int) -> float:
    for c in range(1, warmup + 1):
        step(c)
    ts = []
    for c in range(warmup + 1, warmup + reps + 1):
        t = time.perf_counter()
        step(c)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def make_int8(n):
    p, g, out = _buffers(n)
    nb = -(-n // ca.BLOCK)
    st = {"mu_q": alloc_aligned(n, np.uint8), "nu_q": alloc_aligned(n, np.uint8),
          "mu_scale": np.zeros(nb, np.float32), "nu_scale": np.zeros(nb, np.float32)}
    st["mu_q"][:] = 0
    st["nu_q"][:] = 0
    return lambda c: ca.adamw_int8_step(p, g, st, out, count=c, **HP)


def make_bf16(n):
    p, g, out = _buffers(n)
    st = {"mu_bf16": alloc_aligned(n, np.uint16), "nu_bf16": alloc_aligned(n, np.uint16)}
    st["mu_bf16"][:] = 0
    st["nu_bf16"][:] = 0
    return lambda c: ca.adamw_bf16_step(p, g, st, out, count=c, **HP)


def make_fp32(n):
    p, g, out = _buffers(n)
    opt = FusedAdamW(HP["lr"], b1=HP["b1"], b2=HP["b2"], eps=HP["eps"], weight_decay=HP["weight_decay"])
    st = opt.init_state(p)
    return lambda c: opt.update(p, g, st, c, 1.0, out)


KERNELS = {"int8": make_int8, "bf16": make_bf16, "fp32": make_fp32}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--elements", type=int, default=64 << 20)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--kernels", default="int8,bf16,fp32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    threads = [int(t) for t in a.threads.split(",")]
    ncpu = os.cpu_count()
    threads_ok = [t for t in threads if 1 <= t <= numba.config.NUMBA_NUM_THREADS]
    if threads_ok != threads:
        print(f"skipping thread counts above NUMBA_NUM_THREADS={numba.config.NUMBA_NUM_THREADS}: "
              f"{sorted(set(threads) - set(threads_ok))}")
    kernels = a.kernels.split(",")
    res: dict[str, dict[str, float]] = {k: {} for k in kernels}
    print(f"{a.elements / 1e6:.1f}M elements, cpus {ncpu}, numba threads max {numba.config.NUMBA_NUM_THREADS}, "
          f"median of {a.reps} after {a.warmup} warmup")
    for k in kernels:
        step = KERNELS[k](a.elements)
        for t in threads_ok:
            set_num_threads(t)
            sec = _time(step, a.reps, a.warmup)
            g = a.elements / sec / 1e9
            res[k][str(t)] = g
            print(f"  {k:5s} threads {t:3d}: {g:6.3f} G elem/s  ({g * BYTES[k]:6.1f} GB/s, "
                  f"{g / t * 1e3:6.1f} M elem/s/thread)", flush=True)
        del step
    set_num_threads(None)
    print("\nG elem/s   " + "".join(f"{t:>9d}" for t in threads_ok))
    for k in kernels:
        print(f"{k:10s} " + "".join(f"{res[k][str(t)]:9.3f}" for t in threads_ok))
    if a.out:
        doc = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu_count": ncpu,
               "cpu": platform.processor() or platform.machine(), "numba": numba.__version__,
               "numba_threads_max": numba.config.NUMBA_NUM_THREADS, "elements": a.elements,
               "reps": a.reps, "warmup": a.warmup, "g_elem_per_s": res}
        try:
            with open("/proc/cpuinfo") as f:
                doc["cpu"] = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
        except (OSError, StopIteration):
            pass
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
        print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
