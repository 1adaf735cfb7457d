"""Phi-3 / Phi-4 (``Phi3ForCausalLM``): the Llama block with fused projections, kept fused here as
in the checkpoint: ``self_attn.qkv_proj`` (q, then k, then v rows) and ``mlp.gate_up_proj`` (gate
half, then up half), split inside the block. Import and export are then a plain transpose per
tensor (exact), and each block does one matmul where the split layout would do three (or two).
A ``sliding_window`` applies to every layer, as in transformers. Not supported (``UserError``):
``partial_rotary_factor`` != 1 (Phi-4-mini) and ``longrope`` scaling (the 128k variants)."""
from __future__ import annotations

import megatrain_jax.hf.config as hfc
from megatrain_jax.config import ModelConfig
from megatrain_jax.errors import UserError
from megatrain_jax.families import register
from megatrain_jax.models.common import dense_block_params
from megatrain_jax.models.llama import Block, LlamaFamily, no_gemma_fields, no_qkv_bias


class Phi3Block(Block):
    FUSED = True


class Phi3Family(LlamaFamily):
    name = "phi3"
    architectures = ("Phi3ForCausalLM",)
    model_types = ("phi3",)
    block = Phi3Block
    act_keys = ("hidden_act",)
    rope_scalings = ()  # default RoPE only (no longrope)

    def check_hf(self, hf: dict, where: str, arch: str) -> None:
        hfc.check_act(hf, where, self.act_keys, ("silu", "swish"), "silu", "SwiGLU (silu)")

    def fields_from_hf(self, hf: dict, base: ModelConfig, where: str, arch: str) -> dict:
        return dict(sliding_window=int(hf["sliding_window"]) if hf.get("sliding_window") else None)

    def to_hf_config(self, cfg: ModelConfig, arch: str, out: dict) -> None:
        super().to_hf_config(cfg, arch, out)
        out.update(sliding_window=cfg.sliding_window, partial_rotary_factor=1.0)
        out["rope_parameters"]["partial_rotary_factor"] = 1.0
        out.setdefault("pad_token_id", None)  # transformers' default 32000 is outside a small vocabulary
        out.setdefault("original_max_position_embeddings", out.get("max_position_embeddings") or 4096)

    def block_params(self, cfg: ModelConfig) -> int:
        return dense_block_params(cfg)

    def validate(self, cfg: ModelConfig) -> None:
        no_qkv_bias(cfg)
        if cfg.rope_scaling is not None:
            raise UserError("model.rope_scaling", "Phi3ForCausalLM export supports plain RoPE only", "set it to null")
        if cfg.layer_types is not None and len(set(cfg.layer_types)) > 1:
            raise UserError("model.layer_types", "the phi3 family windows every layer or none", "set it to null")
        no_gemma_fields(cfg)


register(Phi3Family())
