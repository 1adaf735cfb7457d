"""Data: tokenizers, ``megatrain-jax prepare`` (text / JSONL -> packed token file) and the batch loader.

Prepared data set (``PREFIX`` is what ``--out`` and ``data.path`` name)::

    PREFIX.json        index: dtype, n_tokens, vocab_size, tokenizer, file sizes and sha256 checksums
    PREFIX.tokens.bin  the packed token stream, raw uint16 (vocab <= 65536) or uint32, native byte order
    PREFIX.mask.bin    uint8 per token, 0 = not trained on (prompt tokens); only present when some token is masked
    PREFIX.docs.npy    int64 start offset of every document in the stream (first is 0)

Documents are concatenated; with a ``tokenizer.json`` that has an EOS token, EOS follows every document.
Training samples are windows of ``seq_len + 1`` tokens at stride ``seq_len``; the sample order is a
permutation seeded by ``(data.seed, epoch)``, so ``PackedDataset.batch(step, ...)`` is a pure function of the
step and resuming at step k replays exactly the samples an uninterrupted run would have seen.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import sys
import time
from array import array
from typing import IO, Any, Iterator, NamedTuple

import numpy as np

from megatrain_jax import chat
from megatrain_jax.errors import UserError

FORMAT_NAME = "megatrain-jax-packed"
FORMAT_VERSION = 1
_CHUNK_BYTES = 16 << 20  # streaming unit for reading, hashing and scanning files
_FLUSH_TOKENS = 1 << 22  # the prepare writer buffers this many tokens before writing
_TEXT_PIECE_CHARS = 1 << 22  # a long text file is encoded by a tokenizer.json in pieces of about this size
_AUTO_FULL_VERIFY_BYTES = 1 << 30  # verify="auto": full sha256 below this size, size check above
_EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>")
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------ tokenizers


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """Storage dtype of a packed token file: uint16 when every id fits (vocab <= 65536), else uint32."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    if vocab_size <= 1 << 32:
        return np.dtype(np.uint32)
    raise ValueError(f"vocab_size {vocab_size} does not fit in uint32")


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; no files, no special tokens."""

    vocab_size = 256
    eos_id: int | None = None

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")

    def encode_with_offsets(self, texts: list[str]) -> list[tuple[np.ndarray, list[tuple[int, int]]]]:
        """Ids and the character span of each (byte) token: a character's bytes all map to it."""
        out = []
        for t in texts:
            ids = self.encode(t)
            if t.isascii():
                chars = np.arange(len(t), dtype=np.int64)
            else:
                chars = np.repeat(np.arange(len(t), dtype=np.int64), [len(c.encode("utf-8")) for c in t])
            out.append((ids, np.stack([chars, chars + 1], axis=1)))
        return out

    def describe(self) -> dict[str, Any]:
        return {"kind": "byte", "vocab_size": 256, "eos_id": None}


class HFTokenizer:
    """A local Hugging Face ``tokenizer.json`` (via the ``tokenizers`` package).

    ``vocab_size`` is the largest id (added tokens included) plus one. Special tokens are not added
    by ``encode``; documents are separated by ``eos_id`` (from ``tokenizer_config.json`` next to the file,
    else the first of the usual EOS spellings the vocabulary has), or by nothing when there is none.
    """

    def __init__(self, path: str, field: str = "--tokenizer"):
        try:
            from tokenizers import Tokenizer
        except ImportError:  # pragma: no cover - tokenizers is a dependency
            raise UserError(field, "the `tokenizers` package is not installed", "pip install tokenizers") from None
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise UserError(field, f"tokenizer {path!r} does not exist",
                            "use `byte` or the path of a tokenizer.json (or a directory holding one)")
        try:
            self._tok = Tokenizer.from_file(file)
        except Exception as e:  # tokenizers raises plain Exception subclasses
            msg = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
            raise UserError(field, f"{file} is not a valid tokenizer.json ({msg})",
                            "pass a Hugging Face tokenizer.json file") from None
        self.path = os.path.abspath(file)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = (max(vocab.values()) + 1) if vocab else self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token, self.eos_id = self._find_eos(os.path.dirname(self.path))
        with open(self.path, "rb") as f:
            self.sha256 = hashlib.sha256(f.read()).hexdigest()

    def _find_eos(self, folder: str) -> tuple[str | None, int | None]:
        cfg = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(cfg):
            try:
                with open(cfg) as f:
                    eos = json.load(f).get("eos_token")
                if isinstance(eos, dict):
                    eos = eos.get("content")
                if isinstance(eos, str) and self._tok.token_to_id(eos) is not None:
                    return eos, int(self._tok.token_to_id(eos))
            except (OSError, ValueError, AttributeError):
                pass
        for cand in _EOS_CANDIDATES:
            tid = self._tok.token_to_id(cand)
            if tid is not None:
                return cand, int(tid)
        return None, None

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encs]

    def encode_with_offsets(self, texts: list[str]) -> list[tuple[np.ndarray, list[tuple[int, int]]]]:
        """Ids and each token's character span (the tokenizers library's offsets), batched in parallel."""
        encs = self._tok.encode_batch(texts, add_special_tokens=False)
        return [(np.asarray(e.ids, dtype=np.uint32), e.offsets) for e in encs]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def describe(self) -> dict[str, Any]:
        return {"kind": "tokenizers", "path": self.path, "sha256": self.sha256, "vocab_size": self.vocab_size,
                "eos_id": self.eos_id, "eos_token": self.eos_token}


