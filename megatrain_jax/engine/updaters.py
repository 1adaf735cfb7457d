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
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np

from megatrain_jax.engine.adapters import UPDATE_ADAPTERS, AdapterUpdates
from megatrain_jax.engine.holds import HELD_ON_HOST, HostArray, HoldEnv, PageableHold, make_hold
from megatrain_jax.engine.kernels import F32, Kernels, local_shard
from megatrain_jax.engine.shards import Shards
from megatrain_jax.errors import UserError
from megatrain_jax.hoststore import HostStore
from megatrain_jax.optim.device_adamw import BLOCK
from megatrain_jax.optim.host import HostOptimizer
from megatrain_jax.placements import HOST_BF16, HOST_FP32, RESWEEP, STREAM_COPY_DEVICE, UPDATE_DEVICE, UPDATE_HOST
from megatrain_jax.plan.options import HOLD_COPIES_IN_FLIGHT, WRITEBACKS_IN_FLIGHT, EngineOptions
from megatrain_jax.transfer import Transfers


class Groups:
    """The store's groups by key (``EMBED``, block index, ``HEAD``), in the order a forward needs them."""

    def __init__(self, num_layers: int):
        self.names: dict[Any, str] = {EMBED: "embed", **{i: f"block_{i}" for i in range(num_layers)}, HEAD: "head"}
        self.order = list(self.names.values())  # forward order: deferred updates run in this order
        self.pos = {n: j for j, n in enumerate(self.order)}


EMBED, HEAD = "embed", "head"


class _Updates:
    """What both paths share: held gradients, the pending futures a fetch waits for, the step count."""

    on_device = False

    def __init__(self, store: HostStore, opt: HostOptimizer, xfer: Transfers, kernels: Kernels,
                 options: EngineOptions, groups: Groups, tracer: Any):
        self.store, self.opt, self.xfer, self.k, self.o, self.groups = store, opt, xfer, kernels, options, groups
        self.tracer = tracer
        # updates wait for the whole gradient when it must be clipped or checked for NaN first
        self.deferred = options.clip_norm is not None or options.skip_nonfinite or options.update_on == UPDATE_DEVICE
        self.count = 0  # optimizer steps taken
        self.pending: dict[str, Future] = {}  # per group: the host buffers are rewritten when this completes
        self.wait_s = 0.0  # time the dispatching thread spent waiting for updates
        self.update_error: BaseException | None = None  # the first update that raised
        # called on the updating thread as ``before_update(name, count)`` just before update ``count``
        # writes group ``name`` in place (a background checkpoint holds back writes it has not saved)
        self.before_update: Callable[[str, int], None] | None = None
        self._held: dict[str, Any] = {}  # deferred gradients waiting for the norm
        # the pinned gradient slabs: a fixed pool shared by every copy of a gradient to host memory
        self.slabs = threading.Semaphore(options.grad_slabs)
        self.placement = options.grad_hold_placement  # where deferred gradients wait (the name resolved once)
        # no hold: a second backward sweep once the norm is known (``send``); only where it is needed
        self.resweep = self.placement is RESWEEP and (options.clip_norm is not None or options.skip_nonfinite)
        # a resweep's first ``grad_hold_gpu_groups`` groups (embedding, block 0, ...: the backward's last) wait on
        # the GPU in bf16, and its second sweep stops above them (never the head: it is the second sweep's first)
        self.resweep_held = min(int(options.grad_hold_gpu_groups), len(groups.order) - 1) if self.resweep else 0
        # the hold's engine part (holds.HOLD_PARTS), where ``hold`` puts each deferred gradient
        self.held_in = make_hold(self.placement, HoldEnv(xfer, self.slabs, options.grad_slab_elems, kernels.to_bf16,
                                                         register=self.on_device, trace=self._trace)) \
            if self.deferred else None
        self.pageable = self.held_in if isinstance(self.held_in, PageableHold) else None  # (its buffers: tests)

    def register(self, g: Any) -> None:
        """Group ``g``'s host buffers that cross PCIe besides its streaming copy (none here)."""

    def reduce(self, name: str, g: jax.Array) -> jax.Array:
        """Group ``name``'s gradient from the devices' partial sums: summed over them, on every device."""
        return self.k.reduce(g) if self.k.reduce is not None else g

    def done(self, name: str) -> bool:
        fut = self.pending.get(name)
        return fut is None or fut.done()

    def _settle(self, names) -> None:
        """``finish``: wait for these groups' pending updates, in this order."""
        for name in list(names):
            fut = self.pending.pop(name, None)
            if fut is not None:
                fut.result()

    def wait(self, name: str) -> None:
        """Before a group's host buffers are read again: its pending update has written them."""
        fut = self.pending.pop(name, None)
        if fut is not None:
            self.issue_through(self.groups.pos[name])
            t0 = time.perf_counter()
            fut.result()
            self.wait_s += time.perf_counter() - t0

    def load(self, name: str) -> Any:
        """A queued device-side update of ``name`` put in flight, or None (none on this path)."""
        return None

    def issue_ahead(self, i: int) -> None:
        """The forward is at block ``i``: issue queued gradient copies a few groups ahead (none here)."""

    def issue_through(self, pos: int, wait: bool = True) -> None:
        """Issue queued gradient copies up to forward position ``pos`` (none here)."""

    def hold(self, name: str, grad: jax.Array) -> None:
        """A deferred gradient waits for the norm where its hold's engine part puts it (``held_in``; with a
        split hold the first ``grad_hold_gpu_groups`` groups of the forward stay on the GPU in bf16 instead).
        Host copies are issued here, before the next block's backward, which they then overlap. A
        numpy gradient (``stream_io``'s embedding and head) waits where it is."""
        pos = self.groups.pos[name]
        if self.resweep and pos >= self.resweep_held:
            return  # dropped: the second sweep recomputes it once the norm is known
        if isinstance(grad, np.ndarray):  # complete in host memory already (stream_io): it waits there
            grad = HostArray(grad, self.xfer)
        elif self.held_in.split and pos < self.o.grad_hold_gpu_groups:
            grad = self.k.to_bf16(grad)  # the norm was taken in fp32
        else:  # (a pageable buffer's last reader, a device-side update, goes first: ``after``)
            grad = self.held_in.put(name, grad, self.store[name].size, after=self.pending.get(name))
        self._held[name] = grad

    def _close_hold(self) -> None:
        if self.held_in is not None:
            self.held_in.close()

    def _trace(self, lane: str, label: str, arr: Any) -> None:
        if self.tracer is not None:
            self.tracer.watch(lane, label, arr)

    def pending_updates(self) -> dict[str, Future]:
        return dict(self.pending)

    def close(self) -> None:
        self.finish()


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


