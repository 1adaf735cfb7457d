"""Where a deferred gradient waits for the step's clipping norm: each hold's engine part (``HOLD_PARTS``).

Every gradient hold of ``placements`` has one part here, keyed by its ``GradHold`` object, that the updater
builds once and hands each deferred gradient to (``put``):

- ``GpuHold`` (``gpu_fp32`` / ``gpu_bf16``): the gradient waits on the GPU where it is (``gpu_bf16``: cast first).
- ``NoHold`` (``resweep``): nothing waits; the step's second sweep makes the gradients again.
- ``PinnedHold`` (``grad_hold=pinned_host`` / ``pinned_bf16``): the whole group in one pinned host array
  (XLA's pinned pool, where parked activations live too: the backward's gradients land where the inputs it
  has consumed were). ``pinned_bf16`` casts on the GPU first (the norm was taken in fp32): half the pool.
- ``PageableHold`` (``grad_hold=host_fp32`` / ``host_bf16``): ordinary (pageable) host memory, one
  buffer per group allocated once and reused every step. The gradient leaves the GPU through the
  pinned gradient slabs (the fixed pool the host updates use: ``grad_slabs`` buffers of at most
  ``grad_slab_elems`` values); a copier thread moves each landed slab into the group's buffer and
  releases the slab at once, so pinned memory never grows with the model. ``host_bf16`` casts on the
  GPU first (the norm was taken in fp32): half the PCIe bytes and half the host bytes.

The host holds' gradients (``PinnedHeld``, ``PageableHeld``) give the updater the same two calls: ``read``
(fp32 values, for a host update) and ``to_device`` (for a device-side update). With ``grad_hold_gpu_groups``
a host hold's (or a resweep's) first groups wait on the GPU in bf16 instead (the parts' ``split``).
"""
from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.engine.kernels import NO_AUTOTUNE, grad_to_bf16, local_shard, named
from megatrain_jax.optim.host import alloc_aligned
from megatrain_jax.placements import (GPU_BF16, GPU_FP32, GRAD_HOLD_LIST, HOST_BF16, HOST_FP32, PINNED_BF16,
                                      PINNED_HOST, RESWEEP, GradHold)
from megatrain_jax.bounds import HOLD_COPIES_IN_FLIGHT
from megatrain_jax.transfer import Transfers

