"""Host <-> accelerator paths, at full speed where the platform allows it.

Measured on an H100 (docs/design.md section 1): host->GPU from plain numpy is staged through a bounce buffer
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
from typing import Any, Callable, Sequence

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
        self._direct: Any = None  # _DirectCopy once made (False: unavailable)
        self._directs: dict[int, Any] = {}  # per device id, for one device's share (``direct_into``)

    # ------------------------------------------------------------------ host buffers -> device

    def register(self, name: str, buf: np.ndarray, pin_fallback: bool = True,
                 span: tuple[int, int] | None = None) -> None:
        """Make a host buffer a fast transfer source (DMA registration, or a pinned copy).

        A buffer that cannot be registered falls back alone; the others keep their direct DMA.
        Without ``pin_fallback`` it then stays a plain (staged) source: no pinned copy of it is made.
        ``span`` (values ``[lo, hi)``, a sharded store's own): only the pages holding them are registered (pinning
        the rest would back them with memory), and a buffer that cannot be stays a plain source.
        """
        if self.mode == "dma_map":
            addr, nbytes = buf.ctypes.data, buf.nbytes
            if span is not None:
                addr, nbytes = page_span(addr, span[0] * buf.itemsize, span[1] * buf.itemsize)
                pin_fallback = False
            try:
                if nbytes:
                    self.device.client.dma_map(addr, nbytes)
                    self._mapped.append((addr, nbytes))
                return
            except Exception as e:  # noqa: BLE001 - any failure means: use the fallback for this buffer
                self.fallback_reason = f"{name}: dma_map failed ({type(e).__name__}: {str(e)[:120]})"
                if self.host_sharding is None:
                    return
        if not pin_fallback:
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

    def copy_into(self, x: jax.Array, dst: np.ndarray) -> None:
        """Copy a device array into an existing host buffer (same size); blocks until it has landed.

        On the GPU, into a DMA-registered buffer: one direct device->host DMA on a stream of its own
        (``_DirectCopy``: the store is written where it lies, at PCIe speed, with no pinned staging
        buffer and no host memcpy). Elsewhere, or when the driver is not reachable: through a pinned
        array and a host copy.

        With several GPUs ``x`` is one GPU's array (a replicated device update writes back from the group's
        own GPU), and the DMA runs on that GPU's link. Through pinned memory it would stage a whole group
        in XLA's pinned pool, which the plan does not count: the 110B on four H200s ran out of it in its
        first step, asking for a 5.06 GiB group (experiments/bench_memory_plan.py)."""
        if self.mesh is not None and len(self.devices) > 1:
            wait = self.direct_into(x, dst)
            if wait is not None:
                wait()
                return
        direct = self._direct_copy()
        if direct is not None and self._is_mapped(dst):
            x.block_until_ready()
            direct.copy(dst.ctypes.data, x.addressable_data(0).unsafe_buffer_pointer(), dst.nbytes)
            return
        src = self.host_view(self.to_host(x) if self.on_gpu else x)
        np.copyto(dst, src.reshape(dst.shape).view(dst.dtype))

    def direct_into(self, x: jax.Array, dst: np.ndarray) -> Callable[[], None] | None:
        """Start the copy of the first ``dst.size`` values of ``x`` (on one device) into ``dst`` by a direct
        device->host DMA on that device, where ``dst`` lies in a registered buffer, and return what waits for it;
        None (nothing copied) where it cannot (``copy_into``'s path for one GPU's share of a group,
        ``engine/shards.py``: it starts every GPU's share before waiting for one, so the links run together)."""
        if not self.on_gpu or self.mode != "dma_map" or not self._is_mapped(dst):
            return None
        (dev,) = x.devices()
        direct = self._directs.get(dev.id)
        if direct is None:
            try:
                direct = _DirectCopy(dev.local_hardware_id)
            except Exception as e:  # noqa: BLE001 - no driver library: the pinned path serves
                direct = False
                self.fallback_reason = f"direct device->host copy unavailable ({type(e).__name__}: {str(e)[:120]})"
            self._directs[dev.id] = direct
        if not direct:
            return None
        x.block_until_ready()
        return direct.start(dst.ctypes.data, x.unsafe_buffer_pointer(), dst.nbytes)

    def _is_mapped(self, buf: np.ndarray) -> bool:
        lo, n = buf.ctypes.data, buf.nbytes
        return any(p <= lo and lo + n <= p + size for p, size in self._mapped)

    def _direct_copy(self) -> "_DirectCopy | None":
        if not self.on_gpu or self.mode != "dma_map" or self.mesh is not None and len(self.devices) > 1:
            return None
        if self._direct is None:
            try:
                self._direct = _DirectCopy(self.device.local_hardware_id)
            except Exception as e:  # noqa: BLE001 - no driver library: the pinned path serves
                self._direct = False
                self.fallback_reason = f"direct device->host copy unavailable ({type(e).__name__}: {str(e)[:120]})"
        return self._direct or None

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


class _DirectCopy:
    """Device->host DMA into a registered host buffer through the CUDA driver API (ctypes): the one
    copy JAX has no call for (``device_put`` to host memory always allocates a new buffer).

    It runs on a non-blocking stream of its own in the device's primary context (the one XLA uses),
    so it overlaps XLA's compute and copy streams; the caller keeps the source array alive and
    ready (``block_until_ready``) while it runs. One stream per calling thread."""

    def __init__(self, ordinal: int):
        import ctypes

        self._c = ctypes
        self._lib = lib = ctypes.CDLL("libcuda.so.1")
        lib.cuMemcpyDtoHAsync_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        lib.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
        lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        self._check(lib.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self._check(lib.cuDeviceGet(ctypes.byref(dev), int(ordinal)), "cuDeviceGet")
        self._ctx = ctypes.c_void_p()
        self._check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(self._ctx), dev), "cuDevicePrimaryCtxRetain")
        self._streams = threading.local()

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed with CUDA error {rc}")

    def copy(self, dst_ptr: int, src_ptr: int, nbytes: int) -> None:
        self.start(dst_ptr, src_ptr, nbytes)()

    def start(self, dst_ptr: int, src_ptr: int, nbytes: int) -> Callable[[], None]:
        """Issue the copy on this thread's stream of this device and return what waits for it (the source must
        stay alive until then): a thread copying from several GPUs starts each before waiting for any, and the
        GPUs' links run at once (one at a time, four H200s wrote back a split update's state at ~45 GB/s in all,
        one link's rate: experiments/bench_data_parallel.py)."""
        c, lib = self._c, self._lib
        s = getattr(self._streams, "s", None)
        # (current on every call: one thread may copy from several devices, each its own context)
        self._check(lib.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        if s is None:
            s = c.c_void_p()
            self._check(lib.cuStreamCreate(c.byref(s), 1), "cuStreamCreate")  # CU_STREAM_NON_BLOCKING
            self._streams.s = s
        self._check(lib.cuMemcpyDtoHAsync_v2(dst_ptr, src_ptr, nbytes, s), "cuMemcpyDtoHAsync")

        def wait() -> None:
            self._check(lib.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
            self._check(lib.cuStreamSynchronize(s), "cuStreamSynchronize")
        return wait


def page_span(addr: int, lo: int, hi: int) -> tuple[int, int]:
    """(start, length) of the whole pages that hold bytes ``[lo, hi)`` of a buffer at ``addr``."""
    import mmap

    if hi <= lo:
        return addr, 0
    page = mmap.PAGESIZE
    start = (addr + lo) // page * page
    return start, -(-(addr + hi) // page) * page - start