class HostUpdates(_Updates):
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

    def send(self, name: str, grad: jax.Array, scale: float = 1.0) -> None:
        """A gradient whose clip scale is known (unclipped, or the resweep's second sweep) goes to the
        host now, and its update starts as soon as it lands."""
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
        the GPU (10.5 GB; RESULTS.md s14)."""
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


# ------------------------------------------------------------------------------------------ device


@dataclass
class DeviceUpdate:
    """A group whose update runs on the device: its master and state in flight."""

    name: str
    param: jax.Array
    grad: jax.Array
    state: dict
    host_state: dict  # the host arrays the new state is written back into
    scalars: tuple
    count: int


class DeviceUpdates(_Updates):
    """``update_on=device``: each group's update is applied on the accelerator when the next forward
    fetches it (``optim/device_adamw.py``); the new master and state go back straight into the host
    store on a write-back thread while the block computes. Updates are always deferred."""

    on_device = True

    def __init__(self, *args: Any):
        super().__init__(*args)
        if not getattr(self.opt, "runs_on_device", False):
            raise UserError("train.update_on",
                            f"{UPDATE_DEVICE} needs an optimizer that runs there, not {type(self.opt).__name__}",
                            f"use a FusedAdamW or an optax optimizer (or train.update_on={UPDATE_HOST})")
        if any(g.stream_bits is not None for g in self.store):
            raise ValueError(f"update_on={UPDATE_DEVICE} needs a store without a bf16 streaming copy "
                             f"(train.stream_copy={STREAM_COPY_DEVICE}, or float32 compute)")
        self._queued: dict[str, tuple[Any, float, int]] = {}  # per group: (gradient, clip scale, count)
        self._done: dict[str, Future] = {}  # per group: its queued update is in the store
        self._resident: dict[str, jax.Array] = {}  # current weights already on the device
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="d2h-writeback")
        self._writing: deque[Future] = deque()  # write-backs in flight, oldest first (WRITEBACKS_IN_FLIGHT)
        self._host = ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-optim")  # stream_io's groups
        # several GPUs: each updates its share of every group (shards.py) where the update is elementwise; an
        # update over whole tensors (optax) runs on every GPU alike, and one GPU's result goes back to the host
        self.shards = self._shards() if self.k.num_devices > 1 and getattr(self.opt, "shards_on_device", False) \
            else None
        if self.k.num_devices > 1 and jax.process_count() > 1:
            raise UserError("train.update_on", f"{UPDATE_DEVICE} with several processes is not built yet (each "
                            "would write its GPUs' results into its own replica of the host store)",
                            f"set train.update_on={UPDATE_HOST} (or auto)")

    def _shards(self) -> Shards:
        if self.placement in (HOST_FP32, HOST_BF16):
            raise UserError("train.grad_hold", f"{self.placement.name} keeps whole gradients in pageable host "
                            f"memory, and with several GPUs updating on the device each holds only its share",
                            "set train.grad_hold to gpu_bf16, pinned_bf16 or resweep (or auto)")
        device_kind = self.xfer.device_sharding.memory_kind
        host_kind = "pinned_host" if self.xfer.host_shardings else None
        return Shards(self.k.mesh, BLOCK, device_kind, host_kind, direct_into=self.xfer.direct_into)

    def reduce(self, name: str, g: jax.Array) -> jax.Array:
        """Several GPUs: reduce-scattered, each GPU receiving the sum of its share only (its update's input)."""
        if self.shards is None:
            return super().reduce(name, g)
        return self.k.reduce_scatter(g, self.shards.padded(self.store[name].size))

    def register(self, g: Any) -> None:
        for k, a in self.opt.state_to_arrays(g.opt_state).items():  # the optimizer state crosses PCIe too
            self.xfer.register(f"{g.name}/{k}", a)

    def gradient(self, name: str, grad: jax.Array) -> None:
        if self.placement is RESWEEP and not self.resweep:
            return self.send(name, grad)  # no norm to wait for: updated now, nothing held
        self.hold(name, grad)

    def send(self, name: str, grad: jax.Array, scale: float = 1.0) -> None:
        """The resweep's second sweep: the update runs now, on the device, with the clip scale known
        (the next forward then fetches the updated weights from the host store)."""
        if name == HEAD:
            self.count += 1
        if isinstance(grad, np.ndarray):  # complete in host memory (stream_io): updated there
            self.pending[name] = self._host.submit(self._host_update, name, HostArray(grad, self.xfer), scale,
                                                   self.count)
            return
        self._queued[name] = (grad, scale, self.count)
        self._done[name] = Future()
        self.dispatch(self.load(name))

    def apply(self, scale: float | None, resident: dict[str, jax.Array]) -> None:
        """Queue each group's update, applied when the next forward fetches the group. The current
        weights of the groups needed first and last are on the device already: their updates start
        from these instead of crossing PCIe again (the step's first transfers are exposed)."""
        held, self._held = self._held, {}
        if scale is None or not held:
            return
        if not self.resweep:  # (a resweep's second sweep counted the step as it sent the head)
            self.count += 1
        for name in [n for n in self.groups.order if n in held]:  # (a resweep holds only its first groups)
            grad = held.pop(name)
            if isinstance(grad, HostArray):  # complete in host memory (stream_io): updated there, now
                self.pending[name] = self._host.submit(self._host_update, name, grad, scale, self.count)
                continue
            self._queued[name] = (grad, scale, self.count)
            self._done[name] = Future()  # set once this update is back in the host store
        self._resident = dict(resident)

    def _host_update(self, name: str, grad: HostArray, scale: float, count: int) -> None:
        """On the host-optimizer thread: a group whose gradient is in host memory, updated in place by the
        optimizer's host kernel (the same step as its device one: tests compare both with the reference)."""
        g = self.store[name]
        if self.before_update is not None:
            self.before_update(name, count)
        t0 = time.perf_counter()
        self.opt.update(g.master, grad.read(0, g.size), g.opt_state, count, scale, g.stream_bits, g.layout.unflatten)
        self.xfer.host_written(name, g.stream_view())
        if self.tracer is not None:
            self.tracer.interval("optimizer", name, t0, time.perf_counter())

    def load(self, name: str) -> DeviceUpdate | None:
        """Put the group's fp32 master and optimizer state in flight to the device; the update itself
        is dispatched by ``dispatch`` when the weights are first used (dispatched now it would run
        before the block being computed, and hold it back until this transfer lands)."""
        pend = self._queued.pop(name, None)
        if pend is None:
            return None
        grad, scale, count = pend
        g = self.store[name]
        host_state = self.opt.state_to_arrays(g.opt_state)
        p = self._resident.pop(name, None)
        fetched = p is None
        if isinstance(grad, HELD_ON_HOST):
            grad = grad.to_device()
        if self.shards is not None:  # each GPU its share, over its own link
            sh, total = self.shards, self.shards.padded(g.size)
            p = sh.to_device(g.master, total) if fetched else sh.shard(p, total)
            state = {k: sh.to_device(a, sh.padded_like(a.shape[0], g.size)) for k, a in host_state.items()}
            grad = sh.shard(grad, total)
        else:
            if fetched:
                p = self.xfer.to_device(name, g.master)
            state = {k: self.xfer.to_device(f"{name}/{k}", a) for k, a in host_state.items()}
        if fetched:
            self._trace("h2d", name, p)
        return DeviceUpdate(name, p, grad, state, host_state, self.opt.device_scalars(count, scale), count)

    def dispatch(self, u: DeviceUpdate) -> jax.Array:
        """Dispatch the update (the new master is the weights the block uses) and queue its write-back."""
        g = self.store[u.name]
        if self.shards is None:
            p_new, state = self.opt.device_step(u.param, u.grad, u.state, u.scalars, self.o.device_update_chunk,
                                                unflatten=g.layout.unflatten)  # the group's tree (optax: shapes)
            w = p_new
        else:  # each GPU updates its share; the block computes with the whole, gathered over NVLink
            p_new, state = self.opt.device_step(u.param, u.grad, u.state, u.scalars, self.o.device_update_chunk,
                                                mesh=self.k.mesh)
            w = self.shards.gather(p_new, g.size)
        self._trace("compute", f"update {u.name}", p_new)  # runs on the compute stream
        targets = [(u.name, p_new, g.master)] + [(f"{u.name}/{k}", state[k], u.host_state[k]) for k in u.host_state]
        self.pending[u.name] = fut = self._writer.submit(self._write_back, u.name, u.count, targets,
                                                         self._done.pop(u.name, None))
        self._writing.append(fut)
        while len(self._writing) > WRITEBACKS_IN_FLIGHT:  # the updated blocks the GPU holds: what the plan counts
            t0 = time.perf_counter()
            self._writing.popleft().result()
            self.wait_s += time.perf_counter() - t0
        return w

    def queued(self) -> list[str]:
        """Groups whose update is queued and not yet applied."""
        return list(self._queued)

    def _write_back(self, name: str, count: int, targets: list[tuple[str, jax.Array, np.ndarray]],
                    done: Future | None) -> None:
        """On the write-back thread: the updated master and state into the host store, in place;
        then ``done`` (the future a background checkpoint may wait on) completes."""
        try:
            if self.before_update is not None:
                self.before_update(name, count)
            t0 = time.perf_counter()
            for buf_name, x, dst in targets:
                if self.shards is not None:
                    self.shards.copy_into(x, dst)
                else:  # (several GPUs updating alike: the group's own GPU's copy, spreading the links' load)
                    self.xfer.copy_into(local_shard(x, self.groups.pos[name]), dst)
                self.xfer.host_written(buf_name, dst)
            if self.tracer is not None:
                self.tracer.interval("d2h", f"{name} state", t0, time.perf_counter())
        except BaseException as e:
            if done is not None:
                done.set_exception(e)
            raise
        if done is not None:
            done.set_result(None)

    def pending_updates(self) -> dict[str, Future]:
        """Per group, a future that completes once the update queued last is in the host store (a
        background checkpoint waits for these): write-backs in flight, and updates not yet applied."""
        return {**self.pending, **self._done}

    def finish(self) -> None:
        """Apply the queued updates now (in forward order), then wait for every write-back."""
        for name in self.groups.order:
            if name in self._queued:
                self.wait(name)
                self.dispatch(self.load(name))
        self._settle(self.groups.order)
        self._settle(self.pending)

    def close(self) -> None:
        self.finish()
        self._close_hold()
        self._writer.shutdown()
        self._host.shutdown()


def make_updates(store: HostStore, opt: HostOptimizer, xfer: Transfers, kernels: Kernels, options: EngineOptions,
                 groups: Groups, tracer: Any) -> _Updates:
    """The update path the options ask for."""
    return UPDATERS[options.update_on](store, opt, xfer, kernels, options, groups, tracer)


UPDATERS = {UPDATE_HOST: HostUpdates, UPDATE_DEVICE: DeviceUpdates,  # each update placement's engine part
            UPDATE_ADAPTERS: AdapterUpdates}  # (the LoRA variant's: engine/lora.py picks it; no config names it)
