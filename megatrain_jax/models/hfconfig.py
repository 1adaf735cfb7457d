"""Hugging Face ``config.json`` pieces that several families share: the common size fields, RoPE
(transformers 4 ``rope_theta``/``rope_scaling`` and 5 ``rope_parameters``), sliding-window layer
types, and the common keys of an exported config. Every problem is a ``UserError`` naming
``model.from_hf`` and the unsupported feature."""
from __future__ import annotations

import dataclasses

from megatrain_jax.config import ModelConfig
from megatrain_jax.errors import UserError


# ModelConfig.pad_token_id (the embedding's padding index) lives in config.py; until it is merged there
# this code runs without it


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
            mlp_only_layers=None)
        fields["pad_token_id"] = pad_token_id(hf)
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
        **({"pad_token_id": cfg.pad_token_id} if getattr(cfg, "pad_token_id", None) is not None else {}),
    }
