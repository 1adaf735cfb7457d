"""One benchmark case through the user's own commands: ``megatrain-jax plan --json`` (the prediction), then
``megatrain-jax train`` in a child process with no hand-set environment variable (the plan sets XLA's budgets
itself), sampling the child's RSS and the machine's used memory from outside. ``experiments/bench_memory_plan.py``
runs cases from its command line; ``bench_gpu_budgets``, ``bench_data_parallel`` and others build theirs.

Reported per case: tokens/s and model TFLOPS (median of the steps after the first two; the second alone where only
two ran), peak host RSS (VmHWM) and peak GPU memory (XLA's ``peak_bytes_in_use``) next to the plan's figures, and
whether the run survived. A case is CONFIG[;key=value;...]; every case adds train.final_checkpoint=false,
model.init=fast (uniform weights with the nnx std, drawn in seconds: the benchmark measures the step, not the
initialiser), train.steps=``args.steps`` and a fresh out_dir.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


def _plan(name: str, config: str, sets: list[str], flags: list[str], env: dict, py: list[str], procs: int) -> dict:
    """The case's record, started with its plan (``megatrain-jax plan --json``)."""
    # a process of a multi-process run plans its own share: its one GPU, and --processes (sharded: 1/N of the store)
    plan_env, plan_extra = (env, []) if procs == 1 else (dict(env, CUDA_VISIBLE_DEVICES="0"), ["--processes", str(procs)])
    plan = subprocess.run(py + ["plan", config, "--json"] + plan_extra + flags, cwd=REPO, env=plan_env,
                          capture_output=True, text=True)
    res = {"case": name, "config": config, "overrides": sets, "plan_rc": plan.returncode}
    try:
        res["plan"] = json.loads(plan.stdout)
    except ValueError:
        res["plan_error"] = (plan.stdout + plan.stderr)[-2000:]
    return res


def _start(py: list[str], config: str, flags: list[str], env: dict, logf, procs: int) -> list[subprocess.Popen]:
    """``procs`` > 1: that many ``train`` processes joined through jax.distributed (MEGATRAIN_*), one GPU each."""
    if procs == 1:
        return [subprocess.Popen(py + ["train", config] + flags, cwd=REPO, env=env, stdout=logf,
                                 stderr=subprocess.STDOUT)]
    port = 12355 + os.getpid() % 1000
    return [subprocess.Popen(py + ["train", config] + flags, cwd=REPO, stdout=logf if i == 0 else subprocess.DEVNULL,
                             stderr=subprocess.STDOUT,
                             env=dict(env, MEGATRAIN_COORDINATOR=f"127.0.0.1:{port}",
                                      MEGATRAIN_NUM_PROCESSES=str(procs), MEGATRAIN_PROCESS_ID=str(i),
                                      CUDA_VISIBLE_DEVICES=str(i))) for i in range(procs)]


def _watch(ps: list[subprocess.Popen], mpath: str, args, t0: float) -> tuple[dict, dict, int]:
    """Sample the processes' memory until they exit (or the case's own end): (peaks, ended, rc)."""
    peak = {"rss_kb": 0, "used_gb": 0.0, "hwm_kb": [0] * len(ps)}
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
    return peak, ended, rc


def _metrics(mpath: str) -> list[dict]:
    recs = []
    if os.path.exists(mpath):
        with open(mpath) as f:
            for x in f:
                try:
                    recs.append(json.loads(x))
                except ValueError:  # a record cut by the case's end
                    pass
    return recs


def _timing(res: dict, recs: list[dict], args) -> None:
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


def _against_plan(res: dict, recs: list[dict], config: str, sets: list[str], procs: int) -> None:
    if recs and procs > 1:  # each process's plan is its own: the largest process's peak (the sum is sampled too)
        res["peak_host_rss_gb"] = max(res["per_process_peak_rss_gb"])
        res["all_processes_peak_rss_gb"] = res["sampled_peak_rss_gb"]
        res["peak_gpu_gb"] = max(r.get("gpu_peak_gb", 0) for r in recs)
    elif recs:
        res["peak_host_rss_gb"] = max(r.get("host_peak_rss_gb", 0) for r in recs)
        res["peak_gpu_gb"] = max(r.get("gpu_peak_gb", 0) for r in recs)
    p = res.get("plan")
    if not (p and recs):
        return
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
    try:  # the case's sequence length and GPU budget (the result fields where they vary)
        from megatrain_jax.config import load_config

        c = load_config(os.path.join(REPO, config), sets)
        res["seq_len"], res["gpu_budget_gb"] = c.data.seq_len, c.train.gpu_memory_gb
        if getattr(c.model, "num_experts", None):  # a mixture of experts: model FLOPs count its active parameters
            res["active_params"], res["total_params"] = c.model.active_params(), c.model.total_params()
            res["plan_binds"] = p["step"].get("binding")
    except Exception:  # noqa: BLE001 (a config the plan read: only a record field is lost)
        pass


def run_case(name: str, spec: str, args, procs: int = 1) -> dict:
    """One case (``spec``: CONFIG[;key=value;...]) with ``args.steps``, ``args.trace`` and ``args.out`` (the
    train log, and with ``trace`` the timelines, go there) and, optionally, ``args.limit_s`` (end the case at
    that wall time) and ``args.end_after_last_step`` (end it that many seconds after its last step's record);
    ended either way, its record still comes back with ``ended_by_bench``. ``procs`` > 1: that many ``train``
    processes joined through jax.distributed, one GPU each (CUDA_VISIBLE_DEVICES), on this machine; RSS is
    sampled for each and summed."""
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
    res = _plan(name, config, sets, flags, env, py, procs)
    used0 = _used_gb()
    t0 = time.perf_counter()
    log_path = os.path.join(args.out, f"train_{name}.log")
    mpath = os.path.join(out_dir, "metrics.jsonl")
    with open(log_path, "w") as logf:
        peak, ended, rc = _watch(_start(py, config, flags, env, logf, procs), mpath, args, t0)
    res.update({"rc": rc, "wall_s": time.perf_counter() - t0, "sampled_peak_rss_gb": peak["rss_kb"] * 1024 / 1e9,
                "per_process_peak_rss_gb": [h * 1024 / 1e9 for h in peak["hwm_kb"]],
                "machine_used_before_gb": used0, "machine_used_peak_gb": peak["used_gb"]})
    if ended:
        res["ended_by_bench"] = ended
    with open(log_path) as f:
        res["log_tail"] = f.read()[-3000:]
    recs = _metrics(mpath)
    res["steps_done"] = len(recs)
    if args.trace:
        for fn in glob.glob(os.path.join(out_dir, "timeline_step*")):
            shutil.copy(fn, os.path.join(args.out, f"{name}_{os.path.basename(fn)}"))
    _timing(res, recs, args)
    _against_plan(res, recs, config, sets, procs)
    return res
