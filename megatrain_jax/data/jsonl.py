"""JSONL records for ``prepare``: text, prompt/response, conversations rendered with a chat template.

Chunks of lines are parsed, rendered and tokenized inline or in spawned worker processes; a bad line
names its file:line and, with ``--on-error skip``, is skipped and counted instead of stopping the run.
"""
from __future__ import annotations

import gzip
import json
from typing import IO, TYPE_CHECKING, Any

import numpy as np

import megatrain_jax.data.chat as chat
from megatrain_jax.data.tokenizer import load_tokenizer
from megatrain_jax.errors import UserError

if TYPE_CHECKING:
    from megatrain_jax.data.packed import PackedWriter
    from megatrain_jax.data.progress import Progress


def open_binary(path: str) -> IO[bytes]:
    """A file opened for binary reading, gunzipped when its name ends in .gz. Public: data/pipeline.py
    opens its inputs with it."""
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _parse_record(line: bytes, where: str, chat_format: str = "auto") -> tuple:
    """One JSONL line -> ("text", t) | ("pair", prompt, response) | ("chat", messages)."""
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise UserError(where, f"is not valid JSON ({e.__class__.__name__}: {str(e).splitlines()[0]})",
                        "write one JSON object per line, e.g. {\"text\": \"...\"}") from None
    if not isinstance(obj, dict):
        raise UserError(where, f"is a JSON {type(obj).__name__}, not an object",
                        "write one JSON object per line, e.g. {\"text\": \"...\"}")
    fmt = chat.detect_format(obj) if chat_format == "auto" else (None if chat_format == "none" else chat_format)
    if fmt is not None:
        return ("chat", chat.to_messages(obj, fmt, where))
    if "prompt" in obj or "response" in obj:
        p, r = obj.get("prompt"), obj.get("response")
        if not isinstance(p, str) or not isinstance(r, str):
            raise UserError(where, "needs both 'prompt' and 'response' as strings",
                            "give both fields, or a single 'text' field")
        return ("pair", p, r)
    t = obj.get("text")
    if not isinstance(t, str):
        raise UserError(where, "is in no known format (no 'text', 'prompt'/'response', 'messages', 'conversations' "
                        "or 'instruction'/'output')", "give each line a 'text' field, a conversation, or "
                        "'prompt' and 'response' fields")
    return ("text", t)


class Report:
    """What prepare did: examples read, written, dropped or skipped (and why), tokens.
    Public: data/pipeline.py returns and prints it."""

    def __init__(self):
        self.read = self.written = self.chat = 0
        self.dropped: dict[str, int] = {}
        self.dropped_in: dict[str, dict[str, int]] = {}  # reason -> file -> count
        self.bad_lines: list[str] = []
        self.n_bad = 0

    def drop(self, why: str, path: str = "") -> None:
        self.dropped[why] = self.dropped.get(why, 0) + 1
        files = self.dropped_in.setdefault(why, {})
        files[path] = files.get(path, 0) + 1


NO_ASSISTANT = "no assistant tokens (nothing to learn)"


def _process_lines(lines: list[tuple[int, bytes]], path: str, tok, template, chat_format: str, on_error: str):
    """Parse, render and tokenize one chunk of JSONL lines (in a worker process, or inline).

    Returns ``(docs, bad, dropped)``: ``docs`` a list of documents, each a list of ``(ids, mask|None)``
    segments; ``bad`` the messages of skipped lines; ``dropped`` the reasons of dropped examples.
    A bad line with ``on_error='stop'`` raises its ``UserError`` (naming file:line)."""
    recs, bad, dropped = [], [], []
    for lineno, line in lines:
        where = f"{path}:{lineno}"
        try:
            rec = _parse_record(line, where, chat_format)
            if rec[0] == "chat":
                if template is None:
                    raise UserError("--chat-template", f"{where} is a conversation but no chat template "
                                    "was found", "pass --chat-template MODEL_DIR (with tokenizer_config.json or "
                                    "chat_template.jinja), or --chat-template chatml")
                rec = ("chat", *template.render_with_spans(rec[1], where))  # a template may refuse a record
        except UserError as e:
            if on_error == "stop" or e.field == "--chat-template":
                raise
            bad.append(str(e))
            continue
        recs.append(rec)
    texts = [s for r in recs if r[0] != "chat" for s in r[1:]]
    encoded = iter(tok.encode_batch(texts)) if texts else iter(())
    rendered = [r[1] for r in recs if r[0] == "chat"]
    with_offsets = iter(tok.encode_with_offsets(rendered)) if rendered else iter(())
    docs = []
    for r in recs:
        if r[0] == "chat":
            ids, offs = next(with_offsets)
            mask = chat.token_mask(offs, r[2])
            if not mask.any():
                dropped.append(NO_ASSISTANT)
                continue
            docs.append([(ids, mask, True)])
        elif r[0] == "text":
            docs.append([(next(encoded), None, False)])
        else:
            p, resp = next(encoded), next(encoded)
            docs.append([(p, np.zeros(len(p), np.uint8), False), (resp, None, False)])
    return docs, bad, dropped


