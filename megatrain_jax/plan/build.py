"""``make_plan``: every byte the run will need, where it lives, and the engine's options.

The plan decides (``decisions.py``) where boundary activations live, where gradients wait for the
clipping norm, how many micro-batches ``auto`` means, and the GPU budget XLA is given: nothing is
left to XLA's defaults or to free memory read at run time. Sizes come from ``sizes.py``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any

from megatrain_jax.config import Config
from megatrain_jax.errors import UserError
from megatrain_jax.plan import decisions as choose
from megatrain_jax.plan.machine import Machine, detect_machine, process_count
from megatrain_jax.plan.options import DEVICE_UPDATE_CHUNK, EngineOptions, check_one_device
from megatrain_jax.plan.sizes import (BFC_TABLE_BYTES_PER_POOL_BYTE, GB, GRAD_SLAB_ELEMS, GRAD_SLABS, GiB,
                                      HOST_MARGIN, MOMENT_BYTES, RATES, RUNTIME_HOST_BYTES, XLA_FRACTION, Row,
                                      Shapes, grown_pool, pinned_need, usable)


@dataclass
class Plan:
    rows: list[Row]
    settings: choose.RuntimeSettings
    host_need: float
    host_limit: float  # the limit that decides (cgroup memory.max, MemTotal, or train.host_memory_gb)
    host_source: str
    gpu_need: float | None
    gpu_budget: float | None
    gpu_phases: dict[str, float]
    disk_need: float
    disk_free: float | None
    step: dict[str, Any]
    params: int
    machine: Machine
    notes: list[str] = field(default_factory=list)
    modes: dict[str, dict[str, Any]] = field(default_factory=dict)  # host need of each state mode (MODES)
    suggestion: str | None = None  # the fullest leaner mode that fits when the configured one does not
    options: EngineOptions | None = None  # the decisions, typed, as the engine takes them
    host_available: float | None = None  # free now (MemAvailable); a note warns when it is below the need
    step_basis: str = "H100 rates"  # what the predicted step assumes
    host_fix: str | None = None  # the refusal's fix when no state mode fits (refusal.py)
    token_bytes: float | None = None  # host bytes that grow with the tokens, when they are what does not fit

    @property
    def host_bytes_per_param(self) -> float:
        return self.host_need / max(self.params, 1)

    @property
    def decisions(self) -> dict[str, Any]:
        """Every decision as a dict (the JSON output and older callers; the engine reads ``options``)."""
        o, r = self.options, self.settings
        return {"micro_batches": o.micro_batches, "activations": o.activations, "grad_hold": o.grad_hold,
                "stream_copy": o.stream_copy, "update_on": o.update_on, "attention": r.attention,
                "attention_summary": r.attention_summary, "moments": r.moments, "devices": r.devices,
                "grad_slab_elems": o.grad_slab_elems, "grad_slabs": o.grad_slabs,
                "pinned_pool_bytes": r.pinned_pool_bytes, "gpu_mem_fraction": r.gpu_mem_fraction,
                "gpu_preallocate": r.gpu_preallocate, "keep_residuals": o.keep_residuals,
                "seq_tile": o.seq_tile}

    @property
    def tokens_short(self) -> bool:
        """Whether the tokens per step, not the parameters, are what the host cannot hold."""
        return self.token_bytes is not None

    def fits_host(self) -> bool:
        return self.host_need <= usable(self.host_limit, HOST_MARGIN)

    def verdict(self) -> UserError | None:
        """The first thing that does not fit, as the one-line error the CLI prints; None if it fits."""
        from megatrain_jax.plan.refusal import verdict

        return verdict(self)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("settings")
        d["decisions"] = self.decisions
        d["host_bytes_per_param"] = self.host_bytes_per_param
        v = self.verdict()
        d["fits"] = v is None
        d["refusal"] = None if v is None else str(v)
        return d


def make_plan(cfg: Config, machine: Machine | None = None, *, devices: int | None = None, attention: bool = True,
              _modes: bool = True) -> Plan:
    """The plan for ``cfg`` on ``machine`` (this one by default; ``target_machine`` describes another),
    with every 'auto' decided; with the host need of each state mode beside it and, when the
    configured mode does not fit the host, the fix that would (``suggestion``, ``host_fix``).
    ``attention=False``: the model has no attention (no attention term or line)."""
    plan = _make_plan(cfg, machine, devices, attention)
    if not _modes:
        return plan
    if cfg.optim.kernel == "fused":
        for name, over in choose.MODES.items():
            mode = _mode_plan(cfg, plan.machine, devices, attention, over)
            plan.modes[name] = {"host_gb": mode.host_need / GB, "bytes_per_param": mode.host_bytes_per_param,
                                "fits_host": mode.fits_host(), "settings": choose.mode_settings(over)}
        if not plan.fits_host():
            order = list(choose.MODES)  # fullest first; suggest only modes leaner than the configured one
            current = {"float32": 0, "bfloat16": 1}.get(cfg.optim.moments, len(order))
            for name in order[current + 1:]:
                if plan.modes[name]["fits_host"]:
                    mode = plan.modes[name]
                    plan.suggestion = (f"{mode['settings']} ({name}: {mode['bytes_per_param']:.1f} bytes/param, "
                                       f"{mode['host_gb']:.1f} GB)")
                    break
    if not plan.fits_host() and plan.suggestion is None:
        from megatrain_jax.plan.refusal import host_fix

        def replan(variant: Config, over: dict[str, str] | None) -> Plan:
            return _make_plan(variant, plan.machine, devices, attention) if over is None else \
                _mode_plan(variant, plan.machine, devices, attention, over)

        plan.host_fix, plan.token_bytes = host_fix(cfg, plan, replan)
    return plan


def _mode_plan(cfg: Config, machine: Machine, devices: int | None, attention: bool, over: dict[str, str]) -> Plan:
    """The plan of ``cfg`` in a state mode, with the kept residuals its GPU room holds."""
    t = dataclasses.replace(cfg.train, stream_copy=over.get("stream_copy", cfg.train.stream_copy),
                            keep_residuals="auto")
    o = dataclasses.replace(cfg.optim, moments=over["moments"])
    return _make_plan(dataclasses.replace(cfg, train=t, optim=o), machine, devices, attention)


def _make_plan(cfg: Config, machine: Machine | None, devices: int | None, attention: bool = True) -> Plan:
    train, optim, model = cfg.train, cfg.optim, cfg.model
    machine = machine or detect_machine((train.out_dir,) + ((train.export,) if train.export else ()))
    n_dev = choose.resolve_devices(train.devices, machine.gpu_count, process_count(), devices)
    host_limit = train.host_memory_gb * GB if train.host_memory_gb else machine.host_bytes
    host_source = "train.host_memory_gb" if train.host_memory_gb else machine.host_source
    host_avail = host_limit if train.host_memory_gb else machine.host_available
    on_gpu = machine.backend == "gpu"
    gpu_budget = choose.gpu_budget_of(machine.gpu_bytes, on_gpu, train.gpu_memory_gb)
    gpu_usable = choose.gpu_usable_of(gpu_budget)
    rates = step_rates(machine)

    bf16 = train.compute_dtype == "bfloat16"
    notes: list[str] = []
    per_dev_batch = train.batch_size // n_dev if train.batch_size % n_dev == 0 else train.batch_size
    shapes = Shapes.of(model, per_dev_batch, cfg.data.seq_len, train.compute_dtype, backend=machine.backend)
    moment_bytes = 8.0 if optim.kernel == "optax" else MOMENT_BYTES[optim.moments]
    update_on = choose.choose_update_on(train.update_on, on_gpu=on_gpu, devices=n_dev, kernel=optim.kernel,
                                        moments=optim.moments, bf16=bf16, stream_copy=train.stream_copy)
    asked_keep = 0 if train.keep_residuals == "auto" else min(int(train.keep_residuals), shapes.layers - 1)
    check_one_device(n_dev, update_on=update_on, keep_residuals=asked_keep)
    stream_copy = "device" if (update_on == "device" and bf16) else train.stream_copy
    # the runtime at its largest (a preallocated pool's allocator table) while choosing the options
    runtime_max = RUNTIME_HOST_BYTES["gpu" if on_gpu else "cpu"] \
        + (XLA_FRACTION * machine.gpu_bytes * BFC_TABLE_BYTES_PER_POOL_BYTE if on_gpu and machine.gpu_bytes else 0.0)
    store_bytes = shapes.params * (4.0 + moment_bytes)
    fewest_slabs = GRAD_SLABS[0] * GRAD_SLAB_ELEMS * 4
    if stream_copy == "auto":
        room = usable(host_limit, HOST_MARGIN) - store_bytes - runtime_max - fewest_slabs
        stream_copy = choose.choose_stream_copy(shapes, cfg.data.seq_len, model, on_gpu, bf16, room, rates["h2d"],
                                                rates["matmul_bf16"])
    device_cast = bf16 and stream_copy == "device"
    stream_bytes = 2 if (bf16 and not device_cast) else 4

    # ---- micro-batches, activation placement, gradient holding
    micro_candidates = choose.micro_batch_candidates(train.micro_batches, shapes.batch, shapes.seq, n_dev)
    order = choose.placement_order(train.activations, train.grad_hold, cpu_only=not on_gpu and gpu_budget is None)
    attn_info, attn_extra = _attention(cfg, shapes, micro_candidates[0], on_gpu) if attention else (None, None)
    host_base = store_bytes + (2.0 * shapes.layers * shapes.block if (bf16 and not device_cast) else 0.0) \
        + runtime_max + fewest_slabs  # host bytes every placement needs
    host_act_bytes = float(shapes.layers * shapes.batch * shapes.seq * shapes.hidden * shapes.dtype_bytes * n_dev)
    placed = choose.choose_placement(
        shapes, order, micro_candidates, gpu_usable=gpu_usable, host_room=usable(host_limit, HOST_MARGIN) - host_base,
        host_act_bytes=host_act_bytes, loss_chunk=train.loss_chunk, stream_bytes=stream_bytes, device_cast=device_cast,
        attn=attn_extra, update_state_bytes=moment_bytes if update_on == "device" else None)
    if not placed.fits and train.update_on == "auto" and update_on == "device":
        # the device-side update's own GPU memory (and the gradients it must hold there) does not fit:
        # the host updates instead (e.g. 18.1B parameters on an 80 GB GPU)
        host_cfg = dataclasses.replace(cfg, train=dataclasses.replace(train, update_on="host"))
        return _make_plan(host_cfg, machine, devices, attention)
    phases, gpu_rows, gpu_need = placed.phases, placed.gpu_rows, placed.gpu_need
    notes.extend(placed.notes)
    n_keep, per_block = choose.choose_keep_residuals(
        train.keep_residuals, shapes, on_gpu=on_gpu, devices=n_dev, act_on_gpu=placed.activations == "device",
        moments=optim.moments, need=gpu_need, budget=gpu_budget, gpu_usable=gpu_usable,
        moe=bool(getattr(model, "num_experts", None)))
    if n_keep:
        gpu_rows.append(Row("gpu", f"forward residuals of the last {n_keep} blocks", n_keep * per_block,
                            "their backward does not recompute them (train.keep_residuals)"))
        # on top of the step's peak, wherever the plan puts it: conservative (RESULTS.md: measured below it)
        phases["loss, residuals kept"] = max(phases.values()) + n_keep * per_block
        gpu_need = max(phases.values())

    # ---- host rows
    if optim.kernel == "optax":
        notes.append("optim.kernel=optax: optimizer state estimated as Adam's 8 bytes/param")
    chunked = optim.kernel == "fused"
    slab = (min(GRAD_SLAB_ELEMS, shapes.largest_group) if chunked else shapes.largest_group) * 4
    slab_row = Row("host", "gradient staging (pinned slabs)", 0.0)  # sized below, once the rest is known
    rows = _host_rows(cfg, shapes, moment_bytes, host_copy=bf16 and not device_cast, on_gpu=on_gpu, n_dev=n_dev,
                      placed=placed, host_act_bytes=host_act_bytes,
                      slab_row=slab_row if on_gpu and update_on == "host" else None)
    pool_row, gpu_mem_fraction, preallocate = _xla_pool(machine, gpu_budget, gpu_need, n_dev)
    if pool_row is not None:
        rows.append(pool_row)
    if not on_gpu:
        rows.append(Row("host", "device buffers (the CPU backend's device memory is host memory)", gpu_need))
    slabs = choose.choose_slabs(train.grad_slabs, chunked=chunked, on_gpu=on_gpu, moments=optim.moments,
                                host_room=usable(host_limit, HOST_MARGIN) - sum(r.bytes for r in rows),
                                slab_bytes=slab)
    slab_row.bytes, slab_row.note = float(slab * slabs), f"{slabs} x {slab / GiB:.3f} GiB (train.grad_slabs)"
    host_need = sum(r.bytes for r in rows)
    if host_avail < host_need <= usable(host_limit, HOST_MARGIN):
        notes.append(f"host: only {host_avail / GB:.1f} GB is available now ({host_source} limit "
                     f"{host_limit / GB:.1f} GB) and the plan needs {host_need / GB:.1f} GB: other processes hold "
                     "the rest; free it, or the run may be killed")

    disk_rows, disk_need = _disk_rows(cfg, shapes.params, moment_bytes)
    step = predicted_step(cfg, shapes, rates, n_dev=n_dev, n_keep=n_keep, stream_bytes=stream_bytes,
                          moment_bytes=moment_bytes, update_on=update_on, cpu_cores=machine.cpu_cores,
                          attention=attention)
    settings = choose.RuntimeSettings(
        attention=attn_info["impl"] if attn_info else None,
        attention_summary=attn_info["summary"] if attn_info else None, moments=optim.moments, devices=n_dev,
        pinned_pool_bytes=pinned_need(rows), gpu_mem_fraction=gpu_mem_fraction, gpu_preallocate=preallocate)
    options = EngineOptions(compute_dtype=train.compute_dtype, micro_batches=placed.micro_batches,
                            loss_chunk=train.loss_chunk, clip_norm=optim.clip_norm, skip_nonfinite=True,
                            activations=placed.activations, grad_hold=placed.grad_hold, grad_slabs=slabs,
                            grad_slab_elems=GRAD_SLAB_ELEMS if chunked else None, stream_copy=stream_copy,
                            update_on=update_on, keep_residuals=n_keep, devices=train.devices,
                            device_update_chunk=DEVICE_UPDATE_CHUNK, seq_tile=placed.seq_tile)
    return Plan(rows=rows + gpu_rows + disk_rows, settings=settings, options=options, host_need=host_need,
                host_limit=host_limit, host_available=host_avail, host_source=host_source,
                gpu_need=gpu_need if gpu_budget else None, gpu_budget=gpu_budget, gpu_phases=phases,
                disk_need=disk_need, disk_free=machine.disk_free.get(train.out_dir) if machine.disk_free else None,
                step=step, params=shapes.params, machine=machine, notes=notes,
                step_basis=_step_basis(machine))


def _host_rows(cfg: Config, shapes: Shapes, moment_bytes: float, *, host_copy: bool, on_gpu: bool, n_dev: int,
               placed: choose.Placement, host_act_bytes: float, slab_row: Row | None) -> list[Row]:
    """Host memory by component: the store, the pinned buffers the placement asks for, the checkpoint
    writer, the data loader and the runtime (``slab_row``: the gradient slabs of a host update)."""
    train = cfg.train
    rows = [Row("host", "fp32 master weights", 4.0 * shapes.params),
            Row("host", f"optimizer state ({cfg.optim.moments} moments)", moment_bytes * shapes.params)]
    if host_copy:
        rows.append(Row("host", "bf16 streaming copy (blocks)", 2.0 * shapes.layers * shapes.block,
                        "train.stream_copy=device removes it"))
    if slab_row is not None:  # device-side updates bring no gradient to the host
        rows.append(slab_row)
    if placed.grad_hold == "pinned_host":
        rows.append(Row("host", "gradients held for clipping (pinned)", 4.0 * shapes.params))
    if placed.activations == "pinned_host":
        rows.append(Row("host", "boundary activations (pinned)", host_act_bytes))
    if train.final_checkpoint or train.ckpt_every:
        rows.append(Row("host", "checkpoint writer (one group in flight)", shapes.largest_group * (4 + moment_bytes)))
    rows.append(Row("host", "data loader (one batch, index)",
                    float(train.batch_size * cfg.data.seq_len * 4 * 4 + 64e6)))
    rows.append(Row("host", "runtime (Python, JAX" + (", CUDA context)" if on_gpu else ")"),
                    RUNTIME_HOST_BYTES["gpu" if on_gpu else "cpu"] * (n_dev if on_gpu else 1)))
    return rows


def _xla_pool(machine: Machine, gpu_budget: float | None, gpu_need: float,
              n_dev: int) -> tuple[Row | None, float | None, bool | None]:
    """XLA's memory fraction, whether its pool is made whole at the start, and the host row of its
    allocator table (None on the CPU backend)."""
    if machine.backend != "gpu" or not machine.gpu_bytes:
        return None, None, None
    fraction = min(XLA_FRACTION, (gpu_budget or machine.gpu_bytes) / machine.gpu_bytes)
    preallocate = choose.preallocate_pool(gpu_budget, gpu_need)
    pool = fraction * machine.gpu_bytes
    managed = pool if preallocate else min(pool, grown_pool(gpu_need))
    row = Row("host", "XLA's GPU allocator table (8 bytes per 256 of its pool)",
              managed * BFC_TABLE_BYTES_PER_POOL_BYTE * n_dev,
              "pool made at the start" if preallocate else "pool grown on demand")
    return row, round(fraction, 4), preallocate


def _attention(cfg: Config, shapes: Shapes, first_micro: int, on_gpu: bool):
    """The attention path (attention.py) and its working set beyond what the coefficients include."""
    from megatrain_jax import attention as attn_mod

    m, backend = cfg.model, "gpu" if on_gpu else "cpu"

    def describe(batch: int) -> dict[str, Any]:
        return attn_mod.describe(m, cfg.data.seq_len, cfg.train.compute_dtype, backend, batch=batch,
                                 doc_masking=cfg.data.doc_masking)

    def extra(batch: int) -> tuple[float, str]:
        d = describe(batch)
        return float(max(d["extra_over_cudnn_bytes"], 0)), d["impl"]

    return describe(max(shapes.batch // first_micro, 1)), extra


def _disk_rows(cfg: Config, params: int, mom: float) -> tuple[list[Row], float]:
    t = cfg.train
    rows = []
    ckpt_bytes = params * (4 + mom)
    keep = max(t.keep_last, 1) + 1  # the one being written while keep_last are kept
    n_ckpt = 0
    if t.ckpt_every:
        n_ckpt = min(keep, max(1, t.steps // t.ckpt_every) + (1 if t.final_checkpoint else 0))
        if t.keep_every:
            n_ckpt += t.steps // max(t.keep_every, 1)
    elif t.final_checkpoint:
        n_ckpt = 1
    if n_ckpt:
        rows.append(Row("disk", f"checkpoints ({n_ckpt} x {ckpt_bytes / GB:.1f} GB)", n_ckpt * ckpt_bytes,
                        f"in {t.out_dir}"))
    if t.export:
        rows.append(Row("disk", "Hugging Face export", params * (2 if t.export_dtype != "float32" else 4),
                        f"in {t.export}"))
    return rows, sum(r.bytes for r in rows)


def step_rates(machine: Machine) -> dict[str, float]:
    """The floor rates of the predicted step: the H100 machine's (RATES), or a target's PCIe and TFLOPS."""
    rates = {k: v for k, v in RATES.items() if k != "adamw_elems"}
    if machine.pcie_bytes_s:
        rates["h2d"] = rates["d2h"] = machine.pcie_bytes_s
    if machine.gpu_flops:
        rates["matmul_bf16"] = machine.gpu_flops
        rates["matmul_fp32"] = machine.gpu_flops * RATES["matmul_fp32"] / RATES["matmul_bf16"]
    return rates


def _step_basis(machine: Machine) -> str:
    if machine.backend != "gpu":
        return "H100 rates: a GPU prediction; this run is on the CPU backend, which is far slower"
    if machine.pcie_bytes_s or machine.gpu_flops:
        return "the target's rates" + ("" if machine.pcie_bytes_s and machine.gpu_flops else
                                       " where given, the H100's elsewhere")
    return "H100 rates"


def predicted_step(cfg: Config, shapes: Shapes, rates: dict[str, float], *, n_dev: int, n_keep: int, stream_bytes: int,
                   moment_bytes: float, update_on: str, cpu_cores: int, attention: bool = True) -> dict[str, Any]:
    """The step's floor terms (compute, host->GPU, GPU->host, optimizer) and the largest of them.
    N GPUs: each receives every block over its own link, all read the one host memory at once; the
    summed gradient leaves once, its chunks spread over the N links."""
    train, optim, model = cfg.train, cfg.optim, cfg.model
    tokens = train.batch_size * cfg.data.seq_len
    attn = 12.0 * model.num_layers * model.num_heads * model.dim_per_head * cfg.data.seq_len if attention else 0.0
    hw_flops = tokens * (8 * model.non_embedding_params() - 2 * n_keep * shapes.block + 8 * shapes.vocab * shapes.hidden
                         + 4.0 / 6.0 * attn)
    rate = rates["matmul_bf16" if train.compute_dtype == "bfloat16" else "matmul_fp32"] * n_dev
    # blocks twice (forward, backward), embedding and head once
    h2d_bytes = 2 * shapes.layers * shapes.block * stream_bytes + 4 * (shapes.embed + shapes.head)
    opt_rate = RATES["adamw_elems"]["optax" if optim.kernel == "optax" else optim.moments] * min(cpu_cores, 16) / 16
    h2d_s = max(h2d_bytes / rates["h2d"], n_dev * h2d_bytes / rates["host_read"])
    step = {"compute_s": hw_flops / rate, "h2d_s": h2d_s, "d2h_s": 4 * shapes.params / (rates["d2h"] * n_dev),
            "optimizer_s": shapes.params / opt_rate}
    if update_on == "device":  # the state crosses PCIe both ways instead of the gradient; no host kernel
        step["h2d_s"] = (h2d_bytes + moment_bytes * shapes.params) / rates["h2d"]
        step["d2h_s"] = (4 + moment_bytes) * shapes.params / rates["d2h"]
        step["optimizer_s"] = 0.0
    step["predicted_step_s"] = max(step.values())
    step["binding"] = max(("compute_s", "h2d_s", "d2h_s", "optimizer_s"), key=lambda k: step[k])
    return step
