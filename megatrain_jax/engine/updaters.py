"""Where each group's optimizer step runs: one class per update path, chosen once from the options.

- ``HostUpdates``: the gradient goes to host memory in pinned slabs, and the host optimizer thread
  updates the group in place slab by slab as each lands (``update_on=host``).
- ``DeviceUpdates``: the group's fp32 master and optimizer state cross PCIe instead, the update runs on
  the accelerator when the next forward fetches the group, and a write-back thread puts the new
  state straight into the host store (``update_on=device``). A gradient that is complete in host
  memory already (``stream_io``'s embedding and head) is applied there by the host kernel instead:
  those groups never sit on the accelerator, and crossing PCIe twice would only add traffic.

Without clipping (or the NaN check) a host update starts as soon as its group's gradient lands. With
them every update waits for the step's norm: the gradients are *held* (fp32 or bf16 on the device, in
pinned or pageable host memory: ``grad_hold``'s part in ``holds.py``) and queued in forward order after the step,
so the next step's forward waits for each group's update only when it needs that group. With
``grad_hold=resweep`` nothing is held: the step runs a second backward sweep once the norm is known and
hands each gradient over with its clip scale (``send``), as an unclipped step does.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from megatrain_jax.engine.device_updates import DeviceUpdate, DeviceUpdates  # noqa: F401 (the device path)
from megatrain_jax.engine.holds import HELD_ON_HOST, HostArray
from megatrain_jax.engine.kernels import F32, Kernels, local_shard
from megatrain_jax.engine.updates_base import EMBED, HEAD, Groups, Updates  # noqa: F401 (the paths' common part)
from megatrain_jax.hoststore import HostStore
from megatrain_jax.optim.host import HostOptimizer
from megatrain_jax.placements import DEVICE_UPDATE, HOST_UPDATE
from megatrain_jax.bounds import HOLD_COPIES_IN_FLIGHT
from megatrain_jax.plan.options import EngineOptions
from megatrain_jax.transfer import Transfers


# ------------------------------------------------------------------------------------------ host


class GradOut:
    """A group's gradient on its way to host memory, in slabs.

    The gradient leaves the device in chunks of at most ``grad_slab_elems`` values; each chunk lands
    in its own pinned buffer, and at most ``grad_slabs`` such buffers exist at once (a semaphore that
    the optimizer releases as it finishes each chunk): the pinned pool stays at a fixed size however
    large the model, and a chunk's transfer overlaps the update of the one before it (MegaTrain's
    gradient slabs). XLA's pinned-host pool is a BFC allocator, so equal-sized chunks reuse the same
    memory step after step.

    GPU->host copies overlap compute only when issued *before* the compute they should hide behind,
    so the dispatching thread issues each copy at the right point of the step. The optimizer thread
    waits for that, and issues the copies itself if nobody has within a short time, so a waiting
    reader can never deadlock (copies are issued and updates applied in one FIFO order, so the slabs a
    copy waits for are always released next).
    """

    def __init__(self, grad: Any, chunks: list[tuple[int, int]], on_host: bool = False):
        self.grad = grad  # device array (fp32/bf16), or a gradient held in host memory when on_host (holds.py)
        self.chunks = chunks
        self.on_host = on_host
        self.host: list[Any] = [None] * len(chunks)
        self.issued = len(chunks) if on_host else 0  # chunks issued so far
        self.failed = False  # its update raised: no more slabs are taken for it, and its slabs are returned
        self._lock = threading.Lock()
        self._events = [threading.Event() for _ in chunks]
        if on_host:  # already in host memory: nothing to issue
            for e in self._events:
                e.set()

    def issue_next(self, up: "HostUpdates", wait: bool = True) -> bool:
        """Issue the next chunk's copy; False (nothing issued) when no slab is free and not ``wait``."""
        j = self.issued
        lo, hi = self.chunks[j]
        if self.on_host or self.failed:
            self.host[j] = None  # read from the held pinned array itself (or nobody will read it)
        else:
            if not wait:
                if not up.slabs.acquire(blocking=False):
                    return False
            else:
                # a slab frees when the optimizer thread finishes a chunk; if an update has failed, the
                # slabs it would have freed may never come back: surface its error instead of waiting
                while not up.slabs.acquire(timeout=0.05):
                    if up.update_error is not None:
                        raise up.update_error
            g = local_shard(self.grad, j)  # one device's copy of the (replicated) gradient
            piece = g if (len(self.chunks) == 1 and g.dtype == F32) else up.k.chunk(g, lo, hi - lo)
            arr = up.xfer.to_host(piece)
            with self._lock:
                if self.failed:
                    up.slabs.release()
                else:
                    self.host[j] = arr
        self.issued += 1
        if self.issued == len(self.chunks) and not self.on_host:
            self.grad = None  # the device copy is freed once its transfers are done
        self._events[j].set()
        return True

    def chunk(self, j: int, up: "HostUpdates") -> np.ndarray:
        """Chunk ``j`` as a host numpy array; waits until it has landed."""
        while not self._events[j].wait(timeout=up.issue_wait_s):
            up.issue_for(self, j)
        if self.on_host:  # a bf16 hold's bits where the optimizer's kernel widens as it reads
            return self.grad.read(*self.chunks[j], bits=up.bf16_grads)
        return up.xfer.host_view(self.host[j])

    def release(self, j: int, up: "HostUpdates") -> None:
        with self._lock:
            if not self.on_host and self.host[j] is not None:
                self.host[j] = None
                up.slabs.release()

    def fail(self, up: "HostUpdates") -> None:
        """The update raised: give every slab back, so the dispatching thread never waits for one
        that nobody will release (the error then surfaces where the update is waited for)."""
        with self._lock:
            self.failed = True
            for j, arr in enumerate(self.host):
                if arr is not None and not self.on_host:
                    self.host[j] = None
                    up.slabs.release()


