"""LoRA adapters in the PEFT format: ``adapter_config.json`` and ``adapter_model.safetensors``, the
pair ``peft.PeftModel.from_pretrained(base, DIR)`` loads.

Tensor names are peft's for a causal LM: ``base_model.model.model.layers.{i}.self_attn.q_proj.
lora_A.weight`` (r, in) and ``...lora_B.weight`` (out, r): the transposes of our ``lora_a`` (in, r)
and ``lora_b`` (r, out). Written in fp32 (the master), one tensor at a time.
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from megatrain_jax.config import ModelConfig
from megatrain_jax.errors import UserError
from megatrain_jax.hf.safetensors_io import SafetensorsWriter, read_safetensors_header, read_tensor
from megatrain_jax.models.lora import LORA_MODULES

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_LEAF = {"lora_a": "lora_A", "lora_b": "lora_B"}


def peft_name(layer: int, parent: str, proj: str, leaf: str) -> str:
    """peft's key for one adapter leaf of layer ``layer`` (``leaf``: lora_a | lora_b)."""
    return f"base_model.model.model.layers.{layer}.{parent}.{proj}.{_LEAF[leaf]}.weight"


def adapter_config(cfg: ModelConfig, base_name: str | None) -> dict[str, Any]:
    """peft's LoraConfig fields for ``cfg.lora``."""
    lora = cfg.lora
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_name,
            "r": int(lora.rank), "lora_alpha": float(lora.alpha), "lora_dropout": float(lora.dropout),
            "target_modules": [LORA_MODULES[t][1] for t in lora.targets], "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "modules_to_save": None,
            "use_rslora": False, "use_dora": False, "layers_to_transform": None, "layers_pattern": None,
            "rank_pattern": {}, "alpha_pattern": {}, "revision": None}


def save_peft(out_dir: str, adapters: list[Any], cfg: ModelConfig, base_name: str | None = None) -> str:
    """Write ``adapters`` (per layer: ``{submodule: {proj: {lora_a, lora_b}}}``, numpy or jax) as a
    peft adapter directory; written into ``out_dir.tmp`` and renamed. Returns ``out_dir``."""
    entries, arrays = [], []
    for i, tree in enumerate(adapters):
        for parent in sorted(tree):
            for proj in sorted(tree[parent]):
                for leaf in ("lora_a", "lora_b"):
                    a = np.asarray(tree[parent][proj][leaf], np.float32).T
                    entries.append((peft_name(i, parent, proj, leaf), np.float32, a.shape))
                    arrays.append(a)
    tmp = out_dir.rstrip("/") + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    with SafetensorsWriter(os.path.join(tmp, WEIGHTS), entries, {"format": "pt"}) as w:
        for (name, _, _), a in zip(entries, arrays):
            w.write(name, a)
    with open(os.path.join(tmp, CONFIG), "w") as f:
        json.dump(adapter_config(cfg, base_name or cfg.from_hf), f, indent=2)
    if os.path.isdir(out_dir):
        import shutil

        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def load_peft(path: str, cfg: ModelConfig, like: list[Any]) -> list[Any]:
    """A peft adapter directory as per-layer adapter trees shaped as ``like`` (numpy fp32). Refuses
    one whose rank, alpha or targets differ from ``cfg.lora``."""
    cpath, wpath = os.path.join(path, CONFIG), os.path.join(path, WEIGHTS)
    if not (os.path.isfile(cpath) and os.path.isfile(wpath)):
        raise UserError("adapter", f"{path} has no {CONFIG} and {WEIGHTS}", "give a directory saved by save_peft or peft")
    with open(cpath) as f:
        conf = json.load(f)
    want = adapter_config(cfg, None)
    for key in ("r", "lora_alpha"):
        if float(conf.get(key, -1)) != float(want[key]):
            raise UserError("adapter", f"{path}: {key}={conf.get(key)} but model.lora gives {want[key]}",
                            f"set model.lora to the adapter's ({key})")
    tensors, _ = read_safetensors_header(wpath)
    out = []
    with open(wpath, "rb") as fh:
        for i, tree in enumerate(like):
            layer = {}
            for parent, mods in tree.items():
                layer[parent] = {}
                for proj, leaves in mods.items():
                    layer[parent][proj] = {}
                    for leaf in leaves:
                        name = peft_name(i, parent, proj, leaf)
                        if name not in tensors:
                            raise UserError("adapter", f"{path}: no tensor {name}", "save the adapter with these targets")
                        layer[parent][proj][leaf] = np.ascontiguousarray(read_tensor(fh, tensors[name]).astype(np.float32).T)
            out.append(layer)
    return out
