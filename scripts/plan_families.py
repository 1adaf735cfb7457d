"""The memory plan of the big MoE families' shapes on the machines issue 64 names (docs/families.md's
tables): for each config and machine (GPU GB / host GB), whether it fits, the host and GPU need, the
predicted step and the decisions, in the full host state (fp32 moments) and the leanest one (int8
moments, fp32 master streamed, no final checkpoint), both with clipping at 1.0 and every placement auto.

    python scripts/plan_families.py [CONFIG ...] [--machines 80/128,80/512,141/512] [--cores 64]

Planned, not measured. The predicted step is the plan's (H100 rates); a config's own ``optim`` and
``train`` fields stand, except those two states' fields.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CONFIGS = ("configs/gpt-oss-20b-shape.yaml", "configs/gpt-oss-120b-shape.yaml")
MACHINES = ((80, 128), (80, 137.4), (80, 512), (141, 512))  # 137.4 GB: 128 GiB, the lent H100 machine's host
STATES = {"full": ("optim.moments=float32", "train.stream_copy=auto"),
          "leanest": ("optim.moments=int8", "train.stream_copy=device", "train.final_checkpoint=false",
                      "train.ckpt_every=0")}
AUTO = ("optim.clip_norm=1.0", "train.micro_batches=auto", "train.update_on=auto", "train.grad_hold=auto",
        "train.activations=auto", "train.stream_io=auto", "train.boundary_every=auto", "train.keep_residuals=auto")


def plan_row(config: str, gpu_gb: float, host_gb: float, state: str, cores: int) -> list[str]:
    from megatrain_jax.config import load_config
    from megatrain_jax.plan import make_plan, target_machine
    from megatrain_jax.plan.refusal import fits

    cfg = load_config(os.path.join(ROOT, config), [*AUTO, *STATES[state]])
    machine = target_machine(gpu_memory_gb=gpu_gb, host_memory_gb=host_gb, cpu_cores=cores)
    p = make_plan(cfg, machine, _modes=False)
    ok = fits(p)
    m = cfg.model
    tokens = cfg.train.batch_size * cfg.data.seq_len
    step = p.step.get("predicted_step_s")
    d = p.decisions
    from megatrain_jax.plan.refusal import fits_gpu

    why = " and ".join(w for w, good in (("host", p.fits_host()), ("GPU", fits_gpu(p))) if not good)
    return [os.path.basename(config).removesuffix(".yaml"), f"{m.total_params() / 1e9:.1f}B / {m.active_params() / 1e9:.2f}B",
            f"{gpu_gb:g} / {host_gb:g}", state, "yes" if ok else f"no ({why})", f"{p.host_need / 1e9:.0f}",
            f"{(p.gpu_need or 0) / 1e9:.0f}", f"{step:.1f} s ({tokens / step / 1000:.1f}k tok/s)" if ok and step else "-",
            ", ".join(f"{k}={d[k]}" for k in ("micro_batches", "update_on", "grad_hold", "activations") if k in d)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="*", default=list(CONFIGS))
    ap.add_argument("--machines", default=",".join(f"{g}/{h}" for g, h in MACHINES), help="GPU_GB/HOST_GB,...")
    ap.add_argument("--cores", type=int, default=64, help="host cores of the machines (default 64)")
    a = ap.parse_args(argv)
    machines = [tuple(float(x) for x in m.split("/")) for m in a.machines.split(",")]
    head = ["config", "params (total / active)", "GPU / host GB", "host state", "fits", "host GB", "GPU GB",
            "predicted step", "decisions"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for config in a.configs:
        for gpu, host in machines:
            for state in STATES:
                print("| " + " | ".join(plan_row(config, gpu, host, state, a.cores)) + " |", flush=True)


if __name__ == "__main__":
    main()
