"""``make_plan``: every byte the run will need, where it lives, and the engine's options.

The plan decides (``decisions.py``) where boundary activations live, where gradients wait for the
clipping norm, how many micro-batches ``auto`` means, and the GPU budget XLA is given: nothing is
left to XLA's defaults or to free memory read at run time. Sizes come from ``sizes.py``, the host rows
and what a candidate placement costs from ``rows.py``, the placement from ``search.py``, what several GPUs
and processes allow of the update from ``sharding.py``, the verdict and its fix from ``refusal.py``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from megatrain_jax.config import Config
from megatrain_jax.errors import UserError
import megatrain_jax.plan.decisions as choose
import megatrain_jax.plan.refusal as refusal
import megatrain_jax.plan.search as search
import megatrain_jax.plan.sharding as sharding
from megatrain_jax.plan.machine import Machine, detect_machine, process_count
from megatrain_jax.plan.memo import PlanMemo
from megatrain_jax.bounds import DEVICE_UPDATE_CHUNK, GRAD_SLAB_ELEMS, IO_VOCAB_CHUNK
from megatrain_jax.plan.options import EngineOptions
from megatrain_jax.optim.costs import auto_update_on
from megatrain_jax.placements import (DEVICE_CAST, DEVICE_UPDATE, FULL_FETCH, HOST_UPDATE, SPLIT_FETCH, STREAM_COPIES,
                                      UPDATE_PLACES, Fetch, StreamCopy, UpdatePlace, asked)
from megatrain_jax.plan.rows import PlacementCosts, disk_rows, xla_pool
from megatrain_jax.plan.sizes import (BFC_TABLE_BYTES_PER_POOL_BYTE, GB, GRAD_SLABS_FEWEST, HOST_MARGIN,
                                      MOMENT_BYTES, RUNTIME_HOST_BYTES, XLA_FRACTION, Row, Shapes, pinned_in_rows,
                                      early_params, pinned_limit, usable)
from megatrain_jax.plan.step_model import optax_update_cost, reference_pass_note, step_basis, step_rates


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
                "stream_copy": o.stream_copy, "update_on": o.update_on, "fetch": o.fetch, "host_state": o.host_state, "attention": r.attention,
                "attention_summary": r.attention_summary, "moments": r.moments, "devices": r.devices,
                "grad_slab_elems": o.grad_slab_elems, "grad_slabs": o.grad_slabs,
                "pinned_pool_bytes": r.pinned_pool_bytes, "pinned_limit_bytes": r.pinned_limit_bytes,
                "gpu_mem_fraction": r.gpu_mem_fraction,
                "gpu_preallocate": r.gpu_preallocate, "keep_residuals": o.keep_residuals,
                "early_state_groups": o.early_state_groups,
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
        return refusal.verdict(self)

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
    memo = PlanMemo()  # (the call's plans share what they compute alike)
    plan = _make_plan(cfg, machine, devices, attention, memo)
    if getattr(cfg.train, "objective", "sft") in ("dpo", "ipo"):  # the reference pass before step 1
        plan.notes.append(reference_pass_note(cfg, plan.step))
    if not _modes:
        return plan
    if cfg.optim.kernel == "fused" and _mode_table:
        for name, over in choose.MODES.items():
            mode = _mode_plan(cfg, plan.machine, devices, attention, over, memo)
            plan.modes[name] = {"host_gb": mode.host_need / GB, "bytes_per_param": mode.host_bytes_per_param,
                                "fits_host": mode.fits_host(), "fits": refusal.fits(mode),
                                "settings": choose.mode_settings(over)}
    if not refusal.fits(plan):
        def replan(variant: Config, m: Machine | None = None) -> Plan:
            return _make_plan(variant, m or plan.machine, devices, attention, memo)

        plan.fix, plan.token_bytes = refusal.find_fix(cfg, plan, replan)
    return plan


def _mode_plan(cfg: Config, machine: Machine, devices: int | None, attention: bool, over: dict[str, str],
               memo: PlanMemo) -> Plan:
    """The plan of ``cfg`` in a state mode, with the kept residuals its GPU room holds."""
    t = dataclasses.replace(cfg.train, stream_copy=over.get("stream_copy", cfg.train.stream_copy),
                            keep_residuals="auto")
    o = dataclasses.replace(cfg.optim, moments=over["moments"])
    return _make_plan(dataclasses.replace(cfg, train=t, optim=o), machine, devices, attention, memo)


@dataclass
class _Limits:
    """What the run may use: the machine, the GPUs of the run, the host limit, and the GPU budget and room."""

    machine: Machine
    n_dev: int
    host_limit: float  # the limit that decides (cgroup memory.max, MemTotal, or train.host_memory_gb)
    host_source: str
    host_avail: float  # free now
    gpu_budget: float | None  # what XLA's allocator is given
    gpu_usable: float | None  # the room the search compares each candidate with (the budget less its margin, and
    #                           less a huge group's headroom)
    rates: dict[str, float]  # the predicted step's floor rates

    @property
    def on_gpu(self) -> bool:
        return self.machine.backend == "gpu"

    @property
    def host_usable(self) -> float:
        return usable(self.host_limit, HOST_MARGIN)


def _limits_of(cfg: Config, machine: Machine | None, devices: int | None) -> _Limits:
    """The run's machine (this one where none is described) and what the config lets the run use of it."""
    train = cfg.train
    machine = machine or detect_machine((train.out_dir,) + ((train.export,) if train.export else ()))
    n_dev = choose.resolve_devices(train.devices, machine.gpu_count, process_count(), devices)
    host_limit = train.host_memory_gb * GB if train.host_memory_gb else machine.host_bytes
    host_source = "train.host_memory_gb" if train.host_memory_gb else machine.host_source
    host_avail = host_limit if train.host_memory_gb else machine.host_available
    gpu_budget = choose.gpu_budget_of(machine.gpu_bytes, machine.backend == "gpu", train.gpu_memory_gb)
    return _Limits(machine, n_dev, host_limit, host_source, host_avail, gpu_budget, choose.gpu_usable_of(gpu_budget),
                   step_rates(machine))


