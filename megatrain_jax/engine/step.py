"""The streamed training step.

Read ``StreamedTrainer.step`` top to bottom: forward sweep, loss, backward sweep, updates. The
model's state lives in the host store; the accelerator sees, at any moment, the embedding and head
(resident for the step: needed at both ends; with ``stream_io`` only the batch's embedding rows and
a few vocabulary chunks of the head: ``io.py``), the block being computed and the next block
already in flight.

- **Forward**: layer by layer; every micro-batch passes a block while its weights are resident
  (layer-major), and each block's input activation is kept (the boundary checkpoints; with
  ``boundary_every=k`` every k-th one, and the backward runs each segment's forward once more).
- **Loss**: final norm + LM head + cross-entropy in chunks of ``loss_chunk`` tokens
  (``loss.py``), so the (tokens x vocab) logits never exist at once, forward or backward.
- **Backward**: blocks in reverse; each recomputes its forward from the saved input inside a
  per-layer VJP (or applies its kept residuals), accumulates its weight gradient over micro-batches
  in fp32, and hands it to the updater (``updaters.py``). With ``grad_hold=resweep`` and clipping
  the first sweep keeps only the norms, and a second one (``_resweep``) hands the gradients over.
- **Auxiliary loss** (a stack with ``aux_loss``, e.g. MoE load balancing): the emitting blocks add
  their statistics to a per-device accumulator during the forward; ``fn(total)`` joins the loss and
  its gradient w.r.t. the total is the extra cotangent each emitting block's VJP receives.

The machinery sits behind small objects: ``WeightStream`` and ``Boundaries`` (``weights.py``), the
updater (``updaters.py``) and the jitted kernels with one variant per layer (``kernels.py``).

LoRA is this same step with other pieces (``engine/lora.py``: ``LoraEngine`` makes them in the
``_make_*`` methods): the frozen base is what streams, every layer is adapted (its "weight gradient" is
its adapters'), the embedding and head stay resident and make no gradient, and the adapter updater
(``adapters.py``) keeps the adapters and their optax state on the device.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from megatrain_jax.engine.io import IOParts, make_io
from megatrain_jax.engine.kernels import F32, Kernels, KeepResiduals, Recompute, local_shard
from megatrain_jax.engine.shards import Shards, process_bounds
from megatrain_jax.engine.updaters import Groups, make_updates
from megatrain_jax.engine.weights import Boundaries, Pace, WeightStream
from megatrain_jax.errors import UserError
from megatrain_jax.hoststore import HostStore
from megatrain_jax.optim.device_adamw import BLOCK
from megatrain_jax.optim.host import HostOptimizer, global_norm_scale
from megatrain_jax.plan.options import EngineOptions
from megatrain_jax.templates import StreamedModel
from megatrain_jax.transfer import Transfers


class Batch(NamedTuple):
    """One optimizer step's data, all (B, S) numpy arrays."""

    tokens: np.ndarray
    labels: np.ndarray
    loss_mask: np.ndarray | None = None
    segment_ids: np.ndarray | None = None
    positions: np.ndarray | None = None
    ref_logps: np.ndarray | None = None  # (B,) preference objectives: each row's reference log-probability


def as_batch(batch: Any) -> Batch:
    """``Batch``; ``(tokens, labels[, loss_mask])``; a dict with those keys; or one (B, S + 1) token
    array (inputs ``[:, :-1]``, labels ``[:, 1:]``)."""
    if isinstance(batch, Batch):
        return batch
    if isinstance(batch, dict):
        return Batch(**{k: (None if v is None else np.asarray(v)) for k, v in batch.items()})
    if isinstance(batch, (tuple, list)):
        return Batch(*[None if v is None else np.asarray(v) for v in batch])
    toks = np.asarray(batch)
    if toks.ndim != 2 or toks.shape[1] < 2:
        raise UserError("batch", f"a token array of shape {toks.shape}", "give (B, S + 1) tokens or a Batch")
    return Batch(toks[:, :-1], toks[:, 1:])


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    tokens: int  # tokens that count in the loss
    skipped: bool = False
    aux_loss: float | None = None  # the auxiliary term included in ``loss`` (None: the stack has none)
    preference: dict | None = None  # a preference objective's rewards and log-probabilities (objectives.metrics)


