"""Host AdamW kernels per thread count: blockwise int8 moments, bf16 moments, fp32 moments (FusedAdamW).

Each kernel does what the engine asks of it per group: update the fp32 params and the moments in place
and write the bfloat16 copy of the params. Kernels (``--kernels``):

- ``int8``: ``compact_adamw.adamw_int8_step`` as the engine calls it (variant chosen by
  ``MEGATRAIN_INT8_GATHER`` / the auto timing; the choice is reported);
- ``int8-hw``, ``int8-sw``: the two variants of the int8 kernel forced (hw: LLVM may emit vector gather
  instructions; sw: the gathers are scalar loads into vector lanes; see ``compact_adamw.py``);
- ``int8-legacy``: the int8 kernel before the 2026-11-24 rewrite (copied below, same state format,
  same bits), to measure before/after in one process;
- ``bf16``, ``fp32``: the bf16-moment kernel and FusedAdamW.

All int8 kernels share one set of buffers (they give the same bits, so each just takes the next step).
The kernels take turns within each round (``--reps`` rounds after ``--warmup`` rounds), so drifting
load on the machine hits them alike; reported per kernel and thread count: the median and the best
G elements/s, and the implied memory traffic of the median (int8: 18 B/element, bf16: 22, fp32: 30).

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
from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from megatrain_jax.optim import FusedAdamW, alloc_aligned, set_num_threads  # noqa: E402
from megatrain_jax.optim import compact_adamw as ca  # noqa: E402
from megatrain_jax.optim.fused_adamw import adamw_elem, bf16_rne, launch  # noqa: E402

HP = dict(lr=1e-4, b1=0.9, b2=0.95, eps=1e-8, eps_root=0.0, weight_decay=0.1)
# per element: read p g mq vq, write p bf16 mq vq (int8); read p g m v, write p m v bf16 (bf16, fp32)
BYTES = {"int8": 18, "bf16": 22, "fp32": 30}


# ------------------------------------------------------------ the int8 kernel before the rewrite
# (commit 38075e2: separate gather, update, bf16 and three requantization passes per moment, in a
# function called per block; table entries (base << 17) | thr, one compare per value)

_L_LO, _L_HI, _L_SHIFT = ca.LOOKUP_LO, ca.LOOKUP_HI, ca.LOOKUP_SHIFT
_L_NB = ca.LOOKUP_BUCKETS
_L_LOW = (1 << _L_SHIFT) - 1


def _legacy_table(code):
    nb = _L_NB
    tab = np.empty(2 * nb, np.int32)
    for s in (0, 1):
        a0 = _L_LO + (np.arange(nb, dtype=np.int64) << _L_SHIFT)
        a1 = np.minimum(a0 + _L_LOW, _L_HI)

        def f(a):
            x = (a.astype(np.uint32) | np.uint32(s << 31)).view(np.float32)
            return ca._nearest_np(code, x).astype(np.int64)

        f0, f1 = f(a0), f(a1)
        step = f1 - f0 if s == 0 else f0 - f1
        assert np.all((step == 0) | (step == 1))
        lo, hi = a0.copy(), a1.copy()
        while True:
            active = (step == 1) & (hi - lo > 1)
            if not active.any():
                break
            mid = (lo + hi) // 2
            same = f(mid) == f0
            lo = np.where(active & same, mid, lo)
            hi = np.where(active & ~same, mid, hi)
        thr = np.where(step == 1, hi - a0, _L_LOW + 1)
        base = f0 if s == 0 else f0 - 1
        tab[s * nb:(s + 1) * nb] = ((base << 17) | thr).astype(np.int32)
    return tab


def _legacy_magnitude(builder, x):
    i32 = ir.IntType(32)
    b = builder.bitcast(x, i32)
    a = builder.and_(b, ir.Constant(i32, 0x7FFFFFFF))
    neg = builder.and_(builder.icmp_signed("<", b, ir.Constant(i32, 0)),
                       builder.icmp_unsigned("<=", a, ir.Constant(i32, 0x7F800000)))
    lo, hi = ir.Constant(i32, _L_LO), ir.Constant(i32, _L_HI)
    a = builder.select(builder.icmp_unsigned("<", a, lo), lo, a)
    a = builder.select(builder.icmp_unsigned(">", a, hi), hi, a)
    return a, neg


@intrinsic
def _legacy_slot(typingctx, x):
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        a, neg = _legacy_magnitude(builder, args[0])
        k = builder.lshr(builder.sub(a, ir.Constant(i32, _L_LO)), ir.Constant(i32, _L_SHIFT))
        return builder.add(k, builder.select(neg, ir.Constant(i32, _L_NB), ir.Constant(i32, 0)))

    return types.uint32(types.float32), codegen


@intrinsic
def _legacy_index(typingctx, x, entry):
    if x != types.float32 or entry not in (types.int32, types.uint32):
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        a, neg = _legacy_magnitude(builder, args[0])
        ge = builder.icmp_unsigned(">=", builder.and_(a, ir.Constant(i32, _L_LOW)),
                                   builder.and_(args[1], ir.Constant(i32, (1 << 17) - 1)))
        step = builder.zext(builder.xor(ge, neg), i32)
        return builder.trunc(builder.add(builder.ashr(args[1], ir.Constant(i32, 17)), step), ir.IntType(8))

    return types.uint8(types.float32, entry), codegen


@njit(inline="always")
def _legacy_requantize(s, si, r, tab, q, lo, cnt):
    for j in range(cnt):
        x = s[j] * r
        s[j] = x
        si[j] = _legacy_slot(x)
    for j in range(cnt):
        si[j] = tab[si[j]]
    for j in range(cnt):
        q[lo + j] = _legacy_index(s[j], si[j])


@njit(nogil=True, cache=True, error_model="numpy")
def _legacy_block(param, grad, mq, ms, vq, vs, bf16_out, write_bf16, code_s, code_u, tab_s, tab_u, sm, sv, si, b, n,
                  nlr, b1, omb1, b2, omb2, rbc1, rbc2, eps, eps_root, wd, gs):
    decay = wd != np.float32(0.0)
    lo = np.uint64(b) * np.uint64(ca.BLOCK)
    cnt = min(np.uint64(ca.BLOCK), np.uint64(n) - lo)
    for j in range(cnt):
        sm[j] = code_s[mq[lo + j]]
        sv[j] = code_u[vq[lo + j]]
    am, av = ms[b], vs[b]
    mx_m = np.uint32(0)
    mx_v = np.uint32(0)
    for j in range(cnt):
        p, m, v = adamw_elem(param[lo + j], grad[lo + j], sm[j] * am, sv[j] * av, gs, nlr, b1, omb1, b2, omb2,
                              rbc1, rbc2, eps, eps_root, wd, decay)
        param[lo + j] = p
        sm[j] = m
        sv[j] = v
        mx_m = max(mx_m, ca._abs_bits(m))
        mx_v = max(mx_v, ca._abs_bits(v))
    if write_bf16:
        for j in range(cnt):
            bf16_out[lo + j] = bf16_rne(param[lo + j])
    am, av = ca._bits_f32(mx_m), ca._bits_f32(mx_v)
    zero = np.float32(0.0)
    rm = np.float32(1.0) / am if am > zero else zero
    rv = np.float32(1.0) / av if av > zero else zero
    _legacy_requantize(sm, si, rm, tab_s, mq, lo, cnt)
    _legacy_requantize(sv, si, rv, tab_u, vq, lo, cnt)
    ms[b], vs[b] = am, av


@njit(parallel=True, fastmath=False, cache=True, nogil=True)
def _legacy_core(param, grad, mq, ms, vq, vs, bf16_out, code_s, code_u, tab_s, tab_u, nthreads, nlr, b1, omb1,
                 b2, omb2, rbc1, rbc2, eps, eps_root, wd, gs):
    n = param.shape[0]
    nblocks = (n + ca.BLOCK - 1) // ca.BLOCK
    write_bf16 = bf16_out.shape[0] == n
    nruns = min(nblocks, 4 * nthreads)
    for r in prange(nruns):
        sm = np.empty(ca.BLOCK, np.float32)
        sv = np.empty(ca.BLOCK, np.float32)
        si = np.empty(ca.BLOCK, np.uint32)
        for b in range(r * nblocks // nruns, (r + 1) * nblocks // nruns):
            _legacy_block(param, grad, mq, ms, vq, vs, bf16_out, write_bf16, code_s, code_u, tab_s, tab_u, sm, sv,
                          si, b, n, nlr, b1, omb1, b2, omb2, rbc1, rbc2, eps, eps_root, wd, gs)


_LEGACY_TABLES: list[np.ndarray] = []


def legacy_int8_step(param, grad, state, bf16_out, *, lr, b1, b2, eps, eps_root, weight_decay, count,
                     grad_scale=1.0) -> None:
    if not _LEGACY_TABLES:
        _LEGACY_TABLES.extend((_legacy_table(ca.CODE_SIGNED), _legacy_table(ca.CODE_UNSIGNED)))
    with launch:
        _legacy_core(param, grad, state["mu_q"], state["mu_scale"], state["nu_q"], state["nu_scale"],
                     ca._EMPTY_U16 if bf16_out is None else bf16_out, ca.CODE_SIGNED, ca.CODE_UNSIGNED,
                     _LEGACY_TABLES[0], _LEGACY_TABLES[1], numba.get_num_threads(),
                     *ca.adamw_scalars(lr, b1, b2, eps, eps_root, weight_decay, count, grad_scale))


# ------------------------------------------------------------------------------------- harness


def _buffers(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    p, g = alloc_aligned(n), alloc_aligned(n)
    p[:] = rng.standard_normal(n, dtype=np.float32)
    # magnitudes over four decades, as real gradients have, so every part of the int8 code is used
    g[:] = rng.standard_normal(n, dtype=np.float32) * (10.0 ** rng.uniform(-4, 0, n)).astype(np.float32)
    return p, g, alloc_aligned(n, np.uint16)


class _Counter:
    def __init__(self):
        self.c = 0

    def __call__(self) -> int:
        self.c += 1
        return self.c


def make_int8_steps(n):
    """One shared set of buffers for every int8 kernel; each call takes the next step."""
    p, g, out = _buffers(n)
    nb = -(-n // ca.BLOCK)
    st = {"mu_q": alloc_aligned(n, np.uint8), "nu_q": alloc_aligned(n, np.uint8),
          "mu_scale": np.zeros(nb, np.float32), "nu_scale": np.zeros(nb, np.float32)}
    st["mu_q"][:] = 0
    st["nu_q"][:] = 0
    count = _Counter()
    return {"int8": lambda: ca.adamw_int8_step(p, g, st, out, count=count(), **HP),
            "int8-hw": lambda: ca.adamw_int8_step(p, g, st, out, count=count(), gather="hw", **HP),
            "int8-sw": lambda: ca.adamw_int8_step(p, g, st, out, count=count(), gather="sw", **HP),
            "int8-legacy": lambda: legacy_int8_step(p, g, st, out, count=count(), **HP)}


def make_bf16(n):
    p, g, out = _buffers(n)
    st = {"mu_bf16": alloc_aligned(n, np.uint16), "nu_bf16": alloc_aligned(n, np.uint16)}
    st["mu_bf16"][:] = 0
    st["nu_bf16"][:] = 0
    count = _Counter()
    return lambda: ca.adamw_bf16_step(p, g, st, out, count=count(), **HP)


def make_fp32(n):
    p, g, out = _buffers(n)
    opt = FusedAdamW(HP["lr"], b1=HP["b1"], b2=HP["b2"], eps=HP["eps"], weight_decay=HP["weight_decay"])
    st = opt.init_state(p)
    count = _Counter()
    return lambda: opt.update(p, g, st, count(), 1.0, out)


def host_info() -> dict:
    """What decides the kernels' speed: the CPU (and what LLVM makes of it), the threading layer."""
    import llvmlite.binding as llb

    info = {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "numba": numba.__version__, "numba_threads_max": numba.config.NUMBA_NUM_THREADS}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        info["llvm_cpu"] = llb.get_host_cpu_name()
        feats = llb.get_host_cpu_features()
        info["llvm_features"] = sorted(k for k in ("avx2", "fma", "avx512f", "avx512vl", "avx512bw") if feats.get(k))
    except Exception as e:  # noqa: BLE001 - diagnostics only
        info["llvm_cpu"] = f"? ({e})"
    try:
        with open("/sys/devices/system/cpu/vulnerabilities/gather_data_sampling") as f:
            info["gather_data_sampling"] = f.read().strip()  # "Mitigation: Microcode": slow gathers
    except OSError:
        info["gather_data_sampling"] = "?"
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--elements", type=int, default=64 << 20)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--kernels", default="int8-legacy,int8-hw,int8-sw,int8,bf16,fp32",
                    help="comma-separated: int8, int8-hw, int8-sw, int8-legacy, bf16, fp32")
    ap.add_argument("--reps", type=int, default=7, help="timed rounds (the kernels take turns in each)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    threads = [int(t) for t in a.threads.split(",")]
    threads_ok = [t for t in threads if 1 <= t <= numba.config.NUMBA_NUM_THREADS]
    if threads_ok != threads:
        print(f"skipping thread counts above NUMBA_NUM_THREADS={numba.config.NUMBA_NUM_THREADS}: "
              f"{sorted(set(threads) - set(threads_ok))}")
    kernels = a.kernels.split(",")
    steps = {}
    if any(k.startswith("int8") for k in kernels):
        int8 = make_int8_steps(a.elements)
        steps.update({k: int8[k] for k in kernels if k in int8})
    if "bf16" in kernels:
        steps["bf16"] = make_bf16(a.elements)
    if "fp32" in kernels:
        steps["fp32"] = make_fp32(a.elements)
    unknown = [k for k in kernels if k not in steps]
    if unknown:
        ap.error(f"unknown kernels {unknown}")
    info = host_info()
    print(f"{a.elements / 1e6:.1f}M elements; {info}; median and best of {a.reps} rounds after {a.warmup}")
    res: dict[str, dict[str, dict[str, float]]] = {k: {} for k in kernels}
    for t in threads_ok:
        set_num_threads(t)
        for _ in range(a.warmup):
            for k in kernels:
                steps[k]()
        times: dict[str, list[float]] = {k: [] for k in kernels}
        for _ in range(a.reps):
            for k in kernels:
                t0 = time.perf_counter()
                steps[k]()
                times[k].append(time.perf_counter() - t0)
        for k in kernels:
            med, best = a.elements / statistics.median(times[k]) / 1e9, a.elements / min(times[k]) / 1e9
            res[k][str(t)] = {"median": med, "best": best}
            kind = k.split("-")[0]
            print(f"  {k:12s} threads {t:3d}: {med:6.3f} G elem/s median, {best:6.3f} best "
                  f"({med * BYTES[kind]:6.1f} GB/s, {med / t * 1e3:6.1f} M elem/s/thread)", flush=True)
    set_num_threads(None)
    try:
        info["threading_layer"] = numba.threading_layer()  # known once a parallel kernel ran
    except ValueError:
        info["threading_layer"] = "?"
    choice = ca.int8_gather_mode()
    rates = {m: [round(r / 1e9, 3) for r in v] for m, v in ca.int8_gather_rates().items()}
    print(f"\nthreading layer {info['threading_layer']}; int8 auto choice: {choice} "
          f"(G elem/s timed per variant: {rates})")
    print("G elem/s (median) " + "".join(f"{t:>9d}" for t in threads_ok))
    for k in kernels:
        print(f"{k:17s} " + "".join(f"{res[k][str(t)]['median']:9.3f}" for t in threads_ok))
    if a.out:
        doc = {"date": datetime.datetime.now().isoformat(timespec="seconds"), **info,
               "elements": a.elements, "reps": a.reps, "warmup": a.warmup,
               "int8_auto_choice": choice, "int8_auto_rates_g": rates,
               "g_elem_per_s": {k: {t: v["median"] for t, v in r.items()} for k, r in res.items()},
               "g_elem_per_s_best": {k: {t: v["best"] for t, v in r.items()} for k, r in res.items()}}
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
        print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
