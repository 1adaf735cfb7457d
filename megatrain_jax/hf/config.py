"""Hugging Face ``config.json`` <-> ``ModelConfig``: the generic part. The family is found by the
checkpoint's architecture (``megatrain_jax/families.py``) and translates its own keys
(``Family.from_hf_config`` / ``to_hf_config``, in its file under ``megatrain_jax/models/``) with the
pieces here that every family shares: the common size fields, RoPE (transformers 4
``rope_theta``/``rope_scaling`` and 5 ``rope_parameters``), sliding-window layer types, the pad
token, and the common keys of an exported config. Every problem is a ``UserError`` naming
``model.from_hf`` and the unsupported feature."""
from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Callable

from megatrain_jax.config import ModelConfig
from megatrain_jax.errors import UserError
from megatrain_jax.families import architecture_of, family_of_architecture, supported_architectures

STRUCTURAL = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "intermediate_size", "rope_theta", "rope_scaling", "rms_norm_eps", "tie_embeddings", "qkv_bias",
              "sliding_window", "family", "layer_types", "attn_softcap", "final_softcap", "query_pre_attn_scalar",
              "rope_local_theta", "num_experts", "experts_per_token", "moe_intermediate_size", "norm_topk_prob",
              "mlp_only_layers", "router_aux_loss_coef", "pad_token_id", "n_shared_experts", "routed_scaling_factor",
              "n_group", "topk_group", "partial_rotary_factor", "qk_norm", "q_lora_rank", "kv_lora_rank",
              "qk_rope_head_dim", "v_head_dim")

Log = Callable[[str], None] | None


class HFWarning(UserWarning):
    """A Hugging Face checkpoint detail that megatrain-jax handles differently (and says how)."""


def warn(msg: str, stacklevel: int = 3) -> None:
    """An ``HFWarning`` (``stacklevel`` 3: where the caller of the function calling this was called)."""
    warnings.warn(msg, HFWarning, stacklevel=stacklevel)


def say(log: Log, msg: str) -> None:
    if log is not None:
        log(msg)


def read_json(path: str, field: str) -> dict:
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
    return supported_architectures()


def architecture(hf: dict, where: str) -> str:
    """The architecture of a config.json dict (``UserError`` when no family has it)."""
    return architecture_of(hf, where)


def family_of(arch: str):
    """The family object of a supported architecture."""
    return family_of_architecture(arch)


def hf_config_to_model_config(hf: dict, base: ModelConfig | None = None, where: str = "config.json") -> ModelConfig:
    """A ``ModelConfig`` from a Hugging Face ``config.json`` dict, by the architecture's family;
    non-structural fields (``init_std``, ``from_hf``) come from ``base``. Raises ``UserError`` for
    what we cannot run, naming the config field."""
    from megatrain_jax.config import validate_model

    arch = architecture(hf, where)
    out = family_of(arch).from_hf_config(hf, base or ModelConfig(), where, arch)
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
    return read_json(os.path.join(hf_dir, "config.json"), field)


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
        msg = (f"model.from_hf: the checkpoint's config.json overrides the YAML for {', '.join(clashes)} "
               "(architecture fields come from the checkpoint)")
        if log is not None:
            log(f"warning: {msg}")  # one line of the command's output, not a Python warning with its source line
        else:
            warn(msg)
    for name in STRUCTURAL:
        setattr(model_cfg, name, getattr(new, name))
    return model_cfg


# ------------------------------------------------------------------------- pieces the families share


def pad_token_id(hf: dict) -> int | None:
    """transformers builds every family's embedding with ``padding_idx=pad_token_id`` (one id; a list
    or an id outside the vocabulary has no padding row)."""
    pad, vocab = hf.get("pad_token_id"), hf.get("vocab_size")
    if isinstance(pad, bool) or not isinstance(pad, int) or not isinstance(vocab, int) or not 0 <= pad < vocab:
        return None
    return pad


def refuse(where: str, what: str, fix: str) -> None:
    raise UserError("model.from_hf", f"{what} in {where} is not supported", fix)


