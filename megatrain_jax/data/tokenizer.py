"""Tokenizers: UTF-8 bytes, or a local Hugging Face ``tokenizer.json``."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np

from megatrain_jax.errors import UserError

_EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>")


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
