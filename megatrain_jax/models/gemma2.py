"""Gemma 2 (``Gemma2ForCausalLM``), and the base of Gemma 3 (``gemma3.py``).

Embeddings times sqrt(hidden_size) (the factor cast to the compute dtype first, as transformers
does), RMSNorm as ``x / rms(x) * (1 + weight)`` in fp32, a norm before *and* after attention and
the MLP (``input_layernorm``, ``post_attention_layernorm``, ``pre_feedforward_layernorm``,
``post_feedforward_layernorm``), a GeGLU MLP with tanh GELU, attention scores scaled by
``query_pre_attn_scalar ** -0.5``, attention-logit soft-capping (``attn_softcap``), final-logit
soft-capping (``final_softcap``; inside the engine's chunked loss), and sliding-window (local)
layers mixed with global ones (``layer_types``; by default local/global alternate from layer 0).
Local and global layers differ in static attributes only, so the engine compiles one template for
each (``templates.from_nnx``). Tensor names follow the module tree. Not supported (``UserError``):
``use_bidirectional_attention``, ``attention_bias``, activations other than ``gelu_pytorch_tanh``.
"""
from __future__ import annotations

from flax import nnx

import megatrain_jax.hf.config as hfc
from megatrain_jax.config import ModelConfig
from megatrain_jax.errors import UserError
from megatrain_jax.families import Family, register
from megatrain_jax.models.common import MLP, Attention, Aux, OffsetRMSNorm, dense_block_params


class Gemma2Block(nnx.Module):
    """x + post_norm(attn(pre_norm(x))), then x + post_ff_norm(mlp(pre_ff_norm(x)))."""

    QK_NORM = None

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, layer: int = 0):
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        window = cfg.layer_window(layer)
        local = cfg.resolved_layer_types()[layer] == "sliding_attention" and cfg.rope_local_theta is not None
        self.input_layernorm = OffsetRMSNorm(h, eps)
        self.self_attn = Attention(cfg, rngs, window=window, qk_norm=self.QK_NORM, softcap=cfg.attn_softcap,
                                   scale=cfg.attention_scale, local_rope=local)
        self.post_attention_layernorm = OffsetRMSNorm(h, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(h, eps)
        self.mlp = MLP(cfg, rngs, act="gelu_tanh")
        self.post_feedforward_layernorm = OffsetRMSNorm(h, eps)

    def __call__(self, x, aux: Aux):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), aux))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def cap(v) -> float | None:
    return float(v) if v else None


class Gemma2Family(Family):
    name = "gemma2"
    architectures = ("Gemma2ForCausalLM",)
    model_types = ("gemma2",)
    block = Gemma2Block
    norm = OffsetRMSNorm
    embed_scale = True
    global_every = 2  # every 2nd layer global by default (layer_types)

    def layer_types(self, cfg: ModelConfig) -> list[str]:
        return ["sliding_attention" if (i + 1) % self.global_every else "full_attention" for i in range(cfg.num_layers)]

    # ---- Hugging Face config.json

    def check_hf(self, hf: dict, where: str) -> None:
        hfc.check_act(hf, where, ("hidden_activation", "hidden_act"), ("gelu_pytorch_tanh",), "gelu_pytorch_tanh",
                      "GeGLU (gelu_pytorch_tanh)")
        if hf.get("attention_bias"):
            hfc.refuse(where, "attention_bias", "use a checkpoint without attention biases")
        if hf.get("use_bidirectional_attention"):
            hfc.refuse(where, "use_bidirectional_attention", "use a causal (decoder) checkpoint")

    def gemma_fields(self, hf: dict) -> dict:
        """The fields Gemma 2 and 3 read alike (``hf`` with its ``head_dim`` filled in)."""
        every = self.global_every
        n = int(hf["num_hidden_layers"])
        window = hf.get("sliding_window", 4096)  # transformers' default
        types = hfc.layer_types_from_hf(hf, n, ["sliding_attention" if (i + 1) % every else "full_attention"
                                                for i in range(n)])
        default = ["sliding_attention" if (i + 1) % (2 if every == 2 else 6) else "full_attention" for i in range(n)]
        qpas = hf.get("query_pre_attn_scalar", 256)
        return dict(tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
                    sliding_window=int(window) if window else None,
                    layer_types=None if types == default else types,
                    query_pre_attn_scalar=float(qpas) if qpas is not None else None,
                    final_softcap=cap(hf.get("final_logit_softcapping", 30.0 if every == 2 else None)))

    def from_hf_config(self, hf: dict, base: ModelConfig, where: str, arch: str) -> ModelConfig:
        self.check_hf(hf, where)
        theta, scaling = hfc.rope_from_hf(hf, where)
        hf = {**hf, "head_dim": hf.get("head_dim", 256)}
        return hfc.base_from_hf(hf, base, where, self.name, rope_theta=theta, rope_scaling=scaling,
                                attn_softcap=cap(hf.get("attn_logit_softcapping", 50.0)), **self.gemma_fields(hf))

    def to_hf_config(self, cfg: ModelConfig, arch: str, out: dict) -> None:
        out.update(hfc.base_to_hf(cfg))
        out.update(hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh", attention_bias=False,
                   query_pre_attn_scalar=cfg.query_pre_attn_scalar if cfg.query_pre_attn_scalar is not None
                   else cfg.dim_per_head,
                   sliding_window=cfg.sliding_window, layer_types=cfg.resolved_layer_types(),
                   final_logit_softcapping=cfg.final_softcap, use_bidirectional_attention=False,
                   attn_logit_softcapping=cfg.attn_softcap)
        if isinstance(out["query_pre_attn_scalar"], float) and out["query_pre_attn_scalar"].is_integer():
            out["query_pre_attn_scalar"] = int(out["query_pre_attn_scalar"])  # transformers types it int

    # ---- sizes and validation

    def block_params(self, cfg: ModelConfig) -> int:
        return dense_block_params(cfg, norms=4, qk_norm=self.block.QK_NORM is not None)

    def validate(self, cfg: ModelConfig) -> None:
        if cfg.qkv_bias:
            raise UserError("model.qkv_bias", f"the {cfg.family} family has no q/k/v biases", "set model.qkv_bias: false")
        if cfg.rope_local_theta is not None:
            raise UserError("model.rope_local_theta", "Gemma 2 has one RoPE base", "set it to null (or family gemma3)")


register(Gemma2Family())
