"""transformers references for tests/test_sigmoid_moe.py (GLM-4.5 and DeepSeek-V3; runs in .venv-torch).

``hf_reference.py``'s ``make``/``serve`` with these variants, and one addition: the routers'
``e_score_correction_bias`` (a buffer, which ``hf_reference._randomize`` leaves at zero) set to
0.3 x N(0, 1), so that the bias changes which experts are chosen.

    python tests/sigmoid_moe_reference.py serve OUT_DIR
"""
from __future__ import annotations

import sys

import torch

import hf_reference as H

# 24 tokens (hf_reference.SEQ) of vocabulary 128, hidden 64, 4 heads (hf_reference.SMALL)
VARIANTS = {
    # 3 layers (layer 0 dense), GQA, head_dim 32 (rotary 16), q/k/v biases, q/k norm, 8 experts in 4 groups,
    # top-3 from the best 2 groups, renormalised x 1.5, one shared expert
    "glm_gqa_bias_qknorm_groups": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        num_hidden_layers=3, first_k_dense_replace=1, num_key_value_heads=2, head_dim=32, attention_bias=True,
        use_qk_norm=True, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, n_shared_experts=1,
        n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=1.5, rms_norm_eps=1e-5,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                                    "partial_rotary_factor": 0.5})),
    # every layer sparse, tied, MHA of head_dim 16 with a quarter rotated, not renormalised, 2 shared experts
    "glm_tied_quarter_rotary_shared2": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        first_k_dense_replace=0, num_key_value_heads=4, n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
        n_shared_experts=2, norm_topk_prob=False, tie_word_embeddings=True, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})),
    # Moonlight's form: q a plain projection (q_lora_rank null), interleaved rotary, 2 shared experts, one group
    "dsv3_moonlight_form": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_hidden_layers=3, first_k_dense_replace=1, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=2, moe_intermediate_size=16, n_group=1, topk_group=1, routed_scaling_factor=2.446,
        norm_topk_prob=True, rope_interleave=True, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0})),
    # DeepSeek-V3's form: q through its low rank and norm, 4 groups (top-2 groups), YaRN with both mscales
    # (cos/sin and the softmax scale change), value heads wider than q/k (20 > 16), not renormalised, tied
    "dsv3_qlora_groups_yarn": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        first_k_dense_replace=1, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=20, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
        moe_intermediate_size=16, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=False,
        rope_interleave=True, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.7})),
}

_plain_randomize = H._randomize


def _randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    _plain_randomize(model, gen)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn(buf.shape, generator=gen, dtype=torch.float32))


H._randomize = _randomize

if __name__ == "__main__":
    H.quiet_torch()
    if sys.argv[1] == "serve":
        H.serve(sys.argv[2], VARIANTS)
    elif sys.argv[1] == "make":
        H.make(sys.argv[2], VARIANTS)
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]!r}")
