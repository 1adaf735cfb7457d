"""Host AdamW throughput: the fused numba kernel vs optax on the jax CPU device vs numpy.

Each variant does what the engine needs per group: update the fp32 params and moments in place and
write the bfloat16 copy of the params. Reported: median G elements/s over --reps runs after --warmup
runs, and the memory traffic that implies (fused: read p, g, m, v; write p, m, v, bf16 = 30 B/element).

    python experiments/bench_adamw_cpu.py --elements 67108864
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
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import numba  # noqa: E402
import optax  # noqa: E402

from megatrain_jax.optim import FusedAdamW, OptaxHostOptimizer, alloc_aligned, set_num_threads  # noqa: E402
from megatrain_jax.optim.fused_adamw import f32_to_bf16_bits  # noqa: E402

HP = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
LR = 1e-4


def _buffers(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    p, g = alloc_aligned(n), alloc_aligned(n)
    p[:] = rng.standard_normal(n, dtype=np.float32)
    g[:] = rng.standard_normal(n, dtype=np.float32)
    return p, g, alloc_aligned(n, np.uint16)


def _time(fn, reps: int, warmup: int) -> list[float]:
    for c in range(1, warmup + 1):
        fn(c)
    out = []
    for c in range(warmup + 1, warmup + reps + 1):
        t = time.perf_counter()
        fn(c)
        out.append(time.perf_counter() - t)
    return out


def bench_fused(n, reps, warmup, bf16: bool):
    p, g, out = _buffers(n)
    opt = FusedAdamW(LR, **HP)
    st = opt.init_state(p)
    return _time(lambda c: opt.update(p, g, st, c, 1.0, out if bf16 else None), reps, warmup)


def bench_optax(n, reps, warmup):
    p, g, out = _buffers(n)
    opt = OptaxHostOptimizer(optax.adamw(LR, **HP))
    st = opt.init_state(p)
    return _time(lambda c: opt.update(p, g, st, c, 1.0, out), reps, warmup)


def bench_numpy(n, reps, warmup, threads: int):
    """In-place numpy ops, chunks of 1M elements spread over a thread pool (numpy releases the GIL)."""
    p, g, out = _buffers(n)
    m, v = alloc_aligned(n), alloc_aligned(n)
    b1, b2, eps, wd = (np.float32(HP[k]) for k in ("b1", "b2", "eps", "weight_decay"))
    chunk = 1 << 20
    slices = [slice(i, min(i + chunk, n)) for i in range(0, n, chunk)]

    def one(sl, c):
        gi, mi, vi, pi = g[sl], m[sl], v[sl], p[sl]
        mi *= b1
        mi += (1 - b1) * gi
        vi *= b2
        vi += (1 - b2) * (gi * gi)
        u = mi / np.float32(1 - 0.9 ** c)
        den = np.sqrt(vi / np.float32(1 - 0.95 ** c))
        den += eps
        u /= den
        u += wd * pi
        u *= np.float32(-LR)
        pi += u
        out[sl] = f32_to_bf16_bits(pi)

    with ThreadPoolExecutor(threads) as pool:
        return _time(lambda c: list(pool.map(lambda sl: one(sl, c), slices)), reps, warmup)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=64 * 2**20)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="numba/numpy threads (default: all cores)")
    ap.add_argument("--skip", default="", help="comma-separated variants to skip: optax,numpy")
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    n = args.elements
    threads = args.threads or numba.config.NUMBA_NUM_THREADS
    set_num_threads(threads)
    skip = set(filter(None, args.skip.split(",")))

    results: dict[str, dict] = {}
    load_before = list(os.getloadavg())  # other processes on the cores skew every figure below

    def record(name, times, bytes_per_elem):
        med = statistics.median(times)
        results[name] = dict(median_s=med, min_s=min(times), times_s=times,
                             G_elements_per_s=n / med / 1e9, GB_per_s=n * bytes_per_elem / med / 1e9)
        print(f"{name:22s} {n / med / 1e9:7.3f} G elements/s  ({n * bytes_per_elem / med / 1e9:6.1f} GB/s, "
              f"median of {len(times)}: {med * 1e3:.1f} ms)", flush=True)

    record("fused_numba_bf16", bench_fused(n, args.reps, args.warmup, True), 30)
    record("fused_numba_no_bf16", bench_fused(n, args.reps, args.warmup, False), 28)
    if "optax" not in skip:
        record("optax_cpu_jit", bench_optax(n, args.reps, args.warmup), 30)
    if "numpy" not in skip:
        record("numpy_threaded", bench_numpy(n, args.reps, args.warmup, threads), 30)

    cpu_model = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu_model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    host = socket.gethostname()
    now = datetime.datetime.now(datetime.timezone.utc)
    report = dict(
        benchmark="adamw_cpu", date=now.isoformat(timespec="seconds"), host=host,
        cpu_model=cpu_model, cpu_count=os.cpu_count(), cores_available=len(os.sched_getaffinity(0)),
        threads=threads, numba_threading_layer=numba.threading_layer(), elements=n,
        load_average_1_5_15min=load_before, load_average_after=list(os.getloadavg()),
        hyperparameters=dict(lr=LR, **HP), reps=args.reps, warmup=args.warmup,
        versions=dict(python=platform.python_version(), numpy=np.__version__, numba=numba.__version__,
                      jax=jax.__version__, optax=optax.__version__),
        command=" ".join([os.path.basename(sys.executable)] + sys.argv), results=results)
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"adamw_cpu_{host}_{now:%Y%m%d}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
