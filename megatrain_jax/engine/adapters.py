"""The LoRA variant's updater: the adapters and their optax state live on the device for the whole run.

``AdapterUpdates`` stands where ``HostUpdates`` and ``DeviceUpdates`` stand in full training
(``updaters.UPDATERS``) and answers the step the same calls. The base is frozen, so the only gradient
the backward makes for a block is its adapters' (``lora_kernels.Adapted``), and the embedding and head
make none. Each block's adapter gradient is held on the device as it completes (small: rank x (in +
out) per projection); once the step's global norm is known, ``apply`` scales them as
``optax.clip_by_global_norm`` would and runs one jitted optax update over every layer's adapters. A
skipped step (a non-finite loss or norm: no scale) drops them, leaving adapters, state and count as
they were. Nothing is written to host memory, so a fetch never waits for an update.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from megatrain_jax.engine.kernels import F32


def own(tree: Any, sharding: Any) -> Any:
    """A copy of ``tree`` placed by ``sharding`` that the engine may donate (never the caller's arrays)."""
    return jax.tree_util.tree_map(lambda x: jnp.array(jax.device_put(x, sharding), copy=True), tree)


class Adapters:
    """Every layer's adapters (fp32) and their optax state, replicated over the run's devices. The adapted
    blocks read ``trees[i]``; ``AdapterUpdates`` replaces both after each step."""

    def __init__(self, tx: optax.GradientTransformation, trees: list[Any], sharding: Any):
        self.tx, self.sharding = tx, sharding
        self.trees = own(list(trees), sharding)
        self.opt_state = own(tx.init(self.trees), sharding)

    def set(self, trees: list[Any], opt_state: Any | None = None) -> None:
        """Restored values (a checkpoint's): copies of them, placed as the run's."""
        self.trees = own(list(trees), self.sharding)
        if opt_state is not None:
            self.opt_state = own(opt_state, self.sharding)

    def host(self) -> list[Any]:
        """Every layer's adapters as numpy fp32 (copies)."""
        return jax.tree_util.tree_map(np.asarray, jax.device_get(self.trees))


class AdapterUpdates:
    """Adapter gradients held on the device for the norm, then clipped and applied by optax (see the module
    docstring). Built as ``updaters.make_updates`` builds the other paths; ``kernels.adapters`` is the
    ``Adapters`` it updates."""

    on_device = True  # the update runs there; and the base never changes, so a block just computed serves the
    #                   backward (weights.WeightStream.hold) instead of crossing PCIe again
    deferred = True  # every update waits for the step's norm: clipping, and a non-finite step is always skipped
    resweep, resweep_held = False, 0  # (no second sweep: the held gradients are small)

    def __init__(self, store: Any, tx: optax.GradientTransformation, xfer: Any, kernels: Any, options: Any,
                 groups: Any, tracer: Any):
        self.adapters: Adapters = kernels.adapters
        self.order = [groups.names[i] for i in range(store.num_blocks)]  # the blocks, in layer order
        self.tracer = tracer
        self.count = 0  # optimizer steps taken
        self.wait_s = 0.0  # (nothing is ever waited for: the updates run in the device's queue)
        self.before_update: Callable[[str, int], None] | None = None  # (nothing is written to the host)
        self._held: dict[str, Any] = {}  # block name -> its adapters' gradient (fp32, replicated)

        def update(trees, state, grads, scale):
            grads = jax.tree_util.tree_map(lambda g: g * scale, grads)
            upd, state = tx.update(grads, state, trees)
            return optax.apply_updates(trees, upd), state

        self._update = jax.jit(update, donate_argnums=(0, 1))

    # ---- the step's calls

    def reduce(self, name: str, grad: Any) -> Any:
        """Block ``name``'s adapter gradient as the backward made it: summed over the devices inside it already."""
        return grad

    def gradient(self, name: str, grad: Any) -> None:
        """Block ``name``'s adapter gradient is complete: held for the norm."""
        self._held[name] = grad

    def send(self, name: str, grad: Any, scale: float = 1.0) -> None:
        raise AssertionError("adapter updates hold every gradient: there is no resweep to send one")

    def apply(self, scale: float | None, resident: dict) -> None:
        """Clip and update every layer's adapters at once (``scale`` None: a skipped step, dropped)."""
        held, self._held = self._held, {}
        if scale is None or not held:
            return
        a = self.adapters
        grads = [held[name] for name in self.order]
        a.trees, a.opt_state = self._update(a.trees, a.opt_state, grads, jnp.asarray(scale, F32))
        self.count += 1

    # ---- what the weight stream asks (nothing waits: the frozen base is never written)

    def register(self, g: Any) -> None:
        """No buffers cross PCIe besides the group's frozen weights."""

    def done(self, name: str) -> bool:
        return True

    def wait(self, name: str) -> None:
        """The frozen base needs no update before it is read."""

    def load(self, name: str) -> None:
        return None

    def issue_ahead(self, i: int) -> None:
        """No gradient copies to issue."""

    def fetch_early(self, j: int) -> None:
        """No optimizer state crosses: the adapters' stays on the device."""

    def issue_through(self, pos: int, wait: bool = True) -> None:
        """No gradient copies to issue."""

    # ---- state and control

    def pending_updates(self) -> dict[str, Future]:
        return {}

    def finish(self) -> None:
        jax.block_until_ready(self.adapters.trees)

    def close(self) -> None:
        self.finish()
