"""Host optimizers: the per-group (per-layer) update the streaming engine runs on fp32 host buffers.

A *group* is one streamed unit (a transformer block, the embedding, the head). Its parameters live in
one flat, page-aligned fp32 buffer (the master copy); its gradient arrives as a flat fp32 buffer of
the same length; the engine hands both to ``update`` as soon as the gradient has landed, possibly from
a worker thread while the GPU works on other layers.

Every host optimizer is the exact equivalent of an optax transformation (``as_optax``), so the
in-memory reference trainer runs the same optimizer and the two trainers can be compared.

Optimizer state is opaque to the caller except through ``state_to_arrays`` / ``state_from_arrays``,
which turn it into a flat ``dict[str, np.ndarray]`` and back: that is what a checkpoint stores.
Any optax transformation: ``optax_flat.OptaxHostOptimizer``.
"""
from __future__ import annotations

import mmap
import threading
from collections.abc import Callable
from typing import Any, Protocol

import jax
import numpy as np
import optax

from megatrain_jax.optim.fused_adamw import fused_adamw_step

Unflatten = Callable[[np.ndarray], Any]  # flat 1-D array of a group -> pytree of views into it


def alloc_aligned(n: int, dtype=np.float32, hugepages: bool = True) -> np.ndarray:
    """A 1-D zero-filled array of ``n`` elements on its own page-aligned anonymous mmap.

    Page alignment is what ``client.dma_map`` needs for full-speed transfers. The mapping lives as long
    as the array (``arr.base`` is a memoryview that holds the mmap). With ``hugepages``, buffers of 4 MiB
    or more are advised to use transparent huge pages, as numpy does for its own large arrays: the
    optimizer kernels stream through gigabytes and 4 KiB pages cost them TLB misses."""
    dtype = np.dtype(dtype)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    nbytes = max(n * dtype.itemsize, 1)
    nbytes = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                    prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if hugepages and nbytes >= 4 << 20 and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP disabled in this kernel: 4 KiB pages it is
            pass
    return np.frombuffer(buf, dtype=dtype, count=n)


def release_outside(a: np.ndarray, lo: int, hi: int) -> int:
    """Give back to the kernel the pages of ``a`` (an ``alloc_aligned`` array) wholly outside values ``[lo, hi)``:
    they read as zeros afterwards and cost no memory until written (``train.host_state=sharded``: a process backs
    only its own shares of the store). Returns the bytes released; 0 for an array of another origin."""
    base = a.base.obj if isinstance(a.base, memoryview) else None
    if not isinstance(base, mmap.mmap) or a.base.nbytes < a.nbytes:
        return 0
    page, size, step = mmap.PAGESIZE, len(base), a.dtype.itemsize
    start, end = lo * step // page * page, -(-hi * step // page) * page  # every page holding a value of [lo, hi)
    freed = 0
    for a0, a1 in ((0, min(start, size)), (max(end, start), size)):
        if a1 > a0:
            base.madvise(mmap.MADV_DONTNEED, a0, a1 - a0)
            freed += a1 - a0
    return freed


def global_norm_scale(sq_norm_sum: float, clip_norm: float | None) -> float:
    """The gradient factor that ``optax.clip_by_global_norm(clip_norm)`` applies.

    ``sq_norm_sum`` is the sum of squares of every gradient element of the step (all groups). optax
    computes ``norm = sqrt(sum)`` in float32 and keeps the gradient when ``norm < clip_norm``, else uses
    ``(g / norm) * clip_norm``; one factor ``clip_norm / norm`` (rounded once) reproduces that to within
    1 ulp per element. A NaN/inf sum gives NaN/0, as optax would: skip such steps before updating."""
    if clip_norm is None:
        return 1.0
    norm = np.sqrt(np.float32(sq_norm_sum))
    if norm < np.float32(clip_norm):
        return 1.0
    return float(np.float32(np.float64(np.float32(clip_norm)) / np.float64(norm)))


