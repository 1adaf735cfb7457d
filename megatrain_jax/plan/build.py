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
import megatrain_jax.plan.decisions as choose
import megatrain_jax.plan.search as search
from megatrain_jax.plan.machine import Machine, detect_machine, process_count
from megatrain_jax.plan.options import DEVICE_UPDATE_CHUNK, EngineOptions, check_one_device
from megatrain_jax.optim.costs import auto_update_on
from megatrain_jax.plan.sizes import (BFC_TABLE_BYTES_PER_POOL_BYTE, GB, GRAD_SLAB_ELEMS, GRAD_SLABS, HOST_HOLD_BYTES,
                                      HOST_MARGIN, IO_VOCAB_CHUNK, MOMENT_BYTES, PINNED_HOLDS, PINNED_REUSED, RUNTIME_HOST_BYTES,
                                      XLA_FRACTION, GiB, Row, Shapes, grown_pool, kept_on_gpu, pinned_in_rows,
                                      pinned_in_use, pinned_limit, pinned_need, pinned_pool, usable)
from megatrain_jax.plan.step_model import _optax_cost, _step_basis, predicted_step, step_rates


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
    options: EngineOptions | None = None  # the decisions, typed, as the engine takes them
    host_available: float | None = None  # free now (MemAvailable); a note warns when it is below the need
    step_basis: str = "H100 rates"  # what the predicted step assumes
    fix: str | None = None  # a refusal's fix, each alternative checked by planning it (refusal.find_fix)
    token_bytes: float | None = None  # host bytes that grow with the tokens, when they are what does not fit
    search: dict[str, Any] = field(default_factory=dict)  # what the placement search tried (search_summary)

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
                "pinned_pool_bytes": r.pinned_pool_bytes, "pinned_limit_bytes": r.pinned_limit_bytes,
                "gpu_mem_fraction": r.gpu_mem_fraction,
                "gpu_preallocate": r.gpu_preallocate, "keep_residuals": o.keep_residuals,
                "seq_tile": o.seq_tile, "loss_chunk": o.loss_chunk, "stream_io": o.stream_io,
                "boundary_every": o.boundary_every, "grad_hold_gpu_groups": o.grad_hold_gpu_groups,
                "activations_gpu_blocks": o.activations_gpu_blocks,
                "blocks_queued": o.blocks_queued}

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
              _modes: bool = True, _mode_table: bool = True) -> Plan:
    """The plan for ``cfg`` on ``machine`` (this one by default; ``target_machine`` describes another),
    with every 'auto' decided; with the host need of each state mode beside it and, when the
    plan does not fit, the fix that would (``fix``: refusal.find_fix).
    ``attention=False``: the model has no attention (no attention term or line). ``_mode_table=False``
    plans only the modes the verdict reads (the leaner ones up to the first that fits, when the host
    is short): the same verdict, fix and options, with ``modes`` partial (the tests' property runs)."""
    from megatrain_jax.plan.refusal import find_fix, fits

    try:
        plan = _make_plan(cfg, machine, devices, attention)
    except UserError as err:
        plan = _one_device_rule(cfg, machine, devices, attention, err)
    if not _modes:
        return plan
    if cfg.optim.kernel == "fused" and _mode_table:
        for name, over in choose.MODES.items():
            mode = _mode_plan(cfg, plan.machine, devices, attention, over)
            plan.modes[name] = {"host_gb": mode.host_need / GB, "bytes_per_param": mode.host_bytes_per_param,
                                "fits_host": mode.fits_host(), "fits": fits(mode),
                                "settings": choose.mode_settings(over)}
    if not fits(plan):
        def replan(variant: Config, m: Machine | None = None) -> Plan:
            return _make_plan(variant, m or plan.machine, devices, attention)

        plan.fix, plan.token_bytes = find_fix(cfg, plan, replan)
    return plan