def _make_plan(cfg: Config, machine: Machine | None, devices: int | None, attention: bool, memo: PlanMemo) -> Plan:
    """The plan of ``cfg`` (its state mode and fix aside): the run's limits, where the update runs, what streams,
    the placement searched, the GPU's peak with kept residuals, the host rows with their slabs (``memo``: the
    make_plan call's, shared by its plans)."""
    cfg = sharding.sharded_state(cfg)
    if cfg.train.update_on == "auto" and cfg.train.early_state_groups not in ("auto", 0):  # (a device update's)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, update_on=DEVICE_UPDATE.name))
    lim = _limits_of(cfg, machine, devices)
    if cfg.train.fetch == "auto":
        return _either_fetch(cfg, lim, devices, attention, memo)
    train = cfg.train
    bf16 = train.compute_dtype == "bfloat16"
    per_dev_batch = train.batch_size // lim.n_dev if train.batch_size % lim.n_dev == 0 else train.batch_size
    shapes = Shapes.of(cfg.model, per_dev_batch, cfg.data.seq_len, train.compute_dtype, backend=lim.machine.backend)
    notes: list[str] = []
    headroom = _huge_group_headroom(shapes, lim, notes)
    if headroom:
        lim.gpu_usable -= headroom
    update_on, moment_bytes, shapes = _update_on_rule(cfg, shapes, lim, bf16)
    if update_on.on_device and lim.n_dev > 1 and lim.on_gpu and lim.gpu_usable is not None and not headroom:
        headroom = _split_update_headroom(shapes, lim, notes)
    if update_on.on_device and lim.n_dev > 1:
        sharding.check_device_update(cfg, lim.n_dev)
    if train.update_on == "auto" and lim.on_gpu and _device_update_runs(cfg, bf16) \
            and (lim.n_dev == 1 or sharding.device_update_several(cfg)):
        return _both_updates(cfg, update_on, lim.machine, devices, attention, memo)
    stream_copy = _stream_copy(cfg, shapes, lim, update_on, moment_bytes, bf16)
    device_cast = bf16 and not stream_copy.on_host
    optax = optax_update_cost(cfg) if cfg.optim.kernel == "optax" else None
    costs = PlacementCosts(cfg, shapes, lim.machine, lim.n_dev, lim.gpu_budget, update_on, moment_bytes,
                           stream_bytes=2 if (bf16 and not device_cast) else 4, host_copy=bf16 and not device_cast,
                           rates=lim.rates, attention=attention,
                           # an optax update on the host (every group, or with a device-side update the embedding
                           # and head that stream_io makes in host memory) runs on the jax CPU device: its group's
                           # inputs, outputs and temporaries in host memory
                           optax_group=optax.device_group if optax is not None else 0.0, optax_cost=optax, memo=memo)
    found, attn_info = _search_placement(cfg, costs, lim, device_cast)
    placed = found.best
    notes.extend(placed.notes)
    gpu_rows, n_keep, n_early = _gpu_peak(cfg, costs, lim, found, headroom, notes)
    slabs, rows = _slabs_and_host_rows(cfg, costs, lim, placed)
    return _assemble(cfg, costs, lim, found, attn_info, rows=rows, gpu_rows=gpu_rows, slabs=slabs, n_keep=n_keep,
                     n_early=n_early,
                     stream_copy=stream_copy, notes=notes)


