"""Streamed-training throughput on one GPU, next to the floors it cannot beat.

For each model size (Llama shapes from configs/): tokens/s; model TFLOPS (6 x non-embedding
parameters x tokens / step time) with and without attention FLOPs; peak GPU and host memory; the
step time next to its floor terms (compute at the measured matmul rate, host->GPU bytes at the
measured bandwidth, optimizer elements at the measured kernel rate); and, from one traced step, the
exposed (non-overlapped) time of each stage. ``--reference`` adds the in-memory reference trainer
(same per-block rematerialisation, same chunked loss) for sizes that fit, as a ratio.

    PYTHONPATH=. python experiments/bench_throughput.py --sizes 1b,7b --trace --out $OUT

Synthetic random tokens: data loading is not part of what this measures.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import socket
import statistics
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from megatrain_jax.config import load_config  # noqa: E402
from megatrain_jax.engine import Batch, StreamedTrainer  # noqa: E402
from megatrain_jax.metrics import attention_flops_per_token, model_flops_per_token  # noqa: E402
from megatrain_jax.models.llama import init_host_store, init_model  # noqa: E402
from megatrain_jax.optim import build_host_optimizer, build_reference_tx  # noqa: E402
from megatrain_jax.optim.host import FusedAdamW, alloc_aligned  # noqa: E402
from megatrain_jax.transfer import Transfers  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def log(*a):
    print(*a, flush=True)


def host_rss_gb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1e6
    return float("nan")


class PeakRSS:
    """Samples VmRSS in a thread (ru_maxrss misses nothing but never resets)."""

    def __init__(self):
        self.peak, self._stop = 0.0, False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop:
            self.peak = max(self.peak, host_rss_gb())
            time.sleep(0.05)

    def reset(self):
        self.peak = host_rss_gb()

    def stop(self):
        self._stop = True


# ------------------------------------------------------------------------------ ceilings


def measure_ceilings(dev) -> dict:
    """Matmul rate, host->GPU and GPU->host bandwidth, host AdamW rate: the floors' denominators."""
    out = {}
    k = 8192 if dev.platform == "gpu" else 1024  # a CPU run is a smoke test of this script
    a = jax.random.normal(jax.random.key(0), (k, k), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (k, k), jnp.bfloat16)
    mm = jax.jit(lambda x, y: x @ y)
    for _ in range(30):  # long enough for the clocks to settle: 10 cold reps read 495-686 TFLOP/s
        mm(a, b).block_until_ready()
    ts = []
    for _ in range(20):
        t = time.perf_counter()
        mm(a, b).block_until_ready()
        ts.append(time.perf_counter() - t)
    out["matmul_bf16_tflops"] = 2 * k ** 3 / statistics.median(ts) / 1e12
    del a, b

    x = Transfers(dev)
    nbytes = 1 << 30 if dev.platform == "gpu" else 1 << 26
    buf = alloc_aligned(nbytes // 2, np.uint16)
    buf[:] = 1
    x.register("probe", buf)
    import ml_dtypes

    view = buf.view(ml_dtypes.bfloat16)
    x.to_device("probe", view).block_until_ready()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        x.to_device("probe", view).block_until_ready()
        ts.append(time.perf_counter() - t)
    out["h2d_gbps"] = nbytes / statistics.median(ts) / 1e9
    out["transfer_mode"] = x.mode
    d = jax.device_put(view, dev)
    x.to_host(d).block_until_ready()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        x.to_host(d).block_until_ready()
        ts.append(time.perf_counter() - t)
    out["d2h_gbps"] = nbytes / statistics.median(ts) / 1e9
    del d
    x.close()  # unregister before the buffer is freed: its address range may be reused

    n = 1 << 27 if dev.platform == "gpu" else 1 << 23
    opt = FusedAdamW(1e-4, weight_decay=0.01)
    p = alloc_aligned(n, np.float32)
    p[:] = 1.0
    g = alloc_aligned(n, np.float32)
    g[:] = 0.01
    st = opt.init_state(p)
    bits = alloc_aligned(n, np.uint16)
    opt.update(p, g, st, 1, 1.0, bits)
    ts = []
    for c in range(2, 6):
        t = time.perf_counter()
        opt.update(p, g, st, c, 1.0, bits)
        ts.append(time.perf_counter() - t)
    out["adamw_gelem_per_s"] = n / statistics.median(ts) / 1e9
    out["host_cores"] = os.cpu_count()
    return out


# ------------------------------------------------------------------------------ one size


def random_batch(rng, b, s, vocab):
    toks = rng.integers(0, vocab, (b, s + 1), dtype=np.int64).astype(np.int32)
    return Batch(toks[:, :-1], toks[:, 1:])


def bench_size(size: str, args, ceil: dict, rss: PeakRSS) -> dict:
    overrides = [f"data.seq_len={args.seq}", f"train.batch_size={args.batch}", f"train.micro_batches={args.micro}",
                 "train.compute_dtype=bfloat16", f"train.loss_chunk={args.loss_chunk}"]
    if args.no_clip:
        overrides.append("optim.clip_norm=null")
    cfg = load_config(os.path.join(HERE, "..", "configs", f"{size}.yaml"), overrides)
    m, t = cfg.model, cfg.train
    tokens = t.batch_size * cfg.data.seq_len
    log(f"== {size}: {m.total_params() / 1e9:.2f}B params, {tokens} tokens/step "
        f"({t.batch_size} x {cfg.data.seq_len}, {t.micro_batches} micro-batches)")
    dev = jax.devices()[0]
    t0 = time.perf_counter()
    parts, store = init_host_store(m, 0, bf16_stream=True)
    init_s = time.perf_counter() - t0
    st = StreamedTrainer(parts, build_host_optimizer(cfg.optim, 1000), compute_dtype="bfloat16",
                         micro_batches=t.micro_batches, clip_norm=cfg.optim.clip_norm, loss_chunk=t.loss_chunk,
                         store=store, skip_nonfinite=False)
    log(f"   host store {store.nbytes() / 1e9:.1f} GB initialised in {init_s:.0f}s; transfers: {st.xfer.describe()}")
    rng = np.random.default_rng(0)
    batches = [random_batch(rng, t.batch_size, cfg.data.seq_len, m.vocab_size) for _ in range(2)]
    rss.reset()
    for i in range(args.warmup):
        r = st.step(batches[i % 2])
        log(f"   warmup {i}: loss {r.loss:.3f}")
    times = []
    st.updates.wait_s = 0.0
    for i in range(args.steps):
        t0 = time.perf_counter()
        r = st.step(batches[i % 2])
        times.append(time.perf_counter() - t0)
        log(f"   step {i}: {times[-1]:.3f}s loss {r.loss:.3f}")
    step_s = statistics.median(times)
    wait_s = st.updates.wait_s / max(args.steps, 1)
    mem = dev.memory_stats() or {}

    P = store.num_params()
    fpt = model_flops_per_token(m)
    attn = attention_flops_per_token(m, cfg.data.seq_len)
    hw_flops = tokens * (8 * m.non_embedding_params() + 8 * m.vocab_size * m.hidden_size
                         + 4.0 / 6.0 * attn)  # fwd + recompute + bwd, head recomputed by the chunked loss
    floors = {
        "compute_s": hw_flops / (ceil["matmul_bf16_tflops"] * 1e12),
        "h2d_s": 2 * 2 * P / (ceil["h2d_gbps"] * 1e9),
        "d2h_s": 4 * P / (ceil["d2h_gbps"] * 1e9),
        "optimizer_s": P / (ceil["adamw_gelem_per_s"] * 1e9),
    }
    res = {
        "size": size, "params": P, "non_embedding_params": m.non_embedding_params(), "tokens_per_step": tokens,
        "seq_len": cfg.data.seq_len, "batch": t.batch_size, "micro_batches": t.micro_batches,
        "clip_norm": cfg.optim.clip_norm, "step_s_median": step_s, "step_s_all": times,
        "tokens_per_s": tokens / step_s, "model_tflops": fpt * tokens / step_s / 1e12,
        "model_tflops_with_attention": (fpt + attn) * tokens / step_s / 1e12,
        "peak_gpu_gb": mem.get("peak_bytes_in_use", 0) / 1e9, "host_store_gb": store.nbytes() / 1e9,
        "peak_host_rss_gb": rss.peak, "floors": floors, "largest_floor_s": max(floors.values()),
        "step_over_largest_floor": step_s / max(floors.values()),
        "dispatch_thread_waited_for_optimizer_s": wait_s, "offload_activations": st.last_step_info.get("offload_activations"),
        "transfer": st.xfer.describe(), "init_s": init_s,
    }
    log(f"   -> {step_s:.3f}s/step, {res['tokens_per_s']:,.0f} tok/s, {res['model_tflops']:.0f} model TFLOPS "
        f"({res['model_tflops_with_attention']:.0f} with attention), peak GPU {res['peak_gpu_gb']:.1f} GB, "
        f"floors {({k: round(v, 3) for k, v in floors.items()})}")

    if args.trace:
        from megatrain_jax.trace import Tracer, exposed_times, plot_timeline

        # steady state: the previous step's deferred updates are still queued when this one starts
        st.tracer = Tracer()
        t0 = time.perf_counter() - st.tracer.t0
        st.step(batches[0])
        jax.block_until_ready(jax.device_put(0))
        t1 = time.perf_counter() - st.tracer.t0  # the step's own deferred updates come after t1
        st.finish()
        events = st.tracer.close()
        st.tracer = None
        res["exposed_s"] = exposed_times(events, t0, t1)
        res["traced_step_s"] = t1 - t0
        res["trace_note"] = ("window = one step in steady state; the optimizer bars after it are that "
                             "step's own deferred updates, which overlap the next step's forward")
        png = os.path.join(args.out, f"timeline_{size}.png")
        plot_timeline(events, png, f"{size}: one streamed step ({tokens} tokens, {t.micro_batches} micro-batches)")
        with open(os.path.join(args.out, f"timeline_{size}.json"), "w") as f:
            json.dump(events, f)
        log(f"   exposed: {({k: round(v, 3) for k, v in res['exposed_s'].items()})}; plot {png}")
    if not args.trace:
        st.finish()
    st.close()
    del st, store, parts

    if args.reference and args.case in args.reference.split(","):
        res["reference"] = bench_reference(cfg, args, batches)
        res["streamed_over_reference"] = res["reference"]["step_s_median"] / step_s
        log(f"   reference: {res['reference']['step_s_median']:.3f}s/step -> streamed/reference throughput "
            f"{res['streamed_over_reference']:.3f}")
    return res


def bench_reference(cfg, args, batches) -> dict:
    from megatrain_jax.reference import ReferenceTrainer

    model = init_model(cfg.model, 0)
    ref = ReferenceTrainer(model, build_reference_tx(cfg.optim, 1000), compute_dtype="bfloat16", remat=True,
                           loss_chunk=cfg.train.loss_chunk)
    del model
    for i in range(args.warmup):
        ref.step(batches[i % 2])
    times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        ref.step(batches[i % 2])
        times.append(time.perf_counter() - t0)
    out = {"step_s_median": statistics.median(times), "step_s_all": times}
    del ref
    return out


def parse_case(case: str, args) -> argparse.Namespace:
    """``7b``, ``7b:b32``, ``7b:b32:m8:noclip`` -> per-case settings (batch, micro-batches, clipping)."""
    size, *opts = case.split(":")
    a = argparse.Namespace(**vars(args))
    a.size, a.case = size, case
    for o in opts:
        if o == "noclip":
            a.no_clip = True
        elif o.startswith("b"):
            a.batch = int(o[1:])
        elif o.startswith("m"):
            a.micro = int(o[1:])
        else:
            raise SystemExit(f"unknown case option {o!r} in {case!r}")
    return a


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1b,3b,7b", help="cases: SIZE[:bN][:mN][:noclip], comma-separated")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=16, help="sequences per optimizer step")
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--loss-chunk", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-clip", action="store_true", help="no global-norm clipping (updates overlap the backward)")
    ap.add_argument("--reference", default="", help="sizes also run with the in-memory reference trainer, e.g. 1b")
    ap.add_argument("--trace", action="store_true", help="write a per-layer timeline PNG of one step")
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(HERE, "results")))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cases = args.sizes.split(",")
    if not args.child:
        # one process per case: every size starts from an empty host (a 7B store is 94 GB)
        import subprocess

        for case in cases:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--sizes", case] + \
                  [x for k, v in vars(args).items() if k not in ("sizes", "child", "no_clip", "trace")
                   for x in (f"--{k.replace('_', '-')}", str(v))] + \
                  (["--no-clip"] if args.no_clip else []) + (["--trace"] if args.trace else [])
            rc = subprocess.call(cmd)
            if rc:
                log(f"   {case}: child exited with {rc}")
        summarize(args.out, cases)
        return
    dev = jax.devices()[0]
    log(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, host cores {os.cpu_count()}")
    rss = PeakRSS()
    ceil = measure_ceilings(dev)
    log(f"ceilings: {ceil}")
    case = parse_case(cases[0], args)
    res = {"date": datetime.date.today().isoformat(), "device": dev.device_kind, "host": socket.gethostname(),
           "jax": jax.__version__, "ceilings": ceil, "case": case.case}
    try:
        res.update(bench_size(case.size, case, ceil, rss))
    except Exception as e:  # noqa: BLE001 - record the failure
        log(f"   {case.case} failed: {type(e).__name__}: {str(e)[:400]}")
        res["error"] = f"{type(e).__name__}: {str(e)[:1000]}"
    rss.stop()
    with open(os.path.join(args.out, f"bench_{case.case.replace(':', '_')}.json"), "w") as f:
        json.dump(res, f, indent=1)


def summarize(out_dir: str, cases: list[str]) -> None:
    rows = []
    for case in cases:
        path = os.path.join(out_dir, f"bench_{case.replace(':', '_')}.json")
        if os.path.exists(path):
            with open(path) as f:
                rows.append(json.load(f))
    log("\ncase  tokens/step  step_s  tok/s  model_TFLOPS  +attn  peakGPU_GB  hostRSS_GB  step/floor  vs_reference")
    for r in rows:
        if "error" in r:
            log(f"{r['case']}  failed: {r['error'][:100]}")
            continue
        log(f"{r['case']}  {r['tokens_per_step']}  {r['step_s_median']:.3f}  {r['tokens_per_s']:,.0f}  "
            f"{r['model_tflops']:.0f}  {r['model_tflops_with_attention']:.0f}  {r['peak_gpu_gb']:.1f}  "
            f"{r['peak_host_rss_gb']:.1f}  {r['step_over_largest_floor']:.2f}  "
            f"{r.get('streamed_over_reference', float('nan')):.3f}")
        if "exposed_s" in r:
            log(f"      exposed: {({k: round(v, 3) for k, v in r['exposed_s'].items()})}  floors: "
                f"{({k: round(v, 3) for k, v in r['floors'].items()})}")


if __name__ == "__main__":
    main()
