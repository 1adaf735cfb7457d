"""The memory plan of LoRA training (``model.lora``): host and GPU bytes, the micro-batches and where
the boundary activations live, and a predicted step; refused (one line) when it does not fit.

Host: the frozen base (``lora_base``: 2 bytes/param bf16, ~1 byte/param int8 plus fp32 per-channel
scales, the embedding and head in bf16) and the process runtime; boundary activations when parked
in pinned host memory. No fp32 master, optimizer state or gradient on the host.
GPU, for the whole run: the embedding and head (frozen, resident), the adapters (fp32), their
gradients (fp32), the optax state and one update's transient (4 bytes/param). Per step at its peak:
two streamed blocks (one computing, one in flight), the block dequantised in the compute dtype (plus
its largest matrix in fp32 while it dequantises), the boundary activations, and the larger of the
block's recompute + VJP working set (the calibrated ``plan.sizes`` estimate) and the loss's.
Predicted step: the base crosses PCIe twice (forward and backward) and the blocks compute a forward,
a recompute and a backward without weight gradients (about 4 x 2·N·T FLOPs where full training does
4 x 2·N·T with 2·N·T of them weight gradients); the larger of the two bounds the step.

These are the plan's LoRA rows: ``variant`` is the one place the choice "LoRA or full training" is made
(the plan's entries ``plan_of`` / ``plan_or_refuse`` and ``trainer.Trainer`` dispatch on
it); ``lora_plan`` / ``lora_plan_or_refuse`` give these rows for a model with adapters, None otherwise.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from megatrain_jax.config import Config
from megatrain_jax.errors import UserError
from megatrain_jax.bounds import BLOCKS_QUEUED
from megatrain_jax.placements import ACTIVATION_PLACES, HOST_STATES, asked
from megatrain_jax.plan.sizes import (BFC_TABLE_BYTES_PER_POOL_BYTE, GB, GPU_MARGIN, HOST_MARGIN, MICRO_TOKENS, RATES,
                                      RUNTIME_HOST_BYTES, XLA_FRACTION, Row, Shapes, block_working_set,
                                      loss_working_set, pinned_limit, pinned_pool, usable)

FULL, LORA = "full", "lora"  # the two variants of the one engine (``variant``)
LORA_HOST_PER_BASE_BYTE = 0.015  # host bytes beyond the plan's rows per byte of the frozen base (make_lora_plan)


def variant(lora: Any) -> str:
    """``LORA`` (adapters on a frozen, streamed base) or ``FULL`` (every weight trained) for a model's
    ``lora`` section (``cfg.model.lora``, or ``Trainer(..., lora=)``): the one place the choice is made."""
    return FULL if lora is None else LORA


def lora_plan(cfg: Config, machine=None) -> "LoraPlan | None":
    """The plan's LoRA rows for ``cfg`` (``make_lora_plan``) when its model has adapters; None: full training."""
    return make_lora_plan(cfg, machine) if variant(cfg.model.lora) == LORA else None


def refuse_lora_scaling(cfg: Config) -> None:
    """``plan --scaling`` (``report.scaling_rows``) on a LoRA config: refused in one line."""
    if variant(cfg.model.lora) == LORA:
        raise UserError("--scaling", "no multi-GPU prediction for LoRA (each GPU runs the one-GPU plan on its "
                        "slice of the batch)", "plan it without --scaling")


def refuse_lora_sharded(cfg: Config) -> None:
    """``train.host_state=sharded`` on a LoRA config: refused in one line (``make_lora_plan``, the plan and the train
    command's; ``sharding.sharded_state``, a LoRA config planned as a full one)."""
    if HOST_STATES[cfg.train.host_state].sharded and variant(cfg.model.lora) == LORA:
        raise UserError("train.host_state", "sharded is for full training; LoRA's frozen base is streamed whole",
                        "set train.host_state=replicated")


