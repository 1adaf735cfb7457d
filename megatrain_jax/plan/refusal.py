"""The verdict: the first thing that does not fit, as one line, with a fix that would make it fit.

A fix never names a change that leaves the run refused: a state mode is named only where its plan
fits, fewer tokens only at a batch or sequence length whose plan fits, and where nothing this
machine allows fits, the refusal says so and what host would hold the model.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from megatrain_jax.config import Config
from megatrain_jax.errors import UserError
from megatrain_jax.plan.decisions import MODES, mode_settings
from megatrain_jax.plan.sizes import GB, GPU_MARGIN, HOST_MARGIN, XLA_FRACTION, GiB, usable
from megatrain_jax.plan.units import size_text

MIN_SEQ = 64  # the shortest sequence a fix proposes (below it, the model is what does not fit)


def verdict(p) -> UserError | None:
    """The first thing of plan ``p`` that does not fit (host, GPU, disk), or None. Where no placement the
    search tried fits the GPU at all, the GPU is what refuses, whatever the host needs."""
    gpu_first = not p.search.get("gpu_fits_any", True) and not fits_gpu(p)
    if not p.fits_host() and not gpu_first:
        return _host_refusal(p)
    if not fits_gpu(p):
        phase = max(p.gpu_phases, key=p.gpu_phases.get)
        room = usable(p.gpu_budget, GPU_MARGIN)
        closest = p.search.get("closest", p.search.get("chosen", ""))
        need = p.search.get("closest_gpu_need", p.gpu_need)
        at = f" at its peak ({phase})" if need == p.gpu_need else ""
        return UserError("GPU memory", f"no placement the plan tried ({p.search.get('tried', 0)}) fits the "
                         f"{p.gpu_budget / GB:.1f} GB budget; the closest ({closest}) needs {need / GB:.1f} GB"
                         f"{at}, {(need - room) / GB:.1f} GB more than the "
                         f"{room / GB:.1f} GB the budget leaves after a {GPU_MARGIN[0]:.0%} + "
                         f"{GPU_MARGIN[1] / GiB:.0f} GiB margin", p.fix or "a GPU with more memory")
    if p.disk_free is not None and p.disk_need > p.disk_free:
        return UserError("disk", f"checkpoints/export need {size_text(p.disk_need)} but {size_text(p.disk_free)} "
                         f"is free where they go", "train.ckpt_every=0 and train.final_checkpoint=false, a lower "
                         "train.keep_last, or another train.out_dir")
    return None


def fits_gpu(p) -> bool:
    return p.gpu_budget is None or p.gpu_need is None or p.gpu_need <= usable(p.gpu_budget, GPU_MARGIN)


def fits(p) -> bool:
    """Host and GPU both (what a fix must achieve; disk is another refusal with its own fix)."""
    return p.fits_host() and fits_gpu(p)


DETECTED = ("MemTotal",)  # host limits read off this machine (a cgroup's too): the override note applies


def _host_refusal(p) -> UserError:
    short = p.host_need - usable(p.host_limit, HOST_MARGIN)
    if p.tokens_short:  # the tokens per step, not the parameters, are what the host cannot hold
        size = (f"{p.token_bytes / GB:.1f} GB of it grows with the tokens per step (data.seq_len x "
                f"train.batch_size), for {p.params / 1e9:.2f}B parameters")
    else:
        size = f"{p.host_bytes_per_param:.1f} bytes/param for {p.params / 1e9:.2f}B parameters"
    fixes = [p.fix or "a machine with more memory"]
    if p.host_source in DETECTED or p.host_source.startswith("cgroup"):  # read off this machine: it may be misread
        fixes.append("or train.host_memory_gb=N if this machine's limit is misread")
    closest = f"; closest placement: {p.search['chosen']}" if p.search and not p.search.get("fits", True) else ""
    return UserError("host memory", f"the plan needs {p.host_need / GB:.1f} GB ({size}{closest}) but the limit is "
                     f"{p.host_limit / GB:.1f} GB ({p.host_source}; {short / GB:.1f} GB short after a "
                     f"{HOST_MARGIN[0]:.0%} + {HOST_MARGIN[1] / GiB:.0f} GiB safety margin)", ", ".join(fixes))


def host_limit_needed(need: float) -> float:
    """The host limit whose usable part (after HOST_MARGIN) holds ``need``."""
    return (need + HOST_MARGIN[1]) / (1 - HOST_MARGIN[0])


# the decisions a user may fix that the plan searches when left auto, with the value a plan took for each
AUTO_SETTINGS = ("grad_hold", "update_on", "activations", "stream_io", "boundary_every", "micro_batches",
                 "stream_copy", "keep_residuals", "activations_gpu_blocks", "grad_slabs")
SEARCHED = AUTO_SETTINGS  # (the older name)
GPU_SIZES = (10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 94, 141, 192, 288)  # GB of GPUs a fix may name
MAX_ALTERNATIVES = 3
LION_INT8 = {"moments": "int8"}  # Lion's leaner state (its one moment in int8)


def decided(plan, name: str) -> str:
    """The value plan ``plan`` took for setting ``train.<name>``, as a user types it."""
    o = plan.options
    value = {"grad_hold": o.grad_hold, "update_on": o.update_on, "activations": o.activations,
             "stream_io": o.stream_io, "boundary_every": o.boundary_every,
             # (the engine's count is per GPU; train.micro_batches is the step's, split over the GPUs)
             "micro_batches": o.micro_batches * max(plan.settings.devices, 1),
             "stream_copy": o.stream_copy, "keep_residuals": o.keep_residuals,
             "activations_gpu_blocks": o.activations_gpu_blocks, "grad_slabs": o.grad_slabs}[name]
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def with_train(cfg: Config, **change) -> Config:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **change))


def with_mode(cfg: Config, over: dict[str, str]) -> Config:
    """``cfg`` in a state mode (MODES: moments and the streaming copy), its kept residuals left to the plan."""
    t = dataclasses.replace(cfg.train, stream_copy=over.get("stream_copy", cfg.train.stream_copy),
                            keep_residuals="auto")
    return dataclasses.replace(cfg, train=t, optim=dataclasses.replace(cfg.optim, moments=over["moments"]))


def shaped(cfg: Config, batch: int, length: int) -> Config:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=batch),
                               data=dataclasses.replace(cfg.data, seq_len=length))


def find_fix(cfg: Config, plan, replan: Callable[..., Any]) -> tuple[str, float | None]:
    """The fix of a refusal, every alternative it names checked by planning the user's own config with that
    change (``replan(cfg, machine=None)``) and named only where that plan fits host and GPU. In order, the first
    kind that fits: a setting the user fixed, given back to the plan (named as the value it takes); a leaner state
    mode than the one chosen (fused AdamW); fewer tokens per step; a bigger machine (the least host limit that
    fits this config as it is, or a GPU with more memory). Returns (fix, the host bytes that grow with the
    tokens when fewer tokens are the fix and they are most of the need, else None)."""
    replan = _memo(replan)

    def planned(c: Config, machine=None):
        try:
            q = replan(c, machine)
        except UserError:  # a setting of the config refuses this variant (e.g. kept residuals): not a fix
            return None
        return q if fits(q) else None

    gpu_cause = not plan.search.get("gpu_fits_any", True) and not fits_gpu(plan)
    fixes = _settings_fixes(cfg, plan, planned)
    if fixes:
        return _join(fixes), None
    modes = _leaner_modes(cfg)
    for over in modes:
        lean = with_mode(cfg, over)
        q = planned(lean)
        if q is not None:
            name = next((k for k, v in MODES.items() if v == over), "int8 Lion")
            return _join([f"{mode_settings(over)} ({name}: {q.host_bytes_per_param:.1f} bytes/param, "
                          f"{q.host_need / GB:.1f} GB)"]), None
        freed = _settings_fixes(lean, plan, planned)
        if freed:
            return _join([f"{mode_settings(over)} {x}" for x in freed]), None
    fewer = _fewer_tokens(cfg, plan, planned, [None] + modes)
    if fewer:
        token_bytes = None
        if not gpu_cause:
            n_dev = plan.settings.devices
            smallest = planned_any(replan, shaped(cfg, min(_batch_step(cfg, n_dev), cfg.train.batch_size),
                                                  min(cfg.data.seq_len, MIN_SEQ)))
            if smallest is not None:
                grow = plan.host_need - smallest.host_need
                token_bytes = grow if grow > 0.5 * plan.host_need else None
        return fewer, token_bytes
    return _bigger_machine(cfg, plan, planned, replan, gpu_cause), None


def _memo(replan: Callable[..., Any]) -> Callable[..., Any]:
    """``replan`` once per (config, machine): the kinds of fix try many of the same variants."""
    seen: dict[tuple[str, str], Any] = {}

    def cached(c: Config, machine=None):
        key = (repr(c), repr(machine))
        if key not in seen:
            try:
                seen[key] = replan(c, machine)
            except UserError as e:
                seen[key] = e
        if isinstance(seen[key], UserError):
            raise seen[key]
        return seen[key]
    return cached


def planned_any(replan, c):
    """``replan(c)`` whether it fits or not (None where a setting refuses it)."""
    try:
        return replan(c, None)
    except UserError:
        return None


def _join(alternatives: list[str]) -> str:
    return ", or ".join(alternatives[:MAX_ALTERNATIVES]) + " fits"


def _fixed(cfg: Config) -> list[str]:
    return [f for f in AUTO_SETTINGS if getattr(cfg.train, f) != "auto"]


def _all_auto(cfg: Config) -> Config | None:
    fixed = _fixed(cfg)
    return with_train(cfg, **{f: "auto" for f in fixed}) if fixed else None


def _settings_fixes(cfg: Config, plan, planned) -> list[str]:
    """Each setting the user fixed that, given back to the plan, lets it fit: named as the value the plan then
    takes; where no single one does, all of them together."""
    fixed = _fixed(cfg)
    out = []
    for f in fixed:
        q = planned(with_train(cfg, **{f: "auto"}))
        if q is not None:
            out.append(f"train.{f}={decided(q, f)}")
    if not out and len(fixed) > 1:
        q = planned(_all_auto(cfg))
        if q is not None:
            out.append(" ".join(f"train.{f}={decided(q, f)}" for f in fixed if decided(q, f) != str(getattr(cfg.train, f)).lower()))
    return [x for x in out if x]


def _leaner_modes(cfg: Config) -> list[dict[str, str]]:
    """The state modes leaner than the configured moments (the fused AdamW's; none for other optimizers)."""
    if cfg.optim.kernel != "fused":  # (Lion through optax has int8 moments: optim/lean.lion_int8)
        return [LION_INT8] if (cfg.optim.name, cfg.optim.moments) == ("lion", "float32") else []
    order = list(MODES.values())
    current = {"float32": 0, "bfloat16": 1}.get(cfg.optim.moments, len(order))
    return order[current + 1:]


def _batch_step(cfg: Config, n_dev: int) -> int:
    micro = cfg.train.micro_batches if cfg.train.micro_batches != "auto" else 1
    return micro * n_dev // math.gcd(micro, n_dev)  # batch sizes must split into micro-batches and GPUs


def _variants(cfg: Config, modes) -> list[tuple[str, Config]]:
    """``cfg`` and its nearest changes, each with the settings that name it: as configured, the user's fixed
    settings given back to the plan, then each leaner state mode (``modes``: MODES overrides, None for none)."""
    out = []
    for over in modes:
        base = cfg if over is None else with_mode(cfg, over)
        label = "" if over is None else mode_settings(over)
        out.append((label, base))
        free = [f for f in _fixed(cfg) if f not in (over or {})]  # (a mode's own settings stay as it sets them)
        if free:
            out.append(((label + " " if label else "") + " ".join(f"train.{f}=auto" for f in free),
                        with_train(base, **{f: "auto" for f in free})))
    return out


def _fewer_tokens(cfg: Config, plan, planned, modes) -> str | None:
    """The most tokens per step that fit, as a halved batch and as a shorter sequence: as configured, else with the
    user's fixed settings given back to the plan, else in a leaner state mode (the first of these where any fits)."""
    train, seq = cfg.train, cfg.data.seq_len
    step = _batch_step(cfg, plan.settings.devices)
    min_batch, min_seq = min(step, train.batch_size), min(seq, MIN_SEQ)
    batches = _halvings(train.batch_size, min_batch, step)[1:]
    seqs = _halvings(seq, min_seq, 1)[1:]

    def first(base: Config, sizes, what: str) -> str | None:
        for b, n in sizes:
            if planned(shaped(base, b, n)) is not None:
                return f"{what}={b if what == 'train.batch_size' else n}"
        return None

    for label, base in _variants(cfg, modes):
        if (batches or seqs) and planned(shaped(base, min_batch, min_seq)) is None:
            continue  # (the fewest tokens do not fit this variant: no fewer tokens will)
        fewer = first(base, [(b, seq) for b in batches], "train.batch_size")
        shorter = first(base, [(train.batch_size, n) for n in seqs], "data.seq_len")
        if shorter is None and min_batch != train.batch_size:
            found = first(base, [(min_batch, n) for n in seqs], "data.seq_len")
            shorter = f"{found} with train.batch_size={min_batch}" if found else None
        found = [f for f in (fewer, shorter) if f]
        if found:
            return (f"{label} with " if label else "") + "fewer tokens per step: " \
                + (f"{found[0]} (or {found[1]})" if len(found) > 1 else found[0]) + " fits"
    return None


def _least_host(cfg: Config, replan, start_need: float) -> int | None:
    """The least host limit (whole GB) at which ``cfg`` fits, from a host need, checked by planning it there."""
    limit = math.ceil(host_limit_needed(start_need) / GB)
    for _ in range(6):  # auto decisions follow the host's room: the limit named is checked at that limit
        q = planned_any(replan, with_train(cfg, host_memory_gb=float(limit)))
        if q is None:
            return None
        if fits(q):
            return limit
        if fits_gpu(q) is False and not q.search.get("gpu_fits_any", True):
            return None  # the GPU, not the host, refuses it
        limit = max(limit + 1, math.ceil(host_limit_needed(q.host_need) / GB))
    return None


def _bigger_machine(cfg: Config, plan, planned, replan, gpu_cause: bool) -> str:
    """What machine fits this config: the least host limit (from the least host need of the placements that fit
    the GPU, checked by planning it), as configured, else with the fixed settings given back, else in the leanest
    mode; where no placement fits the GPU, the smallest GPU that does (with the host limit it then needs)."""
    modes = [None] + _leaner_modes(cfg)[-1:]
    variants = _variants(cfg, modes)
    shape = f"{cfg.train.batch_size} x {cfg.data.seq_len} tokens"
    found = []  # (limit, settings): the nearest to the config first, and the least limit where that is another
    for label, base in variants:
        q = plan if base is cfg else planned_any(replan, base)
        if q is None or not q.search.get("gpu_fits_any", True):
            continue
        limit = _least_host(base, replan, q.search.get("least_host_on_gpu") or q.host_need)
        if limit is not None:
            found.append((limit, label))
    if found:
        picks = [found[0]] + [f for f in [min(found)] if f[0] < found[0][0]]
        alts = [f"{label + ' with ' if label else ''}a host limit of {limit} GB or more (train.host_memory_gb={limit})"
                for limit, label in picks]
        return f"{_join(alts)}: this machine cannot hold this model at {shape}"
    gpu = gpu_fix(cfg, plan, lambda c, m: planned(c, m))
    if gpu:
        return gpu
    m = plan.machine
    sizes = [g for g in GPU_SIZES if g * GB > (m.gpu_bytes or 0)] if m.backend == "gpu" else []
    lean = variants[-1:]  # (the leanest variant: a GPU it needs is the least any needs)

    def on_gpu(size: int):
        bigger = dataclasses.replace(m, gpu_bytes=size * GB)
        for label, base in lean:
            q = planned_any(lambda c, _m=None: replan(c, bigger), base)
            if q is not None and q.search.get("gpu_fits_any", True):
                return bigger, label, base, q
        return None

    first = _first_true(sizes, on_gpu)  # (more GPU memory never makes a placement not fit the GPU)
    if first is not None:
        size, (bigger, label, base, q) = first
        limit = _least_host(base, lambda c, _m=None: replan(c, bigger), q.search.get("least_host_on_gpu")
                            or q.host_need)
        if limit is not None:
            return (f"{label + ' with ' if label else ''}a GPU with {size} GB and a host limit of {limit} GB "
                    f"or more fits: this machine cannot hold this model at {shape}")
    return f"nothing this plan can change fits: this machine cannot hold this model at {shape}"


def _first_true(items: list, test: Callable[[Any], Any]) -> tuple[Any, Any] | None:
    """The first of the sorted ``items`` whose ``test`` is not None (a bisection: a test that holds for an item
    holds for every later one), with that result."""
    lo, hi, found = 0, len(items) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        r = test(items[mid])
        if r is not None:
            found, hi = (items[mid], r), mid - 1
        else:
            lo = mid + 1
    return found


def fits_gpu_any(plan) -> bool:
    return plan.search.get("gpu_fits_any", True)


def _halvings(value: int, floor: int, multiple: int) -> list[int]:
    """value, then halvings rounded down to ``multiple``, down to ``floor``: [value, ..., floor]."""
    out = [value]
    while out[-1] > floor:
        nxt = max(floor, (out[-1] // 2) // multiple * multiple)
        if nxt >= out[-1]:
            break
        out.append(nxt)
    return out


def gpu_fix(cfg: Config, plan, planned: Callable[[Config, Any], Any]) -> str | None:
    """A bigger GPU for a GPU refusal, each checked by planning it (``planned(cfg, machine)``: None where it does
    not fit): a larger budget where this GPU has it, else a GPU with more memory."""
    train, m = cfg.train, plan.machine
    whole = m.gpu_bytes * XLA_FRACTION / GB if m.gpu_bytes else None
    if train.gpu_memory_gb and (whole is None or train.gpu_memory_gb < whole):
        sizes = [g for g in GPU_SIZES if train.gpu_memory_gb < g and (whole is None or g < whole)]
        for size in sizes + ([math.floor(whole)] if whole else []):
            if planned(with_train(cfg, gpu_memory_gb=float(size)), None) is not None:
                return f"train.gpu_memory_gb={size} fits"
    elif m.backend == "gpu":
        sizes = [g for g in GPU_SIZES if g * GB > (m.gpu_bytes or 0)]
        first = _first_true(sizes, lambda size: planned(cfg, dataclasses.replace(m, gpu_bytes=size * GB)))
        if first is not None:
            return f"a GPU with {first[0]} GB fits"
    return None