def _either_fetch(cfg: Config, lim: _Limits, devices: int | None, attention: bool, memo: PlanMemo) -> Plan:
    """``train.fetch=auto``: with several GPUs of one process both fetches are planned and split taken unless full
    is faster by UPDATE_SWITCH_TOL (split's links carry 1/N of each block, so the step model's transfer term is
    never larger; measured 1.8% faster at Qwen2.5-7B 4 x 128 x 1024 and the same at 4 x 32 x 1024, four H200s,
    experiments/bench_data_parallel.py); full on one GPU, and across the processes of a replicated store (each process's
    GPUs would gather from the others over the network: measured only with full)."""
    def planned(fetch: Fetch) -> Plan:
        return _make_plan(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, fetch=fetch.name)),
                          lim.machine, devices, attention, memo)

    if lim.n_dev == 1 or process_count() > 1:
        return planned(FULL_FETCH)
    return _faster(planned(SPLIT_FETCH), planned(FULL_FETCH), "fetch")


def _split_update_headroom(shapes: Shapes, lim: _Limits, notes: list[str]) -> float:
    """GPU bytes kept free beyond the phases where several GPUs split a device-side update (engine/shards.py): the
    same fragmentation margin as a huge group's, two fp32 copies of the largest group. Measured without it (4 x
    H100, Llama-2-70B 8 x 4096 per GPU): three steps at 4,279 tok/s, then one GPU could not find 6.66 GiB for the
    block backward's temporary with the plan at 75.3 of 81.2 GB, and the other GPUs waited for it in a collective.
    Whether this margin suffices is not yet measured."""
    headroom = 2 * 4.0 * shapes.largest_group
    lim.gpu_usable -= headroom
    notes.append(f"GPU: {headroom / GB:.1f} GB kept free beyond the phases where {lim.n_dev} GPUs split the device-side "
                 "update (a fragmentation margin: the block backward's one-piece temporary)")
    return headroom


def _huge_group_headroom(shapes: Shapes, lim: _Limits, notes: list[str]) -> float:
    """GPU bytes kept free beyond the phases where a group is over HUGE_GROUP parameters (0 elsewhere): a margin
    for fragmentation, where single allocations are many GB. The 110B lean shape's block backward asks for one
    10.8 GB temporary (XLA's buffer assignment), which must find one free piece among 5.4 GB accumulators
    and 2.7 GB held gradients; in a 12-layer slice of that shape the least largest free piece was 18.7 GB with
    30.7 GB free (probe_gpu_fragmentation.py). The run that ran out of GPU memory on that request had XLA's default pool (0.75 of
    the GPU, the plan's budgets never applied: optim/costs.py), not a plan error; whether this margin is needed
    is not measured, and the 110B ran within it (GPU peak 108.9 of a planned 122.8 GB, bench_memory_plan.py)."""
    if not (lim.on_gpu and lim.gpu_usable is not None and shapes.largest_group > HUGE_GROUP):
        return 0.0
    headroom = 2 * 4.0 * shapes.largest_group
    notes.append(f"GPU: {headroom / GB:.1f} GB kept free beyond the phases for groups over "
                 f"{HUGE_GROUP / 1e9:.0f}B parameters (a fragmentation margin: the block backward's one-piece temporary)")
    return headroom


