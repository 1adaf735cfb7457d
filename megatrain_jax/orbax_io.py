"""The orbax glue of ``checkpoint.py``: a synchronous PyTree checkpointer that does not copy the
arrays it saves, and the restore of one array of a group. Imports orbax and jax only when called."""
from __future__ import annotations

import os

import numpy as np


class _QuietFailedSaves:
    """A logging filter: orbax logs a failed write (a full disk, a read-only folder) from each of its threads as
    an ERROR with a traceback before raising it; ``checkpoint.py`` reports that failure itself, as one line
    naming the checkpoint, so these records are dropped. Every other record passes."""

    def filter(self, record) -> bool:
        if "orbax" not in (record.pathname or ""):
            return True
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a record that cannot be formatted is left to its handler
            return True
        return not ("raised an exception" in msg or "Event loop is closed" in msg)


def quiet_failed_saves() -> None:
    """Install ``_QuietFailedSaves`` on the loggers orbax writes through (once)."""
    import logging

    for name in ("absl", ""):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _QuietFailedSaves) for f in logger.filters):
            logger.addFilter(_QuietFailedSaves())


def checkpointer():
    """A synchronous orbax PyTree checkpointer whose numpy handler does not copy its inputs.

    orbax's default numpy handler deep-copies every array in ``save`` (so that the caller may
    mutate it once an async save has returned): for a whole model that is the second full copy we
    must avoid. Without the copy the arrays must stay untouched until ``save`` returns, which is
    exactly what the per-group hold guarantees. Compression is off: weights barely compress and
    zstd would compete with training for the CPU.

    Public: checkpoint.py saves and loads with it, and ``hf export`` reads a checkpoint through it."""
    import jax
    import orbax.checkpoint as ocp

    import inspect

    quiet_failed_saves()

    th = ocp.type_handlers
    # older orbax releases (the GPU image's, for one) have no such switch and copy the group being
    # saved: one group at a time, so the extra memory is one group's, never the model's
    numpy_kwargs = {"deepcopy_host_arrays": False} \
        if "deepcopy_host_arrays" in inspect.signature(th.NumpyHandler.__init__).parameters else {}
    registry = th.create_type_handler_registry(
        (np.ndarray, th.NumpyHandler(**numpy_kwargs)),
        (jax.Array, th.ArrayHandler()),
    )
    handler_kwargs = dict(use_ocdbt=True, use_zarr3=True, type_handler_registry=registry)
    params = inspect.signature(ocp.PyTreeCheckpointHandler.__init__).parameters
    if "use_compression" in params:
        handler_kwargs["use_compression"] = False
    # each process reads and writes host-store groups (numpy, its own replica) alone: in a
    # multi-process run only process 0 saves, and orbax's default cross-process barriers would wait
    # for the others forever
    me = jax.process_index()
    as_me = 0 if me else me  # (process p > 0 saves as process 0: _AsProcessZero)
    alone = ocp.options.MultiprocessingOptions(primary_host=as_me, active_processes={as_me},
                                               barrier_sync_key_prefix=f"megatrain_p{me}")
    if "multiprocessing_options" in params:
        handler_kwargs["multiprocessing_options"] = alone
    handler = ocp.PyTreeCheckpointHandler(**handler_kwargs)
    ckptr = ocp.Checkpointer(handler, multiprocessing_options=alone)
    return ckptr if me == 0 else _AsProcessZero(ckptr)


class _AsProcessZero:
    """A checkpointer for process p > 0 of a sharded store (``checkpoint_shards.py``), which saves its own values.
    orbax's numpy handler writes only where ``process_index() == 0`` (it takes numpy arrays to be replicas): during
    this process's saves, into its own directory, orbax is told it is process 0. Only the checkpoint writer's thread
    calls orbax while training runs, one save at a time."""

    def __init__(self, ckptr):
        self._ckptr = ckptr

    def save(self, *args, **kwargs):
        return self._as_zero(self._ckptr.save, *args, **kwargs)

    def restore(self, *args, **kwargs):
        return self._as_zero(self._ckptr.restore, *args, **kwargs)

    @staticmethod
    def _as_zero(fn, *args, **kwargs):
        from orbax.checkpoint._src.multihost import multihost

        real = multihost.process_index
        multihost.process_index = lambda: 0
        try:
            return fn(*args, **kwargs)
        finally:
            multihost.process_index = real

    def __getattr__(self, name):
        return getattr(self._ckptr, name)


def restore_array(ckptr, path: str, key: str) -> np.ndarray:
    """One array of a group's orbax item (partial restore: peak memory is one array).
    Public: checkpoint.py reads each group array through it."""
    import orbax.checkpoint as ocp

    args = ocp.args.PyTreeRestore(item={key: 0}, restore_args={key: ocp.RestoreArgs(restore_type=np.ndarray)},
                                  partial_restore=True)
    return np.asarray(ckptr.restore(os.path.abspath(path), args=args)[key])
