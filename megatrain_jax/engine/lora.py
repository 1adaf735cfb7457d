"""LoRA training: the one streamed step over a frozen base, adapters resident on the device.

``LoraEngine`` is ``engine/step.StreamedTrainer`` with the variant's pieces; read ``StreamedTrainer.step``
top to bottom. The base (``lora_base.FrozenStore``: bf16, int8 or fp32 in host memory) is what the
weight stream fetches, one block at a time, the next in flight while one computes; the embedding and
head are frozen too, so they stay on the device for the whole run (``lora_kernels.FrozenEnds``). The
adapters (fp32 master), their gradients and the optax state live on the device throughout.

- **Forward**: layer by layer, every micro-batch through the block while it is resident; each
  block's input is kept (on the device, or parked in pinned host memory: ``weights.Boundaries``).
- **Loss**: final norm + head + chunked cross-entropy (``loss.py``); only d loss / d hidden is taken.
- **Backward**: each block recomputed from its input and differentiated with respect to the hidden
  state and its adapters only (``lora_kernels.Adapted``: the dequantised base is closed over, so no
  base gradient is computed, held or sent). Adapter gradients accumulate in fp32 per layer.
- **Update** (``adapters.AdapterUpdates``): the global norm over every adapter gradient, one host fetch
  (loss and norm), the clip factor as ``optax.clip_by_global_norm`` applies it, and one jitted optax
  update over all adapters. A non-finite loss or norm skips the update (adapters and state untouched).

Data parallel (``devices``: several of this process's devices): every device streams the base over
its own link and takes a slice of each micro-batch's sequences; adapters and state are replicated, and
the adapter gradients are summed over the devices by XLA inside the backward (tests/test_lora_dp.py).

``LoraModel`` is a config's model as the variant sees it; ``reference_lora_loss`` the in-memory
yardstick the tests hold the engine to.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from megatrain_jax.config import ModelConfig
from megatrain_jax.engine.adapters import AdapterUpdates, Adapters
from megatrain_jax.engine.kernels import F32
from megatrain_jax.engine.lora_base import FrozenStore
from megatrain_jax.engine.lora_kernels import AdapterKernels, FrozenEnds
from megatrain_jax.engine.step import StreamedTrainer
from megatrain_jax.models.lora import abstract_lora_block, merge_block, plain_config, split_lora
from megatrain_jax.plan.options import EngineOptions
from megatrain_jax.templates import Layout, block_rng


class LoraModel:
    """A config's model as LoRA training sees it: per layer kind the LoRA block's graph and dropout
    key tree (``apply(kind)``: the block as a function of base, adapters, hidden, aux and key); the
    embedding, head and aux functions; the base's group layouts; adapter shapes. ``lora_stream.
    StreamLoraModel`` answers the same for a user's model streamed by ``stream()``."""

    embed_takes_positions = False
    frozen: tuple[str, ...] = ()  # no leaf singled out: the whole base is frozen, only adapters train

    def __init__(self, cfg: ModelConfig):
        from megatrain_jax.models.common import abstract_model, streamed_parts

        self.cfg = cfg
        parts = streamed_parts(abstract_model(plain_config(cfg)))
        self.embed_fn, self.head_fn, self.aux_fn = parts.embed_fn, parts.head_fn, parts.aux_fn
        self.tied, self.softcap = parts.tied, parts.logit_softcap
        self.layouts = {n: Layout(t) for n, t in parts.host_trees().items()}
        self.kinds, self.graphs, self.adapter_shapes = [], [], []
        for i in range(cfg.num_layers):
            graph, ad, rngs, rest = split_lora(abstract_lora_block(cfg, i))
            if Layout(rest).signature() != self.layouts[f"block_{i}"].signature():
                raise ValueError(f"layer {i}: the LoRA block's frozen leaves differ from the base block's")
            for k, (g, _) in enumerate(self.graphs):
                if g == graph:
                    break
            else:
                k = len(self.graphs)
                self.graphs.append((graph, rngs))
            self.kinds.append(k)
            self.adapter_shapes.append(ad)

    @property
    def num_kinds(self) -> int:
        return len(self.graphs)

    def without_dropout(self) -> "LoraModel | None":
        """The same model without adapter dropout (an evaluation sees the whole adapters); None where it has none."""
        if not self.cfg.lora.dropout:
            return None
        return LoraModel(replace(self.cfg, lora=replace(self.cfg.lora, dropout=0.0)))

    def apply(self, kind: int):
        """``f(base, adapters, h, aux, key) -> h`` of one layer kind (base and adapters as pure dicts)."""
        graph, rngs = self.graphs[kind]
        return lambda base, adapters, h, aux, key: merge_block(graph, adapters, rngs, base, key)(h, aux)

    def init_adapters(self, seed: int, device: jax.Device | None = None) -> list[Any]:
        """Every layer's adapters as ``models.lora.add_adapters`` draws them (A peft-uniform, B 0)."""
        from megatrain_jax.models.lora import TARGET_ORDER, adapter_key

        out = []
        for i, shapes in enumerate(self.adapter_shapes):
            base = adapter_key(seed, i)
            layer = {}
            for parent, mods in shapes.items():
                layer[parent] = {}
                for proj, leaves in mods.items():
                    target = next(t for t in TARGET_ORDER if proj.startswith(t + "_"))
                    key = jax.random.fold_in(base, TARGET_ORDER.index(target))
                    din, r = leaves["lora_a"].shape
                    bound = 1.0 / (din ** 0.5)
                    a = jax.random.uniform(key, (din, r), jnp.float32, -bound, bound)
                    layer[parent][proj] = {"lora_a": a, "lora_b": jnp.zeros(leaves["lora_b"].shape, jnp.float32)}
            out.append(jax.device_put(layer, device) if device is not None else layer)
        return out


