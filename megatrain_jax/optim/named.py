"""Named optimizers (``optim.name``): the optax transformation of each and its host optimizer (the
bytes of its state: ``build.state_bytes``; ``optax_name``'s check: ``config.validate.check_optax``).

Each name is one optax transformation built from ``OptimConfig`` (fields left null take the values in
``config.OPTIMIZER_FIELDS``). The streamed engine runs it per group through ``OptaxHostOptimizer``,
which hands optax the group's pytree with every leaf in its real shape (``layout.unflatten``), so an
update that depends on a parameter's shape (Adafactor's factored moments, Muon's Newton-Schulz on
matrices, AdamW for the others: ``muon.labels``) equals the same transformation on the whole model.
"""
from __future__ import annotations

import inspect
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax

from megatrain_jax.config import OPTIMIZER_FIELDS, OptimConfig
from megatrain_jax.config.validate import OPTAX_FIX, check_optax
from megatrain_jax.errors import UserError
from megatrain_jax.optim.host import Unflatten, ScheduleOnCpu
from megatrain_jax.optim.optax_flat import OptaxHostOptimizer

# optimizers whose update of a leaf depends on its shape: they must see the group's pytree
SHAPE_AWARE = frozenset({"adafactor", "muon", "optax"})


def resolved(o: OptimConfig) -> dict[str, Any]:
    """The optimizer's own hyper-parameters: the config's values, its defaults where null."""
    return {f: default if getattr(o, f) is None else getattr(o, f) for f, default in OPTIMIZER_FIELDS[o.name].items()}


def state_label(o: OptimConfig) -> str:
    """What the checkpoint's state keys are prefixed with: the optimizer, so another one is refused."""
    if o.name == "optax":
        return f"optax.{o.optax_name}"
    return o.name if o.moments == "float32" else f"{o.name}.{o.moments}"


def named_tx(o: OptimConfig, lr: float | optax.Schedule) -> optax.GradientTransformation:
    """The optax transformation of ``optim.name`` (no clipping: the engine applies it globally)."""
    h, wd = resolved(o), float(o.weight_decay)
    if o.name == "adamw":
        return optax.adamw(lr, b1=h["b1"], b2=h["b2"], eps=h["eps"], weight_decay=wd)
    if o.name == "lion" and o.moments == "int8":
        from megatrain_jax.optim.lean import lion_int8

        return lion_int8(lr, b1=h["b1"], b2=h["b2"], weight_decay=wd)
    if o.name == "lion":
        return optax.lion(lr, b1=h["b1"], b2=h["b2"], weight_decay=wd)
    if o.name == "sgd":
        sgd = optax.sgd(lr, momentum=h["momentum"], nesterov=h["nesterov"])
        return optax.chain(optax.add_decayed_weights(wd), sgd) if wd else sgd
    if o.name == "adafactor":
        return optax.adafactor(lr, min_dim_size_to_factor=h["min_dim_size_to_factor"], decay_rate=h["decay_rate"],
                               multiply_by_parameter_scale=h["multiply_by_parameter_scale"],
                               momentum=h["momentum"], eps=h["eps"], factored=h["factored"],
                               weight_decay_rate=wd or None)
    if o.name == "muon":  # Muon on the blocks' matrices, AdamW on the embedding, head, norms (optim/muon.py)
        from megatrain_jax.optim.muon import muon

        adam_lr = None
        if h["adam_lr"] is not None:  # the same schedule, scaled to adam_lr
            ratio = float(h["adam_lr"]) / float(o.lr)
            adam_lr = (lambda c: lr(c) * ratio) if callable(lr) else float(h["adam_lr"])
        return muon(lr, ns_steps=h["ns_steps"], beta=h["momentum"], eps=h["eps"], weight_decay=wd,
                    nesterov=h["nesterov"], adam_b1=h["b1"], adam_b2=h["b2"], adam_weight_decay=wd,
                    adam_learning_rate=adam_lr, ns_dtype=jnp.dtype(h["ns_dtype"]))
    if o.name == "optax":
        check_optax(o)
        fn = getattr(optax, o.optax_name)
        kwargs = dict(o.optax_kwargs or {})
        if "weight_decay" in inspect.signature(fn).parameters:
            kwargs["weight_decay"] = wd
        tx = fn(learning_rate=lr, **kwargs)
        if not isinstance(tx, optax.GradientTransformation):
            raise UserError("optim.optax_name", f"optax.{o.optax_name} is not an optimizer", OPTAX_FIX)
        return tx
    raise UserError("optim.name", f"{o.name!r} is not an optimizer",
                    "use adamw, lion, adafactor, sgd, muon or optax (with optim.optax_name)")


class NamedOptaxOptimizer(OptaxHostOptimizer):
    """A named optimizer run per group by ``OptaxHostOptimizer`` (on the host or the device).

    Its state keys carry the optimizer (``lion/float32``), so resuming with another optimizer is
    refused by name rather than by a mismatch of key lists; ``lr_at`` gives the schedule's rate for
    the log, as ``FusedAdamW`` does."""

    def __init__(self, label: str, tx: optax.GradientTransformation, learning_rate: float | optax.Schedule,
                 shape_aware: bool = True, cpu_device=None):
        super().__init__(tx, cpu_device)
        self.label, self.shape_aware, self.learning_rate = label, shape_aware, learning_rate
        self.key_prefix = f"{label}/"
        self._lr = ScheduleOnCpu(learning_rate, cpu_device) if callable(learning_rate) else None

    def lr_at(self, count: int) -> float | np.float32:
        """The learning rate that update ``count`` (1-based) uses."""
        return self._lr(count - 1) if self._lr is not None else self.learning_rate

    def _need_tree(self, unflatten: Unflatten | None) -> None:
        if unflatten is None and self.shape_aware:
            raise ValueError(f"{self.label} updates depend on each parameter's shape: pass the group's unflatten")

    def init_state(self, params, unflatten=None):
        self._need_tree(unflatten)
        return super().init_state(params, unflatten)

    def update(self, params, grad, state, count, grad_scale=1.0, bf16_out=None, unflatten=None) -> None:
        self._need_tree(unflatten)
        super().update(params, grad, state, count, grad_scale, bf16_out, unflatten)

    def device_step(self, param, grad, state, scalars, chunk=None, unflatten=None):
        self._need_tree(unflatten)
        return super().device_step(param, grad, state, scalars, chunk, unflatten)

    def state_from_arrays(self, arrays, params, unflatten=None):
        self._need_tree(unflatten)
        other = sorted({k.split("/", 1)[0] for k in arrays if "/" in k and not k.startswith(self.key_prefix)})
        if other:
            raise ValueError(f"the checkpoint holds {other[0]} optimizer state, this run's optimizer is "
                             f"{self.label} (optim.name)")
        # unprefixed keys: a checkpoint of a plain OptaxHostOptimizer, checked by its keys
        arrays = {(k if "/" in k else self.key_prefix + k): v for k, v in arrays.items()}
        try:
            return super().state_from_arrays(arrays, params, unflatten)
        except ValueError as e:
            held = ", ".join(sorted(arrays)[:2]) + (", ..." if len(arrays) > 2 else "")
            raise ValueError(f"the checkpoint's optimizer state ({held or 'none'}) is not {self.label} state "
                             f"(optimizer state keys do not match: {str(e)[:120]})") from None
