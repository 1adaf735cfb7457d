"""The model-family registry: one ``Family`` object per decoder family, looked up by name
(``get_family``, the one lookup) or by a Hugging Face ``architectures`` / ``model_type``.

A family is one file under ``megatrain_jax/models/``: its NNX block, and a ``Family`` subclass that
holds the family's facts (its Hugging Face ``config.json`` translation both ways, its tensor-name map
where it differs from the module tree, its parameter count and FLOPs, its validation), registered
with ``register(FooFamily())`` at the end of the file. A family that differs from another by a few
fields subclasses that one's ``Family`` (``models/qwen3.py`` extends ``models/llama.py``'s
``LlamaFamily``) and its block. The generic Hugging Face machinery (reading and writing config.json,
RoPE and size fields, the default tensor names, safetensors) is once in ``megatrain_jax/hf/``.

This module sits outside ``models/`` and imports no model: config validation asks it about
``model.family``, and the families import the config. On the first lookup it imports every module
of ``megatrain_jax/models/`` by file name (``llama`` first: the default family), so a new family is
one new file there and nothing else (docs/porting.md, "A new model family").
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Callable

from megatrain_jax.errors import UserError

DEFAULT_FAMILY = "llama"
MODELS_PACKAGE = "megatrain_jax.models"
MODELS_DIR = Path(__file__).resolve().parent / "models"


class Family:
    """Everything the generic code needs to know about one decoder family. Subclass it in the
    family's file, set the class attributes, override what differs, and ``register`` an instance.

    The generic decoder (``models/common.py``) builds ``block(cfg, rngs, layer)`` for every layer,
    ``norm`` (RMSNorm when None) as the final norm, and scales the embedding when ``embed_scale``;
    Hugging Face import/export (``megatrain_jax/hf/``) calls the ``*_hf_*`` methods and ``hf_name``;
    ``ModelConfig``'s parameter counts and the trainer's model FLOPs call the size methods."""

    name: str = ""
    architectures: tuple[str, ...] = ()  # transformers classes it imports; [0] is what it exports by default
    model_types: tuple[str, ...] = ()  # config.json model_type of each architecture (same order)
    block: Any = None  # Block(cfg, rngs, layer) -> nnx.Module with __call__(hidden, aux)
    norm: Any = None  # the final norm's class (RMSNorm when None)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), in the compute dtype (Gemma)
    extra: dict = {}  # {"moe": True} on mixture-of-experts families; "fields": the ModelConfig fields only it uses
    make_aux: Any = None  # fn(positions, cfg, segment_ids) -> aux, for RoPE tables of its own (None: common.make_aux)

    # ---- Hugging Face

    def from_hf_config(self, hf: dict, base: Any, where: str, arch: str) -> Any:
        """A ``ModelConfig`` from a ``config.json`` dict of architecture ``arch``; non-structural
        fields come from ``base``. ``UserError`` (field ``model.from_hf``) for what it cannot run."""
        raise NotImplementedError(f"family {self.name}: from_hf_config")

    def to_hf_config(self, cfg: Any, arch: str, out: dict) -> None:
        """Write the model's keys of a ``config.json`` of architecture ``arch`` into ``out`` (which
        holds the exporter's defaults and a source checkpoint's other keys)."""
        raise NotImplementedError(f"family {self.name}: to_hf_config")

    def hf_name(self, group: str, leaf_path: str) -> tuple[str, bool] | None:
        """Our (group, leaf path) -> (tensor name, transposed?), for the leaves whose names do not
        follow the module tree; None: the module-tree name (``hf/names.py``)."""
        return None

    def export_architecture(self, cfg: Any) -> str:
        """The architecture an export defaults to."""
        return self.architectures[0]

    def check_export(self, cfg: Any, arch: str) -> None:
        """Refuse (``UserError``) an architecture the weights do not fit."""

    def export_extras(self, cfg: Any, arch: str, layer: int) -> list[tuple[str, tuple[int, ...]]]:
        """Tensors of layer ``layer`` that the format has and we do not: written as zeros."""
        return []

    def on_import(self, hf: dict, cfg: Any, seq_len: int | None, say: Callable[[str], None]) -> None:
        """Notes and warnings after reading a checkpoint's config.json (``say``: one log line)."""

    def drops_tensor(self, name: str, cfg: Any) -> bool:
        """A checkpoint tensor the family leaves out on purpose (``on_import`` says so): not warned about."""
        return False

    # ---- sizes

    def block_params(self, cfg: Any) -> int:
        """Parameters of one block (the largest, when blocks differ)."""
        raise NotImplementedError(f"family {self.name}: block_params")

    def non_embedding_params(self, cfg: Any) -> int:
        """Parameters that the 6·N·T model-FLOPs convention counts (blocks and final norm)."""
        return cfg.num_layers * self.block_params(cfg) + cfg.hidden_size

    def active_non_embedding_params(self, cfg: Any) -> int:
        """``non_embedding_params`` counting only what one token uses (a mixture of experts: its experts)."""
        return self.non_embedding_params(cfg)

    def flops_per_token(self, cfg: Any) -> float:
        """Model FLOPs of one training token: 6 x the non-embedding parameters it uses."""
        return 6.0 * self.active_non_embedding_params(cfg)

    # ---- behaviour

    def layer_types(self, cfg: Any) -> list[str]:
        """Each layer's attention type when ``model.layer_types`` is null."""
        kind = "sliding_attention" if cfg.sliding_window is not None else "full_attention"
        return [kind] * cfg.num_layers

    def validate(self, cfg: Any) -> None:
        """Raise ``UserError`` for what the family cannot run (after the generic checks)."""

    def frozen_leaves(self, cfg: Any) -> tuple[str, ...]:
        """Leaf paths inside a group (``mlp/gate/e_score_correction_bias``: that leaf in every block that has it)
        that no optimizer moves: no weight decay, no moment update, on every update path and the reference
        trainer. They keep the values they were loaded with (a checkpoint's, or a family's own rule's)."""
        return ()

    def aux_loss(self, cfg: Any) -> Callable | None:
        """fn(total block stats) -> scalar added to the loss, or None: blocks with a true
        ``emits_stats`` return (hidden, stats), summed over layers and tokens (templates.AuxLoss;
        the MoE router's balancing loss)."""
        return None


