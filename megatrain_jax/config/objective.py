"""``train.objective`` and its fields checked with the rest of the config (``objectives.py`` runs them)."""
from __future__ import annotations

from typing import Any

from megatrain_jax.errors import UserError

OBJECTIVES = ("sft", "dpo", "ipo", "simpo", "orpo")


def check_objective(cfg: Any) -> None:
    """The objective's name and constants, ``train.reference``, and a batch that holds whole pairs."""
    t = cfg.train
    name = t.objective or "sft"
    if name not in OBJECTIVES:
        raise UserError("train.objective", f"{name!r} is not an objective", "use one of " + ", ".join(OBJECTIVES))
    if t.reference not in ("auto", "recompute"):
        raise UserError("train.reference", f"{t.reference!r}", "use auto or recompute")
    if name == "sft":
        return
    if not float(t.beta) > 0:
        raise UserError("train.beta", f"must be > 0, got {t.beta}", "set train.beta, e.g. 0.1")
    ls = float(t.label_smoothing)
    if not 0.0 <= ls < 0.5:
        raise UserError("train.label_smoothing", f"must be in [0, 0.5), got {ls}", "set 0 (plain DPO) or e.g. 0.1")
    if ls and name not in ("dpo", "simpo"):
        raise UserError("train.label_smoothing", f"is used by dpo and simpo, not {name}", "set it to 0")
    if name == "orpo" and not float(t.orpo_lambda) > 0:
        raise UserError("train.orpo_lambda", f"must be > 0, got {t.orpo_lambda}", "set train.orpo_lambda, e.g. 0.1")
    if t.engine != "streamed":
        raise UserError("train.objective", f"{name} runs on the streamed engine", "set train.engine=streamed")
    if t.batch_size % 2:
        raise UserError("train.batch_size", f"must be even with train.objective={name} (a pair is two rows), "
                        f"got {t.batch_size}", "set train.batch_size to twice the pairs per step")
    if t.micro_batches != "auto" and (t.batch_size // int(t.micro_batches)) % 2:
        raise UserError("train.micro_batches", f"{t.micro_batches} micro-batches of {t.batch_size} rows split a pair",
                        "make train.batch_size a multiple of 2 x train.micro_batches")