def load_tokenizer(spec: str, field: str = "data.tokenizer") -> ByteTokenizer | HFTokenizer:
    """``byte`` or the path of a ``tokenizer.json`` (or of a directory holding one)."""
    if spec is None or spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec, field)


# --------------------------------------------------------------------------------------- prepare


def _open_binary(path: str) -> IO[bytes]:
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _detect_format(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    name = path[:-3] if path.endswith(".gz") else path
    return "jsonl" if name.lower().endswith((".jsonl", ".ndjson", ".json")) else "text"


_DIR_SUFFIXES = (".txt", ".jsonl", ".ndjson", ".json", ".txt.gz", ".jsonl.gz", ".ndjson.gz", ".json.gz")


def _expand_inputs(inputs: list[str]) -> list[str]:
    files: list[str] = []
    for p in inputs:
        if os.path.isdir(p):
            found = sorted(os.path.join(root, n) for root, _, names in os.walk(p) for n in names
                           if n.lower().endswith(_DIR_SUFFIXES))
            if not found:
                raise UserError("INPUTS", f"directory {p!r} holds no .txt/.jsonl/.json files",
                                "pass the text or JSONL files themselves")
            files.extend(found)
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise UserError("INPUTS", f"input {p!r} does not exist", "pass existing .txt / .jsonl files or directories")
    return files


class _Progress:
    """Prints a progress line to stderr at most every few seconds (silent for short runs)."""

    def __init__(self, total_bytes: int, quiet: bool, every: float = 5.0):
        self.total, self.quiet, self.every = max(total_bytes, 1), quiet, every
        self.t0 = self.last = time.time()
        self.bytes = 0

    def update(self, nbytes: int, writer: "_PackedWriter", file_i: int, n_files: int) -> None:
        self.bytes += nbytes
        now = time.time()
        if self.quiet or now - self.last < self.every:
            return
        self.last = now
        secs = max(now - self.t0, 1e-9)
        frac = min(1.0, self.bytes / self.total)
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        eta = secs * (1 - frac) / max(frac, 1e-9)
        print(f"prepare: [{bar}] {100 * frac:3.0f}% file {file_i}/{n_files}, {writer.n_docs:,} docs, "
              f"{writer.n_tokens:,} tokens, {self.bytes / secs / 1e6:.1f} MB/s, {writer.n_tokens / secs:,.0f} tokens/s, "
              f"eta {eta:.0f}s", file=sys.stderr, flush=True)


class _PackedWriter:
    """Streams documents into temporary files; ``commit`` renames them into place, ``abort`` deletes them."""

    def __init__(self, prefix: str, dtype: np.dtype, eos_id: int | None):
        self.prefix, self.dtype, self.eos_id = prefix, np.dtype(dtype), eos_id
        self.final = {"tokens": prefix + ".tokens.bin", "mask": prefix + ".mask.bin",
                      "docs": prefix + ".docs.npy", "index": prefix + ".json"}
        tag = f".tmp{os.getpid()}"
        self.tmp = {k: v + tag for k, v in self.final.items()}
        self._tok_f: IO[bytes] | None = open(self.tmp["tokens"], "wb")
        self._mask_f: IO[bytes] | None = None
        self._tok_hash, self._mask_hash = hashlib.sha256(), hashlib.sha256()
        self._tok_buf: list[np.ndarray] = []
        self._mask_buf: list[np.ndarray | None] = []  # None: all ones
        self._buffered = 0
        self.n_flushed = 0
        self.n_tokens = 0  # accepted so far (flushed + buffered)
        self.n_masked = 0
        self.doc_starts = array("q")
        self._doc_start: int | None = None

    @property
    def n_docs(self) -> int:
        return len(self.doc_starts)

    # -- documents
    def start_doc(self) -> None:
        self._doc_start = self.n_tokens

    def append(self, ids: np.ndarray, mask: np.ndarray | None = None) -> None:
        if len(ids) == 0:
            return
        self._tok_buf.append(ids)
        if mask is not None and mask.all():
            mask = None
        if mask is not None:
            self.n_masked += int(len(mask) - np.count_nonzero(mask))
            if self._mask_f is None:
                self._open_mask()
        self._mask_buf.append(mask)
        self._buffered += len(ids)
        self.n_tokens += len(ids)
        if self._buffered >= _FLUSH_TOKENS:
            self.flush()

    def end_doc(self) -> None:
        start, self._doc_start = self._doc_start, None
        if start is None or self.n_tokens == start:  # empty document: no start, no EOS
            return
        if self.eos_id is not None:
            self.append(np.asarray([self.eos_id], dtype=np.uint32))
        self.doc_starts.append(start)

    # -- files
    def _open_mask(self) -> None:
        self._mask_f = open(self.tmp["mask"], "wb")
        ones = np.ones(min(self.n_flushed, _FLUSH_TOKENS), dtype=np.uint8)
        left = self.n_flushed
        while left:
            n = min(left, len(ones))
            self._write(self._mask_f, self._mask_hash, ones[:n])
            left -= n

    @staticmethod
    def _write(f: IO[bytes], h, arr: np.ndarray) -> None:
        mv = memoryview(np.ascontiguousarray(arr)).cast("B")
        h.update(mv)
        f.write(mv)

    def flush(self) -> None:
        if not self._tok_buf:
            return
        toks = np.concatenate(self._tok_buf).astype(self.dtype, copy=False)
        self._write(self._tok_f, self._tok_hash, toks)
        if self._mask_f is not None:
            parts = [np.ones(len(t), np.uint8) if m is None else (np.asarray(m) != 0).astype(np.uint8)
                     for t, m in zip(self._tok_buf, self._mask_buf)]
            self._write(self._mask_f, self._mask_hash, np.concatenate(parts))
        self.n_flushed += len(toks)
        self._tok_buf, self._mask_buf, self._buffered = [], [], 0

    def commit(self, extra: dict[str, Any]) -> dict[str, Any]:
        self.flush()
        self._tok_f.close()
        if self._mask_f is not None:
            self._mask_f.close()
        docs = np.frombuffer(self.doc_starts, dtype=np.int64) if len(self.doc_starts) else np.zeros(0, np.int64)
        with open(self.tmp["docs"], "wb") as f:
            np.save(f, docs)
        base = os.path.basename(self.prefix)
        index = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "dtype": self.dtype.name,
            "n_tokens": self.n_tokens,
            "n_docs": self.n_docs,
            **extra,
            "tokens": {"file": base + ".tokens.bin", "bytes": self.n_tokens * self.dtype.itemsize,
                       "sha256": self._tok_hash.hexdigest()},
            "mask": None if self._mask_f is None else {
                "file": base + ".mask.bin", "bytes": self.n_tokens, "sha256": self._mask_hash.hexdigest(),
                "n_masked": self.n_masked},
            "docs": {"file": base + ".docs.npy", "bytes": os.path.getsize(self.tmp["docs"]),
                     "sha256": _sha256_file(self.tmp["docs"])},
        }
        with open(self.tmp["index"], "w") as f:
            json.dump(index, f, indent=1)
            f.write("\n")
        # Data files first, the index last: an index on disk means a complete data set.
        os.replace(self.tmp["tokens"], self.final["tokens"])
        os.replace(self.tmp["docs"], self.final["docs"])
        if self._mask_f is not None:
            os.replace(self.tmp["mask"], self.final["mask"])
        elif os.path.exists(self.final["mask"]):
            os.remove(self.final["mask"])  # stale mask of an earlier prepare to the same prefix
        os.replace(self.tmp["index"], self.final["index"])
        return index

    def abort(self) -> None:
        for f in (self._tok_f, self._mask_f):
            if f is not None and not f.closed:
                f.close()
        for p in self.tmp.values():
            try:
                os.remove(p)
            except FileNotFoundError:
                pass