class HostOptimizer(Protocol):
    """What the streaming engine calls, per group.

    Contract:
    - ``params`` and ``grad`` are 1-D contiguous float32; ``bf16_out`` (optional) is 1-D uint16 of the
      same length and receives the bfloat16 bits (round to nearest even) of the updated params. Where
      ``bf16_grads`` is true, ``grad`` may also be the bfloat16 bits (uint16) of a gradient held in bf16:
      the kernel widens each value as it reads it, instead of a widening pass first.
    - ``count`` is the 1-based optimizer step; ``grad_scale`` multiplies the gradient first (global-norm
      clipping: ``global_norm_scale``). Call ``update`` exactly once per group per applied step.
    - ``unflatten`` maps a flat fp32 array of the group to its pytree of views (what optax sees); the
      fused kernels ignore it, ``OptaxHostOptimizer`` needs it when masks or per-leaf shapes matter.
    - ``update`` is safe to call concurrently for different groups (never for the same group).
    - ``state_to_arrays`` returns a flat ``dict[str, np.ndarray]`` to checkpoint; read it before the
      next ``update`` of that group (it may be views). ``state_from_arrays`` rebuilds a state from it.
    """

    def init_state(self, params: np.ndarray, unflatten: Unflatten | None = None) -> Any: ...

    def update(self, params: np.ndarray, grad: np.ndarray, state: Any, count: int,
               grad_scale: float = 1.0, bf16_out: np.ndarray | None = None,
               unflatten: Unflatten | None = None) -> None: ...

    def state_to_arrays(self, state: Any) -> dict[str, np.ndarray]: ...

    def state_from_arrays(self, arrays: dict[str, np.ndarray], params: np.ndarray,
                          unflatten: Unflatten | None = None) -> Any: ...

    def as_optax(self) -> optax.GradientTransformation: ...


def device_or_cpu(device=None):
    """``device``, else the first CPU device. Public: optim/optax_flat.py places its state with it."""
    return device if device is not None else jax.local_devices(backend="cpu")[0]


class ScheduleOnCpu:
    """A schedule's float32 value per step, computed once, op by op, on the CPU device: never on the
    GPU (reading a GPU scalar back would wait behind the queued layer computations), and not jitted,
    so it is bit-identical to optax's eager evaluation (a jitted schedule may differ by an ulp where
    XLA fuses into FMAs).
    Public: optim/named.py evaluates the named optimizers' schedules with it."""

    def __init__(self, schedule: optax.Schedule, device=None):
        self._schedule = schedule
        self._device = device
        self._cache: dict[int, np.float32] = {}
        self._lock = threading.Lock()

    def __call__(self, step: int) -> np.float32:
        value = self._cache.get(step)
        if value is None:
            with self._lock:
                dev = device_or_cpu(self._device)
                with jax.default_device(dev):
                    value = np.float32(self._schedule(jax.device_put(np.int32(step), dev)))
                if len(self._cache) > 4096:
                    self._cache.clear()
                self._cache[step] = value
        return value


# -------------------------------------------------------------------------------------- fused AdamW