class HostUpdates(Updates):
    """Gradients to host memory in slabs; the host optimizer thread updates each group in place."""

    LOOKAHEAD = 3  # during a forward, deferred gradient copies run this many blocks ahead of it

    def __init__(self, *args: Any):
        super().__init__(*args)
        # how long the optimizer thread waits for the dispatching thread to issue a gradient copy
        # before issuing it itself: on a GPU a copy issued late queues behind the compute already
        # dispatched, so the dispatcher should issue it; the CPU backend has no such queue
        self.issue_wait_s = 0.2 if self.xfer.on_gpu else 0.02
        self.bf16_grads = bool(getattr(self.opt, "bf16_grads", False))  # it reads a bf16 hold's bits as they are
        # gradient slabs: chunk size (aligned as the optimizer's state needs) and the pool's size
        align, n = getattr(self.opt, "chunk_align", None), self.o.grad_slab_elems
        self.slab = None if (n is None or align is None) else max(align, n // align * align)
        self._queue: list[tuple[str, GradOut]] = []  # gradients not yet sent to the host
        self._copy_lock = threading.RLock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-optim")
        self._num_layers = len(self.groups.order) - 2

    # ---- the step's calls

    def issue_ahead(self, i: int) -> None:
        """Before each micro-batch's compute in the forward: copies issued here overlap it, and the
        host optimizer gets slabs back to work on several times per block."""
        j = i + self.LOOKAHEAD
        self.issue_through(j + 1 if j < self._num_layers else len(self.groups.order), wait=False)

    def gradient(self, name: str, grad: jax.Array) -> None:
        """Group ``name``'s gradient is complete (summed over the devices): held, or sent now."""
        if self.deferred:
            return self.hold(name, grad)
        self.send(name, grad)

    def send(self, name: str, grad: jax.Array, scale: float = 1.0, current: jax.Array | None = None) -> None:
        """A gradient whose clip scale is known (unclipped, or the resweep's second sweep) goes to the
        host now, and its update starts as soon as it lands (``current``, the weights on the device: unused,
        the host updates its own master)."""
        if name == HEAD:  # first gradient of the step: the step counts from here
            self.count += 1
        out = self.grad_out(name, grad)
        with self._copy_lock:
            self._queue.append((name, out))
        self._submit(name, out, scale)  # first: its progress frees the slabs the copies below wait for
        self.issue_through(self.groups.pos[name], wait=False)  # before the next block's backward: they overlap
        self._bound_waiting()

    def _bound_waiting(self) -> None:
        """At most HOLD_COPIES_IN_FLIGHT gradients sent during a backward wait on the device for their copies
        (the plan counts that many): beyond, the dispatching thread issues the oldest's copies as slabs free.
        Unbounded, a resweep's second sweep ran ahead of the slabs and kept 26 of the 3B's 28 block gradients on
        the GPU (10.5 GB; experiments/bench_memory_plan.py)."""
        with self._copy_lock:
            while sum(1 for _, o in self._queue if not o.on_host) > HOLD_COPIES_IN_FLIGHT:
                self._issue_oldest(wait=True)

    def apply(self, scale: float | None, resident: dict[str, jax.Array]) -> None:
        """After the norm: the held updates queued in forward order (their copies are issued during
        the next forward); ``scale`` None drops them (a skipped step). Nothing held: nothing to do."""
        held, self._held = self._held, {}
        if scale is None or not held:
            return
        if not self.resweep:  # (a resweep's second sweep counted the step as it sent the head)
            self.count += 1
        for name in [n for n in self.groups.order if n in held]:  # (a resweep holds only its first groups)
            out = self.grad_out(name, held.pop(name))
            if not out.on_host:
                self._queue.append((name, out))
            self._submit(name, out, scale)
        self.issue_ahead(-1)

    def _start_on_host(self, name: str, grad: HostArray, scale: float, count: int) -> None:
        self.pending[name] = self._pool.submit(self._update, name, self.grad_out(name, grad), scale, count)

    def grad_out(self, name: str, grad: Any) -> GradOut:
        n = self.store[name].size
        step = self.slab or n
        chunks = [(lo, min(lo + step, n)) for lo in range(0, n, step)] or [(0, 0)]
        if isinstance(grad, np.ndarray):
            grad = HostArray(grad, self.xfer)
        return GradOut(grad, chunks, on_host=isinstance(grad, HELD_ON_HOST))

    # ---- gradient copies

    def issue_through(self, pos: int, wait: bool = True) -> None:
        """Issue the queued gradient copies, chunk by chunk in forward order, up to position ``pos``.

        ``wait=False`` (the sweeps, before dispatching compute): issue only as many chunks as there
        are free slabs and leave the rest queued, so the accelerator's queue never runs dry while
        the dispatching thread waits for the host optimizer; the next call, or the optimizer thread
        itself, issues the rest. ``wait=True`` (about to wait for an update anyway): all of them.
        """
        order = self.groups.pos
        with self._copy_lock:
            while self._queue and order[self._queue[0][0]] <= pos:
                if not self._issue_oldest(wait):
                    return

    def _issue_oldest(self, wait: bool) -> bool:
        """The oldest queued gradient's remaining copies, then off the queue (the copy lock held); False
        when a slab was not free and not ``wait`` (the rest stays queued)."""
        name, out = self._queue[0]
        while out.issued < len(out.chunks):
            if not out.issue_next(self, wait):
                return False
            self._trace("d2h", name, out.host[out.issued - 1])
        self._queue.pop(0)
        return True

    def issue_for(self, out: GradOut, j: int) -> None:
        """The optimizer thread needs chunk ``j`` of ``out`` and nobody has issued it: issue the
        queue in order up to it (FIFO order keeps the slab pool deadlock-free).

        Never blocks on the copy lock: whoever holds it is issuing the same queue in the same
        order, and may be waiting for a slab that only this thread can free (a chunk it already
        issued past ``j``); the caller waits for chunk ``j``'s event and tries again.
        """
        if not self._copy_lock.acquire(blocking=False):
            return
        try:
            while out.issued <= j and self._queue:
                head = self._queue[0][1]
                head.issue_next(self)
                if head.issued == len(head.chunks):
                    self._queue.pop(0)
        finally:
            self._copy_lock.release()

    # ---- the optimizer thread

    def _submit(self, name: str, out: GradOut, scale: float) -> None:
        self.pending[name] = self._pool.submit(self._update, name, out, scale, self.count)

    def _update(self, name: str, out: GradOut, scale: float, count: int) -> None:
        """Runs on the host optimizer thread: updates the group in place, slab by slab, each as
        soon as it has landed (zero-copy views of the pinned buffers)."""
        try:
            self._update_slabs(name, out, scale, count)
        except BaseException as e:
            out.fail(self)
            self.update_error = e
            raise

    def _update_slabs(self, name: str, out: GradOut, scale: float, count: int) -> None:
        g = self.store[name]
        t0 = None
        whole = len(out.chunks) == 1
        kept = self.kept(name)
        for j, (lo, hi) in enumerate(out.chunks):
            host_grad = out.chunk(j, self)  # waits until it has landed
            if j == 0:
                if self.before_update is not None:
                    self.before_update(name, count)
                t0 = time.perf_counter()
            if whole:
                self.opt.update(g.master, host_grad, g.opt_state, count, scale, g.stream_bits, g.layout.unflatten)
            else:
                bits = None if g.stream_bits is None else g.stream_bits[lo:hi]
                self.opt.update(g.master[lo:hi], host_grad, self.opt.state_slice(g.opt_state, lo, hi), count, scale,
                                bits)
            out.release(j, self)
        self.put_back(name, kept)
        self.xfer.host_written(name, g.stream_view())
        if self.tracer is not None and t0 is not None:
            self.tracer.interval("optimizer", name, t0, time.perf_counter())

    def finish(self) -> None:
        """Wait for every queued update (before reading, saving or exporting the weights).

        Deferred gradient copies are issued a few groups ahead of the update being waited for,
        never all at once: pinned host memory for a whole model's gradients may not exist.
        """
        last = len(self.groups.order) - 1
        for j, name in enumerate(self.groups.order):
            self.issue_through(min(j + self.LOOKAHEAD, last))
            self._settle([name])
        self._settle(self.pending)

    def close(self) -> None:
        self.finish()
        self._close_hold()
        self._pool.shutdown()


def make_updates(store: HostStore, opt: HostOptimizer, xfer: Transfers, kernels: Kernels, options: EngineOptions,
                 groups: Groups, tracer: Any) -> Updates:
    """The update path the options ask for."""
    return UPDATERS[options.update_place](store, opt, xfer, kernels, options, groups, tracer)


UPDATERS = {HOST_UPDATE: HostUpdates, DEVICE_UPDATE: DeviceUpdates}  # each update placement's engine part (the
#                                                                       LoRA variant's, AdapterUpdates: engine/lora.py)
