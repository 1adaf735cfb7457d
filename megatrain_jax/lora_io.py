"""The edges of a run of adapters (``lora_trainer.LoraRun`` is the run): its frozen base built from a
config (initialised part by part, or read from Hugging Face: ``model.from_hf``), and its adapters written and read,
the PEFT pair for a config's model (``PeftAdapters``) or an npz of the adapter tree for a user's model
(``TreeAdapters``). The engine (``engine/lora.py``) knows neither Hugging Face nor PEFT.

A checkpoint of adapters is ``checkpoints/step_N/`` (the full-training checkpoints' naming, so listing, pruning
and ``--resume`` find it), written by the one saver (``checkpoint.CheckpointSaver(files=AdapterFiles)``): the
adapters (``adapter/``, the PEFT pair ``peft.PeftModel.from_pretrained`` loads; or ``adapters.npz``),
``opt_state.npz`` (the optax state's leaves), ``state.json`` (step, optimizer count, data position, RNG, config)
and ``manifest.json`` written last with the crc32 of each file. The frozen base is not saved: it is rebuilt from
the config (its seed, or ``model.from_hf``), exactly, or is the user's model. Resume restores the adapters, their
optimizer state and the count (hence dropout keys and the LR schedule); the loop continues the data at the saved
step.
"""
from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

from megatrain_jax import checkpoint as ck
from megatrain_jax.config import Config
from megatrain_jax.engine.lora import LoraEngine, LoraModel
from megatrain_jax.engine.lora_base import FrozenStore
from megatrain_jax.errors import UserError
from megatrain_jax.checkpoint_read import read_checked
from megatrain_jax.hf.config import resolve_hf_model_config
from megatrain_jax.hf.merge import ADAPTER, is_lora_checkpoint
from megatrain_jax.hf.peft import load_peft, save_peft
from megatrain_jax.placements import ACT_DEVICE, AUTO
from megatrain_jax.models.lora import plain_config

OPT_STATE = "opt_state.npz"  # a checkpoint's adapter optimizer state
ADAPTERS_FILE = "adapters.npz"  # a Trainer(..., lora=) checkpoint's adapter tree


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


def frozen_store_from_hf(model_cfg, dtype: str, log=print):
    """A Hugging Face checkpoint (``model.from_hf``) read group by group into a frozen store: one
    group's fp32 at a time, never the whole model. Returns ``(layouts, store)``."""
    from megatrain_jax.hf.config import read_hf_config
    from megatrain_jax.hf.importer import OpenFiles, load_item, plan_import, index_checkpoint
    from megatrain_jax.hf.names import model_layouts

    read_hf_config(model_cfg.from_hf)
    resolve_hf_model_config(model_cfg)
    tensors = index_checkpoint(model_cfg.from_hf)
    _, layouts = model_layouts(model_cfg)
    plan = plan_import(layouts, tensors, model_cfg, model_cfg.from_hf)
    store = FrozenStore(layouts, dtype)
    files = OpenFiles()
    try:
        for name, g in store.groups.items():
            master = np.zeros(g.layout.size, np.float32)
            for item in (i for i in plan if i.group == name):
                load_item(files.get(item.info.path), item, master)
            g.load_flat(master)
    finally:
        files.close()
    log(f"hf import: {store.num_params() / 1e6:.1f}M frozen parameters ({dtype}) from {model_cfg.from_hf}")
    return layouts, store


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



def config_engine(cfg: Config, plan: Any = None, adapters: list[Any] | None = None, log=print) -> tuple:
    """``(model, engine, learning rate or schedule)`` of ``cfg``'s run of adapters: its frozen base built
    (``build_frozen_store``), its optimizer and engine options as the memory plan decided (``plan``)."""
    from megatrain_jax.optim.build import learning_rate_or_schedule
    from megatrain_jax.optim.named import named_tx

    if cfg.model.from_hf:
        resolve_hf_model_config(cfg.model)
    t = cfg.train
    model = LoraModel(cfg.model)
    store = build_frozen_store(cfg, model, log)
    lr = learning_rate_or_schedule(cfg.optim, t.steps)
    tx = named_tx(cfg.optim, lr)
    micro = plan.micro_batches if plan is not None else (t.micro_batches if t.micro_batches != AUTO else 1)
    acts = plan.activations if plan is not None else (ACT_DEVICE if t.activations == AUTO else t.activations)
    devices = lora_devices(cfg, micro)
    engine = LoraEngine(model, store, tx, adapters=adapters, seed=t.seed, compute_dtype=t.compute_dtype,
                        micro_batches=micro, clip_norm=cfg.optim.clip_norm, loss_chunk=t.loss_chunk,
                        activations=acts, devices=devices)
    return model, engine, lr