class FusedAdamW:
    """``optax.adamw`` as one in-place numba pass per group (``fused_adamw.py``); bit-identical to
    optax run op by op, within 1 ulp of a jitted optax step.

    State: ``{'mu', 'nu'}``, float32 page-aligned arrays (``state_to_arrays`` returns them as views).
    The learning rate of step ``count`` is ``schedule(count - 1)``, as in optax (its schedule sees the
    count before the increment: 0 at the first update). Weight decay applies to every element of the
    group (optax's ``mask`` is not supported: use ``OptaxHostOptimizer`` for masks); a family's frozen leaves
    are put back by the engine after each update (``engine/updates_base.py``: ``Updates.freeze``)."""

    def __init__(self, learning_rate: float | optax.Schedule, b1: float = 0.9, b2: float = 0.999,
                 eps: float = 1e-8, eps_root: float = 0.0, weight_decay: float = 1e-4,
                 cpu_device=None):
        if callable(weight_decay):
            raise TypeError("FusedAdamW takes a constant weight_decay; use OptaxHostOptimizer for a "
                            "scheduled one")
        self.learning_rate = learning_rate
        self.b1, self.b2, self.eps, self.eps_root = float(b1), float(b2), float(eps), float(eps_root)
        self.weight_decay = float(weight_decay)
        self._lr = ScheduleOnCpu(learning_rate, cpu_device) if callable(learning_rate) else None

    def lr_at(self, count: int) -> float | np.float32:
        """The learning rate that update ``count`` (1-based) uses."""
        return self._lr(count - 1) if self._lr is not None else self.learning_rate

    def init_state(self, params: np.ndarray, unflatten: Unflatten | None = None) -> dict[str, np.ndarray]:
        n = params.shape[0]
        return {"mu": alloc_aligned(n, np.float32), "nu": alloc_aligned(n, np.float32)}

    # the engine updates a group slab by slab as its gradient lands (engine._GradOut): any element
    # range is a valid slice of this elementwise state
    chunk_align = 1

    def state_slice(self, state: dict[str, np.ndarray], lo: int, hi: int) -> dict[str, np.ndarray]:
        """The state of elements ``lo:hi`` (views: updating them updates the group's state)."""
        return {k: v[lo:hi] for k, v in state.items()}

    def bytes_per_param(self) -> float:
        """Host bytes of optimizer state per parameter (the memory plan asks)."""
        return 8.0

    moments = "float32"  # the moment format (``device_adamw.device_adamw_step`` takes the same name)
    bf16_grads = True  # ``update`` takes a bf16 gradient's bits (uint16): the kernels widen as they read
    runs_on_device = True  # ``train.update_on=device``: ``device_step`` runs this update on the accelerator

    shards_on_device = True  # elementwise: with several GPUs each updates its share of a group (engine/shards.py)
    elementwise_state = True  # one state value per parameter, at its offset: a frozen leaf's state is put back too

    def device_step(self, param, grad, state: dict, scalars: tuple, chunk: int | None = None,
                    unflatten: Unflatten | None = None, mesh: Any = None):
        """This update on the accelerator (``optim/device_adamw.py``, ``chunk`` values per slice):
        (new param, new state); the param and state arrays are donated. ``scalars``:
        ``device_scalars(count, grad_scale)``; ``unflatten`` (the group's layout) is not needed here;
        ``mesh``: the arrays are split over its devices, each updating its share."""
        from megatrain_jax.optim.device_adamw import device_adamw_step

        return device_adamw_step(self.moments, param, grad, state, scalars, chunk, mesh=mesh)

    def device_scalars(self, count: int, grad_scale: float = 1.0) -> tuple:
        """The step's float32 scalars as the host kernels round them, for the device-side update
        (``train.update_on=device``: ``optim/device_adamw.py``)."""
        from megatrain_jax.optim.compact_adamw import adamw_scalars

        return adamw_scalars(self.lr_at(count), self.b1, self.b2, self.eps, self.eps_root, self.weight_decay, count,
                        grad_scale)

    def update(self, params, grad, state, count, grad_scale=1.0, bf16_out=None, unflatten=None) -> None:
        fused_adamw_step(params, grad, state["mu"], state["nu"], bf16_out, lr=self.lr_at(count),
                         b1=self.b1, b2=self.b2, eps=self.eps, eps_root=self.eps_root,
                         weight_decay=self.weight_decay, count=count, grad_scale=grad_scale)

    def state_to_arrays(self, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"mu": state["mu"], "nu": state["nu"]}

    def state_from_arrays(self, arrays, params, unflatten=None) -> dict[str, np.ndarray]:
        check_keys(arrays, {"mu", "nu"})
        n = params.shape[0]
        state = self.init_state(params)
        for k in ("mu", "nu"):
            a = np.asarray(arrays[k])
            if a.shape != (n,) or a.dtype != np.float32:
                raise ValueError(f"optimizer state {k!r}: expected float32 ({n},), got {a.dtype} {a.shape}")
            state[k][:] = a
        return state

    def as_optax(self) -> optax.GradientTransformation:
        return optax.adamw(learning_rate=self.learning_rate, b1=self.b1, b2=self.b2, eps=self.eps,
                           eps_root=self.eps_root, weight_decay=self.weight_decay)


