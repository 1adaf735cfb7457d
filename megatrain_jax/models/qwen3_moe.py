"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's block (per-head q/k RMSNorm) with a sparse mixture
of SwiGLU experts (``moe.py``: the MoE layer and ``MoEFamily``, which this extends); the router's
top-k weights are renormalised with ``norm_topk_prob``. Some layers may be dense
(``ModelConfig.mlp_only_layers``: transformers' ``mlp_only_layers`` and ``decoder_sparse_step``),
with a plain SwiGLU MLP of ``intermediate_size``. Checkpoint names: ``mlp.gate`` and
``mlp.experts.{e}.gate_proj/up_proj/down_proj``."""
from __future__ import annotations

from megatrain_jax.config import ModelConfig
from megatrain_jax.errors import UserError
from megatrain_jax.families import register
from megatrain_jax.models.common import RMSNorm
from megatrain_jax.models.moe import MoEBlock, MoEFamily


class Qwen3MoeBlock(MoEBlock):
    QK_NORM = RMSNorm


def mlp_only_layers_from_hf(hf: dict, n: int, where: str) -> list[int] | None:
    """Qwen3-MoE's dense layers as transformers picks them: layer ``i`` is sparse unless it is in
    ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``. None: every layer sparse."""
    step, only = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise UserError("model.from_hf", f"decoder_sparse_step={step!r} in {where} is not a positive integer",
                        "fix config.json")
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        raise UserError("model.from_hf", f"mlp_only_layers={only!r} in {where} is not a list of layer indices",
                        "fix config.json")
    dense = [i for i in range(n) if i in only or (i + 1) % step != 0]
    if n and len(dense) == n:
        raise UserError("model.from_hf", f"decoder_sparse_step={step} and mlp_only_layers={only} in {where} make "
                        "every layer dense (no experts)", "load it as a dense model (Qwen3ForCausalLM)")
    return dense or None


def mlp_only_layers_to_hf(cfg: ModelConfig) -> tuple[int, list[int]]:
    """(decoder_sparse_step, mlp_only_layers) for config.json: a step when one gives exactly our
    dense layers (the form checkpoints use), else step 1 and the list."""
    dense = sorted(cfg.mlp_only_layers or [])
    for step in range(2, cfg.num_layers + 1):
        if dense == [i for i in range(cfg.num_layers) if (i + 1) % step != 0]:
            return step, []
    return 1, dense


class Qwen3MoeFamily(MoEFamily):
    name = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)
    model_types = ("qwen3_moe",)
    block = Qwen3MoeBlock
    experts_keys = ("num_experts", "num_local_experts")

    def fields_from_hf(self, hf: dict, base: ModelConfig, where: str, arch: str) -> dict:
        window = int(hf["sliding_window"]) if hf.get("use_sliding_window") and hf.get("sliding_window") else None
        n = int(hf.get("num_hidden_layers") or 0)
        return dict(sliding_window=window, moe_intermediate_size=int(hf["moe_intermediate_size"]),
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                    mlp_only_layers=mlp_only_layers_from_hf(hf, n, where),
                    **super().fields_from_hf(hf, base, where, arch))

    def to_hf_config(self, cfg: ModelConfig, arch: str, out: dict) -> None:
        super().to_hf_config(cfg, arch, out)
        step, only = mlp_only_layers_to_hf(cfg)
        out.update(num_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_intermediate_size or cfg.intermediate_size,
                   norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=step, mlp_only_layers=only,
                   attention_bias=False, use_sliding_window=cfg.sliding_window is not None,
                   sliding_window=cfg.sliding_window)
        out.pop("num_local_experts", None)


register(Qwen3MoeFamily())