@dataclass
class LoraPlan:
    rows: list[Row]
    host_need: float
    host_limit: float
    host_source: str
    gpu_need: float | None
    gpu_budget: float | None
    micro_batches: int
    activations: str  # device | pinned_host
    adapter_params: int
    base_bytes: int
    step: dict[str, Any]
    params: int
    notes: list[str] = field(default_factory=list)
    options: Any = None  # (no EngineOptions: the LoRA engine takes its fields)
    machine: Any = None  # the machine planned for (``plan.machine.Machine``)

    @property
    def decisions(self) -> dict[str, Any]:
        return {"mode": "lora", "micro_batches": self.micro_batches, "activations": self.activations}

    @property
    def host_bytes_per_param(self) -> float:
        return self.host_need / max(self.params, 1)

    def verdict(self) -> UserError | None:
        if self.host_need > usable(self.host_limit, HOST_MARGIN):
            return UserError("host memory", f"LoRA on this base needs {self.host_need / GB:.1f} GB of host memory, "
                             f"{usable(self.host_limit, HOST_MARGIN) / GB:.1f} GB usable of {self.host_limit / GB:.1f} "
                             f"({self.host_source})", "set model.lora.base_dtype=int8 (about 1 byte/param), or use a "
                             "machine with more memory")
        if self.gpu_budget is not None and self.gpu_need > usable(self.gpu_budget, GPU_MARGIN):
            return UserError("GPU memory", f"LoRA needs {self.gpu_need / GB:.1f} GB on the GPU at its peak "
                             f"({usable(self.gpu_budget, GPU_MARGIN) / GB:.1f} GB usable) even with "
                             f"{self.micro_batches} micro-batches and pinned-host activations",
                             "lower data.seq_len or train.batch_size, or model.lora.rank")
        return None

    def to_dict(self) -> dict[str, Any]:
        v = self.verdict()
        return {"mode": "lora", "rows": [vars(r) for r in self.rows], "host_need": self.host_need,
                "host_limit": self.host_limit, "gpu_need": self.gpu_need, "gpu_budget": self.gpu_budget,
                "decisions": self.decisions, "adapter_params": self.adapter_params, "base_bytes": self.base_bytes,
                "step": self.step, "fits": v is None, "refusal": None if v is None else str(v)}

    @property
    def table(self) -> str:
        lines = [f"{'where':5} {'what':44} {'GB':>9}  note"]
        lines += [f"{r.where:5} {r.what:44} {r.bytes / GB:9.3f}  {r.note}" for r in self.rows]
        gpu = f"{self.gpu_need / GB:.2f} of {self.gpu_budget / GB:.2f} GB" if self.gpu_budget else "n/a (CPU)"
        lines.append(f"host need {self.host_need / GB:.2f} of {self.host_limit / GB:.2f} GB; GPU peak {gpu}; "
                     f"micro_batches={self.micro_batches}, activations={self.activations}; predicted step "
                     f"{self.step['predicted_step_s']:.2f} s ({self.step['binding']})")
        return "\n".join(lines)


def base_bytes_of(layouts: dict, dtype: str) -> dict[str, int]:
    """Host bytes of each frozen group (as ``lora_base.FrozenGroup`` allocates them)."""
    out = {}
    for name, lay in layouts.items():
        d = "bfloat16" if (dtype == "int8" and not name.startswith("block_")) else dtype
        if d != "int8":
            out[name] = lay.size * (2 if d == "bfloat16" else 4)
            continue
        n = 0
        for lf in lay.leaves:
            n += lf.size + 4 * (lf.size // lf.shape[-2]) if len(lf.shape) >= 2 else 4 * lf.size
        out[name] = n
    return out


def adapter_params(cfg) -> int:
    """Adapter parameters of the model, from the shapes (r x (in + out) per targeted projection)."""
    m, lora = cfg, cfg.lora
    h, q, kv, f = m.hidden_size, m.num_heads * m.dim_per_head, m.kv_heads * m.dim_per_head, m.intermediate_size
    dims = {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, f), "up": (h, f), "down": (f, h)}
    per_layer = sum(lora.rank * sum(dims[t]) for t in lora.targets)
    return per_layer * m.num_layers