def _update_on_rule(cfg: Config, shapes: Shapes, lim: _Limits, bf16: bool) -> tuple[UpdatePlace, float, Shapes]:
    """Where the update runs by the rule (``update_on=auto`` may then plan both: ``_both_updates``), the optimizer
    state's host bytes per parameter, and the shapes with an optax transformation's device temporaries (its state
    and temporaries from its own init/step)."""
    train, optim = cfg.train, cfg.optim
    moment_bytes = MOMENT_BYTES[optim.moments]
    update_on = choose.choose_update_on(train.update_on, on_gpu=lim.on_gpu, devices=lim.n_dev, kernel=optim.kernel,
                                        moments=optim.moments, bf16=bf16, stream_copy=train.stream_copy)
    if optim.kernel == "optax":
        cost = optax_update_cost(cfg)
        moment_bytes = cost.host_state
        shapes = dataclasses.replace(shapes, update_temp=cost.device_temp, update_chunked=cost.chunked)
        if train.update_on == "auto":
            several = lim.n_dev if (lim.n_dev == 1 or not sharding.device_update_several(cfg)) \
                else 1  # (every GPU alike)
            update_on = UPDATE_PLACES[auto_update_on(cost, on_gpu=lim.on_gpu, devices=several, moments=optim.moments,
                                                     bf16_host_copy=bf16 and _host_copy_asked(cfg))]
    return update_on, moment_bytes, shapes


def _both_updates(cfg: Config, rule: UpdatePlace, machine: Machine, devices: int | None, attention: bool,
                  memo: PlanMemo) -> Plan:
    """``update_on=auto``: both placements of the update are planned and the faster fitting one taken (steps within
    UPDATE_SWITCH_TOL equal: then the one the rule names, the measured path; a note names the other). A device-side
    update carries its state in flight and must hold every gradient (or resweep) on a small GPU; a host update waits
    for the norm with the host's cores: neither wins everywhere (issue 43)."""
    train, optim = cfg.train, cfg.optim
    other = HOST_UPDATE if rule.on_device else DEVICE_UPDATE
    mine = _make_plan(dataclasses.replace(cfg, train=dataclasses.replace(train, update_on=rule.name)), machine,
                      devices, attention, memo)
    if not rule.on_device and optim.kernel == "fused" and optim.moments == "float32" and mine.found.best.fits \
            and mine.settings.devices == 1:
        return mine  # fp32 moments on one GPU: 16 bytes/param more over PCIe, not measured to pay; tried where
        #              the host update does not fit (several GPUs split it: each link carries its share)
    alt = _make_plan(dataclasses.replace(cfg, train=dataclasses.replace(train, update_on=other.name)), machine,
                     devices, attention, memo)
    return _faster(mine, alt, "update_on")


def _stream_copy(cfg: Config, shapes: Shapes, lim: _Limits, update_on: UpdatePlace, moment_bytes: float,
                 bf16: bool) -> StreamCopy:
    """What streams with bf16 compute (``train.stream_copy``): the fp32 master for a device-side update; ``auto``
    decided with the host room left by the store, the runtime at its largest (a preallocated pool's allocator
    table) and the fewest slabs."""
    if update_on.on_device and bf16:
        return DEVICE_CAST
    fixed = asked(STREAM_COPIES, cfg.train.stream_copy)
    if fixed is not None:
        return fixed
    m = lim.machine
    runtime_max = RUNTIME_HOST_BYTES["gpu" if lim.on_gpu else "cpu"] \
        + (XLA_FRACTION * m.gpu_bytes * BFC_TABLE_BYTES_PER_POOL_BYTE if lim.on_gpu and m.gpu_bytes else 0.0)
    store_bytes = shapes.params * (4.0 + moment_bytes)
    fewest_slabs = GRAD_SLABS_FEWEST * GRAD_SLAB_ELEMS * 4
    room = usable(lim.host_limit, HOST_MARGIN) - store_bytes - runtime_max - fewest_slabs
    return choose.choose_stream_copy(shapes, cfg.data.seq_len, cfg.model, lim.on_gpu, bf16, room, lim.rates["h2d"],
                                     lim.rates["matmul_bf16"])


