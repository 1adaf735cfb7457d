"""What ``megatrain-jax generate SOURCE`` reads: a model's config, its weights group by group, its tokenizer, chat
template, end-of-sequence ids and context length.

SOURCE is a training run (its ``train.out_dir``, ``checkpoints/`` or one ``step_N``: the newest intact checkpoint;
a LoRA run's adapters are merged into its base as ``export --merge-lora`` merges them), an export (a Hugging Face
directory, or ``--format mt``), a Hugging Face directory, or a Hub id ``ORG/NAME[@REVISION]``. Weights are read one
group at a time (``fill(group, flat)``: fp32), never the whole model at once.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from megatrain_jax.config import ModelConfig
from megatrain_jax.errors import UserError

FIX = ("give a training run (its train.out_dir or a checkpoint), an export, a Hugging Face model directory "
       "(config.json + *.safetensors) or a Hub id ORG/NAME")


@dataclass
class Source:
    """A model to generate from."""

    cfg: ModelConfig  # the model (no adapters: a LoRA run's are merged), seq_tile 0, no auxiliary loss
    fill: Callable[[str, np.ndarray], None]  # one group's fp32 weights into a flat buffer
    layouts: dict  # group -> templates.Layout
    describe: str  # what the log says
    folder: str | None = None  # where a tokenizer.json / chat template may be
    tokenizer: str | None = None  # a tokenizer spec (byte | a tokenizer.json), None: none known
    eos_ids: list = field(default_factory=list)
    context: int | None = None  # the longest sequence the model is meant for (max_position_embeddings, seq_len)
    close: Callable[[], None] = lambda: None


def generation_cfg(cfg: ModelConfig) -> ModelConfig:
    """The model as generation runs it: whole sequences per block (no tiles), no router statistics."""
    return dataclasses.replace(cfg, seq_tile=0, router_aux_loss_coef=0.0, lora=None)


def group_layouts(cfg: ModelConfig) -> dict:
    from megatrain_jax.models.common import abstract_model, streamed_parts
    from megatrain_jax.templates import Layout

    return {n: Layout(t) for n, t in streamed_parts(abstract_model(cfg)).host_trees().items()}


def _hf_meta(folder: str) -> tuple[list[int], int | None]:
    """(end-of-sequence ids, context) from ``generation_config.json`` / ``config.json``."""
    ids: list[int] = []
    context = None
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, ValueError):
            continue
        eos = d.get("eos_token_id")
        for e in (eos if isinstance(eos, list) else [eos]):
            if isinstance(e, int) and not isinstance(e, bool) and e not in ids:
                ids.append(e)
        mp = d.get("max_position_embeddings")
        if context is None and isinstance(mp, int) and not isinstance(mp, bool):
            context = mp
    return ids, context


def _tokenizer_in(folder: str | None) -> str | None:
    if folder and os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return os.path.join(folder, "tokenizer.json")
    return None


def _hf_source(folder: str, spec: str) -> Source:
    from megatrain_jax.hf import resolve_hf_model_config
    from megatrain_jax.hf.merge import base_filler

    cfg = ModelConfig(from_hf=folder)
    resolve_hf_model_config(cfg)
    cfg = generation_cfg(cfg)
    layouts = group_layouts(cfg)
    fill, close = base_filler(cfg, 0, layouts)
    eos, context = _hf_meta(folder)
    return Source(cfg, fill, layouts, f"{spec} (Hugging Face, {cfg.family})", folder, _tokenizer_in(folder), eos,
                  context, close)


def _mt_source(folder: str) -> Source:
    from megatrain_jax.hf.mt import mt_group_reader, read_mt_config

    cfg, _ = read_mt_config(folder)
    cfg = generation_cfg(cfg)
    layouts = group_layouts(cfg)
    readers = {n: mt_group_reader(folder, n, lay) for n, lay in layouts.items()}
    eos, context = _hf_meta(folder)
    return Source(cfg, lambda n, flat: readers[n](flat), layouts, f"{folder} (mt export, {cfg.family})", folder,
                  _tokenizer_in(folder), eos, context)


def _run_meta(state: dict, cfg: ModelConfig) -> tuple[str | None, str | None, list[int], int | None]:
    """(folder, tokenizer spec, eos ids, context) of a training run's checkpoint."""
    conf = state.get("config", {}) or {}
    data = conf.get("data", {}) or {}
    folder = cfg.from_hf if cfg.from_hf and os.path.isdir(str(cfg.from_hf)) else None
    tok = data.get("tokenizer")
    if tok and tok != "byte" and os.path.isfile(tok):
        spec = tok
    elif _tokenizer_in(folder):
        spec = _tokenizer_in(folder)
    else:
        spec = "byte" if (not tok or tok == "byte") else None
    eos, context = _hf_meta(folder) if folder else ([], None)
    if context is None and isinstance(data.get("seq_len"), int):
        context = int(data["seq_len"])
    if spec and spec != "byte" and not folder:
        folder = os.path.dirname(spec)
    return folder, spec, eos, context


