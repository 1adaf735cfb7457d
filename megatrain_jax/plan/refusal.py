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

MIN_SEQ = 64  # the shortest sequence a fix proposes (below it, the model is what does not fit)


def verdict(p) -> UserError | None:
    """The first thing of plan ``p`` that does not fit (host, GPU, disk), or None."""
    if not p.fits_host():
        return _host_refusal(p)
    if not fits_gpu(p):
        phase = max(p.gpu_phases, key=p.gpu_phases.get)
        room = usable(p.gpu_budget, GPU_MARGIN)
        closest = p.search.get("chosen", "")
        return UserError("GPU memory", f"no placement the plan tried ({p.search.get('tried', 0)}) fits the "
                         f"{p.gpu_budget / GB:.1f} GB budget; the closest ({closest}) needs {p.gpu_need / GB:.1f} GB "
                         f"at its peak ({phase}), {(p.gpu_need - room) / GB:.1f} GB more than the "
                         f"{room / GB:.1f} GB the budget leaves after a {GPU_MARGIN[0]:.0%} + "
                         f"{GPU_MARGIN[1] / GiB:.0f} GiB margin", p.gpu_fix or "a GPU with more memory")
    if p.disk_free is not None and p.disk_need > p.disk_free:
        return UserError("disk", f"checkpoints/export need {p.disk_need / GB:.1f} GB but {p.disk_free / GB:.1f} GB "
                         f"is free where they go", "train.ckpt_every=0 and train.final_checkpoint=false, a lower "
                         "train.keep_last, or another train.out_dir")
    return None


def fits_gpu(p) -> bool:
    return p.gpu_budget is None or p.gpu_need is None or p.gpu_need <= usable(p.gpu_budget, GPU_MARGIN)


def fits(p) -> bool:
    """Host and GPU both (what a fix must achieve; disk is another refusal with its own fix)."""
    return p.fits_host() and fits_gpu(p)


def _host_refusal(p) -> UserError:
    short = p.host_need - usable(p.host_limit, HOST_MARGIN)
    if p.tokens_short:  # the tokens per step, not the parameters, are what the host cannot hold
        size = (f"{p.token_bytes / GB:.1f} GB of it grows with the tokens per step (data.seq_len x "
                f"train.batch_size), for {p.params / 1e9:.2f}B parameters")
    else:
        size = f"{p.host_bytes_per_param:.1f} bytes/param for {p.params / 1e9:.2f}B parameters"
    if p.suggestion:
        fixes = [f"{p.suggestion} fits"]
    elif p.host_fix:
        fixes = [p.host_fix]
    else:  # no search was made (make_plan(..., _modes=False)): name only what is surely leaner
        fixes = ["a machine with more memory"]
    if p.host_source != "train.host_memory_gb":
        fixes.append("or train.host_memory_gb=N if this machine's limit is misread")
    closest = f"; closest placement: {p.search['chosen']}" if p.search and not p.search.get("fits", True) else ""
    return UserError("host memory", f"the plan needs {p.host_need / GB:.1f} GB ({size}{closest}) but the limit is "
                     f"{p.host_limit / GB:.1f} GB ({p.host_source}; {short / GB:.1f} GB short after a "
                     f"{HOST_MARGIN[0]:.0%} + {HOST_MARGIN[1] / GiB:.0f} GiB safety margin)", ", ".join(fixes))


def host_limit_needed(need: float) -> float:
    """The host limit whose usable part (after HOST_MARGIN) holds ``need``."""
    return (need + HOST_MARGIN[1]) / (1 - HOST_MARGIN[0])


