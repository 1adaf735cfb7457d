"""Training under GPU budgets: 3B, 8B and 14B shapes at 10, 16, 24, 40 GB and the
whole GPU, through the user's own ``megatrain-jax train`` (``bench.runner.run_case``: the plan,
then the run in a child process, RSS sampled from outside, the GPU peak from XLA).

    PYTHONPATH=. python experiments/bench_gpu_budgets.py --out $OUT [--shapes 3b,8b,14b] [--budgets 10,16,24,40,whole]
    PYTHONPATH=. python experiments/bench_gpu_budgets.py --dry [--gpu-gb 80 --host-gb 128]   # plans only (any machine)

Every decision is ``auto`` and clipping is at 1.0; a shape takes int8 moments (and the fp32 master
streamed) where its plan in the configured state does not fit the host. One JSON per case
(``budget_<shape>_<budget>.json``) with ``params``, ``gpu_budget_gb``, ``peak_gpu_gb``,
``plan_gpu_gb``, ``peak_host_rss_gb``, ``plan_host_gb``, ``tokens_per_s``, ``model_tflops``,
``clip_norm``, ``device``, ``date``, the decisions, and the tokens/s against the whole-GPU case of
the same run (``vs_whole``). ``--dry`` writes the same files with the measured fields null.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os

from megatrain_jax.bench.runner import REPO as ROOT, run_case

SHAPES = {  # name: (config, overrides); 16 x 4096 tokens per step each
    "3b": ("configs/3b.yaml", ("train.batch_size=16", "train.micro_batches=auto")),
    "8b": ("configs/llama3.1-8b.yaml", ()),
    "14b": ("configs/qwen2.5-14b.yaml", ()),
}
BUDGETS = ("10", "16", "24", "40", "whole")
COMMON = ("optim.clip_norm=1.0", "train.final_checkpoint=false")
LEANEST = ("optim.moments=int8", "train.stream_copy=device")


def case_sets(shape: str, budget: str, machine=None) -> tuple[str, list[str]]:
    """The config and overrides of one case: the budget, clipping, and int8 moments where the plan
    in the configured state does not fit this machine's (or ``machine``'s) host."""
    from megatrain_jax.config import load_config
    from megatrain_jax.plan import make_plan

    config, sets = SHAPES[shape]
    sets = [*COMMON, *sets] + ([] if budget == "whole" else [f"train.gpu_memory_gb={budget}"])
    p = make_plan(load_config(os.path.join(ROOT, config), sets), machine, _modes=False)
    if not p.fits_host():
        sets += list(LEANEST)
    return config, sets


def dry_case(shape: str, budget: str, machine) -> dict:
    """The plan's figures for one case (nothing runs)."""
    from megatrain_jax.config import load_config
    from megatrain_jax.plan import make_plan

    config, sets = case_sets(shape, budget, machine)
    cfg = load_config(os.path.join(ROOT, config), sets)
    p = make_plan(cfg, machine)
    err = p.verdict()
    tok = cfg.train.batch_size * cfg.data.seq_len
    return {"case": f"{shape}_{budget}", "config": config, "overrides": sets, "params": p.params,
            "gpu_budget_gb": None if budget == "whole" else float(budget), "plan_gpu_gb": (p.gpu_need or 0) / 1e9,
            "plan_host_gb": p.host_need / 1e9, "plan_step_s": p.step["predicted_step_s"],
            "plan_tokens_per_s": tok / p.step["predicted_step_s"], "fits": err is None,
            "refusal": None if err is None else str(err), "decisions": p.decisions,
            "peak_gpu_gb": None, "peak_host_rss_gb": None, "tokens_per_s": None, "model_tflops": None,
            "clip_norm": 1.0}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--budgets", default=",".join(BUDGETS))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--dry", action="store_true", help="plan only (no GPU needed)")
    ap.add_argument("--gpu-gb", type=float, default=None, help="--dry: the GPU to plan for (default: this one)")
    ap.add_argument("--host-gb", type=float, default=None, help="--dry: the host to plan for (default: this one)")
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "experiments", "results")))
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    shapes, budgets = a.shapes.split(","), a.budgets.split(",")
    date = datetime.date.today().isoformat()
    rows = []
    if a.dry:
        from megatrain_jax.plan import target_machine

        machine = target_machine(gpu_memory_gb=a.gpu_gb, host_memory_gb=a.host_gb, cpu_cores=16) \
            if (a.gpu_gb or a.host_gb) else None
        device = f"planned for {a.gpu_gb or 'this'} GB GPU, {a.host_gb or 'this'} GB host (dry)"
        for s in shapes:
            for b in budgets:
                r = dry_case(s, b, machine)
                r.update({"device": device, "date": date})
                rows.append(r)
    else:
        import jax

        device = jax.devices()[0].device_kind
        del jax
        for s in shapes:
            whole = None
            for b in sorted(budgets, key=lambda x: x != "whole"):  # the whole GPU first: the reference
                config, sets = case_sets(s, b)
                spec = ";".join([config, *sets])
                r = run_case(f"{s}_{b}", spec, argparse.Namespace(steps=a.steps, trace=False, out=a.out))
                r.update({"params": (r.get("plan") or {}).get("params"), "clip_norm": 1.0, "device": device,
                          "date": date, "gpu_budget_gb": None if b == "whole" else float(b)})
                for k in ("peak_gpu_gb", "plan_gpu_gb", "peak_host_rss_gb", "plan_host_gb", "tokens_per_s",
                          "model_tflops"):
                    r.setdefault(k, None)
                if b == "whole":
                    whole = r.get("tokens_per_s")
                r["vs_whole"] = r["tokens_per_s"] / whole if (whole and r.get("tokens_per_s")) else None
                r.pop("plan", None)  # the plan's JSON is large; its figures are above
                rows.append(r)
    for r in rows:
        with open(os.path.join(a.out, f"budget_{r['case']}.json"), "w") as f:
            json.dump(r, f, indent=1, default=str)
    print("case | fits | params B | budget | plan GPU | peak GPU | plan host | peak RSS | tok/s (plan) | vs whole | "
          "decisions")
    for r in rows:
        d = r.get("decisions") or {}
        dec = (f"M={d.get('micro_batches')} act={d.get('activations')} k={d.get('boundary_every')} "
               f"hold={d.get('grad_hold')}+{d.get('grad_hold_gpu_groups')} io={d.get('stream_io')} "
               f"chunk={d.get('loss_chunk')} upd={d.get('update_on')}")
        tps = r.get("tokens_per_s") or r.get("plan_tokens_per_s") or 0
        print(f"{r['case']} | {r.get('fits', r.get('rc') == 0)} | {(r.get('params') or 0) / 1e9:.2f} | "
              f"{r['gpu_budget_gb'] or 'whole'} | {r.get('plan_gpu_gb') or 0:.1f} | {r.get('peak_gpu_gb') or 0:.1f} | "
              f"{r.get('plan_host_gb') or 0:.1f} | {r.get('peak_host_rss_gb') or 0:.1f} | {tps:,.0f} | "
              f"{r.get('vs_whole') or 0:.2f} | {dec}")
    return rows
