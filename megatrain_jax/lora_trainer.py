"""LoRA as a trainable subset of the streamed run: ``LoraRun``, the run of ``Trainer(model, tx, lora=...)`` and of
a config's ``model.lora``. The adapters are what is trained (resident on the device, updated by optax); the base is
frozen (bf16, int8 or fp32 in host memory) and streamed by the one engine (``engine/lora.LoraEngine``, whose step
is ``engine/step.StreamedTrainer.step``). What differs between a user's model and a config's is where the base
comes from and how the adapters are written (``lora_io.py``: ``TreeAdapters``, ``PeftAdapters``).

    tr = Trainer(model, optax.adamw(1e-3), lora=LoraConfig(rank=8, alpha=16, targets=["qkv", "out"]),
                 clip_norm=1.0)
    for tokens in batches:
        tr.step(tokens)
    adapters = tr.adapters()          # per block: {path...: {"lora_a": (in, r), "lora_b": (r, out)}}
    tr.update_model(model)            # the model's targeted Linears become LoraLinear with these values

The targeted ``nnx.Linear`` modules of every block (matched by attribute name: ``q`` .. ``down`` mean
``q_proj`` .. ``down_proj``, anything else is a ``Linear``'s own name, peft's ``target_modules`` rule)
become ``LoraLinear`` in a clone of the model (the clone shares the weight arrays), which ``stream()``
then splits as usual: its block template reads the adapters as two more leaves. Here those leaves are
separated from the frozen rest: the base goes to a ``FrozenStore`` (``lora.base_dtype``), the adapters
to ``LoraEngine``, whose backward differentiates only with respect to the adapters and the hidden state.

Adapter dropout (``lora.dropout``) is an ``nnx.Dropout`` on each adapter's input, so the block draws
from the key the engine gives it per (step, layer, micro-batch), as any dropout in a streamed block
(``stream`` docstring); the backward's recompute sees the same mask.

``devices=[...]`` (this process's): data parallel, each device a slice of every micro-batch (``LoraEngine``).
A registry ``models.common.Decoder`` takes its family's own LoRA blocks (``targets``: q .. down).

``save(dir)``/``restore(dir)``: ``dir/step_<count>/`` with the adapters (a user's model: ``adapters.npz``, keyed
by path; a config's: the PEFT pair), the optimizer state and the count (``checkpoint.CheckpointSaver``: atomic,
checksummed, ``keep_last``); restore continues exactly (dropout keys and the schedule follow the count).

From a config (``from_config`` / ``resume``, what ``megatrain-jax train`` runs): the base built from the config
or read from Hugging Face, the engine options as the memory plan decided, the adapter exported in the PEFT format.

A Linen module (``params=`` its params) takes adapters beside its targeted Dense kernels
(``lora_linen.py``); ``merged_params()`` gives its params with the adapters folded in.

Not here yet: the memory plan of a user's model.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import optax

from megatrain_jax import checkpoint as ck
from megatrain_jax.checkpoint_read import read_checked
from megatrain_jax.config import Config
from megatrain_jax.config.schema import LoraConfig, lora_from_dict
from megatrain_jax.engine.lora import LoraEngine
from megatrain_jax.engine.lora_base import FrozenStore
from megatrain_jax.engine.lora_stream import StreamLoraModel
from megatrain_jax.engine_run import EngineRun
from megatrain_jax.errors import UserError
from megatrain_jax.lora_io import AdapterFiles, PeftAdapters, TreeAdapters, config_engine, load_opt_state, \
    newest_checkpoint
from megatrain_jax.models.common import Decoder
from megatrain_jax.models.lora import LoraLinear, merge_adapters
from megatrain_jax.plan.options import EngineOptions


def _lora_config(lora: Any) -> LoraConfig:
    if isinstance(lora, dict):
        lora = lora_from_dict(lora)
    if not isinstance(lora, LoraConfig):
        raise UserError("lora", f"a {type(lora).__name__} is not a LoRA config",
                        "pass lora=LoraConfig(rank=..., alpha=..., targets=[...]) or a dict of those fields")
    if not isinstance(lora.rank, int) or lora.rank < 1:
        raise UserError("lora.rank", f"must be an integer >= 1, got {lora.rank!r}", "e.g. rank=8")
    if not lora.alpha > 0:
        raise UserError("lora.alpha", f"must be > 0, got {lora.alpha!r}", "e.g. alpha=16")
    if not 0 <= lora.dropout < 1:
        raise UserError("lora.dropout", f"must be a number in [0, 1), got {lora.dropout!r}", "e.g. dropout=0.05")
    if lora.base_dtype not in ("bfloat16", "int8", "float32"):
        raise UserError("lora.base_dtype", f"{lora.base_dtype!r} is not supported", "use bfloat16, int8 or float32")
    if not lora.targets or not all(isinstance(t, str) for t in lora.targets):
        raise UserError("lora.targets", f"must be a non-empty list of Linear attribute names, got {lora.targets!r}",
                        "e.g. targets=['q_proj', 'v_proj'] (or q, k, v, o, gate, up, down)")
    return lora


class LoraRun(EngineRun):
    """A run of adapters (see the module docstring): the trainer protocol (``trainer_protocol.TrainerProtocol``)
    over a ``LoraEngine`` (``EngineRun``: its step, count and device); ``Trainer`` is its public face. Built from
    a user's model (the constructor) or from a config (``from_config``, ``resume``)."""

    def __init__(self, model: Any, optimizer: Any = None, *, lora: Any, options: EngineOptions | None = None,
                 store: Any = None, params: Any = None, steps: int | None = None, micro_batches: int | None = None,
                 clip_norm: float | None | str = "auto", compute_dtype: str | None = None,
                 loss_chunk: int | None = None, seed: int | None = None, skip_nonfinite: bool | None = None,
                 device: jax.Device | None = None, devices: list | None = None, **stream_kwargs: Any):
        from flax import nnx

        from megatrain_jax.config import OptimConfig
        from megatrain_jax.models.lora import add_named_adapters, target_names
        from megatrain_jax.stream import stream
        from megatrain_jax.stream.from_nnx import find_blocks

        import flax.linen as nn

        lora = _lora_config(lora)
        linen = isinstance(model, nn.Module)
        if not isinstance(model, nnx.Module) and not linen:
            raise UserError("lora", f"LoRA through Trainer adapts the Linear modules of an NNX or Linen model, not a "
                            f"{type(model).__name__}", "pass the model itself (Linen: with params=)")
        if linen and params is None:
            raise UserError("params", "a Linen module's weights are its params", "pass params=variables['params']")
        for name, v in (("store", store), ("params", None if linen else params), ("skip_nonfinite", skip_nonfinite)):
            if v is not None:
                raise UserError(name, "is not used with lora=", f"leave {name} unset")
        if devices is not None and any(d.process_index != jax.process_index() for d in devices):
            raise UserError("devices", "LoRA data parallel runs in one process", "pass this process's devices")
        o = options or EngineOptions()
        seed = o.rng_seed if seed is None else int(seed)
        self.lora, self.optimizer_spec, self.steps = lora, optimizer, steps
        self.cfg, self.memory_plan, self.files = None, None, TreeAdapters()
        self._linen_targets = None  # Linen: target path -> contracted axes (engine/lora_linen.py)
        if linen:
            from megatrain_jax.engine.lora_linen import add_linen_adapters

            self._blocks = None
            self.parts, self._linen_targets = add_linen_adapters(stream(model, params=params, **stream_kwargs),
                                                                 lora, seed)
            self.model = StreamLoraModel(self.parts)
            frozen = FrozenStore.from_trees(self.model.trees, lora.base_dtype)
        elif isinstance(model, Decoder):  # a registry model: its own LoRA blocks (models/lora.py), as model.lora
            frozen = self._registry(model, lora, stream_kwargs)
        else:
            names = target_names(lora.targets)
            clone = nnx.clone(model)  # shares the weight arrays; the user's model is left as it is
            attr, blocks = find_blocks(clone, stream_kwargs.get("blocks"))
            for i, blk in enumerate(blocks):
                if add_named_adapters(blk, names, lora.rank, lora.scale, i, seed, lora.dropout) == 0:
                    raise UserError("lora.targets", f"{attr}[{i}] has no nnx.Linear named {sorted(names)}",
                                    "name the blocks' Linear attributes (e.g. targets=['qkv', 'out'])")
            self._blocks = attr
            self.parts = stream(clone, **stream_kwargs)
            self.model = StreamLoraModel(self.parts)
            frozen = FrozenStore.from_trees(self.model.trees, lora.base_dtype)
        if clip_norm == "auto":
            clip_norm = optimizer.clip_norm if isinstance(optimizer, OptimConfig) else o.clip_norm
        self._lr = None
        if isinstance(optimizer, OptimConfig) or optimizer is None:
            from megatrain_jax.optim.build import learning_rate_or_schedule
            from megatrain_jax.optim.named import named_tx

            ocfg = optimizer or OptimConfig(kernel="optax", clip_norm=None)
            self._lr = learning_rate_or_schedule(ocfg, steps or 1)
            tx = named_tx(ocfg, self._lr)
        elif isinstance(optimizer, optax.GradientTransformation):
            tx = optimizer
        else:
            raise UserError("optimizer", f"a {type(optimizer).__name__} cannot train adapters",
                            "pass an optax.GradientTransformation or an OptimConfig")
        self.opt = tx
        self.engine = LoraEngine(self.model, frozen, tx, seed=seed, compute_dtype=compute_dtype or o.compute_dtype,
                                 micro_batches=micro_batches or o.micro_batches, clip_norm=clip_norm,
                                 loss_chunk=loss_chunk or o.loss_chunk, device=device, devices=devices)

    def _registry(self, model: Any, lora: LoraConfig, stream_kwargs: dict) -> FrozenStore:
        """A ``models.common.Decoder``: ``LoraModel`` of its config with ``lora`` (targets: q .. down)."""
        import dataclasses

        from megatrain_jax.config.lora import validate_lora
        from megatrain_jax.engine.lora import LoraModel
        from megatrain_jax.models.common import streamed_parts

        if stream_kwargs:
            raise UserError(sorted(stream_kwargs)[0], "a registry model is split by its family", "leave it unset")
        validate_lora(dataclasses.replace(lora, targets=list(lora.targets)))
        self._blocks, self.parts = "layers", None
        self.model = LoraModel(dataclasses.replace(model.cfg, lora=lora))
        return FrozenStore.from_trees(streamed_parts(model).host_trees(), lora.base_dtype)

    @classmethod
    def from_config(cls, cfg: Config, plan: Any = None, *, model: Any = None) -> "LoraRun":
        """A new run of ``cfg``'s adapters (``model``: unused, the base is built from the config)."""
        del model
        return cls._of_config(cfg, plan)

    @classmethod
    def resume(cls, cfg: Config, root: str, plan: Any = None, log=print) -> tuple["LoraRun", str, dict]:
        """``cfg``'s run of adapters continued from the newest intact checkpoint in ``root``."""
        path, state, adapters = newest_checkpoint(cfg, root, log)
        self = cls._of_config(cfg, plan, adapters, log)
        opt_state = load_opt_state(path, self.engine, "--resume", "optim.*",
                                   "resume with the checkpointed run's optim settings")
        self.engine.set_state(self.engine.adapters, opt_state, int(state["count"]))
        return self, path, state

    @classmethod
    def _of_config(cls, cfg: Config, plan: Any = None, adapters: list[Any] | None = None, log=print) -> "LoraRun":
        """The run of ``cfg`` (``adapters``: a checkpoint's, else drawn as ``model.lora`` says)."""
        self = cls.__new__(cls)
        self.model, self.engine, self._lr = config_engine(cfg, plan, adapters, log)
        self.cfg, self.memory_plan, self.files = cfg, plan, PeftAdapters(cfg.model)
        self.lora, self.optimizer_spec, self.steps = cfg.model.lora, cfg.optim, cfg.train.steps
        self.opt = self.engine.tx
        self.parts, self._blocks, self._linen_targets = None, "layers", None
        return self

    @property
    def options(self) -> EngineOptions:
        e = self.engine
        return EngineOptions(compute_dtype=str(e.dtype), micro_batches=e.micro_batches, loss_chunk=e.loss_chunk,
                             clip_norm=e.clip_norm, rng_seed=e.seed)

    @property
    def settings(self) -> dict[str, Any]:
        e = self.engine
        return dict(micro_batches=e.micro_batches, clip_norm=e.clip_norm, compute_dtype=str(e.dtype),
                    loss_chunk=e.loss_chunk, seed=e.seed, lora=vars(self.lora))

    def lr_at(self, count: int) -> float | None:
        lr = self._lr
        if lr is None:
            return None
        return float(lr) if isinstance(lr, float) else float(lr(max(count - 1, 0)))

    @property
    def store(self) -> FrozenStore:
        """The frozen base (``FrozenStore``)."""
        return self.engine.store

    def export(self, cfg: Any, out: str, *, sources=(), own_run: str | None = None, log=print) -> None:
        """``train.export`` at the end of a run: a config's adapter in the PEFT format (the base with it merged
        in: ``megatrain-jax export RUN OUT --merge-lora``, ``hf/merge.py``); a user's model's is refused."""
        del cfg, sources, own_run  # (the run's own config; the adapter directory is small and always new)
        self.files.export(self.adapters(), out, log)

    def adapters(self) -> list[Any]:
        """Per block, the adapter leaves (fp32 numpy copies) nested as the block's weights."""
        return self.engine.adapters_host()

    def params(self) -> Any:
        """Base (as stored: dequantised) and adapters in the model's own tree (``lora_a``/``lora_b``
        beside each targeted ``kernel``)."""
        self.engine.finish()
        ad = self.adapters()
        trees = {g.name: jax.tree.map(np.array, g.tree()) for g in self.engine.store}
        for i, a in enumerate(ad):
            trees[f"block_{i}"] = merge_adapters(a, trees[f"block_{i}"])
        if self.parts is None:  # a registry Decoder's own tree
            return {"embed": trees["embed"], "layers": {i: trees[f"block_{i}"] for i in range(len(ad))},
                    "head": trees["head"]}
        return self.parts.assemble(trees)

    def merged_params(self) -> Any:
        """Linen: the module's params with each targeted kernel + scale * A B (``module.apply`` them)."""
        from megatrain_jax.engine.lora_linen import merged_params

        if self._linen_targets is None:
            raise UserError("merged_params", "is for Linen modules", "use update_model(model) for an NNX model")
        self.engine.finish()
        trees = {g.name: jax.tree.map(np.array, g.tree()) for g in self.engine.store}
        return merged_params(self.parts, trees, self.adapters(), self._linen_targets, self.lora.scale)

    def update_model(self, model: Any) -> Any:
        """Attach adapters to ``model``'s targeted Linears (where not yet ``LoraLinear``) and set every
        weight to this run's (in place; returned)."""
        from flax import nnx

        if self._linen_targets is not None:
            raise UserError("update_model", "a Linen module holds no weights to update",
                            "apply it with tr.merged_params() (or tr.params() and tr.adapters())")

        from megatrain_jax.models.lora import add_named_adapters, target_names
        from megatrain_jax.stream.from_nnx import find_blocks

        from megatrain_jax.models.lora import add_adapters

        _, blocks = find_blocks(model, self._blocks)
        for i, blk in enumerate(blocks):
            if self.parts is None:
                if not any(isinstance(n, LoraLinear) for _, n in nnx.iter_graph(blk)):
                    add_adapters(blk, self.model.cfg, i, 0)
            else:
                add_named_adapters(blk, target_names(self.lora.targets), self.lora.rank, self.lora.scale, i, 0,
                                   self.lora.dropout)
        state = nnx.state(model, nnx.Param)
        nnx.replace_by_pure_dict(state, self.params())
        nnx.update(model, state)
        return model

    # ---------------------------------------------------------------------------------- checkpoints

    def saver(self, directory: str, *, keep_last: int = 2, keep_every: int = 0, log=lambda _: None
              ) -> ck.CheckpointSaver:
        """Checkpoints into ``directory`` between steps (``save(step, meta)``), as ``Trainer.saver``: the one saver,
        its files the adapters (``lora_io.AdapterFiles``). A directory with checkpoints of another kind of run is
        refused: retention would delete them."""
        for c in ck.list_checkpoints(directory):
            if not self.files.holds(c.path):
                raise UserError("directory", f"{directory} holds {c.path}, not a checkpoint of {self.files.what}: "
                                "saving there would prune or replace it", "save into a directory of its own")
        self.engine.finish()
        return ck.CheckpointSaver(self.engine, directory, keep_last=keep_last, keep_every=keep_every, log=log,
                                  files=AdapterFiles(self.engine, self.files))

    def save(self, directory: str, *, keep_last: int = 2, meta: dict | None = None, log=lambda _: None) -> str:
        """Adapters, their optimizer state and the step count into ``directory/step_<count>`` (atomic,
        checksummed; the ``keep_last`` newest kept). An existing checkpoint of this step is never replaced
        (a one-line error). Returns the path."""
        saver = self.saver(directory, keep_last=keep_last, log=log)
        final = os.path.join(directory, ck.step_dirname(self.engine.count))
        if os.path.exists(final):
            raise UserError("directory", f"{final} already exists", "save into another directory (or step first)")
        info = {"trainer": {**self.settings, "optimizer": type(self.opt).__name__}, **(meta or {})}
        return saver.save(self.engine.count, info, wait=True)

    def restore(self, directory: str, log=lambda _: None) -> dict:
        """Load the newest intact checkpoint in ``directory`` (a corrupted one is moved aside and the one
        before it taken). Returns its state.json."""
        self.engine.finish()
        cks = ck.list_checkpoints(directory)
        if not cks:
            raise UserError("directory", f"no complete checkpoint in {directory}", "pass the directory save() wrote")
        for c in reversed(cks):
            try:
                state = read_checked(c.path)
            except ck.CorruptCheckpoint as e:
                os.replace(c.path, c.path + ".corrupt")
                log(f"checkpoint: {c.path} is corrupted: {e}; moved it to {c.path}.corrupt")
                continue
            if not self.files.holds(c.path):
                raise UserError("directory", f"{c.path} is not a checkpoint of {self.files.what}",
                                "restore a checkpoint this kind of run wrote (a config run: `megatrain-jax train "
                                "--resume`)")
            adapters = self.files.read(c.path, self.adapters())
            opt_state = load_opt_state(c.path, self.engine, "optimizer", "this optimizer",
                                       "restore with the checkpointed optimizer")
            self.engine.set_state(adapters, opt_state, int(state["count"]))
            return state
        raise UserError("directory", f"every checkpoint in {directory} is corrupted", "start again without restore")

    def plan(self, *a: Any, **k: Any) -> Any:
        """The memory plan a config run was built with; a user's model is not planned yet."""
        if self.cfg is None:
            raise UserError("plan", "is not implemented for Trainer(..., lora=) yet",
                            "plan a registry model with model.lora in a config: megatrain-jax plan CONFIG")
        return self.memory_plan
