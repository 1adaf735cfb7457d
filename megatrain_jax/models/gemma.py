"""Gemma 2 and Gemma 3 (text): two families in one module.

Both: embeddings times sqrt(hidden_size) (the factor cast to the compute dtype first, as
transformers does), RMSNorm as ``x / rms(x) * (1 + weight)`` in fp32, a norm before *and* after
attention and the MLP (``input_layernorm``, ``post_attention_layernorm``,
``pre_feedforward_layernorm``, ``post_feedforward_layernorm``), a GeGLU MLP with tanh GELU,
attention scores scaled by ``query_pre_attn_scalar ** -0.5``, final-logit soft-capping
(``final_softcap``; inside the engine's chunked loss), and sliding-window (local) layers mixed
with global ones (``layer_types``; by default Gemma 2 alternates local/global from layer 0,
Gemma 3 makes every 6th layer global). Local and global layers differ in static attributes only,
so the engine compiles one template for each (``templates.from_nnx``).

Gemma 2 adds attention-logit soft-capping (``attn_softcap``). Gemma 3 adds per-head q/k norms (of
the same (1 + weight) kind) before RoPE and a second RoPE base for the local layers
(``rope_local_theta``, transformers' ``rope_local_base_freq`` / the ``sliding_attention``
``rope_parameters``); ``rope_scaling`` (linear, in the 4B+ checkpoints) applies to the global
layers only. transformers' Gemma 3 ignores ``attn_logit_softcapping`` (so does the import, with a
warning). Not supported (``UserError``): ``use_bidirectional_attention``, ``attention_bias``,
activations other than ``gelu_pytorch_tanh``, the multimodal ``Gemma3ForConditionalGeneration``.
"""
from __future__ import annotations

import warnings

from flax import nnx

from megatrain_jax.config import ModelConfig
from megatrain_jax.errors import UserError
import megatrain_jax.models.hfconfig as hfconfig
from megatrain_jax.models.hfnames import HFWarning
from megatrain_jax.models.common import MLP, Attention, Aux, OffsetRMSNorm, dense_block_params
from megatrain_jax.models.registry import Family, register


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


class Gemma3Block(Gemma2Block):
    QK_NORM = OffsetRMSNorm


def _pattern(cfg: ModelConfig, every: int) -> list[str]:
    return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(cfg.num_layers)]


# ------------------------------------------------------------------------------- Hugging Face


def _common(hf: dict, where: str) -> None:
    hfconfig.check_act(hf, where, ("hidden_activation", "hidden_act"), ("gelu_pytorch_tanh",), "gelu_pytorch_tanh",
                       "GeGLU (gelu_pytorch_tanh)")
    if hf.get("attention_bias"):
        hfconfig.refuse(where, "attention_bias", "use a checkpoint without attention biases")
    if hf.get("use_bidirectional_attention"):
        hfconfig.refuse(where, "use_bidirectional_attention", "use a causal (decoder) checkpoint")


def _fields(hf: dict, every: int) -> dict:
    n = int(hf["num_hidden_layers"])
    window = hf.get("sliding_window", 4096)  # transformers' default
    types = hfconfig.layer_types_from_hf(hf, n, ["sliding_attention" if (i + 1) % every else "full_attention"
                                                 for i in range(n)])
    default = ["sliding_attention" if (i + 1) % (2 if every == 2 else 6) else "full_attention" for i in range(n)]
    qpas = hf.get("query_pre_attn_scalar", 256)
    return dict(tie_embeddings=bool(hf.get("tie_word_embeddings", True)), sliding_window=int(window) if window else None,
                layer_types=None if types == default else types,
                query_pre_attn_scalar=float(qpas) if qpas is not None else None,
                final_softcap=_cap(hf.get("final_logit_softcapping", 30.0 if every == 2 else None)))


def _cap(v) -> float | None:
    return float(v) if v else None


def gemma2_from_hf(hf: dict, base: ModelConfig, where: str, arch: str) -> ModelConfig:
    _common(hf, where)
    theta, scaling = hfconfig.rope_from_hf(hf, where)
    hf = {**hf, "head_dim": hf.get("head_dim", 256)}
    return hfconfig.base_from_hf(hf, base, where, "gemma2", rope_theta=theta, rope_scaling=scaling,
                                 attn_softcap=_cap(hf.get("attn_logit_softcapping", 50.0)), **_fields(hf, 2))


