"""Mixtral (``MixtralForCausalLM``): the Llama block with a sparse mixture of SwiGLU experts in every
layer (``moe.py``: the MoE layer and ``MoEFamily``, which this extends). The router's top-k weights
are always renormalised; a ``sliding_window`` applies to every layer. Checkpoint names:
``block_sparse_moe.gate`` and ``block_sparse_moe.experts.{e}.w1/w3/w2`` (gate, up, down). Not
supported (``UserError`` naming the field): ``router_jitter_noise``, attention biases."""
from __future__ import annotations

from megatrain_jax.config import ModelConfig
from megatrain_jax.errors import UserError
from megatrain_jax.families import register
from megatrain_jax.models.moe import MIXTRAL_EXPERT, MoEBlock, MoEFamily


class MixtralBlock(MoEBlock):
    QK_NORM = None


class MixtralFamily(MoEFamily):
    name = "mixtral"
    architectures = ("MixtralForCausalLM",)
    model_types = ("mixtral",)
    block = MixtralBlock
    experts_keys = ("num_local_experts", "num_experts")
    moe_prefix = "block_sparse_moe"
    expert_names = MIXTRAL_EXPERT

    def check_hf(self, hf: dict, where: str, arch: str) -> None:
        super().check_hf(hf, where, arch)
        if hf.get("router_jitter_noise"):
            raise UserError("model.from_hf", f"router_jitter_noise={hf['router_jitter_noise']} in {where} is not "
                            "supported", "set router_jitter_noise to 0 in config.json")

    def fields_from_hf(self, hf: dict, base: ModelConfig, where: str, arch: str) -> dict:
        return dict(sliding_window=int(hf["sliding_window"]) if hf.get("sliding_window") else None,
                    moe_intermediate_size=None, norm_topk_prob=True, **super().fields_from_hf(hf, base, where, arch))

    def to_hf_config(self, cfg: ModelConfig, arch: str, out: dict) -> None:
        super().to_hf_config(cfg, arch, out)
        out.update(num_local_experts=cfg.num_experts, sliding_window=cfg.sliding_window, router_jitter_noise=0.0)
        out.pop("num_experts", None)

    def validate(self, cfg: ModelConfig) -> None:
        super().validate(cfg)
        if not cfg.norm_topk_prob:
            raise UserError("model.norm_topk_prob", "Mixtral always renormalises the top-k router weights",
                            "set model.norm_topk_prob: true (or use family qwen3_moe)")
        if cfg.mlp_only_layers is not None:
            raise UserError("model.mlp_only_layers", "every Mixtral layer is sparse",
                            "set model.mlp_only_layers: null (dense layers: family qwen3_moe)")


register(MixtralFamily())
