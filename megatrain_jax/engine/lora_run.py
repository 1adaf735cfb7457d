"""LoRA runs from a config: ``LoraTrainer`` answers the training loop as ``trainer.Trainer`` does
(``step``, ``step_count``, ``lr_at``, ``saver``, ``memory_device``, ``engine``, ``close``), so
``megatrain-jax train`` with ``model.lora`` set runs through the same loop, and ``LoraSaver`` writes
its checkpoints.

A checkpoint is ``checkpoints/step_N/`` (the full-training checkpoints' naming, so listing, pruning
and ``--resume`` find it): ``adapter/`` (the PEFT pair ``peft.PeftModel.from_pretrained`` loads),
``opt_state.npz`` (the optax state's leaves), ``state.json`` (step, optimizer count, data position,
RNG, config) and ``manifest.json`` written last with the crc32 of each file. The frozen base is not
saved: it is rebuilt from the config (its seed, or ``model.from_hf``), exactly. Resume restores the
adapters, their optimizer state and the count (hence dropout keys and the LR schedule); the loop
continues the data at the saved step.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Any

import jax
import numpy as np

from megatrain_jax import checkpoint as ck
from megatrain_jax.config import Config
from megatrain_jax.engine.lora import LoraEngine, LoraModel
from megatrain_jax.engine.lora_base import FrozenStore, frozen_store_from_hf
from megatrain_jax.errors import UserError
from megatrain_jax.hf.merge import ADAPTER, file_crc, manifest_files, read_checked
from megatrain_jax.hf.peft import load_peft, save_peft
from megatrain_jax.models.lora import plain_config

OPT_STATE = "opt_state.npz"


def build_frozen_store(cfg: Config, model: LoraModel, log=print) -> FrozenStore:
    """The frozen base of ``cfg``: from ``model.from_hf``, ``model.init: fast``, or the nnx initialisers
    one part at a time (equal to the in-memory model of the same seed)."""
    from flax import nnx

    from megatrain_jax.models.common import init_part, part_names

    m, dtype = cfg.model, cfg.model.lora.base_dtype
    if m.from_hf:
        return frozen_store_from_hf(m, dtype, log)[1]
    store = FrozenStore(model.layouts, dtype)
    if m.init == "fast":
        store.fill_fast(cfg.train.seed, m.init_std)
        return store
    plain = plain_config(m)
    for name in part_names(plain):
        store[name].load_tree(nnx.to_pure_dict(nnx.state(init_part(plain, cfg.train.seed, name))))
    return store


def lora_devices(cfg: Config, micro: int) -> list:
    """``train.devices`` of this process (LoRA data parallel: one process, its local GPUs, each streaming
    the base over its own link; the memory plan is one device's with the whole batch: conservative)."""
    from megatrain_jax.distributed import run_devices

    if jax.process_count() > 1:
        raise UserError("MEGATRAIN_NUM_PROCESSES", "LoRA data parallel runs in one process (its local GPUs)",
                        "launch one process; train.devices picks its GPUs")
    devices = run_devices(cfg.train.devices)
    if cfg.train.batch_size % (micro * len(devices)):
        raise UserError("train.batch_size", f"{cfg.train.batch_size} sequences do not split into {micro} "
                        f"micro-batches x {len(devices)} devices", f"use a multiple of {micro * len(devices)}")
    return devices


class LoraTrainer:
    """A LoRA run of ``cfg`` (``from_config`` / ``resume``)."""

    store = None  # no trainable host store: ``save_adapter`` exports

    def __init__(self, cfg: Config, plan: Any = None, adapters: list[Any] | None = None, log=print):
        from megatrain_jax.optim.build import learning_rate_or_schedule
        from megatrain_jax.optim.named import named_tx

        if cfg.model.from_hf:
            from megatrain_jax.hf import resolve_hf_model_config

            resolve_hf_model_config(cfg.model)
        self.cfg, self.memory_plan = cfg, plan
        t = cfg.train
        self.model = LoraModel(cfg.model)
        store = build_frozen_store(cfg, self.model, log)
        self._lr = learning_rate_or_schedule(cfg.optim, t.steps)
        tx = named_tx(cfg.optim, self._lr)
        micro = plan.micro_batches if plan is not None else (t.micro_batches if t.micro_batches != "auto" else 1)
        acts = plan.activations if plan is not None else ("device" if t.activations == "auto" else t.activations)
        devices = lora_devices(cfg, micro)
        self.engine = LoraEngine(self.model, store, tx, adapters=adapters, seed=t.seed, compute_dtype=t.compute_dtype,
                                 micro_batches=micro, clip_norm=cfg.optim.clip_norm, loss_chunk=t.loss_chunk,
                                 activations=acts, devices=devices)

    @classmethod
    def from_config(cls, cfg: Config, plan: Any = None) -> "LoraTrainer":
        return cls(cfg, plan)

    @classmethod
    def resume(cls, cfg: Config, root: str, plan: Any = None, log=print) -> tuple["LoraTrainer", str, dict]:
        """``cfg``'s LoRA run continued from the newest intact checkpoint in ``root``."""
        if cfg.model.from_hf:
            from megatrain_jax.hf import resolve_hf_model_config

            resolve_hf_model_config(cfg.model)
        incomplete = ck.set_aside_incomplete(root)  # never resumed from (train.py's rule: checkpoint.read_meta)
        cks = ck.list_checkpoints(root)
        for p, why, aside in incomplete:
            log(f"checkpoint: {p} is corrupted or incomplete ({why}); moved it to {aside}"
                + (f"; resuming from step {cks[-1].step}" if cks else ""))
        if not cks:
            raise UserError("--resume", f"no complete checkpoint in {root}",
                            "train without --resume to start a new run, or set train.out_dir to the run to continue")
        model = LoraModel(cfg.model)
        for c in reversed(cks):
            try:
                state = read_checked(c.path)
            except ck.CorruptCheckpoint as e:
                aside = f"{c.path}.corrupt"
                os.replace(c.path, aside)
                log(f"checkpoint: {c.path} is corrupted: {e}; moved it to {aside}")
                continue
            if state.get("kind") != "lora":
                raise UserError("--resume", f"{c.path} is a full-training checkpoint, not a LoRA one",
                                "resume it without model.lora, or choose another train.out_dir")
            adapters = load_peft(os.path.join(c.path, ADAPTER), cfg.model, model.adapter_shapes)
            self = cls(cfg, plan, adapters=adapters, log=log)
            opt_state = load_opt_state(c.path, self.engine, "--resume", "optim.*",
                                       "resume with the checkpointed run's optim settings")
            self.engine.set_state(self.engine.adapters, opt_state, int(state["count"]))
            return self, c.path, state
        raise UserError("--resume", f"every checkpoint in {root} is corrupted", "start a new run without --resume")

    # ------------------------------------------------------------------------------ the loop's interface

    def step(self, batch: Any):
        from megatrain_jax.engine.step import as_batch

        return self.engine.step(as_batch(batch))

    @property
    def step_count(self) -> int:
        return self.engine.count

    def lr_at(self, count: int) -> float | None:
        lr = self._lr
        return float(lr) if isinstance(lr, float) else float(lr(max(count - 1, 0)))

    @property
    def memory_device(self):
        return self.engine.device if self.engine.device.platform == "gpu" else None

    sharded_checkpoints = False  # one process writes the adapters

    def params(self) -> list[Any]:
        """The trained weights: per block, the adapter leaves (fp32 numpy copies)."""
        return self.engine.adapters_host()

    def saver(self, directory: str, *, keep_last: int = 2, keep_every: int = 0, log=lambda _: None) -> "LoraSaver":
        return LoraSaver(self, directory, keep_last=keep_last, keep_every=keep_every, log=log)

    def save(self, directory: str, *, keep_last: int = 2, meta: dict | None = None, log=lambda _: None) -> str:
        """A checkpoint of the adapters, their optimizer state and the count into ``directory/step_<count>``."""
        return self.saver(directory, keep_last=keep_last, log=log).save(self.engine.count, meta or {}, wait=True)

    def restore(self, directory: str, log=lambda _: None) -> dict:
        """A config run is continued from its checkpoints by ``resume``."""
        raise UserError("restore", "a config run of adapters is continued by resume", "megatrain-jax train --resume")

    def plan(self, *a: Any, **k: Any) -> Any:
        """The memory plan this run was built with."""
        return self.memory_plan

    def write_adapters(self, ckpt_dir: str) -> None:
        write_peft_adapters(ckpt_dir, self.engine.adapters_host(), self.cfg.model)

    def save_adapter(self, out_dir: str, log=print) -> str:
        """The adapters as a PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``)."""
        path = save_peft(out_dir, self.engine.adapters_host(), self.cfg.model, self.cfg.model.from_hf)
        log(f"adapter: saved in the PEFT format to {path}")
        return path

    def export(self, cfg: Config, out: str, *, sources=(), own_run: str | None = None, log=print) -> None:
        """``train.export`` at the end of a LoRA run: the adapter in the PEFT format (``save_adapter``; the
        base with it merged in: ``megatrain-jax export RUN OUT --merge-lora``, ``hf/merge.py``)."""
        del cfg, sources, own_run  # (the run's own config; the adapter directory is small and always new)
        self.save_adapter(out, log=log)

    def close(self) -> None:
        self.engine.close()


def load_opt_state(path: str, engine: LoraEngine, field: str, maker: str, fix: str) -> Any:
    """A checkpoint's adapter optimizer state, in the tree ``engine``'s optimizer makes (a one-line error
    naming ``field`` when the count of arrays differs: another optimizer)."""
    like = jax.eval_shape(engine.tx.init, engine.adapters)
    with np.load(os.path.join(path, OPT_STATE)) as z:
        leaves = [z[f"arr_{i}"] for i in range(len(z.files))]
    treedef = jax.tree_util.tree_structure(like)
    if treedef.num_leaves != len(leaves):
        raise UserError(field, f"{path}: the optimizer state has {len(leaves)} arrays, {maker} makes "
                        f"{treedef.num_leaves}", fix)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def write_peft_adapters(ckpt_dir: str, adapters: list[Any], model_cfg: Any) -> None:
    """A config run's checkpoint adapters (``LoraSaver``): the PEFT pair, which ``--resume`` and peft load."""
    save_peft(os.path.join(ckpt_dir, ADAPTER), adapters, model_cfg, model_cfg.from_hf)


class LoraSaver:
    """Checkpoints of a LoRA run (small: adapters and their optimizer state), written synchronously
    into ``step_N.tmp`` and renamed once complete; the retention policy as ``checkpoint.prune``. The
    trainer writes its adapters (``write_adapters``: a config run the PEFT pair, ``Trainer(..., lora=)``
    an npz of the user's model's adapter tree)."""

    def __init__(self, trainer: Any, root: str, *, keep_last: int = 2, keep_every: int = 0, log=print):
        self.trainer, self.root, self.keep_last, self.keep_every, self.log = trainer, root, keep_last, keep_every, log
        self.history: list[ck.SaveStats] = []
        self.kill_in_save: int | None = None
        self.sigint_in_save: int | None = None  # (fault injection: a save here is never in flight)
        self._unreported: ck.SaveStats | None = None

    def save(self, step: int, meta: dict, *, wait: bool = False) -> str:
        t0 = time.perf_counter()
        eng = self.trainer.engine
        final = os.path.join(self.root, ck.step_dirname(step))
        tmp = final + ".tmp"
        if os.path.isdir(tmp):
            ck.remove_dir(tmp)
        os.makedirs(tmp)
        self.trainer.write_adapters(tmp)
        np.savez(os.path.join(tmp, OPT_STATE), *[np.asarray(x) for x in
                                                   jax.tree_util.tree_leaves(jax.device_get(eng.opt_state))])
        if self.kill_in_save == step:
            os.kill(os.getpid(), signal.SIGKILL)
        ck.write_json(os.path.join(tmp, ck.STATE), {"step": step, "count": eng.count, "kind": "lora", **meta})
        files = manifest_files(tmp)
        ck.write_json(os.path.join(tmp, ck.MANIFEST), {"files": {f: file_crc(os.path.join(tmp, f)) for f in files}})
        if os.path.isdir(final):
            ck.remove_dir(final)
        os.replace(tmp, final)
        ck.fsync_dir(self.root)
        ck.prune(self.root, self.keep_last, self.keep_every)
        dt = time.perf_counter() - t0
        st = ck.SaveStats(step, final, call_s=dt, write_s=dt,
                          nbytes=sum(os.path.getsize(os.path.join(final, f)) for f in files))
        self.history.append(st)
        if not wait:
            self._unreported = st
        return final

    def poll(self) -> ck.SaveStats | None:
        st, self._unreported = self._unreported, None
        return st

    def wait(self) -> ck.SaveStats | None:
        return self.history[-1] if self.history else None

    def close(self) -> None:
        pass

    def abandon(self) -> None:
        pass

    def settle(self, timeout: float = 300.0) -> bool:
        """Nothing to settle: every save is written before ``save`` returns."""
        del timeout
        return True
