"""TRL's preference losses written out directly on ``transformers``' logits (runs in .venv-torch; not a test module).

    python tests/preference_reference.py OUT_DIR

A tiny random Llama saved with ``save_pretrained`` in OUT_DIR/hf, and OUT_DIR/ref.npz: a batch of two pairs
(rows chosen, rejected, chosen, rejected; each pair's rows share their prompt, masked, and the shorter rows are
padded at the end), random reference log-probabilities, each row's summed log-probability under the model
(``seq``), and for each objective its loss (``loss:<obj>``) and every parameter's gradient (``grad:<obj>:<name>``).
The formulas are TRL's (``DPOTrainer.dpo_loss`` sigmoid and ipo, ``CPOTrainer`` simpo, ``ORPOTrainer``),
written here independently of megatrain-jax (tests/test_preference.py compares).
"""
import sys

import numpy as np
import torch
import torch.nn.functional as F
import transformers

BETA, GAMMA, LAM, LS = 0.2, 0.6, 0.3, 0.1
S, V = 24, 128


def batch(rng):
    rows, masks = [], []
    for prompt_len, lens in ((5, (20, 14)), (9, (25, 17))):
        prompt = rng.integers(0, V, prompt_len)
        for n in lens:  # chosen, rejected: n tokens after the prompt (n + prompt may exceed S + 1: cut)
            full = np.concatenate([prompt, rng.integers(0, V, n)])[:S + 1]
            m = np.zeros(S, np.float32)
            m[prompt_len - 1:len(full) - 1] = 1.0  # labels from the first completion token on
            toks = np.zeros(S + 1, np.int64)
            toks[:len(full)] = full
            rows.append(toks)
            masks.append(m)
    t = np.stack(rows)
    return t[:, :-1], t[:, 1:], np.stack(masks)


def losses(name, seq, cnt, ref):
    avg = name in ("ipo", "simpo", "orpo")
    lp = seq / cnt if avg else seq
    pc, pr = lp[0::2], lp[1::2]
    if name in ("dpo", "ipo"):
        rf = ref / cnt if avg else ref
        logits = (pc - pr) - (rf[0::2] - rf[1::2])
        if name == "ipo":
            return ((logits - 1 / (2 * BETA)) ** 2).mean()
        return (-F.logsigmoid(BETA * logits) * (1 - LS) - F.logsigmoid(-BETA * logits) * LS).mean()
    if name == "simpo":
        logits = (pc - pr) - GAMMA / BETA
        return (-F.logsigmoid(BETA * logits) * (1 - LS) - F.logsigmoid(-BETA * logits) * LS).mean()
    log_odds = (pc - pr) - (torch.log1p(-torch.exp(pc)) - torch.log1p(-torch.exp(pr)))
    nll = -seq[0::2].sum() / cnt[0::2].sum()  # the token mean over the chosen completions
    return nll - (LAM * F.logsigmoid(log_odds)).mean()


def main(out):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False, rms_norm_eps=1e-5)
    model = transformers.LlamaForCausalLM(cfg).float()
    with torch.no_grad():  # larger weights than the 0.02 init: log-probabilities that differ between rows
        for p in model.parameters():
            p.mul_(3.0)
    model.save_pretrained(f"{out}/hf", safe_serialization=True)
    rng = np.random.default_rng(0)
    tokens, labels, mask = batch(rng)
    ref = rng.normal(-160.0, 4.0, 4).astype(np.float32)
    rec = {"tokens": tokens, "labels": labels, "mask": mask, "ref": ref}
    t, y, m, r = (torch.tensor(a) for a in (tokens, labels, mask, ref))
    for name in ("dpo", "ipo", "simpo", "orpo"):
        model.zero_grad()
        logits = model(t).logits.float()
        logp = torch.gather(logits.log_softmax(-1), 2, y.unsqueeze(2)).squeeze(2)
        seq = (logp * m).sum(-1)
        loss = losses(name, seq, m.sum(-1), r.double().float())
        loss.backward()
        rec[f"loss:{name}"] = np.float64(loss.item())
        rec["seq"] = seq.detach().numpy()
        for n, p in model.named_parameters():
            rec[f"grad:{name}:{n}"] = p.grad.detach().numpy().copy()
    np.savez(f"{out}/ref.npz", **rec)


if __name__ == "__main__":
    main(sys.argv[1])
