"""Preference pairs: ``megatrain-jax prepare --preference`` and the data set the objectives train on.

Input: JSONL records in TRL's preference formats (``trl`` dataset formats, "preference"):

- standard: ``{"prompt": str, "chosen": str, "rejected": str}``;
- conversational: ``{"prompt": [messages], "chosen": [messages], "rejected": [messages]}``, rendered with the
  chat template as TRL's ``maybe_apply_chat_template`` does it: the prompt with the generation prompt
  added, each completion the rest of ``template(prompt + completion)``;
- implicit prompt: ``{"chosen": [messages], "rejected": [messages]}``: the prompt is the longest common
  prefix of the two conversations (TRL's ``extract_prompt``).

Each completion ends with the tokenizer's EOS where it has one (TRL's ``DPOTrainer.tokenize_row``).

The written data set is the packed format (``packed.py``) with two documents per pair, pair ``j`` being
documents ``2j`` (prompt + chosen) and ``2j + 1`` (prompt + rejected), the prompt's tokens masked out of
the loss, and ``"preference": {"pairs": n}`` in the index. ``PreferenceDataset.batch`` puts each pair in two
adjacent rows (chosen, then rejected) of ``seq_len`` tokens, each padded on the right (padding masked,
label 0), so a pair shares its position in the batch, never straddles a micro-batch, and each row's
summed log-probability is one sequence's. A sequence longer than ``seq_len + 1`` tokens keeps the end of
its prompt and the start of its completion (TRL's ``truncation_mode="keep_end"`` for the prompt, completions
cut from the right), at least one completion token.
"""
from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

import numpy as np

import megatrain_jax.data.chat as chat
from megatrain_jax.errors import UserError

PREFERENCE_KEY = "preference"  # the index entry that marks a preference data set


class PreferenceBatch(NamedTuple):
    """One step's pairs as rows (chosen, rejected, chosen, ...): the fields of ``packed.Batch``, and ``pairs``."""

    tokens: np.ndarray
    labels: np.ndarray
    loss_mask: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    pairs: np.ndarray  # (B / 2,) the pair index of each row pair
    ref_logps: np.ndarray | None = None  # (B,) each row's reference log-probability (dpo, ipo: ``reference`` set)


# ------------------------------------------------------------------------------------ prepare


def _as_text(value: Any, where: str, name: str) -> str | list:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        return chat.to_messages({"messages": value}, "messages", where)
    raise UserError(where, f"'{name}' is neither a string nor a list of messages", "give prompt/chosen/rejected as "
                    "strings, or as conversations [{\"role\": ..., \"content\": ...}]")


def _record(obj: Any, where: str) -> tuple:
    """One JSONL record -> (prompt, chosen, rejected), each a string or a message list."""
    if not isinstance(obj, dict) or "chosen" not in obj or "rejected" not in obj:
        raise UserError(where, "is not a preference pair (no 'chosen' and 'rejected')",
                        "write {\"prompt\": ..., \"chosen\": ..., \"rejected\": ...} per line")
    c, r = _as_text(obj["chosen"], where, "chosen"), _as_text(obj["rejected"], where, "rejected")
    if "prompt" in obj:
        p = _as_text(obj["prompt"], where, "prompt")
    elif isinstance(c, list) and isinstance(r, list):  # implicit prompt: the common prefix of the conversations
        n = 0
        while n < min(len(c), len(r)) - 1 and c[n] == r[n]:
            n += 1
        if n == 0:
            raise UserError(where, "has no 'prompt' and the two conversations share no first turn",
                            "add a 'prompt' field")
        p, c, r = c[:n], c[n:], r[n:]
    else:
        raise UserError(where, "has no 'prompt'", "add a 'prompt' field (or give chosen/rejected as conversations "
                        "that begin with it)")
    if isinstance(p, list) != isinstance(c, list) or isinstance(c, list) != isinstance(r, list):
        raise UserError(where, "mixes strings and conversations", "give all three as strings or all as messages")
    return p, c, r


def _texts(p, c, r, template, where: str) -> tuple[str, str, str]:
    """(prompt text, chosen completion text, rejected completion text)."""
    if isinstance(p, str):
        return p, c, r
    if template is None:
        raise UserError("--chat-template", f"{where} is a conversation but no chat template was found",
                        "pass --chat-template MODEL_DIR, or --chat-template chatml")
    prompt = template.render(p, add_generation_prompt=True, where=where)
    out = [prompt]
    for comp in (c, r):
        full = template.render(p + comp, where=where)
        if not full.startswith(prompt):  # (TRL's maybe_apply_chat_template makes the same assumption)
            raise UserError(where, "the chat template renders the conversation with a different prompt than the "
                            "prompt alone with its generation prompt", "use another chat template")
        out.append(full[len(prompt):])
    return tuple(out)


