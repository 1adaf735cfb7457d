"""The plan as text (``plan_table``), JSON (``plan_json``), and its data-parallel predictions
(``scaling_rows`` as data, ``scaling_table`` as text)."""
from __future__ import annotations

import json
from typing import Any

from megatrain_jax.config import Config
from megatrain_jax.plan.build import Plan, make_plan
from megatrain_jax.plan.lora import LoraPlan, refuse_lora_scaling
from megatrain_jax.plan.machine import Machine, detect_machine
from megatrain_jax.plan.sizes import GB, GPU_MARGIN, HOST_MARGIN, GiB
from megatrain_jax.plan.units import size_text


def plan_table(p: Plan | LoraPlan) -> str:
    """The plan as a readable table (rich), one line per component (the LoRA rows: ``LoraPlan.table``)."""
    import io

    if isinstance(p, LoraPlan):
        return p.table

    from rich.console import Console
    from rich.table import Table

    tab = Table(title=f"memory plan: {p.params / 1e9:.3f}B parameters", show_lines=False)
    for col in ("where", "component", "GB", "note"):
        tab.add_column(col, justify="right" if col == "GB" else "left")
    for r in p.rows:
        tab.add_row(r.where, r.what, f"{r.bytes / GB:.2f}", r.note)
    buf = io.StringIO()
    Console(file=buf, width=table_width(), force_terminal=False, color_system=None).print(tab)
    lines = [buf.getvalue().rstrip(), machine_line(p.machine)]
    avail = "" if p.host_available is None or p.host_available >= p.host_limit else \
        f", {p.host_available / GB:.1f} GB available now" + (" (MemAvailable)" if p.host_source == "MemTotal" else "")
    lines.append(f"host: need {p.host_need / GB:.1f} GB ({p.host_bytes_per_param:.2f} bytes/param), limit "
                 f"{p.host_limit / GB:.1f} GB ({p.host_source}{avail}), margin {HOST_MARGIN[0]:.0%} + "
                 f"{HOST_MARGIN[1] / GiB:.0f} GiB")
    if p.gpu_budget is not None:
        lines.append(f"GPU: peak {p.gpu_need / GB:.1f} GB of a {p.gpu_budget / GB:.1f} GB budget "
                     f"({p.machine.gpu_name or 'device'}; margin {GPU_MARGIN[0]:.0%} + {GPU_MARGIN[1] / GiB:.1f} GiB)")
        for phase, need in p.gpu_phases.items():
            lines.append(f"     {phase}: {need / GB:.1f} GB")
    else:
        lines.append("GPU: none (CPU backend: device buffers are counted in host memory)")
    if p.disk_need:
        lines.append(f"disk: need {size_text(p.disk_need)}, free "
                     + (size_text(p.disk_free) if p.disk_free is not None else "unknown"))
    if p.modes:
        lines.append("host state modes: " + "; ".join(
            f"{n} {m['bytes_per_param']:.1f} B/param = {m['host_gb']:.1f} GB "
            f"({'fits' if m['fits_host'] else 'does not fit'})" for n, m in p.modes.items()))
    o, r = p.options, p.settings
    if r.attention_summary:
        lines.append(r.attention_summary)
    lines.append(f"decisions: micro_batches={o.micro_batches}, activations={o.activations}"
                 + (f" (the last {o.activations_gpu_blocks} blocks' on the GPU)" if o.activations_gpu_blocks else "")
                 + f", boundary_every={o.boundary_every}, grad_hold={o.grad_hold}"
                 + (f" (first {o.grad_hold_gpu_groups} groups on the GPU)" if o.grad_hold_gpu_groups else "")
                 + f", stream_io={'true' if o.stream_io else 'false'}, loss_chunk={o.loss_chunk}, "
                 f"stream_copy={o.stream_copy}, moments={r.moments}, update_on={o.update_on}, "
                 f"keep_residuals={o.keep_residuals}, "
                 + (f"early_state_groups={o.early_state_groups}, " if o.early_state_groups else "")
                 + f"devices={r.devices}, seq_tile={o.seq_tile}, "
                 f"blocks_queued={o.blocks_queued}")
    if p.search:
        lines.append(f"search: {p.search['fitting']} of {p.search['tried']} candidates fit")
    st = p.step
    lines.append(f"predicted step ({p.step_basis}): {st['predicted_step_s']:.2f} s, bound by {st['binding'][:-2]} "
                 f"(compute {st['compute_s']:.2f} s, host->GPU {st['h2d_s']:.2f} s, GPU->host {st['d2h_s']:.2f} s, "
                 f"optimizer {st['optimizer_s']:.2f} s"
                 + (f", of the compute the update on the GPU {st['update_s']:.2f} s" if st.get("update_s") else "")
                 + (f", host copies {st['host_copy_s']:.2f} s" if st.get("host_copy_s") else "")
                 + (f"; with the updates waiting for the norm {st['updates_after_norm_s']:.2f} s"
                    if st.get("updates_after_norm_s") else "") + ")")
    lines.extend(f"note: {n}" for n in p.notes)
    v = p.verdict()
    lines.append("verdict: fits" if v is None else f"verdict: does not fit: {v}")
    return "\n".join(lines)