class CompactAdamW(FusedAdamW):
    """AdamW with compact moments (``compact_adamw.py``): ``moments="bfloat16"`` (bf16 bits, round to
    nearest even; 4 bytes/param) or ``"int8"`` (blockwise 8-bit, 2048 values per block, one fp32
    absmax per block and moment; about 2 bytes/param). Same arithmetic, schedule and bias
    corrections as ``FusedAdamW``; the state keys name the mode, so a checkpoint of one mode is
    refused by another (``state_from_arrays``)."""

    def __init__(self, learning_rate, moments: str, **kwargs):
        if moments not in ("bfloat16", "int8"):
            raise ValueError(f"moments must be bfloat16 or int8, got {moments!r}")
        super().__init__(learning_rate, **kwargs)
        self.moments = moments
        import megatrain_jax.optim.compact_adamw as compact_adamw

        self._ca = compact_adamw
        if moments == "int8":
            compact_adamw.check_gather_env()
        self.chunk_align = compact_adamw.BLOCK if moments == "int8" else 1

    @property
    def elementwise_state(self) -> bool:
        """bf16 moments sit at each parameter's offset; int8 codes share a block's scale with their neighbours."""
        return self.moments == "bfloat16"

    def bytes_per_param(self) -> float:
        return 4.0 if self.moments == "bfloat16" else 2.0 + 8.0 / self._ca.BLOCK

    def _keys(self) -> dict[str, tuple[Any, bool]]:
        """state key -> (dtype, per-block?)"""
        if self.moments == "bfloat16":
            return {"mu_bf16": (np.uint16, False), "nu_bf16": (np.uint16, False)}
        return {"mu_q": (np.uint8, False), "mu_scale": (np.float32, True),
                "nu_q": (np.uint8, False), "nu_scale": (np.float32, True)}

    def init_state(self, params: np.ndarray, unflatten: Unflatten | None = None) -> dict[str, np.ndarray]:
        n = params.shape[0]
        nb = -(-n // self._ca.BLOCK)
        return {k: alloc_aligned(nb if blk else n, dt) for k, (dt, blk) in self._keys().items()}

    def state_slice(self, state: dict[str, np.ndarray], lo: int, hi: int) -> dict[str, np.ndarray]:
        if self.moments == "bfloat16":
            return {k: v[lo:hi] for k, v in state.items()}
        b = self._ca.BLOCK
        if lo % b:
            raise ValueError(f"int8 state slices start on a {b}-value block boundary, got {lo}")
        return {k: (v[lo // b:-(-hi // b)] if blk else v[lo:hi]) for k, v in state.items()
                for blk in [self._keys()[k][1]]}

    def update(self, params, grad, state, count, grad_scale=1.0, bf16_out=None, unflatten=None) -> None:
        step = self._ca.adamw_int8_step if self.moments == "int8" else self._ca.adamw_bf16_step
        step(params, grad, state, bf16_out, lr=self.lr_at(count), b1=self.b1, b2=self.b2, eps=self.eps,
             eps_root=self.eps_root, weight_decay=self.weight_decay, count=count, grad_scale=grad_scale)

    def state_to_arrays(self, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(state)

    def state_from_arrays(self, arrays, params, unflatten=None) -> dict[str, np.ndarray]:
        keys = self._keys()
        if set(arrays) != set(keys):
            raise ValueError(f"optimizer state keys {sorted(arrays)} are not {self.moments} moments "
                             f"({sorted(keys)}): optim.moments differs from the checkpoint's")
        state = self.init_state(params)
        for k, dst in state.items():
            a = np.asarray(arrays[k])
            if a.shape != dst.shape or a.dtype != dst.dtype:
                raise ValueError(f"optimizer state {k!r}: expected {dst.dtype} {dst.shape}, got {a.dtype} {a.shape}")
            dst[:] = a
        return state

    def as_optax(self) -> optax.GradientTransformation:
        """bf16: optax.adamw with ``mu_dtype=bfloat16`` (optax keeps nu in fp32, so it is close, not
        equal). int8 has no optax equivalent: the reference trainer refuses it."""
        if self.moments == "int8":
            from megatrain_jax.errors import UserError

            raise UserError("optim.moments", "int8 moments have no in-memory (optax) equivalent",
                            "use train.engine=streamed, or optim.moments=float32/bfloat16 with the reference engine")
        import jax.numpy as jnp

        return optax.adamw(learning_rate=self.learning_rate, b1=self.b1, b2=self.b2, eps=self.eps,
                           eps_root=self.eps_root, weight_decay=self.weight_decay, mu_dtype=jnp.bfloat16)


def check_keys(arrays: dict, expected: set[str]) -> None:
    """Optimizer state keys must be exactly ``expected``. Public: optim/optax_flat.py checks its state too."""
    missing, extra = expected - set(arrays), set(arrays) - expected
    if missing or extra:
        raise ValueError(f"optimizer state keys do not match: missing {sorted(missing)}, "
                         f"unexpected {sorted(extra)}")


def resident_bytes(a: np.ndarray) -> int:
    """Bytes of ``a``'s pages backed by memory now (``mincore``; whole pages, so up to a page more than its data)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    addr = a.__array_interface__["data"][0]
    start = addr - addr % page
    length = addr + a.nbytes - start
    pages = -(-length // page)
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return int((np.frombuffer(vec, np.uint8) & 1).sum()) * page
