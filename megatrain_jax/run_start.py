"""A run's start: every check on user input before anything is written, then the trainer, new or resumed.

``train()`` calls ``start_run`` first and writes nothing until it returns, so a refusal (a bad field, an output
that would overwrite an input or another run, checkpoints where a new run would go, a vocabulary the data
exceeds, a plan that does not fit) leaves no file behind. ``start_run`` also takes the run lock on
``train.out_dir`` (process 0), which ``train()`` holds until the run ends; a refusal after it releases the lock
and removes what taking it made. A resume warns about what differs from the checkpointed run. Apart from the
loop (``train.py``) because it is a unit of its own: what a run needs to begin, checked in one place.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from megatrain_jax import checkpoint as ck
from megatrain_jax.atomic import RunLock, check_train_outputs
from megatrain_jax.atomic import check_writable as check_out_dir  # train.out_dir's write probe
from megatrain_jax.config import Config
from megatrain_jax.distributed import check_shared_dir
from megatrain_jax.errors import UserError
from megatrain_jax.evaluate import EvalRuns, eval_inputs, eval_split
from megatrain_jax.placements import HOST_STATES
from megatrain_jax.plan import plan_or_refuse
from megatrain_jax.preference_eval import preference_split
from megatrain_jax.reference_logps import preference_start
from megatrain_jax.trainer import Trainer
from megatrain_jax.trainer_protocol import TrainerProtocol

Log = Callable[[str], None]


def reference_trainer(cfg: Config, model=None):
    """``train.engine=reference``: ``ReferenceTrainer.from_config`` (no plan, no checkpoints)."""
    from megatrain_jax.reference import ReferenceTrainer

    return ReferenceTrainer.from_config(cfg, model)


@dataclass
class RunStart:
    """What a run starts from, once every check has passed."""

    trainer: TrainerProtocol  # Trainer, or the reference trainer
    plan: Any  # the memory plan (None for the reference engine)
    dataset: Any
    root: str  # the checkpoint directory
    start_step: int = 0
    state: dict = field(default_factory=dict)  # the resumed checkpoint's state.json
    inputs: list = field(default_factory=list)  # what the run reads (the writers' rule keeps outputs off them)
    lock: Any = None  # atomic.RunLock on train.out_dir (process 0), held until the run ends
    eval: Any = None  # the held-out evaluations (evaluate.EvalRuns: data.eval / eval_fraction), or None


def run_inputs(cfg: Config, extra: tuple[str, ...] | list[str] = ()) -> list[str]:
    """What a run reads (no output may be, hold or lie in it): ``extra`` (the config file), the data, the
    tokenizer, ``model.from_hf`` (for a Hub id: the Hugging Face cache). Paths only: nothing is opened."""
    from megatrain_jax.data.load import resolve_path
    from megatrain_jax.data.packed import SUFFIXES
    from megatrain_jax.hf.hub import input_paths

    out = [p for p in extra if p]
    d = cfg.data
    if d.path:
        p = resolve_path(d.path)
        out += [x for x in [p, *(p + s for s in SUFFIXES)] if os.path.lexists(x)]
    if d.tokenizer and d.tokenizer != "byte":
        out.append(d.tokenizer)
    return out + input_paths(cfg.model.from_hf) + eval_inputs(cfg)  # (data.eval: evaluate.py)


def start_run(cfg: Config, resume: bool, log: Log, main: bool, extra_inputs=()) -> RunStart:
    """Every check, then the trainer; nothing is written here, so a refusal leaves no file behind."""
    from megatrain_jax.data import load_dataset

    t = cfg.train
    _check_fields(cfg)
    inputs = run_inputs(cfg, extra_inputs)
    root = ck.checkpoint_root(t.out_dir)
    if main:
        # the writers' rule (atomic.py) before anything is read: never an input, inside another run or
        # over a folder of runs or data sets; an export that would replace a run is refused now, not after
        check_train_outputs(t.out_dir, t.export, inputs)
        existing = ck.list_checkpoints(root) if not resume else []
        if existing:
            raise UserError("train.out_dir", f"{t.out_dir} already holds checkpoints (newest: step {existing[-1].step})",
                            f"pass --resume to continue that run, or choose another train.out_dir (or delete {root})")
        check_out_dir(t.out_dir, "train.out_dir")  # before the plan: not reported as 0.0 GB of free disk
    if HOST_STATES[t.host_state].sharded:  # every process must see the directory its checkpoint shards go to
        check_shared_dir(t.out_dir)
    if resume and t.engine == "reference":
        raise UserError("--resume", "checkpoints are written by the streamed engine only",
                        "set train.engine=streamed (or train without --resume)")
    if cfg.model.from_hf:
        from megatrain_jax.hf import resolve_hf_model_config

        resolve_hf_model_config(cfg.model, log)  # sizes before anything uses them; a Hub id becomes its snapshot
        _warn_positions(cfg, log)
    try:
        dataset = load_dataset(cfg.data, cfg.model.vocab_size, batch_size=t.batch_size)  # one batch must come out
    except UserError as e:
        if cfg.model.from_hf and getattr(e, "max_id", None) is not None:  # config.json sets the vocabulary
            raise UserError("data.path", f"{cfg.data.path} holds token id {e.max_id} but model.from_hf's vocabulary "
                            f"has {cfg.model.vocab_size} ids (its config.json sets model.vocab_size)",
                            "prepare the data with the model's own tokenizer (megatrain-jax prepare ... --tokenizer "
                            f"{os.path.join(cfg.model.from_hf, 'tokenizer.json')}) and set data.tokenizer to it")
        raise
    # (data.eval / data.eval_fraction: evaluate.py; preference pairs held out whole: preference_eval.py)
    dataset, evals = (preference_split if hasattr(dataset, "n_pairs") else eval_split)(cfg, dataset, log)
    # before anything is allocated (a model with adapters: the plan's LoRA rows, plan/lora.py)
    plan = plan_or_refuse(cfg, log) if t.engine == "streamed" else None
    evals = EvalRuns(cfg, evals, plan, log) if evals is not None else None
    # one command per run directory, from before anything in it is touched until the run ends (train() releases it)
    lock = RunLock(t.out_dir) if main else None
    try:
        if not resume:
            existing = ck.list_checkpoints(root) if main else []
            if existing:  # committed by a command that ended after the check above
                raise UserError("train.out_dir", f"{t.out_dir} already holds checkpoints (newest: step "
                                f"{existing[-1].step})", "pass --resume to continue that run, or choose another "
                                "train.out_dir")
            trainer = Trainer.from_config(cfg, plan) if plan is not None else reference_trainer(cfg)
            # a preference objective (dpo/ipo: the reference pass)
            preference_start(cfg, trainer, dataset, plan, False, log, evals.set if evals else None)
            return RunStart(trainer, plan, dataset, root, inputs=inputs, lock=lock, eval=evals)
        trainer, path, state = Trainer.resume(cfg, root, plan, log)  # every process reads the checkpoint
        _resume_checks(cfg, dataset, state, log)
        preference_start(cfg, trainer, dataset, plan, True, log, evals.set if evals else None)
        log(f"resumed from {path}: step {int(state['step'])}, optimizer count {trainer.step_count}")
        return RunStart(trainer, plan, dataset, root, int(state["step"]), state, inputs, lock=lock, eval=evals)
    except BaseException:
        if lock is not None:
            lock.release(undo=True)  # a refusal leaves nothing behind: no lock file, no run directory it made
        raise


def _check_fields(cfg: Config) -> None:
    t = cfg.train
    for name, v, low in [("train.ckpt_every", t.ckpt_every, 0), ("train.keep_last", t.keep_last, 0),
                         ("train.keep_every", t.keep_every, 0), ("train.max_bad_steps", t.max_bad_steps, 1)]:
        if v < low:
            raise UserError(name, f"must be >= {low}, got {v}", f"set {name} to an integer >= {low}")


def _warn_positions(cfg: Config, log: Log) -> None:
    """A ``model.from_hf`` checkpoint trained at fewer positions than ``data.seq_len``: one warning."""
    from megatrain_jax.hf import read_hf_config

    limit = read_hf_config(cfg.model.from_hf).get("max_position_embeddings")
    if isinstance(limit, int) and not isinstance(limit, bool) and cfg.data.seq_len > limit:
        log(f"warning: data.seq_len={cfg.data.seq_len} is above model.from_hf's max_position_embeddings={limit} "
            f"({cfg.model.from_hf}/config.json): the checkpoint never saw these positions")


def _resume_checks(cfg: Config, dataset, state: dict, log: Log) -> None:
    """Warn about what differs from the checkpointed run (the model itself was checked on load)."""
    saved_cfg = state.get("config", {})
    saved_data = state.get("data", {})
    desc, old = dataset.describe(), saved_data.get("describe", {})
    diff = [k for k in ("n_tokens", "n_docs", "dtype", "has_mask", "tokenizer", "sha256") if old.get(k) != desc.get(k)]
    if diff:
        log(f"warning: the data differs from the checkpointed run's ({', '.join(diff)}: {old.get(diff[0])!r} -> "
            f"{desc.get(diff[0])!r}); the run continues at step {state['step']} of the new data")
    st = saved_cfg.get("train", {})
    for key, now in (("batch_size", cfg.train.batch_size), ("steps", cfg.train.steps)):
        if key in st and st[key] != now:
            log(f"warning: train.{key} was {st[key]} in the checkpointed run, now {now}"
                + (" (the LR schedule's horizon changes)" if key == "steps" else " (the data order changes)"))
    for key, was, now in _changed(saved_cfg.get("optim", {}), cfg.to_dict().get("optim", {}), "optim"):
        log(f"warning: {key} was {was!r} in the checkpointed run, now {now!r} (the run continues with the new value)")
    if saved_cfg.get("data", {}).get("seq_len", cfg.data.seq_len) != cfg.data.seq_len:
        log(f"warning: data.seq_len was {saved_cfg['data']['seq_len']} in the checkpointed run, now {cfg.data.seq_len}")
    rng = state.get("rng", {}).get("numpy_global")
    if rng is not None:
        np.random.set_state((rng[0], np.asarray(rng[1], np.uint32), *rng[2:]))


def _changed(old: Any, new: Any, prefix: str) -> list[tuple[str, Any, Any]]:
    """``(dotted key, was, now)`` of every leaf that differs between two config sections (a key the checkpointed
    run did not have is not a change)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [c for k in new if k in old for c in _changed(old[k], new[k], f"{prefix}.{k}")]
    return [] if old == new else [(prefix, old, new)]