def _search_placement(cfg: Config, costs: PlacementCosts, lim: _Limits,
                      device_cast: bool) -> tuple[search.Result, dict[str, Any] | None]:
    """The step's placement, searched (search.py) over every auto decision, and the attention path's summary."""
    train, shapes = cfg.train, costs.shapes
    micro_candidates = choose.micro_batch_candidates(train.micro_batches, shapes.batch, shapes.seq, lim.n_dev)
    cpu_only = not lim.on_gpu and lim.gpu_budget is None
    attn_info, attn_extra = _attention(cfg, shapes, micro_candidates[0], lim.on_gpu, lim.machine.target,
                                       costs.memo) if costs.attention else (None, None)
    ctx = search.Context(
        stream_bytes=costs.stream_bytes, device_cast=device_cast, attn=attn_extra,
        update_state_bytes=costs.moment_bytes if costs.update_on.on_device else None, gpu_usable=lim.gpu_usable,
        host_usable=lim.host_usable, host_of=costs.host_of, step_of=costs.step_of,
        update_shards=lim.n_dev if (costs.update_on.on_device and sharding.update_shards(cfg)) else 1,
        memo=costs.memo,
        hold_shards=lim.n_dev if costs.update_on.on_device else 1)  # (engine/device_updates: held split)
    axes = search.axes_of(train, micro_candidates, on_gpu=lim.on_gpu, cpu_only=cpu_only, update_on=costs.update_on,
                          devices=lim.n_dev, shares=sharding.update_shards(cfg))
    return search.search(shapes, axes, ctx), attn_info


def _gpu_peak(cfg: Config, costs: PlacementCosts, lim: _Limits, found: search.Result, headroom: float,
              notes: list[str]) -> tuple[list[Row], int, int]:
    """The chosen placement's GPU rows, the blocks whose forward residuals are kept and the groups whose update
    state crosses in the backward: each on top of the step's peak, as a huge group's headroom is (the chosen
    placement's phases and GPU need grow by them)."""
    train, optim, shapes, placed = cfg.train, cfg.optim, costs.shapes, found.best
    phases, gpu_rows, gpu_need = placed.phases, search.gpu_rows(found.shapes, found.ctx, placed), placed.gpu_need
    n_keep, per_block = choose.choose_keep_residuals(
        train.keep_residuals, shapes, on_gpu=lim.on_gpu, devices=lim.n_dev,
        act_on_gpu=placed.activations.on_gpu and placed.boundary_every == 1 and not placed.hold.is_resweep,
        moments=optim.moments, need=gpu_need, budget=lim.gpu_budget, gpu_usable=lim.gpu_usable,
        moe=bool(getattr(cfg.model, "num_experts", None)))
    if optim.kernel == "optax" and costs.update_on.on_device and train.keep_residuals == "auto" and n_keep:
        # an optax update on the GPU works on whole groups (no chunking): with the room filled by kept residuals
        # the 3B shape ran out of memory, and without them it was as fast (bench_memory_plan.py, H100): none kept
        notes.append(f"train.keep_residuals=auto: 0 with an optax update on the GPU (the room would keep {n_keep})")
        n_keep = 0
    n_early, n_keep = _early_state(cfg, costs, lim, placed, n_keep, per_block, gpu_need, notes)
    if n_keep:
        gpu_rows.append(Row("gpu", f"forward residuals of the last {n_keep} blocks", n_keep * per_block,
                            "their backward does not recompute them (train.keep_residuals)"))
        # on top of the step's peak, wherever the plan puts it: conservative (RESULTS.md: measured below it)
        phases["loss, residuals kept"] = max(phases.values()) + n_keep * per_block
        gpu_need = max(phases.values())
    if n_early:
        early = _early_bytes(cfg, costs, lim, n_early)
        gpu_rows.append(Row("gpu", f"update state of the first {n_early} groups, fetched in the backward", early,
                            "held until the next forward updates them (train.early_state_groups)"))
        phases["backward, early update state"] = max(phases.values()) + early  # (on top, as the residuals)
        gpu_need = max(phases.values())
    if headroom:  # (the search compared each candidate with the room less it: the same test as the verdict's)
        why = "groups over 1B parameters" if shapes.largest_group > HUGE_GROUP else "GPUs splitting the update"
        gpu_rows.append(Row("gpu", f"kept free for fragmentation ({why})", headroom,
                            f"two fp32 gradients' bytes of a {shapes.largest_group / 1e9:.2f}B-parameter group"))
        phases["peak + huge-group headroom"] = max(phases.values()) + headroom
        gpu_need = max(phases.values())
    placed.gpu_need = gpu_need  # the pool's table covers the residuals too
    return gpu_rows, n_keep, n_early


