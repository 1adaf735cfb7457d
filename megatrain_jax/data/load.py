"""``load_dataset``: a ``.txt`` file or a prepared prefix, checked in full before training writes anything."""
from __future__ import annotations

import json
import os
import sys

import numpy as np

from megatrain_jax.data.packed import FORMAT_NAME, FORMAT_VERSION, PackedDataset, max_token_id, sha256_file
from megatrain_jax.data.tokenizer import ByteTokenizer, dtype_for_vocab, load_tokenizer
from megatrain_jax.errors import UserError

_BOM = b"\xef\xbb\xbf"  # UTF-8's byte-order mark, which some editors put at the start of a text file
_AUTO_FULL_VERIFY_BYTES = 1 << 30  # verify="auto": full sha256 below this size, size check above
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def resolve_path(path: str) -> str:
    """Relative paths that do not exist from the working directory are tried from the repository root.
    Public: the run's start (run_start.py) resolves the data path with it before loading."""
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
        with open(path, "rb") as f:
            bom = len(_BOM) if f.read(len(_BOM)) == _BOM else 0  # a UTF-8 byte-order mark is no text: not trained on
        if size - bom < 2:
            raise UserError("data.path", f"{path} holds {size - bom} bytes", "use a text file with some content")
        tokens = np.memmap(path, dtype=np.uint8, mode="r", offset=bom)  # the bytes are the ids
        desc = ByteTokenizer().describe()
    else:
        tok = load_tokenizer(tok_spec, "data.tokenizer")
        if size > 256 << 20:
            print(f"data: tokenizing {size / 1e6:.0f} MB in memory; `megatrain-jax prepare` does it once, streamed",
                  file=sys.stderr, flush=True)
        try:
            with open(path, encoding="utf-8-sig", newline="") as f:  # (a byte-order mark is dropped)
                tokens = tok.encode(f.read()).astype(dtype_for_vocab(tok.vocab_size))
        except UnicodeDecodeError as e:
            raise UserError("data.path", f"{path} is not valid UTF-8 (byte {e.start})", "convert it to UTF-8") from None
        desc = tok.describe()
        if len(tokens) < 2:
            raise UserError("data.path", f"{path} holds {len(tokens)} tokens", "use a text file with some content")
    checksum = sha256_file(path) if size <= _AUTO_FULL_VERIFY_BYTES else None
    ds = PackedDataset(tokens, None, None, seed=data_cfg.seed, seq_len=data_cfg.seq_len, path=path,
                       tokenizer=desc, checksum=checksum, doc_masking=bool(getattr(data_cfg, "doc_masking", False)))
    _check_vocab(ds, vocab_size, path)
    return ds


def _check_vocab(ds: PackedDataset, vocab_size: int, path: str, max_id: int | None = None) -> None:
    m = max_token_id(ds.tokens) if max_id is None else max_id
    if m >= vocab_size:
        err = UserError("model.vocab_size",
                        f"data {path} holds token id {m} but the model's vocab_size is {vocab_size}",
                        f"set model.vocab_size >= {m + 1}, or prepare the data with the model's tokenizer")
        err.max_id = m  # (a model.from_hf run names the data instead: its config.json sets vocab_size)
        raise err


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
            if sha256_file(p, note) != entry.get("sha256"):
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
    from megatrain_jax.data.preference import preference_of

    return preference_of(ds, index)  # pairs (prepare --preference): served as adjacent rows


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


def load_dataset(data_cfg, vocab_size: int, *, verify: str = "auto", batch_size: int | None = None) -> PackedDataset:
    """Open ``data_cfg.path``: a ``.txt`` file (tokenized in memory; with the byte tokenizer it is
    memory-mapped as is) or a prefix written by ``megatrain-jax prepare`` (memory-mapped, checked).

    ``verify``: ``full`` checks sizes and sha256 of every file; ``size`` checks sizes only; ``auto`` (default)
    is ``full`` for token files up to 1 GiB and ``size`` above. Token ids are always checked against
    ``vocab_size`` (one streamed max). With ``batch_size``, one batch of ``data_cfg.seq_len`` must fit in
    the data too, so a run that calls this first refuses too little data before it writes anything.
    Every problem raises ``UserError``.
    """
    if verify not in ("auto", "full", "size"):
        raise ValueError(f"verify must be auto, full or size, not {verify!r}")
    raw = getattr(data_cfg, "path", None)
    if not raw:
        raise UserError("data.path", "is empty", "set data.path to a .txt file or a prepared data prefix")
    path = resolve_path(str(raw))
    prefix = path
    for suffix in (".json", ".tokens.bin"):
        if prefix.endswith(suffix) and os.path.isfile(prefix[: -len(suffix)] + ".json"):
            prefix = prefix[: -len(suffix)]
    if os.path.isfile(prefix + ".json"):
        ds = _load_prepared(prefix, data_cfg, vocab_size, verify)
    elif path.lower().endswith(".txt") and os.path.isfile(path):
        ds = _load_text(path, data_cfg, vocab_size)
    else:
        ds = None
    if ds is not None:
        if batch_size is not None:
            ds.check(batch_size, data_cfg.seq_len)
        return ds
    if os.path.exists(path):
        raise UserError("data.path", f"{path!r} is neither a .txt file nor a prepared data prefix",
                        f"run `megatrain-jax prepare {raw} --out PREFIX` and set data.path=PREFIX")
    raise UserError("data.path", f"{raw!r} does not exist (no such file, and no {raw}.json data index)",
                    "set data.path to a .txt file or a prefix written by `megatrain-jax prepare`")