def make_lora_plan(cfg: Config, machine=None) -> LoraPlan:
    from megatrain_jax.models.common import abstract_model, streamed_parts
    from megatrain_jax.models.lora import plain_config
    from megatrain_jax.plan.machine import detect_machine
    from megatrain_jax.templates import Layout

    refuse_lora_sharded(cfg)
    machine = machine or detect_machine()
    m, t, d = cfg.model, cfg.train, cfg.data
    lora = m.lora
    layouts = {n: Layout(tr) for n, tr in streamed_parts(abstract_model(plain_config(m))).host_trees().items()}
    per_group = base_bytes_of(layouts, lora.base_dtype)
    base = sum(per_group.values())
    block_bytes = max(v for k, v in per_group.items() if k.startswith("block_"))
    block_params = max(lay.size for k, lay in layouts.items() if k.startswith("block_"))
    largest_leaf = max(lf.size for k, lay in layouts.items() if k.startswith("block_") for lf in lay.leaves)
    on_gpu = machine.backend == "gpu"
    shapes = Shapes.of(m, t.batch_size, d.seq_len, t.compute_dtype, seq_tile=m.seq_tile_tokens)
    dt = shapes.dtype_bytes
    na = adapter_params(m)
    state = 8 if cfg.optim.name in ("adamw", "muon") else 4 if cfg.optim.name in ("lion", "sgd") else 8
    resident = per_group["embed"] + per_group["head"]
    fixed = resident + na * (4 + 4 + state + 4)
    blocks = (BLOCKS_QUEUED + 1) * block_bytes + block_params * dt + (largest_leaf * 4 if lora.base_dtype == "int8" else 0)
    acts_all = shapes.layers * shapes.tokens * shapes.hidden * dt
    cotangent = shapes.tokens * shapes.hidden * dt  # the cotangents flowing down the blocks (one layer)
    budget = machine.gpu_bytes * XLA_FRACTION if on_gpu else None
    if t.gpu_memory_gb is not None and budget is not None:
        budget = min(budget, t.gpu_memory_gb * GB)
    # auto: from the fewest micro-batches of at most MICRO_TOKENS tokens (efficient matmuls, a smaller working set)
    cands = [t.micro_batches] if t.micro_batches != "auto" else [
        k for k in (1, 2, 4, 8, 16, 32, 64) if t.batch_size % k == 0 and (
            shapes.tokens // k <= MICRO_TOKENS or k == t.batch_size)]
    chosen = asked(ACTIVATION_PLACES, t.activations)
    places = [chosen] if chosen is not None else list(ACTIVATION_PLACES.values())
    choice = None
    for place in places:
        for mb in cands:
            tok = shapes.tokens // mb
            ws = max(block_working_set(shapes, tok), loss_working_set(shapes, tok, t.loss_chunk))
            need = fixed + blocks + (acts_all if place.on_gpu else 2 * acts_all // max(shapes.layers, 1)) + ws \
                + cotangent
            choice = (mb, place, need, ws)
            if budget is None or need <= usable(budget, GPU_MARGIN):
                break
        else:
            continue
        break
    mb, place, gpu_need, ws = choice
    runtime = RUNTIME_HOST_BYTES["gpu" if on_gpu else "cpu"]
    host_acts = acts_all if place.parked else 0
    # XLA's GPU allocator keeps a host table of 8 bytes per 256 of its pool, which a LoRA run makes whole at the
    # start (XLA_FRACTION of the GPU): the ~3 GB the H100 runs measured over the plan (bench_memory_plan.py)
    table = XLA_FRACTION * machine.gpu_bytes * BFC_TABLE_BYTES_PER_POOL_BYTE if on_gpu and machine.gpu_bytes else 0.0
    # beyond the rows: 1.5% of the base's bytes, calibrated (the H100 runs measured 0.4-0.5 GB over them with a 65.5 GB bf16
    # base, 0.7 GB with a 70 GB int8 one: bench_memory_plan.py); stated, not derived
    extra = LORA_HOST_PER_BASE_BYTE * base if on_gpu else 0.0
    # XLA's pinned pool grows in doubling regions up to the limit lora_plan_or_refuse gives it (as the full plan)
    growth = pinned_pool(host_acts) - host_acts if (on_gpu and host_acts) else 0.0
    host_need = base + runtime + host_acts + growth + table + extra
    rows = [Row("host", f"frozen base ({lora.base_dtype}; embed/head bf16)", base,
                f"{base / max(sum(lay.size for lay in layouts.values()), 1):.2f} bytes/param"),
            Row("host", "runtime (Python, JAX, CUDA)", runtime)]
    if extra:
        rows.append(Row("host", "beyond the rows (1.5% of the base, calibrated on the H100)", extra))
    if table:
        rows.append(Row("host", "XLA's GPU allocator table (8 bytes per 256 of its pool)", table,
                        f"a pool of {XLA_FRACTION:.0%} of the GPU"))
    if host_acts:
        rows.append(Row("host", "boundary activations (pinned)", host_acts))
    if growth:
        rows.append(Row("host", "XLA host allocator: regions grown beyond its arrays", growth))
    rows += [Row("gpu", "embedding + head (frozen, resident)", resident),
             Row("gpu", f"adapters fp32 ({na / 1e6:.1f}M params, rank {lora.rank})", 4 * na),
             Row("gpu", "adapter gradients fp32", 4 * na), Row("gpu", f"optimizer state ({cfg.optim.name})", state * na),
             Row("gpu", "update transient", 4 * na),
             Row("gpu", f"{BLOCKS_QUEUED + 1} streamed blocks (computing, queued, in flight) + 1 dequantised", blocks, f"block {block_bytes / GB:.2f} GB streamed"),
             Row("gpu", "boundary activations" if place.on_gpu else "activations in flight",
                 acts_all if place.on_gpu else 2 * acts_all // max(shapes.layers, 1)),
             Row("gpu", f"working set ({shapes.tokens // mb} tokens/micro-batch)", ws),
             Row("gpu", "cotangents flowing down the blocks (one layer)", cotangent)]
    n_base = m.non_embedding_params()
    flops = 4 * 2 * n_base * shapes.tokens  # forward, recompute, backward (dx only: 2 x forward)
    rate = RATES["matmul_bf16" if dt == 2 else "matmul_fp32"]
    pcie = machine.pcie_bytes_s or RATES["h2d"]
    compute_s, stream_s = flops / rate, 2 * (base - resident) / pcie
    step = {"predicted_step_s": max(compute_s, stream_s), "compute_s": compute_s, "stream_s": stream_s,
            "binding": "compute-bound" if compute_s >= stream_s else "PCIe-bound"}
    return LoraPlan(rows, host_need, machine.host_bytes, machine.host_source, gpu_need if on_gpu else None, budget,
                    mb, place.name, na, base, step, sum(lay.size for lay in layouts.values()), machine=machine)


def lora_plan_or_refuse(cfg: Config, log=print) -> LoraPlan | None:
    """``plan_or_refuse`` for a model with adapters: the LoRA plan on this machine, or the one-line refusal;
    XLA's pool and pinned limit set before its backend starts. None: full training (no adapters)."""
    if variant(cfg.model.lora) != LORA:
        return None
    plan = make_lora_plan(cfg)
    err = plan.verdict()
    if err is not None:
        raise err
    if plan.gpu_budget is not None:  # XLA's pool and pinned host limit, before its backend starts
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(XLA_FRACTION))
        pinned = sum(r.bytes for r in plan.rows if r.what.startswith("boundary activations (pinned)"))
        os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", str(round(pinned_limit(pinned) / 2**30)))
    gpu = f", GPU peak {plan.gpu_need / GB:.1f} of {plan.gpu_budget / GB:.1f} GB" if plan.gpu_budget else ""
    log(f"plan (LoRA): host {plan.host_need / GB:.1f} of {plan.host_limit / GB:.1f} GB ({plan.host_source}), base "
        f"{plan.base_bytes / GB:.1f} GB {cfg.model.lora.base_dtype}{gpu}; {plan.adapter_params / 1e6:.1f}M adapter "
        f"params; micro_batches={plan.micro_batches}, activations={plan.activations}; predicted step "
        f"{plan.step['predicted_step_s']:.2f} s ({plan.step['binding']})")
    return plan
