"""Host <-> accelerator paths, at full speed where the platform allows it.

Measured on an H100 (DESIGN.md §1): host->GPU from plain numpy is staged through a bounce buffer
(9-10 GB/s); from page-aligned numpy registered with ``client.dma_map`` it is a direct DMA
(52-54 GB/s); GPU->host into ``pinned_host`` memory also runs at 53 GB/s, and
``np.asarray`` of such an array is a zero-copy view. ``np.asarray`` of a device array (1.6-2 GB/s)
never appears on the hot path.

``dma_map`` is not a public API, so it is wrapped here and nowhere else. When it is missing or
fails, the fallback keeps a ``pinned_host`` jax copy of each streamed buffer, refreshed after each
host write; the host->GPU copy then starts from pinned memory (full speed, one extra host memcpy
per update). The CPU backend exposes the same memory kinds, so both paths run in the tests.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding


class Transfers:
    """Moves streamed buffers to the device and gradients back to host memory."""

    def __init__(self, device: jax.Device | Sequence[jax.Device], mode: str = "auto", mesh: Mesh | None = None):
        """``mode``: ``auto`` (dma_map on GPU, plain device_put on CPU), ``dma_map``, ``pinned``
        (the fallback, forced), or ``plain`` (numpy device_put, for comparison only).

        Several local devices (data parallel): each streamed buffer is copied to every one of them
        (each GPU over its own PCIe link) and the copies form one array replicated over ``mesh``
        (whose other devices, in a multi-process run, belong to other processes)."""
        devices = [device] if isinstance(device, jax.Device) else list(device)
        self.devices, self.device, self.mesh = devices, devices[0], mesh
        self.on_gpu = self.device.platform == "gpu"
        kinds = {m.kind for m in self.device.addressable_memories()}
        self.device_shardings = [SingleDeviceSharding(d, memory_kind="device") if "device" in kinds
                                 else SingleDeviceSharding(d) for d in devices]
        self.host_shardings = {d: SingleDeviceSharding(d, memory_kind="pinned_host") for d in devices} \
            if "pinned_host" in kinds else None
        self.device_sharding = self.device_shardings[0]
        self.host_sharding = self.host_shardings[self.device] if self.host_shardings else None
        if mesh is not None:
            self.replicated = NamedSharding(mesh, PartitionSpec(), memory_kind="device" if "device" in kinds else None)
            self.batch_device = NamedSharding(mesh, PartitionSpec("data"),
                                              memory_kind="device" if "device" in kinds else None)
            self.batch_host = NamedSharding(mesh, PartitionSpec("data"), memory_kind="pinned_host") \
                if "pinned_host" in kinds else None
        mode = os.environ.get("MEGATRAIN_TRANSFER_MODE", mode)
        if mode == "auto":
            mode = "dma_map" if self.on_gpu else "plain"
        if mode == "pinned" and self.host_sharding is None:
            mode = "plain"
        self.mode = mode
        self._mapped: list[tuple[int, int]] = []
        self._pinned: dict[str, jax.Array] = {}
        self._fallback: set[str] = set()  # buffers served from a pinned copy
        self._lock = threading.Lock()
        self.fallback_reason: str | None = None

    # ------------------------------------------------------------------ host buffers -> device

    def register(self, name: str, buf: np.ndarray) -> None:
        """Make a host buffer a fast transfer source (DMA registration, or a pinned copy).

        A buffer that cannot be registered falls back alone; the others keep their direct DMA.
        """
        if self.mode == "dma_map":
            try:
                self.device.client.dma_map(buf.ctypes.data, buf.nbytes)
                self._mapped.append((buf.ctypes.data, buf.nbytes))
                return
            except Exception as e:  # noqa: BLE001 - any failure means: use the fallback for this buffer
                self.fallback_reason = f"{name}: dma_map failed ({type(e).__name__}: {str(e)[:120]})"
                if self.host_sharding is None:
                    return
        if self.mode in ("dma_map", "pinned"):
            self._fallback.add(name)
            self.host_written(name, buf)

    def host_written(self, name: str, buf: np.ndarray) -> None:
        """Called after the host rewrote ``buf`` (an optimizer update): refresh its pinned copy."""
        if name in self._fallback:
            arr = jax.device_put(buf, self.host_sharding)
            arr.block_until_ready()
            with self._lock:
                self._pinned[name] = arr

    def to_device(self, name: str, buf: np.ndarray) -> jax.Array:
        """Start copying a streamed buffer to the device(s); returns at once (async dispatch).

        With a mesh: one copy per local device, issued one after the other (each device's own
        link), assembled into one array replicated over the mesh. The caller must not write
        ``buf`` until the returned array is ready.
        """
        src = buf
        if name in self._fallback:
            with self._lock:
                src = self._pinned[name]
        if self.mesh is None:
            return jax.device_put(src, self.device_sharding)
        parts = [jax.device_put(src, sh) for sh in self.device_shardings]
        return jax.make_array_from_single_device_arrays(buf.shape, self.replicated, parts)

    # ------------------------------------------------------------------ device -> host

    def to_host(self, x: jax.Array) -> jax.Array:
        """Start copying a device array into pinned host memory.

        A ``device_put`` (its own copy stream), not a jit with a pinned output: measured on an
        H200, the jit copy runs on the compute stream and never overlaps compute.
        """
        if self.host_shardings is None:
            return x
        (dev,) = x.devices()
        return jax.device_put(x, self.host_shardings[dev])

    def host_view(self, x: jax.Array) -> np.ndarray:
        """Zero-copy numpy view of an array in host memory; waits until it has landed."""
        return np.asarray(x)

    def offload(self, x: jax.Array) -> jax.Array:
        """Park an activation in pinned host memory."""
        if self.host_sharding is None:
            return x
        return jax.device_put(x, self.batch_host if self.mesh is not None else self.host_sharding)

    def reload(self, x: jax.Array) -> jax.Array:
        return jax.device_put(x, self.batch_device if self.mesh is not None else self.device_sharding)

    def close(self) -> None:
        """Unregister the host buffers: their memory may be unmapped and the range reused next."""
        for ptr, _ in self._mapped:
            try:
                self.device.client.dma_unmap(ptr)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        self._mapped.clear()
        self._pinned.clear()
        self._fallback.clear()

    def describe(self) -> dict[str, Any]:
        return {"mode": self.mode, "registered_buffers": len(self._mapped), "fallback_buffers": len(self._fallback),
                "registered_bytes": sum(n for _, n in self._mapped), "fallback_reason": self.fallback_reason}