def host_fix(cfg: Config, plan, replan: Callable[[Config, dict | None], Any]) -> tuple[str, float | None]:
    """The fix of a host refusal that no state mode fixes at this batch and sequence length: the
    most tokens per step that fit (in the configured mode, else the fullest leaner one), or, where
    none fits, that this machine cannot hold the model and what host would. ``replan(cfg, mode)``
    plans a variant of the config on the same machine (``mode``: MODES overrides, or None). Returns
    (fix, the bytes that grow with the tokens when fewer tokens fit, else None)."""
    def planned(c: Config, over: dict | None):
        try:
            return replan(c, over)
        except UserError:  # a setting of the config refuses this shape (e.g. kept residuals): not a fix
            return None

    modes: list[tuple[str, dict | None]] = [("", None)]
    if cfg.optim.kernel == "fused":
        current = {"float32": 0, "bfloat16": 1}.get(cfg.optim.moments, len(MODES))
        modes += [(mode_settings(over), over) for over in list(MODES.values())[current + 1:]]
    train, seq = cfg.train, cfg.data.seq_len
    n_dev = plan.settings.devices
    micro = train.micro_batches if train.micro_batches != "auto" else 1
    step = micro * n_dev // math.gcd(micro, n_dev)  # batch sizes must split into micro-batches and GPUs
    min_batch, min_seq = min(step, train.batch_size), min(seq, MIN_SEQ)

    def shaped(batch: int, length: int) -> Config:
        return dataclasses.replace(cfg, train=dataclasses.replace(train, batch_size=batch),
                                   data=dataclasses.replace(cfg.data, seq_len=length))

    smallest = planned(shaped(min_batch, min_seq), None)
    token_bytes = plan.host_need - smallest.host_need if smallest is not None else 0.0
    lean_over = list(MODES.values())[-1] if cfg.optim.kernel == "fused" else None
    leanest = planned(shaped(min_batch, min_seq), lean_over)
    if leanest is None or not leanest.fits_host():
        floor = leanest or smallest
        need = floor.host_need if floor is not None else plan.host_need
        limit = math.ceil(host_limit_needed(need) / GB)
        for _ in range(4):  # auto decisions follow the host's room: check the limit named, at that limit
            bigger = dataclasses.replace(shaped(min_batch, min_seq), train=dataclasses.replace(
                train, batch_size=min_batch, host_memory_gb=limit))
            q = planned(bigger, lean_over)
            if q is None or q.fits_host():
                need = q.host_need if q is not None else need
                break
            limit = max(limit + 1, math.ceil(host_limit_needed(q.host_need) / GB))
        what = "even the leanest state mode" if lean_over else "the smallest batch and sequence"
        return (f"this machine cannot hold this model: {what} needs {need / GB:.1f} GB "
                f"({need / max(plan.params, 1):.1f} bytes/param at {min_batch} x {min_seq} tokens); a host limit of "
                f"{limit} GB or more would", None)

    batches = _halvings(train.batch_size, min_batch, step)
    seqs = _halvings(seq, min_seq, 1)
    def first_fit(candidates, over):
        for label, c in candidates:
            q = planned(c, over)
            if q is not None and fits(q):
                return label
        return None

    for settings, over in modes:
        fewer = first_fit([(f"train.batch_size={b}", shaped(b, seq)) for b in batches[1:]], over)
        shorter = first_fit([(f"data.seq_len={n}", shaped(train.batch_size, n)) for n in seqs[1:]], over)
        if shorter is None and min_batch != train.batch_size:
            shorter = first_fit([(f"data.seq_len={n} with train.batch_size={min_batch}", shaped(min_batch, n))
                                 for n in seqs[1:]], over)
        found = [f for f in (fewer, shorter) if f]
        if found:
            fix = (f"{settings} with " if settings else "") + "fewer tokens per step: " \
                + (f"{found[0]} (or {found[1]})" if len(found) > 1 else found[0])
            share = token_bytes / max(plan.host_need, 1.0)
            return fix + " fits", (token_bytes if share > 0.5 else None)
    return ("a machine with more memory", None)


def _halvings(value: int, floor: int, multiple: int) -> list[int]:
    """value, then halvings rounded down to ``multiple``, down to ``floor``: [value, ..., floor]."""
    out = [value]
    while out[-1] > floor:
        nxt = max(floor, (out[-1] // 2) // multiple * multiple)
        if nxt >= out[-1]:
            break
        out.append(nxt)
    return out


SEARCHED = ("micro_batches", "activations", "grad_hold", "stream_io", "boundary_every", "update_on")
GPU_SIZES = (10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 94, 141, 192, 288)  # GB of GPUs a fix may name


def gpu_fix(cfg: Config, plan, replan: Callable[[Config, Any], Any]) -> str:
    """The fix of a GPU refusal, each alternative checked by planning it (``replan(cfg, machine)``,
    None: the same machine) and named only where that plan fits host and GPU: the settings that
    restrict the search back to auto, fewer tokens per step, a larger budget where the GPU has it, a
    GPU with more memory."""
    def planned(c: Config, machine=None):
        try:
            q = replan(c, machine)
        except UserError:
            return None
        return q if q is not None and fits(q) else None

    train = cfg.train
    fixes: list[str] = []
    fixed = {f: getattr(train, f) for f in SEARCHED if getattr(train, f) != "auto"}
    if fixed:
        free = dataclasses.replace(cfg, train=dataclasses.replace(train, **{f: "auto" for f in fixed}))
        if planned(free) is not None:
            fixes.append(" ".join(f"train.{f}=auto" for f in fixed) + " (let the plan search)")
    n_dev = plan.settings.devices
    micro = train.micro_batches if train.micro_batches != "auto" else 1
    step = micro * n_dev // math.gcd(micro, n_dev)

    def shaped(batch: int, length: int) -> Config:
        return dataclasses.replace(cfg, train=dataclasses.replace(train, batch_size=batch),
                                   data=dataclasses.replace(cfg.data, seq_len=length))

    for b in _halvings(train.batch_size, min(step, train.batch_size), step)[1:]:
        if planned(shaped(b, cfg.data.seq_len)) is not None:
            fixes.append(f"fewer tokens per step: train.batch_size={b}")
            break
    else:
        for n in _halvings(cfg.data.seq_len, min(cfg.data.seq_len, MIN_SEQ), 1)[1:]:
            if planned(shaped(train.batch_size, n)) is not None:
                fixes.append(f"fewer tokens per step: data.seq_len={n}")
                break
    m = plan.machine
    whole = m.gpu_bytes * XLA_FRACTION / GB if m.gpu_bytes else None
    if train.gpu_memory_gb and (whole is None or train.gpu_memory_gb < whole):
        sizes = [g for g in GPU_SIZES if train.gpu_memory_gb < g and (whole is None or g < whole)]
        for size in sizes + ([math.floor(whole)] if whole else []):
            if planned(dataclasses.replace(cfg, train=dataclasses.replace(train, gpu_memory_gb=float(size)))):
                fixes.append(f"train.gpu_memory_gb={size}")
                break
    elif m.backend == "gpu":
        for size in [g for g in GPU_SIZES if g * GB > (m.gpu_bytes or 0)]:
            if planned(cfg, dataclasses.replace(m, gpu_bytes=size * GB)) is not None:
                fixes.append(f"a GPU with {size} GB")
                break
    return ", or ".join(fixes[:3]) + " fits" if fixes else "nothing this plan can change fits: a GPU with more memory"
