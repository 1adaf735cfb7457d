"""The packed token format: its writer, its batches, and the data set served from it.

Prepared data set (``PREFIX`` is what ``--out`` and ``data.path`` name)::

    PREFIX.json        index: dtype, n_tokens, vocab_size, tokenizer, file sizes and sha256 checksums
    PREFIX.tokens.bin  the packed token stream, raw uint16 (vocab <= 65536) or uint32, native byte order
    PREFIX.mask.bin    uint8 per token, 0 = not trained on (prompt tokens); only present when some token is masked
    PREFIX.docs.npy    int64 start offset of every document in the stream (first is 0)

Training samples are windows of ``seq_len + 1`` tokens at stride ``seq_len``; the sample order is a
permutation seeded by ``(data.seed, epoch)``, so ``PackedDataset.batch(step, ...)`` is a pure function of the
step and resuming at step k replays exactly the samples an uninterrupted run would have seen.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from array import array
from typing import IO, Any, NamedTuple

import numpy as np

from megatrain_jax.errors import UserError

FORMAT_NAME = "megatrain-jax-packed"
FORMAT_VERSION = 1
SUFFIXES = (".json", ".tokens.bin", ".mask.bin", ".docs.npy")  # every file a prepared data set has
_CHUNK_BYTES = 16 << 20  # streaming unit for hashing and scanning files
_FLUSH_TOKENS = 1 << 22  # the writer buffers this many tokens before writing


class Batch(NamedTuple):
    """One training batch of numpy arrays, all of shape (batch_size, seq_len)."""

    tokens: np.ndarray  # int32 input ids
    labels: np.ndarray  # int32 next-token ids (tokens shifted left by one)
    loss_mask: np.ndarray  # float32, 0 where the label is a masked (prompt) token, else 1
    segment_ids: np.ndarray  # int32 document index within the window, from 0
    positions: np.ndarray  # int32 position within the document (restarting at 0 at each document start in the window)


def sha256_file(path: str, progress: str | None = None) -> str:
    """The file's SHA-256 in chunks, with a progress line when ``progress`` names it. Public: data/load.py
    checks a dataset's recorded hash with it."""
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


def max_token_id(tokens: np.ndarray) -> int:
    """The largest token id, read in chunks (no full temporary). Public: data/load.py checks the vocabulary with it."""
    step = max(1, _CHUNK_BYTES // tokens.dtype.itemsize)
    return max(int(tokens[i:i + step].max()) for i in range(0, len(tokens), step))


def _durable_close(f: IO) -> None:
    """Flush, fsync and close: a data file is on disk before the rename that publishes it."""
    f.flush()
    os.fsync(f.fileno())
    f.close()


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


class PackedWriter:
    """Streams documents into temporary files; ``commit`` renames them into place, ``abort`` deletes them.
    Public: the jsonl and pipeline preparers write through it."""

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
        _durable_close(self._tok_f)
        if self._mask_f is not None:
            _durable_close(self._mask_f)
        docs = np.frombuffer(self.doc_starts, dtype=np.int64) if len(self.doc_starts) else np.zeros(0, np.int64)
        f = open(self.tmp["docs"], "wb")
        np.save(f, docs)
        _durable_close(f)
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
                     "sha256": sha256_file(self.tmp["docs"])},
        }
        f = open(self.tmp["index"], "w")
        json.dump(index, f, indent=1)
        f.write("\n")
        _durable_close(f)
        # An index on disk means a complete data set: an earlier one's index goes first (a kill from here
        # on leaves no data set at that prefix, never a mix), then the data files, the new index last.
        if os.path.isfile(self.final["index"]):
            os.remove(self.final["index"])
        os.replace(self.tmp["tokens"], self.final["tokens"])
        os.replace(self.tmp["docs"], self.final["docs"])
        if self._mask_f is not None:
            os.replace(self.tmp["mask"], self.final["mask"])
        elif os.path.isfile(self.final["mask"]):
            os.remove(self.final["mask"])  # stale mask of an earlier prepare to the same prefix
        os.replace(self.tmp["index"], self.final["index"])
        _fsync_dir(os.path.dirname(os.path.abspath(self.prefix)))
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
        if n == 0:  # not one window: no batch size helps
            raise UserError("data.seq_len", f"{self.path} has {self.n_tokens:,} tokens, fewer than one sample of "
                            f"data.seq_len={s} (+1 for the last label)",
                            f"set data.seq_len to at most {max(self.n_tokens - 1, 1)}, or use more data")
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
