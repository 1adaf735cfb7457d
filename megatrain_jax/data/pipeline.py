"""``megatrain-jax prepare``: text / JSONL files -> a packed token data set (format: ``packed.py``).

Documents are concatenated; with a ``tokenizer.json`` that has an EOS token, EOS follows every document.
Everything is streamed into temporary files that are renamed into place only when the whole run succeeded.
"""
from __future__ import annotations

import argparse
import errno
import io
import os
import re
import time
from typing import IO, Any, Iterator

import numpy as np

import megatrain_jax.data.chat as chat
from megatrain_jax.atomic import check_place, io_problem, remove_stale
from megatrain_jax.data.jsonl import NO_ASSISTANT, open_binary, prepare_jsonl, Report
from megatrain_jax.data.packed import SUFFIXES, PackedWriter
from megatrain_jax.data.progress import Progress
from megatrain_jax.data.tokenizer import ByteTokenizer, dtype_for_vocab, load_tokenizer
from megatrain_jax.errors import UserError

_CHUNK_BYTES = 16 << 20  # a byte-tokenized text file is read in pieces of this size
_TEXT_PIECE_CHARS = 1 << 22  # a long text file is encoded by a tokenizer.json in pieces of about this size
_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)  # failures of the output, not of an input


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


def _prepare_text(path: str, tok, w: PackedWriter, prog: Progress, fi: int, nf: int) -> None:
    """A whole text file is one document."""
    w.start_doc()
    if isinstance(tok, ByteTokenizer):  # raw bytes are the ids: no decoding at all
        with open_binary(path) as f:
            first = True
            while True:
                chunk = f.read(_CHUNK_BYTES)
                if not chunk:
                    break
                if first and chunk.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark: no text, not kept
                    chunk = chunk[3:]
                first = False
                w.append(np.frombuffer(chunk, dtype=np.uint8))
                prog.update(len(chunk), w, fi, nf)
    else:
        try:
            with open_binary(path) as fb:
                f = io.TextIOWrapper(fb, encoding="utf-8-sig", errors="strict", newline="")  # (drops a BOM)
                batch: list[str] = []
                for piece in _text_pieces(f, _TEXT_PIECE_CHARS):
                    batch.append(piece)
                    if len(batch) >= 8:
                        for ids in _interruptible(tok.encode_batch, batch):
                            w.append(ids)
                        prog.update(sum(len(p) for p in batch), w, fi, nf)
                        batch = []
                for ids in _interruptible(tok.encode_batch, batch) if batch else []:
                    w.append(ids)
                prog.update(sum(len(p) for p in batch), w, fi, nf)
        except UnicodeDecodeError as e:
            raise UserError(path, f"is not valid UTF-8 (byte {e.start})",
                            "convert it to UTF-8 (e.g. iconv), or use --tokenizer byte") from None
    w.end_doc()