def _early_bytes(cfg: Config, costs: PlacementCosts, lim: _Limits, n_early: int) -> float:
    """GPU bytes (each GPU's) of the first ``n_early`` groups' master and state: its share with a split update."""
    shares = lim.n_dev if sharding.update_shards(cfg) else 1
    return (4 + costs.moment_bytes) * early_params(costs.shapes, n_early) / shares


def _early_state(cfg: Config, costs: PlacementCosts, lim: _Limits, placed: choose.Placement, n_keep: int,
                 per_block: float, need: float, notes: list[str]) -> tuple[int, int]:
    """``train.early_state_groups`` (choose_early_state): where a device-side update's state can cross in the
    backward, the groups that do and the kept residuals beside them; elsewhere none (asked for: refused). ``auto``
    keeps none until a GPU run measures it, and a note names what it predicts."""
    t = cfg.train
    applies = costs.update_on.on_device and not placed.hold.is_resweep and not placed.stream_io \
        and cfg.optim.kernel == "fused"
    if not applies and t.early_state_groups not in ("auto", 0):
        raise UserError("train.early_state_groups", "fetches the fused AdamW's device-side state during the "
                        f"backward, and this plan updates on the {costs.update_on.name} with grad_hold="
                        f"{placed.hold.name}, stream_io={placed.stream_io}, optim.kernel={cfg.optim.kernel}",
                        "set train.early_state_groups=auto (or 0)")
    if not applies or (t.early_state_groups == "auto" and not (lim.on_gpu and lim.gpu_usable is not None)):
        return 0, n_keep  # (auto: on a GPU, whose room it takes; asked for, anywhere)
    room = choose.gpu_room(need, lim.gpu_budget, lim.gpu_usable, cfg.optim.moments) \
        if lim.gpu_usable is not None else float("inf")

    def step_of(kept: int, k: int) -> float:
        return costs.predicted_step(placed, kept, k)["predicted_step_s"]

    k, kept = choose.choose_early_state(
        t.early_state_groups, groups=costs.shapes.layers + 2, n_keep=n_keep, keep_auto=t.keep_residuals == "auto",
        per_block=per_block, room=room, group_bytes=lambda j: _early_bytes(cfg, costs, lim, j), step_of=step_of)
    if t.early_state_groups == "auto" and k:  # offered only: on 4 H200s it ran 2.5% faster where the model said 19%
        #                                        (docs/design.md 7.7), too far off to choose by
        notes.append(f"train.early_state_groups=auto: 0 (the predicted gain is overstated: 19% predicted, 2.5% "
                     f"measured on 4 H200s); {k} (kept residuals {n_keep} -> "
                     f"{kept}) predicts {step_of(kept, k):.2f} s against {step_of(n_keep, 0):.2f} s: set "
                     f"train.early_state_groups={k} to try it")
        return 0, n_keep
    return k, kept


def _slabs_and_host_rows(cfg: Config, costs: PlacementCosts, lim: _Limits,
                         placed: choose.Placement) -> tuple[int, list[Row]]:
    """The pinned gradient slabs the host has room for (choose_slabs; fewer while the pinned pool's growth with
    them does not fit) and the host rows with them."""
    fewest = costs.rows_of(placed, GRAD_SLABS_FEWEST)
    slabs = choose.choose_slabs(cfg.train.grad_slabs, chunked=costs.chunked, on_gpu=lim.on_gpu,
                                moments=cfg.optim.moments,
                                host_room=usable(lim.host_limit, HOST_MARGIN) - sum(r.bytes for r in fewest)
                                + GRAD_SLABS_FEWEST * costs.slab * costs.has_slabs(placed), slab_bytes=costs.slab)
    rows = costs.rows_of(placed, slabs)
    while slabs > GRAD_SLABS_FEWEST and sum(r.bytes for r in rows) > usable(lim.host_limit, HOST_MARGIN):
        slabs -= 1  # the pinned pool's growth with more slabs must fit too
        rows = costs.rows_of(placed, slabs)
    return slabs, rows


