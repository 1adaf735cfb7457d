"""The DeepSeek-V3 architecture (``DeepseekV3ForCausalLM``: DeepSeek-V3/R1, Kimi-K2, Moonlight-16B-A3B):
multi-head latent attention and the sigmoid-routed MoE with shared experts of ``sigmoid_moe.py``
(group-limited ``noaux_tc`` routing with the correction bias, the first ``first_k_dense_replace``
layers dense).

**Multi-head latent attention** (transformers' ``DeepseekV3Attention``), per token:
q = ``q_proj(x)``, or with ``q_lora_rank`` ``q_b_proj(q_a_layernorm(q_a_proj(x)))``, as ``num_heads``
heads of ``qk_nope_head_dim + qk_rope_head_dim`` (``ModelConfig.head_dim``); ``kv_a_proj_with_mqa(x)``
gives the latent (``kv_lora_rank``, normed by ``kv_a_layernorm``) and one rotary key part shared by
every head (``qk_rope_head_dim``); ``kv_b_proj(latent)`` gives each head's key part without position
(``qk_nope_head_dim``) and its value (``v_head_dim``). RoPE turns the rotary parts only, in DeepSeek's
interleaved layout (pairs ``(x0, x1), (x2, x3)...``; ``rope_interleave``); the softmax scale is
``head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN, whose tables are
also multiplied by transformers' ``attention_factor``. The attention itself is the common entry point
(``attention.py``) with the value heads zero-padded to the q/k width (or q and k to the value's),
the padding cut off after. The low-rank norms use eps 1e-6 (transformers' default there), not
``rms_norm_eps``.

Not run (one line each): ``rope_interleave: false``, ``attention_bias``, fewer key/value heads than
query heads, quantized releases (DeepSeek-V3/R1 and Kimi-K2 ship fp8: dequantize to bf16 first), the
multi-token-prediction layer (dropped on import with a note).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

import megatrain_jax.hf.config as hfc
from megatrain_jax.config import ModelConfig
from megatrain_jax.errors import UserError
from megatrain_jax.families import register
from megatrain_jax.models.common import Aux, RMSNorm, apply_rope, dot_product_attention, linear
from megatrain_jax.models.sigmoid_moe import SIGMOID_FIELDS, SigmoidMoEBlock, SigmoidMoEFamily

MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim")
LORA_NORM_EPS = 1e-6  # DeepseekV3RMSNorm(q_lora_rank) / (kv_lora_rank): transformers' default eps


# ------------------------------------------------------------------------------- RoPE (and YaRN)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, theta: float, s: dict) -> tuple[jax.Array, float]:
    """(inverse frequencies (dim/2,), attention_factor) as transformers' ``_compute_yarn_parameters``."""
    factor = float(s["factor"])
    att = s.get("attention_factor")
    if att is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        att = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if (m and m_all) else yarn_mscale(factor)
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1
    old = float(s["original_max_position_embeddings"])

    def corr(rot):
        return (dim * math.log(old / (rot * 2 * math.pi))) / (2 * math.log(theta))

    low, high = corr(fast), corr(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos = theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    extra, inter = 1.0 / pos, 1.0 / (factor * pos)
    keep = 1 - jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    return inter * (1 - keep) + extra * keep, float(att)


def softmax_scale(cfg: ModelConfig) -> float:
    """``head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN (transformers'
    ``yarn_apply_mscale``)."""
    scale = cfg.dim_per_head ** -0.5
    s = cfg.rope_scaling
    if s and s.get("mscale_all_dim"):
        m = yarn_mscale(float(s["factor"]), float(s["mscale_all_dim"]))
        scale = scale * m * m
    return scale


def mla_aux(positions: jax.Array, cfg: ModelConfig, segment_ids: jax.Array | None = None) -> Aux:
    """RoPE tables (B, S, qk_rope_head_dim / 2) for the rotary parts."""
    dim = cfg.qk_rope_head_dim
    if cfg.rope_scaling:
        inv_freq, att = yarn_inv_freq(dim, cfg.rope_theta, cfg.rope_scaling)
    else:
        inv_freq, att = 1.0 / (cfg.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)), 1.0
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    aux = {"cos": jnp.cos(angles) * att, "sin": jnp.sin(angles) * att}
    if segment_ids is not None:
        aux["segment_ids"] = segment_ids
    return aux


def rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """transformers' ``apply_rotary_pos_emb_interleave``: pairs (x0, x1), (x2, x3)... each turned by one
    frequency, the result in the rotate-half layout (evens' results, then odds')."""
    return apply_rope(jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1), cos, sin)


# ------------------------------------------------------------------------------- attention


class MLAttention(nnx.Module):
    """Multi-head latent attention (module docstring); causal, inside documents."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        h, n, std = cfg.hidden_size, cfg.num_heads, cfg.init_std
        self.num_heads, self.qk_dim, self.rope_dim = n, cfg.dim_per_head, cfg.qk_rope_head_dim
        self.nope_dim, self.v_dim, self.lora = cfg.dim_per_head - cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.scale = softmax_scale(cfg)
        if cfg.q_lora_rank:
            self.q_a_proj = linear(h, cfg.q_lora_rank, False, std, rngs)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = linear(cfg.q_lora_rank, n * self.qk_dim, False, std, rngs)
        else:
            self.q_proj = linear(h, n * self.qk_dim, False, std, rngs)
        self.kv_a_proj_with_mqa = linear(h, self.lora + self.rope_dim, False, std, rngs)
        self.kv_a_layernorm = RMSNorm(self.lora, LORA_NORM_EPS)
        self.kv_b_proj = linear(self.lora, n * (self.nope_dim + self.v_dim), False, std, rngs)
        self.o_proj = linear(n * self.v_dim, h, False, std, rngs)

    def __call__(self, x: jax.Array, aux: Aux) -> jax.Array:
        b, s, _ = x.shape
        n, nope, rope, vd = self.num_heads, self.nope_dim, self.rope_dim, self.v_dim
        cos, sin = aux["cos"], aux["sin"]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_a_proj") else self.q_proj(x)
        q = q.reshape(b, s, n, nope + rope)
        q = jnp.concatenate([q[..., :nope], rope_interleaved(q[..., nope:], cos, sin)], axis=-1)
        ckv = self.kv_a_proj_with_mqa(x)
        latent, k_rot = self.kv_a_layernorm(ckv[..., :self.lora]), ckv[..., self.lora:]
        k_rot = rope_interleaved(k_rot.reshape(b, s, 1, rope), cos, sin)
        kv = self.kv_b_proj(latent).reshape(b, s, n, nope + vd)
        k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(k_rot, (b, s, n, rope))], axis=-1)
        v = kv[..., nope:]
        d = max(nope + rope, vd)  # one width for q, k and v: the narrower zero-padded (no score or output changes)
        q, k, v = (jnp.pad(t, ((0, 0), (0, 0), (0, 0), (0, d - t.shape[-1]))) if t.shape[-1] < d else t
                   for t in (q, k, v))
        o = dot_product_attention(q, k, v, aux.get("segment_ids"), scale=self.scale)[..., :vd]
        return self.o_proj(o.reshape(b, s, n * vd))


class DeepseekV3Block(SigmoidMoEBlock):
    def attention(self, cfg: ModelConfig, rngs: nnx.Rngs, layer: int) -> nnx.Module:
        return MLAttention(cfg, rngs)


# ------------------------------------------------------------------------------- the family


def yarn_from_hf(scaling: dict, where: str) -> dict:
    try:
        out = {"rope_type": "yarn", "factor": float(scaling["factor"]),
               "original_max_position_embeddings": int(scaling["original_max_position_embeddings"])}
    except (KeyError, TypeError) as e:
        raise UserError("model.from_hf", f"yarn rope scaling in {where} lacks {e.args[0]!r}", "fix config.json") from None
    for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
        if scaling.get(key) is not None:
            out[key] = float(scaling[key])
    if scaling.get("truncate") is not None:
        out["truncate"] = bool(scaling["truncate"])
    return out


class DeepseekV3Family(SigmoidMoEFamily):
    name = "deepseek_v3"
    architectures = ("DeepseekV3ForCausalLM",)
    model_types = ("deepseek_v3",)
    block = DeepseekV3Block
    extra = {"moe": True, "fields": SIGMOID_FIELDS + MLA_FIELDS, "rope_scalings": ("yarn",)}
    make_aux = staticmethod(mla_aux)

    def check_hf(self, hf: dict, where: str, arch: str) -> None:
        super().check_hf(hf, where, arch)
        if hf.get("attention_bias"):
            hfc.refuse(where, "attention_bias (biases on q_a_proj, kv_a_proj_with_mqa and o_proj)",
                       "use a checkpoint without attention biases")
        if hf.get("rope_interleave", True) is False:
            hfc.refuse(where, "rope_interleave: false (the rotate-half layout)", "use DeepSeek's interleaved layout")
        heads = hf.get("num_attention_heads")
        if hf.get("num_key_value_heads") not in (None, heads):
            hfc.refuse(where, f"num_key_value_heads={hf['num_key_value_heads']} != num_attention_heads={heads} "
                       "(transformers' latent attention has a key and value per head)", "set them equal")

    def from_hf_config(self, hf: dict, base: ModelConfig, where: str, arch: str) -> ModelConfig:
        self.check_hf(hf, where, arch)
        params = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
        theta = float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind not in ("yarn", "default", None):
                hfc.refuse(where, f"rope scaling type {kind!r}", "only yarn scaling is implemented for deepseek_v3")
            scaling = yarn_from_hf(scaling, where) if kind == "yarn" else None
        try:
            nope, rope, vd = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"]), int(hf["v_head_dim"])
            kv_rank = int(hf["kv_lora_rank"])
        except KeyError as e:
            raise UserError("model.from_hf", f"{where} lacks {e.args[0]!r}", "use a complete config.json") from None
        q_rank = hf.get("q_lora_rank")
        return hfc.base_from_hf({**hf, "head_dim": nope + rope, "num_key_value_heads": hf["num_attention_heads"]},
                                base, where, self.name, rope_theta=theta, rope_scaling=scaling,
                                tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                                q_lora_rank=int(q_rank) if q_rank else None, kv_lora_rank=kv_rank,
                                qk_rope_head_dim=rope, v_head_dim=vd, **self.fields_from_hf(hf, base, where, arch))

    def to_hf_config(self, cfg: ModelConfig, arch: str, out: dict) -> None:
        super().to_hf_config(cfg, arch, out)
        rope = cfg.qk_rope_head_dim
        out.update(q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_rope_head_dim=rope,
                   qk_nope_head_dim=cfg.dim_per_head - rope, qk_head_dim=cfg.dim_per_head, v_head_dim=cfg.v_head_dim,
                   head_dim=rope, rope_interleave=True, attention_bias=False)

    def attention_params(self, cfg: ModelConfig) -> int:
        h, n, qk, rope = cfg.hidden_size, cfg.num_heads, cfg.dim_per_head, cfg.qk_rope_head_dim
        r_q, r_kv, vd = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.v_head_dim
        q = h * r_q + r_q + r_q * n * qk if r_q else h * n * qk
        return q + h * (r_kv + rope) + r_kv + r_kv * n * (qk - rope + vd) + n * vd * h

    def validate(self, cfg: ModelConfig) -> None:
        super().validate(cfg)
        if cfg.qkv_bias:
            raise UserError("model.qkv_bias", "the deepseek_v3 family has no attention biases", "set model.qkv_bias: false")
        for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            v = getattr(cfg, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise UserError(f"model.{name}", f"the deepseek_v3 family needs a positive model.{name}, got {v!r}",
                                "set it (Moonlight-16B-A3B: kv_lora_rank 512, qk_rope_head_dim 64, v_head_dim 128)")
        q = cfg.q_lora_rank
        if q is not None and (isinstance(q, bool) or not isinstance(q, int) or q <= 0):
            raise UserError("model.q_lora_rank", f"must be a positive integer or null, got {q!r}",
                            "null for a plain q projection (Moonlight), 1536 for DeepSeek-V3")
        if cfg.qk_rope_head_dim % 2 or cfg.qk_rope_head_dim >= cfg.dim_per_head:
            raise UserError("model.qk_rope_head_dim", f"{cfg.qk_rope_head_dim} must be even and below head_dim "
                            f"{cfg.dim_per_head} (qk_nope_head_dim + qk_rope_head_dim)", "fix model.head_dim or it")
        if cfg.kv_heads != cfg.num_heads:
            raise UserError("model.num_kv_heads", "latent attention has a key and value per head",
                            "set model.num_kv_heads: null")
        s = cfg.rope_scaling
        if s is not None and s.get("rope_type") != "yarn":
            raise UserError("model.rope_scaling", f"the deepseek_v3 family takes yarn scaling only, got {s!r}",
                            "use {rope_type: yarn, factor, original_max_position_embeddings, ...} or null")


register(DeepseekV3Family())
