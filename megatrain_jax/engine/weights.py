"""What the step keeps in flight: the weight stream and the boundary activations.

Issue order decides overlap (docs/design.md section 2): a transfer issued *before* the compute it should hide
behind runs concurrently with it; issued after, it waits. The step therefore asks for a group
(``prefetch``) one block ahead of the compute that hides it, and ``take``s it when it computes.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable

import jax

from megatrain_jax.engine.device_updates import DeviceUpdate
from megatrain_jax.engine.shards import Shards
from megatrain_jax.engine.updates_base import Groups, Updates
from megatrain_jax.hoststore import HostStore
from megatrain_jax.bounds import PINNED_ACT_LAYERS_ON_GPU
from megatrain_jax.transfer import Transfers


class Pace:
    """Keeps the dispatching thread at most ``queued`` blocks ahead of the device: after each block's
    work is dispatched, wait until the one ``queued`` back has been computed. Everything a dispatch
    allocates (the next weights, a returning activation, an accumulator, the output) exists from the
    dispatch on, so without this the GPU holds as many blocks as the thread has run ahead (the plan
    counts ``BLOCKS_QUEUED``); one block always stays queued behind the running one, so the GPU never
    waits for the thread."""

    def __init__(self, queued: int):
        self.queued, self._marks = queued, deque()

    def dispatched(self, mark: Any) -> None:
        """``mark``: an array the block's last dispatched computation produces."""
        self._marks.append(mark)
        while len(self._marks) >= self.queued:
            jax.block_until_ready(self._marks.popleft())

    def reset(self) -> None:
        self._marks.clear()


class WeightStream:
    """Each group's weights, put in flight to the device once its pending update is done.

    The host buffer must not be written while a transfer reads it, and must not be read before its
    update has written it: ``updates.wait`` before each transfer is the only synchronisation needed.
    With device-side updates a fetch puts the group's master and optimizer state in flight instead,
    and ``take`` dispatches the update: its output is the weights the block computes with.
    """

    def __init__(self, store: HostStore, xfer: Transfers, updates: Updates, groups: Groups, tracer: Any,
                 shards: Shards | None = None):
        """``shards`` (``train.fetch=split``, several GPUs): each GPU fetches its share of a block over its own link
        and the block is gathered over NVLink; None: each fetches the whole block."""
        self.store, self.xfer, self.updates, self.groups, self.tracer = store, xfer, updates, groups, tracer
        self.shards = shards
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
        view = self.store[name].stream_view()
        if self.shards is not None:
            sh = self.shards
            w = sh.gather(sh.to_device(view, sh.padded(view.shape[0])), view.shape[0])
        else:
            w = self.xfer.to_device(name, view)
        if self.tracer is not None:
            self.tracer.watch("h2d", name, w)
        return w