def _assemble(cfg: Config, costs: PlacementCosts, lim: _Limits, found: search.Result,
              attn_info: dict[str, Any] | None, *, rows: list[Row], gpu_rows: list[Row], slabs: int, n_keep: int,
              n_early: int,
              stream_copy: StreamCopy, notes: list[str]) -> Plan:
    """The plan of the chosen placement: its XLA settings, the engine's options, the rows, the predicted step."""
    train, optim, placed = cfg.train, cfg.optim, found.best
    gpu_need = placed.gpu_need
    _, gpu_mem_fraction, preallocate = xla_pool(lim.machine, lim.gpu_budget, gpu_need, lim.n_dev)
    host_need = sum(r.bytes for r in rows)
    if lim.host_avail < host_need <= usable(lim.host_limit, HOST_MARGIN):
        notes.append(f"host: only {lim.host_avail / GB:.1f} GB is available now ({lim.host_source} limit "
                     f"{lim.host_limit / GB:.1f} GB) and the plan needs {host_need / GB:.1f} GB: other processes hold "
                     "the rest; free it, or the run may be killed")
    disk, disk_need = disk_rows(cfg, costs.shapes.params, costs.moment_bytes)
    step = costs.predicted_step(placed, n_keep, n_early)
    settings = choose.RuntimeSettings(
        attention=attn_info["impl"] if attn_info else None,
        attention_summary=attn_info["summary"] if attn_info else None, moments=optim.moments, devices=lim.n_dev,
        pinned_pool_bytes=pinned_in_rows(rows),
        pinned_limit_bytes=pinned_limit(pinned_in_rows(rows), costs.pinned_chunk(placed)),
        gpu_mem_fraction=gpu_mem_fraction, gpu_preallocate=preallocate)
    options = EngineOptions(compute_dtype=train.compute_dtype, micro_batches=placed.micro_batches,
                            loss_chunk=placed.loss_chunk, clip_norm=optim.clip_norm, skip_nonfinite=True,
                            activations=placed.activations.name, grad_hold=placed.hold.name, grad_slabs=slabs,
                            grad_slab_elems=GRAD_SLAB_ELEMS if costs.chunked else None, stream_copy=stream_copy.name,
                            update_on=costs.update_on.name, fetch=train.fetch, host_state=train.host_state,
                            keep_residuals=n_keep, early_state_groups=n_early, devices=train.devices,
                            device_update_chunk=DEVICE_UPDATE_CHUNK, seq_tile=placed.seq_tile,
                            grad_hold_gpu_groups=placed.grad_hold_gpu_groups, stream_io=placed.stream_io,
                            activations_gpu_blocks=placed.activations_gpu_blocks,
                            boundary_every=placed.boundary_every, vocab_chunk=IO_VOCAB_CHUNK,
                            blocks_queued=placed.blocks_queued)
    m = lim.machine
    plan = Plan(rows=rows + gpu_rows + disk, settings=settings, options=options, host_need=host_need,
                host_limit=lim.host_limit, host_available=lim.host_avail, host_source=lim.host_source,
                gpu_need=gpu_need if lim.gpu_budget else None, gpu_budget=lim.gpu_budget, gpu_phases=placed.phases,
                disk_need=disk_need, disk_free=m.disk_free.get(train.out_dir) if m.disk_free else None,
                step=step, params=costs.shapes.params, machine=m, notes=notes,
                step_basis=step_basis(m), search=search_summary(found))
    plan.found = found  # the search itself (not a field: not in the JSON): what tests re-check
    return plan


HUGE_GROUP = 1.0e9  # parameters of a group above which the GPU keeps two of its fp32 gradients' bytes free
#                     (_huge_group_headroom: a fragmentation margin)
UPDATE_SWITCH_TOL = 0.05  # the other placement of the update is taken over the rule's where predicted this much faster


