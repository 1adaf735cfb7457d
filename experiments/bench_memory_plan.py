"""The memory plan against what the trainer really uses, through the user's own command.

For each case: ``megatrain-jax plan --json`` (the prediction), then ``megatrain-jax train`` in a
child process with no hand-set environment variable (the plan sets XLA's budgets itself), sampling
the child's RSS and the machine's used memory from outside. Reported per case: tokens/s and model
TFLOPS (median of the steps after the first two; the second alone where only two ran), peak host RSS (VmHWM) and peak GPU memory
(XLA's ``peak_bytes_in_use``) next to the plan's figures, and whether the run survived.

    PYTHONPATH=. python experiments/bench_memory_plan.py --out $OUT \\
        --case 7b_b16=configs/7b.yaml --case "7b_b32=configs/7b.yaml;train.batch_size=32"

A case is NAME=CONFIG[;key=value;...]. Every case adds train.final_checkpoint=false,
model.init=fast (uniform weights with the nnx std, drawn in seconds: the benchmark measures the
step, not the initialiser), train.steps=--steps and a fresh out_dir.

``--end-after-last-step S`` ends a case S seconds after its last step's record if the process has not exited by
then (a 110B run takes ~150 s to give its 500 GB back: device time that measures nothing); ``--limit-s`` ends a case
at that wall time. Either way the case's JSON is still written, from the steps it recorded, with ``ended_by_bench``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _status_kb(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _used_gb() -> float:
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, _, v = line.partition(":")
            info[k] = int(v.split()[0])
    return (info["MemTotal"] - info["MemAvailable"]) * 1024 / 1e9


def _records(path: str) -> int:
    try:
        with open(path) as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


def run_case(name: str, spec: str, args, procs: int = 1) -> dict:
    """``procs`` > 1: that many ``train`` processes joined through jax.distributed (MEGATRAIN_*), one GPU
    each (CUDA_VISIBLE_DEVICES), on this machine; RSS is sampled for each and summed."""
    config, *sets = [x for x in spec.split(";") if x]
    out_dir = tempfile.mkdtemp(prefix=f"bench_{name}_")
    sets = sets + ["train.final_checkpoint=false", "model.init=fast", f"train.steps={args.steps}",
                   "optim.schedule.kind=constant", "optim.schedule.warmup_steps=0",
                   f"train.out_dir={out_dir}", "train.log_every=1"]
    if args.trace:  # the last step records its timeline; it is left out of the timed median
        sets.append(f"train.trace_step={args.steps}")
    flags = [x for s in sets for x in ("--set", s)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    py = [sys.executable, "-m", "megatrain_jax"]
    # a process of a multi-process run plans its own share: its one GPU, and --processes (sharded: 1/N of the store)
    plan_env, plan_extra = (env, []) if procs == 1 else (dict(env, CUDA_VISIBLE_DEVICES="0"), ["--processes", str(procs)])
    plan = subprocess.run(py + ["plan", config, "--json"] + plan_extra + flags, cwd=ROOT, env=plan_env,
                          capture_output=True, text=True)
    res = {"case": name, "config": config, "overrides": sets, "plan_rc": plan.returncode}
    try:
        res["plan"] = json.loads(plan.stdout)
    except ValueError:
        res["plan_error"] = (plan.stdout + plan.stderr)[-2000:]
    used0 = _used_gb()
    t0 = time.perf_counter()
    log_path = os.path.join(args.out, f"train_{name}.log")
    with open(log_path, "w") as logf:
        if procs == 1:
            ps = [subprocess.Popen(py + ["train", config] + flags, cwd=ROOT, env=env, stdout=logf,
                                   stderr=subprocess.STDOUT)]
        else:
            port = 12355 + os.getpid() % 1000
            ps = [subprocess.Popen(py + ["train", config] + flags, cwd=ROOT, stdout=logf if i == 0 else subprocess.DEVNULL,
                                   stderr=subprocess.STDOUT,
                                   env=dict(env, MEGATRAIN_COORDINATOR=f"127.0.0.1:{port}",
                                            MEGATRAIN_NUM_PROCESSES=str(procs), MEGATRAIN_PROCESS_ID=str(i),
                                            CUDA_VISIBLE_DEVICES=str(i))) for i in range(procs)]
        peak = {"rss_kb": 0, "used_gb": 0.0, "hwm_kb": [0] * len(ps)}
        mpath = os.path.join(out_dir, "metrics.jsonl")
        ended = {}

        def end(why: str) -> None:  # the case's own end: every process of the run, at once
            ended.update(why=why, at_s=time.perf_counter() - t0)
            for q in ps:
                if q.poll() is None:
                    q.send_signal(signal.SIGKILL)

        # callers with their own options (bench_data_parallel, bench_gpu_budgets) may lack the case-ending ones
        limit_s, end_after = getattr(args, "limit_s", None), getattr(args, "end_after_last_step", None)

        def sample():
            last_step_at = None
            while any(q.poll() is None for q in ps):
                if not ended and limit_s and time.perf_counter() - t0 > limit_s:
                    end(f"the case's wall limit ({limit_s:.0f} s)")
                if not ended and end_after is not None:
                    if last_step_at is None and _records(mpath) >= args.steps:
                        last_step_at = time.perf_counter()
                    if last_step_at is not None and time.perf_counter() - last_step_at > end_after:
                        end(f"{end_after:.0f} s after the last step's record, the process still exiting")
                peak["rss_kb"] = max(peak["rss_kb"], sum(_status_kb(q.pid, "VmRSS:") for q in ps))
                # each process's own peak: the kernel's high-water mark, read while it lives
                peak["hwm_kb"] = [max(h, _status_kb(q.pid, "VmHWM:")) for h, q in zip(peak["hwm_kb"], ps)]
                peak["used_gb"] = max(peak["used_gb"], _used_gb())
                time.sleep(0.1)

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        while any(q.poll() is None for q in ps):  # (once the bench has ended a case, its teardown is not waited
            if ended and time.perf_counter() - t0 - ended["at_s"] > 5:  # for: a 500 GB process takes minutes)
                break
            time.sleep(0.2)
        rc = max(9 if q.returncode is None else abs(q.returncode) for q in ps)
        th.join(timeout=1)
    res.update({"rc": rc, "wall_s": time.perf_counter() - t0, "sampled_peak_rss_gb": peak["rss_kb"] * 1024 / 1e9,
                "per_process_peak_rss_gb": [h * 1024 / 1e9 for h in peak["hwm_kb"]],
                "machine_used_before_gb": used0, "machine_used_peak_gb": peak["used_gb"]})
    if ended:
        res["ended_by_bench"] = ended
    with open(log_path) as f:
        tail = f.read()[-3000:]
    res["log_tail"] = tail
    recs = []
    if os.path.exists(mpath):
        with open(mpath) as f:
            for x in f:
                try:
                    recs.append(json.loads(x))
                except ValueError:  # a record cut by the case's end
                    pass
    res["steps_done"] = len(recs)
    if args.trace:
        import glob
        import shutil

        for fn in glob.glob(os.path.join(out_dir, "timeline_step*")):
            shutil.copy(fn, os.path.join(args.out, f"{name}_{os.path.basename(fn)}"))
    if len(recs) > 1:  # steps after the first two (after the first where only two ran: long sequences)
        later = recs[2:] if len(recs) > 2 else recs[1:]
        timed = [r for r in later if not (args.trace and r["step"] == args.steps)] or later
        res["timed_steps"] = [r["step"] for r in timed]
        step_s = statistics.median(r["step_time_s"] for r in timed)
        tokens = recs[0]["tokens_per_s"] * recs[0]["step_time_s"]
        res.update({"step_s_median": step_s, "step_s_all": [r["step_time_s"] for r in recs],
                    "tokens_per_s": tokens / step_s,
                    "model_tflops": statistics.median(r["model_tflops"] for r in timed),
                    "model_tflops_with_attention": statistics.median(r["model_tflops_with_attention"] for r in timed),
                    "losses": [r["loss"] for r in recs]})
    if recs and procs > 1:  # each process's plan is its own: the largest process's peak (the sum is sampled too)
        res["peak_host_rss_gb"] = max(res["per_process_peak_rss_gb"])
        res["all_processes_peak_rss_gb"] = res["sampled_peak_rss_gb"]
        res["peak_gpu_gb"] = max(r.get("gpu_peak_gb", 0) for r in recs)
    elif recs:
        res["peak_host_rss_gb"] = max(r.get("host_peak_rss_gb", 0) for r in recs)
        res["peak_gpu_gb"] = max(r.get("gpu_peak_gb", 0) for r in recs)
    p = res.get("plan")
    if p and recs:
        params = p.get("params") or p.get("base_params") or (recs[0].get("params") if recs else None) \
            or int(recs[0]["model_tflops"] * 1e12 / (6 * recs[0]["tokens_per_s"]))  # LoRA: counted over the base
        res["host_bytes_per_param_measured"] = res["peak_host_rss_gb"] * 1e9 / params
        res["params"] = params
        res["plan_host_gb"] = p["host_need"] / 1e9
        res["plan_gpu_gb"] = (p["gpu_need"] or 0) / 1e9
        res["host_plan_over_measured"] = res["plan_host_gb"] / max(res["peak_host_rss_gb"], 1e-9)
        res["gpu_plan_over_measured"] = res["plan_gpu_gb"] / max(res["peak_gpu_gb"], 1e-9)
        res["decisions"] = p["decisions"]
        res["host_limit_gb"], res["cores"] = p["host_limit"] / 1e9, os.cpu_count()
        res["plan_step_s"] = p["step"]["predicted_step_s"]
        res["step_plan_over_measured"] = res["plan_step_s"] / res["step_s_median"] if "step_s_median" in res else None
        try:  # the case's sequence length and GPU budget (the brief's result fields where they vary)
            from megatrain_jax.config import load_config

            c = load_config(os.path.join(ROOT, config), sets)
            res["seq_len"], res["gpu_budget_gb"] = c.data.seq_len, c.train.gpu_memory_gb
        except Exception:  # noqa: BLE001 (a config the plan read: only a record field is lost)
            pass
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", required=True, help="NAME=CONFIG[;key=value;...]")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--trace", action="store_true", help="record the last step's per-layer timeline (train.trace_step); "
                    "that step is left out of the median")
    ap.add_argument("--end-after-last-step", type=float, default=None, metavar="S",
                    help="end a case S seconds after its last step's record if it has not exited")
    ap.add_argument("--limit-s", type=float, default=None, help="end a case at this wall time (its JSON still written)")
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(HERE, "results")))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import jax  # only to name the device in the results (the children start their own backends)

    dev = jax.devices()[0]
    meta = {"date": datetime.date.today().isoformat(), "device": dev.device_kind, "jax": jax.__version__,
            "host_cores": os.cpu_count(), "command": " ".join(sys.argv)}
    del jax, dev
    rows = []
    for item in args.case:
        name, _, spec = item.partition("=")
        print(f"== {name}: {spec}", flush=True)
        r = run_case(name, spec, args)
        r.update(meta)
        with open(os.path.join(args.out, f"plan_{name}.json"), "w") as f:
            json.dump(r, f, indent=1, default=str)
        rows.append(r)
        print(f"   rc {r['rc']}, steps {r['steps_done']}, step {r.get('step_s_median', float('nan')):.3f}s, "
              f"tok/s {r.get('tokens_per_s', 0):,.0f}, TFLOPS {r.get('model_tflops', 0):.0f}, "
              f"RSS {r.get('peak_host_rss_gb', 0):.1f} GB (plan {r.get('plan_host_gb', 0):.1f}), "
              f"GPU {r.get('peak_gpu_gb', 0):.1f} GB (plan {r.get('plan_gpu_gb', 0):.1f}), "
              f"{r.get('host_bytes_per_param_measured', 0):.2f} B/param; decisions {r.get('decisions')}", flush=True)
        if r["rc"]:
            print(r["log_tail"][-1500:], flush=True)
    print("\ncase | rc | step s | tok/s | TFLOPS | +attn | RSS GB (plan) | GPU GB (plan) | B/param")
    for r in rows:
        print(f"{r['case']} | {r['rc']} | {r.get('step_s_median', float('nan')):.3f} | {r.get('tokens_per_s', 0):,.0f} | "
              f"{r.get('model_tflops', 0):.0f} | {r.get('model_tflops_with_attention', 0):.0f} | "
              f"{r.get('peak_host_rss_gb', 0):.1f} ({r.get('plan_host_gb', 0):.1f}) | "
              f"{r.get('peak_gpu_gb', 0):.1f} ({r.get('plan_gpu_gb', 0):.1f}) | "
              f"{r.get('host_bytes_per_param_measured', 0):.2f}")


if __name__ == "__main__":
    main()
