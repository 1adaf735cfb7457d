"""The memory plan: what a run needs, where each buffer lives, and the engine's options.

``machine`` (what the run may use), ``sizes`` (bytes of each buffer), ``decisions`` (every auto),
``search`` (the step's placement), ``rows`` (host rows, what a candidate costs), ``sharding`` (what several
GPUs and processes allow of the update and the host state), ``build`` (``make_plan``), ``refusal`` (the verdict
and its fix), ``units`` (sizes as text), ``report`` (table, JSON, scaling); the placement names are
``megatrain_jax.placements``'s; ``lora`` (the plan's LoRA rows: a frozen base and its adapters, and
``variant``, where the choice LoRA or full training is made). ``plan_or_refuse`` is the one planning step
every entry point takes (the CLI's ``train``, the library's ``Trainer.from_config``): the plan on this
machine, or the one-line refusal before anything is allocated; ``plan_of`` the plan as ``megatrain-jax
plan`` prints it. Both give the LoRA rows for a model with adapters.
"""
from __future__ import annotations

import math
import os
from typing import Callable

from megatrain_jax.placements import UPDATE_PLACES
from megatrain_jax.plan.build import Plan, make_plan  # noqa: F401
from megatrain_jax.plan.step_model import predicted_step  # noqa: F401
from megatrain_jax.plan.lora import LoraPlan, lora_plan, lora_plan_or_refuse
from megatrain_jax.plan.decisions import MODES, Candidate, Placement, RuntimeSettings  # noqa: F401
from megatrain_jax.plan.machine import (Machine, detect_machine, host_limit,  # noqa: F401
                                        jax_backend_ready, memory_snapshot, target_machine)
from megatrain_jax.plan.options import EngineOptions  # noqa: F401
from megatrain_jax.plan.report import plan_json, plan_table, scaling_rows, scaling_table  # noqa: F401
from megatrain_jax.plan.sizes import GB, GiB, Row, Shapes, pinned_limit  # noqa: F401

Log = Callable[[str], None]


def few_malloc_arenas(arenas: int = 2) -> bool:
    """Cap glibc's malloc arenas (``mallopt(M_ARENA_MAX)``, as ``MALLOC_ARENA_MAX`` does) before the
    backend's and the engine's threads start: each arena keeps what its threads freed; with the
    device-side update the host runs no optimizer threads (0.3 GB less resident at Qwen2.5-7B,
    experiments/RESULTS.md). False where glibc is not there."""
    import ctypes

    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(-8, int(arenas)))  # M_ARENA_MAX = -8
    except (OSError, AttributeError):
        return False


def apply_gpu_settings(p: Plan) -> None:
    """Give XLA the plan's budgets before its backend starts (no hand-set variable is needed; one
    that the user did set is respected)."""
    r = p.settings
    if r.gpu_mem_fraction:
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(r.gpu_mem_fraction))
    if r.gpu_preallocate is False:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if p.machine.backend == "gpu":
        limit = r.pinned_limit_bytes or pinned_limit(r.pinned_pool_bytes or 0.0)  # the limit the host rows assume
        os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", str(int(round(limit / GiB))))


def plan_of(cfg, machine: Machine | None = None, *, devices: int | None = None) -> Plan | LoraPlan:
    """The memory plan for ``cfg`` on ``machine`` (this one by default): the LoRA rows for a model with
    adapters (``lora.make_lora_plan``), else the full-training plan (``make_plan``, on ``devices`` GPUs)."""
    lora_rows = lora_plan(cfg, machine)
    return lora_rows if lora_rows is not None else _with_eval(cfg, make_plan(cfg, machine, devices=devices))


def _with_eval(cfg, plan: Plan) -> Plan:
    """The eval passes (``plan/eval_pass.py``) as a note: their time, and that the step's forward covers their
    memory."""
    from megatrain_jax.config.eval_fields import has_eval

    if has_eval(cfg) and plan.step:
        from megatrain_jax.plan.eval_pass import plan_eval

        e = plan_eval(cfg, plan)
        if e is not None:
            plan.notes.append(f"eval: {e['eval_passes']} pass(es) of {e['eval_tokens']:,} tokens, about "
                              f"{e['eval_pass_s']:.2f} s each (a forward sweep, micro-batches of the step's shape: "
                              "its GPU memory is under the step's forward peak)")
    return plan


def plan_or_refuse(cfg, log: Log = print) -> Plan | LoraPlan:
    """The memory plan for ``cfg`` on this machine, or the one-line refusal (``UserError``) before
    anything is allocated. Gives XLA the plan's budgets when its backend has not started yet. A model
    with adapters gets the plan's LoRA rows (``lora.lora_plan_or_refuse``)."""
    lora_rows = lora_plan_or_refuse(cfg, log)
    if lora_rows is not None:
        return lora_rows
    started_before = jax_backend_ready()
    plan = _with_eval(cfg, make_plan(cfg))
    if not started_before and jax_backend_ready() and plan.machine.backend == "gpu":
        # planning must start nothing (tests/test_device_optax.py checks it): XLA read its budgets just now
        log("plan: warning: JAX started while planning, before the plan could give XLA its GPU pool and pinned "
            "limit: XLA's defaults apply (0.75 of the GPU); please report this with the config")
    err = plan.verdict()
    if err is not None:
        raise err
    apply_gpu_settings(plan)
    o = plan.options
    if UPDATE_PLACES[o.update_on].on_device:
        few_malloc_arenas()
    gpu = f", GPU peak {plan.gpu_need / 1e9:.1f} of {plan.gpu_budget / 1e9:.1f} GB" if plan.gpu_budget else ""
    log(f"plan: host {plan.host_need / 1e9:.1f} of {plan.host_limit / 1e9:.1f} GB ({plan.host_source}) "
        f"({plan.host_bytes_per_param:.2f} bytes/param){gpu}; micro_batches={o.micro_batches}, "
        f"activations={o.activations}"
        f"{f' (the last {o.activations_gpu_blocks} blocks on the GPU)' if o.activations_gpu_blocks else ''}, "
        f"boundary_every={o.boundary_every}, grad_hold={o.grad_hold}"
        f"{f' (first {o.grad_hold_gpu_groups} groups on the GPU)' if o.grad_hold_gpu_groups else ''}, "
        f"stream_io={o.stream_io}, loss_chunk={o.loss_chunk}, stream_copy={o.stream_copy}, "
        f"moments={plan.settings.moments}, update_on={o.update_on}, keep_residuals={o.keep_residuals}"
        f"{f', early_state_groups={o.early_state_groups}' if o.early_state_groups else ''}"
        f"{', blocks_queued=1' if o.blocks_queued == 1 else ''}; "
        f"predicted step {plan.step['predicted_step_s']:.2f} s ({plan.step['binding'][:-2]}-bound, "
        f"{plan.step_basis})  [megatrain-jax plan CONFIG shows the table]")
    for note in plan.notes:
        log(f"plan: note: {note}")
    if plan.settings.attention_summary:
        log(plan.settings.attention_summary)
    return plan