# host copies of a slab (its landing in the pageable buffer, bf16 widened to fp32 for the update) split over
# threads: numpy's copies release the GIL, and one thread moved ~4 GB/s, which made an 8B step's 16 GB of
# bf16 gradients seconds of serial work (bench_gpu_budgets.py: the 24 GB budget ran at 0.42x)
_COPY_THREADS = max(1, min(8, (os.cpu_count() or 1) // 2))
_COPIERS = ThreadPoolExecutor(max_workers=_COPY_THREADS, thread_name_prefix="hold-copy")
_SPLIT_ABOVE = 1 << 22  # values: smaller slices are copied by the calling thread


def _copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    parallel(lambda a, b: np.copyto(dst[a:b], src[a:b]), len(dst))


def parallel(fn: Callable[[int, int], Any], n: int) -> None:
    """``fn(lo, hi)`` over ``n`` values in pieces, on the copier threads (here when small)."""
    if n <= _SPLIT_ABOVE or _COPY_THREADS == 1:
        fn(0, n)
        return
    step = -(-n // _COPY_THREADS)
    for f in [_COPIERS.submit(fn, lo, min(lo + step, n)) for lo in range(0, n, step)]:
        f.result()


def widen_bf16(part: np.ndarray, out: np.ndarray) -> np.ndarray:
    """bf16 values as fp32 into ``out`` (exact: the bf16 bits are the fp32's top half), over the copier threads."""
    src, dst = part.view(np.uint16), out.view(np.uint32)
    parallel(lambda a, b: np.left_shift(src[a:b], 16, out=dst[a:b], dtype=np.uint32), len(part))
    return out


class Scratch:
    """One fp32 buffer that widened bf16 reads land in, reused by the next read (one reader: the host
    optimizer thread reads a chunk, updates with it, then reads the next)."""

    def __init__(self):
        self._buf: np.ndarray | None = None

    def __call__(self, n: int) -> np.ndarray:
        if self._buf is None or self._buf.size < n:
            self._buf = np.empty(n, np.float32)
        return self._buf[:n]


class PinnedHeld:
    """A group's gradient held in one pinned host array (``grad_hold=pinned_host``; ``pinned_bf16``: a bf16
    array, widened on reading into ``scratch``)."""

    def __init__(self, arr: jax.Array, xfer: Transfers, scratch: Scratch | None = None):
        self.arr, self.xfer, self.scratch = arr, xfer, scratch

    def read(self, lo: int, hi: int, bits: bool = False) -> np.ndarray:
        """Values ``lo:hi`` as fp32; with ``bits`` a bf16 array's as its uint16 bits (for a kernel that widens
        as it reads: ``HostOptimizer.bf16_grads``)."""
        part = self.xfer.host_view(self.arr)[lo:hi]
        if part.dtype == np.float32:
            return part
        return part.view(np.uint16) if bits else widen_bf16(part, self.scratch(hi - lo))

    def to_device(self) -> jax.Array:
        if not self.arr.sharding.is_fully_replicated:  # each GPU's share (shards.py): back to its GPU
            return jax.device_put(self.arr, self.arr.sharding.with_memory_kind(self.xfer.device_sharding.memory_kind))
        return jax.device_put(self.arr, self.xfer.device_sharding)


class HostArray:
    """A gradient that is complete in host memory already (``stream_io``'s embedding and head,
    scattered or gathered there): it waits, and is read, where it is."""

    def __init__(self, arr: np.ndarray, xfer: Transfers):
        self.arr, self.xfer = arr, xfer

    def read(self, lo: int, hi: int, bits: bool = False) -> np.ndarray:
        return self.arr[lo:hi]

    def to_device(self) -> jax.Array:
        return jax.device_put(self.arr, self.xfer.device_sharding)


class PageableHeld:
    """A group's gradient on its way into (and then waiting in) its pageable buffer."""

    def __init__(self, hold: "PageableHold", name: str, buf: np.ndarray, chunks: int):
        self.hold, self.name, self.buf = hold, name, buf
        self._left = chunks
        self._lock = threading.Lock()
        self._landed = threading.Event()
        if chunks == 0:
            self._landed.set()

    def landed_one(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left == 0:
                self._landed.set()

    def wait(self) -> None:
        """Until every chunk is in the buffer (pumping the queue meanwhile: nothing is left stranded)."""
        while not self._landed.wait(timeout=0.05):
            self.hold.pump(block=True)
        if self.hold.error is not None:
            raise self.hold.error

    def read(self, lo: int, hi: int, bits: bool = False) -> np.ndarray:
        """Values ``lo:hi`` as fp32 (a bf16 buffer is widened into a scratch buffer, reused by the
        next read: one reader, the host optimizer thread); with ``bits`` a bf16 buffer's as uint16 bits."""
        self.wait()
        part = self.buf[lo:hi]
        if part.dtype == np.float32:
            return part
        if bits:
            return part.view(np.uint16)
        return widen_bf16(part, self.hold.scratch(hi - lo))

    def to_device(self) -> jax.Array:
        """The held gradient back on the device (a device-side update), fp32 or bf16 as held: a direct
        DMA where the buffer is registered, else staged by the runtime."""
        self.wait()
        return self.hold.xfer.to_device(self.hold.buffer_name(self.name), self.buf)


HELD_ON_HOST = (PinnedHeld, PageableHeld, HostArray)  # held gradients waiting in host memory


class _Chunk:
    """One slab's copy: its pinned array until the copier has moved it into the buffer."""

    __slots__ = ("held", "lo", "hi", "arr", "after")

    def __init__(self, held: PageableHeld, lo: int, hi: int, arr: Any, after: Future | None):
        self.held, self.lo, self.hi, self.arr, self.after = held, lo, hi, arr, after


# shared by every hold in the process (kernels.py says why)
_hold_slab_slice = jax.jit(named("hold_slab_slice", lambda g, lo, n: jax.lax.dynamic_slice_in_dim(g, lo, n)),
                           static_argnums=2, compiler_options=NO_AUTOTUNE)


class PageableHold:
    """Deferred gradients in pageable host memory, fed through the pinned slab pool ``slabs`` (the engine part
    of ``host_fp32`` / ``host_bf16``).

    ``put`` (the dispatching thread, right after a group's backward is dispatched and before the next
    block's) issues as many slab copies as there are free slabs and queues the rest. The copier thread
    issues queued copies as it frees slabs. ``put`` waits only while more than HOLD_COPIES_IN_FLIGHT
    earlier gradients are still on the device waiting for their copies (what the plan counts): with
    the dispatching thread paced to the GPU (``weights.Pace``) the GPU's queue still never runs dry.
    """

    split = True  # (HoldPart)

    def __init__(self, xfer: Transfers, slabs: threading.Semaphore, slab_elems: int | None, bf16: bool,
                 register: bool = False, trace: Callable[[str, str, Any], None] | None = None):
        self.xfer, self.slabs, self.slab_elems, self.bf16 = xfer, slabs, slab_elems, bf16
        self.register = register  # device-side updates read the buffers back: make them fast DMA sources
        self.trace = trace
        self.error: BaseException | None = None
        self._bufs: dict[str, np.ndarray] = {}
        self._queue: deque = deque()  # [held, device gradient, chunks, next chunk, after]
        self._lock = threading.Lock()
        self._issued = threading.Condition()  # notified each time a group's last copy is issued
        self.scratch = Scratch()
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grad-hold")
        self._slice, self._to_bf16 = _hold_slab_slice, grad_to_bf16

    @staticmethod
    def buffer_name(name: str) -> str:
        return f"{name}/held_grad"

    def buffer(self, name: str, n: int) -> np.ndarray:
        """Group ``name``'s buffer: allocated on first use, then reused every step."""
        buf = self._bufs.get(name)
        if buf is None:
            buf = alloc_aligned(n, np.uint16).view(jnp.bfloat16) if self.bf16 else alloc_aligned(n, np.float32)
            self._bufs[name] = buf
            if self.register:
                self.xfer.register(self.buffer_name(name), buf, pin_fallback=False)
        return buf

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._bufs.values())

    @classmethod
    def part(cls, placement: GradHold, env: "HoldEnv") -> "PageableHold":
        return cls(env.xfer, env.slabs, env.slab_elems, placement.bf16, register=env.register, trace=env.trace)

    def put(self, name: str, grad: jax.Array, n: int, after: Future | None = None) -> PageableHeld:
        """Start moving group ``name``'s fp32 gradient (``n`` values, replicated over the devices)
        into its buffer. ``after``: the buffer's last reader, waited for before it is overwritten."""
        if self.error is not None:
            raise self.error
        if self.bf16:
            grad = self._to_bf16(grad)
        step = self.slab_elems or n
        chunks = [(lo, min(lo + step, n)) for lo in range(0, n, step)]
        held = PageableHeld(self, name, self.buffer(name, n), len(chunks))
        with self._lock:
            self._queue.append([held, grad, chunks, 0, after])
        self.pump()
        del grad
        with self._issued:
            while len(self._queue) > HOLD_COPIES_IN_FLIGHT and self.error is None:
                self._issued.wait(0.05)
                self.pump()
        return held

    def pump(self, block: bool = False) -> None:
        """Issue queued copies, in order, while a slab is free. Without ``block`` (the dispatching
        thread) it returns at once if another thread is issuing."""
        if not self._lock.acquire(blocking=block):
            return
        try:
            while self._queue:
                job = self._queue[0]
                held, grad, chunks, j, after = job
                if not self.slabs.acquire(blocking=False):
                    return
                lo, hi = chunks[j]
                g = local_shard(grad, j)  # one device's copy of the (replicated) gradient
                piece = g if len(chunks) == 1 else self._slice(g, lo, hi - lo)
                # (no local name keeps the pinned array: the copier drops it before releasing its slab)
                c = _Chunk(held, lo, hi, self.xfer.to_host(piece), after if j == 0 else None)
                if self.trace is not None:
                    self.trace("d2h", held.name, c.arr)
                job[3] = j + 1
                if job[3] == len(chunks):
                    self._queue.popleft()  # the device gradient is freed once its copies are done
                    with self._issued:
                        self._issued.notify_all()
                self._copier.submit(self._land, c)
                del c, job, grad, g, piece
        finally:
            self._lock.release()

    def _land(self, c: _Chunk) -> None:
        """On the copier thread: the landed slab into the buffer, the slab back to the pool."""
        try:
            if c.after is not None:
                c.after.result()  # a device-side update's transfer of this buffer has completed
            _copy_into(c.held.buf[c.lo:c.hi], self.xfer.host_view(c.arr))  # (no view of the slab outlives it)
        except BaseException as e:  # noqa: BLE001 - surfaced where the held gradient is read
            self.error = self.error or e
        finally:
            c.arr = None
            self.slabs.release()
            c.held.landed_one()
            self.pump(block=True)

    def drain(self) -> None:
        """Wait until every queued copy has landed."""
        while True:
            with self._lock:
                last = self._queue[-1][0] if self._queue else None
            if last is None:
                break
            last.wait()
        self._copier.submit(lambda: None).result()

    def close(self) -> None:
        self.drain()
        self._copier.shutdown()


# ------------------------------------------------------------------------------------------ each hold's part


@dataclass(frozen=True)
class HoldEnv:
    """What a hold's engine part is built from (the updater's transfers, slab pool and kernels)."""

    xfer: Transfers
    slabs: threading.Semaphore  # the pinned gradient slabs (shared with the host updates)
    slab_elems: int | None  # values per slab (None: whole groups)
    to_bf16: Callable[[jax.Array], jax.Array]  # the GPU's cast (the norm was taken in fp32)
    register: bool  # device-side updates read held buffers back: make them fast DMA sources
    trace: Callable[[str, str, Any], None]  # (lane, label, array) for the tracer


class HoldPart(Protocol):
    """The engine part of one gradient hold: ``put`` leaves a deferred gradient where the hold keeps it."""

    split: bool  # with grad_hold_gpu_groups, the forward's first groups wait on the GPU in bf16 instead

    def put(self, name: str, grad: jax.Array, n: int, after: Future | None = None) -> Any:
        """Group ``name``'s gradient (``n`` values) held; ``after``: its buffer's last reader."""

    def close(self) -> None: ...


class GpuHold:
    """``gpu_fp32`` / ``gpu_bf16``: the gradient waits on the GPU, fp32 as made or cast to bf16."""

    split = False

    def __init__(self, placement: GradHold, env: HoldEnv):
        self.to_bf16 = env.to_bf16 if placement.bf16 else None

    def put(self, name: str, grad: jax.Array, n: int, after: Future | None = None) -> jax.Array:
        return grad if self.to_bf16 is None else self.to_bf16(grad)

    def close(self) -> None:
        pass


class PinnedHold:
    """``pinned_host`` / ``pinned_bf16``: each group's gradient in one pinned host array (bf16: cast on the GPU
    first, widened on reading into one scratch buffer)."""

    split = True

    def __init__(self, placement: GradHold, env: HoldEnv):
        self.xfer, self.trace = env.xfer, env.trace
        self.to_bf16 = env.to_bf16 if placement.bf16 else None
        self.scratch = Scratch()  # pinned_bf16: the widened chunk the host update reads

    def put(self, name: str, grad: jax.Array, n: int, after: Future | None = None) -> PinnedHeld:
        if self.to_bf16 is not None:
            grad = self.to_bf16(grad)
        if not grad.sharding.is_fully_replicated:  # each GPU's share (shards.py) into pinned memory over its link
            held = PinnedHeld(jax.device_put(grad, grad.sharding.with_memory_kind("pinned_host")), self.xfer,
                              self.scratch)
        else:
            held = PinnedHeld(self.xfer.to_host(local_shard(grad)), self.xfer, self.scratch)
        self.trace("d2h", name, held.arr)
        return held

    def close(self) -> None:
        pass


class NoHold(GpuHold):
    """``resweep``: nothing waits (the second sweep makes the gradients again); only the split's first groups
    are held, on the GPU in bf16, and anything else handed over stays where it is."""

    split = True


# each hold's engine part, keyed by its placement object (built once per updater: ``make_hold``)
HOLD_PARTS: dict[GradHold, Callable[[GradHold, HoldEnv], HoldPart]] = {
    GPU_FP32: GpuHold, GPU_BF16: GpuHold, PINNED_HOST: PinnedHold, PINNED_BF16: PinnedHold,
    HOST_FP32: PageableHold.part, HOST_BF16: PageableHold.part, RESWEEP: NoHold,
}
if set(HOLD_PARTS) != set(GRAD_HOLD_LIST):
    raise ImportError(f"holds without an engine part: {set(GRAD_HOLD_LIST) - set(HOLD_PARTS)}")


def make_hold(placement: GradHold, env: HoldEnv) -> HoldPart:
    """The engine part of ``placement``."""
    return HOLD_PARTS[placement](placement, env)
