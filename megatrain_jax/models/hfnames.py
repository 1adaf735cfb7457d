"""Small Hugging Face pieces the family modules share and that import nothing above them: the
warning class of the importer and the default tensor-name map.

Names follow our module tree: leaf ``self_attn/q_proj/kernel`` of ``block_3`` is
``model.layers.3.self_attn.q_proj.weight`` (kernels transposed: ours are ``(in, out)``), so a family
whose modules are named like the ``transformers`` ones needs no map of its own (``Family.hf_name``)."""
from __future__ import annotations


class HFWarning(UserWarning):
    """A Hugging Face checkpoint detail that megatrain-jax handles differently (and says how)."""


def default_hf_name(group: str, leaf_path: str) -> tuple[str, bool]:
    """Our (group, leaf path) -> (Hugging Face tensor name, transposed?)."""
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
