"""The plain in-memory trainer: whole-model ``jax.grad`` and optax, all on one device.

Model-agnostic: any family's ``Decoder`` (its logits are soft-capped where the family's are, and
so is the chunked loss). It is the yardstick the streamed engine is tested against (same model, same optimizer, none of
the streaming machinery) and the baseline the 1B benchmark compares with. It keeps the batch whole
(no micro-batches): the loss is normalised by the step's token count either way, so gradient
accumulation in the streamed engine must reproduce this exactly. A family's auxiliary loss (the
MoE router's load balancing) is added on the whole batch, as the streamed engine defines it.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from megatrain_jax.engine import Batch, StepResult, chunked_cross_entropy
from megatrain_jax.errors import UserError
from megatrain_jax.models.common import Decoder


def _cast(tree: Any, dtype) -> Any:
    return jax.tree_util.tree_map(lambda x: x.astype(dtype), tree)


def _key(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")


def frozen_paths(model: Decoder) -> frozenset[str]:
    """The model's leaves that no optimizer moves (``Family.frozen_leaves``), as "/"-joined paths of its
    parameter tree."""
    from megatrain_jax.families import get_family

    cfg = getattr(model, "cfg", None)
    names = tuple(get_family(cfg.family).frozen_leaves(cfg)) if cfg is not None else ()
    if not names:
        return frozenset()
    leaves = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model)))
    return frozenset(k for k in (_key(p) for p, _ in leaves) if any(k == n or k.endswith("/" + n) for n in names))


def _where_frozen(frozen: frozenset[str], fn: Callable, tree: Any) -> Any:
    return jax.tree_util.tree_map_with_path(lambda path, x: fn(x) if _key(path) in frozen else x, tree)


class ReferenceTrainer:
    """Answers ``trainer_protocol.TrainerProtocol`` as ``trainer.Trainer`` does, so ``train()`` drives
    either without branching on it; it writes no checkpoints, has no plan and exports nothing."""

    engine = None  # no streamed engine: no per-layer timeline, no fault hooks
    store = None  # no host store: nothing to export
    sharded_checkpoints = False
    step_count = 0  # optimizer updates applied (set per instance)

    def __init__(self, model: Decoder, tx: optax.GradientTransformation, compute_dtype: str = "float32",
                 remat: bool = False, device: jax.Device | None = None, loss_chunk: int | None = None,
                 lr_at: Callable[[int], float] | None = None):
        """``remat`` recomputes each block in the backward and ``loss_chunk`` computes the loss in
        chunks, as the streamed engine does (the fair in-memory baseline for benchmarks); by default
        the loss is the plain full-logits cross-entropy. ``lr_at``: the learning rate of update
        ``count`` (1-based), for the log; None when unknown."""
        self.step_count = 0  # optimizer updates applied (every step updates: nothing is skipped here)
        self._lr_at = lr_at
        self.graphdef, state = nnx.split(model)
        self.device = device or jax.devices()[0]
        self.weights = jax.device_put(nnx.to_pure_dict(state), self.device)
        self.tx = tx
        # committed to the device as the step's outputs are: the first step compiles the step the later ones use
        self.opt_state = jax.device_put(tx.init(self.weights), self.device)
        dtype = jnp.dtype(compute_dtype)
        graphdef = self.graphdef

        def loss_fn(params, tokens, labels, mask, positions, segment_ids):
            model = nnx.merge(graphdef, _cast(params, dtype))
            denom = jnp.maximum(jnp.sum(mask), 1.0)
            # aux: the family's auxiliary loss over the whole batch (MoE router balancing), or None
            x, aux = model.final_hidden_aux(tokens, positions, segment_ids, dtype=dtype, remat=remat)
            if loss_chunk:
                emb = model.embed.embedding[...] if model.cfg.tie_embeddings else None
                normed, out = model.head.norm(x), model.head.output_matrix(emb).astype(dtype)
                loss = chunked_cross_entropy(normed, out, labels, mask, loss_chunk, model.cfg.final_softcap) / denom
            else:
                emb = model.embed.embedding[...].astype(dtype) if model.cfg.tie_embeddings else None
                ce = optax.softmax_cross_entropy_with_integer_labels(model.head(x, emb), labels)
                loss = jnp.sum(ce * mask) / denom
            return loss if aux is None else loss + aux

        frozen = frozen_paths(model)

        def step(params, opt_state, tokens, labels, mask, positions, segment_ids):
            loss, grads = jax.value_and_grad(loss_fn)(params, tokens, labels, mask, positions, segment_ids)
            if frozen:  # no moment update for a frozen leaf: the optimizer sees a zero gradient
                grads = _where_frozen(frozen, jnp.zeros_like, grads)
            updates, opt_state = tx.update(grads, opt_state, params)
            new = optax.apply_updates(params, updates)
            if frozen:  # and no weight decay: the value as it was, bit for bit
                new = jax.tree_util.tree_map_with_path(
                    lambda path, n, o: o if _key(path) in frozen else n, new, params)
            return new, opt_state, loss, optax.global_norm(grads)

        self._step = jax.jit(step, donate_argnums=(0, 1))

        def forward_nll(params, tokens, labels, mask, positions, segment_ids):  # no gradient, no auxiliary loss
            model = nnx.merge(graphdef, _cast(params, dtype))
            x, _ = model.final_hidden_aux(tokens, positions, segment_ids, dtype=dtype, remat=False)
            emb = model.embed.embedding[...].astype(dtype) if model.cfg.tie_embeddings else None
            ce = optax.softmax_cross_entropy_with_integer_labels(model.head(x, emb).astype(jnp.float32), labels)
            return jnp.sum(ce * mask, axis=1), jnp.sum(mask, axis=1)

        self._forward_nll = jax.jit(forward_nll)

    def step(self, batch: Batch) -> StepResult:
        b, s = batch.tokens.shape
        mask = batch.loss_mask if batch.loss_mask is not None else np.ones((b, s), np.float32)
        pos = batch.positions if batch.positions is not None else np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
        self.weights, self.opt_state, loss, norm = self._step(
            self.weights, self.opt_state, jnp.asarray(batch.tokens, jnp.int32), jnp.asarray(batch.labels, jnp.int32),
            jnp.asarray(mask, jnp.float32), jnp.asarray(pos, jnp.int32),
            None if batch.segment_ids is None else jnp.asarray(batch.segment_ids, jnp.int32))
        self.step_count += 1
        return StepResult(float(loss), float(norm), int(np.sum(mask)))

    def forward_nll(self, batch: Batch):
        """A forward-only pass (``evaluate.ForwardResult``): each sequence's summed NLL over its mask, its tokens."""
        from megatrain_jax.evaluate import ForwardResult

        b, s = batch.tokens.shape
        mask = batch.loss_mask if batch.loss_mask is not None else np.ones((b, s), np.float32)
        pos = batch.positions if batch.positions is not None else np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
        nll, toks = self._forward_nll(
            self.weights, jnp.asarray(batch.tokens, jnp.int32), jnp.asarray(batch.labels, jnp.int32),
            jnp.asarray(mask, jnp.float32), jnp.asarray(pos, jnp.int32),
            None if batch.segment_ids is None else jnp.asarray(batch.segment_ids, jnp.int32))
        return ForwardResult(np.asarray(nll, np.float64), np.asarray(toks, np.float64))

    def params(self) -> Any:
        """The current weights (numpy copies), in the model's own tree."""
        return jax.tree_util.tree_map(np.asarray, self.weights)

    params_tree = params

    @classmethod
    def from_config(cls, cfg, model: Decoder | None = None) -> "ReferenceTrainer":
        """``train.engine=reference``: the whole model and plain optax in device memory, a correctness
        reference for the streamed engine (no plan, no checkpoints)."""
        from megatrain_jax.models import init_model
        from megatrain_jax.optim import build_host_optimizer, build_reference_tx

        t = cfg.train
        model = model if model is not None else init_model(cfg.model, t.seed)
        lr_at = getattr(build_host_optimizer(cfg.optim, t.steps), "lr_at", None)
        return cls(model, build_reference_tx(cfg.optim, t.steps), compute_dtype=t.compute_dtype, lr_at=lr_at)

    def lr_at(self, count: int) -> float | None:
        return None if self._lr_at is None else float(self._lr_at(count))

    @property
    def memory_device(self) -> jax.Device | None:
        """The device whose memory ``memory.memory_snapshot`` reports (None: the host's CPU)."""
        return self.device if self.device.platform == "gpu" else None

    def saver(self, directory: str, **_: Any) -> None:
        """The reference engine writes no checkpoints."""
        return None

    def save(self, directory: str, **_: Any) -> str:
        raise UserError("train.engine", "the reference engine writes no checkpoints", "use train.engine=streamed")

    def restore(self, directory: str, log: Any = None) -> dict:
        raise UserError("train.engine", "the reference engine writes no checkpoints", "use train.engine=streamed")

    def plan(self, *a: Any, **k: Any) -> None:
        """No memory plan: the whole model lives in device memory."""
        return None

    def export(self, cfg: Any, out: str, **_: Any) -> None:
        raise UserError("train.export", "the reference engine exports nothing", "use train.engine=streamed")

    def close(self) -> None:
        pass
