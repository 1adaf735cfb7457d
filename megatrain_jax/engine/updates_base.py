"""What every update path shares (``updaters.py`` says what each path does): the store's groups in forward order, and
``Updates``: held gradients, the pending futures a fetch waits for, the step count, the gradient hold's engine part."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import jax
import numpy as np

from megatrain_jax.engine.holds import HostArray, HoldEnv, PageableHold, make_hold
from megatrain_jax.engine.kernels import Kernels
from megatrain_jax.hoststore import HostStore
from megatrain_jax.optim.fused_adamw import f32_to_bf16_bits
from megatrain_jax.optim.host import HostOptimizer
from megatrain_jax.plan.options import EngineOptions
from megatrain_jax.transfer import Transfers


class Groups:
    """The store's groups by key (``EMBED``, block index, ``HEAD``), in the order a forward needs them."""

    def __init__(self, num_layers: int):
        self.names: dict[Any, str] = {EMBED: "embed", **{i: f"block_{i}" for i in range(num_layers)}, HEAD: "head"}
        self.order = list(self.names.values())  # forward order: deferred updates run in this order
        self.pos = {n: j for j, n in enumerate(self.order)}


EMBED, HEAD = "embed", "head"


class Updates:
    """What both paths share: held gradients, the pending futures a fetch waits for, the step count."""

    on_device = False

    def __init__(self, store: HostStore, opt: HostOptimizer, xfer: Transfers, kernels: Kernels,
                 options: EngineOptions, groups: Groups, tracer: Any):
        self.store, self.opt, self.xfer, self.k, self.o, self.groups = store, opt, xfer, kernels, options, groups
        self.tracer = tracer
        # updates wait for the whole gradient when it must be clipped or checked for NaN first
        self.deferred = options.clip_norm is not None or options.skip_nonfinite or options.update_place.on_device
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
        self.resweep = self.placement.is_resweep and (options.clip_norm is not None or options.skip_nonfinite)
        # a resweep's first ``grad_hold_gpu_groups`` groups (embedding, block 0, ...: the backward's last) wait on
        # the GPU in bf16, and its second sweep stops above them (never the head: it is the second sweep's first)
        self.resweep_held = min(int(options.grad_hold_gpu_groups), len(groups.order) - 1) if self.resweep else 0
        # the hold's engine part (holds.HOLD_PARTS), where ``hold`` puts each deferred gradient
        self.held_in = make_hold(self.placement, HoldEnv(xfer, self.slabs, options.grad_slab_elems, kernels.to_bf16,
                                                         register=self.on_device, trace=self._trace)) \
            if self.deferred else None
        self.pageable = self.held_in if isinstance(self.held_in, PageableHold) else None  # (its buffers: tests)
        self.frozen: dict[str, list[tuple[int, int]]] = {}  # per group: the spans no update may change (``freeze``)

    def freeze(self, paths: tuple[str, ...]) -> None:
        """Leaves the optimizer leaves untouched (``Family.frozen_leaves``): each group's leaves whose path is one of
        ``paths`` or ends with ``/`` + one. Their values (and their elementwise optimizer state, where the optimizer
        keeps one value per parameter: ``elementwise_state``) are put back after every update, so weight decay never
        scales them and their moments stay as they were."""
        self.frozen = {}
        for g in self.store:
            spans = [(leaf.offset, leaf.offset + leaf.size) for leaf in g.layout.leaves
                     if any(leaf.path == p or leaf.path.endswith("/" + p) for p in paths) and leaf.size]
            if spans:
                self.frozen[g.name] = spans

    def kept(self, name: str) -> list[tuple[np.ndarray, int, np.ndarray]]:
        """Before group ``name``'s host update: copies of its frozen spans (master and elementwise state)."""
        spans = self.frozen.get(name)
        if not spans:
            return []
        g = self.store[name]
        if self.store.owned:  # (host state split between processes: only this one's share is updated here)
            o0, o1 = self.store.owned[name]
            spans = [(max(lo, o0), min(hi, o1)) for lo, hi in spans if max(lo, o0) < min(hi, o1)]
        arrays = [g.master]
        if getattr(self.opt, "elementwise_state", False):
            arrays += [a for a in self.opt.state_to_arrays(g.opt_state).values() if a.shape[0] == g.size]
        return [(a, lo, a[lo:hi].copy()) for a in arrays for lo, hi in spans]

    def put_back(self, name: str, kept: list[tuple[np.ndarray, int, np.ndarray]]) -> None:
        """After group ``name``'s host update: its frozen spans as ``kept`` had them (the bf16 copy too)."""
        if not kept:
            return
        for a, lo, v in kept:
            a[lo:lo + v.shape[0]] = v
        g = self.store[name]
        if g.stream_bits is not None:
            for a, lo, v in kept:
                if a is g.master:
                    g.stream_bits[lo:lo + v.shape[0]] = f32_to_bf16_bits(v)

    def register(self, g: Any) -> None:
        """Group ``g``'s host buffers that cross PCIe besides its streaming copy (none here)."""

    def reduce(self, name: str, g: jax.Array) -> jax.Array:
        """Group ``name``'s gradient from the devices' partial sums: summed over them, on every device."""
        return self.k.reduce(g) if self.k.reduce is not None else g

    def done(self, name: str) -> bool:
        fut = self.pending.get(name)
        return fut is None or fut.done()

    def fetch_early(self, j: int) -> None:
        """The backward has passed its ``j``-th block: a device-side update may put an early group in flight."""

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
        if self.resweep and pos >= self.resweep_held and not (name == EMBED and isinstance(grad, np.ndarray)):
            # dropped: the second sweep makes it again once the norm is known (the head's, kept in host memory by
            # stream_io, is sent as that sweep starts; the embedding's, made in host memory, waits: start_on_host)
            return
        if isinstance(grad, np.ndarray):  # complete in host memory already (stream_io): it waits there
            grad = HostArray(grad, self.xfer)
        elif self.held_in.split and pos < self.o.grad_hold_gpu_groups:
            grad = self.k.to_bf16(grad)  # the norm was taken in fp32
        else:  # (a pageable buffer's last reader, a device-side update, goes first: ``after``)
            grad = self.held_in.put(name, grad, self.store[name].size, after=self.pending.get(name))
        self._held[name] = grad

    def start_on_host(self, scale: float) -> None:
        """A resweep's norm is known: the held gradients complete in host memory already (``stream_io``'s
        embedding) start their host updates now, before the second sweep, which they then overlap. Applied
        after it (``apply``), the 110B's embedding update (6.6 s) held back the next forward: the step was
        79.8 s with the GPU idle for those 6.6 s (experiments/bench_memory_plan.py --trace)."""
        for name in [n for n in self.groups.order if isinstance(self._held.get(n), HostArray)]:
            self._start_on_host(name, self._held.pop(name), scale, self.count + 1)  # (the head's send counts it)

    def _start_on_host(self, name: str, grad: HostArray, scale: float, count: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} holds no gradient in host memory")

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
