"""Data parallel over the GPUs of one host, through the user's own command (issues 16, 45).

For each model and each GPU count N of ``--gpus`` (default 1,2,4): ``megatrain-jax train`` in one process on N GPUs
(``train.devices=N``)
- weak scaling (``--runs weak``): the per-GPU batch on each GPU (N x BATCH_PER_GPU sequences a step);
- strong scaling (``--runs strong``): the same step for every N (max(--gpus) x BATCH_PER_GPU sequences), the
  global batch a user keeps when adding GPUs;
- processes (``--runs procs``): N processes x 1 GPU joined through jax.distributed (the README's multi-host launch,
  one ``CUDA_VISIBLE_DEVICES`` each), weak, for N > 1.
Each result carries ``params``, ``tokens_per_s``, ``model_tflops``, ``peak_host_rss_gb``, ``processes``, ``devices``,
``scaling`` (tokens/s over the one-GPU run of the same kind in the same call), ``scaling_kind``, and the plan's
figures; a process run also ``over_one_process`` (over the one-process run of the same N).

    PYTHONPATH=. python experiments/bench_data_parallel.py --out $OUT --gpus 1,2,4 --runs weak,strong,procs \\
        --model "qwen7b_b128=configs/qwen2.5-7b.yaml;128"

A model is NAME=CONFIG;BATCH_PER_GPU[;key=value...]; extra settings go to every run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatrain_jax.bench.runner import run_case  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--host-gb", type=float, default=240.0,
                    help="train.host_memory_gb for the one-process runs (the machine's MemTotal grows as it is used); "
                         "each of N processes gets 1/N")
    ap.add_argument("--gpus", default="1,2,4", help="GPU counts, one process each (and procs: N processes)")
    ap.add_argument("--runs", default="weak,strong,procs", help="which of weak, strong, procs")
    ap.add_argument("--trace", action="store_true", help="record each run's last step's timeline (train.trace_step; "
                    "copied to --out, left out of the timed median)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import jax

    meta = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind,
            "gpus": len(jax.devices()), "jax": jax.__version__, "host_cores": os.cpu_count(),
            "command": " ".join(sys.argv)}
    del jax
    gpus = sorted({int(x) for x in args.gpus.split(",")})
    kinds = args.runs.split(",")
    for item in args.model:
        name, _, spec = item.partition("=")
        config, batch, *extra = [x for x in spec.split(";") if x]
        b, top = int(batch), max(gpus)
        runs = {}  # run name -> (settings, processes, kind, gpus)
        for n in gpus:
            host = f"train.host_memory_gb={args.host_gb}"
            if "weak" in kinds:
                runs[f"weak{n}"] = (f"train.devices={n};train.batch_size={n * b};{host}", 1, "weak", n)
            if "strong" in kinds:
                runs[f"strong{n}"] = (f"train.devices={n};train.batch_size={top * b};{host}", 1, "strong", n)
            if "procs" in kinds and n > 1:
                runs[f"procs{n}"] = (f"train.batch_size={n * b};train.host_memory_gb={args.host_gb / n}", n, "weak", n)
        res = {}
        for run, (sets, procs, kind, n) in runs.items():
            case = f"{name}_{run}"
            r = run_case(case, ";".join([config, *extra, *sets.split(";")]), args, procs=procs)
            r.update(meta, processes=procs, devices=n, scaling_kind=kind)
            r["params"] = (r.get("plan") or {}).get("params")
            res[run] = r
            print(f"{case}: rc {r['rc']} tok/s {r.get('tokens_per_s', 0):,.0f} TFLOPS {r.get('model_tflops', 0):.0f} "
                  f"RSS {r.get('peak_host_rss_gb', 0):.1f} GB GPU {r.get('peak_gpu_gb', 0):.1f} GB "
                  f"(plan {r.get('plan_gpu_gb', 0):.1f}) decisions {r.get('decisions')}", flush=True)
            if r["rc"]:
                print(r["log_tail"][-1500:], flush=True)
        for run, r in res.items():
            base = res.get(f"{r['scaling_kind']}1", {}).get("tokens_per_s")
            if base and r.get("tokens_per_s"):
                r["scaling"] = r["tokens_per_s"] / base
            one = res.get(f"weak{r['devices']}", {}).get("tokens_per_s")
            if run.startswith("procs") and one and r.get("tokens_per_s"):
                r["over_one_process"] = r["tokens_per_s"] / one
            with open(os.path.join(args.out, f"dp_{name}_{run}.json"), "w") as f:
                json.dump(r, f, indent=1, default=str)
        print(name, {run: {k: r.get(k) for k in ("tokens_per_s", "model_tflops", "peak_host_rss_gb", "scaling",
                                                 "over_one_process")} for run, r in res.items()}, flush=True)


if __name__ == "__main__":
    main()
