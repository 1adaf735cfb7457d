"""Held-out evaluation of a preference objective (``train.objective``: dpo | ipo | simpo | orpo).

- **The split**: ``data.eval_fraction`` holds out a seeded choice of whole pairs (``PreferenceSplit``: training
  draws only from the others), so a chosen row and its rejected row are always on the same side; ``data.eval``
  names a held-out set prepared with ``megatrain-jax prepare --preference``.
- **The reference**: a split's held-out pairs take their reference log-probabilities from the one reference pass
  over the whole data set (the same cache entry, ``reference_logps.py``); a held-out file has its own entry, made
  by the same pass of the initial weights before step 1 and cached next to it. No second model is held.
- **The figures**, as TRL logs them at evaluation: ``eval_loss`` (the objective's loss over the held-out pairs),
  ``eval/rewards/chosen``, ``eval/rewards/rejected``, ``eval/rewards/accuracies``, ``eval/rewards/margins``,
  ``eval/logps/chosen``, ``eval/logps/rejected``: means over the pairs. The policy's log-probabilities come from
  the streamed forward-only pass with the objective's own head (``reference_logps.forward_logps``), the
  computation the reference pass ran, so at the initial weights every reward is exactly 0.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

from megatrain_jax.config.eval_fields import check_eval_fields, eval_tokens
from megatrain_jax.errors import UserError
from megatrain_jax.evaluate import ForwardPass, load_eval_file, split_windows
from megatrain_jax.reference_logps import forward_logps

F32 = jnp.float32


class PreferenceSplit:
    """A ``PreferenceDataset`` restricted to some of its pairs (``pairs``: sorted pair indices): batches, epochs and
    positions as the full data set's over those pairs only (each epoch a ``(data.seed, epoch)`` permutation of
    them). Rows come from the full data set (``base.rows``), with its reference log-probabilities: one reference
    pass, one cache entry, covers the training and the held-out pairs."""

    def __init__(self, base: Any, pairs: np.ndarray, role: str):
        self.base, self.split_pairs, self.role = base, np.asarray(pairs, np.int64), role
        self.n_pairs = int(len(self.split_pairs))

    def __getattr__(self, name: str) -> Any:  # path, seed, mask, tokens, reference, rows, ...
        return getattr(self.base, name)

    def check(self, batch_size: int, seq_len: int | None = None) -> None:
        self.base.check(batch_size, seq_len)
        if self.n_pairs < batch_size // 2:
            raise UserError("data.eval_fraction", f"{self.base.path} has {self.base.n_pairs} pairs; {self.n_pairs} are "
                            f"left for training, fewer than train.batch_size / 2 = {batch_size // 2}",
                            "lower data.eval_fraction or train.batch_size, or use more pairs")

    def pair_indices(self, step: int, batch_size: int) -> np.ndarray:
        self.check(batch_size)
        return self.split_pairs[self.base.epoch_order(step, batch_size, self.n_pairs)]

    def batch(self, step: int, batch_size: int, seq_len: int):
        return self.base.rows(self.pair_indices(step, batch_size), seq_len)

    def position(self, step: int, batch_size: int, seq_len: int | None = None) -> dict[str, int]:
        g = int(step) * (int(batch_size) // 2)
        return {"step": int(step), "epoch": g // self.n_pairs, "sample_index": g % self.n_pairs, "samples_seen": g,
                "samples_per_epoch": self.n_pairs, "seed": self.base.seed, "unit": "pairs"}

    def batches_per_epoch(self, batch_size: int) -> int:
        return -(-self.n_pairs // (batch_size // 2))

    def describe(self) -> dict[str, Any]:
        return {**self.base.describe(), "split": {"role": self.role, "pairs": self.n_pairs}}


@dataclass
class PreferenceEvalSet:
    """The fixed held-out pairs of a preference run, evaluated in batches of the training step's rows (chosen,
    rejected, ...), the last filled with pairs whose mask is zero (left out of every figure)."""

    dataset: Any  # a PreferenceDataset: the training data's full set (a split) or the held-out file's
    pairs: np.ndarray  # the pairs evaluated, in order
    batch_size: int
    seq_len: int
    source: str
    objective: Any  # objectives.Objective
    keep: Any = None

    @property
    def windows(self) -> np.ndarray:
        return self.pairs

    def size(self) -> str:
        n = len(self.pairs)
        return f"{n} pairs = {2 * n * self.seq_len:,}"

    @staticmethod
    def forward(trainer: Any):
        return preference_logps(trainer)

    def evaluate(self, run_logps, on_batch=None) -> dict[str, float]:
        return evaluate_preference(run_logps, self, self.objective, on_batch)

    @staticmethod
    def line(figures: dict) -> str:
        return (f"reward acc {figures['eval/rewards/accuracies']:.2f} margin {figures['eval/rewards/margins']:.3f}"
                f"  ({figures['eval_pairs']:,} pairs")

    @property
    def n_batches(self) -> int:
        return math.ceil(len(self.pairs) / (self.batch_size // 2))

    def batches(self):
        """(engine batch with the reference's log-probabilities where there are some, rows that count)."""
        from megatrain_jax.engine.step import Batch as EngineBatch

        per = self.batch_size // 2
        for lo in range(0, len(self.pairs), per):
            p = self.pairs[lo:lo + per]
            pad = per - len(p)
            b = self.dataset.rows(np.concatenate([p, np.repeat(p[:1], pad)]) if pad else p, self.seq_len)
            mask = b.loss_mask
            if pad:
                mask = mask.copy()
                mask[2 * len(p):] = 0.0
            yield EngineBatch(b.tokens, b.labels, mask, None, None, b.ref_logps), 2 * len(p)


def preference_split(cfg: Any, dataset: Any, log=print) -> tuple[Any, PreferenceEvalSet | None]:
    """(the training pairs, the held-out pairs or None): ``data.eval_fraction`` holds out a seeded choice of whole
    pairs (a chosen row and its rejected row are never on two sides); ``data.eval`` a prepared preference set."""
    from megatrain_jax.objectives import from_config

    check_eval_fields(cfg)
    d, t = cfg.data, cfg.train
    s = int(d.seq_len)
    want = max(1, math.ceil(eval_tokens(cfg) / (2 * s)))  # pairs per evaluation (two rows of seq_len each)
    if (t.objective or "sft") == "sft":
        return dataset, None  # (pairs under sft are refused by reference_logps.preference_start)
    obj = from_config(t)
    if d.eval_fraction is not None:
        n = dataset.n_pairs
        train_p, eval_p = split_windows(n, float(d.eval_fraction), d.seed)
        if len(train_p) == 0:
            raise UserError("data.eval_fraction", f"{d.eval_fraction} of {n} pairs leaves none for training",
                            "lower data.eval_fraction")
        train_ds = PreferenceSplit(dataset, train_p, "train")
        train_ds.check(t.batch_size, s)
        ev = PreferenceEvalSet(dataset, _spread(eval_p, want), t.batch_size, s,
                               f"{len(eval_p)} of {n} pairs held out of {dataset.path} "
                               f"(data.eval_fraction={d.eval_fraction})", obj)
        return train_ds, ev
    if d.eval:
        from megatrain_jax.data.packed import SUFFIXES

        path = _resolve(str(d.eval))
        prefix = path[:-5] if path.endswith(".json") and os.path.isfile(path[:-5] + SUFFIXES[0]) else path
        if not os.path.isfile(prefix + SUFFIXES[0]):
            raise UserError("data.eval", f"{d.eval!r} is not a preference data set written by `megatrain-jax prepare "
                            "--preference`", f"prepare the held-out pairs (megatrain-jax prepare --preference "
                            "HELD.jsonl --out PREFIX) and set data.eval=PREFIX")
        ds, _ = load_eval_file(cfg)
        if not hasattr(ds, "n_pairs"):
            raise UserError("data.eval", f"{d.eval} holds no preference pairs, and train.objective={t.objective} "
                            "evaluates on pairs", "prepare the held-out pairs with `megatrain-jax prepare "
                            "--preference`")
        if os.path.realpath(ds.path) == os.path.realpath(dataset.path):
            raise UserError("data.eval", f"{d.eval} is the training data itself", "hold out other pairs, or set "
                            "data.eval_fraction instead")
        ev = PreferenceEvalSet(ds, _spread(np.arange(ds.n_pairs, dtype=np.int64), want), t.batch_size, s,
                               f"held-out {d.eval} ({ds.n_pairs} pairs)", obj)
        return dataset, ev
    return dataset, None


def _spread(items: np.ndarray, want: int) -> np.ndarray:
    """``want`` of ``items`` evenly spread (all of them when fewer): the same at every evaluation."""
    if want < len(items):
        items = items[np.floor(np.arange(want) * (len(items) / want)).astype(np.int64)]
    return np.asarray(items, np.int64)


def _resolve(path: str) -> str:
    from megatrain_jax.data.load import resolve_path

    return resolve_path(path)


def evaluate_preference(run_logps, ev: PreferenceEvalSet, objective: Any, on_batch=None) -> dict[str, float]:
    """The held-out pairs' figures as TRL logs them at evaluation: ``eval_loss`` (the objective's loss, a mean over
    the pairs, ORPO's NLL a mean over the chosen tokens) and ``eval/rewards/*``, ``eval/logps/*`` (means over the
    pairs, ``Objective.metrics``). ``run_logps(batch)``: each row's summed log-probability of its counted tokens."""
    seq, cnt, ref = [], [], []
    for batch, rows in ev.batches():
        lp = np.asarray(run_logps(batch), np.float64).reshape(-1)
        seq.append(lp[:rows])
        cnt.append(np.asarray(batch.loss_mask, np.float64).sum(1)[:rows])
        ref.append(np.zeros(rows) if batch.ref_logps is None else np.asarray(batch.ref_logps, np.float64)[:rows])
        if on_batch is not None:
            on_batch()
    seq, cnt, ref = np.concatenate(seq), np.concatenate(cnt), np.concatenate(ref)
    loss = float(objective.total(jnp.asarray(seq, F32), jnp.asarray(cnt, F32), jnp.asarray(ref, F32),
                                 jnp.asarray(objective.norms(cnt[:, None]), F32)))
    figures = {f"eval/{k}": v for k, v in objective.metrics(seq, cnt, ref).items()}
    return {"eval_loss": loss, **figures, "eval_pairs": int(len(seq) // 2), "eval_tokens": int(cnt.sum())}


def preference_logps(trainer: Any):
    """``batch -> each row's summed log-probability``: the streamed forward-only pass with the preference objective's
    head, the one the reference pass ran (``reference_logps.forward_logps``), so the policy's and the reference's
    log-probabilities of a pair come from the same computation (equal at the initial weights)."""
    engine = trainer.engine
    fp = ForwardPass(engine)
    return lambda batch: forward_logps(engine, batch, fp)
