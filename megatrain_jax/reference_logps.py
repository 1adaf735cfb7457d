"""The reference model of DPO and IPO without a second model in memory.

Before the first step, a streamed forward-only pass of the initial weights over the whole preference data
set computes each pair's reference log-probabilities (chosen, rejected): the same engine, the same blocks
streamed through the GPU once per batch, the head's forward only (``objectives.token_logps``: the
log-probabilities from the chunked loss path, no logits whole). They are written next to the prepared data::

    PREFIX.reference.npy   float32 (pairs, 2): each pair's summed log-probabilities of its chosen and
                           rejected completions under the initial weights
    PREFIX.reference.json  what they came from: the weights (the Hugging Face checkpoint's files, or the
                           model config and seed of a fresh initialisation; LoRA: the base and its dtype),
                           the data's checksum, the sequence length and compute dtype; and their hash (the key)

A later run with the same key reuses them (no pass); one whose weights or data differ is refused in one
line (stale) unless ``train.reference=recompute``. A resumed run reads the same file: the key is made from
the config, not from the weights it has trained since.

With LoRA the reference is the frozen base with the adapters disabled (as TRL computes it for a peft
model). The pass runs the adapted blocks at initialisation, where every adapter's B is zero, so each
block's output is exactly the base's; the key names the base, not the adapters, so another adapter
configuration on the same base and data reuses the file. The pass is the one extra forward TRL would run
per step with adapters disabled, done once per data set instead of once per step of every epoch.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any, Callable

import numpy as np

from megatrain_jax.errors import UserError

VERSION = 1
SUFFIX_NPY, SUFFIX_JSON = ".reference.npy", ".reference.json"


def paths(data_prefix: str) -> tuple[str, str]:
    return data_prefix + SUFFIX_NPY, data_prefix + SUFFIX_JSON


def _weights_source(cfg: Any) -> dict:
    m = cfg.model
    if m.from_hf:
        d = m.from_hf
        files = sorted(f for f in os.listdir(d) if f.endswith((".safetensors", ".json"))) if os.path.isdir(d) else []
        return {"from_hf": os.path.abspath(d),
                "files": [[f, os.path.getsize(os.path.join(d, f)), os.stat(os.path.join(d, f)).st_mtime_ns]
                          for f in files]}
    return {"init": m.init, "seed": int(cfg.train.seed)}


def describe(cfg: Any, dataset: Any) -> dict:
    """What the reference log-probabilities depend on (the key is its hash)."""
    model = {k: v for k, v in cfg.to_dict()["model"].items() if k not in ("seq_tile", "lora", "moe_impl")}
    lora = cfg.model.lora
    d = dataset.describe()
    return {"version": VERSION, "model": model, "weights": _weights_source(cfg),
            "lora_base_dtype": None if lora is None else lora.base_dtype,
            "data": {"sha256": d.get("sha256"), "n_tokens": d.get("n_tokens"), "pairs": d.get("pairs")},
            "seq_len": int(cfg.data.seq_len), "compute_dtype": cfg.train.compute_dtype}


def key_of(desc: dict) -> str:
    return hashlib.sha256(json.dumps(desc, sort_keys=True, default=str).encode()).hexdigest()


def _first_difference(old: Any, new: Any, path: str = "") -> str:
    if isinstance(old, dict) and isinstance(new, dict):
        for k in sorted(set(old) | set(new)):
            if old.get(k) != new.get(k):
                return _first_difference(old.get(k), new.get(k), f"{path}.{k}" if path else k)
    return f"{path}: {old!r} -> {new!r}"[:200]


def cached(cfg: Any, dataset: Any, resume: bool = False) -> np.ndarray | None:
    """The valid cached reference log-probabilities of ``cfg`` over ``dataset``, or None where a pass must make
    them. Stale ones are refused in one line (``train.reference=recompute`` replaces them), as are missing ones
    on ``resume`` (the initial weights are gone)."""
    npy, js = paths(dataset.path)
    desc = describe(cfg, dataset)
    if cfg.train.reference == "recompute" and not resume:
        return None
    if not os.path.isfile(js) or not os.path.isfile(npy):
        if resume:
            raise UserError("train.reference", f"{npy} (the reference log-probabilities this run started from) is "
                            "missing, and the initial weights are no longer at hand to make it again",
                            "restore the file, or start a new run (a new train.out_dir)")
        return None
    try:
        with open(js) as f:
            old = json.load(f)
        arr = np.load(npy, allow_pickle=False)
    except (OSError, ValueError):
        raise UserError("train.reference", f"{npy} or {js} is unreadable", "delete both; the next run makes them "
                        "again") from None
    if old.get("key") != key_of(desc):
        raise UserError("train.reference", f"{npy} is stale: made from other weights or data "
                        f"({_first_difference(old.get('describe', {}), desc)})",
                        "set train.reference=recompute to replace it (or delete it)" if not resume else
                        "restore the reference file this run started from, or start a new run")
    if arr.shape != (dataset.n_pairs, 2) or arr.dtype != np.float32:
        raise UserError("train.reference", f"{npy} holds {arr.shape} {arr.dtype}, not ({dataset.n_pairs}, 2) float32",
                        "set train.reference=recompute")
    return arr


def write(cfg: Any, dataset: Any, arr: np.ndarray, seconds: float) -> str:
    """Atomically: the array, then the description that makes it valid."""
    npy, js = paths(dataset.path)
    desc = describe(cfg, dataset)
    tmp = f"{npy}.tmp{os.getpid()}.npy"
    np.save(tmp, np.asarray(arr, np.float32))
    if os.path.exists(js):
        os.remove(js)  # (an index on disk means a complete pair of files)
    os.replace(tmp, npy)
    tmpj = f"{js}.tmp{os.getpid()}"
    with open(tmpj, "w") as f:
        json.dump({"key": key_of(desc), "describe": desc, "pass_seconds": seconds}, f, indent=1, default=str)
    os.replace(tmpj, js)
    return npy


# ------------------------------------------------------------------------------------ the pass


def forward_logps(engine: Any, batch: Any, fp: Any = None) -> np.ndarray:
    """Each row's summed log-probability of its masked-in labels under the engine's current weights: the blocks'
    streamed forward-only sweep (``evaluate.ForwardPass.sweep``: each block fetched and run once, no activation
    kept, nothing updated), then the objective's head, forward only (``fp``: a ``ForwardPass`` of ``engine`` to
    reuse)."""
    from megatrain_jax.engine.step import Batch
    from megatrain_jax.evaluate import ForwardPass

    k, io = engine.kernels, engine.io
    b = engine.preference_batch(Batch(batch.tokens, batch.labels, batch.loss_mask))
    k.begin(engine.count)
    mbs, emb, head, hs = (fp or ForwardPass(engine)).sweep(b)
    out = io.seq_logps(head, emb, hs, mbs)  # (stream_io: the head's chunks, pass 1 only)
    engine.pace.reset()
    return engine.host_logps(out)


def reference_pass(engine: Any, dataset: Any, batch_size: int, seq_len: int, log: Callable[[str], None] = print
                   ) -> tuple[np.ndarray, float]:
    """(pairs, 2) reference log-probabilities of every pair, in batches of ``batch_size`` rows, and the seconds taken."""
    from megatrain_jax.evaluate import ForwardPass

    n, per = dataset.n_pairs, batch_size // 2
    out = np.zeros((n, 2), np.float32)
    fp = ForwardPass(engine)
    t0 = last = time.perf_counter()
    for lo in range(0, n, per):
        pairs = np.arange(lo, lo + per) % n  # the last batch wraps around (its extra rows are dropped)
        rows = forward_logps(engine, dataset.rows(pairs, seq_len), fp)
        take = min(per, n - lo)
        out[lo:lo + take] = rows.reshape(-1, 2)[:take]
        if time.perf_counter() - last > 30:
            last = time.perf_counter()
            log(f"reference pass: {lo + take:,} of {n:,} pairs ({last - t0:.0f} s)")
    return out, time.perf_counter() - t0


def predicted_pass_s(plan: Any, n_batches: int) -> float | None:
    """The plan's time for the pass (``plan.build.reference_pass_s`` per batch)."""
    from megatrain_jax.plan.step_model import reference_pass_s

    st = getattr(plan, "step", None) or {}
    return n_batches * reference_pass_s(st) if "compute_s" in st else None