def _interruptible(fn, *args):
    """``fn(*args)`` on a daemon thread, waited for in short slices: a Ctrl-C reaches this thread within a fraction
    of a second instead of after a long native call (a tokenizer encoding megabytes of text holds the thread that
    calls it for seconds); the abandoned call ends with the process."""
    import threading

    box: dict = {}

    def run():
        try:
            box["out"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["err"] = e

    t = threading.Thread(target=run, name="prepare-encode", daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.1)
    if "err" in box:
        raise box["err"]
    return box["out"]


def _check_out(out: str, overwrite: bool, inputs: list[str | None] = ()) -> str:
    """Refuse an ``--out`` whose files would replace something prepare did not write, an earlier data set
    without ``overwrite``, or that breaks the writers' rule (``atomic.check_place``: never an input of the
    command, never inside a run); returns the prefix. Runs before anything is read or written."""
    if not out:
        raise UserError("--out", "is empty", "give an output prefix such as data/mycorpus")
    for suffix in (".json", ".tokens.bin"):
        if out.endswith(suffix):
            out = out[: -len(suffix)]
    if out.endswith(("/", os.sep)) or os.path.isdir(out):
        raise UserError("--out", f"{out} is a directory; prepare writes PREFIX.json, PREFIX.tokens.bin, ... "
                        "beside a prefix", f"give a prefix, e.g. {os.path.join(out, 'data')}")
    check_place(out, inputs=inputs, field="--out", files=[out + s for s in SUFFIXES])
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UserError("--out", f"{parent!r} is a file, not a directory", "choose an output prefix in a directory")
    existing = [out + s for s in SUFFIXES if os.path.lexists(out + s)]
    for p in existing:
        if not os.path.isfile(p) or os.path.islink(p) or (p.endswith(".json") and not _is_index(p)):
            raise UserError("--out", f"{p} exists and is not a file prepare wrote; it is never replaced, "
                            "whatever the flags", "choose another --out prefix")
    if existing and not overwrite:
        raise UserError("--out", f"{out} already holds a prepared data set "
                        f"({', '.join(os.path.basename(p) for p in existing)})",
                        "pass --overwrite to replace it, or choose another --out prefix")
    return out


def _is_index(path: str) -> bool:
    """``path`` is a data index prepare wrote (a small JSON object of its format), not a user's file."""
    import json

    from megatrain_jax.data.packed import FORMAT_NAME

    try:
        if os.path.getsize(path) > 64 << 20:
            return False
        with open(path, encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(index, dict) and index.get("format") == FORMAT_NAME


def _make_dirs(path: str) -> list[str]:
    """``os.makedirs`` that returns the directories it created, outermost first."""
    made, d = [], os.path.abspath(path)
    while not os.path.exists(d):
        made.append(d)
        d = os.path.dirname(d)
    os.makedirs(path, exist_ok=True)
    return made[::-1]


def _no_assistant_error(report: Report) -> UserError:
    files = report.dropped_in.get(NO_ASSISTANT, {})
    n = sum(files.values())
    field = next(iter(files)) if len(files) == 1 else "INPUTS"
    where = "" if len(files) == 1 else f" in {', '.join(files)}"
    return UserError(field, f"no assistant tokens: none of the {n:,} conversation(s){where} has an assistant turn, "
                     "so there is nothing to train on",
                     'give each conversation an assistant turn ({"role": "assistant", ...} or {"from": "gpt", ...}), '
                     'or write plain text as {"text": ...} records')


def prepare(inputs: list[str], out: str, tokenizer: str = "byte", fmt: str = "auto",
            quiet: bool = False, chat_format: str = "auto", chat_template: str | None = None,
            on_error: str = "stop", workers: int | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Tokenize ``inputs`` into the packed data set ``out`` (a prefix); returns the index written.

    Text files: each whole file is one document. JSONL (``.jsonl``/``.ndjson``/``.json``, or ``fmt='jsonl'``):
    one JSON object per line with ``text``, or ``prompt`` and ``response`` (the prompt's tokens get loss
    mask 0; the two are encoded separately and concatenated, nothing in between). ``.gz`` inputs are read
    compressed. Everything is streamed; nothing appears under ``out`` unless the whole run succeeds.

    Conversations (``messages``, ShareGPT ``conversations``, Alpaca ``instruction``/``output``; detected per
    record or forced by ``chat_format``) are rendered with ``chat_template`` (a model/tokenizer folder, or
    ``chatml``; default: the tokenizer's folder) and only assistant tokens count in the loss (``chat.py``).
    ``on_error``: ``stop`` at the first bad line (one line naming file:line), or ``skip`` it and count it.
    An existing data set at ``out`` is refused unless ``overwrite``; then only its own files are replaced,
    and only once the new one is complete. Never a directory, never a file of an input (the input
    ``y.json`` and ``--out y``) nor a prefix inside an input directory or a run, whatever the flags
    (``atomic.check_place``).
    """
    if chat_format not in ("auto", "none") + chat.FORMATS:
        raise UserError("--chat-format", f"{chat_format!r} is not a format", "use auto, none, messages, sharegpt or alpaca")
    if on_error not in ("stop", "skip"):
        raise UserError("--on-error", f"{on_error!r} is not a policy", "use stop or skip")
    if fmt not in ("auto", "text", "jsonl"):
        raise UserError("--format", f"{fmt!r} is not a format", "use auto, text or jsonl")
    if not inputs:
        raise UserError("INPUTS", "no input files given", "pass one or more .txt / .jsonl files")
    inputs_read = [*inputs, tokenizer if tokenizer != "byte" else None,
                   chat_template if chat_template != "chatml" else None]
    out = _check_out(out, overwrite, inputs_read)  # the writers' rule first: nothing read or written yet
    files = _expand_inputs(inputs)
    # what a killed prepare to this prefix left (PREFIX.tokens.bin.tmp<pid>, ...): its process is gone
    remove_stale(os.path.dirname(out), re.escape(os.path.basename(out)) + r"\.(json|tokens\.bin|mask\.bin|docs\.npy)"
                 r"\.tmp(?P<pid>\d+)")
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
    report = Report()
    explicit_workers = workers is not None
    workers = workers or (os.cpu_count() or 1)
    dtype = dtype_for_vocab(tok.vocab_size)
    out_dir = os.path.dirname(os.path.abspath(out))
    total = 0
    for p in files:
        try:
            total += os.path.getsize(p)
        except OSError:
            pass
    prog = Progress(total, quiet)
    made: list[str] = []
    try:
        made = _make_dirs(out_dir)
        w = PackedWriter(out, dtype, tok.eos_id)
    except OSError as e:
        _remove_empty(made)
        raise UserError("--out", f"cannot write under {out_dir!r} ({e.strerror or e})",
                        "choose a writable output directory") from None
    try:
        for i, p in enumerate(files, 1):
            try:
                if _detect_format(p, fmt) == "jsonl":
                    big = os.path.getsize(p) > (16 << 20)  # worker start-up (~1 s) pays off on large files
                    prepare_jsonl(p, tok, w, prog, i, len(files), template, chat_format, on_error, report,
                                   workers=workers if (big or explicit_workers) else 1, tok_spec=tokenizer)
                else:
                    _prepare_text(p, tok, w, prog, i, len(files))
            except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
                if getattr(e, "errno", None) in _WRITE_ERRNOS:  # the output's disk, not the input
                    raise
                raise UserError(p, f"could not be processed ({e.__class__.__name__}: {e})",
                                "check that the input is readable and the output directory has space") from None
        if w.n_tokens < 2 and report.dropped.get(NO_ASSISTANT):
            raise _no_assistant_error(report)
        if w.n_tokens < 2:
            raise UserError("INPUTS", f"the inputs hold {w.n_tokens} tokens", "pass non-empty text or JSONL files")
        summary = {"examples_read": report.read, "examples_written": report.written, "conversations": report.chat,
                   "dropped": report.dropped, "bad_lines_skipped": report.n_bad, "bad_lines_first": report.bad_lines}
        index = w.commit({"vocab_size": tok.vocab_size, "tokenizer": tok.describe(),
                          "sources": [os.path.abspath(p) for p in files], "report": summary})
    except BaseException as e:
        w.abort()
        _remove_empty(made)  # directories this run created: nothing is left behind
        if isinstance(e, OSError):  # a full disk, a read-only folder: one line (the temporaries are gone)
            what, fix = io_problem(e)
            raise UserError("--out", f"writing {out} failed: {what}; nothing of it is kept",
                            f"{fix} (under {out_dir})") from None
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


def _remove_empty(dirs: list[str]) -> None:
    for d in reversed(dirs):
        try:
            os.rmdir(d)
        except OSError:
            return


def prepare_main(argv: list[str]) -> int:
    """``megatrain-jax prepare INPUTS... --out PREFIX [--tokenizer byte|PATH] [--format auto|text|jsonl]``.

    Returns 0 on success; user mistakes raise ``UserError`` (the CLI prints it and exits 2); bad
    command-line syntax exits 2 through argparse.
    """
    ap = argparse.ArgumentParser(
        prog="megatrain-jax prepare",
        description="Tokenize text / JSONL files into a packed token file for training (data.path=PREFIX); "
                    "--preference: JSONL preference pairs (docs/preference.md).")
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
    ap.add_argument("--overwrite", action="store_true",
                    help="replace an earlier data set at PREFIX (its own files only, once the new one is complete)")
    args = ap.parse_args(argv)
    if args.workers is not None and args.workers < 1:
        raise UserError("--workers", f"must be >= 1, got {args.workers}", "pass a positive number of processes")
    prepare(args.inputs, args.out, args.tokenizer, args.format, args.quiet, args.chat_format, args.chat_template,
            args.on_error, args.workers, args.overwrite)
    return 0


# shared with data/preference.py: ``prepare --preference`` checks and writes its output under the same rules
check_out, expand_inputs, make_dirs, remove_empty = _check_out, _expand_inputs, _make_dirs, _remove_empty
