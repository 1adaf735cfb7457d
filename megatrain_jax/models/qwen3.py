"""Qwen3 (dense): the Llama block with a per-head RMSNorm on q and k (before RoPE), no q/k/v bias,
an explicit head_dim. Hugging Face: ``Qwen3ForCausalLM`` (``self_attn.q_norm`` / ``k_norm``)."""
from __future__ import annotations

from megatrain_jax.config import ModelConfig
from megatrain_jax.errors import UserError
import megatrain_jax.models.hfconfig as hfconfig
from megatrain_jax.models.common import RMSNorm, dense_block_params
from megatrain_jax.models.llama import Block, _no_gemma_fields
from megatrain_jax.models.registry import Family, register


class Qwen3Block(Block):
    QK_NORM = RMSNorm


def layer_types_from_hf(hf: dict) -> tuple[int | None, list[str] | None]:
    """(sliding_window, layer_types or None when uniform) as transformers' Qwen3Config builds them:
    a window only with ``use_sliding_window``, on the layers ``layer_types`` (else from
    ``max_window_layers`` on) marks sliding."""
    n = int(hf["num_hidden_layers"])
    window = int(hf["sliding_window"]) if hf.get("use_sliding_window") and hf.get("sliding_window") else None
    if window is None:
        return None, None
    mwl = int(hf.get("max_window_layers", 28))
    default = ["sliding_attention" if i >= mwl else "full_attention" for i in range(n)]
    types = hfconfig.layer_types_from_hf(hf, n, default)
    if set(types) == {"full_attention"}:
        return None, None
    return window, (None if set(types) == {"sliding_attention"} else types)


def config_from_hf(hf: dict, base: ModelConfig, where: str, arch: str) -> ModelConfig:
    hfconfig.check_act(hf, where, ("hidden_act",), ("silu", "swish"), "silu", "SwiGLU (silu)")
    if hf.get("attention_bias"):
        hfconfig.refuse(where, "attention_bias (biases on q/k/v and o_proj)", "use a checkpoint without attention biases")
    theta, scaling = hfconfig.rope_from_hf(hf, where, allowed=("llama3", "linear"))
    window, types = layer_types_from_hf(hf)
    return hfconfig.base_from_hf(hf, base, where, "qwen3", rope_theta=theta, rope_scaling=scaling,
                                 tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                                 sliding_window=window, layer_types=types)


def config_to_hf(cfg: ModelConfig, arch: str, out: dict) -> None:
    types = cfg.resolved_layer_types()
    windowed = cfg.sliding_window is not None and "sliding_attention" in types
    out.update(hidden_act="silu", attention_bias=False, use_sliding_window=windowed,
               sliding_window=cfg.sliding_window if windowed else None,
               layer_types=types if windowed else ["full_attention"] * cfg.num_layers,
               max_window_layers=types.index("sliding_attention") if windowed else cfg.num_layers)


def validate(cfg: ModelConfig) -> None:
    if cfg.qkv_bias:
        raise UserError("model.qkv_bias", "the qwen3 family has no q/k/v biases", "set model.qkv_bias: false")
    _no_gemma_fields(cfg)


register(Family(
    name="qwen3", architectures=("Qwen3ForCausalLM",), model_types=("qwen3",), block=Qwen3Block,
    block_params=lambda cfg: dense_block_params(cfg, qk_norm=True),
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, validate=validate))
