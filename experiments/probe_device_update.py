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

    q8 = alloc_aligned(n, np.uint8)
    q8[:] = 7
    x.register("q8", q8)
    res["h2d_uint8_registered_GBps"] = q8.nbytes / 1e9 / timed(lambda: x.to_device("q8", q8).block_until_ready())
    d8 = x.to_device("q8", q8)
    res["d2h_uint8_direct_GBps"] = q8.nbytes / 1e9 / timed(lambda: x.copy_into(d8, q8))

    # one layer of the forward of a device-side update, as the engine issues it: the master and two
    # int8 moment arrays in, the update, then the write-back on another thread (a 4-layer loop)
    layers = 4
    host = [{"p": alloc_aligned(n, np.float32), "mu_q": alloc_aligned(n, np.uint8), "nu_q": alloc_aligned(n, np.uint8),
             "mu_scale": alloc_aligned(n // 2048, np.float32), "nu_scale": alloc_aligned(n // 2048, np.float32)}
            for _ in range(layers)]
    for i, h in enumerate(host):
        for k, v in h.items():
            x.register(f"{i}/{k}", v)
    gl = jax.device_put(np.full(n, 1e-3, np.float32), dev)
    scal0 = compact_adamw.adamw_scalars(1e-4, 0.9, 0.95, 1e-8, 0.0, 0.1, 3, 0.5)
    from concurrent.futures import ThreadPoolExecutor
    pool = ThreadPoolExecutor(1)

    def loop():
        futs = []
        put = {}
        for i in range(layers):
            put[i] = {k: x.to_device(f"{i}/{k}", v) for k, v in host[i].items()}
        for i in range(layers):
            d = put.pop(i)
            pn, st = device_adamw_step("int8", d.pop("p"), gl, d, scal0)
            futs.append(pool.submit(lambda i=i, pn=pn, st=st: [x.copy_into(a, host[i][k]) for k, a in
                                                                   [("p", pn)] + list(st.items())]))
        for f in futs:
            f.result()
    # where the time goes in one run of the loop: when each call returns, when each array is ready
    t0 = time.perf_counter()
    ev = []
    put = {}
    for i in range(layers):
        put[i] = {k: x.to_device(f"{i}/{k}", v) for k, v in host[i].items()}
        ev.append((f"h2d {i} issued", time.perf_counter() - t0))
    outs = []
    for i in range(layers):
        d = put.pop(i)
        pn, st = device_adamw_step("int8", d.pop("p"), gl, d, scal0)
        outs.append((pn, st))
        ev.append((f"update {i} dispatched", time.perf_counter() - t0))
    for i, (pn, st) in enumerate(outs):
        pn.block_until_ready()
        ev.append((f"update {i} ready", time.perf_counter() - t0))
    for i, (pn, st) in enumerate(outs):
        x.copy_into(pn, host[i]["p"])
        ev.append((f"d2h p {i} done", time.perf_counter() - t0))
    res["loop_events_ms"] = [(k, round(1e3 * v, 1)) for k, v in ev]

    def h2d_only():
        arrs = [x.to_device(f"{i}/{k}", v) for i in range(layers) for k, v in host[i].items()]
        for a_ in arrs:
            a_.block_until_ready()
    res["h2d_only_loop_GBps"] = layers * 6.0 * n / 1e9 / timed(h2d_only, reps=2)
    # the engine's forward with a device-side update, three issue orders, next to a stand-in forward
    # (bf16 matmuls, ~60 ms) that reads the updated weights: per-layer time
    import jax.numpy as jnp

    mat = jax.device_put(np.full((8192, 8192), 1e-3, np.float32), dev).astype(jnp.bfloat16)

    @jax.jit
    def fake_fwd(w, a):
        a = jax.lax.fori_loop(0, 36, lambda _, a: (a @ a) * jnp.bfloat16(1e-3), a)
        return a + w[0].astype(jnp.bfloat16)

    fake_fwd(gl, mat).block_until_ready()
    res["fake_forward_ms"] = 1e3 * timed(lambda: fake_fwd(gl, mat).block_until_ready())
    L = 8

    def engine_like(order):
        futs = []
        fetch = lambda i: {k: x.to_device(f"{i % layers}/{k}", v) for k, v in host[i % layers].items()}
        nxt = fetch(0)
        a_ = mat
        for i in range(L):
            cur = nxt
            if order == "fetch_first" and i + 1 < L:
                nxt = fetch(i + 1)
            pn, st = device_adamw_step("int8", cur.pop("p"), gl, cur, scal0)
            if order == "update_first" and i + 1 < L:
                nxt = fetch(i + 1)
            a_ = fake_fwd(pn, a_)
            if order == "fetch_after_fwd" and i + 1 < L:
                nxt = fetch(i + 1)
            futs.append(pool.submit(lambda i=i, pn=pn, st=st: [x.copy_into(v, host[i % layers][k]) for k, v in
                                                               [("p", pn)] + list(st.items())]))
        a_.block_until_ready()
        for f in futs:
            f.result()
    for order in ("fetch_first", "update_first", "fetch_after_fwd"):
        res[f"engine_like_{order}_ms_per_layer"] = 1e3 * timed(lambda: engine_like(order), reps=2) / L
    t_loop = timed(loop, reps=2)
    res["layer_loop_ms_per_layer"] = 1e3 * t_loop / layers
    res["layer_loop_GBps_each_way"] = layers * 6.0 * n / 1e9 / t_loop

    def both():
        t = threading.Thread(target=lambda: x.copy_into(d, p))
        t.start()
        x.to_device("p", p).block_until_ready()
        t.join()
    res["both_directions_total_GBps"] = 2 * gb / timed(both)

    rng = np.random.default_rng(0)
    g = jax.device_put(rng.standard_normal(n, dtype=np.float32) * 1e-3, dev)
    scal = compact_adamw.adamw_scalars(1e-4, 0.9, 0.95, 1e-8, 0.0, 0.1, 3, 0.5)
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
