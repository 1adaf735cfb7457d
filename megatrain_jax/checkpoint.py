"""Training checkpoints: written by orbax group by group in the background, atomic, checked, retained.

Layout of ``<train.out_dir>/checkpoints/``::

    step_00000010/                  one complete checkpoint (the loop step it was taken after)
        groups/<group>/             one orbax PyTree checkpoint per host-store group (embed, block_i, head):
                                    {"master": fp32 weights, "opt_0".. : optimizer state arrays}
        state.json                  step, optimizer count, data position, RNG seeds, config, layouts
        manifest.json               written last: crc32 of every array and of state.json
    step_00000015.tmp/              a save in progress (or killed): never read, removed by the next run
    step_00000005.corrupt/          failed its checks at resume: moved aside, kept for inspection

**Consistency while training continues.** A save of the state after optimizer update ``K`` starts
between two steps. The writer thread walks the groups in the order the next step updates them; for
each it waits for update ``K`` of that group (the engine's pending future), hands the live host
buffers to orbax (no copy: orbax's numpy handler is built with ``deepcopy_host_arrays=False``,
so nothing may write the buffers until its synchronous ``save`` returns) while a second thread
computes their crc32, then *releases* the group. The engine calls ``before_update(name, count)`` on
its host-optimizer thread just before it writes a group in place; for ``count > K`` it waits until
that group is released. So every group is saved exactly as update ``K`` left it, the model is
never copied, and the forward/backward of the next steps run while the save proceeds: the only
stall is an update of a group that the writer has not reached yet (measured as ``held_s``; zero
when a save finishes within one step's compute, since updates come at the end of a step).
``save()`` itself blocks the loop only to wait for a previous save that is still running; a save
with ``wait=True`` (the loop is paused: end of run, signal) first applies the queued updates.
Measured (``experiments/bench_checkpoint.py``, 2-core VM, 1.24B params fp32 = 14.8 GB): a background
save takes ~21 s and stalls the loop ~19-20 s when steps take 1.4 s (the updates catch up with the
writer within a step); ``save()`` returns in ~1 ms; no extra host memory; restore ~36 s cold with
~2.1 GB transient (twice the largest array).

**Atomic.** Everything is written under ``step_N.tmp``; ``manifest.json`` is written (and fsynced)
last, then the directory is renamed to ``step_N`` (an atomic rename, then the parent is fsynced).
A kill at any point leaves either the complete old set of checkpoints or a ``.tmp`` directory
that is ignored. Retention (``keep_last`` newest, plus every step divisible by ``keep_every``)
deletes only after a newer checkpoint is committed, renaming before removing.

**Checked.** Resume restores array by array and compares each with its crc32 (and orbax/tensorstore
reject truncated files); a checkpoint that fails is reported, moved aside to ``step_N.corrupt`` and
the previous one is used. The crc32 is taken from the live buffer while the group is held, so it
also proves that the bytes written are the bytes of update ``K``.

**A few files.** A run whose trained state is small (adapters over a frozen base) gives the saver ``files``: its
files are written in-line into ``step_N.tmp``, the manifest lists the crc32 of each, and the commit and retention
are the same (``checkpoint_read.read_checked`` checks them).

``megatrain-jax export`` (``megatrain_jax.hf.commands``) reads a committed checkpoint's master
weights with ``read_checkpoint_meta`` and ``load_group_array``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

import megatrain_jax.checkpoint_shards as shards
from megatrain_jax.atomic import io_problem
from megatrain_jax.checkpoint_files import file_crc, manifest_files
from megatrain_jax.errors import UserError
from megatrain_jax.orbax_io import checkpointer, restore_array  # noqa: F401 - the orbax glue (export uses it)

FORMAT = 1
BLOCK_ALIGN = 2048  # values per block of per-block state (int8 moments' scales: optim.device_adamw.BLOCK)
CKPT_SUBDIR = "checkpoints"
MANIFEST = "manifest.json"
STATE = "state.json"
STEP_RE = re.compile(r"^step_(\d+)$")
"""The name of a checkpoint's directory (``step_dirname`` writes it), its step in group 1. Public: ``export``
(``hf/commands.resolve_checkpoint``) tells a checkpoint from a run's directory by it, as ``list_checkpoints`` does."""
Log = Callable[[str], None]


class CorruptCheckpoint(Exception):
    """A checkpoint that is incomplete, truncated or fails its checksums."""


