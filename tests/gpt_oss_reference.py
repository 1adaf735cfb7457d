"""Reference numbers from ``transformers`` for the gpt-oss tests (runs in .venv-torch; not a test module).

    python tests/gpt_oss_reference.py serve OUT_DIR
        For every ``VARIANTS`` entry a tiny random fp32 ``GptOssForCausalLM`` (eager attention and
        experts) saved in OUT_DIR/<variant>/hf, and OUT_DIR/<variant>/ref.npz as ``hf_reference.make``
        writes it: tokens, logits, loss, every gradient, and the same with the router's load-balancing
        loss (``aux:``). The weights are drawn so that every gpt-oss feature shows: sinks of order 1,
        expert gate/up weights large enough that the SwiGLU clamps (|gate|, |up| > 7) bite. Then prints
        ``ready`` and answers requests on stdin, one JSON list a line (each answered with ``done``):
        ``["logits", TOKENS.npy, OUT.npz, DIR, ...]`` (``hf_reference.logits``: from_pretrained(DIR));
        ``["dequant", IN.npz, OUT.npz]``: for each ``<name>_blocks``/``<name>_scales`` pair in IN,
        ``<name>`` = transformers' ``convert_moe_packed_tensors(blocks, scales, dtype=float32)``;
        ``["logits_fp32", TOKENS.npy, OUT.npz, DIR]``: DIR loaded in fp32 (an MXFP4 checkpoint is
        dequantized by transformers, ``Mxfp4Config(dequantize=True)``), its logits as ``logits:0``.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_reference  # noqa: E402

_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0,
         "original_max_position_embeddings": 16}
VARIANTS = {
    # 3 layers: sliding (window 7 < 24 tokens), full, sliding; top-2 of 4; GQA; YaRN (not truncated)
    "gptoss_untied_gqa_top2of4_yarn_window7": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_hidden_layers=3, num_key_value_heads=2, head_dim=16, intermediate_size=32, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=7, tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_parameters={**_YARN, "truncate": False})),
    # 2 layers, full then sliding (window 5); top-2 of 6; MQA, head_dim 32 != 64 / 4; tied; YaRN truncated
    "gptoss_tied_mqa_top2of6_yarn_window5": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_key_value_heads=1, head_dim=32, intermediate_size=64, num_local_experts=6, num_experts_per_tok=2,
        sliding_window=5, layer_types=["full_attention", "sliding_attention"], tie_word_embeddings=True,
        rms_norm_eps=1e-6, rope_parameters={**_YARN, "factor": 8.0, "truncate": True})),
}


def _randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    """hf_reference's values, then sinks of order 1 and expert gate/up weights that reach the clamps."""
    hf_reference_randomize(model, gen)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("self_attn.sinks"):
                p.copy_(noise)
            elif name.endswith("experts.gate_up_proj"):
                p.copy_(0.6 * noise)
            elif name.endswith("experts.gate_up_proj_bias"):
                p.copy_(0.5 * noise)


hf_reference_randomize = hf_reference._randomize


def dequant(in_path: str, out_path: str) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src = np.load(in_path)
    out = {}
    for key in src.files:
        if key.endswith("_blocks"):
            name = key[:-len("_blocks")]
            blocks, scales = torch.from_numpy(src[key]), torch.from_numpy(src[name + "_scales"])
            out[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).numpy()
    np.savez(out_path, **out)


def logits_fp32(tokens_path: str, out_path: str, d: str) -> None:
    tokens = torch.from_numpy(np.load(tokens_path).astype(np.int64))
    kw = {}
    with open(os.path.join(d, "config.json")) as f:
        if json.load(f).get("quantization_config"):
            kw["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, **kw).eval()
    experts = model.model.layers[0].mlp.experts
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float().numpy()
    np.savez(out_path, **{"logits:0": logits, "gate_up_proj:0": experts.gate_up_proj.detach().float().numpy(),
                          "down_proj:0": experts.down_proj.detach().float().numpy()})


def serve(out_dir: str) -> None:
    hf_reference._randomize = _randomize  # this process only
    hf_reference.serve(out_dir, VARIANTS, {"dequant": dequant, "logits_fp32": logits_fp32})


if __name__ == "__main__":
    hf_reference.quiet_torch()
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]!r}")
