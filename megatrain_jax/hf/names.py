"""Tensor names: our (group, leaf path) <-> the checkpoint's tensor names, by the family's map
(``Family.hf_name``, beside the family in ``megatrain_jax/models/``; else the module-tree default,
``models/hfnames.py``). A name with ``*`` marks a leaf stacked along its first axis that the
checkpoint holds as one tensor per slice (MoE experts: ``...experts.*.w1.weight``)."""
from __future__ import annotations

from megatrain_jax.config import ModelConfig
from megatrain_jax.models.hfnames import default_hf_name


def hf_name(group: str, leaf_path: str, family: str | None = None) -> tuple[str, bool]:
    """Our (group, leaf path) -> (Hugging Face tensor name, transposed?)."""
    if family is not None:
        from megatrain_jax.models.registry import get_family

        own = get_family(family).hf_name
        if own is not None:
            return own(group, leaf_path)
    return default_hf_name(group, leaf_path)


def hf_tensors(group: str, leaf_path: str, shape: tuple[int, ...],
               family: str | None = None) -> list[tuple[str, bool, int | None, tuple[int, ...]]]:
    """The checkpoint tensors of one leaf: ``(name, transposed, index, hf shape)``. ``index`` is None
    for a leaf that is one tensor; a leaf whose ``hf_name`` holds ``*`` (stacked MoE experts) is one
    tensor per slice along axis 0, ``*`` replaced by the slice's index."""
    name, transposed = hf_name(group, leaf_path, family)
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


