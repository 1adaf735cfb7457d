"""The plan's table for the 70-123B size class on one GPU of the 512 GiB and 560 GiB machines (issue 42): every decision
auto, clipping 1.0, fp32 master, 8 x 4096 tokens. Planned on this machine for the described ones (no GPU needed).

    PYTHONPATH=. python experiments/plan_table_100b.py [--json OUT.json]

Host limits: 540.9 GB is the 512 GiB four-GPU machine's MemTotal (measured, docs/design.md section 7); 591.6 GB for
560 GiB is that scaled by 560/512 (not measured). GPUs: an H100 (81559 MiB) and an H200 (143771 MiB) as nvidia-smi
reports them, each named as nvidia-smi names it (the step model counts an H200's memory passes at its own rate).
"""
from __future__ import annotations

import argparse
import dataclasses
import json

from megatrain_jax.config import load_config
from megatrain_jax.plan import make_plan, target_machine

M123 = ["model.hidden_size=12288", "model.num_layers=88", "model.num_heads=96", "model.num_kv_heads=8",
        "model.intermediate_size=28672", "model.vocab_size=32768", "model.qkv_bias=false", "model.rope_theta=1000000.0"]
MODELS = {"Llama-2-70B, AdamW int8": ("configs/llama2-70b.yaml", ["train.batch_size=8", "optim.clip_norm=1.0"]),
          "Qwen1.5-110B, lean": ("configs/lean-110b.yaml", []),
          "Mistral-Large-123B, lean": ("configs/lean-110b.yaml", M123)}
HOSTS = {"512 GiB": 540.9, "560 GiB": 591.6}
GPUS = {"H100": 81559 * 2 ** 20 / 1e9, "H200": 143771 * 2 ** 20 / 1e9}
NAMES = {"H100": "NVIDIA H100 80GB HBM3", "H200": "NVIDIA H200"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    print("| model | GPU | host | verdict | host GB (B/param) | GPU GB | predicted step s | model-TFLOPS | placement |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (config, sets) in MODELS.items():
        for gname, gpu in GPUS.items():
            for hname, host in HOSTS.items():
                cfg = load_config(config, ["train.final_checkpoint=false", *sets])
                m = dataclasses.replace(target_machine(gpu_memory_gb=gpu, host_memory_gb=host, cpu_cores=64),
                                        gpu_name=NAMES[gname])
                p = make_plan(cfg, m, _mode_table=False)
                v, o = p.verdict(), p.options
                step = p.step["predicted_step_s"]
                tflops = 6 * p.params * cfg.train.batch_size * cfg.data.seq_len / step / 1e12
                place = (f"{o.grad_hold}" + (f" ({o.grad_hold_gpu_groups} groups on the GPU)" if o.grad_hold_gpu_groups
                                             else "") + f", update on {o.update_on}, stream_io={o.stream_io}")
                verdict = "fits" if v is None else f"refused ({v.field}): fix {v.fix}"
                rows.append({"model": name, "gpu": gname, "host": hname, "host_limit_gb": host, "fits": v is None,
                             "refusal": None if v is None else str(v), "host_gb": p.host_need / 1e9,
                             "bytes_per_param": p.host_bytes_per_param, "gpu_gb": (p.gpu_need or 0) / 1e9,
                             "predicted_step_s": step, "model_tflops": tflops, "decisions": p.decisions,
                             "params": p.params})
                print(f"| {name} | {gname} | {hname} | {verdict} | {p.host_need / 1e9:.1f} "
                      f"({p.host_bytes_per_param:.2f}) | {(p.gpu_need or 0) / 1e9:.1f} | {step:.1f} | {tflops:.0f} | "
                      f"{place} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
