"""Host-resident model state: fp32 master weights, the bf16 streaming copy and optimizer state.

Every *group* (the embedding, each transformer block, the head) is one flat, page-aligned buffer
per kind of state, so that

- a layer crosses PCIe as one transfer (and the buffer can be DMA-registered on the GPU path),
- the fused optimizer kernel walks it in one pass, in place,
- a checkpoint streams it group by group without a second copy of the model.

Memory per parameter: 4 (fp32 master) + 2 (bf16 copy of the blocks, only with bf16 compute and
``train.stream_copy=host``) + optimizer state (8 for fp32 Adam moments, 4 bf16, about 2 int8). The accelerator never holds more than two blocks' weights plus the embedding and
head (see ``engine/``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import ml_dtypes
import numpy as np

import numba
from numba import njit, prange

from megatrain_jax.optim.fused_adamw import launch, to_bf16_bits_
from megatrain_jax.optim.host import alloc_aligned, release_outside

from megatrain_jax.templates import Layout

@dataclass

class Group:
    """One streamed unit of the model (a block, the embedding or the head)."""

    name: str
    layout: Layout
    master: np.ndarray  # fp32, (layout.size,)
    stream_bits: np.ndarray | None  # uint16 bf16 copy, (layout.size,); None when compute is fp32
    opt_state: Any = None
    extra: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        return self.layout.size

    def stream_view(self) -> np.ndarray:
        """What crosses PCIe: the bf16 copy, or the fp32 master for fp32 compute."""
        if self.stream_bits is None:
            return self.master
        return self.stream_bits.view(ml_dtypes.bfloat16)

    def tree(self) -> Any:
        """The fp32 master as a pytree of numpy views (no copy)."""
        return self.layout.unflatten(self.master)

    def sync_stream(self) -> None:
        if self.stream_bits is not None:
            to_bf16_bits_(self.master, self.stream_bits)


@njit(parallel=True, cache=True, nogil=True)
def _fill_uniform(out, seed, half_width):
    """out[i] = uniform(-w, w) from a splitmix64 hash of (seed, i): parallel and reproducible."""
    for i in prange(out.shape[0]):
        z = numba.uint64(seed) * numba.uint64(0x9E3779B97F4A7C15) + numba.uint64(i)
        z = (z ^ (z >> numba.uint64(30))) * numba.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> numba.uint64(27))) * numba.uint64(0x94D049BB133111EB)
        z = z ^ (z >> numba.uint64(31))
        u = np.float32(z >> numba.uint64(40)) * np.float32(1.0 / (1 << 24))  # [0, 1)
        out[i] = (np.float32(2.0) * u - np.float32(1.0)) * half_width



def fill_fast_group(layout, gi: int, seed: int, std: float, master: np.ndarray) -> None:
    """Group ``gi``'s values under ``model.init: fast`` into ``master``: matrices uniform with standard
    deviation ``std`` (one seeded stream per leaf), norm scales 1, biases 0 (the store's and LoRA's frozen base)."""
    for li, leaf in enumerate(layout.leaves):
        view = master[leaf.offset:leaf.offset + leaf.size]
        last = leaf.path.rsplit("/", 1)[-1]
        if last == "scale":
            view[:] = 1.0
        elif last == "bias":
            view[:] = 0.0
        else:
            with launch:
                _fill_uniform(view, (seed << 32) + (gi << 12) + li, np.float32(std * np.sqrt(3.0)))


class HostStore:
    """Ordered groups: ``embed``, ``block_0`` .. ``block_{L-1}``, ``head``."""

    def __init__(self, layouts: dict[str, Layout], bf16_stream: bool):
        self.bf16_stream = bf16_stream
        self.owned: dict[str, tuple[int, int]] | None = None  # sharded: the values this process backs (``own``)
        self.align = 1
        self.groups: dict[str, Group] = {}
        for name, layout in layouts.items():
            master = alloc_aligned(layout.size, np.float32)
            # only blocks keep a bf16 copy: the embedding and head cross PCIe once per step, as their
            # fp32 master cast on the device, which saves 2 bytes per parameter of the largest groups
            # (2.2 GB for Qwen2.5-7B's 152k vocabulary) for one extra copy of them per step
            bits = alloc_aligned(layout.size, np.uint16) if (bf16_stream and name.startswith("block_")) else None
            self.groups[name] = Group(name, layout, master, bits)

    @classmethod
    def from_trees(cls, trees: dict[str, Any], bf16_stream: bool) -> "HostStore":
        """Build from host pytrees, copying one group at a time (never a second whole model)."""
        store = cls({name: Layout(t) for name, t in trees.items()}, bf16_stream)
        for name, tree in trees.items():
            store.load_group(name, tree)
        return store

    def load_group(self, name: str, tree: Any) -> None:
        g = self.groups[name]
        g.layout.flatten_into(tree, g.master)
        g.sync_stream()
        self.release(name)

    # ------------------------------------------------------------------ train.host_state=sharded

    def own(self, bounds: Callable[[int], tuple[int, int]], align: int) -> None:
        """From now on this process backs only its own values of each group, ``bounds(size)`` (``[lo, hi)``): the
        pages outside them are given back (``release``), so its memory for the store falls as 1/N of N processes.
        The rest of each buffer keeps its place (every index stays the group's own) and reads as zeros: nothing
        but this process's shares may be read (``engine/shards.py`` reads and writes only those)."""
        self.owned = {g.name: bounds(g.size) for g in self}
        self.align = int(align)
        for g in self:
            self.release(g.name)

    def release(self, name: str) -> int:
        """Group ``name``'s pages outside its owned values given back (master, bf16 copy, optimizer state arrays:
        elementwise, or one value per ``align`` block); 0 where the store is not sharded."""
        if self.owned is None:
            return 0
        g, (lo, hi) = self.groups[name], self.owned[name]
        arrays = [g.master] + ([g.stream_bits] if g.stream_bits is not None else [])
        if isinstance(g.opt_state, dict):
            arrays += [a for a in g.opt_state.values() if isinstance(a, np.ndarray) and a.ndim == 1]
        freed = 0
        for a in arrays:
            if a.shape[0] == g.size:
                freed += release_outside(a, lo, hi)
            elif a.shape[0] == -(-g.size // self.align):  # per block (int8 moments' scales)
                freed += release_outside(a, lo // self.align, -(-hi // self.align))
        return freed

    def resident_bytes(self) -> int:
        """Bytes of the store's buffers backed by memory now (``mincore``): what a sharded store saves."""
        from megatrain_jax.optim.host import resident_bytes

        total = 0
        for g in self:
            arrays = [g.master] + ([g.stream_bits] if g.stream_bits is not None else [])
            if isinstance(g.opt_state, dict):
                arrays += [a for a in g.opt_state.values() if isinstance(a, np.ndarray)]
            total += sum(resident_bytes(a) for a in arrays)
        return total

    def fill_fast(self, seed: int, std: float) -> None:
        """Random weights in seconds (``model.init: fast``): matrices uniform with standard deviation
        ``std``, norm scales 1, biases 0. Not equal to the nnx initialisers; for benchmarks and smoke
        runs of large shapes, where the ~35 s of a 7B nnx init would dominate."""
        for gi, g in enumerate(self):
            fill_fast_group(g.layout, gi, seed, std, g.master)
            g.sync_stream()
            self.release(g.name)  # (sharded: one group at a time is whole in memory)

    def __getitem__(self, name: str) -> Group:
        return self.groups[name]

    def __iter__(self) -> Iterator[Group]:
        return iter(self.groups.values())

    @property
    def num_blocks(self) -> int:
        return sum(1 for n in self.groups if n.startswith("block_"))

    def nbytes(self) -> int:
        """Host bytes of weights, streaming copies and optimizer state."""
        total = 0
        for g in self:
            total += g.master.nbytes + (g.stream_bits.nbytes if g.stream_bits is not None else 0)
            if isinstance(g.opt_state, dict):
                total += sum(a.nbytes for a in g.opt_state.values() if isinstance(a, np.ndarray))
        return total

    def num_params(self) -> int:
        return sum(g.size for g in self)
