"""GLM-4.5 and GLM-4.5-Air (``Glm4MoeForCausalLM``): Llama-style grouped-query attention with q/k/v
biases (``attention_bias``), optional per-head q/k RMSNorm (``use_qk_norm``) and *partial* rotary
embeddings (the first ``partial_rotary_factor`` x head_dim dimensions of each head, rotate-half
layout; transformers' default 0.5), and the sigmoid-routed MoE with a shared expert of
``sigmoid_moe.py`` (128 experts, top-8, ``noaux_tc`` with ``e_score_correction_bias``), the first
``first_k_dense_replace`` layers dense. Tensor names follow transformers (``self_attn.q_proj``,
``mlp.gate``, ``mlp.experts.{e}.gate_proj``, ``mlp.shared_experts.*``).

Not run: the multi-token-prediction layer (dropped on import with a note), GLM-4.5V's vision
variants (``Glm4vMoeForConditionalGeneration``: not an importable architecture).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import megatrain_jax.hf.config as hfc
from megatrain_jax.config import ModelConfig
from megatrain_jax.errors import UserError
from megatrain_jax.families import register
from megatrain_jax.models.common import Attention, Aux, RMSNorm, apply_rope, rope_tables
from megatrain_jax.models.sigmoid_moe import SIGMOID_FIELDS, SigmoidMoEBlock, SigmoidMoEFamily

GLM_PARTIAL_DEFAULT = 0.5  # Glm4MoeConfig's partial_rotary_factor when config.json has none


def rotary_dim(cfg: ModelConfig) -> int:
    """The rotated dimensions of each head, as transformers: ``int(head_dim * partial_rotary_factor)``."""
    return int(cfg.dim_per_head * cfg.partial_rotary_factor)


def glm_aux(positions: jax.Array, cfg: ModelConfig, segment_ids: jax.Array | None = None) -> Aux:
    """RoPE tables of the rotated dimensions only."""
    cos, sin = rope_tables(positions, rotary_dim(cfg), cfg.rope_theta, cfg.rope_scaling)
    aux = {"cos": cos, "sin": sin}
    if segment_ids is not None:
        aux["segment_ids"] = segment_ids
    return aux


class PartialRotaryAttention(Attention):
    """``Attention`` whose RoPE turns the first ``rotary`` dimensions of each q/k head (the tables'
    width) and passes the rest through."""

    def project(self, x: jax.Array, cos: jax.Array, sin: jax.Array):
        b, s, _ = x.shape
        n, kv, d = self.num_heads, self.kv_heads, self.head_dim
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = q.reshape(b, s, n, d), k.reshape(b, s, kv, d), v.reshape(b, s, kv, d)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        r = 2 * cos.shape[-1]

        def rope(t):
            return jnp.concatenate([apply_rope(t[..., :r], cos, sin), t[..., r:]], axis=-1) if r < d \
                else apply_rope(t, cos, sin)

        return rope(q), rope(k), v


class Glm4MoeBlock(SigmoidMoEBlock):
    def attention(self, cfg: ModelConfig, rngs: nnx.Rngs, layer: int) -> nnx.Module:
        return PartialRotaryAttention(cfg, rngs, bias=cfg.qkv_bias, qk_norm=RMSNorm if cfg.qk_norm else None)


class Glm4MoeFamily(SigmoidMoEFamily):
    name = "glm4_moe"
    architectures = ("Glm4MoeForCausalLM",)
    model_types = ("glm4_moe",)
    block = Glm4MoeBlock
    extra = {"moe": True, "fields": SIGMOID_FIELDS + ("partial_rotary_factor", "qk_norm")}
    make_aux = staticmethod(glm_aux)

    def from_hf_config(self, hf: dict, base: ModelConfig, where: str, arch: str) -> ModelConfig:
        self.check_hf(hf, where, arch)
        params = hf.get("rope_parameters") or {}
        factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", GLM_PARTIAL_DEFAULT))
        plain = {k: v for k, v in hf.items() if k != "partial_rotary_factor"}
        if params:
            plain["rope_parameters"] = {k: v for k, v in params.items() if k != "partial_rotary_factor"}
        theta, scaling = hfc.rope_from_hf(plain, where, allowed=self.rope_scalings)
        return hfc.base_from_hf(hf, base, where, self.name, rope_theta=theta, rope_scaling=scaling,
                                tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                                qkv_bias=bool(hf.get("attention_bias", False)), qk_norm=bool(hf.get("use_qk_norm")),
                                partial_rotary_factor=float(factor), **self.fields_from_hf(hf, base, where, arch))

    def to_hf_config(self, cfg: ModelConfig, arch: str, out: dict) -> None:
        super().to_hf_config(cfg, arch, out)
        out["rope_parameters"]["partial_rotary_factor"] = cfg.partial_rotary_factor
        out.update(attention_bias=cfg.qkv_bias, use_qk_norm=cfg.qk_norm, partial_rotary_factor=cfg.partial_rotary_factor)

    def attention_params(self, cfg: ModelConfig) -> int:
        h, d = cfg.hidden_size, cfg.dim_per_head
        q, kv = cfg.num_heads * d, cfg.kv_heads * d
        return 2 * h * q + 2 * h * kv + ((q + 2 * kv) if cfg.qkv_bias else 0) + (2 * d if cfg.qk_norm else 0)

    def validate(self, cfg: ModelConfig) -> None:
        super().validate(cfg)
        r = cfg.partial_rotary_factor
        if not 0 < r <= 1 or rotary_dim(cfg) % 2:
            raise UserError("model.partial_rotary_factor", f"{r!r} x head_dim {cfg.dim_per_head} is not an even "
                            "number of rotated dimensions", "use a factor in (0, 1] (GLM-4.5: 0.5)")


register(Glm4MoeFamily())
