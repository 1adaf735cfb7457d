"""The table of typical machines (docs/performance.md): for each GPU memory and host memory, the largest model of a
ladder the plan says trains there with clipping (issue 27 item 4). Planned, not measured.

    python -m megatrain_jax.plan.machines [--tokens 16x4096] [--cores 16] [--markdown]

Every rung is planned in the leanest host state (int8 moments, fp32 master streamed: ~6 bytes/param)
with every placement ``auto``, global-norm clipping at 1.0, at the H100's rates (``--pcie-gbps``,
``--gpu-tflops`` describe another GPU) on a machine of ``--cores`` host cores.
"""
from __future__ import annotations

import argparse
import os
from typing import Any

GPUS = (10, 16, 24, 48, 80, 141)  # GB
HOSTS = (32, 64, 128, 256)  # GB
# (label, config, overrides): Llama-style shapes from 1B to 70B, the repository's own configs
LADDER = (("Llama-3.2-1B", "configs/1b.yaml", ()),
          ("Llama-3.2-3B", "configs/3b.yaml", ()),
          ("Llama-2-7B", "configs/7b.yaml", ()),
          ("Llama-3.1-8B", "configs/llama3.1-8b.yaml", ()),
          ("Qwen2.5-14B", "configs/qwen2.5-14b.yaml", ()),
          ("Qwen2.5-32B", "configs/qwen2.5-32b.yaml", ()),
          ("Llama-2-70B", "configs/llama2-70b.yaml", ()))
LEANEST = ("optim.moments=int8", "train.stream_copy=device", "optim.clip_norm=1.0", "train.final_checkpoint=false",
           "train.micro_batches=auto", "train.update_on=auto", "train.grad_hold=auto", "train.activations=auto",
           "train.stream_io=auto", "train.boundary_every=auto", "train.keep_residuals=auto", "train.ckpt_every=0")


def largest(gpu_gb: float, host_gb: float, *, batch: int, seq: int, cores: int, root: str,
            pcie_gbps: float | None = None, gpu_tflops: float | None = None) -> tuple[str, Any] | None:
    """The largest rung of LADDER whose plan fits (label, plan), or None."""
    from megatrain_jax.config import load_config
    from megatrain_jax.plan import make_plan, target_machine
    from megatrain_jax.plan.refusal import fits

    machine = target_machine(gpu_memory_gb=gpu_gb, host_memory_gb=host_gb, pcie_gbps=pcie_gbps,
                             gpu_tflops=gpu_tflops, cpu_cores=cores)
    for label, config, sets in reversed(LADDER):
        cfg = load_config(os.path.join(root, config), [*LEANEST, *sets, f"train.batch_size={batch}",
                                                       f"data.seq_len={seq}"])
        p = make_plan(cfg, machine, _modes=False)
        if fits(p):
            return label, p
    return None


def table(*, batch: int = 16, seq: int = 4096, cores: int = 16, markdown: bool = True, root: str | None = None,
          pcie_gbps: float | None = None, gpu_tflops: float | None = None, gpus=GPUS, hosts=HOSTS) -> str:
    root = root or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    head = ["GPU \\ host"] + [f"{h} GB" for h in hosts]
    rows = []
    for g in gpus:
        cells = [f"{g} GB"]
        for h in hosts:
            found = largest(g, h, batch=batch, seq=seq, cores=cores, root=root, pcie_gbps=pcie_gbps,
                            gpu_tflops=gpu_tflops)
            if found is None:
                cells.append("-")
                continue
            label, p = found
            tps = batch * seq / p.step["predicted_step_s"]
            cells.append(f"{label} ({tps / 1000:.1f}k tok/s)")
        rows.append(cells)
    if not markdown:
        width = max(len(c) for r in rows + [head] for c in r)
        return "\n".join(" | ".join(c.ljust(width) for c in r) for r in [head] + rows)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="16x4096", help="sequences x length per step (default 16x4096)")
    ap.add_argument("--cores", type=int, default=16, help="host cores of the machines (default 16)")
    ap.add_argument("--pcie-gbps", type=float, default=None)
    ap.add_argument("--gpu-tflops", type=float, default=None)
    ap.add_argument("--plain", action="store_true", help="aligned text instead of markdown")
    a = ap.parse_args(argv)
    batch, seq = (int(x) for x in a.tokens.lower().split("x"))
    print(table(batch=batch, seq=seq, cores=a.cores, markdown=not a.plain, pcie_gbps=a.pcie_gbps,
                gpu_tflops=a.gpu_tflops))


if __name__ == "__main__":
    main()
