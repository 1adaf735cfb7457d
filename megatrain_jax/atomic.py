"""Output directories of the weight writers (export, convert, ``train.export``): which ones may be
written, and writing them atomically.

A writer fills a temporary sibling directory and renames it into place, so a kill leaves either
the old output or the new one. What it may replace is decided before anything is read or written:

- never a training run (a directory holding ``checkpoints/``, a ``checkpoints/`` directory, a
  checkpoint ``step_N``), a directory that contains one, or a path inside a ``checkpoints/`` tree;
- never the source, a directory containing it, or a path inside it;
- an existing non-empty directory only with ``overwrite`` and only when an earlier writer of the
  same kind made it (its ``MARKER`` file says the kind and lists the files it wrote). Only those
  files are replaced; anything else in it (tokenizer files copied in by hand) is carried over.

No import from the rest of the package: every writer can use it.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from typing import Iterable, Iterator

from megatrain_jax.errors import UserError

MARKER = "megatrain_export.json"  # {"kind": ..., "files": [...]}: written last by every writer here
KINDS = {"hf": "a Hugging Face export", "mt": "an mt (per-group safetensors) directory"}
_STEP = re.compile(r"^step_\d+($|\.)")  # step_N, step_N.tmp, step_N.corrupt...


def _is_checkpoint_step(path: str) -> bool:
    return bool(_STEP.match(os.path.basename(path))) and any(
        os.path.exists(os.path.join(path, n)) for n in ("manifest.json", "state.json", "groups"))


def run_reason(path: str) -> str | None:
    """Why ``path`` (an existing directory) is part of a training run with checkpoints, or None."""
    if os.path.isdir(os.path.join(path, "checkpoints")):
        return "is a training run directory (it holds checkpoints/)"
    if _is_checkpoint_step(path):
        return "is a training checkpoint"
    try:
        names = os.listdir(path)
    except OSError:
        return None
    if any(_is_checkpoint_step(os.path.join(path, n)) for n in names):
        return "is a checkpoints directory of a training run"
    return None


def _inside(child: str, parent: str) -> bool:
    return child == parent or child.startswith(parent.rstrip(os.sep) + os.sep)


def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(path))


def read_marker(path: str) -> dict | None:
    try:
        with open(os.path.join(path, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or not isinstance(marker.get("files"), list):
        return None
    # plain names only: a damaged marker must never point a removal outside the directory
    marker["files"] = [f for f in marker["files"] if isinstance(f, str) and f not in ("", ".", "..")
                       and os.sep not in f and (os.altsep is None or os.altsep not in f)]
    return marker


def check_output(out: str, kind: str, *, sources: Iterable[str] = (), overwrite: bool = False,
                 field: str = "OUT", other: str | None = None) -> None:
    """Raise ``UserError`` unless a writer of ``kind`` may write ``out`` (see the module docstring).
    ``other``: a hint naming the command that writes the other kind, for the refusal of one."""
    real = _real(out)
    for src in sources:
        s = _real(src)
        if _inside(real, s) or _inside(s, real):
            where = "is" if real == s else ("lies inside" if _inside(real, s) else "contains")
            raise UserError(field, f"{out} {where} the source {src}", "write to a directory outside the source")
    for anc in [real, *_ancestors(real)]:
        if os.path.basename(anc) == "checkpoints" and os.path.isdir(anc) and run_reason(anc):
            raise UserError(field, f"{out} lies inside the checkpoints of a training run ({anc})",
                            "write to a directory outside the run's checkpoints/")
    if not os.path.exists(out):
        return
    if not os.path.isdir(out):
        raise UserError(field, f"{out} exists and is not a directory", "choose a new directory")
    why = run_reason(out)
    if why:
        raise UserError(field, f"{out} {why}; it is never replaced, whatever the flags",
                        "choose a new directory for the output")
    if not os.listdir(out):
        return
    marker = read_marker(out)
    if marker is None:
        raise UserError(field, f"{out} already exists, is not empty and was not written by megatrain-jax "
                        f"(no {MARKER}); it is never replaced", "choose a new directory, or empty it yourself")
    if marker.get("kind") != kind:
        was = KINDS.get(marker.get("kind"), repr(marker.get("kind")))
        raise UserError(field, f"{out} holds {was}, not {KINDS.get(kind, kind)}",
                        other or "choose a new directory")
    for dirpath, dirnames, _ in os.walk(out):
        for d in dirnames:
            why = run_reason(os.path.join(dirpath, d))
            if why:
                raise UserError(field, f"{out} contains {os.path.join(dirpath, d)}, which {why}",
                                "choose a new directory for the output")
    if not overwrite:
        raise UserError(field, f"{out} already exists and holds {KINDS.get(kind, kind)}",
                        "choose a new directory, or pass --overwrite to replace it")


def _ancestors(path: str) -> Iterator[str]:
    while True:
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent
        yield path


@contextlib.contextmanager
def output_dir(out: str, kind: str, *, sources: Iterable[str] = (), overwrite: bool = False,
               field: str = "OUT", meta: dict | None = None) -> Iterator[str]:
    """``with output_dir(out, kind) as tmp:`` write the files into ``tmp``; on a clean exit they
    replace ``out`` at once (with ``MARKER`` listing them), on an exception ``tmp`` is removed."""
    sources = list(sources)
    check_output(out, kind, sources=sources, overwrite=overwrite, field=field)
    out = os.path.abspath(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
        files = sorted(os.listdir(tmp))
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump({"kind": kind, "files": files, **(meta or {})}, f, indent=1)
        _swap(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _swap(tmp: str, out: str) -> None:
    """Put ``tmp`` in place of ``out``. Entries of the old ``out`` that its writer did not list move
    into the new one; the old directory is then removed file by file (only what the writer listed)."""
    if not os.path.exists(out):
        os.replace(tmp, out)
        return
    listed = set((read_marker(out) or {}).get("files", [])) | {MARKER}
    for name in os.listdir(out):
        if name not in listed and not os.path.exists(os.path.join(tmp, name)):
            os.replace(os.path.join(out, name), os.path.join(tmp, name))  # carried over, e.g. tokenizer files
    old = f"{out}.old-{os.getpid()}"
    os.replace(out, old)
    os.replace(tmp, out)
    for name in listed:
        p = os.path.join(old, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        elif os.path.lexists(p):
            os.remove(p)
    with contextlib.suppress(OSError):
        os.rmdir(old)  # left in place if it still holds anything (a name clash): nothing is lost
