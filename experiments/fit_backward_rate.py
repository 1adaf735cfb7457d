"""Each traced step's matmul rate per phase: the forward, the backward of a block that kept its residuals, and the
backward that recomputes its block's forward (issue 42: the step model's one 600 TFLOP/s rate put the 110B's
recomputing backward at 0.457 s a block where an H200 ran 0.40).

Reads the timeline JSONs ``bench_memory_plan.py --trace`` writes (the "fwd i" / "bwd i" bars of the compute lane)
and each case's plan JSON beside it, counts each phase's FLOPs as the step model does (``plan/step_model.py``: a
forward is 2 per block parameter and token plus the causal attention's 2 x heads x head_dim x seq; a backward twice
that; a recompute once more), takes off the micro-batches' memory passes the model counts apart (its
``MICRO_BATCH_BYTES_PER_PARAM`` at the H200's memory rate), and prints the rates.

    python experiments/fit_backward_rate.py DIR [DIR ...]   (each DIR holding plan_<case>.json and the timeline)
"""
from __future__ import annotations

import glob
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatrain_jax.config import load_config  # noqa: E402
from megatrain_jax.plan.sizes import MICRO_BATCH_BYTES_PER_PARAM  # noqa: E402
from megatrain_jax.plan.step_model import GPU_MEMORY_RATES  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def phases(timeline: dict) -> dict[str, list[tuple[int, float, float]]]:
    """The compute lane's forward and backward bars: (block, seconds, start), in the order they ran."""
    out: dict[str, list[tuple[int, float, float]]] = {"fwd": [], "bwd": []}
    for e in timeline["events"]:
        kind, _, idx = e["label"].partition(" ")
        if e["lane"] == "compute" and kind in out and idx.isdigit():
            out[kind].append((int(idx), e["end"] - e["start"], e["start"]))
    return out


def fit(plan_path: str) -> dict:
    plan = json.load(open(plan_path))
    case = plan["case"]
    timeline = json.load(open(os.path.join(os.path.dirname(plan_path), f"{case}_timeline_step4.json")))
    sets = [s for s in plan["overrides"] if not s.startswith("train.out_dir")]
    cfg = load_config(os.path.join(ROOT, plan["config"]), sets)
    m, dec = cfg.model, plan["decisions"]
    tokens = cfg.train.batch_size * cfg.data.seq_len // max(dec["devices"], 1)
    block = m.block_params()
    fwd_flops = tokens * (2 * block + 2 * m.num_heads * m.dim_per_head * cfg.data.seq_len)
    mem_rate = GPU_MEMORY_RATES["H200"]
    per_param = MICRO_BATCH_BYTES_PER_PARAM  # a streamed fp32 master, bf16 compute (the four cases here)
    mem_fwd = 6.0 / 24.0 * per_param * block * dec["micro_batches"] / mem_rate  # the fp32 master's cast
    mem_bwd = 18.0 / 24.0 * per_param * block * dec["micro_batches"] / mem_rate  # the cast, the accumulation
    bars = phases(timeline)
    n_keep = dec["keep_residuals"]
    layers = m.num_layers
    # the first backward runs from the top block down: the top n_keep blocks kept their residuals
    first_bwd = bars["bwd"][:layers]
    kept = [s for i, s, _ in first_bwd if i >= layers - n_keep]
    recomputed = [s for i, s, _ in first_bwd if i < layers - n_keep]
    # a resweep's second sweep (every block recomputes): its bars close at issue, so block to block, each interval
    # holding that block's device-side update too
    starts = [t for _, _, t in bars["bwd"][layers:]]
    second = [b - a for a, b in zip(starts, starts[1:])]
    fwd = [s for _, s, _ in bars["fwd"][:layers]]

    def rate(times: list[float], flops: float, mem: float) -> float | None:
        return round(flops / (statistics.median(times) - mem) / 1e12, 1) if times else None

    return {"case": case, "device": plan.get("device"), "block_params": block, "tokens": tokens,
            "micro_batches": dec["micro_batches"], "keep_residuals": n_keep, "layers": layers,
            "fwd_s": round(statistics.median(fwd), 4), "fwd_tflops": rate(fwd, fwd_flops, mem_fwd),
            "kept_bwd_s": round(statistics.median(kept), 4) if kept else None,
            "kept_bwd_tflops": rate(kept, 2 * fwd_flops, mem_bwd),
            "recompute_bwd_s": round(statistics.median(recomputed), 4) if recomputed else None,
            "recompute_bwd_tflops": rate(recomputed, 3 * fwd_flops, mem_bwd),
            "second_sweep_interval_s": round(statistics.median(second), 4) if second else None,
            "second_sweep_tflops_with_update": rate(second, 3 * fwd_flops, mem_bwd)}


def main() -> None:
    rows = [fit(p) for d in sys.argv[1:] for p in sorted(glob.glob(os.path.join(d, "plan_*.json")))
            if os.path.exists(os.path.join(d, f"{json.load(open(p))['case']}_timeline_step4.json"))]
    for r in rows:
        print(json.dumps(r))
    rec = [r["recompute_bwd_tflops"] for r in rows if r["recompute_bwd_tflops"]]
    fwd = [r["fwd_tflops"] for r in rows]
    kept = [r["kept_bwd_tflops"] for r in rows if r["kept_bwd_tflops"]]
    print(json.dumps({"fwd_tflops_mean": round(statistics.mean(fwd), 1),
                      "kept_bwd_tflops_mean": round(statistics.mean(kept), 1) if kept else None,
                      "recompute_bwd_tflops_mean": round(statistics.mean(rec), 1),
                      "recompute_over_fwd": round(statistics.mean(rec) / statistics.mean(fwd), 3)}))


if __name__ == "__main__":
    main()
