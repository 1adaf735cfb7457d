"""Held-out evaluation: the eval set, and a streamed forward-only pass over the engine's blocks.

- **The eval set** (``eval_split``): ``data.eval`` names a held-out file (a ``.txt`` file, a prefix written by
  ``megatrain-jax prepare``, or a JSONL / text file ``prepare`` takes, tokenized into a temporary data set with
  ``data.tokenizer`` and the tokenizer's chat template), or ``data.eval_fraction`` holds out that share of the
  training windows. A split is a seeded choice of windows (samples of ``seq_len + 1`` tokens at stride ``seq_len``):
  training draws only from the others (``SplitDataset``), so no sample is in both. The eval batches are fixed
  (``train.eval_tokens`` worth of windows, evenly spread over the eval set), the same at every evaluation.
- **The pass** (``ForwardPass``): the embedding, every block and the head, each block streamed in once while every
  micro-batch passes it (layer-major, as the step's forward), the next block in flight; no boundary activation is
  kept, no gradient made, nothing sent to the optimizer. It reuses the engine's jitted block templates (each
  layer's side-effect-free ``again`` forward) and transfers. The head computes each token's negative
  log-likelihood in chunks (the logits never exist at once; with ``stream_io`` the head's vocabulary chunks stream
  past the tokens, pass 1 of its online log-sum-exp, ``io_head.HeadStream.forward_stats``) and returns, per
  sequence, the summed NLL of the
  tokens that count (chat data: only the assistant's, as in training) and their number: the mean loss, and the
  per-sequence log-probabilities a preference objective needs.
- **Memory and time**: an eval pass runs micro-batches of the training step's shape, one step's sequences at a
  time; it holds one block's weights and two micro-batch activations per micro-batch, below the step's forward
  peak (which also keeps the boundary activations), so the training plan covers it. Its time is a forward sweep:
  ``eval_pass_s`` (``plan_eval``) for the ETA.
"""
from __future__ import annotations

import math
import os
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.config.eval_fields import check_eval_fields, eval_tokens
from megatrain_jax.errors import UserError

F32 = jnp.float32
_SPLIT_SALT = 0x65766131  # the split's seed stream is (data.seed, this): not the training order's


# ------------------------------------------------------------------------------------ the eval set


