"""Gemma 3 text (``Gemma3ForCausalLM``): Gemma 2's family (``gemma2.py``) without attention
soft-capping, plus per-head q/k norms of the (1 + weight) kind before RoPE and a second RoPE base
for the local layers (``rope_local_theta``: transformers' ``rope_local_base_freq`` / the
``sliding_attention`` ``rope_parameters``); ``rope_scaling`` (linear, in the 4B+ checkpoints)
applies to the global layers only; every 6th layer is global by default. transformers' Gemma 3
ignores ``attn_logit_softcapping`` (so does the import, with a warning). Not supported
(``UserError``): as Gemma 2, and the multimodal ``Gemma3ForConditionalGeneration``."""
from __future__ import annotations

import warnings

import megatrain_jax.hf.config as hfc
from megatrain_jax.config import ModelConfig
from megatrain_jax.errors import UserError
from megatrain_jax.families import register
from megatrain_jax.models.common import OffsetRMSNorm
from megatrain_jax.models.gemma2 import Gemma2Block, Gemma2Family


class Gemma3Block(Gemma2Block):
    QK_NORM = OffsetRMSNorm


def rope_from_hf(hf: dict, where: str) -> tuple[float, float, dict | None]:
    """(global theta, local theta, the global layers' scaling) from transformers 5's per-layer-type
    ``rope_parameters`` or transformers 4's ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling``."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # transformers 5: per layer type
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
        theta = float(full.get("rope_theta", hf.get("rope_theta", 1e6)))
        local_theta = float(local.get("rope_theta", hf.get("rope_local_base_freq", 1e4)))
        scaling = hfc.scaling_from_hf(full, where, allowed=("linear", "llama3"))
        if hfc.scaling_from_hf(local, where, allowed=("linear", "llama3")) is not None:
            hfc.refuse(where, "rope scaling of the sliding_attention layers", "use a checkpoint without it")
        if any(p.get("partial_rotary_factor", 1.0) != 1.0 for p in (full, local)):
            hfc.refuse(where, "partial_rotary_factor", "use a checkpoint that rotates the whole head dimension")
    else:  # transformers 4: rope_theta (global), rope_local_base_freq, rope_scaling (global layers)
        theta = float(hf.get("rope_theta", 1e6))
        local_theta = float(hf.get("rope_local_base_freq", 1e4))
        scaling = hfc.scaling_from_hf(hf.get("rope_scaling"), where, allowed=("linear", "llama3"))
    return theta, local_theta, scaling


class Gemma3Family(Gemma2Family):
    name = "gemma3"
    architectures = ("Gemma3ForCausalLM",)
    model_types = ("gemma3_text",)
    block = Gemma3Block
    global_every = 6

    def from_hf_config(self, hf: dict, base: ModelConfig, where: str, arch: str) -> ModelConfig:
        self.check_hf(hf, where)
        theta, local_theta, scaling = rope_from_hf(hf, where)
        if hf.get("attn_logit_softcapping"):
            warnings.warn(f"model.from_hf: attn_logit_softcapping={hf['attn_logit_softcapping']} in {where} is "
                          "ignored, as transformers' Gemma 3 ignores it", hfc.HFWarning, stacklevel=3)
        every = int(hf.get("sliding_window_pattern") or 6)
        hf = {**hf, "head_dim": hf.get("head_dim", 256)}
        fields = self.gemma_fields(hf)
        if hf.get("layer_types") is None and every != 6:
            fields["layer_types"] = ["sliding_attention" if (i + 1) % every else "full_attention"
                                     for i in range(int(hf["num_hidden_layers"]))]
        return hfc.base_from_hf(hf, base, where, self.name, rope_theta=theta, rope_scaling=scaling,
                                rope_local_theta=local_theta, **fields)

    def to_hf_config(self, cfg: ModelConfig, arch: str, out: dict) -> None:
        super().to_hf_config(cfg, arch, out)
        local = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
        out.update(attn_logit_softcapping=None, rope_local_base_freq=local,
                   rope_parameters={"full_attention": hfc.rope_params_out(cfg.rope_theta, cfg.rope_scaling),
                                    "sliding_attention": {"rope_type": "default", "rope_theta": local}})
        out.pop("sliding_window_pattern", None)  # layer_types says it

    def validate(self, cfg: ModelConfig) -> None:
        if cfg.qkv_bias:
            raise UserError("model.qkv_bias", f"the {cfg.family} family has no q/k/v biases", "set model.qkv_bias: false")
        if cfg.attn_softcap is not None:
            raise UserError("model.attn_softcap", "Gemma 3 has no attention soft-capping (transformers ignores it)",
                            "set it to null (or family gemma2)")


register(Gemma3Family())