def prepare(cfg: Any, trainer: Any, dataset: Any, plan: Any, resume: bool, log: Callable[[str], None]) -> None:
    """The objective set on the trainer's engine and, for dpo/ipo, the dataset's reference log-probabilities
    (``dataset.reference``, which its batches then carry): cached, or made by the pass (fresh runs only) and
    written next to the data."""
    from megatrain_jax.objectives import from_config

    obj = from_config(cfg.train)
    engine = trainer.engine  # (trainer_protocol.TrainerProtocol)
    engine.kernels.objective = obj
    per = cfg.train.batch_size // (engine.options.micro_batches * engine.num_devices)
    if per % 2:  # (micro_batches=auto may have split a pair: refused before anything is written)
        raise UserError("train.micro_batches", f"{engine.options.micro_batches} micro-batches over "
                        f"{engine.num_devices} device(s) give each {per} rows of train.batch_size="
                        f"{cfg.train.batch_size}: a pair is two rows", "set train.micro_batches so that "
                        "batch_size / (micro_batches x devices) is even")
    if obj is None or not obj.needs_reference:
        return
    dataset.reference = reference_of(cfg, engine, dataset, plan, resume, log)


def reference_of(cfg: Any, engine: Any, dataset: Any, plan: Any, resume: bool, log: Callable[[str], None]
                 ) -> np.ndarray:
    """The (pairs, 2) reference log-probabilities of ``dataset``: cached, or made by the pass (fresh runs only) and
    written next to the data."""
    from megatrain_jax.distributed import is_main

    arr = cached(cfg, dataset, resume)
    if arr is None:
        t = cfg.train
        n_batches = -(-dataset.n_pairs // (t.batch_size // 2))
        pred = predicted_pass_s(plan, n_batches)
        log(f"reference pass: {dataset.n_pairs:,} pairs in {n_batches} batches of {t.batch_size} rows, forward only"
            + (f" (planned {pred:.1f} s)" if pred is not None else ""))
        arr, secs = reference_pass(engine, dataset, t.batch_size, cfg.data.seq_len, log)
        path = write(cfg, dataset, arr, secs) if is_main() else paths(dataset.path)[0]
        log(f"reference pass: done in {secs:.1f} s; {path}")
    else:
        log(f"reference log-probabilities: {paths(dataset.path)[0]} (made from the same weights and data)")
    return arr


def preference_start(cfg: Any, trainer: Any, dataset: Any, plan: Any, resume: bool, log: Callable[[str], None],
                     eval_set: Any = None) -> None:
    """The run's start's hook (run_start.py), before anything is written: a preference objective trains on
    preference pairs (and pairs only under one); the objective set on the engine and, for dpo/ipo, the reference
    (``prepare``). A split of the pairs (``data.eval_fraction``) takes its reference from the whole data set's pass;
    a held-out file of pairs (``data.eval``) has its own, cached next to it as the training data's is."""
    pairs = hasattr(dataset, "n_pairs")
    if cfg.train.objective != "sft" and not pairs:
        raise UserError("data.path", f"train.objective={cfg.train.objective} trains on preference pairs, and "
                        f"{dataset.path} holds none", "prepare the pairs with `megatrain-jax prepare --preference`")
    if cfg.train.objective == "sft" and pairs:
        raise UserError("train.objective", f"{dataset.path} holds preference pairs, not SFT data",
                        "set train.objective to dpo, ipo, simpo or orpo")
    if cfg.train.objective != "sft":
        from megatrain_jax.distributed import is_main

        say = log if is_main() else (lambda _m: None)
        full = getattr(dataset, "base", dataset)  # (preference_eval.PreferenceSplit: the whole set, one pass)
        prepare(cfg, trainer, full, plan, resume, say)
        held = getattr(eval_set, "dataset", None)
        engine = getattr(trainer, "engine", trainer)
        obj = engine.kernels.objective
        if held is not None and held is not full and obj is not None and obj.needs_reference:
            held.reference = reference_of(cfg, engine, held, plan, resume, say)


def reward_line(rec: dict) -> str:
    """The step's log line part for a preference objective's rewards (TRL's accuracies and margins); "" otherwise."""
    if "rewards/accuracies" not in rec:
        return ""
    return f"reward acc {rec['rewards/accuracies']:.2f} margin {rec['rewards/margins']:.3f}  "