def _one_device_rule(cfg: Config, machine: Machine | None, devices: int | None, attention: bool,
                     err: UserError) -> Plan:
    """A fixed setting that runs on one GPU (options.check_one_device) in a run of several: its fix names each way out
    that fits when planned (the setting given back to the plan; one GPU); where none does, the plan of the setting
    given back is returned, and its own verdict says what does not fit."""
    field = err.field.split(".")[-1]
    if field not in ("update_on", "keep_residuals") or " on one GPU, and this run uses " not in err.problem:
        raise err
    freed = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **{field: "auto"}))
    one = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, devices=1))
    from megatrain_jax.plan.refusal import fits

    ways = []
    for label, variant in ((f"train.{field}=auto", freed), ("train.devices=1", one)):
        try:
            q = _make_plan(variant, machine, 1 if label == "train.devices=1" else devices, attention)
        except UserError:
            continue
        if fits(q):
            ways.append(label)
    if ways:
        raise UserError(err.field, err.problem, " or ".join(ways) + " fits")
    plan = _make_plan(freed, machine, devices, attention)
    plan.notes.append(f"{err.field}={getattr(cfg.train, field)} runs on one GPU: planned as {field}=auto")
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
    headroom = 0.0
    if on_gpu and gpu_usable is not None and shapes.largest_group > HUGE_GROUP:
        # the 110B lean shape (1.36B-parameter blocks) ran out of GPU memory in step 1 on a 10.1 GiB request, two
        # blocks' fp32 gradients, beyond a plan 12 GB under the budget (session 17; cause open): held free
        headroom = 2 * 4.0 * shapes.largest_group
        gpu_usable -= headroom
        notes.append(f"GPU: {headroom / GB:.1f} GB kept free beyond the phases for groups over "
                     f"{HUGE_GROUP / 1e9:.0f}B parameters (a transient two groups' fp32 gradients, measured at 110B)")
    moment_bytes = MOMENT_BYTES[optim.moments]
    update_on = choose.choose_update_on(train.update_on, on_gpu=on_gpu, devices=n_dev, kernel=optim.kernel,
                                        moments=optim.moments, bf16=bf16, stream_copy=train.stream_copy)
    if optim.kernel == "optax":  # any optax transformation: its state and device temporaries, from its own init/step
        cost = _optax_cost(cfg)
        moment_bytes = cost.host_state
        shapes = dataclasses.replace(shapes, update_temp=cost.device_temp, update_chunked=cost.chunked)
        if train.update_on == "auto":
            update_on = auto_update_on(cost, on_gpu=on_gpu, devices=n_dev, moments=optim.moments,
                                       bf16_host_copy=bf16 and train.stream_copy == "host")
    asked_keep = 0 if train.keep_residuals == "auto" else min(int(train.keep_residuals), shapes.layers - 1)
    check_one_device(n_dev, update_on=update_on, keep_residuals=asked_keep)
    if train.update_on == "auto" and on_gpu and n_dev == 1 and _device_update_runs(cfg, bf16):
        # update_on=auto: both placements of the update are planned and the faster fitting one taken (steps within
        # UPDATE_SWITCH_TOL equal: then the one the rule above names, the measured path; a note names the other).
        # A device-side update carries its state in flight and must hold every gradient (or resweep) on a small
        # GPU; a host update waits for the norm with the host's cores: neither wins everywhere (issue 43)
        other = "host" if update_on == "device" else "device"
        mine = _make_plan(dataclasses.replace(cfg, train=dataclasses.replace(train, update_on=update_on)), machine,
                          devices, attention)
        if update_on == "host" and optim.kernel == "fused" and optim.moments == "float32" and mine.found.best.fits:
            return mine  # fp32 moments on the GPU: 16 bytes/param more over PCIe, not measured to pay; tried where
            #              the host update does not fit
        alt = _make_plan(dataclasses.replace(cfg, train=dataclasses.replace(train, update_on=other)), machine,
                         devices, attention)
        return _faster_update(mine, alt)
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

    # ---- the step's placement: searched (search.py) over every auto decision
    micro_candidates = choose.micro_batch_candidates(train.micro_batches, shapes.batch, shapes.seq, n_dev)
    cpu_only = not on_gpu and gpu_budget is None
    attn_info, attn_extra = _attention(cfg, shapes, micro_candidates[0], on_gpu, machine.target) \
        if attention else (None, None)
    host_act_bytes = float(shapes.layers * shapes.batch * shapes.seq * shapes.hidden * shapes.dtype_bytes * n_dev)
    chunked = optim.kernel == "fused"
    slab = (min(GRAD_SLAB_ELEMS, shapes.largest_group) if chunked else shapes.largest_group) * 4
    host_copy = bf16 and not device_cast

    # an optax update on the host (every group, or with a device-side update the embedding and head that stream_io
    # makes in host memory) runs on the jax CPU device: its group's inputs, outputs and temporaries in host memory
    optax_group = _optax_cost(cfg).device_group if optim.kernel == "optax" else 0.0

    def rows_of(p: choose.Placement, slabs: int) -> list[Row]:
        """The host rows with placement ``p`` and ``slabs`` gradient slabs (where the path has them)."""
        return placement_rows(p, slabs) + gpu_side_rows(p)

    def placement_rows(p: choose.Placement, slabs: int) -> list[Row]:
        """The host rows that follow from where ``p`` puts things, not from its GPU bytes."""
        slab_row = None
        if _has_slabs(on_gpu, update_on, p):
            slab_row = Row("host", "gradient staging (pinned slabs)", float(slab * slabs),
                           f"{slabs} x {slab / GiB:.3f} GiB (train.grad_slabs)")
        rows = _host_rows(cfg, shapes, moment_bytes, host_copy=host_copy, on_gpu=on_gpu, n_dev=n_dev, placed=p,
                          host_act_bytes=host_act_bytes, slab_row=slab_row, update_on=update_on,
                          optax_group_bytes=optax_group)
        arrays = pinned_need(rows)
        in_use = pinned_in_use(rows, shapes, p.boundary_every, p.gpu_groups, arrays, p.gpu_act_blocks,
                               HOST_HOLD_BYTES[p.grad_hold]) \
            if p.activations == "pinned_host" and p.grad_hold in PINNED_HOLDS else arrays
        if in_use < arrays:
            rows.append(Row("host", PINNED_REUSED, in_use - arrays,
                            "held gradients land where the activations they follow were"))
        growth = pinned_pool(in_use, chunk=pinned_chunk(p)) - in_use if on_gpu else 0.0
        if growth > 0:
            rows.append(Row("host", "XLA host allocator: regions grown beyond its arrays", growth,
                            "its regions double from 2 MiB (all page-locked), cut at its limit"))
        return rows

    def pinned_chunk(p: choose.Placement) -> float:
        """The largest array XLA's pinned pool takes with placement ``p`` (sizes.bfc_capacity: a region holds only
        whole ones): a held block's gradient, a parked block input (one GPU's), a gradient slab."""
        sizes = [slab if _has_slabs(on_gpu, update_on, p) else 0.0]
        if p.grad_hold in PINNED_HOLDS:
            groups = [shapes.block] + ([] if p.stream_io else [shapes.embed, shapes.head])
            sizes.append(HOST_HOLD_BYTES[p.grad_hold] * max(groups))
        if p.activations == "pinned_host":
            sizes.append(host_act_bytes / max(shapes.layers * n_dev, 1))
        return max(sizes)

    def gpu_side_rows(p: choose.Placement) -> list[Row]:
        """The host rows that follow from ``p``'s GPU bytes: XLA's pool table (the CPU backend: the buffers)."""
        pool_row, _, _ = _xla_pool(machine, gpu_budget, p.gpu_need, n_dev)
        rows = [] if pool_row is None else [pool_row]
        if not on_gpu:
            rows.append(Row("host", "device buffers (the CPU backend's device memory is host memory)", p.gpu_need))
        return rows

    steps: dict[tuple, dict] = {}

    def step_of(p: choose.Placement) -> dict:
        """The candidate's predicted step (the same for candidates that differ only in the loss chunk or GPU bytes)."""
        key = (p.grad_hold, p.activations, p.boundary_every, p.stream_io, p.gpu_group_params, p.micro_batches,
               p.blocks_queued, p.gpu_act_blocks)
        if key not in steps:
            steps[key] = predicted_step(cfg, shapes, rates, n_dev=n_dev, n_keep=0, stream_bytes=stream_bytes,
                                        moment_bytes=moment_bytes, update_on=update_on, cpu_cores=machine.cpu_cores,
                                        attention=attention, placement=p)
        return dict(steps[key])

    # the search evaluates thousands of candidates that differ only in what their host rows do not read
    # (micro-batches, loss chunk): each placement's rows are summed once
    placed_sums: dict[tuple, float] = {}

    def host_of(p: choose.Placement) -> tuple[float, float]:
        key = (p.grad_hold, p.activations, p.boundary_every, p.stream_io, p.gpu_groups, p.gpu_group_params,
               p.gpu_act_blocks)
        fixed = placed_sums.get(key)
        if fixed is None:
            fixed = placed_sums[key] = sum(r.bytes for r in placement_rows(p, GRAD_SLABS[0]))
        need, placed = _host_sums(gpu_side_rows(p))
        return fixed + need, fixed + placed

    ctx = search.Context(
        stream_bytes=stream_bytes, device_cast=device_cast, attn=attn_extra,
        update_state_bytes=moment_bytes if update_on == "device" else None, gpu_usable=gpu_usable,
        host_usable=usable(host_limit, HOST_MARGIN),
        host_of=host_of,
        step_of=step_of)
    axes = search.axes_of(train, micro_candidates, on_gpu=on_gpu, cpu_only=cpu_only, update_on=update_on,
                          devices=n_dev)
    found = search.search(shapes, axes, ctx)
    placed = found.best
    phases, gpu_rows, gpu_need = placed.phases, search.gpu_rows(found.shapes, found.ctx, placed), placed.gpu_need
    notes.extend(placed.notes)
    n_keep, per_block = choose.choose_keep_residuals(
        train.keep_residuals, shapes, on_gpu=on_gpu, devices=n_dev,
        act_on_gpu=placed.activations == "device" and placed.boundary_every == 1 and placed.grad_hold != "resweep",
        moments=optim.moments, need=gpu_need, budget=gpu_budget, gpu_usable=gpu_usable,
        moe=bool(getattr(model, "num_experts", None)))
    if optim.kernel == "optax" and update_on == "device" and train.keep_residuals == "auto" and n_keep:
        # an optax update on the GPU works on whole groups (no chunking): with the room filled by kept residuals
        # the 3B shape ran out of memory, and without them it was as fast (RESULTS.md s7, H100): none kept
        notes.append(f"train.keep_residuals=auto: 0 with an optax update on the GPU (the room would keep {n_keep})")
        n_keep = 0
    if n_keep:
        gpu_rows.append(Row("gpu", f"forward residuals of the last {n_keep} blocks", n_keep * per_block,
                            "their backward does not recompute them (train.keep_residuals)"))
        # on top of the step's peak, wherever the plan puts it: conservative (RESULTS.md: measured below it)
        phases["loss, residuals kept"] = max(phases.values()) + n_keep * per_block
        gpu_need = max(phases.values())
    if headroom:  # (the search compared each candidate with the room less it: the same test as the verdict's)
        gpu_rows.append(Row("gpu", "kept free for a huge group's transient fp32 copies", headroom,
                            f"two fp32 gradients of a {shapes.largest_group / 1e9:.2f}B-parameter group"))
        phases["peak + huge-group headroom"] = max(phases.values()) + headroom
        gpu_need = max(phases.values())

    # ---- host rows
    placed.gpu_need = gpu_need  # the pool's table covers the residuals too
    fewest = rows_of(placed, GRAD_SLABS[0])
    slabs = choose.choose_slabs(train.grad_slabs, chunked=chunked, on_gpu=on_gpu, moments=optim.moments,
                                host_room=usable(host_limit, HOST_MARGIN) - sum(r.bytes for r in fewest)
                                + GRAD_SLABS[0] * slab * _has_slabs(on_gpu, update_on, placed), slab_bytes=slab)
    rows = rows_of(placed, slabs)
    while slabs > GRAD_SLABS[0] and sum(r.bytes for r in rows) > usable(host_limit, HOST_MARGIN):
        slabs -= 1  # the pinned pool's growth with more slabs must fit too
        rows = rows_of(placed, slabs)
    _, gpu_mem_fraction, preallocate = _xla_pool(machine, gpu_budget, gpu_need, n_dev)
    host_need = sum(r.bytes for r in rows)
    if host_avail < host_need <= usable(host_limit, HOST_MARGIN):
        notes.append(f"host: only {host_avail / GB:.1f} GB is available now ({host_source} limit "
                     f"{host_limit / GB:.1f} GB) and the plan needs {host_need / GB:.1f} GB: other processes hold "
                     "the rest; free it, or the run may be killed")

    disk_rows, disk_need = _disk_rows(cfg, shapes.params, moment_bytes)
    step = predicted_step(cfg, shapes, rates, n_dev=n_dev, n_keep=n_keep, stream_bytes=stream_bytes,
                          moment_bytes=moment_bytes, update_on=update_on, cpu_cores=machine.cpu_cores,
                          attention=attention, placement=placed)
    settings = choose.RuntimeSettings(
        attention=attn_info["impl"] if attn_info else None,
        attention_summary=attn_info["summary"] if attn_info else None, moments=optim.moments, devices=n_dev,
        pinned_pool_bytes=pinned_in_rows(rows),
        pinned_limit_bytes=pinned_limit(pinned_in_rows(rows), pinned_chunk(placed)),
        gpu_mem_fraction=gpu_mem_fraction, gpu_preallocate=preallocate)
    options = EngineOptions(compute_dtype=train.compute_dtype, micro_batches=placed.micro_batches,
                            loss_chunk=placed.loss_chunk, clip_norm=optim.clip_norm, skip_nonfinite=True,
                            activations=placed.activations, grad_hold=placed.grad_hold, grad_slabs=slabs,
                            grad_slab_elems=GRAD_SLAB_ELEMS if chunked else None, stream_copy=stream_copy,
                            update_on=update_on, keep_residuals=n_keep, devices=train.devices,
                            device_update_chunk=DEVICE_UPDATE_CHUNK, seq_tile=placed.seq_tile,
                            grad_hold_gpu_groups=placed.gpu_groups, stream_io=placed.stream_io,
                            activations_gpu_blocks=placed.gpu_act_blocks,
                            boundary_every=placed.boundary_every, vocab_chunk=IO_VOCAB_CHUNK,
                            blocks_queued=placed.blocks_queued)
    plan = Plan(rows=rows + gpu_rows + disk_rows, settings=settings, options=options, host_need=host_need,
                host_limit=host_limit, host_available=host_avail, host_source=host_source,
                gpu_need=gpu_need if gpu_budget else None, gpu_budget=gpu_budget, gpu_phases=phases,
                disk_need=disk_need, disk_free=machine.disk_free.get(train.out_dir) if machine.disk_free else None,
                step=step, params=shapes.params, machine=machine, notes=notes,
                step_basis=_step_basis(machine), search=search_summary(found))
    plan.found = found  # the search itself (not a field: not in the JSON): what tests re-check
    return plan


