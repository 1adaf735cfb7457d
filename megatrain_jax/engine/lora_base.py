"""The frozen base of LoRA training in host memory: no fp32 master, no optimizer state, no gradient.

Each group (``embed``, ``block_i``, ``head``) is kept in ``model.lora.base_dtype``:

- ``bfloat16`` (2 bytes/param) or ``float32``: one flat buffer, streamed as it is and cast on the
  device to the compute dtype.
- ``int8`` (blocks only; the embedding and head stay bfloat16): every matrix leaf ``(..., in, out)``
  is quantised per output channel, symmetric: ``scale = max|W[..., :, j]| / 127``,
  ``q = round(W / scale)`` in [-127, 127]; its scales (fp32) and the vector leaves (norm scales,
  biases, fp32) come first in the group's one byte buffer, the int8 values after them. The buffer
  crosses PCIe whole; the device reinterprets its two parts and dequantises ``q * scale`` in fp32,
  then casts to the compute dtype. Error per weight: at most ``scale / 2``, i.e.
  ``max|W[:, j]| / 254`` (0.39% of the column's largest magnitude); about 1 byte/param.

Every group is one page-aligned buffer (``alloc_aligned``; ``stream_view``), as a ``HostStore``
group's streaming copy is: the engine's ``WeightStream`` registers and streams it the same way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from numba import njit, prange

from megatrain_jax.hoststore import fill_fast_group  # the store's fast init, the same draws
from megatrain_jax.optim.fused_adamw import launch, to_bf16_bits_
from megatrain_jax.optim.host import alloc_aligned
from megatrain_jax.templates import Layout

BF16 = np.dtype(ml_dtypes.bfloat16)


@dataclass(frozen=True)
class _QLeaf:
    quantised: bool
    offset: int  # in the int8 buffer (quantised) or the side buffer (vector leaves)
    size: int
    shape: tuple[int, ...]
    scale_offset: int = 0  # in the side buffer: prod(shape[:-2]) * shape[-1] fp32 scales


class FrozenGroup:
    """One group of the frozen base; ``buffers`` are what cross PCIe, ``dequantise`` (traced, on the
    device) turns them back into the group's pytree."""

    def __init__(self, name: str, layout: Layout, dtype: str):
        self.name, self.layout = name, layout
        self.dtype = "bfloat16" if (dtype == "int8" and not name.startswith("block_")) else dtype
        if self.dtype != "int8":
            self.flat = alloc_aligned(layout.size, np.uint16 if self.dtype == "bfloat16" else np.float32)
            self.qleaves, self.q, self.side = None, None, None
            return
        qmap, qoff, soff = {}, 0, 0
        for lf in layout.leaves:  # matrices: int8 values, their scales first in the side buffer
            if len(lf.shape) >= 2:
                qmap[lf.path] = _QLeaf(True, qoff, lf.size, lf.shape, soff)
                qoff, soff = qoff + lf.size, soff + lf.size // lf.shape[-2]
        for lf in layout.leaves:  # vectors after the scales
            if len(lf.shape) < 2:
                qmap[lf.path] = _QLeaf(False, soff, lf.size, lf.shape)
                soff += lf.size
        self.qleaves = [qmap[lf.path] for lf in layout.leaves]
        # one buffer: the fp32 side part first (4-byte aligned at the page's start), the int8 values after it
        self.side_bytes = 4 * soff
        self.packed, self.flat = alloc_aligned(self.side_bytes + qoff, np.uint8), None
        self.side = self.packed[:self.side_bytes].view(np.float32)
        self.q = self.packed[self.side_bytes:self.side_bytes + qoff].view(np.int8)

    # ------------------------------------------------------------------ host side

    def stream_view(self) -> np.ndarray:
        """The one host buffer that crosses PCIe (the weights ``dequantise`` reads on the device)."""
        if self.dtype == "int8":
            return self.packed
        return self.flat.view(BF16) if self.dtype == "bfloat16" else self.flat

    def buffers(self) -> tuple[np.ndarray, ...]:
        """The host buffers that cross PCIe, in ``dequantise``'s argument order (one: ``stream_view``)."""
        return (self.stream_view(),)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers())

    def load_flat(self, master: np.ndarray) -> None:
        """Fill from the group's fp32 values as one flat array (``layout`` order)."""
        if self.dtype == "float32":
            np.copyto(self.flat, master)
        elif self.dtype == "bfloat16":
            to_bf16_bits_(np.ascontiguousarray(master, np.float32), self.flat)
        else:
            for lf, ql in zip(self.layout.leaves, self.qleaves):
                src = master[lf.offset:lf.offset + lf.size]
                if ql.quantised:
                    quantise_into(src.reshape(lf.shape), self.q[ql.offset:ql.offset + ql.size],
                                  self.side[ql.scale_offset:ql.scale_offset + ql.size // lf.shape[-2]])
                else:
                    self.side[ql.offset:ql.offset + ql.size] = src

    def load_tree(self, tree: Any) -> None:
        master = np.empty(self.layout.size, np.float32)
        self.layout.flatten_into(tree, master)
        self.load_flat(master)

    def to_flat(self) -> np.ndarray:
        """The stored values (dequantised) as fp32, ``layout`` order: what the device computes with."""
        if self.dtype != "int8":
            return np.asarray(self.buffers()[0], np.float32)
        out = np.empty(self.layout.size, np.float32)
        for lf, ql in zip(self.layout.leaves, self.qleaves):
            dst = out[lf.offset:lf.offset + lf.size]
            if ql.quantised:
                q = self.q[ql.offset:ql.offset + ql.size].reshape(lf.shape).astype(np.float32)
                s = self.side[ql.scale_offset:ql.scale_offset + ql.size // lf.shape[-2]]
                dst[:] = (q * s.reshape(lf.shape[:-2] + (1, lf.shape[-1]))).reshape(-1)
            else:
                dst[:] = self.side[ql.offset:ql.offset + ql.size]
        return out

    def tree(self) -> Any:
        return self.layout.unflatten(self.to_flat())

    # ------------------------------------------------------------------ device side (traced)

    def dequantise(self, bufs: tuple, dtype) -> Any:
        """The group's pytree in ``dtype`` from its device buffers (``buffers()``' order; inside a jit)."""
        if self.dtype != "int8":
            return self.layout.unflatten(bufs[0].astype(dtype))
        (packed,) = bufs
        side = jax.lax.bitcast_convert_type(packed[:self.side_bytes].reshape(-1, 4), jnp.float32)
        q = jax.lax.bitcast_convert_type(packed[self.side_bytes:], jnp.int8)
        leaves = []
        for lf, ql in zip(self.layout.leaves, self.qleaves):
            if ql.quantised:
                nscale = ql.size // lf.shape[-2]
                s = side[ql.scale_offset:ql.scale_offset + nscale].reshape(lf.shape[:-2] + (1, lf.shape[-1]))
                w = q[ql.offset:ql.offset + ql.size].reshape(lf.shape).astype(jnp.float32) * s
                leaves.append(w.astype(dtype))
            else:
                leaves.append(side[ql.offset:ql.offset + ql.size].reshape(lf.shape).astype(dtype))
        return jax.tree_util.tree_unflatten(self.layout.treedef, leaves)


def quantise_into(w: np.ndarray, q_out: np.ndarray, scale_out: np.ndarray) -> None:
    """Per-output-channel symmetric int8 of ``w`` (..., in, out): ``q_out`` (flat int8), ``scale_out``
    (flat fp32, one per (..., out))."""
    w3 = np.ascontiguousarray(w, np.float32).reshape(-1, w.shape[-2], w.shape[-1])
    with launch:
        _quantise(w3, q_out.reshape(w3.shape), scale_out.reshape(w3.shape[0], w3.shape[2]))


@njit(parallel=True, cache=True, nogil=True)
def _quantise(w, q, scale):
    """Per (k, j) column: scale = max|w| / 127, q = rint(w / scale); threads own blocks of 64 columns and
    walk the rows in order (row-major reads)."""
    e, n, m = w.shape
    nb = (m + 63) // 64
    for k in range(e):
        for b in prange(nb):
            lo, hi = b * 64, min(m, b * 64 + 64)
            mx = np.zeros(hi - lo, np.float32)
            for i in range(n):
                for j in range(lo, hi):
                    a = abs(w[k, i, j])
                    if a > mx[j - lo]:
                        mx[j - lo] = a
            inv = np.zeros(hi - lo, np.float32)
            for j in range(lo, hi):
                s = mx[j - lo] / np.float32(127.0)
                scale[k, j] = s
                inv[j - lo] = np.float32(0.0) if s == 0 else np.float32(1.0) / s
            for i in range(n):
                for j in range(lo, hi):
                    v = np.rint(w[k, i, j] * inv[j - lo])
                    q[k, i, j] = np.int8(min(max(v, -127.0), 127.0))


class FrozenStore:
    """Ordered frozen groups: ``embed``, ``block_0`` .. ``block_{L-1}``, ``head``."""

    def __init__(self, layouts: dict[str, Layout], dtype: str):
        self.dtype = dtype
        self.groups = {name: FrozenGroup(name, layout, dtype) for name, layout in layouts.items()}

    @classmethod
    def from_trees(cls, trees: dict[str, Any], dtype: str) -> "FrozenStore":
        store = cls({n: Layout(t) for n, t in trees.items()}, dtype)
        for n, t in trees.items():
            store[n].load_tree(t)
        return store

    def fill_fast(self, seed: int, std: float) -> None:
        """``model.init: fast`` (as ``HostStore.fill_fast``: matrices uniform with std ``std``, norm
        scales 1, biases 0), one group's fp32 at a time."""
        for gi, g in enumerate(self):
            master = np.empty(g.layout.size, np.float32)
            fill_fast_group(g.layout, gi, seed, std, master)
            g.load_flat(master)

    def __getitem__(self, name: str) -> FrozenGroup:
        return self.groups[name]

    def __iter__(self):
        return iter(self.groups.values())

    @property
    def num_blocks(self) -> int:
        return sum(1 for n in self.groups if n.startswith("block_"))

    def nbytes(self) -> int:
        return sum(g.nbytes for g in self)

    def num_params(self) -> int:
        return sum(g.layout.size for g in self)

