"""A 300-step LoRA fine-tune on chat data made with ``prepare``: ``megatrain-jax train`` against the same
fine-tune in ``transformers`` + ``peft`` (PyTorch, CPU); both loss curves in one PNG.

    PYTHONPATH=$PWD .venv/bin/python experiments/lora_chat_curve.py [--steps 300] [--work DIR] [--out DIR]

What is the same on both sides: the base (a random-init 4-layer Llama-shaped model, hidden 256, written
as a Hugging Face checkpoint that both load), the adapters' initial values (ours, saved in the PEFT
format and loaded by ``PeftModel.from_pretrained``: A peft-uniform, B zero), every batch (our loader's
batches for steps 1..N, dumped once), the masked token-mean loss (assistant tokens only), AdamW's
hyper-parameters and the learning rate per step (the warmup-cosine schedule's values), and the global
gradient-norm clipping rule (``optax.clip_by_global_norm``'s). Both compute in fp32.

The data: deterministic synthetic conversations (arithmetic, word reversal, counting, capitals), a
byte-level BPE tokenizer trained on the shipped tinyshakespeare text with a ChatML template, prepared
with ``megatrain-jax prepare`` so that only assistant tokens carry loss.

The torch side is this file too, run by ``.venv-torch``'s interpreter (``--torch-side WORK``); peft
from that environment or ``LORA_PEFT_PATH``. Results: ``curve.png`` and ``curves.json`` in ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>",
            "<|im_end|>", "<|endoftext|>"]
SHAPE = dict(vocab_size=640, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=704)
CONFIG = ROOT / "configs" / "lora-chat-curve.yaml"


# ------------------------------------------------------------------------------------------ data


def conversations(n: int, seed: int = 0) -> list[dict]:
    """``n`` deterministic conversations of four small tasks (answers follow rules, so the loss can fall)."""
    rs = random.Random(seed)
    words = ["king", "crown", "sword", "night", "love", "death", "queen", "honour", "blood", "heart", "duke",
             "tongue", "grace", "lord", "fair", "sweet", "world", "heaven", "father", "son", "time", "eyes"]
    capitals = {"France": "Paris", "Italy": "Rome", "Spain": "Madrid", "England": "London", "Denmark": "Copenhagen",
                "Norway": "Oslo", "Greece": "Athens", "Egypt": "Cairo", "Poland": "Warsaw", "Austria": "Vienna"}
    out = []
    for _ in range(n):
        t = rs.randrange(4)
        if t == 0:
            a, b = rs.randrange(100), rs.randrange(100)
            q, ans = f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
        elif t == 1:
            ws = rs.sample(words, rs.randint(3, 5))
            q, ans = "Reverse these words: " + " ".join(ws), " ".join(reversed(ws))
        elif t == 2:
            i = rs.randrange(50)
            q, ans = f"Count from {i} to {i + 4}.", " ".join(str(i + k) for k in range(5))
        else:
            c = rs.choice(sorted(capitals))
            q, ans = f"What is the capital of {c}?", f"The capital of {c} is {capitals[c]}."
        msgs = ([{"role": "system", "content": "Answer briefly."}] if rs.random() < 0.5 else []) + [
            {"role": "user", "content": q}, {"role": "assistant", "content": ans}]
        out.append({"messages": msgs})
    return out


def make_tokenizer(folder: Path) -> None:
    """A byte-level BPE (vocab 600 + specials) with the ChatML template of tests/fixtures/chat."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    text = (ROOT / "data" / "tinyshakespeare.txt").read_text()[:200_000]
    tk.train_from_iterator([text], trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True, exist_ok=True)
    tk.save(str(folder / "tokenizer.json"))
    shutil.copy(ROOT / "tests" / "fixtures" / "chat" / "chatml_tokenizer_config.json", folder / "tokenizer_config.json")


# ------------------------------------------------------------------------------------------ our side


def run(cmd: list[str], **kw) -> None:
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def overrides(work: Path, steps: int) -> list[str]:
    return [f"model.from_hf={work / 'hf'}", f"data.path={work / 'chat'}", f"data.tokenizer={work / 'hf' / 'tokenizer.json'}",
            f"train.steps={steps}", f"train.out_dir={work / 'run'}"]


