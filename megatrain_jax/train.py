"""The training loop: config -> data -> model -> engine -> steps, with logging.

Everything that can fail on user input (config, data, tokens) is checked before the output
directory is created, so a bad run leaves nothing half-written.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable

import numpy as np
import yaml

from megatrain_jax.config import Config
from megatrain_jax.engine import Batch, StreamedTrainer
from megatrain_jax.metrics import MetricsWriter, attention_flops_per_token, model_flops_per_token


def build_trainer(cfg: Config, model=None):
    """The configured trainer (streamed or reference).

    The streamed trainer never materialises the whole model: the host store is initialised part
    by part (or filled from a Hugging Face checkpoint, ``model.from_hf``).
    """
    from megatrain_jax.models import init_model, streamed_parts
    from megatrain_jax.models.llama import init_host_store
    from megatrain_jax.optim import build_host_optimizer, build_reference_tx

    t = cfg.train
    if t.engine == "reference":
        from megatrain_jax.reference import ReferenceTrainer

        model = model if model is not None else init_model(cfg.model, t.seed)
        return ReferenceTrainer(model, build_reference_tx(cfg.optim, t.steps), compute_dtype=t.compute_dtype)
    bf16 = t.compute_dtype == "bfloat16"
    if model is not None:
        parts, store = streamed_parts(model), None
    elif cfg.model.from_hf:
        from megatrain_jax.hf import load_hf_into_store

        parts, store = load_hf_into_store(cfg.model, bf16_stream=bf16)
    else:
        parts, store = init_host_store(cfg.model, t.seed, bf16_stream=bf16)
    return StreamedTrainer(parts, build_host_optimizer(cfg.optim, t.steps), compute_dtype=t.compute_dtype,
                           micro_batches=t.micro_batches, clip_norm=cfg.optim.clip_norm,
                           loss_chunk=t.loss_chunk, store=store)


def to_engine_batch(b: Any, doc_masking: bool) -> Batch:
    """Data-loader batch -> engine batch; document structure is passed only when masking by it."""
    return Batch(b.tokens, b.labels, b.loss_mask,
                 b.segment_ids if doc_masking else None, b.positions if doc_masking else None)


def train(cfg: Config, resume: bool = False, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run ``cfg.train.steps`` steps; returns a summary (first/last losses, throughput).

    ``resume`` continues from the newest complete checkpoint in ``train.out_dir``.
    """
    from megatrain_jax.data import load_dataset

    t, d = cfg.train, cfg.data
    dataset = load_dataset(d, cfg.model.vocab_size)  # validates the data before anything is written
    trainer = build_trainer(cfg)

    os.makedirs(t.out_dir, exist_ok=True)
    with open(os.path.join(t.out_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
    metrics = MetricsWriter(os.path.join(t.out_dir, "metrics.jsonl"))
    tokens_per_step = t.batch_size * d.seq_len
    fpt = model_flops_per_token(cfg.model)
    fpt_attn = fpt + attention_flops_per_token(cfg.model, d.seq_len)
    log(f"model: {cfg.model.total_params() / 1e6:.2f}M parameters "
        f"({cfg.model.non_embedding_params() / 1e6:.2f}M non-embedding), engine={t.engine}, "
        f"compute={t.compute_dtype}, {tokens_per_step} tokens/step")

    losses: list[float] = []
    start = time.perf_counter()
    last = start
    skipped = 0
    for step in range(t.steps):
        batch = to_engine_batch(dataset.batch(step, t.batch_size, d.seq_len), d.doc_masking)
        res = trainer.step(batch)
        now = time.perf_counter()
        dt, last = now - last, now
        losses.append(res.loss)
        skipped += int(res.skipped)
        rec = {"step": step + 1, "loss": res.loss, "grad_norm": res.grad_norm, "step_time_s": dt,
               "tokens_per_s": tokens_per_step / dt, "model_tflops": fpt * tokens_per_step / dt / 1e12,
               "model_tflops_with_attention": fpt_attn * tokens_per_step / dt / 1e12, "skipped": res.skipped}
        metrics.write(rec)
        if (step + 1) % t.log_every == 0 or step == 0 or step + 1 == t.steps:
            elapsed = now - start
            eta = elapsed / (step + 1) * (t.steps - step - 1)
            log(f"step {step + 1:>6}/{t.steps}  loss {res.loss:.4f}  grad_norm {res.grad_norm:.3f}  "
                f"tokens/s {rec['tokens_per_s']:,.0f}  model TFLOPS {rec['model_tflops']:.3f}  "
                f"elapsed {elapsed:.0f}s  eta {eta:.0f}s")
    if hasattr(trainer, "close"):
        trainer.close()
    metrics.close()
    summary = {"steps": t.steps, "first_loss": losses[0], "last_loss": losses[-1],
               "mean_last10": float(np.mean(losses[-10:])), "wall_s": time.perf_counter() - start,
               "skipped_steps": skipped}
    log(f"done: loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f} in {summary['wall_s']:.0f}s; "
        f"metrics in {os.path.join(t.out_dir, 'metrics.jsonl')}")
    return summary