def _safe_cut(s: str) -> int:
    """Where to split a long text for separate encoding without changing tokens much: after a newline
    that is followed by a non-space character, else before a space that precedes a word; 0 if none."""
    i = s.rfind("\n", 0, len(s) - 1)
    while i >= 0:
        if not s[i + 1].isspace():
            return i + 1
        i = s.rfind("\n", 0, i)
    i = s.rfind(" ", 0, len(s) - 1)
    while i > 0:
        if not s[i + 1].isspace():
            return i
        i = s.rfind(" ", 0, i)
    return 0


def _text_pieces(f: IO[str], chunk_chars: int) -> Iterator[str]:
    carry = ""
    while True:
        block = f.read(chunk_chars)
        if not block:
            if carry:
                yield carry
            return
        s = carry + block
        cut = _safe_cut(s)
        if cut <= 0:
            if len(s) < 4 * chunk_chars:
                carry = s
                continue
            cut = len(s)
        yield s[:cut]
        carry = s[cut:]


def _prepare_text(path: str, tok, w: _PackedWriter, prog: _Progress, fi: int, nf: int) -> None:
    """A whole text file is one document."""
    w.start_doc()
    if isinstance(tok, ByteTokenizer):  # raw bytes are the ids: no decoding at all
        with _open_binary(path) as f:
            while True:
                chunk = f.read(_CHUNK_BYTES)
                if not chunk:
                    break
                w.append(np.frombuffer(chunk, dtype=np.uint8))
                prog.update(len(chunk), w, fi, nf)
    else:
        try:
            with _open_binary(path) as fb:
                import io
                f = io.TextIOWrapper(fb, encoding="utf-8", errors="strict", newline="")
                batch: list[str] = []
                for piece in _text_pieces(f, _TEXT_PIECE_CHARS):
                    batch.append(piece)
                    if len(batch) >= 8:
                        for ids in tok.encode_batch(batch):
                            w.append(ids)
                        prog.update(sum(len(p) for p in batch), w, fi, nf)
                        batch = []
                for ids in tok.encode_batch(batch) if batch else []:
                    w.append(ids)
                prog.update(sum(len(p) for p in batch), w, fi, nf)
        except UnicodeDecodeError as e:
            raise UserError(path, f"is not valid UTF-8 (byte {e.start})",
                            "convert it to UTF-8 (e.g. iconv), or use --tokenizer byte") from None
    w.end_doc()


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


class _Report:
    """What prepare did: examples read, written, dropped or skipped (and why), tokens."""

    def __init__(self):
        self.read = self.written = self.chat = 0
        self.dropped: dict[str, int] = {}
        self.bad_lines: list[str] = []
        self.n_bad = 0

    def drop(self, why: str) -> None:
        self.dropped[why] = self.dropped.get(why, 0) + 1