def table_width() -> int:
    """The plan table's width: the terminal's (between 60 and 130 columns; 100 where it is not a terminal)."""
    import shutil

    return max(60, min(130, shutil.get_terminal_size((100, 24)).columns))


def machine_line(m: Machine) -> str:
    """What the plan assumed of the machine: the GPU, the host<->GPU link, the GPU's speed and the host's cores,
    each with where it comes from (a described machine's unknowns are assumed, never read off this one)."""
    from megatrain_jax.plan.sizes import RATES

    if m.backend != "gpu":
        gpu = "no GPU (CPU backend)"
    else:
        gpu = f"{m.gpu_count} x {m.gpu_name or 'GPU'} ({m.gpu_source})"
    link = f"{m.pcie_bytes_s / GB:.0f} GB/s (--pcie-gbps)" if m.pcie_bytes_s else \
        f"{RATES['h2d'] / GB:.0f} GB/s (the H100 machine's; --pcie-gbps)"
    flops = f"{m.gpu_flops / 1e12:.0f} TFLOP/s (--gpu-tflops)" if m.gpu_flops else \
        f"{RATES['matmul_bf16'] / 1e12:.0f} TFLOP/s bf16 (the H100's; --gpu-tflops)"
    return (f"machine{' (described)' if m.target else ''}: {gpu}; host<->GPU link {link}; GPU {flops}; "
            f"host optimizer on {m.cpu_cores} CPU cores ({m.cpu_source})")


def plan_json(p: Plan) -> str:
    return json.dumps(p.to_dict(), indent=1, default=str)


def scaling_rows(cfg: Config, machine: Machine | None = None, counts=(1, 2, 4, 8)) -> list[dict[str, Any]]:
    """The same config's plan on N GPUs (data parallel, the global batch split over them), one dict
    per N: per-GPU peak, the host's total, the step's floor terms; ``error`` where the batch does not
    split. Predictions from the plan's rates, until measured. Refused for LoRA (``lora.refuse_lora_scaling``)."""
    refuse_lora_scaling(cfg)
    machine = machine or detect_machine((cfg.train.out_dir,))
    tokens = cfg.train.batch_size * cfg.data.seq_len
    rows = []
    for n in counts:
        if cfg.train.batch_size % n:
            rows.append({"gpus": n, "error": f"batch_size {cfg.train.batch_size} does not split over {n} GPUs"})
            continue
        p = make_plan(cfg, machine, devices=n)
        st = p.step
        rows.append({"gpus": n, "per_gpu_peak_gb": p.gpu_need / GB if p.gpu_need else None,
                     "host_gb": p.host_need / GB, "step_s": st["predicted_step_s"], "bound_by": st["binding"][:-2],
                     "tokens_per_s": tokens / st["predicted_step_s"], "optimizer_s": st["optimizer_s"],
                     "d2h_s": st["d2h_s"], "fits": p.verdict() is None, "step_basis": p.step_basis})
    return rows


def scaling_table(cfg: Config, machine: Machine | None = None, counts=(1, 2, 4, 8)) -> str:
    """``scaling_rows`` as text."""
    lines = ["data parallel (predictions from the plan's rates, not measurements):",
             f"{'GPUs':>4} | {'per-GPU peak GB':>15} | {'host GB':>7} | {'step s':>6} | {'bound by':>9} | "
             f"{'tokens/s':>9} | {'optimizer s':>11} | {'GPU->host s':>11}"]
    for r in scaling_rows(cfg, machine, counts):
        n = r["gpus"]
        if "error" in r:
            lines.append(f"{n:>4} | {r['error']}")
            continue
        gpu = f"{r['per_gpu_peak_gb']:.1f}" if r["per_gpu_peak_gb"] else "-"
        lines.append(f"{n:>4} | {gpu:>15} | {r['host_gb']:>7.1f} | {r['step_s']:>6.2f} | {r['bound_by']:>9} | "
                     f"{r['tokens_per_s']:>9,.0f} | {r['optimizer_s']:>11.2f} | {r['d2h_s']:>11.2f}")
    return "\n".join(lines)