class LoraEngine(StreamedTrainer):
    """Trains LoRA adapters of ``model`` over the frozen ``store`` with ``tx`` (an optax transformation, no
    clipping: ``clip_norm`` applies globally), on ``device`` or over this process's ``devices``.

    The one streamed step (``StreamedTrainer.step``) with the variant's pieces: the frozen groups are what
    the weight stream fetches (``_register``), every layer is adapted (``lora_kernels.AdapterKernels``),
    the embedding and head stay resident (``lora_kernels.FrozenEnds``), and the adapters and their optax
    state are updated on the device (``adapters.AdapterUpdates``). A non-finite loss or norm always skips
    the update."""

    def __init__(self, model: LoraModel, store: FrozenStore, tx: optax.GradientTransformation, *,
                 adapters: list[Any] | None = None, seed: int = 0, compute_dtype: str = "bfloat16",
                 micro_batches: int = 1, clip_norm: float | None = 1.0, loss_chunk: int = 1024,
                 activations: str = "device", device: jax.Device | None = None, transfer_mode: str = "auto",
                 devices: list[jax.Device] | None = None):
        devices = list(devices) if devices else [device or jax.local_devices()[0]]
        if any(d.process_index != jax.process_index() for d in devices):
            raise ValueError("LoRA data parallel runs in one process: give this process's devices")
        self._initial = adapters if adapters is not None else model.init_adapters(seed)
        options = EngineOptions(compute_dtype=str(jnp.dtype(compute_dtype)), micro_batches=int(micro_batches),
                                clip_norm=clip_norm, loss_chunk=int(loss_chunk), activations=activations,
                                transfer_mode=transfer_mode, rng_seed=int(seed), skip_nonfinite=True,
                                devices=len(devices))
        super().__init__(model, tx, options, store=store, devices=devices)
        self.model = model
        del self._initial  # (in ``kernels.adapters`` now)

    # ------------------------------------------------------------------------------ the variant's pieces

    def _make_kernels(self) -> AdapterKernels:
        adapters = Adapters(self.opt, self._initial, NamedSharding(self.mesh, PartitionSpec()))
        return AdapterKernels(self.parts, self.store, self.mesh, self.dtype, self.options.loss_chunk, adapters,
                              self.options.rng_seed)

    def _make_updates(self, groups: Any, tracer: Any) -> AdapterUpdates:
        return AdapterUpdates(self.store, self.opt, self.xfer, self.kernels, self.options, groups, tracer)

    def _register(self, g: Any) -> None:
        """A frozen group: its one buffer registered for transfer (no optimizer state, no gradient)."""
        self.xfer.register(g.name, g.stream_view())

    def _make_io(self, io: Any) -> FrozenEnds:
        return FrozenEnds(io)

    # ------------------------------------------------------------------------------ state

    tx = property(lambda self: self.opt)
    seed = property(lambda self: self.options.rng_seed)
    adapters = property(lambda self: self.kernels.adapters.trees)
    opt_state = property(lambda self: self.kernels.adapters.opt_state)

    def adapters_host(self) -> list[Any]:
        """Every layer's adapters as numpy fp32 (copies)."""
        return self.kernels.adapters.host()

    def set_state(self, adapters: list[Any], opt_state: Any | None, count: int) -> None:
        self.kernels.adapters.set(adapters, opt_state)
        self.count = int(count)

    def forward_without_dropout(self):
        """The blocks again without adapter dropout, as ``forward(i, w, h, aux, m)`` (``evaluate.ForwardPass``);
        None where the blocks have no dropout (their own forward serves)."""
        model = self.model.without_dropout()
        if model is None:
            return None
        dt, k = self.dtype, self.kernels
        fns = {}
        for kind in range(model.num_kinds):
            group, apply = self.store[f"block_{model.kinds.index(kind)}"], model.apply(kind)

            def fwd(w, adapters, h, aux, key, apply=apply, group=group):
                return apply(group.dequantise((w,), dt), jax.tree_util.tree_map(lambda a: a.astype(dt), adapters), h,
                             aux, key)
            fns[kind] = jax.jit(fwd)
        return lambda i, w, h, aux, m: fns[model.kinds[i]](w, k.adapters.trees[i], h, aux, k.rng(i, m))

    def device_bytes(self) -> dict[str, int]:
        """Bytes resident on the device for the whole run: adapters, optimizer state, embedding + head."""
        nb = lambda t: sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(t))  # noqa: E731
        return {"adapters": nb(self.adapters), "opt_state": nb(self.opt_state), "embed_head": self.io.device_bytes()}