def _process_lines(lines: list[tuple[int, bytes]], path: str, tok, template, chat_format: str, on_error: str):
    """Parse, render and tokenize one chunk of JSONL lines (in a worker process, or inline).

    Returns ``(docs, bad, dropped)``: ``docs`` a list of documents, each a list of ``(ids, mask|None)``
    segments; ``bad`` the messages of skipped lines; ``dropped`` the reasons of dropped examples.
    A bad line with ``on_error='stop'`` raises its ``UserError`` (naming file:line)."""
    recs, bad, dropped = [], [], []
    for lineno, line in lines:
        try:
            rec = _parse_record(line, f"{path}:{lineno}", chat_format)
            if rec[0] == "chat" and template is None:
                raise UserError("--chat-template", f"{path}:{lineno} is a conversation but no chat template "
                                "was found", "pass --chat-template MODEL_DIR (with tokenizer_config.json or "
                                "chat_template.jinja), or --chat-template chatml")
        except UserError as e:
            if on_error == "stop" or e.field == "--chat-template":
                raise
            bad.append(str(e))
            continue
        recs.append(rec)
    texts = [s for r in recs if r[0] != "chat" for s in r[1:]]
    encoded = iter(tok.encode_batch(texts)) if texts else iter(())
    rendered = [template.render_with_spans(r[1]) for r in recs if r[0] == "chat"]
    with_offsets = iter(tok.encode_with_offsets([t for t, _ in rendered])) if rendered else iter(())
    spans = iter([sp for _, sp in rendered])
    docs = []
    for r in recs:
        if r[0] == "chat":
            ids, offs = next(with_offsets)
            mask = chat.token_mask(offs, next(spans))
            if not mask.any():
                dropped.append("no assistant tokens (nothing to learn)")
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
    except UserError as e:
        return e


def _prepare_jsonl(path: str, tok, w: _PackedWriter, prog: _Progress, fi: int, nf: int,
                   template: "chat.ChatTemplate | None" = None, chat_format: str = "auto",
                   on_error: str = "stop", report: "_Report | None" = None, workers: int = 1,
                   tok_spec: str = "byte") -> None:
    """One document per line: ``text``; ``prompt`` + ``response`` with the prompt masked out of the loss;
    or a conversation rendered with ``template``, the loss on its assistant turns only.

    Chunks of lines go to ``workers`` processes (rendering a template is Python: one core per worker);
    results are written in input order, with at most two chunks per worker in flight, so memory stays
    a few chunks whatever the input size."""
    import collections

    report = report or _Report()
    chunk_lines = 2048

    def write(result, nbytes) -> None:
        if isinstance(result, UserError):
            raise result
        docs, bad, dropped = result
        for doc in docs:
            w.start_doc()
            for ids, mask, is_chat in doc:
                w.append(ids, mask)
            w.end_doc()
            report.written += 1
            report.chat += int(doc[0][2])
        for why in dropped:
            report.drop(why)
        report.n_bad += len(bad)
        report.bad_lines.extend(bad[: max(0, 20 - len(report.bad_lines))])
        prog.update(nbytes, w, fi, nf)

    def chunks():
        lines, nbytes = [], 0
        with _open_binary(path) as f:
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


