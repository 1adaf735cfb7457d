"""Merged export of a LoRA run: ``megatrain-jax export CHECKPOINT OUT --merge-lora`` writes the base with
its adapters folded in as a Hugging Face directory that ``from_pretrained`` loads without peft.

Every targeted projection's kernel becomes ``W + (alpha / r) * A B`` (our (in, out) layout; peft's
``merge_and_unload`` adds ``scale * B_t A_t`` to its (out, in) weight: the same matrix). The base is
the run's fp32 definition, rebuilt from the checkpoint's config as training rebuilt it: the Hugging Face
checkpoint of ``model.from_hf`` as read, or the config's initialisation (``model.init``, ``train.seed``);
not the bf16/int8 copy the GPU streamed (a merged int8 base would carry its rounding into every weight).
One group at a time (``exporter.one_group_at_a_time``): host memory peaks at one block, never the model.
The output directory follows ``atomic.check_output``'s rules, as every export does.

A LoRA checkpoint (``checkpoint.CheckpointSaver`` writes its files) is read here too, once
``checkpoint_read.read_checked`` has checked its manifest (the crc32 of each file).
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Callable

import numpy as np

from megatrain_jax import checkpoint as ck
from megatrain_jax.atomic import check_output
from megatrain_jax.checkpoint_read import read_checked
from megatrain_jax.config import ModelConfig
from megatrain_jax.errors import UserError

ADAPTER = "adapter"  # a LoRA checkpoint's PEFT directory (step_N/adapter)


def is_lora_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ADAPTER, "adapter_config.json")) and \
        os.path.isfile(os.path.join(path, ck.STATE))


def find_lora_checkpoint(spec: str, log=print) -> tuple[str, dict] | None:
    """``spec`` (a LoRA checkpoint, a ``checkpoints/`` directory or a run's out_dir) -> the newest intact
    LoRA checkpoint and its state; None when ``spec`` holds no LoRA checkpoint."""
    if not os.path.isdir(spec):
        return None
    if is_lora_checkpoint(spec):
        cands = [spec]
    else:
        root = spec if ck.list_checkpoints(spec) else ck.checkpoint_root(spec)
        cands = [c.path for c in reversed(ck.list_checkpoints(root)) if is_lora_checkpoint(c.path)]
    for path in cands:
        try:
            state = read_checked(path)
        except ck.CorruptCheckpoint as e:
            if path == spec:
                raise UserError("CHECKPOINT", f"{path} is corrupted: {e}", "export an earlier checkpoint") from None
            log(f"export: skipping {path}: {e}")
            continue
        if state.get("kind") == "lora":
            return path, state
    return None


def merged_model_config(state: dict, path: str) -> ModelConfig:
    model = dict(state.get("config", {}).get("model") or {})
    try:
        cfg = ModelConfig(**model)
    except (TypeError, ValueError) as e:
        raise UserError("CHECKPOINT", f"{path}: its config's model section does not load ({e})",
                        "export a checkpoint written by megatrain-jax train with model.lora") from None
    if cfg.lora is None:
        raise UserError("CHECKPOINT", f"{path}: its config has no model.lora", "export it without --merge-lora")
    if cfg.from_hf:
        from megatrain_jax.hf.config import resolve_hf_model_config

        if not os.path.isdir(cfg.from_hf):
            raise UserError("CHECKPOINT", f"{path}: its base {cfg.from_hf} (model.from_hf) is not a directory",
                            "restore the base checkpoint at that path (the LoRA checkpoint does not hold the base)")
        resolve_hf_model_config(cfg)
    return cfg


def base_filler(cfg: ModelConfig, seed: int, layouts: dict) -> tuple[Callable[[str, np.ndarray], None], Callable]:
    """``(fill(group, flat), close())``: one group's fp32 base values, as the run's frozen store was built."""
    from flax import nnx

    from megatrain_jax.hoststore import fill_fast_group
    from megatrain_jax.models.lora import plain_config

    if cfg.from_hf:
        from megatrain_jax.hf.importer import OpenFiles, load_item, plan_import, index_checkpoint

        plan = plan_import(layouts, index_checkpoint(cfg.from_hf), cfg, cfg.from_hf)
        files = OpenFiles()

        def fill(name, flat):
            flat[:] = 0
            for item in (i for i in plan if i.group == name):
                load_item(files.get(item.info.path), item, flat)

        return fill, files.close
    names = list(layouts)
    if cfg.init == "fast":
        return (lambda name, flat: fill_fast_group(layouts[name], names.index(name), seed, cfg.init_std, flat)), \
            (lambda: None)
    from megatrain_jax.models.common import init_part

    plain = plain_config(cfg)

    def fill(name, flat):
        layouts[name].flatten_into(nnx.to_pure_dict(nnx.state(init_part(plain, seed, name))), flat)

    return fill, lambda: None


def merge_into(layout: Any, flat: np.ndarray, adapters: dict, scale: float) -> None:
    """Add ``scale * A B`` to each adapted kernel of one block's flat fp32 values (in place)."""
    where = {lf.path: lf for lf in layout.leaves}
    for parent, mods in adapters.items():
        for proj, ab in mods.items():
            lf = where[f"{parent}/{proj}/kernel"]
            w = flat[lf.offset:lf.offset + lf.size].reshape(lf.shape)
            delta = np.asarray(ab["lora_a"], np.float64) @ np.asarray(ab["lora_b"], np.float64)
            w[...] = (w.astype(np.float64) + scale * delta).astype(np.float32)


def export_merged(checkpoint: str, out: str, dtype: str = "bfloat16", *, architecture: str | None = None,
                  overwrite: bool = False, max_shard_bytes: int | None = None, log=print) -> str:
    """The newest LoRA checkpoint in ``checkpoint`` merged into its base, as a Hugging Face directory."""
    from megatrain_jax.hf.exporter import SHARD_BYTES, export_hf, one_group_at_a_time
    from megatrain_jax.hf.peft import load_peft
    from megatrain_jax.models.common import abstract_model, streamed_parts
    from megatrain_jax.models.lora import adapter_shapes, plain_config
    from megatrain_jax.templates import Layout

    if not os.path.isdir(checkpoint):
        raise UserError("CHECKPOINT", f"{checkpoint!r} does not exist" if not os.path.exists(checkpoint) else
                        f"{checkpoint!r} is not a directory", "give a LoRA run's train.out_dir (or one of its "
                        "checkpoints)")
    check_output(out, "hf", sources=[checkpoint], overwrite=overwrite)
    found = find_lora_checkpoint(checkpoint, log)
    if found is None:
        raise UserError("--merge-lora", f"{checkpoint} holds no LoRA checkpoint (no step_N/{ADAPTER}/)",
                        "give a checkpoint of a run trained with model.lora, or export without --merge-lora")
    path, state = found
    t0 = time.perf_counter()
    cfg = merged_model_config(state, path)
    seed = int(state.get("config", {}).get("train", {}).get("seed", 0))
    plain = plain_config(cfg)
    layouts = {n: Layout(t) for n, t in streamed_parts(abstract_model(plain)).host_trees().items()}
    adapters = load_peft(os.path.join(path, ADAPTER), cfg, adapter_shapes(cfg))
    fill_base, close = base_filler(cfg, seed, layouts)

    def fill(name, flat):
        fill_base(name, flat)
        if name.startswith("block_"):
            merge_into(layouts[name], flat, adapters[int(name[6:])], cfg.lora.scale)

    try:
        export_hf(one_group_at_a_time(layouts, fill), plain, out, dtype, architecture, overwrite=overwrite,
                  max_shard_bytes=max_shard_bytes or SHARD_BYTES, sources=[checkpoint, path], log=log)
    finally:
        close()
    log(f"export: {path} (step {state.get('step')}) merged with its adapter (scale {cfg.lora.scale:g}) -> {out}: "
        f"Hugging Face {dtype} in {time.perf_counter() - t0:.1f}s")
    return out


def lora_export(args: Any) -> int | None:
    """``megatrain-jax export`` where it concerns LoRA (``commands.export_main`` asks here first, with its parsed
    arguments): ``--merge-lora`` exports; a LoRA run without it is refused in one line; None: not a LoRA export."""
    if not args.merge_lora:
        if find_lora_checkpoint(args.checkpoint, lambda _: None) is not None:
            raise UserError("CHECKPOINT", f"{args.checkpoint} is a LoRA run: a frozen base and an adapter (PEFT "
                            "format, in step_N/adapter)", "pass --merge-lora for merged weights, or load the "
                            "adapter with peft.PeftModel.from_pretrained")
        return None
    if args.format != "hf":
        raise UserError("--format", "--merge-lora writes a Hugging Face directory", "drop --format mt")
    if not args.max_shard_gb > 0:
        raise UserError("--max-shard-gb", "must be positive", "give e.g. 5")
    export_merged(args.checkpoint, args.out, args.dtype, architecture=args.architecture, overwrite=args.overwrite,
                  max_shard_bytes=int(args.max_shard_gb * 1e9))
    return 0