def checkpoint_root(out_dir: str) -> str:
    return os.path.join(os.path.abspath(out_dir), CKPT_SUBDIR)  # orbax refuses relative paths


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


@dataclasses.dataclass
class CheckpointInfo:
    path: str
    step: int


def read_meta(path: str) -> tuple[dict, bytes]:
    """``(manifest, state.json's bytes)`` of a checkpoint whose metadata is whole; ``CorruptCheckpoint``
    when not: a missing or unreadable manifest.json or state.json, a state.json that fails the manifest's
    checksum, a group or shard directory the manifest names that is missing. A checkpoint of files (its
    manifest lists ``files``: ``CheckpointSaver(files=)``) needs every file listed."""
    try:
        with open(os.path.join(path, MANIFEST), "rb") as f:
            manifest = json.loads(f.read())
        with open(os.path.join(path, STATE), "rb") as f:
            state_bytes = f.read()
    except (OSError, ValueError) as e:
        what = getattr(e, "filename", None)
        why = f"no {os.path.basename(what)}" if isinstance(e, FileNotFoundError) and what else \
            f"cannot read its metadata ({type(e).__name__}: {e})"
        raise CorruptCheckpoint(why) from None
    if not isinstance(manifest, dict):
        raise CorruptCheckpoint(f"{MANIFEST} is not a JSON object")
    if "files" in manifest and "format" not in manifest:  # a checkpoint of files (adapters)
        files = manifest["files"] if isinstance(manifest["files"], dict) else {}
        missing = [rel for rel in files if not os.path.isfile(os.path.join(path, rel))]
        if missing:
            raise CorruptCheckpoint(f"{missing[0]} is missing")
        return manifest, state_bytes
    if manifest.get("format") != FORMAT:
        raise CorruptCheckpoint(f"manifest format {manifest.get('format')} is not {FORMAT}")
    if zlib.crc32(state_bytes) != manifest.get("state_crc32"):
        raise CorruptCheckpoint(f"{STATE} fails its checksum")
    if manifest.get("shards"):
        parts = [f"shard_{p}" for p in range(int(manifest["shards"]))]
    else:
        parts = [os.path.join("groups", g) for g in manifest.get("groups", {})]
    missing = [d for d in parts if not os.path.isdir(os.path.join(path, d))]
    if missing:
        raise CorruptCheckpoint(f"{missing[0]}/ is missing")
    return manifest, state_bytes


def checkpoint_problem(path: str) -> str | None:
    """Why ``path`` is not a complete checkpoint, or None when it is. The one definition of complete that
    resume, export and retention share (``read_meta``); the arrays' checksums are checked when they are read."""
    try:
        read_meta(path)
    except CorruptCheckpoint as e:
        return str(e)
    return None


def step_dirs(root: str) -> list[CheckpointInfo]:
    """Every ``step_N`` directory under ``root``, complete or not (oldest first): what ``list_checkpoints`` and
    ``incomplete_checkpoints`` sort by ``checkpoint_problem``. Public: ``export`` (``hf/commands.resolve_checkpoint``)
    takes a directory that holds any as a ``checkpoints/`` directory, and a run's ``out_dir`` otherwise."""
    out = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            m = STEP_RE.match(name)
            path = os.path.join(root, name)
            if m and os.path.isdir(path):
                out.append(CheckpointInfo(path, int(m.group(1))))
    return sorted(out, key=lambda c: c.step)


def list_checkpoints(root: str) -> list[CheckpointInfo]:
    """Complete checkpoints (``step_N`` whose metadata is whole: ``checkpoint_problem``) under ``root``,
    oldest first."""
    return [c for c in step_dirs(root) if checkpoint_problem(c.path) is None]


def incomplete_checkpoints(root: str) -> list[tuple[CheckpointInfo, str]]:
    """``step_N`` directories under ``root`` that are not complete checkpoints, with why (oldest first)."""
    out = []
    for c in step_dirs(root):
        why = checkpoint_problem(c.path)
        if why is not None:
            out.append((c, why))
    return out


def set_aside(path: str) -> str:
    """Move a damaged or incomplete checkpoint to ``<path>.corrupt`` (kept for inspection); returns where."""
    aside = f"{path}.corrupt"
    if os.path.exists(aside):
        aside = f"{aside}-{int(time.time())}"
    os.replace(path, aside)
    return aside