def prepare(inputs: list[str], out: str, tokenizer: str = "byte", fmt: str = "auto",
            quiet: bool = False, chat_format: str = "auto", chat_template: str | None = None,
            on_error: str = "stop", workers: int | None = None) -> dict[str, Any]:
    """Tokenize ``inputs`` into the packed data set ``out`` (a prefix); returns the index written.

    Text files: each whole file is one document. JSONL (``.jsonl``/``.ndjson``/``.json``, or ``fmt='jsonl'``):
    one JSON object per line with ``text``, or ``prompt`` and ``response`` (the prompt's tokens get loss
    mask 0; the two are encoded separately and concatenated, nothing in between). ``.gz`` inputs are read
    compressed. Everything is streamed; nothing appears under ``out`` unless the whole run succeeds.

    Conversations (``messages``, ShareGPT ``conversations``, Alpaca ``instruction``/``output``; detected per
    record or forced by ``chat_format``) are rendered with ``chat_template`` (a model/tokenizer folder, or
    ``chatml``; default: the tokenizer's folder) and only assistant tokens count in the loss (``chat.py``).
    ``on_error``: ``stop`` at the first bad line (one line naming file:line), or ``skip`` it and count it.
    """
    if chat_format not in ("auto", "none") + chat.FORMATS:
        raise UserError("--chat-format", f"{chat_format!r} is not a format", "use auto, none, messages, sharegpt or alpaca")
    if on_error not in ("stop", "skip"):
        raise UserError("--on-error", f"{on_error!r} is not a policy", "use stop or skip")
    if fmt not in ("auto", "text", "jsonl"):
        raise UserError("--format", f"{fmt!r} is not a format", "use auto, text or jsonl")
    if not inputs:
        raise UserError("INPUTS", "no input files given", "pass one or more .txt / .jsonl files")
    if not out:
        raise UserError("--out", "is empty", "give an output prefix such as data/mycorpus")
    for suffix in (".json", ".tokens.bin"):
        if out.endswith(suffix):
            out = out[: -len(suffix)]
    files = _expand_inputs(inputs)
    tok = load_tokenizer(tokenizer, "--tokenizer")
    if chat_template == "chatml":
        template = chat.ChatTemplate(chat.CHATML_TEMPLATE)
    elif chat_template:
        if not os.path.exists(chat_template):
            raise UserError("--chat-template", f"{chat_template!r} does not exist", "pass a model folder or chatml")
        template = chat.ChatTemplate.from_folder(chat_template)
        if template is None:
            raise UserError("--chat-template", f"{chat_template} has no chat_template.jinja nor a chat_template in "
                            "tokenizer_config.json", "pass the model's folder, or chatml")
    else:
        template = chat.ChatTemplate.from_folder(getattr(tok, "path", None))
    report = _Report()
    explicit_workers = workers is not None
    workers = workers or (os.cpu_count() or 1)
    dtype = dtype_for_vocab(tok.vocab_size)
    out_dir = os.path.dirname(os.path.abspath(out))
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError("--out", f"{out_dir!r} is a file, not a directory", "choose an output prefix in a directory")
    os.makedirs(out_dir, exist_ok=True)

    total = 0
    for p in files:
        try:
            total += os.path.getsize(p)
        except OSError:
            pass
    prog = _Progress(total, quiet)
    try:
        w = _PackedWriter(out, dtype, tok.eos_id)
    except OSError as e:
        raise UserError("--out", f"cannot write under {out_dir!r} ({e.strerror or e})",
                        "choose a writable output directory") from None
    try:
        for i, p in enumerate(files, 1):
            try:
                if _detect_format(p, fmt) == "jsonl":
                    big = os.path.getsize(p) > (16 << 20)  # worker start-up (~1 s) pays off on large files
                    _prepare_jsonl(p, tok, w, prog, i, len(files), template, chat_format, on_error, report,
                                   workers=workers if (big or explicit_workers) else 1, tok_spec=tokenizer)
                else:
                    _prepare_text(p, tok, w, prog, i, len(files))
            except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
                raise UserError(p, f"could not be processed ({e.__class__.__name__}: {e})",
                                "check that the input is readable and the output directory has space") from None
        if w.n_tokens < 2:
            raise UserError("INPUTS", f"the inputs hold {w.n_tokens} tokens", "pass non-empty text or JSONL files")
        summary = {"examples_read": report.read, "examples_written": report.written, "conversations": report.chat,
                   "dropped": report.dropped, "bad_lines_skipped": report.n_bad, "bad_lines_first": report.bad_lines}
        index = w.commit({"vocab_size": tok.vocab_size, "tokenizer": tok.describe(),
                          "sources": [os.path.abspath(p) for p in files], "report": summary})
    except BaseException:
        w.abort()
        raise
    if not quiet:
        masked = f", {index['mask']['n_masked']:,} masked" if index["mask"] else ""
        secs = time.time() - prog.t0
        print(f"prepare: wrote {out} ({index['n_docs']:,} docs, {index['n_tokens']:,} {index['dtype']} tokens{masked}, "
              f"{secs:.1f}s, {index['n_tokens'] / max(secs, 1e-9):,.0f} tokens/s)", flush=True)
        if report.read:
            drops = ", ".join(f"{n:,} {why}" for why, n in report.dropped.items()) or "none"
            print(f"prepare: {report.read:,} examples read, {report.written:,} written ({report.chat:,} conversations); "
                  f"dropped: {drops}; bad lines skipped: {report.n_bad:,}", flush=True)
            for line in report.bad_lines[:5]:
                print(f"prepare: skipped {line}", flush=True)
    return index


def prepare_main(argv: list[str]) -> int:
    """``megatrain-jax prepare INPUTS... --out PREFIX [--tokenizer byte|PATH] [--format auto|text|jsonl]``.

    Returns 0 on success; user mistakes raise ``UserError`` (the CLI prints it and exits 2); bad
    command-line syntax exits 2 through argparse.
    """
    ap = argparse.ArgumentParser(
        prog="megatrain-jax prepare",
        description="Tokenize text / JSONL files into a packed token file for training (data.path=PREFIX).")
    ap.add_argument("inputs", nargs="+", metavar="INPUTS",
                    help=".txt files (one document each), .jsonl files ('text', or 'prompt'+'response'), or directories")
    ap.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.json, PREFIX.tokens.bin, ...")
    ap.add_argument("--tokenizer", default="byte", help="byte (default) or the path of a tokenizer.json")
    ap.add_argument("--format", default="auto", choices=("auto", "text", "jsonl"),
                    help="auto: .jsonl/.ndjson/.json are JSONL, everything else is text")
    ap.add_argument("--quiet", action="store_true", help="no progress or summary output")
    ap.add_argument("--chat-format", default="auto", choices=("auto", "none") + chat.FORMATS,
                    help="conversation records: detected per line (auto), or all of one format")
    ap.add_argument("--chat-template", default=None, metavar="DIR|chatml",
                    help="the model folder whose chat template renders conversations (default: the tokenizer's)")
    ap.add_argument("--on-error", default="stop", choices=("stop", "skip"),
                    help="a malformed line stops the run (default) or is skipped and counted")
    ap.add_argument("--workers", type=int, default=None, help="processes for JSONL (default: every core)")
    args = ap.parse_args(argv)
    if args.workers is not None and args.workers < 1:
        raise UserError("--workers", f"must be >= 1, got {args.workers}", "pass a positive number of processes")
    prepare(args.inputs, args.out, args.tokenizer, args.format, args.quiet, args.chat_format, args.chat_template,
            args.on_error, args.workers)
    return 0