def setup(work: Path, steps: int) -> dict:
    """Tokenizer, conversations, ``prepare``, the HF base, the initial adapter (PEFT) and the batches."""
    import dataclasses

    from megatrain_jax.config import ModelConfig, load_config
    from megatrain_jax.data import load_dataset
    from megatrain_jax.engine.lora import LoraModel
    from megatrain_jax.hf.exporter import export_hf
    from megatrain_jax.hf.peft import save_peft
    from megatrain_jax.models.common import Decoder
    from megatrain_jax.optim.build import learning_rate_or_schedule
    from megatrain_jax.optim.named import resolved

    if work.exists():
        shutil.rmtree(work)
    make_tokenizer(work / "hf")
    with open(work / "chat.jsonl", "w") as f:
        for c in conversations(3000):
            f.write(json.dumps(c) + "\n")
    prep = [sys.executable, "-m", "megatrain_jax", "prepare", str(work / "chat.jsonl"), "--out", str(work / "chat"),
            "--tokenizer", str(work / "hf"), "--chat-template", str(work / "hf"), "--workers", "1"]
    run(prep, env={**os.environ, "PYTHONPATH": str(ROOT)})
    cfg = load_config(str(CONFIG), overrides(work, steps))
    base_cfg = ModelConfig(**SHAPE, family="llama", rope_theta=10000.0, tie_embeddings=False)
    export_hf(Decoder(base_cfg, 1234), base_cfg, str(work / "hf_tmp"), "float32", log=lambda _: None)
    for p in (work / "hf_tmp").iterdir():  # the base's weights and config next to the tokenizer
        shutil.move(str(p), work / "hf" / p.name)
    (work / "hf_tmp").rmdir()
    lora_cfg = dataclasses.replace(base_cfg, lora=cfg.model.lora)
    save_peft(str(work / "adapter0"), LoraModel(lora_cfg).init_adapters(cfg.train.seed), lora_cfg, str(work / "hf"))
    ds = load_dataset(cfg.data, SHAPE["vocab_size"], batch_size=cfg.train.batch_size)
    bs = [ds.batch(s, cfg.train.batch_size, cfg.data.seq_len) for s in range(steps)]
    lr = learning_rate_or_schedule(cfg.optim, steps)
    lrs = [float(lr) if isinstance(lr, float) else float(lr(i)) for i in range(steps)]
    np.savez(work / "batches.npz", tokens=np.stack([b.tokens for b in bs]), labels=np.stack([b.labels for b in bs]),
             mask=np.stack([b.loss_mask for b in bs]), lr=np.asarray(lrs, np.float64))
    h = resolved(cfg.optim)
    hyper = {"b1": h["b1"], "b2": h["b2"], "eps": h["eps"], "weight_decay": cfg.optim.weight_decay,
             "clip_norm": cfg.optim.clip_norm, "rank": cfg.model.lora.rank, "alpha": cfg.model.lora.alpha}
    (work / "hyper.json").write_text(json.dumps(hyper))
    mask = np.stack([b.loss_mask for b in bs])
    return {"prepare": " ".join(prep[3:]), "assistant_token_fraction": float(mask.mean()), **hyper,
            "lr_peak": cfg.optim.lr, "batch_size": cfg.train.batch_size, "seq_len": cfg.data.seq_len}


def ours(work: Path, steps: int) -> tuple[list[float], list[float], str, float]:
    cmd = [sys.executable, "-m", "megatrain_jax", "train", str(CONFIG.relative_to(ROOT))]
    for o in overrides(work, steps):
        cmd += ["--set", o]
    t0 = time.time()
    run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"})
    recs = [json.loads(x) for x in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs], [r["grad_norm"] for r in recs], " ".join(cmd[1:]), time.time() - t0


def theirs(work: Path) -> tuple[list[float], list[float], float]:
    py = ROOT / ".venv-torch" / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "JAX", "XLA", "VIRTUAL_ENV"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    if os.environ.get("LORA_PEFT_PATH"):
        env["PYTHONPATH"] = os.environ["LORA_PEFT_PATH"]
    t0 = time.time()
    run([str(py), __file__, "--torch-side", str(work)], env=env)
    r = json.loads((work / "torch.json").read_text())
    return r["loss"], r["grad_norm"], time.time() - t0


