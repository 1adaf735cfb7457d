"""The largest model per number of hosts (issue 46): for each model and host size, the fewest hosts (processes, one
H100 each) whose plan fits with ``train.host_state=sharded``, and what each host then needs. Every decision auto,
AdamW with int8 moments (the fused kernel: what a sharded state updates), fp32 master, clipping 1.0, 8 x 4096
tokens per GPU. Planned on this machine for the described ones (no GPU needed).

    PYTHONPATH=. python experiments/plan_table_hosts.py [--json OUT.json]

Host limits: 135.1 GB is the 128 GiB single-GPU machine's MemTotal and 540.9 GB the 512 GiB four-GPU machine's
(measured, docs/design.md); 270.5 GB for 256 GiB is the latter halved (not measured).
"""
from __future__ import annotations

import argparse
import json
import os

from megatrain_jax.config import load_config
from megatrain_jax.plan import make_plan, target_machine

SHAPE_123B = ["model.hidden_size=12288", "model.num_layers=88", "model.num_heads=96", "model.num_kv_heads=8",
              "model.intermediate_size=28672", "model.vocab_size=32768", "model.qkv_bias=false"]
SHAPE_110B = ["model.hidden_size=8192", "model.num_layers=80", "model.num_heads=64", "model.num_kv_heads=8",
              "model.intermediate_size=49152", "model.vocab_size=152064", "model.qkv_bias=true",
              "model.tie_embeddings=false"]
SHAPE_405B = ["model.hidden_size=16384", "model.num_layers=126", "model.num_heads=128", "model.num_kv_heads=8",
              "model.intermediate_size=53248", "model.vocab_size=128256", "model.qkv_bias=false"]
BASE = "configs/llama2-70b.yaml"  # AdamW int8 moments, fp32 master, clipping 1.0
MODELS = {"Llama-2-7B": ("configs/7b.yaml", ["optim.moments=int8"]), "Llama-2-70B": (BASE, []),
          "Qwen1.5-110B shape": (BASE, SHAPE_110B), "Mistral-Large-123B shape": (BASE, SHAPE_123B),
          "Llama-3.1-405B shape": (BASE, SHAPE_405B)}
HOSTS = {"128 GiB": 135.1, "256 GiB": 270.5, "512 GiB": 540.9}
COUNTS = (1, 2, 4, 8, 16)
H100 = 81559 * 2 ** 20 / 1e9


def plan_for(config: str, sets: list[str], host_gb: float, n: int):
    """The plan of one of ``n`` processes (one H100 each), sharded where ``n`` > 1."""
    os.environ["MEGATRAIN_NUM_PROCESSES"] = str(n)
    try:
        cfg = load_config(config, ["train.final_checkpoint=false", f"train.batch_size={8 * n}", *sets]
                          + (["train.host_state=sharded"] if n > 1 else []))
        return cfg, make_plan(cfg, target_machine(gpu_memory_gb=H100, host_memory_gb=host_gb, cpu_cores=16))
    finally:
        os.environ.pop("MEGATRAIN_NUM_PROCESSES", None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    print("| model | params | " + " | ".join(f"{h} hosts" for h in HOSTS) + " |")
    print("|---|---|" + "---|" * len(HOSTS))
    for name, (config, sets) in MODELS.items():
        cells, params = [], None
        for hname, host in HOSTS.items():
            found = None
            for n in COUNTS:
                cfg, p = plan_for(config, sets, host, n)
                params = p.params
                if p.verdict() is None:
                    found = (n, p)
                    break
            if found is None:
                cells.append(f"more than {COUNTS[-1]}")
                rows.append({"model": name, "host": hname, "host_limit_gb": host, "hosts": None, "params": params})
                continue
            n, p = found
            step = p.step["predicted_step_s"]
            cells.append(f"**{n}** ({p.host_need / 1e9:.0f} GB each, {step:.0f} s a step)")
            rows.append({"model": name, "host": hname, "host_limit_gb": host, "hosts": n, "params": p.params,
                         "host_gb_each": p.host_need / 1e9, "gpu_gb": (p.gpu_need or 0) / 1e9,
                         "predicted_step_s": step, "decisions": p.decisions})
        print(f"| {name} | {params / 1e9:.1f}B | " + " | ".join(cells) + " |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