def reference_lora_loss(model: LoraModel, store: FrozenStore, compute_dtype: str = "float32"):
    """``loss(adapters, tokens, labels, mask, step, seed) -> mean CE`` of the whole LoRA model in memory
    (plain jax, no streaming): the yardstick the engine is tested against. The base is the store's
    values as the device sees them (dequantised); dropout keys as the engine's (one micro-batch)."""
    from megatrain_jax.models.common import make_aux

    dt = jnp.dtype(compute_dtype)
    L = store.num_blocks
    trees = {n: jax.tree_util.tree_map(jnp.asarray, store[n].tree()) for n in ("embed", "head")}
    blocks = [jax.tree_util.tree_map(jnp.asarray, store[f"block_{i}"].tree()) for i in range(L)]
    cast = lambda t: jax.tree_util.tree_map(lambda a: a.astype(dt), t)  # noqa: E731

    def loss(adapters, tokens, labels, mask, step, seed):
        pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        aux = make_aux(pos, model.cfg, None) if isinstance(model, LoraModel) else model.aux_fn(pos, None)
        h = model.embed_fn(cast(trees["embed"]), (tokens, pos) if model.embed_takes_positions else tokens).astype(dt)
        for i in range(L):
            h = model.apply(model.kinds[i])(cast(blocks[i]), cast(adapters[i]), h, aux, block_rng(seed, step, i, 0))
        normed, out = model.head_fn(cast(trees["head"]), h, cast(trees["embed"]) if model.tied else None)
        logits = jnp.einsum("bsh,hv->bsv", normed, out, preferred_element_type=F32)
        if model.softcap is not None:
            logits = model.softcap * jnp.tanh(logits / model.softcap)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    return loss