def gemma3_from_hf(hf: dict, base: ModelConfig, where: str, arch: str) -> ModelConfig:
    _common(hf, where)
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # transformers 5: per layer type
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
        theta = float(full.get("rope_theta", hf.get("rope_theta", 1e6)))
        local_theta = float(local.get("rope_theta", hf.get("rope_local_base_freq", 1e4)))
        scaling = hfconfig.scaling_from_hf(full, where, allowed=("linear", "llama3"))
        if hfconfig.scaling_from_hf(local, where, allowed=("linear", "llama3")) is not None:
            hfconfig.refuse(where, "rope scaling of the sliding_attention layers", "use a checkpoint without it")
        if any(p.get("partial_rotary_factor", 1.0) != 1.0 for p in (full, local)):
            hfconfig.refuse(where, "partial_rotary_factor", "use a checkpoint that rotates the whole head dimension")
    else:  # transformers 4: rope_theta (global), rope_local_base_freq, rope_scaling (global layers)
        theta = float(hf.get("rope_theta", 1e6))
        local_theta = float(hf.get("rope_local_base_freq", 1e4))
        scaling = hfconfig.scaling_from_hf(hf.get("rope_scaling"), where, allowed=("linear", "llama3"))
    if hf.get("attn_logit_softcapping"):
        warnings.warn(f"model.from_hf: attn_logit_softcapping={hf['attn_logit_softcapping']} in {where} is ignored, "
                      "as transformers' Gemma 3 ignores it", HFWarning, stacklevel=3)
    every = int(hf.get("sliding_window_pattern") or 6)
    hf = {**hf, "head_dim": hf.get("head_dim", 256)}
    fields = _fields(hf, 6)
    if hf.get("layer_types") is None and every != 6:
        fields["layer_types"] = ["sliding_attention" if (i + 1) % every else "full_attention"
                                 for i in range(int(hf["num_hidden_layers"]))]
    return hfconfig.base_from_hf(hf, base, where, "gemma3", rope_theta=theta, rope_scaling=scaling,
                                 rope_local_theta=local_theta, **fields)


def _to_hf(cfg: ModelConfig, out: dict) -> None:
    out.update(hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh", attention_bias=False,
               query_pre_attn_scalar=cfg.query_pre_attn_scalar if cfg.query_pre_attn_scalar is not None
               else cfg.dim_per_head,
               sliding_window=cfg.sliding_window, layer_types=cfg.resolved_layer_types(),
               final_logit_softcapping=cfg.final_softcap, use_bidirectional_attention=False)
    if isinstance(out["query_pre_attn_scalar"], float) and out["query_pre_attn_scalar"].is_integer():
        out["query_pre_attn_scalar"] = int(out["query_pre_attn_scalar"])  # transformers types it int


def gemma2_to_hf(cfg: ModelConfig, arch: str, out: dict) -> None:
    _to_hf(cfg, out)
    out["attn_logit_softcapping"] = cfg.attn_softcap


def gemma3_to_hf(cfg: ModelConfig, arch: str, out: dict) -> None:
    _to_hf(cfg, out)
    local = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
    out.update(attn_logit_softcapping=None, rope_local_base_freq=local,
               rope_parameters={"full_attention": hfconfig.rope_params_out(cfg.rope_theta, cfg.rope_scaling),
                                "sliding_attention": {"rope_type": "default", "rope_theta": local}})
    out.pop("sliding_window_pattern", None)  # layer_types says it


def _validate(cfg: ModelConfig) -> None:
    if cfg.qkv_bias:
        raise UserError("model.qkv_bias", f"the {cfg.family} family has no q/k/v biases", "set model.qkv_bias: false")


def gemma2_validate(cfg: ModelConfig) -> None:
    _validate(cfg)
    if cfg.rope_local_theta is not None:
        raise UserError("model.rope_local_theta", "Gemma 2 has one RoPE base", "set it to null (or family gemma3)")


def gemma3_validate(cfg: ModelConfig) -> None:
    _validate(cfg)
    if cfg.attn_softcap is not None:
        raise UserError("model.attn_softcap", "Gemma 3 has no attention soft-capping (transformers ignores it)",
                        "set it to null (or family gemma2)")


register(Family(
    name="gemma2", architectures=("Gemma2ForCausalLM",), model_types=("gemma2",), block=Gemma2Block,
    block_params=lambda cfg: dense_block_params(cfg, norms=4), config_from_hf=gemma2_from_hf,
    config_to_hf=gemma2_to_hf, norm=OffsetRMSNorm, embed_scale=True,
    default_layer_types=lambda cfg: _pattern(cfg, 2), validate=gemma2_validate))

register(Family(
    name="gemma3", architectures=("Gemma3ForCausalLM",), model_types=("gemma3_text",), block=Gemma3Block,
    block_params=lambda cfg: dense_block_params(cfg, norms=4, qk_norm=True), config_from_hf=gemma3_from_hf,
    config_to_hf=gemma3_to_hf, norm=OffsetRMSNorm, embed_scale=True,
    default_layer_types=lambda cfg: _pattern(cfg, 6), validate=gemma3_validate))
