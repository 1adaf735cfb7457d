"""transformers + peft reference numbers for tests/test_lora.py (runs in .venv-torch; not a test module).

    python tests/lora_reference.py DIR [DIR ...]
        Each DIR holds ``hf/`` (a base checkpoint), ``adapter/`` (a peft adapter directory) and
        ``inputs.npz`` (``tokens``, ``labels``, both (B, S)). Loads the base with
        AutoModelForCausalLM.from_pretrained, the adapter with PeftModel.from_pretrained(is_trainable=
        True), and writes DIR/ref.npz: ``logits`` (fp32), ``loss`` (mean token cross-entropy on the
        labels) and ``grad:<peft tensor name>`` for every adapter weight after ``loss.backward()``.
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


if __name__ == "__main__":
    main(sys.argv[1:])