class MicroBatch(NamedTuple):
    inputs: Any  # the embedding's input: tokens (B/M, S), or (tokens, positions)
    labels: jax.Array  # (B/M, S) int32
    mask: jax.Array  # (B/M, S) float32
    mask_sum: float
    aux: Any  # the blocks' extra inputs (``aux_fn``: positions, masks)
    ref: Any = None  # (B/M,) fp32: each row's reference log-probability (preference objectives; else None)


class StreamedTrainer:
    """Trains a ``StreamedModel`` whose state lives in a ``HostStore``, as ``options`` say.

    ``options``: an ``EngineOptions`` (what the memory plan decides), or its fields as keywords.
    ``devices`` (data parallel): every device of the run, in every process (``jax.devices()``
    order); this process drives those it can address. Each receives every block, computes its share
    of each micro-batch, and each group's gradient is summed over all of them by one collective.
    ``tracer``: an optional timeline recorder (``trace.py``: ``watch`` and ``interval``).
    """

    def __init__(self, parts: StreamedModel, host_opt: HostOptimizer, options: EngineOptions | None = None, *,
                 store: HostStore | None = None, device: jax.Device | None = None,
                 devices: list[jax.Device] | None = None, tracer: Any = None, **fields: Any):
        if options is not None and fields:
            raise TypeError("pass options or its fields, not both")
        options = options if options is not None else EngineOptions(**fields)
        devices = list(devices) if devices else [device or jax.local_devices()[0]]
        if options.device_count not in (None, len(devices)):
            options = options.with_(devices=len(devices))  # the combination rules see the real count
        self.options, self.parts, self.opt, self._tracer = options, parts, host_opt, tracer
        self.local_devices = [d for d in devices if d.process_index == jax.process_index()]
        if not self.local_devices:
            raise ValueError("none of the given devices belongs to this process")
        self.device, self.num_devices = self.local_devices[0], len(devices)
        self.mesh = Mesh(np.array(devices), ("data",))
        self.dtype = jnp.dtype(options.compute_dtype)
        # the streamed dtype follows the store: without a bf16 copy the fp32 master streams, and
        # each jitted piece casts it to the compute dtype on the device (stream_copy=device)
        self.store = store or HostStore.from_trees(parts.host_trees(), bf16_stream=self.dtype == jnp.bfloat16)
        self.num_layers = self.store.num_blocks
        self.xfer = Transfers(self.local_devices, options.transfer_mode, mesh=self.mesh)
        self.kernels = self._make_kernels()
        groups = Groups(self.num_layers)
        self.updates = self._make_updates(groups, tracer)
        if parts.frozen and hasattr(self.updates, "freeze"):  # (adapters: the base is never updated anyway)
            self.updates.freeze(parts.frozen)
        if options.host_state_place.sharded and self.store.owned is None:
            self.store.own(lambda n: process_bounds(n, devices, BLOCK), BLOCK)  # (a store filled whole: given back)
        for g in self.store:
            self._register(g)
        self.weights = WeightStream(self.store, self.xfer, self.updates, groups, tracer, shards=self._fetch_shards())
        self.pace = Pace(options.blocks_queued)  # the dispatching thread stays this many blocks ahead of the device
        self.boundaries = Boundaries(self.xfer, options.activation_place.parked
                                     and self.xfer.host_sharding is not None, options.boundary_every,
                                     keep_from=self.num_layers - self.kernels.keep_residuals,
                                     gpu_from=self.num_layers - int(options.activations_gpu_blocks))
        # the embedding and head: resident, or streamed (``stream_io``: io.py)
        self.io = self._make_io(IOParts(parts=self.parts, options=self.options, kernels=self.kernels, xfer=self.xfer,
                                        updates=self.updates, weights=self.weights, store=self.store,
                                        deliver=self._gradient))
        # the head goes in flight during the last two blocks; with device-side updates during the
        # last only, so that block L-1's update does not wait for its transfer
        self._head_from = self.num_layers - (1 if self.updates.on_device else 2)
        self.last_step_info: dict[str, Any] = {}

    # ------------------------------------------------------------------------------ the pieces
    # Full training's; the LoRA variant (engine/lora.py: ``LoraEngine``) makes its own here and runs the same step

    def _make_kernels(self) -> Kernels:
        """The jitted pieces, one variant per layer (``kernels.py``)."""
        o = self.options
        k = Kernels(self.parts, self.store, self.mesh, self.dtype, o.loss_chunk, o.keep_residuals)
        k.rng_seed = o.rng_seed
        return k

    def _make_updates(self, groups: Groups, tracer: Any) -> Any:
        """The update path the options ask for (``updaters.py``)."""
        return make_updates(self.store, self.opt, self.xfer, self.kernels, self.options, groups, tracer)

    def _register(self, g: Any) -> None:
        """Group ``g`` of the store: its optimizer state (made on first use), its buffers registered for transfer."""
        if g.opt_state is None:
            g.opt_state = self.opt.init_state(g.master, g.layout.unflatten)
            self.store.release(g.name)
        self.xfer.register(g.name, g.stream_view(), span=self.store.owned[g.name] if self.store.owned else None)
        self.updates.register(g)

    def _fetch_shards(self) -> Shards | None:
        """``train.fetch=split`` with several GPUs: each fetches its share of a block (``shards.py``)."""
        if not self.options.fetch_place.split or self.num_devices < 2:
            return None
        if getattr(self.updates, "shards", None) is not None:  # (a split device-side update's: the same shares)
            return self.updates.shards
        host = "pinned_host" if self.xfer.host_shardings else None
        return Shards(self.mesh, BLOCK, self.xfer.device_sharding.memory_kind, host, direct_into=self.xfer.direct_into)

    def _make_io(self, io: IOParts) -> Any:
        """The embedding and head: resident, or streamed (``io.py``)."""
        return make_io(io)

    def forward_without_dropout(self) -> Callable | None:
        """The blocks' forward for a forward-only pass, where it differs from their own (``again``); None here."""
        return None

    # ------------------------------------------------------------------------------ the step

    def step(self, batch: Batch) -> StepResult:
        L, k, weights, acts, io = self.num_layers, self.kernels, self.weights, self.boundaries, self.io
        if k.objective is not None:
            batch = self.preference_batch(batch)
        mbs = self._micro_batches(batch)  # M micro-batches of (B/M, S)
        n_tokens = int(sum(mb.mask_sum for mb in mbs))
        inv = jnp.asarray(1.0 / max(n_tokens, 1), F32)  # () the loss is a mean over the step's tokens
        objective = k.objective
        if objective is not None:  # a mean over the step's pairs (objectives.py)
            inv = jnp.asarray(objective.norms(self._loss_mask(batch)))
        self.pace.reset()
        k.begin(self.count)
        acts.start(lambda b, hs: self._forward_again(b, hs, mbs))  # recomputes the inputs it did not keep

        # ---- forward sweep. Issue order decides overlap: block i+1's transfer is issued before block
        # i is dispatched, and a device-side update is dispatched (``take``) before the next transfer
        # (dispatched after it, it would wait for that transfer too: experiments/RESULTS.md)
        emb = io.take_embed(batch, mbs)  # the embedding (size,), or with stream_io the rows the batch uses
        weights.prefetch(0)
        hs = io.embed(emb, mbs)  # M x (B/M, S, H)
        for i in range(L):
            w = weights.take(i)  # (block size,)
            weights.prefetch(i + 1, wait=False)  # not while its host update runs: block i goes first
            if i >= self._head_from:
                io.prefetch_head()  # the head (or its first vocabulary chunk): in flight while the last blocks compute
            acts.keep(hs)  # block i's input: the boundary checkpoint (every k-th: boundary_every)
            hs = self._forward_block(i, w, hs, mbs)  # M x (B/M, S, H)
            self._trace("compute", f"fwd {i}", hs[-1])
            self.pace.dispatched(hs[-1])  # waits for block i-1: what the GPU holds stays what the plan counts
            weights.prefetch(i + 1)  # (when its update was still running: fetched now, after block i)
        weights.hold(L - 1, w)  # device-side updates: block L-1's just-updated weights serve the backward
        del w
        head = io.take_head()  # (head size,), or with stream_io its small weights (the final norm)
        aux_val = k.aux_total()  # () or None: the auxiliary loss of the whole step

        # ---- loss, head backward and backward sweep: each group's gradient, once complete, gives its
        # squared norm and is held for the norm, sent to be applied, or (resweep) dropped
        losses, sq, w = self._backward_sweep(head, emb, hs, mbs, inv)  # sq: fp32 (), one per group
        if aux_val is not None:
            losses.append(aux_val)

        # ---- norm, clipping and the updates (deferred ones queued in the order the forward needs them)
        loss, sq_total = (float(np.asarray(local_shard(x))) for x in k.totals(losses, sq))
        grad_norm = float(np.sqrt(sq_total))
        aux = None if aux_val is None else float(np.asarray(local_shard(aux_val)))
        self.last_step_info = {"offload_activations": acts.offload, "transfer_mode": self.xfer.mode}
        skipped = self.updates.deferred and not (np.isfinite(loss) and np.isfinite(grad_norm))
        scale = None if skipped else global_norm_scale(grad_norm ** 2, self.options.clip_norm)
        if self.updates.resweep and scale is not None:
            self.updates.start_on_host(scale)  # (the embedding's waiting gradient: its update overlaps the sweep)
            self._resweep(head, emb, hs, mbs, inv, scale)
        self.updates.apply(scale, resident={**io.resident(emb, head), "block_0": w})
        self.pace.reset()
        pref = None if objective is None else objective.metrics(
            self.host_logps(k.preference_logps[-len(mbs):]), self._loss_mask(batch).sum(axis=1), batch.ref_logps)
        return StepResult(loss, grad_norm, n_tokens, skipped=skipped, aux_loss=aux, preference=pref)

    def preference_batch(self, batch: Batch) -> Batch:
        """A preference objective's batch checked (each device's rows of a micro-batch hold whole pairs) and
        given reference log-probabilities (zeros where the objective has none)."""
        b = batch.tokens.shape[0]
        per = b // (self.options.micro_batches * self.num_devices)
        if per % 2:
            raise UserError("train.batch_size", f"a preference pair is two rows, and each device's share of a "
                            f"micro-batch holds {per}", "make train.batch_size a multiple of 2 x micro_batches x "
                            f"devices = {2 * self.options.micro_batches * self.num_devices}")
        if batch.ref_logps is None:
            return batch._replace(ref_logps=np.zeros(b, np.float32))
        return batch

    def _loss_mask(self, batch: Batch) -> np.ndarray:
        b, s = batch.tokens.shape
        return np.asarray(batch.loss_mask, np.float32) if batch.loss_mask is not None else np.ones((b, s), np.float32)

    @staticmethod
    def host_logps(parts: list) -> np.ndarray:
        """Per-row log-probabilities of the micro-batches (device arrays split by rows) as one host array."""
        return np.concatenate([np.asarray(jax.device_get(p), np.float64).reshape(-1) for p in parts])

    # ------------------------------------------------------------------------------ step helpers

    def _forward_block(self, i: int, w: jax.Array, hs: list, mbs: list[MicroBatch]) -> list:
        """Every micro-batch through block ``i`` (layer-major); queued gradient copies are issued
        before each micro-batch's compute, which they then overlap."""
        layer, out = self.kernels.layers[i], []
        for m, (h, mb) in enumerate(zip(hs, mbs)):
            self.updates.issue_ahead(i)
            out.append(layer.forward(w, h, mb.aux, m))
        return out

    def _backward_sweep(self, head: jax.Array, emb: Any, hs: list, mbs: list[MicroBatch], inv: jax.Array,
                        scale: float | None = None) -> tuple[list, list, jax.Array]:
        """Loss and head backward, every block's VJP from its saved input (blocks in reverse), then the
        embedding's backward; each group's gradient goes to ``_gradient`` once complete (``scale``: the
        resweep's second sweep). Returns the micro-batches' losses, the groups' squared norms and block
        0's weights."""
        L, weights, acts = self.num_layers, self.weights, self.boundaries
        forget = scale is not None or not self.updates.resweep  # resweep: the inputs serve the second sweep too
        # a resweep's second sweep stops above the blocks whose gradients the first held (updates.resweep_held:
        # the embedding and blocks 0..low-1, the backward's last); the first lets their inputs go, below the kept
        # input that block low's recompute starts from (boundary_every: the second sweep needs it)
        low = max(self.updates.resweep_held - 1, 0)
        stop = low if scale is not None else 0  # the lowest block this sweep runs (L: none, every block's held)
        # (the first sweep keeps the inputs the second's blocks recompute from: none where it runs no block)
        keep_from = (L if low >= L else acts.first(low)) if scale is None and low else 0
        top = L - 1 if stop < L else -1  # (-1: nothing to fetch or bring)
        weights.prefetch(acts.first(top))  # the last block and its inputs go in flight first, to overlap the loss
        acts.bring(top)
        losses, dhs, sq = self.io.loss(head, emb, hs, mbs, inv, scale)  # M x (), M x (B/M, S, H), [head's sq]
        self._trace("compute", "loss", losses[-1])
        if forget or not self.io.second_loss_reads_outputs:  # the last block's outputs served the loss; gone,
            hs.clear()  # they leave a layer's room to the backward (a resweep's second loss may read them again)
        w = None  # (block 0's weights, once the sweep reaches it)
        for i in reversed(range(stop, L)):  # recompute each block from its saved input, VJP, gradient out
            h = acts.take(i, forget or i < keep_from)  # M x (B/M, S, H); a dropped input: its segment's forward runs first
            w = weights.take(i)
            nxt = i - 1 if i > stop else -1
            weights.prefetch(acts.first(nxt))  # before block i's backward: the transfer overlaps it
            acts.bring(nxt)
            g = self._backward_block(i, w, h, mbs, dhs, again=scale is not None)
            if scale is None:
                self.updates.fetch_early(L - 1 - i)  # (device-side updates: a first group's state, in flight now)
            sq.append(self._gradient(i, g, scale, w))  # g: (devices x block size,) fp32
            self._trace("compute", f"bwd {i}", sq[-1])  # (g itself may be donated later)
            self.pace.dispatched(sq[-1])  # waits for block i+1's backward
        if scale is None:
            self.updates.fetch_early(L + 1)  # (the early groups past the blocks: the last block's, the head's)
        # (the first sweep's embedding gradient waited: held on the GPU, or in host memory where it was made)
        if scale is None or not (self.updates.resweep_held or self.io.embed_grad_on_host):
            sq.append(self.io.embed_backward(emb, mbs, dhs, scale))
        return losses, sq, w

    def _forward_again(self, b: int, hs: list, mbs: list[MicroBatch]) -> list:
        """Block ``b``'s forward again in the backward (``Boundaries`` recomputing an input the
        forward let go): its weights streamed again, the next block's put in flight first."""
        w, layer = self.weights.take(b), self.kernels.layers[b]
        self.weights.prefetch(b + 1)
        out = [layer.again(w, h, mb.aux, m) for m, (h, mb) in enumerate(zip(hs, mbs))]
        self._trace("compute", f"fwd again {b}", out[-1])
        self.pace.dispatched(out[-1])
        return out

    def _resweep(self, head: jax.Array, emb: Any, hs: list, mbs: list[MicroBatch], inv: jax.Array,
                 scale: float) -> None:
        """``grad_hold=resweep``: the first sweep kept only each gradient's norm. Now that the clip scale
        is known, the whole backward runs again from the same saved inputs (the same gradients, bit for
        bit) and each gradient is sent with it as it completes, as an unclipped step sends it: no hold."""
        self._backward_sweep(head, emb, hs, mbs, inv, scale)

    def _backward_block(self, i: int, w: jax.Array, acts: list, mbs: list[MicroBatch], dhs: list,
                        again: bool = False) -> jax.Array:
        """Block ``i``'s VJP for every micro-batch: ``dhs`` becomes the inputs' cotangents, and the
        weight gradient accumulates over the micro-batches in fp32. ``again`` (the resweep's second
        sweep): kept residuals were spent by the first, so such a block recomputes."""
        layer, g = self.kernels.layers[i], self.kernels.block_zeros(i)
        backward = partial(Recompute.backward, layer) if again and isinstance(layer, KeepResiduals) else layer.backward
        for m, mb in enumerate(mbs):
            dhs[m], g = backward(w, acts[m], mb.aux, m, dhs[m], g)
        return g

    def _gradient(self, key: Any, g: jax.Array, scale: float | None = None, w: jax.Array | None = None) -> jax.Array:
        """A group's gradient is complete on the devices: summed over them (one collective per
        group), its squared norm taken in fp32, then held for the norm or sent to be applied (with
        ``scale``: the resweep's second sweep, where a device-side update starts from ``w``, the weights
        the block's backward computed with, and may donate them)."""
        name = self.weights.groups.names[key]
        g = self.updates.reduce(name, g)  # summed over the devices (several GPUs updating on the device: each its share)
        sq = self.kernels.sqnorm(g)
        if scale is None:
            self.updates.gradient(name, g)
        else:
            self.updates.send(name, g, scale, current=w)
        return sq

    def _trace(self, lane: str, label: str, arr: Any) -> None:
        if self._tracer is not None:
            self._tracer.watch(lane, label, arr)

    def _micro_batches(self, batch: Batch) -> list[MicroBatch]:
        """The step's micro-batches as device arrays, each split over the devices by sequence."""
        b, s = batch.tokens.shape
        m, n = self.options.micro_batches, self.num_devices
        if b % m:
            raise ValueError(f"batch of {b} sequences does not split into {m} micro-batches")
        if (b // m) % n:
            raise ValueError(f"micro-batches of {b // m} sequences do not split over {n} devices "
                             f"(batch_size must be a multiple of micro_batches x devices = {m * n})")
        mask = batch.loss_mask if batch.loss_mask is not None else np.ones((b, s), np.float32)
        pos = batch.positions if batch.positions is not None else np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
        sharding = self.kernels.batch_sharding

        def put(x, dtype):
            x = np.ascontiguousarray(x, dtype)
            return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

        out = []
        for part in range(m):
            sl = slice(part * b // m, (part + 1) * b // m)
            seg = None if batch.segment_ids is None else put(batch.segment_ids[sl], np.int32)
            tokens, positions = put(batch.tokens[sl], np.int32), put(pos[sl], np.int32)
            out.append(MicroBatch((tokens, positions) if self.parts.embed_takes_positions else tokens,
                                  put(batch.labels[sl], np.int32), put(mask[sl], np.float32),
                                  float(np.asarray(mask[sl], np.float64).sum()), self.kernels.aux_of(positions, seg),
                                  None if batch.ref_logps is None else put(batch.ref_logps[sl], np.float32)))
        return out

    # ------------------------------------------------------------------------------ state and control

    @property
    def count(self) -> int:
        """Optimizer steps taken."""
        return self.updates.count

    @count.setter
    def count(self, value: int) -> None:
        self.updates.count = int(value)

    @property
    def tracer(self) -> Any:
        """The timeline recorder (``trace.py``), or None; settable between steps."""
        return self._tracer

    @tracer.setter
    def tracer(self, tracer: Any) -> None:
        self._tracer = self.weights.tracer = self.updates.tracer = tracer

    @property
    def before_update(self) -> Callable[[str, int], None] | None:
        """Called as ``before_update(name, count)`` on the updating thread just before update
        ``count`` writes group ``name`` in place (a background checkpoint holds back writes)."""
        return self.updates.before_update

    @before_update.setter
    def before_update(self, fn: Callable[[str, int], None] | None) -> None:
        self.updates.before_update = fn

    micro_batches = property(lambda self: self.options.micro_batches)
    clip_norm = property(lambda self: self.options.clip_norm)
    loss_chunk = property(lambda self: self.options.loss_chunk)
    skip_nonfinite = property(lambda self: self.options.skip_nonfinite)
    rng_seed = property(lambda self: self.options.rng_seed)
    update_on = property(lambda self: self.options.update_on)
    grad_hold = property(lambda self: self.options.grad_hold)
    keep_residuals = property(lambda self: self.kernels.keep_residuals)

    def pending_updates(self) -> dict:
        """Per group, a future that completes once the update queued last is in the host store (a
        background checkpoint waits for these)."""
        return self.updates.pending_updates()

    def residual_bytes(self, h: Any, aux: Any) -> int:
        """Bytes of the VJP residuals the last block keeps for one micro-batch shaped like ``h``."""
        return self.kernels.residual_bytes(h, aux)

    @contextlib.contextmanager
    def nan_forward(self) -> Iterator[None]:
        """Fault injection: steps run inside see a NaN embedding output, hence a NaN loss and NaN
        gradients everywhere (``train.skip_nonfinite`` must then change nothing)."""
        io = self.io
        real = io.embed
        io.embed = lambda emb, mbs: [h * jnp.nan for h in real(emb, mbs)]
        try:
            yield
        finally:
            del io.embed  # the class's method again

    def finish(self) -> None:
        """Wait for every queued update (before reading, saving or exporting the weights)."""
        self.updates.finish()

    def close(self) -> None:
        self.updates.close()
        self.io.close()  # its background gathers and scatters settle before their buffers are unregistered
        self.xfer.close()

    def params_tree(self) -> dict[str, Any]:
        """fp32 master weights as the full model's pure-dict tree (views into the host store)."""
        self.finish()
        return {
            "embed": self.store["embed"].tree(),
            "layers": {i: self.store[f"block_{i}"].tree() for i in range(self.num_layers)},
            "head": self.store["head"].tree(),
        }