STORE_SLACK = 0.005  # host bytes per byte of the store the process holds beyond the rows (glibc, the driver's
#                      registration of the store): 0.3% measured at 70B; the row is 0.5% (one point measured)
HUGE_GROUP = 1.0e9  # parameters of a group above which the GPU keeps two of its fp32 gradients free (see _make_plan)
UPDATE_SWITCH_TOL = 0.05  # the other placement of the update is taken over the rule's where predicted this much faster


def _device_update_runs(cfg: Config, bf16: bool) -> bool:
    """Whether a device-side update can run this config (one GPU is checked by the caller): no host bf16 copy
    streams, and the optimizer has a device form (the fused AdamW's, or an optax transformation's)."""
    if bf16 and cfg.train.stream_copy == "host":
        return False
    return cfg.optim.kernel == "fused" or _optax_cost(cfg).runs_on_device


def _faster_update(mine: Plan, alt: Plan) -> Plan:
    """Of two plans differing in ``update_on`` (``mine``: the rule's), the one to take: the only one that fits; of
    two, the other where it is faster by UPDATE_SWITCH_TOL, else the rule's (its path is the measured one: a
    device-side update with fp32 moments was not measured to pay, docs/design.md); of none, the rule's where its search found a candidate,
    else the other's (the nearer refusal)."""
    from megatrain_jax.plan.refusal import fits

    ok_mine, ok_alt = fits(mine), fits(alt)
    if ok_mine != ok_alt:
        pick = mine if ok_mine else alt
    elif not ok_mine:  # the nearer refusal: one whose search found a placement for the GPU, then the smaller need
        def near(p: Plan) -> tuple:
            return (not p.found.best.fits, not p.search.get("gpu_fits_any", True), p.host_need)
        pick = mine if near(mine) <= near(alt) else alt
    else:
        t_mine, t_alt = mine.step["predicted_step_s"], alt.step["predicted_step_s"]
        pick = alt if t_alt < t_mine * (1 - UPDATE_SWITCH_TOL) else mine
    other = alt if pick is mine else mine
    if fits(other):
        pick.notes.append(f"train.update_on=auto: {pick.options.update_on} (predicted step "
                          f"{pick.step['predicted_step_s']:.2f} s, host {pick.host_need / GB:.1f} GB; "
                          f"{other.options.update_on}: {other.step['predicted_step_s']:.2f} s, "
                          f"{other.host_need / GB:.1f} GB)")
    return pick


