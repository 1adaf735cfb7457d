"""Phi-3 / Phi-4 (``Phi3ForCausalLM``): the Llama block with fused projections, kept fused here as
in the checkpoint: ``self_attn.qkv_proj`` (q, then k, then v rows) and ``mlp.gate_up_proj`` (gate
half, then up half), split inside the block. Import and export are then a plain transpose per
tensor (exact), and each block does one matmul where the split layout would do three (or two).
A ``sliding_window`` applies to every layer, as in transformers. Not supported (``UserError``):
``partial_rotary_factor`` != 1 (Phi-4-mini) and ``longrope`` scaling (the 128k variants)."""
from __future__ import annotations

from megatrain_jax.config import ModelConfig
from megatrain_jax.errors import UserError
import megatrain_jax.models.hfconfig as hfconfig
from megatrain_jax.models.common import dense_block_params
from megatrain_jax.models.llama import Block, _no_gemma_fields
from megatrain_jax.models.registry import Family, register


class Phi3Block(Block):
    FUSED = True


def config_from_hf(hf: dict, base: ModelConfig, where: str, arch: str) -> ModelConfig:
    hfconfig.check_act(hf, where, ("hidden_act",), ("silu", "swish"), "silu", "SwiGLU (silu)")
    theta, scaling = hfconfig.rope_from_hf(hf, where, allowed=())  # default RoPE only (no longrope)
    window = int(hf["sliding_window"]) if hf.get("sliding_window") else None
    return hfconfig.base_from_hf(hf, base, where, "phi3", rope_theta=theta, rope_scaling=scaling,
                                 tie_embeddings=bool(hf.get("tie_word_embeddings", False)), sliding_window=window)


def config_to_hf(cfg: ModelConfig, arch: str, out: dict) -> None:
    out.update(hidden_act="silu", sliding_window=cfg.sliding_window, partial_rotary_factor=1.0)
    out["rope_parameters"]["partial_rotary_factor"] = 1.0
    out.setdefault("pad_token_id", None)  # transformers' default 32000 is outside a small vocabulary
    out.setdefault("original_max_position_embeddings", out.get("max_position_embeddings") or 4096)


def validate(cfg: ModelConfig) -> None:
    if cfg.qkv_bias:
        raise UserError("model.qkv_bias", "the phi3 family has no q/k/v biases", "set model.qkv_bias: false")
    if cfg.rope_scaling is not None:
        raise UserError("model.rope_scaling", "Phi3ForCausalLM export supports plain RoPE only", "set it to null")
    if cfg.layer_types is not None and len(set(cfg.layer_types)) > 1:
        raise UserError("model.layer_types", "the phi3 family windows every layer or none", "set it to null")
    _no_gemma_fields(cfg)


register(Family(
    name="phi3", architectures=("Phi3ForCausalLM",), model_types=("phi3",), block=Phi3Block,
    block_params=lambda cfg: dense_block_params(cfg), config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    validate=validate))
