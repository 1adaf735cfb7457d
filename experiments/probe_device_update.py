"""Probe: what a device-side optimizer step (``train.update_on=device``) costs, piece by piece, on the GPU.

Times, for one block-sized group (default 308M values, a Qwen2.5-14B layer): host->GPU from a
DMA-registered buffer; GPU->host through the CUDA driver copy (``transfer._DirectCopy``) into a
registered and into an unregistered buffer; ``device_put`` to pinned host memory; both directions at
once; and ``device_adamw_step`` for each moment format, alone. Prints one JSON object.

    PYTHONPATH=. python experiments/probe_device_update.py [--n 308000000] [--out results.json]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import threading
import time

import jax
import numpy as np

from megatrain_jax.optim import compact_adamw
from megatrain_jax.optim.device_adamw import device_adamw_step
from megatrain_jax.optim.host import alloc_aligned
from megatrain_jax.transfer import Transfers, _DirectCopy


def timed(fn, reps=3):
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=308_000_000)
    ap.add_argument("--out")
    a = ap.parse_args()
    n = a.n // 2048 * 2048
    dev = jax.devices()[0]
    x = Transfers(dev)
    res: dict = {"n": n, "device": dev.device_kind, "transfer_mode": x.mode}
    p = alloc_aligned(n, np.float32)
    p[:] = 1.0
    x.register("p", p)
    unreg = alloc_aligned(n, np.float32)
    unreg[:] = 0.0
    gb = p.nbytes / 1e9

    d = x.to_device("p", p)
    d.block_until_ready()
    res["h2d_GBps"] = gb / timed(lambda: x.to_device("p", p).block_until_ready())
    res["d2h_direct_registered_GBps"] = gb / timed(lambda: x.copy_into(d, p))
    direct = x._direct_copy()
    ptr = d.addressable_data(0).unsafe_buffer_pointer()
    res["d2h_direct_unregistered_GBps"] = gb / timed(lambda: direct.copy(unreg.ctypes.data, ptr, unreg.nbytes))
    res["d2h_device_put_pinned_GBps"] = gb / timed(lambda: x.to_host(d).block_until_ready())
    # is the dma_map'd range page-locked as the driver API sees it? (cuMemHostGetFlags succeeds only then)
    lib = ctypes.CDLL("libcuda.so.1")
    flags = ctypes.c_uint()
    res["cuMemHostGetFlags_registered_rc"] = lib.cuMemHostGetFlags(ctypes.byref(flags), ctypes.c_void_p(p.ctypes.data))
    res["cuMemHostGetFlags_registered_flags"] = flags.value
    res["cuMemHostGetFlags_unregistered_rc"] = lib.cuMemHostGetFlags(ctypes.byref(flags), ctypes.c_void_p(unreg.ctypes.data))

    def both():
        t = threading.Thread(target=lambda: x.copy_into(d, p))
        t.start()
        x.to_device("p", p).block_until_ready()
        t.join()
    res["both_directions_total_GBps"] = 2 * gb / timed(both)

    rng = np.random.default_rng(0)
    g = jax.device_put(rng.standard_normal(n, dtype=np.float32) * 1e-3, dev)
    scal = compact_adamw._scalars(1e-4, 0.9, 0.95, 1e-8, 0.0, 0.1, 3, 0.5)
    nb = n // 2048
    states = {"float32": {"mu": np.zeros(n, np.float32), "nu": np.zeros(n, np.float32)},
              "bfloat16": {"mu_bf16": np.zeros(n, np.uint16), "nu_bf16": np.zeros(n, np.uint16)},
              "int8": {"mu_q": np.zeros(n, np.uint8), "nu_q": np.zeros(n, np.uint8),
                       "mu_scale": np.zeros(nb, np.float32), "nu_scale": np.zeros(nb, np.float32)}}
    for mode, st in states.items():
        cur = {"p": jax.device_put(p, dev), "st": {k: jax.device_put(v, dev) for k, v in st.items()}}

        def one():
            q, s = device_adamw_step(mode, cur["p"], g, cur["st"], scal)
            q.block_until_ready()
            cur["p"], cur["st"] = q, s
        res[f"update_{mode}_ms"] = 1e3 * timed(one)
        res[f"update_{mode}_Gelems"] = n / (res[f"update_{mode}_ms"] * 1e6)
        del cur
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