def _host_sums(rows: list[Row]) -> tuple[float, float]:
    """(host need, the same without XLA's GPU pool table): the search compares the second."""
    need = sum(r.bytes for r in rows)
    return need, need - sum(r.bytes for r in rows if r.what.startswith("XLA's GPU allocator table"))


def _has_slabs(on_gpu: bool, update_on: str, p: choose.Placement) -> bool:
    """Whether the run has pinned gradient slabs: a host update's gradient, or a pageable hold's, lands there."""
    return on_gpu and (update_on == "host" or p.grad_hold in ("host_fp32", "host_bf16"))


def search_summary(found: search.Result) -> dict[str, Any]:
    """What the search tried and, where nothing fit, the candidate that came closest."""
    b, room = found.best, found.ctx.gpu_usable if found.ctx else None
    on_gpu = [c for c in found.candidates if room is None or c.gpu_need <= room]
    return {"tried": found.tried, "fitting": found.fitting, "chosen": search.describe(b), "fits": b.fits,
            "gpu_need": b.gpu_need, "host_need": b.host_need, "predicted_step_s": b.step.get("predicted_step_s"),
            # whether any candidate fits the GPU (none: the GPU, not the host, is what refuses), and the least
            # host need among those that do (the host limit a refusal names is planned from it)
            "gpu_fits_any": bool(on_gpu), "least_host_on_gpu": min((c.host_need for c in on_gpu), default=None)}


