"""The LoRA variant's jitted pieces: adapted blocks over a frozen base, and the frozen ends.

``AdapterKernels`` answers the step what ``kernels.Kernels`` answers it, for a model with adapters
(``lora.LoraModel`` or ``lora_stream.StreamLoraModel``). Every layer is ``Adapted``: the weights the step
streams are the frozen group's buffer (``lora_base.FrozenGroup``: bf16, int8 or fp32), dequantised on
the device, and the layer's adapters (``adapters.Adapters``) ride along. Its backward recomputes the
block from its saved input and differentiates with respect to the adapters and the input only
(``jax.vjp`` over ``(adapters, h)``, the dequantised base closed over): no base gradient is made, held or
sent, and the per-layer "gradient" the step hands the updater is the adapters'.

The pieces are plain ``jax.jit`` over global arrays, not the per-device ``shard_map`` of full training:
with several devices (data parallel, one process) the micro-batches are split over them by sequence
and XLA sums the adapters' gradients inside the backward (the batch axis is contracted), so ``reduce``
is None; a dropout mask is drawn for the global batch, the same masks whatever the device count.

``FrozenEnds`` is the variant's embedding and head (``io.make_io``'s place): frozen, so fetched once and
resident for the run; the loss gives d loss / d hidden only.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from megatrain_jax.engine.adapters import Adapters
from megatrain_jax.engine.kernels import F32, step_totals
from megatrain_jax.engine.loss import chunked_cross_entropy
from megatrain_jax.templates import block_rng


class AdapterKernels:
    """The adapted step's jitted pieces for ``model`` over the frozen ``store``; ``layers[i]`` is layer i."""

    keep_residuals = 0  # every adapted block recomputes
    reduce = None  # XLA sums the adapter gradients over the devices inside the backward

    def __init__(self, model: Any, store: Any, mesh: Mesh, dtype: Any, loss_chunk: int, adapters: Adapters,
                 seed: int):
        self.model, self.store, self.dtype, self.adapters = model, store, dtype, adapters
        self.replicated = NamedSharding(mesh, P())
        self.batch_sharding = NamedSharding(mesh, P("data"))
        self.rng_seed, self.rng_step = seed, 0
        self.loss_chunk, self.objective, self.preference_logps = int(loss_chunk), None, []  # (as kernels.Kernels')
        self._build(loss_chunk)
        self.layers = [Adapted(self, i) for i in range(store.num_blocks)]

    def _build(self, chunk: int) -> None:
        dt, m, store = self.dtype, self.model, self.store
        ge, gh = store["embed"], store["head"]
        cap, tied = m.softcap, m.tied

        def embed(we, tokens):
            return m.embed_fn(ge.dequantise((we,), dt), tokens).astype(dt)

        def head_loss(wh, we, h, labels, mask, inv):
            hw, ew = gh.dequantise((wh,), dt), (ge.dequantise((we,), dt) if tied else None)

            def f(h):
                normed, out = m.head_fn(hw, h, ew)
                return chunked_cross_entropy(normed, out, labels, mask, chunk, cap) * inv

            return jax.value_and_grad(f)(h)

        self.embed_fwd = jax.jit(embed)
        self.head_loss = jax.jit(head_loss)
        self.fwd, self.bwd, self._zeros = {}, {}, {}
        for kind in range(m.num_kinds):
            first = m.kinds.index(kind)
            fwd, bwd = _block_fns(m.apply(kind), store[f"block_{first}"], dt)
            self.fwd[kind] = jax.jit(fwd)
            self.bwd[kind] = jax.jit(bwd, donate_argnums=(5, 6))
            shapes = m.adapter_shapes[first]
            self._zeros[kind] = jax.jit(lambda s=shapes: jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, F32), s),
                                        out_shardings=self.replicated)
        self.sqnorm = jax.jit(lambda g: sum(jnp.sum(jnp.square(x)) for x in jax.tree_util.tree_leaves(g)))
        self.totals = step_totals
        self._aux = jax.jit(m.aux_fn)
        self._rng = jax.jit(block_rng)  # one dispatch per (layer, micro-batch), not three

    # ---------------------------------------------------------------------------- per step

    def begin(self, step: int) -> None:
        """A new step: dropout keys are (updates done before it, layer, micro-batch)."""
        self.rng_step = step
        self.preference_logps = []

    def rng(self, layer: int, micro: int) -> jax.Array:
        return self._rng(self.rng_seed, self.rng_step, layer, micro)

    def block_zeros(self, i: int) -> Any:
        """Layer ``i``'s adapter-gradient accumulator (fp32, replicated)."""
        return self._zeros[self.model.kinds[i]]()

    def aux_of(self, positions: jax.Array, segment_ids: jax.Array | None) -> Any:
        return self._aux(positions, segment_ids)

    def aux_total(self) -> None:
        """No auxiliary loss (``lora_stream.StreamLoraModel`` refuses a stack that adds one)."""
        return None


