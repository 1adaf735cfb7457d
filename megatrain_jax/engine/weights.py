"""What the step keeps in flight: the weight stream and the boundary activations.

Issue order decides overlap (DESIGN.md §2): a transfer issued *before* the compute it should hide
behind runs concurrently with it; issued after, it waits. The step therefore asks for a group
(``prefetch``) one block ahead of the compute that hides it, and ``take``s it when it computes.
"""
from __future__ import annotations

from typing import Any

import jax

from megatrain_jax.engine.updaters import DeviceUpdate, Groups, _Updates
from megatrain_jax.hoststore import HostStore
from megatrain_jax.transfer import Transfers


class WeightStream:
    """Each group's weights, put in flight to the device once its pending update is done.

    The host buffer must not be written while a transfer reads it, and must not be read before its
    update has written it: ``updates.wait`` before each transfer is the only synchronisation needed.
    With device-side updates a fetch puts the group's master and optimizer state in flight instead,
    and ``take`` dispatches the update: its output is the weights the block computes with.
    """

    def __init__(self, store: HostStore, xfer: Transfers, updates: _Updates, groups: Groups, tracer: Any):
        self.store, self.xfer, self.updates, self.groups, self.tracer = store, xfer, updates, groups, tracer
        self._inflight: dict[Any, Any] = {}  # key -> device array, or a DeviceUpdate in flight

    def prefetch(self, key: Any, *, wait: bool = True) -> None:
        """Put group ``key`` in flight (a no-op when it is, or when there is no such group). Without
        ``wait``, skipped while its host update still runs: the caller dispatches compute first."""
        name = self.groups.names.get(key)
        if name is None or key in self._inflight or (not wait and not self.updates.done(name)):
            return
        self._inflight[key] = self._fetch(name)

    def take(self, key: Any) -> jax.Array:
        """Group ``key``'s weights on the device (fetched now if they are not in flight)."""
        w = self._inflight.pop(key, None)
        if w is None:
            w = self._fetch(self.groups.names[key])
        return self.updates.dispatch(w) if isinstance(w, DeviceUpdate) else w

    def hold(self, key: Any, w: jax.Array) -> None:
        """Group ``key`` is needed again soon: device-side updates keep the weights just updated on
        the device (``prefetch`` is then a no-op); the host path lets them go and fetches again."""
        if self.updates.on_device:
            self._inflight[key] = w

    def _fetch(self, name: str) -> Any:
        self.updates.wait(name)
        pending = self.updates.load(name)
        if pending is not None:
            return pending
        w = self.xfer.to_device(name, self.store[name].stream_view())
        if self.tracer is not None:
            self.tracer.watch("h2d", name, w)
        return w


class Boundaries:
    """Each block's input activations (the boundary checkpoints the backward recomputes from), on
    the device or parked in pinned host memory (``activations=pinned_host``)."""

    def __init__(self, xfer: Transfers, offload: bool):
        self.xfer, self.offload = xfer, offload
        self._saved: list[list[jax.Array] | None] = []
        self._back: dict[int, list[jax.Array]] = {}

    def start(self) -> None:
        self._saved, self._back = [], {}

    def keep(self, hs: list[jax.Array]) -> None:
        self._saved.append([self.xfer.offload(h) for h in hs] if self.offload else hs)

    def bring(self, i: int) -> None:
        """Block ``i``'s inputs back to the device ahead of its backward (nothing for ``i < 0``)."""
        if i >= 0:
            saved = self._saved[i]
            self._back[i] = [self.xfer.reload(h) for h in saved] if self.offload else saved

    def take(self, i: int, forget: bool = True) -> list[jax.Array]:
        """Block ``i``'s inputs, forgotten here (freed once the caller is done with them) unless not
        ``forget`` (``grad_hold=resweep``: a second backward sweep brings them back again)."""
        if forget:
            self._saved[i] = None
        return self._back.pop(i)