def _host_rows(cfg: Config, shapes: Shapes, moment_bytes: float, *, host_copy: bool, on_gpu: bool, n_dev: int,
               placed: choose.Placement, host_act_bytes: float, slab_row: Row | None, update_on: str = "host",
               optax_group_bytes: float = 0.0) -> list[Row]:
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
    # stream_io: the embedding's and head's fp32 gradients are made in host memory and wait there (engine/holds.HostArray),
    # outside any hold (the H100's 524k slice ran 3.9 GB over the plan without this row, RESULTS.md s12)
    io_grads = shapes.embed + shapes.head if placed.stream_io else 0
    if io_grads:
        rows.append(Row("host", "embedding + head gradients (train.stream_io)", 4.0 * io_grads,
                        "fp32, made in host memory"))
    if placed.stream_io:
        # the head's vocabulary chunks: the engine's staging buffers (one per chunk, the whole output matrix gathered
        # once a step in the background: engine/io.py; registered host memory) and two chunk gradients on their way
        # to the host (XLA's pinned pool); the 3B at 10 GB ran 2.9 GB over a plan without them and without the
        # parked segment inputs below (RESULTS.md s14 call 6)
        vc = min(IO_VOCAB_CHUNK, shapes.vocab)
        chunk, chunks = 4.0 * shapes.hidden * vc, -(-shapes.vocab // vc)
        rows.append(Row("host", "head chunks' staging (train.stream_io)", chunks * chunk * shapes.dtype_bytes / 4,
                        f"{chunks} chunks: the output matrix, vocabulary-major, in the compute dtype"))
        rows.append(Row("host", "head chunks' gradients on their way (pinned)", 2.0 * chunk, "two chunks"))
    held = shapes.params - io_grads - placed.gpu_group_params
    split = f"; the first {placed.gpu_groups} groups wait on the GPU" if placed.gpu_groups else ""
    if placed.grad_hold in PINNED_HOLDS:
        rows.append(Row("host", "gradients held for clipping (pinned)", HOST_HOLD_BYTES[placed.grad_hold] * held,
                        placed.grad_hold[7:].replace("host", "fp32") + split))
    elif placed.grad_hold in HOST_HOLD_BYTES:
        rows.append(Row("host", "gradients held for clipping (pageable)", HOST_HOLD_BYTES[placed.grad_hold] * held,
                        placed.grad_hold[5:] + ", fed through the slabs" + split))
        # measured over the rows above with a pageable hold, never with the pinned one (H100, RESULTS.md s10:
        # 8B +2.3 GB, 14B +2.7 GB at 24 GB): one group in fp32 beside the hold, the size of the largest that goes
        # through it (stream_io: a block; the embedding's and head's gradients are made in host memory, and
        # counting the 8B's head there put the plan 5.3% over its run at 24 GB: RESULTS.md s15)
        rows.append(Row("host", "pageable hold's staging (one group in fp32)",
                        4.0 * (shapes.block if placed.stream_io else shapes.largest_group)))
    if placed.activations == "pinned_host":
        k = placed.boundary_every
        kept = -(-shapes.layers // k) - kept_on_gpu(shapes.layers, k, placed.gpu_act_blocks)
        parked = max(k - 2, 0)  # a segment's recomputed inputs below its top two wait parked too (weights.Boundaries)
        rows.append(Row("host", "boundary activations (pinned)", host_act_bytes * (kept + parked) / shapes.layers,
                        ", ".join(x for x in (f"every {k}th block input" if k > 1 else "",
                                              f"{parked} recomputed parked" if parked else "",
                                              f"the last {placed.gpu_act_blocks} blocks' on the GPU"
                                              if placed.gpu_act_blocks else "") if x)))
    host_updated = shapes.largest_group if update_on == "host" else \
        (max(shapes.embed, shapes.head) if placed.stream_io else 0)
    if optax_group_bytes and host_updated:
        # one group at a time (one host-optimizer thread): the 110B lean shape's head (1.25B parameters, Adafactor,
        # 16 bytes a parameter) is 20 GB; without this row its run was killed 20+ GB over its plan (issue 42)
        rows.append(Row("host", "host update's working set (optax on the CPU device, one group)",
                        optax_group_bytes * host_updated, "inputs, outputs and temporaries of its compiled step"))
    if train.final_checkpoint or train.ckpt_every:
        rows.append(Row("host", "checkpoint writer (one group in flight)", shapes.largest_group * (4 + moment_bytes)))
    rows.append(Row("host", "data loader (one batch, index)",
                    float(train.batch_size * cfg.data.seq_len * 4 * 4 + 64e6)))
    if on_gpu:  # measured at 70B (H200 x4, session 17 call 1): RSS 472.2 GB against 470.7 planned without this row
        rows.append(Row("host", "bookkeeping that grows with the store (allocator, registration)",
                        STORE_SLACK * (4.0 + moment_bytes) * shapes.params, f"{STORE_SLACK:.1%} of master + state"))
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
    budgeted = bool(gpu_budget and gpu_budget < XLA_FRACTION * machine.gpu_bytes * 0.999)
    preallocate = choose.preallocate_pool(gpu_budget, gpu_need, budgeted)
    pool = fraction * machine.gpu_bytes
    managed = pool if preallocate else min(pool, grown_pool(gpu_need))
    row = Row("host", "XLA's GPU allocator table (8 bytes per 256 of its pool)",
              managed * BFC_TABLE_BYTES_PER_POOL_BYTE * n_dev,
              "pool made at the start" if preallocate else "pool grown on demand")
    return row, round(fraction, 4), preallocate


def _attention(cfg: Config, shapes: Shapes, first_micro: int, on_gpu: bool, target: bool = False):
    """The attention path (attention.py) and its working set beyond what the coefficients include. A
    described GPU (``target``) has cuDNN with the pre-Hopper head-dim limit (128), whatever this machine has."""
    from megatrain_jax import attention as attn_mod

    m, backend = cfg.model, "gpu" if on_gpu else "cpu"
    limit = 128 if (target and on_gpu) else None

    def describe(batch: int) -> dict[str, Any]:
        return attn_mod.describe(m, cfg.data.seq_len, cfg.train.compute_dtype, backend, batch=batch,
                                 doc_masking=cfg.data.doc_masking, cudnn_max_head_dim=limit)

    cache: dict[int, tuple[float, str]] = {}

    def extra(batch: int) -> tuple[float, str]:
        if batch not in cache:  # the search asks for the same few batches many times
            d = describe(batch)
            cache[batch] = float(max(d["extra_over_cudnn_bytes"], 0)), d["impl"]
        return cache[batch]

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