# ----------------------------------------------------------------------------------------- loading


class Batch(NamedTuple):
    """One training batch of numpy arrays, all of shape (batch_size, seq_len)."""

    tokens: np.ndarray  # int32 input ids
    labels: np.ndarray  # int32 next-token ids (tokens shifted left by one)
    loss_mask: np.ndarray  # float32, 0 where the label is a masked (prompt) token, else 1
    segment_ids: np.ndarray  # int32 document index within the window, from 0
    positions: np.ndarray  # int32 position within the document (restarting at 0 at each document start in the window)


def _sha256_file(path: str, progress: str | None = None) -> str:
    h = hashlib.sha256()
    size = os.path.getsize(path)
    done, last = 0, time.time()
    buf = bytearray(_CHUNK_BYTES)
    mv = memoryview(buf)
    with open(path, "rb") as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(mv[:n])
            done += n
            if progress and time.time() - last > 5:
                last = time.time()
                print(f"{progress}: {100.0 * done / max(size, 1):.0f}%", file=sys.stderr, flush=True)
    return h.hexdigest()


def _max_id(tokens: np.ndarray) -> int:
    step = max(1, _CHUNK_BYTES // tokens.dtype.itemsize)
    return max(int(tokens[i:i + step].max()) for i in range(0, len(tokens), step))


class PackedDataset:
    """A packed token stream with document starts and an optional loss mask, served as batches."""

    def __init__(self, tokens: np.ndarray, doc_starts: np.ndarray | None = None, mask: np.ndarray | None = None,
                 *, seed: int = 0, seq_len: int | None = None, path: str = "<memory>",
                 tokenizer: dict[str, Any] | None = None, checksum: str | None = None, doc_masking: bool = False):
        if tokens.ndim != 1:
            raise ValueError("tokens must be 1-D")
        self.tokens = tokens
        ds = np.zeros(1, np.int64) if doc_starts is None or len(doc_starts) == 0 else np.asarray(doc_starts, np.int64)
        if ds[0] != 0:  # tokens before the first recorded document form a document of their own
            ds = np.concatenate([[0], ds])
        self.doc_starts = ds
        self.mask = mask
        self.seed, self.seq_len, self.path = int(seed), seq_len, path
        self.tokenizer = tokenizer or {"kind": "unknown"}
        self.checksum = checksum
        self.doc_masking = doc_masking
        self._perm_cache: dict[tuple[int, int], np.ndarray] = {}

    @property
    def n_tokens(self) -> int:
        return int(len(self.tokens))

    @property
    def n_docs(self) -> int:
        return int(len(self.doc_starts))

    def _seq(self, seq_len: int | None) -> int:
        s = self.seq_len if seq_len is None else seq_len
        if s is None or int(s) <= 0:
            raise UserError("data.seq_len", f"must be positive, got {s}", "set data.seq_len to a positive integer")
        return int(s)

    def n_samples(self, seq_len: int | None = None) -> int:
        """Windows of ``seq_len + 1`` tokens at stride ``seq_len`` (one epoch)."""
        return max(0, (self.n_tokens - 1) // self._seq(seq_len))

    def check(self, batch_size: int, seq_len: int | None = None) -> None:
        """Raise ``UserError`` unless one batch of this shape can be drawn (call it before allocating anything)."""
        s = self._seq(seq_len)
        if batch_size <= 0:
            raise UserError("train.batch_size", f"must be positive, got {batch_size}", "set a positive batch size")
        n = self.n_samples(s)
        if n < batch_size:
            raise UserError("train.batch_size",
                            f"{self.path} has {self.n_tokens:,} tokens = {n} samples of data.seq_len={s}, "
                            f"fewer than train.batch_size={batch_size}",
                            "lower train.batch_size or data.seq_len, or use more data")

    def _perm(self, epoch: int, n: int) -> np.ndarray:
        key = (epoch, n)
        p = self._perm_cache.get(key)
        if p is None:
            rng = np.random.default_rng([self.seed % (1 << 64), epoch])
            p = rng.permutation(n)
            if len(self._perm_cache) >= 2:
                self._perm_cache.pop(next(iter(self._perm_cache)))
            self._perm_cache[key] = p
        return p

    def sample_indices(self, step: int, batch_size: int, seq_len: int | None = None) -> np.ndarray:
        """Window indices (0..n_samples-1) of the rows of ``batch(step)``: global sample ``g = step*B + row``
        is entry ``g % n`` of epoch ``g // n``'s permutation, so each epoch visits every window exactly once."""
        s = self._seq(seq_len)
        self.check(batch_size, s)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        n = self.n_samples(s)
        g = np.int64(step) * batch_size + np.arange(batch_size, dtype=np.int64)
        epochs, idx = g // n, g % n
        out = np.empty(batch_size, np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._perm(int(e), n)[idx[sel]]
        return out

    def batch(self, step: int, batch_size: int, seq_len: int) -> Batch:
        """The batch of optimizer step ``step``: a pure function of (data, seed, step, batch_size, seq_len)."""
        s = self._seq(seq_len)
        starts = self.sample_indices(step, batch_size, s) * s
        idx = starts[:, None] + np.arange(s + 1, dtype=np.int64)
        window = np.asarray(self.tokens[idx]).astype(np.int32)
        tokens, labels = window[:, :-1], window[:, 1:]
        if self.mask is None:
            loss_mask = np.ones((batch_size, s), np.float32)
        else:
            loss_mask = (np.asarray(self.mask[idx[:, 1:]]) != 0).astype(np.float32)
        pos = idx[:, :-1]
        doc = np.searchsorted(self.doc_starts, pos, side="right") - 1
        segment_ids = (doc - doc[:, :1]).astype(np.int32)
        positions = (pos - np.maximum(self.doc_starts[doc], starts[:, None])).astype(np.int32)
        return Batch(np.ascontiguousarray(tokens), np.ascontiguousarray(labels), loss_mask, segment_ids, positions)

    def position(self, step: int, batch_size: int, seq_len: int | None = None) -> dict[str, int]:
        """Where the loader stands before ``batch(step)``, for checkpoints and metadata."""
        n = self.n_samples(seq_len)
        g = int(step) * int(batch_size)
        return {"step": int(step), "epoch": g // n if n else 0, "sample_index": g % n if n else 0,
                "samples_seen": g, "samples_per_epoch": n, "seed": self.seed}

    def describe(self) -> dict[str, Any]:
        """Identity of the data, to store with a checkpoint (a resumed run can compare it)."""
        return {"path": self.path, "n_tokens": self.n_tokens, "n_docs": self.n_docs, "dtype": self.tokens.dtype.name,
                "has_mask": self.mask is not None, "tokenizer": self.tokenizer, "sha256": self.checksum}


def _resolve_path(path: str) -> str:
    """Relative paths that do not exist from the working directory are tried from the repository root."""
    if os.path.isabs(path) or os.path.exists(path) or os.path.exists(path + ".json"):
        return path
    alt = os.path.join(_REPO_ROOT, path)
    if os.path.exists(alt) or os.path.exists(alt + ".json"):
        return alt
    return path


def _load_text(path: str, data_cfg, vocab_size: int) -> PackedDataset:
    size = os.path.getsize(path)
    if size < 2:
        raise UserError("data.path", f"{path} holds {size} bytes", "use a text file with some content")
    tok_spec = getattr(data_cfg, "tokenizer", "byte") or "byte"
    if tok_spec == "byte":
        tokens = np.memmap(path, dtype=np.uint8, mode="r")  # the bytes are the ids
        desc = ByteTokenizer().describe()
    else:
        tok = load_tokenizer(tok_spec, "data.tokenizer")
        if size > 256 << 20:
            print(f"data: tokenizing {size / 1e6:.0f} MB in memory; `megatrain-jax prepare` does it once, streamed",
                  file=sys.stderr, flush=True)
        try:
            with open(path, encoding="utf-8", newline="") as f:
                tokens = tok.encode(f.read()).astype(dtype_for_vocab(tok.vocab_size))
        except UnicodeDecodeError as e:
            raise UserError("data.path", f"{path} is not valid UTF-8 (byte {e.start})", "convert it to UTF-8") from None
        desc = tok.describe()
        if len(tokens) < 2:
            raise UserError("data.path", f"{path} holds {len(tokens)} tokens", "use a text file with some content")
    checksum = _sha256_file(path) if size <= _AUTO_FULL_VERIFY_BYTES else None
    ds = PackedDataset(tokens, None, None, seed=data_cfg.seed, seq_len=data_cfg.seq_len, path=path,
                       tokenizer=desc, checksum=checksum, doc_masking=bool(getattr(data_cfg, "doc_masking", False)))
    _check_vocab(ds, vocab_size, path)
    return ds


def _check_vocab(ds: PackedDataset, vocab_size: int, path: str, max_id: int | None = None) -> None:
    m = _max_id(ds.tokens) if max_id is None else max_id
    if m >= vocab_size:
        raise UserError("model.vocab_size",
                        f"data {path} holds token id {m} but the model's vocab_size is {vocab_size}",
                        f"set model.vocab_size >= {m + 1}, or prepare the data with the model's tokenizer")


def _corrupt(path: str, problem: str) -> UserError:
    return UserError("data.path", f"{path} {problem}",
                     "the data set is corrupt or incomplete: re-run `megatrain-jax prepare` to rebuild it")


def _load_prepared(prefix: str, data_cfg, vocab_size: int, verify: str) -> PackedDataset:
    index_path = prefix + ".json"
    try:
        with open(index_path) as f:
            index = json.load(f)
    except ValueError:
        raise _corrupt(index_path, "is not valid JSON") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT_NAME:
        raise UserError("data.path", f"{index_path} is not a megatrain-jax data index",
                        "point data.path at a prefix written by `megatrain-jax prepare`, or at a .txt file")
    if index.get("version") != FORMAT_VERSION:
        raise UserError("data.path", f"{index_path} has format version {index.get('version')}, "
                        f"this megatrain-jax reads version {FORMAT_VERSION}", "re-run `megatrain-jax prepare`")
    try:
        dtype = np.dtype(index["dtype"])
        n_tokens = int(index["n_tokens"])
        tok_entry, docs_entry, mask_entry = index["tokens"], index["docs"], index.get("mask")
    except (KeyError, TypeError, ValueError):
        raise _corrupt(index_path, "misses fields") from None
    if dtype not in (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32)):
        raise _corrupt(index_path, f"names an unsupported dtype {dtype.name}")
    folder = os.path.dirname(index_path)

    def check_file(entry: dict, expected_bytes: int, what: str, full: bool) -> str:
        if not isinstance(entry, dict) or not isinstance(entry.get("file"), str):
            raise _corrupt(index_path, f"has no valid entry for the {what} file")
        p = os.path.join(folder, entry["file"])
        if not os.path.isfile(p):
            raise _corrupt(p, f"({what} file) is missing")
        size = os.path.getsize(p)
        if size != expected_bytes or size != entry.get("bytes"):
            raise _corrupt(p, f"({what} file) is {size:,} bytes, the index expects {expected_bytes:,}")
        if full:
            note = f"data: verifying {p}" if size > 256 << 20 else None
            if _sha256_file(p, note) != entry.get("sha256"):
                raise _corrupt(p, f"({what} file) fails its sha256 checksum")
        return p

    tok_bytes = n_tokens * dtype.itemsize
    full = verify == "full" or (verify == "auto" and tok_bytes <= _AUTO_FULL_VERIFY_BYTES)
    if verify == "auto" and not full:
        print(f"data: {tok_bytes / 1e9:.1f} GB token file: checking sizes, not sha256 "
              "(load_dataset(..., verify='full') hashes it)", file=sys.stderr, flush=True)
    tok_path = check_file(tok_entry, tok_bytes, "token", full)
    docs_path = check_file(docs_entry, int(docs_entry.get("bytes", -1)), "document index", True)
    mask_path = check_file(mask_entry, n_tokens, "loss mask", full) if mask_entry else None
    if n_tokens < 2:
        raise UserError("data.path", f"{prefix} holds {n_tokens} tokens", "prepare some more data")

    try:
        docs = np.load(docs_path, allow_pickle=False)
    except (ValueError, OSError):
        raise _corrupt(docs_path, "is not a valid .npy file") from None
    if docs.ndim != 1 or (len(docs) and (docs[0] < 0 or docs[-1] >= n_tokens or np.any(np.diff(docs) <= 0))):
        raise _corrupt(docs_path, "does not hold increasing document offsets within the token file")

    tokens = np.memmap(tok_path, dtype=dtype, mode="r", shape=(n_tokens,))
    mask = np.memmap(mask_path, dtype=np.uint8, mode="r", shape=(n_tokens,)) if mask_path else None
    tok_desc = index.get("tokenizer") or {}
    _check_tokenizer_matches(getattr(data_cfg, "tokenizer", "byte"), tok_desc, prefix)
    ds = PackedDataset(tokens, docs.astype(np.int64), mask, seed=data_cfg.seed, seq_len=data_cfg.seq_len,
                       path=prefix, tokenizer=tok_desc, checksum=tok_entry.get("sha256"),
                       doc_masking=bool(getattr(data_cfg, "doc_masking", False)))
    _check_vocab(ds, vocab_size, prefix)
    return ds


def _check_tokenizer_matches(spec: str | None, desc: dict, prefix: str) -> None:
    """``data.tokenizer`` left at ``byte`` (the default) accepts any prepared data; an explicit
    tokenizer.json must be the one the data was prepared with."""
    if not spec or spec == "byte":
        return
    tok = load_tokenizer(spec, "data.tokenizer")
    if desc.get("kind") != "tokenizers" or desc.get("sha256") != tok.sha256:
        used = desc.get("path") or desc.get("kind", "unknown")
        raise UserError("data.tokenizer", f"{prefix} was prepared with tokenizer {used}, not {spec}",
                        "set data.tokenizer to the tokenizer the data was prepared with, or re-run prepare")


def load_dataset(data_cfg, vocab_size: int, *, verify: str = "auto") -> PackedDataset:
    """Open ``data_cfg.path``: a ``.txt`` file (tokenized in memory; with the byte tokenizer it is
    memory-mapped as is) or a prefix written by ``megatrain-jax prepare`` (memory-mapped, checked).

    ``verify``: ``full`` checks sizes and sha256 of every file; ``size`` checks sizes only; ``auto`` (default)
    is ``full`` for token files up to 1 GiB and ``size`` above. Token ids are always checked against
    ``vocab_size`` (one streamed max). Every problem raises ``UserError``.
    """
    if verify not in ("auto", "full", "size"):
        raise ValueError(f"verify must be auto, full or size, not {verify!r}")
    raw = getattr(data_cfg, "path", None)
    if not raw:
        raise UserError("data.path", "is empty", "set data.path to a .txt file or a prepared data prefix")
    path = _resolve_path(str(raw))
    prefix = path
    for suffix in (".json", ".tokens.bin"):
        if prefix.endswith(suffix) and os.path.isfile(prefix[: -len(suffix)] + ".json"):
            prefix = prefix[: -len(suffix)]
    if os.path.isfile(prefix + ".json"):
        return _load_prepared(prefix, data_cfg, vocab_size, verify)
    if path.lower().endswith(".txt") and os.path.isfile(path):
        return _load_text(path, data_cfg, vocab_size)
    if os.path.exists(path):
        raise UserError("data.path", f"{path!r} is neither a .txt file nor a prepared data prefix",
                        f"run `megatrain-jax prepare {raw} --out PREFIX` and set data.path=PREFIX")
    raise UserError("data.path", f"{raw!r} does not exist (no such file, and no {raw}.json data index)",
                    "set data.path to a .txt file or a prefix written by `megatrain-jax prepare`")


if __name__ == "__main__":  # python -m megatrain_jax.data INPUTS... --out PREFIX
    try:
        sys.exit(prepare_main(sys.argv[1:]))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
