"""Qwen3 (dense): the Llama block with a per-head RMSNorm on q and k (before RoPE), no q/k/v bias,
an explicit head_dim, and optionally windowed layers mixed with full ones. Hugging Face:
``Qwen3ForCausalLM`` (``self_attn.q_norm`` / ``k_norm``; every other name as Llama's).

The whole family is this file, extending Llama's (docs/porting.md, "A new model family"): the
block sets ``QK_NORM``; the family object overrides the Hugging Face checks and fields, adds its
config.json keys, counts the q/k norms, and validates."""
from __future__ import annotations

import megatrain_jax.hf.config as hfc
from megatrain_jax.config import ModelConfig
from megatrain_jax.families import register
from megatrain_jax.models.common import RMSNorm, dense_block_params
from megatrain_jax.models.llama import Block, LlamaFamily, no_gemma_fields, no_qkv_bias


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
    types = hfc.layer_types_from_hf(hf, n, default)
    if set(types) == {"full_attention"}:
        return None, None
    return window, (None if set(types) == {"sliding_attention"} else types)


class Qwen3Family(LlamaFamily):
    name = "qwen3"
    architectures = ("Qwen3ForCausalLM",)
    model_types = ("qwen3",)
    block = Qwen3Block
    act_keys = ("hidden_act",)

    def check_hf(self, hf: dict, where: str, arch: str) -> None:
        hfc.check_act(hf, where, self.act_keys, ("silu", "swish"), "silu", "SwiGLU (silu)")
        if hf.get("attention_bias"):
            hfc.refuse(where, "attention_bias (biases on q/k/v and o_proj)", "use a checkpoint without attention biases")

    def fields_from_hf(self, hf: dict, base: ModelConfig, where: str, arch: str) -> dict:
        window, types = layer_types_from_hf(hf)
        return dict(sliding_window=window, layer_types=types)

    def to_hf_config(self, cfg: ModelConfig, arch: str, out: dict) -> None:
        super().to_hf_config(cfg, arch, out)
        types = cfg.resolved_layer_types()
        windowed = cfg.sliding_window is not None and "sliding_attention" in types
        out.update(attention_bias=False, use_sliding_window=windowed,
                   sliding_window=cfg.sliding_window if windowed else None,
                   layer_types=types if windowed else ["full_attention"] * cfg.num_layers,
                   max_window_layers=types.index("sliding_attention") if windowed else cfg.num_layers)

    def block_params(self, cfg: ModelConfig) -> int:
        return dense_block_params(cfg, qk_norm=True)

    def validate(self, cfg: ModelConfig) -> None:
        no_qkv_bias(cfg)
        no_gemma_fields(cfg)


register(Qwen3Family())