def newest_checkpoint(cfg: Config, root: str, log=print) -> tuple[str, dict, list[Any]]:
    """``(path, state, adapters)`` of the newest intact checkpoint of ``cfg``'s run of adapters in ``root``
    (``--resume``): incomplete and corrupted ones are set aside, a full-training one is refused."""
    if cfg.model.from_hf:
        resolve_hf_model_config(cfg.model)
    incomplete = ck.set_aside_incomplete(root)  # never resumed from (train.py's rule: checkpoint.read_meta)
    cks = ck.list_checkpoints(root)
    for p, why, aside in incomplete:
        log(f"checkpoint: {p} is corrupted or incomplete ({why}); moved it to {aside}"
            + (f"; resuming from step {cks[-1].step}" if cks else ""))
    if not cks:
        raise UserError("--resume", f"no complete checkpoint in {root}",
                        "train without --resume to start a new run, or set train.out_dir to the run to continue")
    files = PeftAdapters(cfg.model)
    for c in reversed(cks):
        try:
            state = read_checked(c.path)
        except ck.CorruptCheckpoint as e:
            aside = f"{c.path}.corrupt"
            os.replace(c.path, aside)
            log(f"checkpoint: {c.path} is corrupted: {e}; moved it to {aside}")
            continue
        if state.get("kind") != AdapterFiles.kind:
            raise UserError("--resume", f"{c.path} is a full-training checkpoint, not a LoRA one",
                            "resume it without model.lora, or choose another train.out_dir")
        return c.path, state, files.read(c.path, None)
    raise UserError("--resume", f"every checkpoint in {root} is corrupted", "start a new run without --resume")

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


class PeftAdapters:
    """The adapters of a config's model (``model.lora``) in the PEFT format: a checkpoint's ``adapter/``, and the
    run's export (``train.export``; merged into the base: ``megatrain-jax export RUN OUT --merge-lora``)."""

    what = "a config run of adapters (model.lora)"

    def __init__(self, model_cfg: Any):
        self.model_cfg = model_cfg

    def holds(self, path: str) -> bool:
        """``path`` is a checkpoint of these adapters (its PEFT pair and its state)."""
        return is_lora_checkpoint(path)

    def write(self, directory: str, adapters: list[Any]) -> None:
        """A checkpoint's PEFT pair, which ``--resume`` and peft load."""
        save_peft(os.path.join(directory, ADAPTER), adapters, self.model_cfg, self.model_cfg.from_hf)

    def read(self, path: str, like: Any) -> list[Any]:
        """A checkpoint's adapters (``like``: unused, the shapes are the config's)."""
        del like
        return load_peft(os.path.join(path, ADAPTER), self.model_cfg, LoraModel(self.model_cfg).adapter_shapes)

    def export(self, adapters: list[Any], out: str, log=print) -> str:
        """The adapters as a PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``)."""
        path = save_peft(out, adapters, self.model_cfg, self.model_cfg.from_hf)
        log(f"adapter: saved in the PEFT format to {path}")
        return path


class TreeAdapters:
    """The adapters of a user's model (``Trainer(model, tx, lora=...)``) as its own tree: a checkpoint's
    ``adapters.npz`` keyed by path. The PEFT format needs a registry model's config: no export."""

    what = "Trainer(..., lora=)"

    def holds(self, path: str) -> bool:
        """``path`` was written by ``Trainer(..., lora=).save`` (its state says LoRA and it holds the tree)."""
        try:
            with open(os.path.join(path, ck.STATE)) as f:
                kind = json.load(f).get("kind")
        except (OSError, ValueError):
            return False
        return kind == AdapterFiles.kind and os.path.isfile(os.path.join(path, ADAPTERS_FILE))

    def write(self, directory: str, adapters: list[Any]) -> None:
        flat = jax.tree_util.tree_flatten_with_path(adapters)[0]
        np.savez(os.path.join(directory, ADAPTERS_FILE), **{jax.tree_util.keystr(p): v for p, v in flat})

    def read(self, path: str, like: Any) -> list[Any]:
        """A checkpoint's adapter tree, which must be ``like``'s (the same paths and shapes)."""
        flat, treedef = jax.tree_util.tree_flatten_with_path(like)
        with np.load(os.path.join(path, ADAPTERS_FILE)) as z:
            keys = [jax.tree_util.keystr(p) for p, _ in flat]
            if sorted(z.files) != sorted(keys) or any(z[k].shape != v.shape for k, (_, v) in zip(keys, flat)):
                raise UserError("lora", f"{path} holds other adapters than this trainer's "
                                f"({len(z.files)} arrays, {len(keys)} here)",
                                "restore with the checkpointed run's lora settings and model")
            return jax.tree_util.tree_unflatten(treedef, [z[k] for k in keys])

    def export(self, adapters: list[Any], out: str, log=print) -> str:
        del adapters, out, log
        raise UserError("export", "Trainer(..., lora=) keeps the adapters in your model's tree",
                        "use tr.adapters(), tr.update_model(model) or tr.merged_params()")


class AdapterFiles:
    """What a checkpoint of adapters holds (``checkpoint.CheckpointSaver(files=)``): the adapters in their run's
    format (``PeftAdapters`` or ``TreeAdapters``) and their optimizer state (``OPT_STATE``); the frozen base is
    rebuilt, never saved."""

    kind = "lora"  # state.json's: resume and export tell a checkpoint of adapters by it

    def __init__(self, engine: LoraEngine, adapters: PeftAdapters | TreeAdapters):
        self.engine, self.adapters = engine, adapters

    def write(self, directory: str) -> None:
        self.adapters.write(directory, self.engine.adapters_host())
        leaves = jax.tree_util.tree_leaves(jax.device_get(self.engine.opt_state))
        np.savez(os.path.join(directory, OPT_STATE), *[np.asarray(x) for x in leaves])