def scaling_from_hf(scaling: dict | None, where: str, allowed=("llama3", "linear")) -> dict | None:
    """A ``rope_scaling`` dict in our form (None for plain RoPE)."""
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in allowed:
        raise UserError("model.from_hf", f"rope scaling type {kind!r} in {where} is not supported",
                        "only " + " and ".join(f"rope_type {a!r}" for a in allowed) + " scaling is implemented here")
    try:
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(scaling["factor"])}
        if kind == "yarn":  # the keys models/common.py's yarn_frequencies reads
            out = {"rope_type": "yarn", "factor": float(scaling["factor"]),
                   "original_max_position_embeddings": int(scaling["original_max_position_embeddings"])}
            for key in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
                if scaling.get(key) is not None:
                    out[key] = float(scaling[key])
            if "truncate" in scaling:
                out["truncate"] = bool(scaling["truncate"])
            return out
        return {"rope_type": "llama3", "factor": float(scaling["factor"]),
                "low_freq_factor": float(scaling["low_freq_factor"]),
                "high_freq_factor": float(scaling["high_freq_factor"]),
                "original_max_position_embeddings": int(scaling["original_max_position_embeddings"])}
    except KeyError as e:
        raise UserError("model.from_hf", f"{kind} rope scaling in {where} lacks {e.args[0]!r}", "fix config.json") from None


def rope_from_hf(hf: dict, where: str, allowed=("llama3", "linear")) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from either the transformers 4 keys (``rope_theta``,
    ``rope_scaling``) or the transformers 5 ``rope_parameters``, for one RoPE setting for all layers."""
    params = hf.get("rope_parameters") or {}
    if params and not ("rope_theta" in params or "rope_type" in params):
        raise UserError("model.from_hf", f"per-layer-type rope_parameters in {where} are not supported",
                        "use a checkpoint with one RoPE setting for all layers")
    theta = float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))
    if hf.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UserError("model.from_hf", f"partial_rotary_factor in {where} is not supported",
                        "use a checkpoint that rotates the whole head dimension")
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return theta, scaling_from_hf(scaling, where, allowed)


def check_act(hf: dict, where: str, keys: tuple[str, ...], want: tuple[str, ...], default: str, what: str) -> None:
    """The MLP activation, read from the first of ``keys`` that is set (transformers' own order)."""
    act = next((hf[k] for k in keys if hf.get(k)), default)
    if act not in want:
        raise UserError("model.from_hf", f"hidden_act {act!r} in {where} is not supported", f"only {what} MLPs are implemented")


def base_from_hf(hf: dict, base: ModelConfig, where: str, family: str, **over) -> ModelConfig:
    """The size fields every family has, plus ``over``; non-structural fields come from ``base``."""
    try:
        heads = int(hf["num_attention_heads"])
        fields = dict(
            family=family, vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
            num_layers=int(hf["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf["head_dim"]) if hf.get("head_dim") else None,
            intermediate_size=int(hf["intermediate_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qkv_bias=False, sliding_window=None, layer_types=None, attn_softcap=None, final_softcap=None,
            query_pre_attn_scalar=None, rope_local_theta=None, rope_scaling=None,
            num_experts=None, experts_per_token=None, moe_intermediate_size=None, norm_topk_prob=True,
            mlp_only_layers=None, pad_token_id=pad_token_id(hf), n_shared_experts=0, routed_scaling_factor=1.0,
            n_group=1, topk_group=1, partial_rotary_factor=1.0, qk_norm=False, q_lora_rank=None, kv_lora_rank=None,
            qk_rope_head_dim=None, v_head_dim=None)
        out = dataclasses.replace(base, **{**fields, **over})
    except KeyError as e:
        raise UserError("model.from_hf", f"{where} lacks {e.args[0]!r}", "use a complete transformers config.json") from None
    if out.head_dim == out.hidden_size // out.num_heads and out.hidden_size % out.num_heads == 0:
        out.head_dim = None  # the default: keeps YAML round trips and comparisons simple
    return out


def layer_types_from_hf(hf: dict, n: int, default: list[str]) -> list[str]:
    types = hf.get("layer_types")
    if types is None:
        return list(default)
    if len(types) != n or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise UserError("model.from_hf", f"layer_types {types!r} is not {n} of sliding_attention/full_attention",
                        "fix config.json")
    return list(types)


def rope_params_out(theta: float, scaling: dict | None) -> dict:
    return {**scaling, "rope_theta": theta} if scaling else {"rope_type": "default", "rope_theta": theta}


def base_to_hf(cfg: ModelConfig) -> dict:
    """config.json keys every family writes (RoPE in both the transformers 4 and 5 spellings)."""
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.dim_per_head,
        "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "rope_theta": cfg.rope_theta, "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "rope_parameters": rope_params_out(cfg.rope_theta, cfg.rope_scaling),
        **({"pad_token_id": cfg.pad_token_id} if cfg.pad_token_id is not None else {}),
    }