def prepare_preference(inputs: list[str], out: str, tokenizer: str = "byte", chat_template: str | None = None,
                       quiet: bool = False, on_error: str = "stop", overwrite: bool = False) -> dict[str, Any]:
    """``prepare --preference``: JSONL preference pairs -> a packed preference data set at ``out``."""
    from megatrain_jax.data.jsonl import open_binary
    from megatrain_jax.data.packed import PackedWriter
    from megatrain_jax.data.pipeline import check_out, expand_inputs, make_dirs, remove_empty
    from megatrain_jax.data.tokenizer import dtype_for_vocab, load_tokenizer

    if on_error not in ("stop", "skip"):
        raise UserError("--on-error", f"{on_error!r} is not a policy", "use stop or skip")
    if not inputs:
        raise UserError("INPUTS", "no input files given", "pass one or more .jsonl files of preference pairs")
    out = check_out(out, overwrite, [*inputs, tokenizer if tokenizer != "byte" else None,
                                      chat_template if chat_template != "chatml" else None])
    files = expand_inputs(inputs)
    tok = load_tokenizer(tokenizer, "--tokenizer")
    if chat_template == "chatml":
        template = chat.ChatTemplate(chat.CHATML_TEMPLATE)
    elif chat_template:
        template = chat.ChatTemplate.from_folder(chat_template)
        if template is None:
            raise UserError("--chat-template", f"{chat_template} has no chat template", "pass the model's folder, or chatml")
    else:
        template = chat.ChatTemplate.from_folder(getattr(tok, "path", None))
    made = make_dirs(os.path.dirname(os.path.abspath(out)))
    w = PackedWriter(out, dtype_for_vocab(tok.vocab_size), tok.eos_id)
    pairs = bad = 0
    try:
        for path in files:
            with open_binary(path) as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    where = f"{path}:{lineno}"
                    try:
                        try:
                            obj = json.loads(line)
                        except ValueError as e:
                            raise UserError(where, f"is not valid JSON ({e.__class__.__name__})",
                                            "write one JSON object per line") from None
                        pt, ct, rt = _texts(*_record(obj, where), template, where)
                        if not ct or not rt:
                            raise UserError(where, "has an empty completion", "drop or fill the record")
                    except UserError as e:
                        if on_error == "stop" or e.field == "--chat-template":
                            raise
                        bad += 1
                        continue
                    p_ids, c_ids, r_ids = tok.encode_batch([pt, ct, rt]) if pt else [np.zeros(0, np.int64),
                                                                                     *tok.encode_batch([ct, rt])]
                    for comp in (c_ids, r_ids):  # the prompt masked; the completion and its EOS trained on
                        w.start_doc()
                        if len(p_ids):
                            w.append(np.asarray(p_ids), np.zeros(len(p_ids), np.uint8))
                        w.append(np.asarray(comp), np.ones(len(comp), np.uint8))
                        w.end_doc()
                    pairs += 1
        if pairs == 0:
            raise UserError("INPUTS", "no preference pair was read", "pass JSONL files of prompt/chosen/rejected records")
        w.flush()
        if w._mask_f is None:  # (every pair has a prompt: the mask file exists; a pair without one still needs it)
            w._open_mask()
        index = w.commit({"vocab_size": tok.vocab_size, "tokenizer": tok.describe(),
                          "sources": [os.path.abspath(p) for p in files],
                          PREFERENCE_KEY: {"pairs": pairs, "bad_lines_skipped": bad}})
    except BaseException:
        w.abort()
        remove_empty(made)
        raise
    if not quiet:
        print(f"prepare: wrote {out} ({pairs:,} preference pairs, {index['n_tokens']:,} tokens"
              + (f", {bad:,} bad lines skipped" if bad else "") + ")", flush=True)
    return index


def preference_main(argv: list[str]) -> int:
    """``megatrain-jax prepare --preference INPUTS... --out PREFIX [--tokenizer ...] [--chat-template ...]``."""
    import argparse

    ap = argparse.ArgumentParser(prog="megatrain-jax prepare --preference",
                                 description="Tokenize JSONL preference pairs (prompt/chosen/rejected, TRL's formats) "
                                             "for train.objective=dpo|ipo|simpo|orpo.")
    ap.add_argument("inputs", nargs="+", metavar="INPUTS")
    ap.add_argument("--preference", action="store_true", required=True)
    ap.add_argument("--out", required=True, metavar="PREFIX")
    ap.add_argument("--tokenizer", default="byte")
    ap.add_argument("--chat-template", default=None, metavar="DIR|chatml")
    ap.add_argument("--on-error", default="stop", choices=("stop", "skip"))
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--overwrite", action="store_true")
    a = ap.parse_args(argv)
    prepare_preference(a.inputs, a.out, a.tokenizer, a.chat_template, a.quiet, a.on_error, a.overwrite)
    return 0


# ------------------------------------------------------------------------------------ the data set