class SplitDataset:
    """A ``PackedDataset`` restricted to some of its windows (``windows``: sorted window indices): batches,
    epochs and positions as the full data set's, over those windows only."""

    def __init__(self, base: Any, windows: np.ndarray, seq_len: int, role: str):
        self.base, self.windows, self.split_seq_len, self.role = base, np.asarray(windows, np.int64), int(seq_len), role

    def __getattr__(self, name: str) -> Any:  # tokens, mask, doc_starts, path, tokenizer, checksum, seed, ...
        return getattr(self.base, name)

    def _check_seq(self, seq_len: int | None) -> int:
        s = self.base._seq(seq_len)
        if s != self.split_seq_len:
            raise ValueError(f"the split was made for seq_len {self.split_seq_len}, not {s}")
        return s

    def n_samples(self, seq_len: int | None = None) -> int:
        self._check_seq(seq_len)
        return int(len(self.windows))

    def check(self, batch_size: int, seq_len: int | None = None) -> None:
        s = self._check_seq(seq_len)
        n = len(self.windows)
        if n < batch_size:
            raise UserError("data.eval_fraction", f"{self.base.path} has {self.base.n_samples(s)} samples of "
                            f"data.seq_len={s}; {n} are left for training, fewer than train.batch_size={batch_size}",
                            "lower data.eval_fraction or train.batch_size, or use more data")

    def sample_indices(self, step: int, batch_size: int, seq_len: int | None = None) -> np.ndarray:
        s = self._check_seq(seq_len)
        self.check(batch_size, s)
        n = len(self.windows)
        g = np.int64(step) * batch_size + np.arange(batch_size, dtype=np.int64)
        epochs, idx = g // n, g % n
        out = np.empty(batch_size, np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self.windows[self.base._perm(int(e), n)[idx[sel]]]
        return out

    def batch(self, step: int, batch_size: int, seq_len: int):
        return window_batch(self.base, self.sample_indices(step, batch_size, seq_len), seq_len)

    def position(self, step: int, batch_size: int, seq_len: int | None = None) -> dict[str, int]:
        n = self.n_samples(seq_len)
        g = int(step) * int(batch_size)
        return {"step": int(step), "epoch": g // n if n else 0, "sample_index": g % n if n else 0,
                "samples_seen": g, "samples_per_epoch": n, "seed": self.base.seed}

    def describe(self) -> dict[str, Any]:
        return {**self.base.describe(), "split": {"role": self.role, "windows": int(len(self.windows))}}


def window_batch(ds: Any, windows: np.ndarray, seq_len: int):
    """The batch of these windows of ``ds`` (a ``PackedDataset``), as ``PackedDataset.batch`` builds its rows."""
    from megatrain_jax.data.packed import Batch

    s, b = int(seq_len), len(windows)
    starts = np.asarray(windows, np.int64) * s
    idx = starts[:, None] + np.arange(s + 1, dtype=np.int64)
    window = np.asarray(ds.tokens[idx]).astype(np.int32)
    tokens, labels = window[:, :-1], window[:, 1:]
    if ds.mask is None:
        loss_mask = np.ones((b, s), np.float32)
    else:
        loss_mask = (np.asarray(ds.mask[idx[:, 1:]]) != 0).astype(np.float32)
    pos = idx[:, :-1]
    doc = np.searchsorted(ds.doc_starts, pos, side="right") - 1
    segment_ids = (doc - doc[:, :1]).astype(np.int32)
    positions = (pos - np.maximum(ds.doc_starts[doc], starts[:, None])).astype(np.int32)
    return Batch(np.ascontiguousarray(tokens), np.ascontiguousarray(labels), loss_mask, segment_ids, positions)


def split_windows(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training windows, eval windows) of ``n``: a seeded choice of ``round(fraction * n)`` (at least one) held
    out; a pure function of (n, fraction, seed), disjoint, together every window."""
    n_eval = max(1, int(round(fraction * n)))
    rng = np.random.default_rng([int(seed) % (1 << 64), _SPLIT_SALT])
    held = np.zeros(n, bool)
    held[rng.choice(n, size=min(n_eval, n), replace=False)] = True
    return np.flatnonzero(~held), np.flatnonzero(held)


@dataclass
class EvalSet:
    """The fixed eval batches of a run and where they come from."""

    dataset: Any  # the eval windows' data set (a SplitDataset, or the held-out file's PackedDataset)
    windows: np.ndarray  # the windows evaluated, in order
    batch_size: int
    seq_len: int
    source: str  # what the log says
    keep: Any = None  # a temporary directory the held-out data lives in (kept while the run lasts)
    doc_masking: bool = False  # attention inside documents (data.doc_masking), as training runs it

    @property
    def n_batches(self) -> int:
        return math.ceil(len(self.windows) / self.batch_size)

    def size(self) -> str:
        n = len(self.windows)
        return f"{n} samples = {n * self.seq_len:,}"

    @staticmethod
    def forward(trainer: Any):
        return forward_pass(trainer)

    def evaluate(self, run_batch, on_batch=None) -> dict[str, float]:
        return evaluate(run_batch, self, on_batch)

    @staticmethod
    def line(figures: dict) -> str:
        """The eval log line's figures (after the loss)."""
        return f"perplexity {figures['eval_ppl']:.3f}  ({figures['eval_tokens']:,} tokens"

    def batches(self):
        """The eval batches as the engine takes them (``engine.Batch``; document structure only with doc masking, as
        ``train.to_engine_batch``), each ``batch_size`` rows (the last filled with rows whose mask is zero)."""
        from megatrain_jax.engine.step import Batch as EngineBatch

        for b in self._data_batches():
            yield EngineBatch(b.tokens, b.labels, b.loss_mask, b.segment_ids if self.doc_masking else None,
                              b.positions if self.doc_masking else None)

    def _data_batches(self):
        b = self.batch_size
        for lo in range(0, len(self.windows), b):
            w = self.windows[lo:lo + b]
            pad = b - len(w)
            batch = window_batch(self.dataset, np.concatenate([w, np.repeat(w[:1], pad)]) if pad else w, self.seq_len)
            if pad:
                mask = batch.loss_mask.copy()
                mask[len(w):] = 0.0
                batch = batch._replace(loss_mask=mask)
            yield batch


def eval_split(cfg: Any, dataset: Any, log=print) -> tuple[Any, EvalSet | None]:
    """(the training data set, the eval set or None): every check before the run writes anything."""
    check_eval_fields(cfg)
    d, t = cfg.data, cfg.train
    s = int(d.seq_len)
    if d.eval_fraction is not None:
        n = dataset.n_samples(s)
        train_w, eval_w = split_windows(n, float(d.eval_fraction), d.seed)
        if len(train_w) == 0:
            raise UserError("data.eval_fraction", f"{d.eval_fraction} of {n} samples leaves none for training",
                            "lower data.eval_fraction")
        train_ds = SplitDataset(dataset, train_w, s, "train")
        train_ds.check(t.batch_size, s)
        ev = _eval_set(cfg, dataset, eval_w, f"{len(eval_w)} of {n} samples held out of {dataset.path} "
                       f"(data.eval_fraction={d.eval_fraction})")
        return train_ds, ev
    if d.eval:
        ds, keep = load_eval_file(cfg)
        if hasattr(ds, "n_pairs"):
            if keep is not None:
                keep.cleanup()
            raise UserError("data.eval", f"{d.eval} holds preference pairs, and train.objective="
                            f"{t.objective or 'sft'} trains on plain text", "hold out SFT data, or set train.objective "
                            "to dpo, ipo, simpo or orpo")
        n = ds.n_samples(s)
        if n == 0:
            raise UserError("data.eval", f"{d.eval} has {ds.n_tokens:,} tokens, fewer than one sample of "
                            f"data.seq_len={s} (+1 for the last label)",
                            f"use a held-out file of at least {s + 1} tokens, or lower data.seq_len")
        if ds.mask is not None and not np.any(np.asarray(ds.mask[: (n * s) + 1][1:]) != 0):
            raise UserError("data.eval", f"{d.eval} has no token that counts in the loss (every label is masked)",
                            "hold out conversations with assistant turns, or plain text")
        ev = _eval_set(cfg, ds, np.arange(n, dtype=np.int64), f"held-out {d.eval} ({n} samples)")
        ev.keep = keep
        return dataset, ev
    return dataset, None


def _eval_set(cfg: Any, ds: Any, windows: np.ndarray, source: str) -> EvalSet:
    s = int(cfg.data.seq_len)
    want = max(1, math.ceil(eval_tokens(cfg) / s))
    if want < len(windows):  # evenly spread over the eval set, the same at every evaluation
        windows = windows[np.floor(np.arange(want) * (len(windows) / want)).astype(np.int64)]
    return EvalSet(ds, np.asarray(windows, np.int64), int(cfg.train.batch_size), s, source,
                   doc_masking=bool(cfg.data.doc_masking))


def load_eval_file(cfg: Any) -> tuple[Any, Any]:
    """``data.eval`` as a data set: loaded as ``data.path`` is (``.txt``, a prepared prefix), or tokenized by
    ``prepare`` into a temporary directory (JSONL, text in other suffixes); (data set, the directory to keep)."""
    from megatrain_jax.data import load_dataset
    from megatrain_jax.data.load import resolve_path
    from megatrain_jax.data.packed import SUFFIXES

    d = cfg.data
    path = resolve_path(str(d.eval))
    dcfg = replace(d, path=path)
    prefix = path[:-5] if path.endswith(".json") and os.path.isfile(path[:-5] + ".tokens.bin") else path
    if os.path.isfile(prefix + SUFFIXES[0]) or (path.lower().endswith(".txt") and os.path.isfile(path)):
        return _relabel(lambda: load_dataset(dcfg, cfg.model.vocab_size)), None
    if not os.path.exists(path):
        raise UserError("data.eval", f"{d.eval!r} does not exist",
                        "set data.eval to a held-out .txt / .jsonl file or a prefix written by `megatrain-jax prepare`")
    from megatrain_jax.data import prepare

    keep = tempfile.TemporaryDirectory(prefix="megatrain-eval-")
    out = os.path.join(keep.name, "eval")
    try:
        _relabel(lambda: prepare([path], out, tokenizer=d.tokenizer or "byte", quiet=True))
    except BaseException:
        keep.cleanup()
        raise
    return _relabel(lambda: load_dataset(replace(d, path=out), cfg.model.vocab_size)), keep


def _relabel(fn):
    """``fn()`` with a data error reported against ``data.eval``."""
    try:
        return fn()
    except UserError as e:
        if e.field in ("data.path", "INPUTS") or str(e.field).startswith(("/", ".")):
            raise UserError("data.eval", e.problem, e.fix) from None
        raise


# ------------------------------------------------------------------------------------ the forward-only pass


class ForwardResult(NamedTuple):
    """Per sequence of the batch: the summed negative log-likelihood of its counted tokens, and their number."""

    nll: np.ndarray  # (B,) float64
    tokens: np.ndarray  # (B,) float64

    @property
    def logprobs(self) -> np.ndarray:
        """(B,) the summed log-probability of each sequence's counted tokens (a preference objective's input)."""
        return -self.nll

    @property
    def mean_loss(self) -> float:
        n = float(self.tokens.sum())
        return float(self.nll.sum() / n) if n else float("nan")


def token_nll(normed: jax.Array, out_matrix: jax.Array, labels: jax.Array, chunk: int,
              softcap: float | None = None) -> jax.Array:
    """(B, S) fp32 negative log-likelihood of each label, ``chunk`` tokens of logits at a time."""
    from megatrain_jax.engine.loss import capped

    b, s, h = normed.shape
    x, y = normed.reshape(-1, h), labels.reshape(-1)
    n = x.shape[0]
    c = min(int(chunk), n)
    pad = (-n) % c
    if pad:
        x, y = jnp.pad(x, ((0, pad), (0, 0))), jnp.pad(y, (0, pad))

    def body(_, inp):
        xc, yc = inp
        logits = capped(jnp.dot(xc, out_matrix, preferred_element_type=F32), softcap)
        lse = jax.nn.logsumexp(logits, axis=-1)
        return None, lse - jnp.take_along_axis(logits, yc[:, None], axis=-1)[:, 0]

    _, nll = jax.lax.scan(body, None, (x.reshape(-1, c, h), y.reshape(-1, c)))
    return nll.reshape(-1)[:n].reshape(b, s)


def sequence_nll(normed, out_matrix, labels, mask, chunk, softcap=None):
    """(per-sequence summed NLL over ``mask``, per-sequence mask sum), both (B,) fp32."""
    nll = token_nll(normed, out_matrix, labels, chunk, softcap)
    m = mask.astype(F32)
    return jnp.sum(nll * m, axis=1), jnp.sum(m, axis=1)


@jax.jit
def _stream_nll(mx, se, pk, mask):
    """A streamed head's pass-1 statistics -> (per-sequence summed NLL over ``mask``, per-sequence mask sum)."""
    m = mask.astype(F32)
    return jnp.sum((mx + jnp.log(se) - pk) * m, axis=1), jnp.sum(m, axis=1)


_HEADS: dict[Any, Any] = {}  # jitted heads, per (head function, layouts, dtype, chunk): shared by passes of one model


class ForwardPass:
    """A streamed forward-only pass through a ``StreamedTrainer`` (or its LoRA variant): ``run(batch)`` ->
    ``ForwardResult``. No gradient is made, no update sent; queued updates are applied first (``finish``), so the
    pass sees the weights after the last step, as a checkpoint of that step holds them."""

    def __init__(self, engine: Any):
        self.engine = eng = engine
        self._streamed_head = eng.io.streams_head  # stream_io: the head's vocabulary chunks
        self._head = _stream_nll if self._streamed_head else self._head_fn(eng)
        self._forward = eng.forward_without_dropout()

    @staticmethod
    def _head_fn(eng: Any):
        chunk = int(eng.options.loss_chunk)
        trees, head_fn, cap, key = eng.io.head_of(eng.dtype)
        key = None if key is None else key + (chunk,)

        def head(wh, we, h, labels, mask):
            hw, ew = trees(wh, we)
            normed, out = head_fn(hw, h, ew)
            b = h.shape[0]
            return sequence_nll(normed, out, labels, mask, max(1, chunk // max(b, 1)) * b, cap)

        try:
            if key is not None and key in _HEADS:
                return _HEADS[key]
            fn = jax.jit(head)
            if key is not None:
                _HEADS[key] = fn
            return fn
        except TypeError:  # an unhashable layout signature: this pass's own
            return jax.jit(head)

    def sweep(self, batch: Any) -> tuple:
        """The blocks' forward over ``batch`` (an ``engine.Batch``): ``(micro-batches, embedding, head, last block's
        outputs per micro-batch)``, the head taken but not applied: what an objective of its own (preference
        log-probabilities) puts its head on. Queued updates are applied first: the weights after the last step."""
        eng = self.engine
        eng.finish()
        L, weights, io, k = eng.num_layers, eng.weights, eng.io, eng.kernels
        mbs = eng._micro_batches(batch)
        eng.pace.reset()
        emb = io.take_embed(batch, mbs)
        weights.prefetch(0)
        hs = io.embed(emb, mbs)
        for i in range(L):
            w = weights.take(i)
            weights.prefetch(i + 1, wait=False)  # (not while its update runs: block i goes first)
            if i >= L - 2:
                io.prefetch_head()
            fwd = k.layers[i].again if self._forward is None else (lambda *a, i=i: self._forward(i, *a))
            hs = [fwd(w, h, mb.aux, m) for m, (h, mb) in enumerate(zip(hs, mbs))]
            eng.pace.dispatched(hs[-1])  # the dispatching thread stays the step's blocks ahead, no more
            weights.prefetch(i + 1)
        del w
        return mbs, emb, io.take_head(), hs

    def run(self, batch: Any) -> ForwardResult:
        """Each sequence's summed NLL over its mask, and its counted tokens (``ForwardResult``)."""
        from megatrain_jax.engine.step import as_batch

        mbs, emb, head, hs = self.sweep(as_batch(batch))
        if self._streamed_head:  # the head's vocabulary chunks stream past every micro-batch once (its pass 1)
            outs = [self._head(*st, mb.mask) for st, mb in zip(self.engine.io.head.forward_stats(head, hs, mbs), mbs)]
        else:
            outs = [self._head(head, emb, h, mb.labels, mb.mask) for h, mb in zip(hs, mbs)]
        self.engine.pace.reset()
        nll = np.concatenate([np.asarray(o[0], np.float64) for o in outs])
        toks = np.concatenate([np.asarray(o[1], np.float64) for o in outs])
        return ForwardResult(nll, toks)


def forward_pass(trainer: Any):
    """The forward-only pass of a run's trainer (``trainer_protocol.TrainerProtocol``): the streamed engine's
    ``ForwardPass``, or the reference trainer's own (``ReferenceTrainer.forward_nll``)."""
    engine = trainer.engine
    if engine is None:
        return trainer.forward_nll  # the reference trainer: a plain in-memory forward
    return ForwardPass(engine).run


def evaluate(run_batch, ev: EvalSet, on_batch=None) -> dict[str, float]:
    """The eval figures over ``ev``'s fixed batches: mean loss over the counted tokens, perplexity, tokens
    (``on_batch()`` after each batch: a long evaluation keeps the stall watchdog fed)."""
    nll = tok = 0.0
    for batch in ev.batches():
        r = run_batch(batch)
        nll += float(r.nll.sum())
        tok += float(r.tokens.sum())
        if on_batch is not None:
            on_batch()
    loss = nll / tok if tok else float("nan")
    return {"eval_loss": loss, "eval_ppl": float(math.exp(min(loss, 700.0))) if tok else float("nan"),
            "eval_tokens": int(tok)}


def eval_inputs(cfg: Any) -> list[str]:
    """What ``data.eval`` reads (the writers' rule keeps every output off it): its file or prepared files."""
    from megatrain_jax.data.load import resolve_path
    from megatrain_jax.data.packed import SUFFIXES

    if not getattr(cfg.data, "eval", None):
        return []
    p = resolve_path(str(cfg.data.eval))
    return [x for x in [p, *(p + s for s in SUFFIXES)] if os.path.lexists(x)]


class EvalRuns:
    """A run's evaluations (``train.py``): every ``train.eval_every`` steps and at the end, the eval set's figures
    joined to that step's record, one log line; their time is kept out of the step's and counted in the ETA."""

    def __init__(self, cfg: Any, eval_set: EvalSet, plan: Any, log=print):
        from megatrain_jax.plan.eval_pass import plan_eval

        self.set, self.log = eval_set, log
        self.every, self.steps = int(cfg.train.eval_every), int(cfg.train.steps)
        self.pass_s: list[float] = []
        planned = plan_eval(cfg, plan)
        self.planned_s = None if planned is None else planned["eval_pass_s"]
        self._run = None
        self.last: dict[str, Any] | None = None
        log(f"eval: {eval_set.source}; {eval_set.size()} tokens per evaluation, "
            + (f"every {self.every} steps and " if self.every else "") + "at the end")

    def due(self, s: int) -> bool:
        return s == self.steps or bool(self.every and s % self.every == 0)

    def remaining(self, s: int) -> int:
        """Evaluations after step ``s``."""
        n = (self.steps // self.every - s // self.every) if self.every else 0
        return n + (0 if (self.every and self.steps % self.every == 0) or s >= self.steps else 1)

    def run(self, s: int, trainer: Any, on_batch=None) -> dict[str, Any]:
        if self._run is None:
            self._run = self.set.forward(trainer)
        t0 = time.perf_counter()
        figures = self.set.evaluate(self._run, on_batch)
        line = self.set.line(figures)
        dt = time.perf_counter() - t0
        self.pass_s.append(dt)
        self.last = {"step": s, **figures}
        self.log(f"eval   {s:>6}/{self.steps}  eval_loss {figures['eval_loss']:.4f}  {line} in {dt:.1f}s)")
        return {**figures, "eval_time_s": dt}

    def run_into(self, rec: dict, s: int, trainer: Any, watchdog: Any, last: float) -> float:
        """After step ``s``: evaluate when due, into ``rec``; returns when the next step's time starts (``last``
        itself when nothing ran), so that the eval pass is in no step's time."""
        if not self.due(s):
            return last
        rec.update(self.run(s, trainer, lambda: watchdog.beat(s)))
        return time.perf_counter()

    def eta(self, elapsed: float, s: int, start: int) -> float:
        spent = sum(self.pass_s)
        per_step = max(elapsed - spent, 0.0) / max(s - start, 1)
        per_eval = (spent / len(self.pass_s)) if self.pass_s else (self.planned_s or 0.0)
        return per_step * (self.steps - s) + per_eval * self.remaining(s)


def eta_with_evals(evals: EvalRuns | None, elapsed: float, s: int, start: int, steps: int) -> float:
    """Seconds left after step ``s``: the steps to come at their mean time, and the evaluations to come apart."""
    if evals is None:
        return elapsed / max(s - start, 1) * (steps - s)
    return evals.eta(elapsed, s, start)