def _device_update_runs(cfg: Config, bf16: bool) -> bool:
    """Whether a device-side update can run this config (one GPU is checked by the caller): no host bf16 copy
    streams, and the optimizer has a device form (the fused AdamW's, or an optax transformation's)."""
    if bf16 and _host_copy_asked(cfg):
        return False
    return cfg.optim.kernel == "fused" or optax_update_cost(cfg).runs_on_device


def _host_copy_asked(cfg: Config) -> bool:
    """Whether the config asks for the bf16 streaming copy on the host (``train.stream_copy=host``)."""
    fixed = asked(STREAM_COPIES, cfg.train.stream_copy)
    return fixed is not None and fixed.on_host


def _faster(mine: Plan, alt: Plan, option: str) -> Plan:
    """Of two plans differing in one option (``update_on`` or ``fetch``; ``mine``: the rule's), the one to take: the
    only one that fits; of two, the other where it is faster by UPDATE_SWITCH_TOL, else the rule's (its path is the
    measured one: a device-side update with fp32 moments was not measured to pay, docs/design.md); of none, the
    rule's where its search found a candidate, else the other's (the nearer refusal)."""
    ok_mine, ok_alt = refusal.fits(mine), refusal.fits(alt)
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
    if refusal.fits(other):
        pick.notes.append(f"train.{option}=auto: {getattr(pick.options, option)} (predicted step "
                          f"{pick.step['predicted_step_s']:.2f} s, host {pick.host_need / GB:.1f} GB; "
                          f"{getattr(other.options, option)}: {other.step['predicted_step_s']:.2f} s, "
                          f"{other.host_need / GB:.1f} GB)")
    return pick


def search_summary(found: search.Result) -> dict[str, Any]:
    """What the search tried and, where nothing fit, the candidate that came closest."""
    b, room = found.best, found.ctx.gpu_usable if found.ctx else None
    on_gpu = [c for c in found.candidates if room is None or c.gpu_need <= room]
    # where no candidate fits the GPU, the closest is the one that needs the least of it
    near = None if on_gpu or b.fits else min(found.candidates, key=lambda c: c.gpu_need, default=None)
    closest = {} if near is None or near.gpu_need >= b.gpu_need else \
        {"closest": search.describe(near), "closest_gpu_need": near.gpu_need}
    return {"tried": found.tried, "fitting": found.fitting, "chosen": search.describe(b), "fits": b.fits, **closest,
            "gpu_need": b.gpu_need, "host_need": b.host_need, "predicted_step_s": b.step.get("predicted_step_s"),
            # whether any candidate fits the GPU (none: the GPU, not the host, is what refuses), and the least
            # host need among those that do (the host limit a refusal names is planned from it)
            "gpu_fits_any": bool(on_gpu), "least_host_on_gpu": min((c.host_need for c in on_gpu), default=None)}


def _attention(cfg: Config, shapes: Shapes, first_micro: int, on_gpu: bool, target: bool, memo: PlanMemo):
    """The attention path (attention.py) and its working set beyond what the coefficients include. A
    described GPU (``target``) has cuDNN with the pre-Hopper head-dim limit (128), whatever this machine has.
    The working set's function is the memo's for its inputs: searches share GPU phases by it (search._phases)."""
    from megatrain_jax import attention as attn_mod

    m, backend = cfg.model, "gpu" if on_gpu else "cpu"
    limit = 128 if (target and on_gpu) else None

    def describe(batch: int) -> dict[str, Any]:
        return attn_mod.describe(m, cfg.data.seq_len, cfg.train.compute_dtype, backend, batch=batch,
                                 doc_masking=cfg.data.doc_masking, cudnn_max_head_dim=limit)

    def new_extra() -> Callable[[int], tuple[float, str]]:
        cache: dict[int, tuple[float, str]] = {}

        def extra(batch: int) -> tuple[float, str]:
            if batch not in cache:  # the search asks for the same few batches many times
                d = describe(batch)
                cache[batch] = float(max(d["extra_over_cudnn_bytes"], 0)), d["impl"]
            return cache[batch]
        return extra

    key = ("attention", repr(m), cfg.data.seq_len, cfg.train.compute_dtype, backend, cfg.data.doc_masking, limit)
    return describe(max(shapes.batch // first_micro, 1)), memo.once(key, new_extra)