class Adapted:
    """Layer ``i`` with adapters: ``w`` is its frozen base as streamed, the adapters are the run's current
    ones (``AdapterKernels.adapters``); ``g`` accumulates the adapters' gradient over the micro-batches."""

    def __init__(self, kernels: AdapterKernels, i: int):
        self.k, self.i, self.kind = kernels, i, kernels.model.kinds[i]

    def forward(self, w, h, aux, m: int):
        k = self.k
        return k.fwd[self.kind](w, k.adapters.trees[self.i], h, aux, k.rng(self.i, m))

    def backward(self, w, h, aux, m: int, dh, g):
        k = self.k
        return k.bwd[self.kind](w, k.adapters.trees[self.i], h, aux, k.rng(self.i, m), dh, g)

    def again(self, w, h, aux, m: int):
        """The forward once more (an input the boundaries let go): the same executable and key."""
        return self.forward(w, h, aux, m)


def _block_fns(block_apply, group, dt):
    """(forward, backward) of one layer kind (``block_apply``: ``LoraModel.apply``) over the frozen
    group's device buffer."""

    def apply(base, adapters, h, aux, key):
        return block_apply(base, jax.tree_util.tree_map(lambda a: a.astype(dt), adapters), h, aux, key)

    def fwd(w, adapters, h, aux, key):
        return apply(group.dequantise((w,), dt), adapters, h, aux, key)

    def bwd(w, adapters, h, aux, key, dh, g):
        base = group.dequantise((w,), dt)  # closed over: no gradient w.r.t. the base
        _, vjp = jax.vjp(lambda a, x: apply(base, a, x, aux, key), adapters, h)
        da, dh_in = vjp(dh)
        return dh_in, jax.tree_util.tree_map(lambda acc, d: acc + d.astype(F32), g, da)

    return fwd, bwd


class FrozenEnds:
    """The embedding and head of a LoRA run (``io.ResidentIO``'s calls): frozen, so taken once from the weight
    stream and resident for the run; no gradient of either, so nothing is delivered for them."""

    second_loss_reads_outputs = True
    embed_grad_on_host = False
    streams_head = False

    def __init__(self, io: Any):  # io: io.IOParts
        self.k = io.kernels
        self.emb, self.head = io.weights.take("embed"), io.weights.take("head")
        self._no_grad = jax.device_put(jnp.zeros((), F32), self.k.replicated)  # the ends' squared norm: none

    def take_embed(self, batch: Any, mbs: list) -> jax.Array:
        return self.emb

    def embed(self, emb: jax.Array, mbs: list) -> list:
        return [self.k.embed_fwd(emb, mb.inputs) for mb in mbs]

    def prefetch_head(self) -> None:
        """Resident already."""

    def take_head(self) -> jax.Array:
        return self.head

    def loss(self, head: jax.Array, emb: jax.Array, hs: list, mbs: list, inv: jax.Array,
             scale: float | None = None) -> tuple:
        """(M losses, M d hidden, no squared norms: the head has no gradient)."""
        losses, dhs = [], []
        for h, mb in zip(hs, mbs):
            loss, dh = self.k.head_loss(head, emb, h, mb.labels, mb.mask, inv) if self.k.objective is None \
                else self.k.objective.frozen_ends_loss(self.k, head, emb, h, mb, inv)
            losses.append(loss)
            dhs.append(dh)
        return losses, dhs, []

    def embed_backward(self, emb: jax.Array, mbs: list, dhs: list, scale: float | None = None) -> jax.Array:
        """The embedding is frozen: no backward, a zero squared norm."""
        return self._no_grad

    def resident(self, emb: jax.Array, head: jax.Array) -> dict:
        return {}

    def head_of(self, dt: Any) -> tuple:
        """As ``io.ResidentIO.head_of``: the frozen groups dequantised (their buffers are the run's: no cache key)."""
        m, ge, gh = self.k.model, self.k.store["embed"], self.k.store["head"]

        def trees(wh, we):
            return gh.dequantise((wh,), dt), (ge.dequantise((we,), dt) if m.tied else None)
        return trees, m.head_fn, m.softcap, None

    def seq_logps(self, head: jax.Array, emb: jax.Array, hs: list, mbs: list) -> list:
        """As ``io.ResidentIO.seq_logps``, over the frozen ends."""
        return [self.k.objective.frozen_ends_logps(self.k, head, emb, h, mb) for h, mb in zip(hs, mbs)]

    def close(self) -> None:
        """Nothing to end."""

    def device_bytes(self) -> int:
        return int(self.emb.nbytes + self.head.nbytes)
