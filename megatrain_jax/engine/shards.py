"""A group's flat arrays split over the GPUs, for device-side updates with several of them.

With ``update_on=device`` and N GPUs each GPU updates its 1/N share of every group: its share of the
fp32 master and optimizer state crosses its own PCIe link (1/N of the one-GPU traffic per link), the
gradient reaches it reduce-scattered over NVLink (``reduce``: each GPU receives only the sum of its
share), a gradient held for the clipping norm waits there sharded (1/N of the GPU memory), and the
updated master is all-gathered over NVLink into the replicated weights the block computes with
(``gather``). The write-back sends each GPU's share to its place in the host store.

Shares are equal and whole optimizer blocks (``align`` values: the int8 moments' scale blocks never
straddle two GPUs), so a group is padded on the device to a multiple of N x align values; the padding is
zeros (a zero gradient, zero state: its update is zero) and never reaches the host store.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from megatrain_jax.engine.kernels import NO_AUTOTUNE, named


@lru_cache(maxsize=None)
def _pad_to(n: int, total: int) -> Callable[[jax.Array], jax.Array]:
    return jax.jit(named("shard_pad", lambda x: jnp.pad(x, (0, total - n))), compiler_options=NO_AUTOTUNE)


@lru_cache(maxsize=None)
def _zeros(n: int, dtype) -> Callable[[], jax.Array]:
    return jax.jit(named("shard_zeros", lambda: jnp.zeros((n,), dtype)))


def share_bounds(n: int, n_dev: int, align: int, j: int) -> tuple[int, int]:
    """The values of a group of ``n`` that device ``j`` of ``n_dev`` owns: ``[lo, hi)``, clipped to the group (a
    share past its end is padding only: empty). The same arithmetic as ``Shards.padded`` and ``to_device``."""
    unit = n_dev * align
    share = -(-int(n) // unit) * unit // n_dev
    return min(j * share, n), min((j + 1) * share, n)


def process_bounds(n: int, devices: list, align: int) -> tuple[int, int]:
    """The values of a group of ``n`` this process's devices own (``train.host_state=sharded``): one contiguous range,
    the run's devices being in process order (``distributed.run_devices``)."""
    mine = [j for j, d in enumerate(devices) if d.process_index == jax.process_index()]
    if mine != list(range(mine[0], mine[-1] + 1)):
        raise ValueError(f"this process's devices {mine} are not contiguous in the run's device order")
    return share_bounds(n, len(devices), align, mine[0])[0], share_bounds(n, len(devices), align, mine[-1])[1]


class Shards:
    """Flat arrays of the host store as equal padded shares of the mesh's devices, and back."""

    def __init__(self, mesh: Mesh, align: int, device_kind: str | None, host_kind: str | None,
                 direct_into: Callable[[jax.Array, np.ndarray], Callable[[], None] | None] | None = None):
        """``direct_into(share, dst)``: starts one device's share into its registered host slice by a direct DMA and
        returns what waits for it, or None (then through pinned memory: ``transfer.Transfers.direct_into``)."""
        self.mesh, self.align = mesh, int(align)
        self.direct_into = direct_into
        self.n_dev = mesh.devices.size
        self.sharded = NamedSharding(mesh, P("data"), memory_kind=device_kind)
        self.replicated = NamedSharding(mesh, P(), memory_kind=device_kind)
        self.host_sharded = NamedSharding(mesh, P("data"), memory_kind=host_kind) if host_kind else None
        self._host_one = {d: jax.sharding.SingleDeviceSharding(d, memory_kind=host_kind) for d in mesh.devices.flat} \
            if host_kind else None
        self._dev_one = {d: jax.sharding.SingleDeviceSharding(d, memory_kind=device_kind) for d in mesh.devices.flat}
        self._gathers: dict[tuple, Callable] = {}
        self._reshards: dict[tuple, Callable] = {}

    # ------------------------------------------------------------------ sizes

    def padded(self, n: int) -> int:
        """A group of ``n`` values on the devices: a multiple of N x align."""
        unit = self.n_dev * self.align
        return -(-int(n) // unit) * unit

    def padded_like(self, a_len: int, n: int) -> int:
        """The padded length of a group's array of ``a_len`` values (its master and elementwise state: ``n``;
        per-block state such as int8 scales: one value per ``align``)."""
        if a_len == n:
            return self.padded(n)
        if a_len == -(-n // self.align):
            return self.padded(n) // self.align
        raise ValueError(f"a group array of {a_len} values is neither elementwise ({n}) nor per block of "
                         f"{self.align} ({-(-n // self.align)})")

    # ------------------------------------------------------------------ host <-> devices

    def to_device(self, buf: np.ndarray, total: int) -> jax.Array:
        """``buf`` (host, flat) split into the devices' equal shares of ``total`` values, each copied over its
        own device's link (async); the tail past ``buf`` is zeros."""
        share, n = total // self.n_dev, buf.shape[0]
        parts = []
        for dev, idx in self.sharded.addressable_devices_indices_map((total,)).items():
            lo = idx[0].start or 0
            hi = min(lo + share, n)
            if hi <= lo:
                part = jax.device_put(_zeros(share, buf.dtype)(), self._dev_one[dev])
            else:
                part = jax.device_put(buf[lo:hi], self._dev_one[dev])
                if hi - lo < share:
                    part = _pad_to(hi - lo, share)(part)
            parts.append(part)
        return jax.make_array_from_single_device_arrays((total,), self.sharded, parts)

    def copy_into(self, x: jax.Array, dst: np.ndarray) -> None:
        """Each device's share of ``x`` into its place in ``dst`` (the padding past ``dst`` is dropped); every
        share's copy is issued before the first is waited for."""
        n = dst.shape[0]
        landing, direct = [], []
        for s in x.addressable_shards:
            lo = s.index[0].start or 0
            if lo >= n:
                continue
            hi = min(lo + s.data.shape[0], n)
            wait = self.direct_into(s.data, dst[lo:hi]) if self.direct_into is not None else None
            if wait is not None:  # (a direct DMA into the registered store: no pinned staging)
                direct.append(wait)
                continue
            h = jax.device_put(s.data, self._host_one[s.device]) if self._host_one else s.data
            landing.append((lo, min(lo + s.data.shape[0], n), h))
        for wait in direct:
            wait()
        for lo, hi, h in landing:
            np.copyto(dst[lo:hi], np.asarray(h)[:hi - lo].view(dst.dtype))

    # ------------------------------------------------------------------ on the devices

    def gather(self, x: jax.Array, n: int) -> jax.Array:
        """The replicated first ``n`` values of a sharded array (an all-gather over the devices' links)."""
        key = (x.shape[0], n, x.dtype)
        fn = self._gathers.get(key)
        if fn is None:
            fn = jax.jit(named("shard_gather", lambda a: a[:n]), out_shardings=self.replicated,
                         compiler_options=NO_AUTOTUNE)
            self._gathers[key] = fn
        return fn(x)

    def shard(self, x: jax.Array, total: int) -> jax.Array:
        """A replicated (or single-device) flat array as the devices' padded shares of ``total`` values."""
        if x.sharding == self.sharded and x.shape[0] == total:
            return x
        if len(x.devices()) == 1 and self.n_dev > 1:
            x = jax.device_put(x, self.replicated)
        key = (x.shape[0], total, x.dtype)
        fn = self._reshards.get(key)
        if fn is None:
            n = x.shape[0]
            fn = jax.jit(named("shard_split", lambda a: jnp.pad(a, (0, total - n))), out_shardings=self.sharded,
                         compiler_options=NO_AUTOTUNE)
            self._reshards[key] = fn
        return fn(x)
