"""Host memory bandwidth as the optimizer kernels see it: numba-parallel streams over large arrays.

Tells whether a host AdamW kernel is bound by memory (its bytes moved per second near these figures)
or by its own arithmetic. Kernels: copy (8 bytes/element moved), triad a = b + s*c (12), and
read-modify-write of 3 arrays (24: like p, m, v updated in place).

    PYTHONPATH=. python experiments/probe_host_bandwidth.py --gelem 0.25 --threads 16 --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numba
import numpy as np
from numba import njit, prange


@njit(parallel=True, cache=True)
def _copy(a, b):
    for i in prange(a.shape[0]):
        a[i] = b[i]


@njit(parallel=True, cache=True)
def _triad(a, b, c, s):
    for i in prange(a.shape[0]):
        a[i] = b[i] + s * c[i]


@njit(parallel=True, cache=True)
def _rmw3(a, b, c, s):
    for i in prange(a.shape[0]):
        a[i] = a[i] * s + 1.0
        b[i] = b[i] * s + 1.0
        c[i] = c[i] * s + 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gelem", type=float, default=0.25, help="elements per array, in billions (fp32)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    n = int(args.gelem * 1e9)
    a, b, c = (np.ones(n, np.float32) for _ in range(3))
    s = np.float32(0.5)
    res = {"threads": numba.get_num_threads(), "elements": n, "threading_layer": None}
    for name, fn, fargs, bytes_per in [("copy", _copy, (a, b), 8), ("triad", _triad, (a, b, c, s), 12),
                                       ("rmw3", _rmw3, (a, b, c, s), 24)]:
        fn(*fargs)
        best = min(_timed(fn, fargs) for _ in range(args.repeat))
        res[name] = {"best_s": best, "gelem_per_s": n / best / 1e9, "gb_per_s": n * bytes_per / best / 1e9}
    res["threading_layer"] = numba.threading_layer()
    print(json.dumps(res, indent=1))
    with open(os.path.join(args.out, "host_bandwidth.json"), "w") as f:
        json.dump(res, f, indent=1)


def _timed(fn, fargs) -> float:
    t = time.perf_counter()
    fn(*fargs)
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
