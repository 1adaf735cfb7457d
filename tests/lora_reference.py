"""transformers + peft reference numbers for tests/test_lora.py (runs in .venv-torch; not a test module).

    python tests/lora_reference.py DIR [DIR ...]
        Each DIR holds ``hf/`` (a base checkpoint), ``adapter/`` (a peft adapter directory) and
        ``inputs.npz`` (``tokens``, ``labels``, both (B, S)). Loads the base with
        AutoModelForCausalLM.from_pretrained, the adapter with PeftModel.from_pretrained(is_trainable=
        True), and writes DIR/ref.npz: ``logits`` (fp32), ``loss`` (mean token cross-entropy on the
        labels) and ``grad:<peft tensor name>`` for every adapter weight after ``loss.backward()``.

    python tests/lora_reference.py --merged DIR
        DIR holds ``hf/`` (the base), ``adapter/``, ``merged/`` (our merged export) and ``inputs.npz``;
        writes DIR/merged_ref.npz: ``peft`` (logits of peft's ``merge_and_unload()``) and ``merged``
        (logits of ``merged/`` loaded by AutoModelForCausalLM alone), both fp32.
"""
from __future__ import annotations

import sys

import numpy as np
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM


def main(dirs: list[str]) -> None:
    torch.manual_seed(0)
    for d in dirs:
        base = AutoModelForCausalLM.from_pretrained(f"{d}/hf", torch_dtype=torch.float32, attn_implementation="eager")
        model = PeftModel.from_pretrained(base, f"{d}/adapter", is_trainable=True)
        model.train()
        inp = np.load(f"{d}/inputs.npz")
        tokens, labels = torch.from_numpy(inp["tokens"]).long(), torch.from_numpy(inp["labels"]).long()
        logits = model(input_ids=tokens).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        loss.backward()
        out = {"logits": logits.detach().numpy(), "loss": np.float64(loss.item())}
        for name, p in model.named_parameters():
            if "lora_" in name:
                key = name.replace(".default.weight", ".weight")
                out[f"grad:{key}"] = p.grad.detach().numpy()
        np.savez(f"{d}/ref.npz", **out)


def merged(d: str) -> None:
    tokens = torch.from_numpy(np.load(f"{d}/inputs.npz")["tokens"]).long()
    base = AutoModelForCausalLM.from_pretrained(f"{d}/hf", torch_dtype=torch.float32, attn_implementation="eager")
    folded = PeftModel.from_pretrained(base, f"{d}/adapter").merge_and_unload().eval()
    ours = AutoModelForCausalLM.from_pretrained(f"{d}/merged", torch_dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        np.savez(f"{d}/merged_ref.npz", peft=folded(input_ids=tokens).logits.float().numpy(),
                 merged=ours.eval()(input_ids=tokens).logits.float().numpy())


if __name__ == "__main__":
    if sys.argv[1] == "--merged":
        merged(sys.argv[2])
    else:
        main(sys.argv[1:])
