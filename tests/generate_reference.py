"""Greedy generations from ``transformers`` for the generation parity test (runs in .venv-torch;
tests/test_generate.py).

    python tests/generate_reference.py OUT_DIR [--all]

For each of ``VARIANTS`` (a tiny random Llama, Qwen3-MoE with a sliding window, Gemma 2 with soft-caps and a sliding
window; their definitions are ``hf_reference.py``'s): the model saved with ``save_pretrained`` in OUT_DIR/<name>/hf,
and OUT_DIR/<name>/generated.json: for each of ``PROMPTS`` (token ids), ``model.generate`` greedy with
``max_new_tokens=NEW``, one prompt at a time (no padding), the new tokens only. ``--all``: every variant of
``hf_reference.py`` instead (each family and feature; a check by hand, not a test).
"""
from __future__ import annotations

import json
import os
import sys

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_reference import EXTRA, FAMILIES, MOE, SMALL, VARIANTS as HF_VARIANTS, _randomize  # noqa: E402

VARIANTS = {
    "llama": HF_VARIANTS["llama_untied_gqa_llama3rope"],
    "qwen3moe": MOE["qwen3moe_tied_mqa_top2of5_window7"],
    "gemma2": FAMILIES["gemma2_tied_gqa_softcaps_window7"],
}
# lengths 5, 11 and 3: batched together they are left-padded; with 10 new tokens every sequence passes the window 7
PROMPTS = [[5, 17, 99, 3, 42], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 120], [64, 1, 100]]
NEW = 10


def main(out_dir: str, variants: dict = VARIANTS) -> None:
    torch.manual_seed(0)
    for k, (name, (cfg_cls, model_cls, over)) in enumerate(variants.items()):
        cfg = getattr(transformers, cfg_cls)(**{**SMALL, **over})
        cfg._attn_implementation = "eager"
        cfg._experts_implementation = "eager"
        model = getattr(transformers, model_cls)(cfg).float().eval()
        _randomize(model, torch.Generator().manual_seed(4321 + k))
        d = os.path.join(out_dir, name)
        model.save_pretrained(os.path.join(d, "hf"), safe_serialization=True)
        outs = []
        with torch.no_grad():
            for p in PROMPTS:
                ids = torch.tensor([p], dtype=torch.long)
                g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                                   pad_token_id=0)
                outs.append(g[0, len(p):].tolist())
        with open(os.path.join(d, "generated.json"), "w") as f:
            json.dump({"prompts": PROMPTS, "new": NEW, "generated": outs,
                       "eos": model.generation_config.eos_token_id}, f)


if __name__ == "__main__":
    main(sys.argv[1], {**HF_VARIANTS, **FAMILIES, **MOE, **EXTRA} if "--all" in sys.argv[2:] else VARIANTS)
