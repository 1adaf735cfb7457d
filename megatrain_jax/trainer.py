"""``Trainer``: the streamed engine as a Python object, for research code and notebooks.

    from megatrain_jax.trainer import Trainer
    tr = Trainer(model, optax.adamw(3e-4), micro_batches=2, clip_norm=1.0)   # model: NNX (or Linen + params=)
    for tokens in batches:                     # (B, S + 1) int arrays, or Batch / (tokens, labels[, mask])
        res = tr.step(tokens)                  # StepResult(loss, grad_norm, tokens, skipped)
    weights = tr.params()                      # fp32, in your model's own tree structure
    tr.save("ckpt/"); tr.restore("ckpt/")      # checkpoint.py: orbax, per group, checked, exact resume
    print(tr.plan(batch_size=16, seq_len=1024).table)   # the CLI's memory plan

The model's weights and optimizer state live in host memory (``HostStore``); each step streams the
blocks through the device. ``megatrain-jax train`` runs through this class too (one path to the
engine): ``Trainer.from_config(cfg, plan)`` (a new run: initialised or imported from Hugging Face)
and ``Trainer.resume(cfg, root, plan)`` (filled from the newest checkpoint) build it from a config,
with the engine options the memory plan decided; ``saver(root)`` gives the background checkpoints
the training loop polls, and ``lr_at``, ``store``, ``memory_device`` what it logs and exports.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import optax

from megatrain_jax import checkpoint as ck

from megatrain_jax import checkpoint_read as ckr
from megatrain_jax.config import Config, OptimConfig
from megatrain_jax.distributed import run_devices
from megatrain_jax.engine import Batch, StepResult, StreamedTrainer
from megatrain_jax.engine.step import as_batch  # noqa: F401 (its public home was here)
from megatrain_jax.engine_run import EngineRun
from megatrain_jax.errors import UserError
from megatrain_jax.optim import HostOptimizer, OptaxHostOptimizer, build_host_optimizer
from megatrain_jax.plan.lora import FULL, variant
from megatrain_jax.plan.options import EngineOptions
from megatrain_jax.templates import StreamedModel
from megatrain_jax.trainer_protocol import Saver, TrainerProtocol


def host_optimizer(optimizer: Any, steps: int | None = None) -> HostOptimizer:
    """``OptimConfig`` (the CLI's optimizer section), an ``optax.GradientTransformation`` (run per
    group on the host, exactly as on the whole model for element-wise optimizers such as adamw), or
    a ready ``HostOptimizer``."""
    if optimizer is None:
        optimizer = OptimConfig(clip_norm=None)
    if isinstance(optimizer, OptimConfig):
        if steps is None and (optimizer.schedule.kind != "constant" or optimizer.schedule.warmup_steps) \
                and not optimizer.schedule.decay_steps:
            raise UserError("steps", f"the {optimizer.schedule.kind} schedule needs the run's length",
                            "pass Trainer(..., steps=N) or set optim.schedule.decay_steps")
        return build_host_optimizer(optimizer, steps or 1)
    if isinstance(optimizer, optax.GradientTransformation):
        return OptaxHostOptimizer(optimizer)
    if all(hasattr(optimizer, a) for a in ("init_state", "update", "state_to_arrays")):
        return optimizer
    raise UserError("optimizer", f"a {type(optimizer).__name__} is not an optimizer",
                    "pass an OptimConfig, an optax.GradientTransformation or a HostOptimizer")


def _plan(cfg: Config, plan):
    if plan is not None:
        return plan
    from megatrain_jax.plan import plan_or_refuse  # refuses what does not fit

    return plan_or_refuse(cfg, lambda _: None)


@dataclass
class PlanView:
    plan: Any  # memory.Plan
    config: Any  # the Config it was made from

    @property
    def table(self) -> str:
        from megatrain_jax.plan import plan_table

        return plan_table(self.plan)

    def verdict(self):
        return self.plan.verdict()


class StreamedRun(EngineRun):
    """Full training through the streamed engine: every weight trained (``Trainer``'s run without
    adapters, ``lora`` None; see ``Trainer`` for the arguments)."""

    def __init__(self, model: Any, optimizer: Any = None, *, lora: None = None, options: EngineOptions | None = None,
                 store: Any = None, params: Any = None, steps: int | None = None, micro_batches: int | None = None,
                 clip_norm: float | None | str = "auto", compute_dtype: str | None = None,
                 loss_chunk: int | None = None, seed: int | None = None, skip_nonfinite: bool | None = None,
                 device: jax.Device | None = None, devices: list[jax.Device] | None = None,
                 **stream_kwargs: Any):
        if isinstance(model, StreamedModel):
            if params is not None or stream_kwargs:
                raise UserError("params", "a StreamedModel is already split", "pass params/stream options to stream()")
            self.parts = model
        else:
            from megatrain_jax.stream import stream

            self.parts = stream(model, params=params, **stream_kwargs)
        if clip_norm == "auto":
            clip_norm = options.clip_norm if options is not None else \
                optimizer.clip_norm if isinstance(optimizer, OptimConfig) else None
        given = dict(micro_batches=micro_batches, clip_norm=clip_norm, compute_dtype=compute_dtype,
                     loss_chunk=loss_chunk, rng_seed=seed, skip_nonfinite=skip_nonfinite)
        options = (options or EngineOptions()).with_(**{k: v for k, v in given.items()
                                                        if v is not None or k == "clip_norm"})
        self.optimizer_spec, self.steps = optimizer, steps
        self.opt = host_optimizer(optimizer, steps)
        self.engine = StreamedTrainer(self.parts, self.opt, options, store=store, device=device, devices=devices)

    @property
    def options(self) -> EngineOptions:
        return self.engine.options

    @property
    def settings(self) -> dict[str, Any]:
        """The engine settings a checkpoint records."""
        o = self.engine.options
        return dict(micro_batches=o.micro_batches, clip_norm=o.clip_norm, compute_dtype=o.compute_dtype,
                    loss_chunk=o.loss_chunk, seed=o.rng_seed)

    # ---------------------------------------------------------------------------------- from a config

    @classmethod
    def from_config(cls, cfg: Config, plan=None, *, model: Any = None) -> "StreamedRun":
        """``Trainer.from_config`` for full training (every weight trained)."""
        from megatrain_jax.models.llama import init_host_store

        plan = _plan(cfg, plan)
        cfg = with_plan_tile(cfg, plan)  # the blocks run the working set the plan counted
        bf16 = plan.options.host_bf16_copy
        if model is not None:
            from megatrain_jax.hoststore import HostStore
            from megatrain_jax.models import streamed_parts

            parts = streamed_parts(model)
            store = HostStore.from_trees(parts.host_trees(), bf16_stream=bf16)
        elif cfg.model.from_hf:
            from megatrain_jax.hf import load_hf_into_store

            parts, store = load_hf_into_store(cfg.model, bf16_stream=bf16)  # (sharded: whole, then given back)
        else:
            parts, store = init_host_store(cfg.model, cfg.train.seed, bf16_stream=bf16, own=_owned(plan.options))
        return cls._of_config(parts, store, build_host_optimizer(cfg.optim, cfg.train.steps), cfg, plan)

    @classmethod
    def resume(cls, cfg: Config, root: str, plan=None, log=print) -> tuple["StreamedRun", str, dict]:
        """``Trainer.resume`` for full training."""
        from megatrain_jax.hoststore import HostStore
        from megatrain_jax.models.llama import abstract_model, streamed_parts
        from megatrain_jax.templates import Layout

        plan = _plan(cfg, plan)
        cfg = with_plan_tile(cfg, plan)  # the blocks run the working set the plan counted
        parts = streamed_parts(abstract_model(cfg.model))
        store = HostStore({n: Layout(tr) for n, tr in parts.host_trees().items()}, plan.options.host_bf16_copy)
        if _owned(plan.options) is not None:
            store.own(*_owned(plan.options))  # restored share by share: never whole in this process
        host_opt = build_host_optimizer(cfg.optim, cfg.train.steps)
        path, state = ckr.restore_latest(root, store, host_opt, log)
        self = cls._of_config(parts, store, host_opt, cfg, plan)
        self.engine.count = int(state["count"])
        return self, path, state

    @classmethod
    def _of_config(cls, parts: StreamedModel, store: Any, host_opt: HostOptimizer, cfg: Config, plan) -> "StreamedRun":
        """The trainer of ``cfg`` over made parts, a filled store and its host optimizer."""
        self = cls(parts, host_opt, options=plan.options, store=store, steps=cfg.train.steps,
                   devices=run_devices(plan.options.devices))
        self.optimizer_spec = cfg.optim  # what ``plan()`` plans with
        return self

    # ---------------------------------------------------------------------------------- training

    def lr_at(self, count: int) -> float | None:
        """The learning rate of update ``count`` (1-based), or None when the optimizer does not
        expose its schedule (an optax transformation)."""
        lr_at = getattr(self.opt, "lr_at", None)
        return None if lr_at is None else float(lr_at(count))

    @property
    def store(self) -> Any:
        """The ``HostStore``: fp32 weights and optimizer state per group (live, not copies)."""
        return self.engine.store

    def params(self) -> Any:
        """The current fp32 weights (copies), in the model's own tree structure (NNX: like
        ``nnx.to_pure_dict(nnx.state(model, nnx.Param))``; Linen: like ``params``)."""
        self.engine.finish()
        trees = {g.name: jax.tree.map(np.array, g.tree()) for g in self.engine.store}
        assemble = getattr(self.parts, "assemble", None)
        if assemble is not None:
            return assemble(trees)
        return {"embed": trees["embed"], "layers": {i: trees[f"block_{i}"] for i in range(self.engine.num_layers)},
                "head": trees["head"]}

    def update_model(self, model: Any) -> Any:
        """Write the current weights into an NNX model (in place; returned); Linen: returns params."""
        from flax import nnx

        p = self.params()
        if isinstance(model, nnx.Module):
            nnx.update(model, nnx.State(p) if not isinstance(p, nnx.State) else p)
            return model
        return p

    # ---------------------------------------------------------------------------------- checkpoints

    def saver(self, directory: str, *, keep_last: int = 2, keep_every: int = 0, log=lambda _: None) -> ck.CheckpointSaver:
        """Background checkpoints into ``directory`` while training continues (``checkpoint.py``):
        ``save(step, meta, wait=False)`` between steps, ``poll()`` for one that has committed,
        ``wait()``, and ``close()`` (or ``abandon()`` on an abort) when done. Updates that would
        overwrite a group not yet written are held back, so each checkpoint is the state after its step."""
        return ck.CheckpointSaver(self.engine, directory, keep_last=keep_last, keep_every=keep_every, log=log)

    def save(self, directory: str, *, keep_last: int = 2, meta: dict | None = None, log=lambda _: None) -> str:
        """Checkpoint weights, optimizer state and step count to ``directory/step_<count>``
        (checkpoint.py: atomic, checksummed; the ``keep_last`` newest are kept). Returns the path."""
        saver = self.saver(directory, keep_last=keep_last, log=log)
        info = {"trainer": {**self.settings, "optimizer": type(self.opt).__name__},
                "model": getattr(self.parts, "summary", ""), **(meta or {})}
        try:
            return saver.save(self.engine.count, info, wait=True)
        finally:
            saver.close()

    def restore(self, directory: str, log=lambda _: None) -> dict:
        """Load the newest usable checkpoint in ``directory`` (weights, optimizer state, step count:
        dropout keys and schedules continue where they were). Returns its state.json."""
        self.engine.finish()
        _, state = ckr.restore_latest(directory, self.engine.store, self.opt, log)
        for g in self.engine.store:
            self.engine.xfer.host_written(g.name, g.stream_view())
        self.engine.count = int(state["count"])
        return state

    # ---------------------------------------------------------------------------------- memory

    def plan(self, batch_size: int, seq_len: int, *, num_heads: int | None = None, attention: bool = True,
             **train_overrides: Any) -> PlanView:
        """The CLI's memory plan (``plan.make_plan``) for this model at ``batch_size`` x ``seq_len``
        (``attention=False``: a model without attention: no attention term, row or line).

        The plan reads Llama-shaped sizes (``ModelConfig``); this model is described by one with the
        same vocabulary, width, depth, tying and per-block parameter count (the MLP width is solved
        for it), so weights, optimizer state and transfers are exact and the activation working set
        is the calibrated Llama estimate. ``num_heads`` (default: width / 64) shapes the attention term.
        """
        from megatrain_jax.config import Config, ModelConfig, TrainConfig, DataConfig
        from megatrain_jax.plan import make_plan

        store = self.engine.store
        H = int(np.shape(jax.eval_shape(self.parts.embed_fn, self.parts.embed_weights,
                                        np.zeros((1, 2), np.int32)))[-1])
        V = int(jax.eval_shape(lambda hw, h, ew: self.parts.head_fn(hw, h, ew)[1], self.parts.head_weights,
                               jax.ShapeDtypeStruct((1, 2, H), np.float32),
                               self.parts.embed_weights if self.parts.tied else None).shape[-1])
        L = store.num_blocks
        block = store["block_0"].size
        heads = num_heads or max(1, H // 64)
        F = max(1, round((block - 4 * H * H - 2 * H) / (3 * H)))
        m = ModelConfig(vocab_size=V, hidden_size=H, num_layers=L, num_heads=heads, intermediate_size=F,
                        tie_embeddings=self.parts.tied)
        opt = self.optimizer_spec if isinstance(self.optimizer_spec, OptimConfig) else OptimConfig(kernel="optax")
        t = TrainConfig(batch_size=batch_size, micro_batches=self.settings["micro_batches"],
                        compute_dtype=self.settings["compute_dtype"], loss_chunk=self.settings["loss_chunk"],
                        final_checkpoint=False)
        for k, v in train_overrides.items():
            if not hasattr(t, k):
                raise UserError(f"train.{k}", "unknown train setting", "see config.TrainConfig")
            setattr(t, k, v)
        cfg = Config(model=m, optim=opt, data=DataConfig(seq_len=seq_len), train=t)
        return PlanView(make_plan(cfg, attention=attention), cfg)

    def export(self, cfg: Config, out: str, *, sources=(), own_run: str | None = None, log=print) -> None:
        """``train.export`` at the end of a config run: the weights as a Hugging Face directory (``hf.export_hf``;
        a run of adapters writes its adapter)."""
        from megatrain_jax.hf import export_hf

        export_hf(self.store, cfg.model, out, cfg.train.export_dtype, overwrite=True, sources=sources,
                  own_run=own_run, log=log)


class Trainer:
    """Streamed training of a Flax model (see the module docstring); answers ``TrainerProtocol``.

    ``model``: a ``StreamedModel`` (from ``stream.stream`` or ``models.streamed_parts``), or an NNX
    model / Linen module (``params=`` its params) with ``stream_kwargs`` passed on to ``stream``.
    ``optimizer``: ``OptimConfig``, ``optax.GradientTransformation`` or ``HostOptimizer``.
    ``options``: the engine's ``EngineOptions`` (what the memory plan decides; default: its
    defaults); ``micro_batches``, ``clip_norm`` ("auto": the ``OptimConfig``'s, else none),
    ``compute_dtype``, ``loss_chunk``, ``seed`` (dropout keys: ``templates.block_rng(seed, step,
    layer, micro_batch)``) and ``skip_nonfinite`` set its fields. ``steps``: the run's length, for
    schedules that decay over it. ``store``: an already-filled ``HostStore`` for the model.
    ``lora``: a ``LoraConfig`` (or dict): the trained subset is the LoRA adapters on the model's
    targeted ``nnx.Linear`` modules, over a frozen (possibly int8) base (``lora_trainer.py``).

    From a ``Config`` (what ``megatrain-jax train`` does): ``from_config`` or ``resume``. The work is
    done by ``run`` (``run_class``): a ``StreamedRun`` (every weight trained) or a ``lora_trainer.LoraRun``
    (the adapters trained over a frozen base: a user's model's, or a config's ``model.lora``); this class
    is the one public face of both.
    """

    def __init__(self, model: Any, optimizer: Any = None, *, lora: Any = None, **kwargs: Any):
        self.run: TrainerProtocol = run_class(lora)(model, optimizer, lora=lora, **kwargs)

    @classmethod
    def of_run(cls, run: TrainerProtocol) -> "Trainer":
        """The trainer whose work ``run`` does (``from_config``, ``resume``)."""
        self = cls.__new__(cls)
        self.run = run
        return self

    @classmethod
    def from_config(cls, cfg: Config, plan=None, *, model: Any = None) -> "Trainer":
        """A new run of ``cfg``: the host store initialised part by part from ``train.seed`` (the
        whole model is never materialised), or filled from a Hugging Face checkpoint
        (``model.from_hf``), or from ``model`` (a ``models.llama`` Decoder) when given; the engine
        options are the memory plan's (``plan.options``; planned, and refused if it does not fit,
        when not given), on the run's devices (``train.devices``), exactly as ``megatrain-jax
        train`` runs it. With ``model.lora`` the adapters are trained over a frozen base
        (``lora_trainer.LoraRun``)."""
        return cls.of_run(run_class(cfg.model.lora).from_config(cfg, plan, model=model))

    @classmethod
    def resume(cls, cfg: Config, root: str, plan=None, log=print) -> tuple["Trainer", str, dict]:
        """``cfg``'s run continued from the newest usable checkpoint in ``root``: the host store is
        allocated empty and restored group by group (never initialised first), the step count (hence
        the LR schedule) restored. Returns the trainer, the checkpoint's path and its state.json."""
        run, path, state = run_class(cfg.model.lora).resume(cfg, root, plan, log)
        return cls.of_run(run), path, state

    # ------------------------------------------------------------------------ what the run holds

    @property
    def engine(self) -> Any:
        """The streamed engine (``engine/step.StreamedTrainer``, or ``engine/lora.LoraEngine``)."""
        return self.run.engine

    @property
    def store(self) -> Any:
        """The host store: the trained weights and optimizer state per group (adapters: the frozen base)."""
        return self.run.store

    @property
    def parts(self) -> Any:
        return self.run.parts

    @property
    def opt(self) -> Any:
        return self.run.opt

    @property
    def optimizer_spec(self) -> Any:
        return self.run.optimizer_spec

    @property
    def options(self) -> EngineOptions:
        return self.run.options

    @property
    def settings(self) -> dict[str, Any]:
        """The engine settings a checkpoint records."""
        return self.run.settings

    @property
    def step_count(self) -> int:
        """Optimizer updates applied so far."""
        return self.run.step_count

    @property
    def memory_device(self) -> jax.Device | None:
        return self.run.memory_device

    @property
    def sharded_checkpoints(self) -> bool:
        return self.run.sharded_checkpoints

    # ------------------------------------------------------------------------ the protocol

    def step(self, batch: Any) -> StepResult:
        """One optimizer step; ``StepResult(loss, grad_norm, tokens, skipped)``."""
        return self.run.step(batch)

    def lr_at(self, count: int) -> float | None:
        """The learning rate of update ``count`` (1-based), or None where the optimizer hides it."""
        return self.run.lr_at(count)

    def params(self) -> Any:
        """The current weights (copies), in the model's own tree structure."""
        return self.run.params()

    def update_model(self, model: Any) -> Any:
        """Write the current weights into an NNX model (in place; returned); Linen: returns params."""
        return self.run.update_model(model)

    def adapters(self) -> Any:
        """A run of adapters: per block, the adapter leaves (fp32 numpy copies)."""
        return self.run.adapters()

    def merged_params(self) -> Any:
        """A run of adapters on a Linen module: its params with the adapters folded in."""
        return self.run.merged_params()

    def saver(self, directory: str, *, keep_last: int = 2, keep_every: int = 0, log=lambda _: None) -> Saver | None:
        """Background checkpoints into ``directory`` while training continues (``StreamedRun.saver``)."""
        return self.run.saver(directory, keep_last=keep_last, keep_every=keep_every, log=log)

    def save(self, directory: str, *, keep_last: int = 2, meta: dict | None = None, log=lambda _: None) -> str:
        """A checkpoint into ``directory/step_<count>`` (atomic, checksummed; the ``keep_last`` newest kept)."""
        return self.run.save(directory, keep_last=keep_last, meta=meta, log=log)

    def restore(self, directory: str, log=lambda _: None) -> dict:
        """Load the newest usable checkpoint in ``directory``; returns its state.json."""
        return self.run.restore(directory, log=log)

    def plan(self, *args: Any, **kwargs: Any) -> Any:
        """The CLI's memory plan for this model (``StreamedRun.plan``)."""
        return self.run.plan(*args, **kwargs)

    def export(self, cfg: Config, out: str, *, sources=(), own_run: str | None = None, log=print) -> None:
        """``train.export`` at the end of a config run: the weights as a Hugging Face directory, or a run's
        adapter in the PEFT format."""
        self.run.export(cfg, out, sources=sources, own_run=own_run, log=log)

    def close(self) -> None:
        self.run.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_class(lora: Any) -> type:
    """The run that trains ``lora``'s variant (``plan.lora.variant``, the one place it is chosen): every weight
    (``StreamedRun``), or the adapters over a frozen base (``lora_trainer.LoraRun``). Each is built from a model
    (the constructor) or a config (``from_config``, ``resume``) and answers ``TrainerProtocol``."""
    if variant(lora) == FULL:
        return StreamedRun
    from megatrain_jax.lora_trainer import LoraRun

    return LoraRun


def with_plan_tile(cfg: Config, plan) -> Config:
    """``cfg`` with the blocks' sequence tile the plan decided (``model.seq_tile=auto`` resolved), so the
    model built from it runs the working set the plan counted."""
    import dataclasses

    if plan is None or plan.options is None or cfg.model.seq_tile_tokens == plan.options.seq_tile:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, seq_tile=plan.options.seq_tile))


def _owned(options) -> tuple | None:
    """``train.host_state=sharded``: the values of each group this process backs (``HostStore.own``'s arguments),
    its devices' shares; None for a replicated store."""
    from megatrain_jax.engine.shards import process_bounds
    from megatrain_jax.optim.device_adamw import BLOCK
    if not options.host_state_place.sharded:
        return None
    devices = run_devices(options.devices)
    return (lambda n: process_bounds(n, devices, BLOCK)), BLOCK
