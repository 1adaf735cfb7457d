"""Where every writer may write (the one rule), and writing output directories atomically.

**The rule** (``check_place``), applied by every command that writes (``prepare``, ``train``'s
``train.out_dir`` and ``train.export``, ``export``, ``convert``) before it reads or writes anything,
whatever the flags (``--overwrite`` never widens it): an output may not be, contain, or lie inside

- any input of the command (its source checkpoint or directory, data files, tokenizer, config file);
- any training run directory (one holding ``checkpoints/`` or the run's ``config.yaml``), a
  ``checkpoints/`` directory or a checkpoint ``step_N``: another run's retention or ``--overwrite``
  would later remove it, or it would remove files of the run. The one exception is the command's
  own run (``own_run``): ``train.out_dir`` is that run, and ``train.export`` may lie inside it
  (never inside its ``checkpoints/``);
- a folder that holds runs or prepared data sets (``runs/``, ``data/``): it may lie inside one
  (``runs/new``, ``data/new``), never be or contain one.

**Output directories** (export, convert, ``train.export``): a writer fills a temporary sibling
directory and renames it into place, so a kill leaves either the old output or the new one. An
existing non-empty directory is replaced only with ``overwrite`` and only when an earlier writer of
the same kind made it (its ``MARKER`` file says the kind and lists the files it wrote). Only those
files are replaced; anything else in it (tokenizer files copied in by hand) is carried over.

No import from the rest of the package: every writer can use it.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from typing import Iterable, Iterator

from megatrain_jax.errors import UserError

MARKER = "megatrain_export.json"  # {"kind": ..., "files": [...]}: written last by every writer here
KINDS = {"hf": "a Hugging Face export", "mt": "an mt (per-group safetensors) directory"}
RUN_CONFIG = "config.yaml"  # written by `train` into train.out_dir before its first step
WALK_LIMIT = 20_000  # entries of an existing output directory looked through for runs and data sets
_STEP = re.compile(r"^step_\d+($|\.)")  # step_N, step_N.tmp, step_N.corrupt...


def _is_checkpoint_step(path: str) -> bool:
    return bool(_STEP.match(os.path.basename(path))) and any(
        os.path.exists(os.path.join(path, n)) for n in ("manifest.json", "state.json", "groups"))


def _is_run_config(path: str) -> bool:
    """``path`` is a ``config.yaml`` that ``train`` wrote: every section of a megatrain-jax config, and
    ``train.out_dir`` and ``train.keep_last`` in it (another tool's config.yaml is not a run's)."""
    try:
        if not os.path.isfile(path) or os.path.getsize(path) > 1 << 20:
            return False
        import yaml

        with open(path) as f:
            tree = yaml.safe_load(f)
    except Exception:  # noqa: BLE001 - unreadable or not YAML: not a run's config
        return False
    return (isinstance(tree, dict) and all(isinstance(tree.get(k), dict) for k in ("model", "optim", "data", "train"))
            and {"out_dir", "keep_last"} <= set(tree["train"]))


def run_reason(path: str) -> str | None:
    """Why ``path`` (an existing directory) is part of a training run, or None."""
    if os.path.isdir(os.path.join(path, "checkpoints")):
        return "is a training run directory (it holds checkpoints/)"
    if _is_checkpoint_step(path):
        return "is a training checkpoint"
    try:
        names = os.listdir(path)
    except OSError:
        return None
    if any(_is_checkpoint_step(os.path.join(path, n)) for n in names if _STEP.match(n)):
        return "is a checkpoints directory of a training run"
    if RUN_CONFIG in names and _is_run_config(os.path.join(path, RUN_CONFIG)):
        return f"is a training run directory (it holds the run's {RUN_CONFIG})"
    return None


def dataset_in(path: str) -> str | None:
    """The prefix of a prepared data set (``PREFIX.json`` + ``PREFIX.tokens.bin``) directly in the
    directory ``path``, or None."""
    try:
        names = set(os.listdir(path))
    except OSError:
        return None
    for n in sorted(names):
        if n.endswith(".tokens.bin") and n[: -len(".tokens.bin")] + ".json" in names:
            return os.path.join(path, n[: -len(".tokens.bin")])
    return None


def _inside(child: str, parent: str) -> bool:
    return child == parent or child.startswith(parent.rstrip(os.sep) + os.sep)


def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(os.path.expanduser(path)))


def check_place(out: str, *, inputs: Iterable[str | None] = (), field: str = "OUT", own_run: str | None = None,
                files: Iterable[str] | None = None) -> None:
    """The one rule of every writer (see the module docstring): raise ``UserError`` when ``out`` is,
    contains or lies inside an input, a training run or a folder holding runs or data sets.

    ``out`` is a directory the command writes; ``files``: the command writes these files instead
    (``prepare``'s ``PREFIX.json``, ...; ``out`` then names them in messages). ``own_run``: the run
    the command itself writes (``train.out_dir``): ``out`` may be it or lie inside it, never inside
    its ``checkpoints/``. Reads directory listings only; writes nothing."""
    targets = [out] if files is None else list(files)
    reals = [_real(t) for t in targets]
    own = _real(own_run) if own_run else None
    never = "it is never written, whatever the flags"
    for src in inputs:
        if not src:
            continue
        s = _real(src)
        for t, r in zip(targets, reals):
            if r == s:
                raise UserError(field, f"{t} is the input {src} of this command; {never}",
                                "choose an output outside every input of the command")
            if _inside(r, s):
                raise UserError(field, f"{t} lies inside the input {src} of this command; {never}",
                                "choose an output outside every input of the command")
            if _inside(s, r):
                raise UserError(field, f"{out} contains the input {src} of this command; {never}",
                                "choose an output outside every input of the command")
    where = reals[0] if files is None else os.path.dirname(reals[0])
    probe = where if files is not None else os.path.dirname(where)
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise UserError(field, f"{out} lies under {probe}, which is a file, not a directory",
                        "choose an output whose parents are directories")
    if own is not None and files is None and where != own and _inside(where, os.path.join(own, "checkpoints")):
        raise UserError(field, f"{out} lies inside the checkpoints of the run {own_run}; {never}",
                        "write it outside the run's checkpoints/, e.g. <train.out_dir>/export")
    for anc in ([where] if files is not None else []) + list(_ancestors(where)):
        if anc == own:
            continue
        why = run_reason(anc) if os.path.isdir(anc) else None
        if why:
            raise UserError(field, f"{out} lies inside {anc}, which {why}; {never} (that run's retention or "
                            "--overwrite could remove it, or it would remove files of the run)",
                            "write it outside every training run, e.g. a new directory beside the runs")
    if files is not None or not os.path.isdir(where):
        return
    if where != own:
        why = run_reason(where)
        if why:
            raise UserError(field, f"{out} {why}; {never}", "choose a new directory for the output")
    _check_contents(out, where, field, own, never)


def _check_contents(out: str, where: str, field: str, own: str | None, never: str) -> None:
    """An existing output directory may hold no training run and no prepared data set."""
    seen = 0
    for dirpath, dirnames, _ in os.walk(where):
        ds = dataset_in(dirpath)
        if ds is not None:
            held = "holds" if dirpath == where else "contains"
            raise UserError(field, f"{out} {held} the prepared data set {ds}; {never}",
                            "choose a new directory for the output (beside the data, not over it)")
        if dirpath == own:  # the run's own checkpoints: its, not another run's
            dirnames[:] = [d for d in dirnames if d != "checkpoints"]
        for d in list(dirnames):
            why = run_reason(os.path.join(dirpath, d))
            if why:
                raise UserError(field, f"{out} contains {os.path.join(dirpath, d)}, which {why}; {never}",
                                "choose a new directory for the output (beside the runs, not over them)")
        seen += len(dirnames) + 1
        if seen > WALK_LIMIT:
            raise UserError(field, f"{out} holds over {WALK_LIMIT:,} entries: not an output directory; {never}",
                            "choose a new directory for the output")


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
                 field: str = "OUT", other: str | None = None, own_run: str | None = None) -> None:
    """Raise ``UserError`` unless a writer of ``kind`` may write the directory ``out``: the one rule
    (``check_place``, with ``sources`` as the command's inputs), then what an existing directory must
    be (see the module docstring). ``other``: a hint naming the command that writes the other kind,
    for the refusal of one."""
    check_place(out, inputs=sources, field=field, own_run=own_run)
    if not os.path.exists(out):
        return
    if not os.path.isdir(out):
        raise UserError(field, f"{out} exists and is not a directory", "choose a new directory")
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
    if not overwrite:
        raise UserError(field, f"{out} already exists and holds {KINDS.get(kind, kind)}",
                        "choose a new directory, or pass --overwrite to replace it")


def check_train_outputs(out_dir: str, export: str | None, inputs: Iterable[str | None] = ()) -> None:
    """``train``'s outputs under the one rule, before anything is read: ``train.out_dir`` (the run
    itself: it may be an existing run, never lie inside or hold another) and ``train.export``."""
    inputs = [i for i in inputs if i]
    check_place(out_dir, inputs=inputs, field="train.out_dir", own_run=out_dir)
    if export:
        check_train_export(export, out_dir, inputs)


def check_train_export(export: str, out_dir: str | None, inputs: Iterable[str | None] = ()) -> None:
    """``train.export`` as the end of the run will write it (an ``export --overwrite``): the one rule,
    inside the run ``out_dir`` allowed (never its ``checkpoints/``), never the run itself or a
    directory holding it."""
    inputs = [i for i in inputs if i]
    if out_dir is not None and _inside(_real(out_dir), _real(export)):
        raise UserError("train.export", f"{export} is or contains train.out_dir ({out_dir}); the export would "
                        "replace the run", "export to a directory of its own, e.g. <out_dir>/export")
    check_output(export, "hf", sources=inputs, overwrite=True, field="train.export", own_run=out_dir)


def check_writable(out_dir: str, field: str = "train.out_dir") -> None:
    """Refuse an output directory that cannot be created and written, creating nothing: a file, a
    path under a file, a directory without write permission, a read-only filesystem. The probe is
    one temporary file in the nearest existing ancestor, removed at once."""
    import tempfile

    path = os.path.abspath(out_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(field, f"{out_dir} is an existing file, not a directory", f"choose a directory path for {field}")
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise UserError(field, f"{out_dir} lies under {probe}, which is a file, not a directory",
                        f"choose a {field} whose parents are directories")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".megatrain-write-check-", dir=probe)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise UserError(field, f"{out_dir} cannot be written ({probe}: {e.strerror or e})",
                        f"choose a {field} you may create files in (not on a read-only filesystem)") from None


def _ancestors(path: str) -> Iterator[str]:
    while True:
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent
        yield path


@contextlib.contextmanager
def output_dir(out: str, kind: str, *, sources: Iterable[str] = (), overwrite: bool = False,
               field: str = "OUT", meta: dict | None = None, own_run: str | None = None) -> Iterator[str]:
    """``with output_dir(out, kind) as tmp:`` write the files into ``tmp``; on a clean exit they
    replace ``out`` at once (with ``MARKER`` listing them), on an exception ``tmp`` is removed."""
    sources = list(sources)
    check_output(out, kind, sources=sources, overwrite=overwrite, field=field, own_run=own_run)
    out = os.path.abspath(out)
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        remove_stale(os.path.dirname(out), re.escape(os.path.basename(out)) + r"\.tmp-(?P<pid>\d+)")  # killed writers'
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    except OSError as e:
        raise io_error(e, field, out) from None
    try:
        yield tmp
        files = sorted(os.listdir(tmp))
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump({"kind": kind, "files": files, **(meta or {})}, f, indent=1)
        _swap(tmp, out)
    except OSError as e:  # a full disk, a read-only folder: one line, and nothing of the new output is kept
        shutil.rmtree(tmp, ignore_errors=True)
        raise io_error(e, field, out) from None
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


RUN_LOCK = ".megatrain.lock"  # in train.out_dir: held (flock) by the one command that runs there


class RunLock:
    """An advisory ``flock`` on ``<out_dir>/.megatrain.lock``, held from before the command touches anything in
    the run until ``release()``; the kernel releases it when the process dies (a kill leaves no stale lock). The
    file holds the holder's pid and command line, for the refusal of a second command."""

    def __init__(self, out_dir: str, field: str = "train.out_dir"):
        import fcntl

        self.path = os.path.join(out_dir, RUN_LOCK)
        self.made: list[str] = []  # the directories this lock created (outermost first)
        d = os.path.abspath(out_dir)
        while not os.path.exists(d):
            self.made.insert(0, d)
            d = os.path.dirname(d)
        try:
            os.makedirs(out_dir, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise UserError(field, f"{self.path} cannot be created ({e.strerror or e})",
                            f"choose a {field} you may create files in") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip().splitlines()
            except OSError:
                holder = []
            os.close(fd)
            who = f"process {holder[0]}" + (f" ({holder[1][:120]})" if len(holder) > 1 else "") if holder \
                else "another process"
            raise UserError(field, f"{out_dir} is in use: {who} is running there; nothing of that run was "
                            "touched", f"wait for it to end (or stop it), or choose another {field}") from None
        import sys

        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n{' '.join(sys.argv)}\n".encode(), 0)
        self.fd: int | None = fd

    def release(self, undo: bool = False) -> None:
        """Release the lock; ``undo`` (the command stopped before writing anything): also remove the lock file and
        the directories the lock created, where they hold nothing else."""
        if self.fd is not None:
            if undo:
                with contextlib.suppress(OSError):
                    os.remove(self.path)
                for d in reversed(self.made):
                    with contextlib.suppress(OSError):
                        os.rmdir(d)
            os.close(self.fd)  # closing the one descriptor releases the flock
            self.fd = None


def io_problem(e: BaseException) -> tuple[str, str]:
    """``(what went wrong, the fix)`` of a failed write, in a few words: a full disk, a read-only folder, a
    permission, or the error's own first line (orbax and tensorstore report a full disk as their own errors)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    code = getattr(e, "errno", None)
    if code == errno.ENOSPC or "No space left" in text or "os_error_code='28'" in text:
        return "the disk is full (No space left on device)", "free disk space there"
    if code == errno.EROFS or "Read-only file system" in text:
        return "the file system is read-only", "choose a writable folder"
    if code in (errno.EACCES, errno.EPERM) or "Permission denied" in text:
        return "permission denied", "choose a folder you may write in, or fix its permissions"
    if code == errno.EDQUOT or "quota" in text.lower():
        return "the disk quota is exceeded", "free space within your quota"
    return f"{type(e).__name__}: {text[:200]}", "check free disk space and permissions there"


def io_error(e: OSError, field: str | None = None, path: str | None = None) -> UserError:
    """An ``OSError`` (a full disk, a read-only folder, ...) as the one-line ``UserError`` naming the path written
    (``path``, else the error's own file name)."""
    what, fix = io_problem(e)
    where = path or e.filename or "the output"
    return UserError(field or str(where), f"writing {where} failed: {what}" if field else what, fix)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process
    return True


def remove_stale(folder: str, pattern: str) -> list[str]:
    """Remove what a killed writer left in ``folder``: entries whose name matches ``pattern`` (a regex whose
    group ``pid`` is the writer's process id) and whose writer is gone. Returns the paths removed."""
    rx = re.compile(pattern)
    removed = []
    try:
        names = os.listdir(folder or ".")
    except OSError:
        return removed
    for n in names:
        m = rx.fullmatch(n)
        if m is None or pid_alive(int(m.group("pid"))):
            continue
        p = os.path.join(folder, n)
        try:
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            else:
                os.remove(p)
        except OSError:
            continue
        removed.append(p)
    return removed
