"""The LoRA training step: a frozen base streamed block by block, adapters resident on the device.

Read ``LoraEngine.step`` top to bottom. The base (``lora_base.FrozenStore``: bf16, int8 or fp32 in
host memory) crosses PCIe one block at a time, the next block in flight while one computes; the
embedding and head are frozen too, so they stay on the device for the whole run. The adapters (fp32
master), their gradients and the optax state live on the device throughout.

- **Forward**: layer by layer, every micro-batch through the block while it is resident; each
  block's input is kept (on the device, or parked in pinned host memory).
- **Loss**: final norm + head + chunked cross-entropy (``loss.py``); only d loss / d hidden is taken.
- **Backward**: each block recomputed from its input and differentiated with respect to the hidden
  state and its adapters only (``jax.vjp`` over ``(adapters, h)``; the dequantised base is closed over,
  so no base gradient is computed, held or sent). Adapter gradients accumulate in fp32 per layer.
- **Update**: the global norm over every adapter gradient, one host fetch (loss and norm), the clip
  factor as ``optax.clip_by_global_norm`` applies it, and one jitted optax update over all adapters.
  A non-finite loss or norm skips the update (adapters and state untouched).

Data parallel (``devices``: several of this process's devices): every device streams the base over
its own link and takes a slice of each micro-batch's sequences; adapters and state are replicated, and
the adapter gradients are summed over the devices by XLA inside the backward (tests/test_lora_dp.py).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax

from megatrain_jax.config import ModelConfig
from megatrain_jax.engine.kernels import F32
from megatrain_jax.engine.lora_base import FrozenStore
from megatrain_jax.engine.loss import chunked_cross_entropy
from megatrain_jax.engine.step import Batch, StepResult
from megatrain_jax.engine.weights import Pace
from megatrain_jax.plan.options import BLOCKS_QUEUED
from megatrain_jax.models.lora import abstract_lora_block, merge_block, plain_config, split_lora
from megatrain_jax.optim.host import global_norm_scale
from megatrain_jax.templates import Layout, block_rng
from megatrain_jax.transfer import Transfers


class LoraModel:
    """A config's model as LoRA training sees it: per layer kind the LoRA block's graph and dropout
    key tree (``apply(kind)``: the block as a function of base, adapters, hidden, aux and key); the
    embedding, head and aux functions; the base's group layouts; adapter shapes. ``lora_stream.
    StreamLoraModel`` answers the same for a user's model streamed by ``stream()``."""

    embed_takes_positions = False

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


