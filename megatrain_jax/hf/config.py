"""Hugging Face ``config.json`` <-> ``ModelConfig``, through the family registry (each family's
``config_from_hf`` / ``config_to_hf`` lives beside its modules in ``megatrain_jax/models/``)."""
from __future__ import annotations

import json
import os
import warnings
from typing import Callable

from megatrain_jax.config import ModelConfig
from megatrain_jax.errors import UserError
from megatrain_jax.models.hfnames import HFWarning

STRUCTURAL = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "intermediate_size", "rope_theta", "rope_scaling", "rms_norm_eps", "tie_embeddings", "qkv_bias",
              "sliding_window", "family", "layer_types", "attn_softcap", "final_softcap", "query_pre_attn_scalar",
              "rope_local_theta", "num_experts", "experts_per_token", "moe_intermediate_size", "norm_topk_prob",
              "mlp_only_layers", "router_aux_loss_coef", "pad_token_id")

Log = Callable[[str], None] | None


def _warn(msg: str) -> None:
    warnings.warn(msg, HFWarning, stacklevel=3)


def _say(log: Log, msg: str) -> None:
    if log is not None:
        log(msg)


def _read_json(path: str, field: str) -> dict:
    if not os.path.isfile(path):
        raise UserError(field, f"{path} does not exist",
                        "point it at a Hugging Face model directory (config.json + *.safetensors)")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(field, f"{path} is not valid JSON ({e})", "fix or re-download the file") from None


def supported() -> dict[str, str]:
    """Every importable/exportable architecture -> its model_type (from the family registry)."""
    from megatrain_jax.models.registry import supported_architectures

    return supported_architectures()


def _architecture(hf: dict, where: str) -> str:
    from megatrain_jax.models.registry import architecture_of

    return architecture_of(hf, where)


def _family_of(arch: str):
    from megatrain_jax.models.registry import family_of_architecture

    return family_of_architecture(arch)


def hf_config_to_model_config(hf: dict, base: ModelConfig | None = None, where: str = "config.json") -> ModelConfig:
    """A ``ModelConfig`` from a Hugging Face ``config.json`` dict, by the architecture's family;
    non-structural fields (``init_std``, ``from_hf``) come from ``base``. Raises ``UserError`` for
    what we cannot run, naming the config field."""
    from megatrain_jax.config import validate_model

    arch = _architecture(hf, where)
    out = _family_of(arch).config_from_hf(hf, base or ModelConfig(), where, arch)
    validate_model(out)
    return out


def read_hf_config(hf_dir: str, field: str = "model.from_hf") -> dict:
    """``config.json`` of a model directory, or of a Hub id's snapshot (``hub.local_model_dir``)."""
    from megatrain_jax.hf.hub import local_model_dir

    hf_dir = local_model_dir(hf_dir, field)
    if not os.path.isdir(hf_dir):
        raise UserError(field, f"{hf_dir!r} is not a directory",
                        "point it at a Hugging Face model directory (config.json + *.safetensors), "
                        "or give a Hub id ORG/NAME[@REVISION]")
    return _read_json(os.path.join(hf_dir, "config.json"), field)


def resolve_hf_model_config(model_cfg: ModelConfig, log: Log = None) -> ModelConfig:
    """Overwrite ``model_cfg``'s structural fields in place from ``model_cfg.from_hf``'s config.json
    (cheap: reads only the JSON). Warns about every explicitly set YAML value that disagrees.
    Call it before anything uses the sizes (e.g. the vocabulary check of the data). A Hub id
    (``ORG/NAME[@REVISION]``) in ``from_hf`` becomes its snapshot directory in the Hugging Face
    cache (``hub.local_model_dir``: fetched first where needed), so that every later reader sees a
    local directory (``log``: one line saying where it resolved to)."""
    from megatrain_jax.hf.hub import local_model_dir

    model_cfg.from_hf = local_model_dir(model_cfg.from_hf, log=log)
    hf = read_hf_config(model_cfg.from_hf)
    new = hf_config_to_model_config(hf, model_cfg, os.path.join(model_cfg.from_hf, "config.json"))
    default = ModelConfig()
    clashes = []
    for name in STRUCTURAL:
        mine, theirs = getattr(model_cfg, name), getattr(new, name)
        if mine != getattr(default, name) and mine != theirs:
            clashes.append(f"{name}={mine!r} -> {theirs!r}")
    if clashes:
        _warn(f"model.from_hf: the checkpoint's config.json overrides the YAML for {', '.join(clashes)} "
              "(architecture fields come from the checkpoint)")
    for name in STRUCTURAL:
        setattr(model_cfg, name, getattr(new, name))
    return model_cfg