def plot(path: Path, a: list[float], b: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.arange(1, len(a) + 1)
    rel = np.abs(np.asarray(a) - np.asarray(b)) / np.abs(np.asarray(b))
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax.plot(steps, b, label="transformers + peft (PyTorch, CPU)", lw=2.5, alpha=0.6)
    ax.plot(steps, a, label="megatrain-jax train, model.lora (streamed base)", lw=1, ls="--", color="k")
    ax.set_ylabel("loss (assistant tokens)")
    ax.set_title("LoRA rank 8 on every projection, 4-layer Llama-shaped base, chat data from prepare")
    ax.legend()
    bx.semilogy(steps, np.maximum(rel, 1e-9))
    bx.set_ylabel("|ours - peft| / peft\n(equal: drawn at 1e-9)", fontsize=8)
    bx.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--work", default="/tmp/lora_chat_curve")
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results" / "lora_chat_curve_cpu_2026-11-25"))
    ap.add_argument("--plot-only", action="store_true", help="redraw curve.png from --out's curves.json")
    ap.add_argument("--torch-side", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.torch_side:
        return torch_side(Path(args.torch_side))
    if args.plot_only:
        r = json.loads((Path(args.out) / "curves.json").read_text())
        return plot(Path(args.out) / "curve.png", r["loss"]["megatrain_jax"], r["loss"]["peft"])
    work, out = Path(args.work), Path(args.out)
    t0 = time.time()
    info = setup(work, args.steps)
    la, ga, train_cmd, ta = ours(work, args.steps)
    lb, gb, tb = theirs(work)
    rel = np.abs(np.asarray(la) - np.asarray(lb)) / np.abs(np.asarray(lb))
    out.mkdir(parents=True, exist_ok=True)
    plot(out / "curve.png", la, lb)
    res = {"device": "cpu", "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
           "env": {"LORA_PEFT_PATH": os.environ.get("LORA_PEFT_PATH"), "cores": os.cpu_count(),
                   "load_avg_at_end": os.getloadavg()[0]},
           "prepare_command": "megatrain-jax " + info.pop("prepare"), "train_command": "megatrain-jax " + train_cmd.split(" ", 2)[2],
           "model": {**SHAPE, "family": "llama", "base": "random init (seed 1234), fp32 HF checkpoint"},
           "setup": info, "steps": args.steps,
           "final_loss": {"megatrain_jax": la[-1], "peft": lb[-1]}, "first_loss": {"megatrain_jax": la[0], "peft": lb[0]},
           "max_rel_diff_loss": float(rel.max()), "max_rel_diff_loss_at_step": int(rel.argmax()) + 1,
           "max_rel_diff_grad_norm": float(np.max(np.abs(np.asarray(ga) - gb) / np.asarray(gb))),
           "wall_s": {"megatrain_jax_train": round(ta, 1), "peft": round(tb, 1), "total": round(time.time() - t0, 1)},
           "loss": {"megatrain_jax": la, "peft": lb}, "grad_norm": {"megatrain_jax": ga, "peft": gb}}
    (out / "curves.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k not in ("loss", "grad_norm")}, indent=1))


# ------------------------------------------------------------------------------------------ torch side


def torch_side(work: Path) -> None:
    """The same fine-tune in transformers + peft: the base, the initial adapter, the batches and the
    learning rates from ``work``; AdamW and the global-norm clip as ours."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(1)  # the machine is shared: one thread ran 2x faster than two
    h = json.loads((work / "hyper.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(str(work / "hf"), torch_dtype=torch.float32, attn_implementation="eager")
    model = PeftModel.from_pretrained(base, str(work / "adapter0"), is_trainable=True)
    model.train()
    params = [p for n, p in model.named_parameters() if p.requires_grad]
    assert params and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    d = np.load(work / "batches.npz")
    opt = torch.optim.AdamW(params, lr=float(d["lr"][0]), betas=(h["b1"], h["b2"]), eps=h["eps"],
                            weight_decay=h["weight_decay"])
    losses, norms = [], []
    for s in range(len(d["lr"])):
        tokens, labels = torch.from_numpy(d["tokens"][s]).long(), torch.from_numpy(d["labels"][s]).long()
        mask = torch.from_numpy(d["mask"][s]).float()
        logits = model(input_ids=tokens).logits.float()
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        loss = (ce * mask.reshape(-1)).sum() / mask.sum().clamp(min=1.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params)).float()
        if h["clip_norm"] is not None and norm >= h["clip_norm"]:  # optax.clip_by_global_norm's rule
            for p in params:
                p.grad.mul_(h["clip_norm"] / norm)
        for g in opt.param_groups:
            g["lr"] = float(d["lr"][s])
        opt.step()
        losses.append(loss.item())
        norms.append(norm.item())
        if s % 25 == 0:
            print(f"peft step {s + 1}: loss {losses[-1]:.4f} grad_norm {norms[-1]:.3f}", flush=True)
    (work / "torch.json").write_text(json.dumps({"loss": losses, "grad_norm": norms}))


if __name__ == "__main__":
    main()