def _run_source(spec: str, log) -> Source:
    from megatrain_jax.hf.commands import family_layouts, master_reader, resolve_checkpoint
    from megatrain_jax.hf.merge import ADAPTER, base_filler, find_lora_checkpoint, merge_into, merged_model_config

    lora = find_lora_checkpoint(spec, log)
    if lora is not None:  # the base with the run's adapters merged in (the same weights as export --merge-lora)
        from megatrain_jax.hf.peft import load_peft
        from megatrain_jax.models.lora import adapter_shapes

        path, state = lora
        full = merged_model_config(state, path)
        cfg = generation_cfg(full)
        layouts = group_layouts(cfg)
        adapters = load_peft(os.path.join(path, ADAPTER), full, adapter_shapes(full))
        seed = int(state.get("config", {}).get("train", {}).get("seed", 0))
        fill_base, close = base_filler(cfg, seed, layouts)

        def fill(name, flat):
            fill_base(name, flat)
            if name.startswith("block_"):
                merge_into(layouts[name], flat, adapters[int(name[6:])], full.lora.scale)

        folder, tok, eos, context = _run_meta(state, cfg)
        return Source(cfg, fill, layouts, f"{path} (LoRA run, step {state.get('step')}, adapters merged)", folder, tok,
                      eos, context, close)
    path, manifest, state = resolve_checkpoint(spec, log)
    cfg, layouts = family_layouts(state, path)
    cfg = generation_cfg(cfg)
    read = master_reader(path, manifest)
    folder, tok, eos, context = _run_meta(state, cfg)
    return Source(cfg, read, layouts, f"{path} (training run, step {state.get('step')})", folder, tok, eos, context)


def open_source(spec: str, log=print) -> Source:
    """SOURCE as a ``Source``; anything else is one ``UserError`` naming SOURCE."""
    from megatrain_jax import checkpoint as ck
    from megatrain_jax.hf.hub import local_model_dir, parse_hub_id
    from megatrain_jax.hf.mt import MT_CONFIG

    if not spec:
        raise UserError("SOURCE", "is empty", FIX)
    if not os.path.exists(spec):
        if parse_hub_id(spec) is None:
            raise UserError("SOURCE", f"{spec!r} does not exist and is not a Hub id", FIX)
        folder = local_model_dir(spec, "SOURCE", log=log)
        return _hf_source(folder, spec)
    if not os.path.isdir(spec):
        raise UserError("SOURCE", f"{spec!r} is a file, not a model directory", FIX)
    if os.path.isfile(os.path.join(spec, MT_CONFIG)):
        return _mt_source(spec)
    if os.path.isfile(os.path.join(spec, "config.json")) and any(f.endswith(".safetensors") for f in os.listdir(spec)):
        return _hf_source(spec, spec)
    is_run = os.path.isfile(os.path.join(spec, ck.MANIFEST)) or ck.list_checkpoints(spec) or \
        ck.list_checkpoints(ck.checkpoint_root(spec))
    if is_run:
        try:
            return _run_source(spec, log)
        except UserError as e:
            if e.field == "CHECKPOINT":
                raise UserError("SOURCE", e.problem, e.fix) from None
            raise
    raise UserError("SOURCE", f"{spec} holds no model (no checkpoint, no config.json with safetensors, no "
                    f"{MT_CONFIG})", FIX)
