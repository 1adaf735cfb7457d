"""``update_on=device``: each group's update runs on the accelerator (``updaters.py`` says how the paths differ)."""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from megatrain_jax.engine.holds import HELD_ON_HOST, HostArray
from megatrain_jax.engine.kernels import local_shard
from megatrain_jax.engine.shards import Shards
from megatrain_jax.engine.updates_base import HEAD, Updates
from megatrain_jax.errors import UserError
from megatrain_jax.optim.device_adamw import BLOCK
from megatrain_jax.placements import HOST_STATE_SHARDED, STREAM_COPY_DEVICE, UPDATE_DEVICE, UPDATE_HOST
from megatrain_jax.bounds import WRITEBACKS_IN_FLIGHT


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


class DeviceUpdates(Updates):
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
        # train.early_state_groups: the first groups of the forward, whose master and state the backward puts in
        # flight (neither depends on the norm), so that the forward moves only the others' (the forward of a split
        # update was bound by this traffic: docs/design.md 7.6)
        self._early_names = list(self.groups.order[:max(int(self.o.early_state_groups), 0)])
        self._early: dict[str, tuple[jax.Array, dict]] = {}
        self.early_loads = 0  # updates that started from state fetched in the backward (the tests read it)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="d2h-writeback")
        self._writing: deque[Future] = deque()  # write-backs in flight, oldest first (WRITEBACKS_IN_FLIGHT)
        self._host = ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-optim")  # stream_io's groups
        # several GPUs: each updates its share of every group (shards.py) where the update is elementwise; an
        # update over whole tensors (optax) runs on every GPU alike, and one GPU's result goes back to the host
        self.shards = self._shards() if self.k.num_devices > 1 and getattr(self.opt, "shards_on_device", False) \
            else None
        # an update run alike on every GPU still holds its gradients split: each GPU keeps its share of a held
        # gradient and the update gathers the whole over NVLink when it starts (four H200s held 11 groups of the
        # 110B for its resweep where one holds 17, and swept the other 69 twice: experiments/bench_memory_plan.py)
        self.hold_shards = Shards(self.k.mesh, BLOCK, self.xfer.device_sharding.memory_kind, None) \
            if self.k.num_devices > 1 and self.shards is None else None
        self.split_held_loads = 0  # updates that gathered a gradient held split (the tests read it)
        sharded = self.o.host_state_place.sharded
        if self.k.num_devices > 1 and jax.process_count() > 1 and not sharded:
            raise UserError("train.update_on", f"{UPDATE_DEVICE} with several processes needs train.host_state="
                            f"{HOST_STATE_SHARDED} (with a replica in each, each process's GPUs would update only "
                            "their shares of it)", f"set train.host_state={HOST_STATE_SHARDED}, or train.update_on="
                            f"{UPDATE_HOST} (or auto)")
        if sharded and self.k.num_devices > 1 and self.shards is None:
            raise UserError("train.host_state", f"{HOST_STATE_SHARDED} needs an update split elementwise between the "
                            f"GPUs, which {type(self.opt).__name__} is not", "use optim.name=adamw, or set "
                            "train.host_state=replicated")

    def hold(self, name: str, grad: jax.Array) -> None:
        super().hold(name, grad)
        held = self._held.get(name)
        if self.hold_shards is not None and isinstance(held, jax.Array) and held.sharding.is_fully_replicated:
            self._held[name] = self.hold_shards.shard(held, self.hold_shards.padded(self.store[name].size))

    def _shards(self) -> Shards:
        if self.placement.pageable:
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
        owned = self.store.owned[g.name] if self.store.owned else None
        for k, a in self.opt.state_to_arrays(g.opt_state).items():  # the optimizer state crosses PCIe too
            span = owned if owned is None or a.shape[0] == g.size else (owned[0] // BLOCK, -(-owned[1] // BLOCK))
            self.xfer.register(f"{g.name}/{k}", a, span=span)

    def gradient(self, name: str, grad: jax.Array) -> None:
        if self.placement.is_resweep and not self.resweep:
            return self.send(name, grad)  # no norm to wait for: updated now, nothing held
        self.hold(name, grad)

    def send(self, name: str, grad: jax.Array, scale: float = 1.0, current: jax.Array | None = None) -> None:
        """The resweep's second sweep: the update runs now, on the device, with the clip scale known
        (the next forward then fetches the updated weights from the host store). ``current``: the group's
        fp32 master on the device already (the weights its backward just computed with), which the update
        starts from instead of fetching it again: 5.4 GB less over PCIe for each of the 110B's blocks."""
        if name == HEAD:
            self.count += 1
        if isinstance(grad, np.ndarray):  # complete in host memory (stream_io): updated there
            self._start_on_host(name, HostArray(grad, self.xfer), scale, self.count)
            return
        if current is not None:
            self._resident[name] = current
        self._queued[name] = (grad, scale, self.count)
        self._done[name] = Future()
        self.dispatch(self.load(name))

    def apply(self, scale: float | None, resident: dict[str, jax.Array]) -> None:
        """Queue each group's update, applied when the next forward fetches the group. The current
        weights of the groups needed first and last are on the device already: their updates start
        from these instead of crossing PCIe again (the step's first transfers are exposed)."""
        held, self._held = self._held, {}
        if scale is None or not held:
            self._early.clear()  # (a skipped step: the state fetched early is dropped, the store's is unchanged)
            return
        if not self.resweep:  # (a resweep's second sweep counted the step as it sent the head)
            self.count += 1
        for name in [n for n in self.groups.order if n in held]:  # (a resweep holds only its first groups)
            grad = held.pop(name)
            if isinstance(grad, HostArray):  # complete in host memory (stream_io): updated there, now
                self._start_on_host(name, grad, scale, self.count)
                continue
            self._queued[name] = (grad, scale, self.count)
            self._done[name] = Future()  # set once this update is back in the host store
        self._resident = dict(resident)
        self._early = {n: e for n, e in self._early.items() if n in self._queued}  # (only what a load will take)

    def _start_on_host(self, name: str, grad: HostArray, scale: float, count: int) -> None:
        self.pending[name] = self._host.submit(self._host_update, name, grad, scale, count)

    def _host_update(self, name: str, grad: HostArray, scale: float, count: int) -> None:
        """On the host-optimizer thread: a group whose gradient is in host memory, updated in place by the
        optimizer's host kernel (the same step as its device one: tests compare both with the reference)."""
        g = self.store[name]
        if self.before_update is not None:
            self.before_update(name, count)
        t0 = time.perf_counter()
        kept = self.kept(name)
        self.opt.update(g.master, grad.read(0, g.size), g.opt_state, count, scale, g.stream_bits, g.layout.unflatten)
        self.put_back(name, kept)
        self.xfer.host_written(name, g.stream_view())
        if self.tracer is not None:
            self.tracer.interval("optimizer", name, t0, time.perf_counter())

    def fetch_early(self, j: int) -> None:
        """The backward's ``j``-th block (from the top) is dispatched: the early groups up to the ``j``-th put their
        master and state in flight (one a block), each once its last write-back is in the store."""
        for name in self._early_names[:j + 1]:
            if name in self._early:
                continue
            fut = self.pending.get(name)
            if fut is not None:
                fut.result()
            self._early[name] = self._state_to_device(name)
            self._trace("h2d", f"{name} early", self._early[name][0])

    def _state_to_device(self, name: str, master: bool = True) -> tuple[jax.Array | None, dict]:
        """The group's fp32 master (None without ``master``) and optimizer state in flight to the device(s): with a
        split update each GPU its share, over its own link."""
        g = self.store[name]
        host_state = self.opt.state_to_arrays(g.opt_state)
        if self.shards is not None:
            sh = self.shards
            return sh.to_device(g.master, sh.padded(g.size)) if master else None, {
                k: sh.to_device(a, sh.padded_like(a.shape[0], g.size)) for k, a in host_state.items()}
        return self.xfer.to_device(name, g.master) if master else None, {
            k: self.xfer.to_device(f"{name}/{k}", a) for k, a in host_state.items()}

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
        p = self._resident.pop(name, None)  # (the weights the forward computed with: no master to fetch)
        early = self._early.pop(name, None)  # (fetched in the backward: train.early_state_groups)
        if early is not None:
            self.early_loads += 1
        fetched = p is None and early is None
        if isinstance(grad, HELD_ON_HOST):
            grad = grad.to_device()
        elif self.hold_shards is not None and not grad.sharding.is_fully_replicated:  # (held split: ``hold``)
            grad = self.hold_shards.gather(grad, g.size)
            self.split_held_loads += 1
        p_in, state = early if early is not None else self._state_to_device(name, master=fetched)
        if self.shards is not None:  # each GPU its share, over its own link
            total = self.shards.padded(g.size)
            if p is not None:  # (resident weights are whole on every GPU: each takes its share)
                p = self.shards.shard(p, total)
            grad = self.shards.shard(grad, total)
        p = p_in if p is None else p
        if fetched:
            self._trace("h2d", name, p)
        return DeviceUpdate(name, p, grad, state, host_state, self.opt.device_scalars(count, scale), count)

    def dispatch(self, u: DeviceUpdate) -> jax.Array:
        """Dispatch the update (the new master is the weights the block uses) and queue its write-back."""
        g = self.store[u.name]
        kept = self._kept_on_device(u)  # (before the step: it donates the param and state)
        if self.shards is None:
            p_new, state = self.opt.device_step(u.param, u.grad, u.state, u.scalars, self.o.device_update_chunk,
                                                unflatten=g.layout.unflatten)  # the group's tree (optax: shapes)
        else:  # each GPU updates its share
            p_new, state = self.opt.device_step(u.param, u.grad, u.state, u.scalars, self.o.device_update_chunk,
                                                mesh=self.k.mesh)
        if kept is not None:  # the frozen spans as they were, before the block computes with the new weights
            p_new, state = _put_back(p_new, state, kept)
        # a split update's block computes with the whole, gathered over NVLink
        w = p_new if self.shards is None else self.shards.gather(p_new, g.size)
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

    def _kept_on_device(self, u: DeviceUpdate) -> tuple | None:
        """The frozen spans of the group's master (and elementwise state) on the device, before its update."""
        spans = self.frozen.get(u.name)
        if not spans:
            return None
        n = u.param.shape[0]
        keys = [k for k, a in u.state.items() if a.shape[0] == n] if getattr(self.opt, "elementwise_state", False) \
            else []
        return (tuple(spans), [u.param[lo:hi] for lo, hi in spans],
                {k: [u.state[k][lo:hi] for lo, hi in spans] for k in keys})

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
                    # every GPU's update first: on the CPU backend each device's master may be the store's own
                    # memory (a zero-copy device_put), which this write changes under an update still reading it
                    # (a 4-device Adafactor run then diverged in its last steps, under load only)
                    x.block_until_ready()
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
        self._early.clear()
        self._settle(self.groups.order)
        self._settle(self.pending)

    def close(self) -> None:
        self.finish()
        self._close_hold()
        self._writer.shutdown()
        self._host.shutdown()


def _put_back(p: jax.Array, state: dict, kept: tuple) -> tuple[jax.Array, dict]:
    """``p`` and ``state`` with the spans ``kept`` holds (``_kept_on_device``) written back, each array keeping its
    sharding (a split update's share on each GPU)."""
    spans, param_kept, state_kept = kept
    new_p, new_state = _PUT_BACK(p, {k: state[k] for k in state_kept}, param_kept, state_kept, spans)
    if new_p.sharding != p.sharding:
        new_p = jax.device_put(new_p, p.sharding)
    out = dict(state)
    for k, a in new_state.items():
        out[k] = a if a.sharding == state[k].sharding else jax.device_put(a, state[k].sharding)
    return new_p, out


def _put_back_fn(p, state, param_kept, state_kept, spans):
    def put(a, vals):
        for (lo, hi), v in zip(spans, vals):
            a = a.at[lo:hi].set(v)
        return a

    return put(p, param_kept), {k: put(a, state_kept[k]) for k, a in state.items()}


_PUT_BACK = jax.jit(_put_back_fn, static_argnums=(4,), donate_argnums=(0, 1))