class Boundaries:
    """Each block's input activations (the boundary checkpoints the backward recomputes from), on
    the device or parked in pinned host memory (``activations=pinned_host``).

    ``gpu_from`` (a split placement, ``activations_gpu_blocks``): blocks from there on keep their inputs on
    the device even when parking; the GPU's free room takes the last ones, which the backward needs first
    (no round trip where there is no compute left to hide it behind), the pinned share the first.

    ``every`` > 1 keeps only the inputs of blocks 0, k, 2k, ... (and of blocks ``keep_from`` on):
    boundary memory ~L/k + k inputs instead of L. The backward asks for the inputs of a segment's
    top block first; ``take`` then re-runs the forward of the blocks between the kept input and it
    once (``forward(b, hs)``, given by the step at ``start``: block b's weights streamed again),
    keeping their inputs as the forward would have for the segment's backward.
    """

    def __init__(self, xfer: Transfers, offload: bool, every: int = 1, keep_from: int | None = None,
                 gpu_from: int | None = None):
        self.xfer, self.offload, self.every = xfer, offload, int(every)
        self.gpu_from = gpu_from  # blocks from here on keep their inputs on the device (None: every block parks)
        self._parked: set[int] = set()  # blocks whose saved inputs are in pinned host memory
        self.keep_from = keep_from  # blocks from here on always keep their input (their kept residuals
        #                             need no recompute, so none of theirs is ever run again)
        self.forward: Callable[[int, list], list] | None = None
        self._saved: dict[int, list[jax.Array]] = {}  # block -> its inputs (device, or pinned host)
        self._back: dict[int, list[jax.Array]] = {}  # block -> its inputs back on the device
        self._count = 0
        self._landing: list[list[jax.Array]] = []

    def start(self, forward: Callable[[int, list], list] | None = None) -> None:
        """A new step; ``forward(b, hs)``: block b's forward of this step's micro-batches, again."""
        self._saved, self._back, self._count, self.forward = {}, {}, 0, forward
        self._parked = set()
        self._landing = []  # parked layers whose copies to the host may still be in flight

    def kept(self, i: int) -> bool:
        """Whether the forward keeps block ``i``'s input."""
        return i % self.every == 0 or (self.keep_from is not None and i >= self.keep_from)

    def keep(self, hs: list[jax.Array]) -> None:
        """The next block's inputs (called once per block, in forward order): kept or let go."""
        i, self._count = self._count, self._count + 1
        if self.kept(i):
            self._saved[i] = self._park(i, hs)

    def first(self, i: int) -> int:
        """The first block whose weights block ``i``'s backward needs: ``i``, or the block of the kept
        input its recompute starts from (the weight stream prefetches that one first)."""
        return i if (i < 0 or i in self._saved or i in self._back) else self._base(i)

    def bring(self, i: int) -> None:
        """Block ``i``'s inputs back to the device ahead of its backward (nothing for ``i < 0``); for
        an input to recompute, the kept input it is recomputed from."""
        if i < 0:
            return
        j = i if (i in self._saved or i in self._back) else self._base(i)
        if j not in self._back:  # (a recomputed input already on the device stays where it is)
            self._back[j] = self._unpark(j, self._saved[j])

    def take(self, i: int, forget: bool = True) -> list[jax.Array]:
        """Block ``i``'s inputs, forgotten here (freed once the caller is done with them); recomputed
        first, with those of the blocks between, when the forward did not keep them. Not ``forget``
        (a second backward sweep will bring them back): a kept input stays kept, a recomputed one is
        let go all the same (that sweep recomputes it again)."""
        if i not in self._saved and i not in self._back:
            self._recompute(self._base(i), i)
        back = self._back.pop(i, None)
        saved = self._saved.pop(i, None) if (forget or not self.kept(i)) else self._saved[i]
        return back if back is not None else self._unpark(i, saved)

    def _recompute(self, j: int, i: int) -> None:
        """Inputs of blocks j+1..i from block j's: the forward of blocks j..i-1 once more. Those of
        blocks i and i-1 stay on the device (their backwards are next); the others are kept as the
        forward keeps them. Block j's own stay kept (parked: brought back again for its backward)."""
        hs = self._back.pop(j, None)
        hs = self._unpark(j, self._saved[j]) if hs is None else hs
        for b in range(j, i):
            hs = self.forward(b, hs)
            if b + 1 >= i - 1:
                self._back[b + 1] = hs
            else:
                self._saved[b + 1] = self._park(b + 1, hs)

    def _base(self, i: int) -> int:
        return max(b for b in self._saved if b <= i)

    def _park(self, i: int, hs: list[jax.Array]) -> list[jax.Array]:
        """To pinned host memory. At most ``PINNED_ACT_LAYERS_ON_GPU`` layers' copies are in flight (their
        device buffers live until they land): the dispatching thread waits for the oldest beyond that,
        which has had a whole block's compute to land, so the GPU's queue does not run dry. Unbounded, async
        dispatch ran ~4 layers ahead and the 8B at 10 GB ran out of memory (experiments/bench_gpu_budgets.py)."""
        if not self.offload:
            return hs
        if self.gpu_from is not None and i >= self.gpu_from:
            # the GPU's share: the parked layers still landing go first, so the GPU holds the split's layers
            # and no copies besides (what the plan counts)
            while self._landing:
                jax.block_until_ready(self._landing.pop(0))
            return hs
        self._parked.add(i)
        parked = [self.xfer.offload(h) for h in hs]
        self._landing.append(parked)
        while len(self._landing) > PINNED_ACT_LAYERS_ON_GPU - 1:
            jax.block_until_ready(self._landing.pop(0))
        return parked

    def _unpark(self, i: int, hs: list[jax.Array]) -> list[jax.Array]:
        return [self.xfer.reload(h) for h in hs] if i in self._parked else hs
