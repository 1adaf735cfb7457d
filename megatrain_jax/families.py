"""The model families: one ``Family`` record per decoder family, looked up by name or by a Hugging
Face ``architectures`` / ``model_type``. It sits outside ``models/`` and imports no model: config
validation asks it about ``model.family`` and the families import the config, so the family modules
are loaded by name (``FAMILY_MODULES``) on the first lookup. ``megatrain_jax.models.registry`` is the
same module's names under their old path.

How to add a family (say ``foo``): write ``megatrain_jax/models/foo.py`` holding its NNX block
class (called as ``Block(cfg, rngs, layer)``, computing ``block(hidden, aux) -> hidden``; reuse the
parts in ``models/common.py``: norms, RoPE, a configurable ``Attention``, the gated MLPs), its
Hugging Face config translation (``config_from_hf(hf, base, where, arch) -> ModelConfig`` and
``config_to_hf(cfg, arch, out)``, which adds its keys to the config.json dict ``out``) and its parameter count, then call ``register(Family(...))``
at the end of the module and add ``"foo"`` to ``FAMILY_MODULES`` below. Nothing else changes: the
generic decoder (embedding, the stack of blocks, the head), the streamed engine's parts, the host
store, the memory planner's ``block_params``, and Hugging Face import/export all go through the
record. Tensor names follow the module tree: a leaf ``self_attn/q_proj/kernel`` of layer ``i`` is
``model.layers.i.self_attn.q_proj.weight`` (kernels transposed: ours are ``(in, out)``), so a
family whose modules are named like the ``transformers`` ones needs no name map; give ``hf_name``
when it differs. Blocks of one model may differ in static attributes (a local window, a RoPE base):
``templates.from_nnx`` makes one compiled kind per distinct graph.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from megatrain_jax.errors import UserError

# modules that register families when imported (in this order; the first is the default family)
FAMILY_MODULES = ("megatrain_jax.models.llama", "megatrain_jax.models.qwen3", "megatrain_jax.models.phi3",
                  "megatrain_jax.models.gemma", "megatrain_jax.models.moe")
DEFAULT_FAMILY = "llama"


@dataclass(frozen=True)
class Family:
    """Everything the generic code needs to know about one decoder family."""

    name: str
    architectures: tuple[str, ...]  # transformers classes it imports; [0] is what it exports by default
    model_types: tuple[str, ...]  # config.json model_type of each architecture (same order)
    block: Callable[..., Any]  # Block(cfg, rngs, layer) -> nnx.Module with __call__(hidden, aux)
    block_params: Callable[[Any], int]  # parameters of one block, from the ModelConfig
    config_from_hf: Callable[[dict, Any, str, str], Any]  # (hf config.json, base ModelConfig, where, arch)
    config_to_hf: Callable[[Any, str, dict], None]  # (cfg, arch, out): add the family's config.json keys to out
    norm: Callable[..., Any] | None = None  # the final norm's class (RMSNorm when None)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), in the compute dtype (Gemma)
    default_layer_types: Callable[[Any], list[str]] | None = None  # None: every layer windowed iff sliding_window
    validate: Callable[[Any], None] | None = None  # raise UserError for what the family cannot run
    export_architecture: Callable[[Any], str] | None = None  # default architecture of an export
    check_export: Callable[[Any, str], None] | None = None  # refuse an architecture the weights do not fit
    export_extras: Callable[[Any, str, int], list[tuple[str, tuple[int, ...]]]] | None = None  # zero tensors
    on_import: Callable[[dict, Any, int | None, Any], None] | None = None  # notes/warnings after reading config
    hf_name: Callable[[str, str], tuple[str, bool]] | None = None  # (group, leaf) -> (name, transposed)
    # cfg -> fn(total stats) -> scalar added to the loss, or None: blocks with a true ``emits_stats``
    # return (hidden, stats), summed over layers and tokens (templates.AuxLoss; MoE router balancing)
    aux_loss: Callable[[Any], Callable | None] | None = None
    extra: dict = field(default_factory=dict)

    def layer_types(self, cfg) -> list[str]:
        if self.default_layer_types is not None:
            return list(self.default_layer_types(cfg))
        kind = "sliding_attention" if cfg.sliding_window is not None else "full_attention"
        return [kind] * cfg.num_layers


_FAMILIES: dict[str, Family] = {}
_LOADED = False


def register(family: Family) -> Family:
    if family.name in _FAMILIES and _FAMILIES[family.name] is not family:
        raise ValueError(f"model family {family.name!r} is registered twice")
    if len(family.architectures) != len(family.model_types):
        raise ValueError(f"family {family.name}: one model_type per architecture")
    _FAMILIES[family.name] = family
    return family


def _load() -> None:
    global _LOADED
    if not _LOADED:
        _LOADED = True
        for mod in FAMILY_MODULES:
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
