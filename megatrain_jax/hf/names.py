"""Tensor names: our (group, leaf path) <-> the checkpoint's tensor names. Names follow our module
tree (``default_hf_name``): leaf ``self_attn/q_proj/kernel`` of ``block_3`` is
``model.layers.3.self_attn.q_proj.weight`` (kernels transposed: ours are ``(in, out)``), so a family
whose modules are named like the ``transformers`` ones needs no map of its own; one that differs
gives ``Family.hf_name`` in its file under ``megatrain_jax/models/``. A name with ``*`` marks a leaf
stacked along its first axis that the checkpoint holds as one tensor per slice (MoE experts:
``...experts.*.w1.weight``); a name ending in ``[k::n]`` marks a leaf that is every n-th entry, from
k, of the checkpoint tensor's last axis (gpt-oss's ``gate_up_proj``, gate and up interleaved)."""
from __future__ import annotations

import re

from megatrain_jax.config import ModelConfig
from megatrain_jax.families import get_family

_PART = re.compile(r"^(.*)\[(\d+)::(\d+)\]$")


def interleaved_part(name: str) -> tuple[str, int, int] | None:
    """``base[k::n]`` -> (base, k, n): the leaf is ``tensor[..., k::n]`` of checkpoint tensor ``base``
    (untransposed); None for any other name."""
    m = _PART.match(name)
    return (m.group(1), int(m.group(2)), int(m.group(3))) if m else None


def default_hf_name(group: str, leaf_path: str) -> tuple[str, bool]:
    """Our (group, leaf path) -> (Hugging Face tensor name, transposed?), by the module tree."""
    if group == "embed" and leaf_path == "embedding":
        return "model.embed_tokens.weight", False
    if group == "head":
        if leaf_path == "lm_head":
            return "lm_head.weight", True
        if leaf_path in ("norm/scale", "norm/weight"):
            return "model.norm.weight", False
    if group.startswith("block_"):
        *mods, kind = leaf_path.split("/")
        prefix = f"model.layers.{int(group[6:])}." + ".".join(mods)
        if kind == "kernel":
            return prefix + ".weight", True
        if kind in ("scale", "weight"):  # RMSNorm scales; Gemma's (1 + weight) norms
            return prefix + ".weight", False
        if kind == "bias":
            return prefix + ".bias", False
    raise ValueError(f"no Hugging Face name for {group}/{leaf_path}")


def hf_name(group: str, leaf_path: str, family: str | None = None) -> tuple[str, bool]:
    """Our (group, leaf path) -> (Hugging Face tensor name, transposed?): the family's own name
    where it has one, else the module tree's."""
    own = get_family(family).hf_name(group, leaf_path) if family is not None else None
    return own if own is not None else default_hf_name(group, leaf_path)


def hf_tensors(group: str, leaf_path: str, shape: tuple[int, ...],
               family: str | None = None) -> list[tuple[str, bool, int | None, tuple[int, ...]]]:
    """The checkpoint tensors of one leaf: ``(name, transposed, index, hf shape)``. ``index`` is None
    for a leaf that is one tensor; a leaf whose ``hf_name`` holds ``*`` (stacked MoE experts) is one
    tensor per slice along axis 0, ``*`` replaced by the slice's index."""
    name, transposed = hf_name(group, leaf_path, family)
    part = interleaved_part(name)
    if part is not None:  # the whole checkpoint tensor's shape: n times the leaf's last axis
        if transposed or "*" in name:
            raise ValueError(f"{name}: an interleaved part is neither transposed nor per-slice")
        return [(name, False, None, (*shape[:-1], shape[-1] * part[2]))]
    if "*" not in name:
        return [(name, transposed, None, tuple(reversed(shape)) if transposed else tuple(shape))]
    inner = tuple(shape[1:])
    hf_shape = tuple(reversed(inner)) if transposed else inner
    return [(name.replace("*", str(e)), transposed, e, hf_shape) for e in range(shape[0])]


def model_layouts(cfg: ModelConfig):
    """(the streamed parts, {group: Layout}) of the model a config describes (abstract: no weights)."""
    from megatrain_jax.models.common import abstract_model, streamed_parts
    from megatrain_jax.templates import Layout

    parts = streamed_parts(abstract_model(cfg))
    return parts, {n: Layout(t) for n, t in parts.host_trees().items()}