_WORKER: dict[str, Any] = {}


def _init_worker(tok_spec: str, tpl_source: str | None, specials: dict) -> None:
    """A worker process builds its own tokenizer and template (spawned: nothing inherited, no fork
    of a process whose threads hold locks)."""
    _WORKER["tok"] = load_tokenizer(tok_spec, "--tokenizer")
    _WORKER["template"] = None if tpl_source is None else chat.ChatTemplate(tpl_source, specials)


def _work(args):
    lines, path, chat_format, on_error = args
    try:
        return _process_lines(lines, path, _WORKER["tok"], _WORKER["template"], chat_format, on_error)
    except UserError as e:  # as its parts: a UserError does not survive pickling back to the parent
        return ("error", e.field, e.problem, e.fix)


def prepare_jsonl(path: str, tok, w: PackedWriter, prog: Progress, fi: int, nf: int,
                   template: "chat.ChatTemplate | None" = None, chat_format: str = "auto",
                   on_error: str = "stop", report: "Report | None" = None, workers: int = 1,
                   tok_spec: str = "byte") -> None:
    """One document per line: ``text``; ``prompt`` + ``response`` with the prompt masked out of the loss;
    or a conversation rendered with ``template``, the loss on its assistant turns only.

    Chunks of lines go to ``workers`` processes (rendering a template is Python: one core per worker);
    results are written in input order, with at most two chunks per worker in flight, so memory stays
    a few chunks whatever the input size.
    Public: data/pipeline.py's prepare runs it for .jsonl inputs."""
    import collections

    report = report or Report()
    chunk_lines = 2048

    def write(result, nbytes) -> None:
        if result[0] == "error":  # a worker's UserError
            raise UserError(*result[1:])
        docs, bad, dropped = result
        for doc in docs:
            w.start_doc()
            for ids, mask, is_chat in doc:
                w.append(ids, mask)
            w.end_doc()
            report.written += 1
            report.chat += int(doc[0][2])
        for why in dropped:
            report.drop(why, path)
        report.n_bad += len(bad)
        report.bad_lines.extend(bad[: max(0, 20 - len(report.bad_lines))])
        prog.update(nbytes, w, fi, nf)

    def chunks():
        lines, nbytes = [], 0
        with open_binary(path) as f:
            for lineno, line in enumerate(f, 1):
                nbytes += len(line)
                if not line.strip():
                    continue
                report.read += 1
                lines.append((lineno, line))
                if len(lines) >= chunk_lines:
                    yield lines, nbytes
                    lines, nbytes = [], 0
        yield lines, nbytes

    if workers <= 1:
        for lines, nbytes in chunks():
            write(_process_lines(lines, path, tok, template, chat_format, on_error), nbytes)
        return
    import multiprocessing as mp

    init = (tok_spec, None if template is None else template.source, {} if template is None else template.special)
    with mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=init) as pool:
        pending: collections.deque = collections.deque()
        for lines, nbytes in chunks():
            pending.append((pool.apply_async(_work, ((lines, path, chat_format, on_error),)), nbytes))
            while len(pending) >= 2 * workers:
                res, nb = pending.popleft()
                write(res.get(), nb)
        while pending:
            res, nb = pending.popleft()
            write(res.get(), nb)
