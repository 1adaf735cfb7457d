"""Several GPUs and processes: what they allow of the update and of the host state.

A device-side update over several GPUs is split between them where it is elementwise, and with several processes
each process's GPUs update only their shares: the same refusals as the engine's, made before anything is planned.
``train.host_state=sharded`` fixes where the update runs and how the blocks are fetched. ``build`` asks these
questions of every config it plans; they are a unit of their own (what a config may ask of several devices), apart
from the placement arithmetic.
"""
from __future__ import annotations

import dataclasses

from megatrain_jax.config import Config
from megatrain_jax.errors import UserError
from megatrain_jax.placements import (GRAD_HOLD, HOST_STATES, SPLIT_FETCH, DEVICE_UPDATE, UPDATE_PLACES,
                                      asked)
from megatrain_jax.plan.lora import refuse_lora_sharded
from megatrain_jax.plan.machine import process_count


def update_shards(cfg: Config) -> bool:
    """With several GPUs a device-side update splits each group between them (each its share: engine/shards.py)
    where it is elementwise (the fused AdamW); an optax transformation works on whole tensors: every GPU runs it
    alike."""
    return cfg.optim.kernel == "fused"


def device_update_several(cfg: Config) -> bool:
    """``update_on=auto`` may plan a device-side update over several GPUs: one process, and no pageable hold asked
    for where the update is split (``check_device_update``)."""
    return (process_count() == 1 or _sharded(cfg)) and not (update_shards(cfg) and _pageable_hold(cfg))


def check_device_update(cfg: Config, n_dev: int) -> None:
    """``update_on=device`` with several GPUs: the same refusals as the engine's (engine/updaters.DeviceUpdates)."""
    if update_shards(cfg) and _pageable_hold(cfg):
        raise UserError("train.grad_hold", f"{cfg.train.grad_hold} keeps whole gradients in pageable host memory, and "
                        f"with {n_dev} GPUs updating on the device each holds only its share",
                        "set train.grad_hold to gpu_bf16, pinned_bf16 or resweep (or auto)")
    if process_count() > 1 and not _sharded(cfg):
        raise UserError("train.update_on", "device with several processes needs train.host_state=sharded (with a "
                        "replica in each, each process's GPUs would update only their shares of it)",
                        "set train.host_state=sharded, or train.update_on=host (or auto)")


def sharded_state(cfg: Config) -> Config:
    """``train.host_state=sharded``: each process backs only its GPUs' shares of the store, so its GPUs must update
    and fetch exactly those (update_on=device, fetch=split, no stream_io; the fused AdamW, whose update is
    elementwise). Settings left auto are set so; a setting that contradicts it is refused in one line."""
    t = cfg.train
    if not _sharded(cfg):
        return cfg
    fix = "or set train.host_state=replicated"
    update = asked(UPDATE_PLACES, t.update_on)
    if update is not None and not update.on_device:
        raise UserError("train.update_on", "host cannot update a sharded host state (each process backs only its "
                        "GPUs' shares, and they update them)", f"set train.update_on=device (or auto), {fix}")
    if t.stream_io is True:
        raise UserError("train.stream_io", "true makes the embedding's and head's gradients whole in host memory, and "
                        "a sharded host state holds only this process's shares", f"set train.stream_io=auto, {fix}")
    if cfg.optim.kernel != "fused":
        raise UserError("train.host_state", f"sharded splits each update elementwise, which {cfg.optim.name} "
                        f"(optim.kernel={cfg.optim.kernel}) is not", f"use optim.name=adamw, {fix}")
    refuse_lora_sharded(cfg)
    return dataclasses.replace(cfg, train=dataclasses.replace(t, update_on=DEVICE_UPDATE.name, fetch=SPLIT_FETCH.name,
                                                              stream_io=False))


def _sharded(cfg: Config) -> bool:
    return HOST_STATES[cfg.train.host_state].sharded


def _pageable_hold(cfg: Config) -> bool:
    """Whether the config asks for a hold in pageable host memory (whole gradients there)."""
    hold = asked(GRAD_HOLD, cfg.train.grad_hold)
    return hold is not None and hold.pageable