def set_aside_incomplete(root: str) -> list[tuple[str, str, str]]:
    """Every incomplete ``step_N`` under ``root`` moved aside as ``.corrupt``: ``[(path, why, aside)]``."""
    return [(c.path, why, set_aside(c.path)) for c, why in incomplete_checkpoints(root)]


def leftovers(root: str) -> list[str]:
    """Directories left by interrupted saves or deletions (never complete checkpoints)."""
    if not os.path.isdir(root):
        return []
    return sorted(os.path.join(root, n) for n in os.listdir(root)
                  if n.startswith("step_") and (n.endswith(".tmp") or ".deleting" in n))


# ------------------------------------------------------------------------------------ checksums, files


def _bytes_view(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def crc32(a: np.ndarray) -> int:
    return zlib.crc32(_bytes_view(a))  # zlib releases the GIL on large buffers


def fsync_dir(path: str) -> None:
    """fsync a directory (its renames durable); best effort."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json(path: str, obj: Any) -> bytes:
    """``obj`` as JSON at ``path``, fsynced; returns the bytes written."""
    data = json.dumps(obj, indent=1, default=_json_default).encode()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return data


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"{type(o).__name__} is not JSON serialisable")


def remove_dir(path: str) -> None:
    """Rename first, so that a kill during the removal never leaves a half-deleted ``step_N``."""
    doomed = f"{path}.deleting-{os.getpid()}"
    try:
        os.replace(path, doomed)
    except FileNotFoundError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


def prune(root: str, keep_last: int, keep_every: int) -> list[str]:
    """Delete committed checkpoints outside the retention policy; returns the removed paths.

    Kept: the ``keep_last`` newest (all when 0) and every step divisible by ``keep_every`` (> 0).
    """
    cks = list_checkpoints(root)
    if keep_last <= 0:
        return []
    keep = {c.step for c in cks[-keep_last:]}
    if keep_every > 0:
        keep |= {c.step for c in cks if c.step % keep_every == 0}
    removed = []
    for c in cks:
        if c.step not in keep:
            remove_dir(c.path)
            removed.append(c.path)
    return removed


# ------------------------------------------------------------------------------------- saving


def newest_line(root: str) -> str:
    """Names the newest complete checkpoint under ``root`` (what --resume continues from), or says there is none."""
    cks = list_checkpoints(root)
    if not cks:
        return "no complete checkpoint exists yet"
    return f"the newest complete checkpoint {cks[-1].path} (step {cks[-1].step}) is intact: continue with --resume"


def save_failure(e: BaseException, final: str, root: str) -> tuple[str, str, str]:
    """The ``UserError`` arguments of a failed save: one line naming the checkpoint, the cause and the newest
    complete one."""
    what, fix = io_problem(e)
    return ("train.out_dir", f"saving checkpoint {final} failed: {what}; nothing of it is kept",
            f"{fix} (train.out_dir), lower train.keep_last or raise train.ckpt_every; {newest_line(root)}")


def store_layouts(store) -> dict[str, list]:
    return {g.name: [[leaf.path, list(leaf.shape), leaf.offset, leaf.size] for leaf in g.layout.leaves]
            for g in store}


@dataclasses.dataclass
class SaveStats:
    step: int
    path: str
    call_s: float = 0.0  # time save() kept the training loop waiting (a previous save still running)
    held_s: float = 0.0  # time the host-optimizer thread waited for this save before an update
    write_s: float = 0.0  # start of the save to commit
    nbytes: int = 0
    group_s: dict = dataclasses.field(default_factory=dict)  # per group: wait for update + write + crc

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class _Job:
    def __init__(self, step: int, count: int, final: str, tmp: str, meta: dict, pending: dict, order: list[str]):
        self.step, self.count, self.final, self.tmp, self.meta = step, count, final, tmp, meta
        self.pending, self.order = pending, order
        self.released = {name: threading.Event() for name in order}
        self.error: BaseException | None = None
        self.abandoned = False
        self.stats = SaveStats(step, final)
        self.thread: threading.Thread | None = None
        # set by the writer as its very last act. Waited on instead of Thread.join: a join that a signal
        # interrupts marks the thread as finished while it still runs (CPython's bpo-45274 handling), and
        # is_alive() then lies
        self.done = threading.Event()


class CheckpointSaver:
    """Background, group-by-group checkpoints of a ``StreamedTrainer``'s host store (see module doc); with
    ``files`` (``kind``: state.json's, ``write(directory)``: the run's files), in-line checkpoints of those."""

    def __init__(self, trainer, root: str, *, keep_last: int = 2, keep_every: int = 0, log: Log = print,
                 files: Any = None):
        self.trainer, self.root, self.log, self.files = trainer, os.path.abspath(root), log, files
        self.keep_last, self.keep_every = keep_last, keep_every
        self._job: _Job | None = None  # the save in flight (or finished but not yet waited for)
        self._active: _Job | None = None  # the save whose groups are still held
        self._crc_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-crc")
        self._ckptr = None
        self.kill_in_save: int | None = None  # fault injection (train.TrainHooks): SIGKILL mid-save of this step
        self.sigint_in_save: int | None = None  # fault injection: SIGINT to the main thread mid-save of this step
        self._ckptr_ready = threading.Thread(target=self._make_checkpointer, name="ckpt-init", daemon=True)
        if files is None:
            self._ckptr_ready.start()  # importing orbax takes a second: not while groups are held
        self.history: list[SaveStats] = []
        self.last_path: str | None = None
        # a sharded store (train.host_state=sharded) over several processes: each saves its own values
        self.shard = shards.shard_of_process() if files is None else (0, 1)
        self.sharded = files is None and getattr(trainer.store, "owned", None) is not None and self.shard[1] > 1
        self._shard_saved: int | None = None  # process p > 0: the step whose shard it wrote last (never written again)
        os.makedirs(root, exist_ok=True)
        for path in leftovers(root) if self.shard[0] == 0 else ():  # (process 0's to clean up)
            log(f"checkpoint: removing {path} (left by an interrupted save)")
            shutil.rmtree(path, ignore_errors=True)
        for path, why, aside in set_aside_incomplete(root) if self.shard[0] == 0 else ():
            log(f"checkpoint: {path} is corrupted or incomplete ({why}); moved it to {aside}")
        trainer.before_update = self._before_update

    def _own_dir(self, step_tmp: str) -> str:
        """Where this process writes a save: the step's directory, or its shard of it."""
        return shards.shard_dir(step_tmp, self.shard[0]) if self.sharded else step_tmp

    def _make_checkpointer(self) -> None:
        try:
            self._ckptr = checkpointer()
        except Exception:  # noqa: BLE001 - retried (and reported) by the first save
            self._ckptr = None

    # -- the engine's hook (host-optimizer thread)
    def _before_update(self, name: str, count: int) -> None:
        job = self._active
        if job is None or count <= job.count:
            return  # no save in flight, or the very update the save is waiting for
        ev = job.released.get(name)
        if ev is not None and not ev.is_set():
            t0 = time.perf_counter()
            ev.wait()
            job.stats.held_s += time.perf_counter() - t0

    # -- the training loop's side
    def save(self, step: int, meta: dict, *, wait: bool = False) -> str:
        """Start saving the state after loop step ``step``; returns the final directory.

        Call between steps. ``meta`` (JSON-able) goes to ``state.json``. With ``wait`` the call
        returns once the checkpoint is committed.
        """
        t0 = time.perf_counter()
        if wait and hasattr(self.trainer, "finish"):
            # the loop is paused anyway: apply the queued updates now (the engine otherwise paces
            # deferred gradient copies by the next step's forward, which is not coming). Before waiting for a
            # save still in flight: with device-side updates that save waits for these very updates (a save of
            # the last step, then the final one, hung here until the watchdog ended the run)
            self.trainer.finish()
        self.wait()
        final = os.path.join(self.root, step_dirname(step))
        if os.path.isdir(final) and checkpoint_problem(final) is not None and self.shard[0] == 0:
            # never taken for a save of this step: an incomplete one is set aside and the step written anew
            why, aside = checkpoint_problem(final), set_aside(final)
            self.log(f"checkpoint: {final} is corrupted or incomplete ({why}); moved it to {aside}; saving step "
                     f"{step} anew")
        if os.path.isdir(final) or self._shard_saved == step:  # this state is already saved, complete (a signal
            # right after a resume; sharded, process p > 0: its shard of this step is written, process 0 commits it)
            self.last_path = final
            return final
        tmp = final + ".tmp"
        shutil.rmtree(self._own_dir(tmp), ignore_errors=True)  # (sharded: only this process's shard)
        tr = self.trainer
        if self.files is not None:
            self._job = _Job(step, tr.count, final, tmp, meta, {}, [])
            self._write_files(self._job)
            if wait:
                self.wait()
            return final
        order = [g.name for g in tr.store]  # the order the forward fetches the groups
        # update K of each group, maybe still running (or, for device-side updates, not yet started)
        pending = tr.pending_updates() if hasattr(tr, "pending_updates") else {}
        job = _Job(step, tr.count, final, tmp, meta, pending, order)
        self._job = self._active = job
        job.thread = threading.Thread(target=self._write, args=(job,), name=f"ckpt-save-{step}", daemon=True)
        job.thread.start()
        job.stats.call_s = time.perf_counter() - t0
        if wait:
            self.wait()
        return final

    def wait(self) -> SaveStats | None:
        """Wait for the save in flight; raise ``UserError`` if it failed."""
        job = self._job
        if job is None:
            return None
        t0 = time.perf_counter()
        job.done.wait()  # a signal may interrupt it: the job stays in flight, for abandon() to give up
        if job.thread is not None:  # (a save of files ran in-line)
            job.thread.join()
        self._job = None
        job.stats.call_s += time.perf_counter() - t0
        if job.error is not None:
            raise UserError(*save_failure(job.error, job.final, self.root)) from job.error
        self.history.append(job.stats)
        self.last_path = job.final
        return job.stats

    @property
    def busy(self) -> bool:
        return self._job is not None and not self._job.done.is_set()

    def poll(self) -> SaveStats | None:
        """The stats of a background save that has finished since the last call (else ``None``);
        raises like ``wait`` if it failed."""
        if self._job is not None and self._job.done.is_set():
            return self.wait()
        return None

    def abandon(self) -> int | None:
        """Give up the save in flight (an abort): release every held group at once and make sure
        that save never commits (its ``.tmp`` is removed, or ignored by the next run). Returns the
        step of the save given up (None when none was in flight). ``settle()`` then waits for its
        writer to stop."""
        job = self._job
        step = None
        if job is not None:
            job.abandoned = True
            self._active = None
            for ev in job.released.values():
                ev.set()
            if not job.done.is_set():
                step = job.step
        if getattr(self.trainer, "before_update", None) == self._before_update:
            self.trainer.before_update = None
        return step

    def settle(self, timeout: float = 300.0) -> bool:
        """After ``abandon()`` (and once the trainer's queued updates have settled, which the writer
        may be waiting for): wait for the abandoned save's writer to notice and remove its ``.tmp``,
        so that no thread is writing, or asking orbax for more work, while the process exits. The
        writer stops at the next group (one group's write at most). True when it has stopped."""
        job = self._job
        done = job is None or job.done.wait(timeout)
        if done:
            self._job = None
            self._crc_pool.shutdown(wait=True)
        return done

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if getattr(self.trainer, "before_update", None) == self._before_update:
                self.trainer.before_update = None
            self._crc_pool.shutdown()

    def _write_files(self, job: _Job) -> None:
        """``files``' checkpoint, in-line: its files, state.json, then the manifest of their crc32; committed as a
        group save is (a failure is reported by ``wait``)."""
        t0 = time.perf_counter()
        try:
            os.makedirs(job.tmp)
            self.files.write(job.tmp)
            if self.kill_in_save == job.step:
                os.kill(os.getpid(), signal.SIGKILL)
            write_json(os.path.join(job.tmp, STATE), {"step": job.step, "count": job.count, "kind": self.files.kind,
                                                      **job.meta})
            names = manifest_files(job.tmp, MANIFEST)
            crcs = {f: file_crc(os.path.join(job.tmp, f)) for f in names}
            write_json(os.path.join(job.tmp, MANIFEST), {"files": crcs})
            os.replace(job.tmp, job.final)
            fsync_dir(self.root)
            prune(self.root, self.keep_last, self.keep_every)
            job.stats.nbytes = sum(os.path.getsize(os.path.join(job.final, f)) for f in names)
        except BaseException as e:  # noqa: BLE001 - reported by wait()
            job.error = e
            shutil.rmtree(job.tmp, ignore_errors=True)
        finally:
            job.stats.call_s = job.stats.write_s = time.perf_counter() - t0
            job.done.set()

    # -- the writer thread
    def _write(self, job: _Job) -> None:
        st = job.stats
        t_start = time.perf_counter()
        kill_step = self.kill_in_save
        try:
            self._ckptr_ready.join()
            if self._ckptr is None:
                self._ckptr = checkpointer()
            store, opt = self.trainer.store, self.trainer.opt
            base = self._own_dir(job.tmp)
            os.makedirs(os.path.join(base, "groups"))
            groups: dict[str, Any] = {}
            for name in job.order:
                if job.abandoned:
                    raise RuntimeError("abandoned")
                t0 = time.perf_counter()
                fut = job.pending.get(name)
                if fut is not None:
                    fut.result()  # update K of this group has been applied
                g = store[name]
                state_arrays = opt.state_to_arrays(g.opt_state) if g.opt_state is not None else {}
                opt_names = sorted(state_arrays)
                item = {"master": g.master}
                item.update({f"opt_{i}": np.asarray(state_arrays[k]) for i, k in enumerate(opt_names)})
                per_block = {k for k, a in item.items() if a.shape[0] != g.size}
                if self.sharded:  # this process's values only
                    item = shards.owned_slices(g, item, store.owned[name], store.align)
                crcs = self._crc_pool.submit(lambda it=item: {k: crc32(a) for k, a in it.items()})
                self._ckptr.save(os.path.join(base, "groups", name), item)
                crc = crcs.result()
                job.released[name].set()  # from here the next update may write this group
                groups[name] = {"arrays": {k: {"dtype": a.dtype.name, "shape": list(a.shape), "crc32": crc[k],
                                               **({"name": opt_names[int(k[4:])]} if k != "master" else {}),
                                               **({"per_block": True} if k in per_block else {})}
                                           for k, a in item.items()}}
                if self.sharded:
                    groups[name].update(range=list(store.owned[name]), size=g.size)
                st.nbytes += sum(a.nbytes for a in item.values())
                st.group_s[name] = time.perf_counter() - t0
                del item, state_arrays
                if kill_step is not None and int(kill_step) == job.step:
                    os.kill(os.getpid(), signal.SIGKILL)
                if self.sigint_in_save is not None and int(self.sigint_in_save) == job.step and name == job.order[0]:
                    from megatrain_jax.signals import interrupt_main_until

                    interrupt_main_until(lambda: job.abandoned)  # the save stays in flight until given up
            meta = dict(job.meta)
            meta.update(format=FORMAT, step=job.step, count=job.count, layouts=store_layouts(store),
                        optimizer=getattr(opt, "label", type(opt).__name__), saved_at=time.time())
            top = {"format": FORMAT, "step": job.step, "count": job.count, "groups": groups, "order": job.order,
                   "nbytes": st.nbytes}
            if self.sharded:  # this shard's manifest; process 0 commits once every shard has written its own
                write_json(os.path.join(base, MANIFEST), dict(top, shard=self.shard[0], shards=self.shard[1]))
                fsync_dir(base)
                if self.shard[0] != 0:
                    self._shard_saved = job.step
                    return
                top = {"format": FORMAT, "step": job.step, "count": job.count, "order": job.order,
                       "shards": self.shard[1], "nbytes": st.nbytes,
                       "shard_crc32": shards.wait_for_shards(job.tmp, self.shard[1], lambda: job.abandoned, MANIFEST)}
            state_bytes = write_json(os.path.join(job.tmp, STATE), meta)
            write_json(os.path.join(job.tmp, MANIFEST), dict(top, state_crc32=zlib.crc32(state_bytes)))
            fsync_dir(job.tmp)
            if job.abandoned:  # groups were released early: what was written may be torn
                raise RuntimeError("abandoned")
            os.replace(job.tmp, job.final)  # the commit
            fsync_dir(self.root)
            st.write_s = time.perf_counter() - t_start
            for path in prune(self.root, self.keep_last, self.keep_every):
                self.log(f"checkpoint: removed {path} (retention: keep_last={self.keep_last}, "
                         f"keep_every={self.keep_every})")
        except BaseException as e:  # noqa: BLE001 - reported by wait()
            job.error = e
            # (sharded: process 0 gives up the whole save; another process only its own shard)
            shutil.rmtree(job.tmp if self.shard[0] == 0 else self._own_dir(job.tmp), ignore_errors=True)
        finally:
            for ev in job.released.values():
                ev.set()  # never leave the training waiting on a failed save
            self._active = None
            job.done.set()