_FAMILIES: dict[str, Family] = {}
_LOADED = False


def register(family: Family) -> Family:
    """Add a family (called at the end of its file under ``models/``); returns it."""
    if family.name in _FAMILIES and _FAMILIES[family.name] is not family:
        raise ValueError(f"model family {family.name!r} is registered twice")
    if not family.name or family.block is None:
        raise ValueError(f"family {type(family).__name__}: set name and block")
    if len(family.architectures) != len(family.model_types):
        raise ValueError(f"family {family.name}: one model_type per architecture")
    _FAMILIES[family.name] = family
    return family


def family_modules() -> list[str]:
    """Every module of ``megatrain_jax/models/`` (the default family's first): importing them
    registers the families (modules that are no family register nothing)."""
    names = sorted(p.stem for p in MODELS_DIR.glob("*.py") if not p.stem.startswith("_"))
    names.sort(key=lambda n: n != DEFAULT_FAMILY)
    return [f"{MODELS_PACKAGE}.{n}" for n in names]


def _load() -> None:
    global _LOADED
    if not _LOADED:
        _LOADED = True
        for mod in family_modules():
            importlib.import_module(mod)


def families() -> dict[str, Family]:
    _load()
    return dict(_FAMILIES)


def family_names() -> list[str]:
    return list(families())


def get_family(name: str) -> Family:
    fams = families()
    if name not in fams:
        raise UserError("model.family", f"{name!r} is not a model family", f"use one of: {', '.join(fams)}")
    return fams[name]


def supported_architectures() -> dict[str, str]:
    """architecture -> model_type, over every family."""
    out = {}
    for fam in families().values():
        out.update(zip(fam.architectures, fam.model_types))
    return out


def family_of_architecture(arch: str) -> Family:
    for fam in families().values():
        if arch in fam.architectures:
            return fam
    raise KeyError(arch)


def architecture_of(hf: dict, where: str) -> str:
    """The checkpoint's architecture, from ``architectures`` (else ``model_type``); ``UserError``
    naming the supported ones when we have no family for it."""
    supported = supported_architectures()
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    if arch is None:
        by_type = {v: k for k, v in supported.items()}
        arch = by_type.get(hf.get("model_type"))
    if arch not in supported:
        shown = arch or f"model_type {hf.get('model_type')!r}"
        raise UserError("model.from_hf", f"architecture {shown} in {where} is not supported",
                        f"use a checkpoint of one of: {', '.join(supported)}")
    return arch