class LoraEngine:
    """Trains LoRA adapters of ``model`` over the frozen ``store`` with ``tx`` (an optax
    transformation, no clipping: ``clip_norm`` applies globally), on ``device`` or over ``devices``."""

    def __init__(self, model: LoraModel, store: FrozenStore, tx: optax.GradientTransformation, *,
                 adapters: list[Any] | None = None, seed: int = 0, compute_dtype: str = "bfloat16",
                 micro_batches: int = 1, clip_norm: float | None = 1.0, loss_chunk: int = 1024,
                 activations: str = "device", device: jax.Device | None = None, transfer_mode: str = "auto",
                 devices: list[jax.Device] | None = None):
        self.model, self.store, self.tx = model, store, tx
        devices = list(devices) if devices else [device or jax.local_devices()[0]]
        if any(d.process_index != jax.process_index() for d in devices):
            raise ValueError("LoRA data parallel runs in one process: give this process's devices")
        self.device, self.num_devices = devices[0], len(devices)
        self.dtype = jnp.dtype(compute_dtype)
        self.micro_batches, self.clip_norm, self.loss_chunk, self.seed = int(micro_batches), clip_norm, loss_chunk, seed
        self.num_layers = store.num_blocks
        # data parallel (several local devices): each device streams the base over its own link, takes a
        # slice of every micro-batch's sequences; adapters, their state and gradients are replicated, and
        # XLA sums the gradients over the devices inside the backward (the batch axis is contracted)
        mesh = jax.sharding.Mesh(np.array(devices), ("data",)) if len(devices) > 1 else None
        self.replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()) if mesh is not None \
            else jax.sharding.SingleDeviceSharding(self.device)
        self.batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")) \
            if mesh is not None else self.replicated
        self.xfer = Transfers(devices if mesh is not None else self.device, transfer_mode, mesh=mesh)
        for g in store:
            for j, buf in enumerate(g.buffers()):
                self.xfer.register(f"{g.name}/{j}", buf)
        self.offload = activations == "pinned_host" and self.xfer.host_sharding is not None
        self.adapters = [_own(a, self.replicated) for a in (adapters if adapters is not None else model.init_adapters(seed))]
        self.opt_state = _own(tx.init(self.adapters), self.replicated)
        self.count = 0
        self.tracer = None
        self._nan = False
        self._resident = {n: self._fetch(n) for n in ("embed", "head")}  # frozen: on the device for the run
        self._build_kernels()

    # ------------------------------------------------------------------------------ the step

    def step(self, batch: Batch) -> StepResult:
        L, k = self.num_layers, self
        mbs = self._micro_batches(batch)
        n_tokens = int(sum(mb["mask_sum"] for mb in mbs))
        inv = jnp.asarray(1.0 / max(n_tokens, 1), F32)
        emb, head = self._resident["embed"], self._resident["head"]

        # ---- forward sweep: block i + 1 in flight while block i computes; the dispatching thread stays
        # BLOCKS_QUEUED blocks ahead of the device (weights.Pace: what the GPU holds is what the plan counts)
        pace = Pace(BLOCKS_QUEUED)
        inflight = {0: self._fetch("block_0")}
        hs = [k._embed(emb, mb["embed_in"]) for mb in mbs]
        if self._nan:
            hs = [h * jnp.nan for h in hs]
        saved = []
        for i in range(L):
            w = inflight.pop(i)
            if i + 1 < L:
                inflight[i + 1] = self._fetch(f"block_{i + 1}")
            saved.append([self.xfer.offload(h) for h in hs] if self.offload else hs)
            hs = [k._fwd[self.model.kinds[i]](w, self.adapters[i], h, mb["aux"], self._key(i, m))
                  for m, (h, mb) in enumerate(zip(hs, mbs))]
            pace.dispatched(hs[-1])
        inflight[L - 1] = w  # the last block serves the backward at once

        # ---- loss: d loss / d final hidden only
        losses, dhs = [], []
        for h, mb in zip(hs, mbs):
            loss, dh = k._head_loss(head, emb, h, mb["labels"], mb["mask"], inv)
            losses.append(loss)
            dhs.append(dh)
        del hs

        # ---- backward sweep: recompute, VJP w.r.t. (adapters, hidden); block i - 1 in flight
        grads: list[Any] = [None] * L
        for i in reversed(range(L)):
            w = inflight.pop(i)
            if i > 0:
                inflight[i - 1] = self._fetch(f"block_{i - 1}")
            acts = saved[i]
            saved[i] = None
            if self.offload:
                acts = [self.xfer.reload(h) for h in acts]
            g = self._zeros[self.model.kinds[i]]()
            bwd = k._bwd[self.model.kinds[i]]
            for m, mb in enumerate(mbs):
                dhs[m], g = bwd(w, self.adapters[i], acts[m], mb["aux"], self._key(i, m), dhs[m], g)
            grads[i] = g
            pace.dispatched(g)
            del w, acts

        # ---- norm, clipping and the update
        loss, sq = (float(x) for x in jax.device_get(self._totals(losses, grads)))
        grad_norm = float(np.sqrt(sq))
        skipped = not (np.isfinite(loss) and np.isfinite(grad_norm))
        if not skipped:
            scale = jnp.asarray(global_norm_scale(sq, self.clip_norm), F32)
            self.adapters, self.opt_state = self._update(self.adapters, self.opt_state, grads, scale)
            self.count += 1
        return StepResult(loss, grad_norm, n_tokens, skipped=skipped)

    # ------------------------------------------------------------------------------ pieces

    def _build_kernels(self) -> None:
        dt, m, store = self.dtype, self.model, self.store
        ge, gh = store["embed"], store["head"]
        chunk, cap, tied = self.loss_chunk, m.softcap, m.tied

        def embed(we, tokens):
            return m.embed_fn(ge.dequantise(we, dt), tokens).astype(dt)

        def head_loss(wh, we, h, labels, mask, inv):
            hw, ew = gh.dequantise(wh, dt), (ge.dequantise(we, dt) if tied else None)

            def f(h):
                normed, out = m.head_fn(hw, h, ew)
                return chunked_cross_entropy(normed, out, labels, mask, chunk, cap) * inv

            return jax.value_and_grad(f)(h)

        self._embed = jax.jit(embed)
        self._head_loss = jax.jit(head_loss)
        self._fwd, self._bwd, self._zeros = {}, {}, {}
        for kind in range(m.num_kinds):
            group = store[f"block_{m.kinds.index(kind)}"]
            fwd, bwd = _block_fns(m.apply(kind), group, dt)
            self._fwd[kind] = jax.jit(fwd)
            self._bwd[kind] = jax.jit(bwd, donate_argnums=(5, 6))
            shapes = m.adapter_shapes[m.kinds.index(kind)]
            self._zeros[kind] = jax.jit(lambda s=shapes: jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, F32), s),
                                        out_shardings=self.replicated)

        def totals(losses, grads):
            return sum(losses), sum(jnp.sum(jnp.square(x)) for x in jax.tree_util.tree_leaves(grads))

        def update(adapters, state, grads, scale):
            grads = jax.tree_util.tree_map(lambda g: g * scale, grads)
            upd, state = self.tx.update(grads, state, adapters)
            return optax.apply_updates(adapters, upd), state

        self._totals = jax.jit(totals)
        self._update = jax.jit(update, donate_argnums=(0, 1))
        self._aux = jax.jit(m.aux_fn)
        self._rng = jax.jit(block_rng)  # one dispatch per (layer, micro-batch), not three

    def _fetch(self, name: str) -> tuple:
        g = self.store[name]
        return tuple(self.xfer.to_device(f"{name}/{j}", b) for j, b in enumerate(g.buffers()))

    def _key(self, layer: int, micro: int) -> jax.Array:
        return self._rng(self.seed, self.count, layer, micro)

    def _micro_batches(self, batch: Batch) -> list[dict]:
        b, s = batch.tokens.shape
        m = self.micro_batches
        if b % (m * self.num_devices):
            raise ValueError(f"batch of {b} sequences does not split into {m} micro-batches x "
                             f"{self.num_devices} devices")
        mask = batch.loss_mask if batch.loss_mask is not None else np.ones((b, s), np.float32)
        pos = batch.positions if batch.positions is not None else np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
        put = lambda x, dt: jax.device_put(np.ascontiguousarray(x, dt), self.batch_sharding)  # noqa: E731
        out = []
        for part in range(m):
            sl = slice(part * b // m, (part + 1) * b // m)
            seg = None if batch.segment_ids is None else put(batch.segment_ids[sl], np.int32)
            positions = put(pos[sl], np.int32)
            tokens = put(batch.tokens[sl], np.int32)
            out.append({"embed_in": (tokens, positions) if self.model.embed_takes_positions else tokens, "labels": put(batch.labels[sl], np.int32),
                        "mask": put(mask[sl], np.float32), "mask_sum": float(np.asarray(mask[sl], np.float64).sum()),
                        "aux": self._aux(positions, seg)})
        return out

    # ------------------------------------------------------------------------------ state

    def adapters_host(self) -> list[Any]:
        """Every layer's adapters as numpy fp32 (copies)."""
        return jax.tree_util.tree_map(np.asarray, jax.device_get(self.adapters))

    def set_state(self, adapters: list[Any], opt_state: Any | None, count: int) -> None:
        self.adapters = [_own(a, self.replicated) for a in adapters]
        if opt_state is not None:
            self.opt_state = _own(opt_state, self.replicated)
        self.count = int(count)

    @contextlib.contextmanager
    def nan_forward(self) -> Iterator[None]:
        """Fault injection: the steps inside see a NaN embedding output (hence a skipped update)."""
        self._nan = True
        try:
            yield
        finally:
            self._nan = False

    def finish(self) -> None:
        jax.block_until_ready(self.adapters)

    def close(self) -> None:
        self.xfer.close()

    def device_bytes(self) -> dict[str, int]:
        """Bytes resident on the device for the whole run: adapters, optimizer state, embedding + head."""
        nb = lambda t: sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(t))  # noqa: E731
        return {"adapters": nb(self.adapters), "opt_state": nb(self.opt_state), "embed_head": nb(self._resident)}


def _own(tree: Any, sharding: Any) -> Any:
    """A copy of ``tree`` placed by ``sharding`` that the engine may donate (never the caller's arrays)."""
    return jax.tree_util.tree_map(lambda x: jnp.array(jax.device_put(x, sharding), copy=True), tree)


def _block_fns(block_apply, group, dt):
    """(forward, backward) of one layer kind (``block_apply``: ``LoraModel.apply``) over the frozen
    group's device buffers."""

    def apply(base, adapters, h, aux, key):
        return block_apply(base, jax.tree_util.tree_map(lambda a: a.astype(dt), adapters), h, aux, key)

    def fwd(w, adapters, h, aux, key):
        return apply(group.dequantise(w, dt), adapters, h, aux, key)

    def bwd(w, adapters, h, aux, key, dh, g):
        base = group.dequantise(w, dt)  # closed over: no gradient w.r.t. the base
        _, vjp = jax.vjp(lambda a, x: apply(base, a, x, aux, key), adapters, h)
        da, dh_in = vjp(dh)
        return dh_in, jax.tree_util.tree_map(lambda acc, d: acc + d.astype(F32), g, da)

    return fwd, bwd


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