class PreferenceDataset:
    """Pairs as adjacent rows; the pair order a permutation seeded by ``(data.seed, epoch)``, so
    ``batch(step)`` is a pure function of the step (exact resume), as ``PackedDataset``'s."""

    def __init__(self, packed: Any, n_pairs: int):
        if packed.n_docs != 2 * n_pairs:
            raise UserError("data.path", f"{packed.path} holds {packed.n_docs} documents, not 2 per pair "
                            f"({n_pairs} pairs)", "re-run `megatrain-jax prepare --preference`")
        self.packed, self.n_pairs = packed, int(n_pairs)
        self.reference: np.ndarray | None = None  # (pairs, 2) reference log-probabilities (reference_logps.py)
        self.path, self.seed, self.mask = packed.path, packed.seed, packed.mask
        starts = packed.doc_starts
        self.starts = starts
        self.ends = np.append(starts[1:], packed.n_tokens)

    # the PackedDataset interface train.py reads
    n_tokens = property(lambda self: self.packed.n_tokens)
    tokens = property(lambda self: self.packed.tokens)

    def describe(self) -> dict[str, Any]:
        return {**self.packed.describe(), "pairs": self.n_pairs}

    def check(self, batch_size: int, seq_len: int | None = None) -> None:
        if batch_size <= 0 or batch_size % 2:
            raise UserError("train.batch_size", f"must be a positive even number (a pair is two rows), got {batch_size}",
                            "set train.batch_size to twice the pairs per step")
        if self.n_pairs < batch_size // 2:
            raise UserError("train.batch_size", f"{self.path} has {self.n_pairs} pairs, fewer than "
                            f"train.batch_size / 2 = {batch_size // 2}", "lower train.batch_size or use more pairs")

    def pair_indices(self, step: int, batch_size: int) -> np.ndarray:
        """The pairs of ``batch(step)`` (``epoch_order`` over all of them)."""
        self.check(batch_size)
        return self.epoch_order(step, batch_size, self.n_pairs)

    def epoch_order(self, step: int, batch_size: int, n: int) -> np.ndarray:
        """Positions among ``n`` pairs that ``batch(step)`` takes: global pair ``g = step * B/2 + j`` is entry
        ``g % n`` of epoch ``g // n``'s permutation, so each epoch visits every pair once. Shared with the
        held-out split (preference_eval.py), which maps the positions onto its training pairs."""
        per = batch_size // 2
        g = np.int64(step) * per + np.arange(per, dtype=np.int64)
        epochs, idx = g // n, g % n
        out = np.empty(per, np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self.packed._perm(int(e), n)[idx[sel]]
        return out

    def rows(self, pairs: np.ndarray, seq_len: int) -> PreferenceBatch:
        """The rows of ``pairs`` (chosen, rejected, ...), each ``seq_len`` tokens, padded right."""
        s = int(seq_len)
        docs = np.stack([2 * pairs, 2 * pairs + 1], axis=1).reshape(-1)
        B = len(docs)
        tokens = np.zeros((B, s), np.int32)
        labels = np.zeros((B, s), np.int32)
        mask = np.zeros((B, s), np.float32)
        for i, d in enumerate(docs):
            a, b = int(self.starts[d]), int(self.ends[d])
            toks = np.asarray(self.packed.tokens[a:b]).astype(np.int32)
            m = np.asarray(self.mask[a:b]) != 0 if self.mask is not None else np.ones(b - a, bool)
            if len(toks) > s + 1:  # keep the prompt's end and the completion's start (keep_end / cut right)
                n_prompt = int(np.argmax(m)) if m.any() else 0
                keep_prompt = max(min(n_prompt, s), 0)
                keep_prompt = min(keep_prompt, s)  # at least one completion token as a label
                lo = n_prompt - keep_prompt
                toks, m = toks[lo:lo + s + 1], m[lo:lo + s + 1]
            n = len(toks) - 1
            tokens[i, :n], labels[i, :n], mask[i, :n] = toks[:-1], toks[1:], m[1:]
        pos = np.broadcast_to(np.arange(s, dtype=np.int32), (B, s)).copy()
        ref = None if self.reference is None else self.reference[pairs].reshape(-1)
        return PreferenceBatch(tokens, labels, mask, np.zeros((B, s), np.int32), pos, pairs.astype(np.int64), ref)

    def batch(self, step: int, batch_size: int, seq_len: int) -> PreferenceBatch:
        return self.rows(self.pair_indices(step, batch_size), seq_len)

    def position(self, step: int, batch_size: int, seq_len: int | None = None) -> dict[str, int]:
        g = int(step) * (int(batch_size) // 2)
        return {"step": int(step), "epoch": g // self.n_pairs, "sample_index": g % self.n_pairs, "samples_seen": g,
                "samples_per_epoch": self.n_pairs, "seed": self.seed, "unit": "pairs"}

    def batches_per_epoch(self, batch_size: int) -> int:
        return -(-self.n_pairs // (batch_size // 2))


def preference_of(packed: Any, index: dict) -> Any:
    """``packed`` as a ``PreferenceDataset`` when ``index`` marks a preference data set; else unchanged."""
    entry = index.get(PREFERENCE_KEY)
    if not isinstance(entry, dict):
        return packed
    return PreferenceDataset(packed, int(entry.get("pairs", 0)))
