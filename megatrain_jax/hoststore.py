"""Host-resident model state: fp32 master weights, the bf16 streaming copy and optimizer state.

Every *group* (the embedding, each transformer block, the head) is one flat, page-aligned buffer
per kind of state, so that

- a layer crosses PCIe as one transfer (and the buffer can be DMA-registered on the GPU path),
- the fused optimizer kernel walks it in one pass, in place,
- a checkpoint streams it group by group without a second copy of the model.

Memory per parameter: 4 (fp32 master) + 2 (bf16 copy, only with bf16 compute) + optimizer state
(8 for Adam). The accelerator never holds more than two blocks' weights plus the embedding and
head (see ``engine.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import ml_dtypes
import numpy as np

from megatrain_jax.optim.fused_adamw import to_bf16_bits_
from megatrain_jax.optim.host import alloc_aligned

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


class HostStore:
    """Ordered groups: ``embed``, ``block_0`` .. ``block_{L-1}``, ``head``."""

    def __init__(self, layouts: dict[str, Layout], bf16_stream: bool):
        self.bf16_stream = bf16_stream
        self.groups: dict[str, Group] = {}
        for name, layout in layouts.items():
            master = alloc_aligned(layout.size, np.float32)
            bits = alloc_aligned(layout.size, np.uint16) if bf16_stream else None
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
