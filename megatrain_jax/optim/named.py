"""Named optimizers (``optim.name``): the optax transformation of each, its host optimizer, and the
bytes per parameter of its state.

Each name is one optax transformation built from ``OptimConfig`` (fields left null take the values in
``config.OPTIMIZER_FIELDS``). The streamed engine runs it per group through ``OptaxHostOptimizer``,
which hands optax the group's pytree with every leaf in its real shape (``layout.unflatten``), so an
update that depends on a parameter's shape (Adafactor's factored moments, Muon's Newton-Schulz on
matrices, Muon's Adam for the others) equals the same transformation on the whole model.
"""
from __future__ import annotations

import inspect
from typing import Any

import jax
import numpy as np
import optax

from megatrain_jax.config import OPTIMIZER_FIELDS, OptimConfig
from megatrain_jax.errors import UserError
from megatrain_jax.optim.host import Unflatten, _ScheduleOnCpu
from megatrain_jax.optim.optax_flat import OptaxHostOptimizer

# optimizers whose update of a leaf depends on its shape: they must see the group's pytree
SHAPE_AWARE = frozenset({"adafactor", "muon", "optax"})
_OPTAX_FIX = "name an optax optimizer function, e.g. lion, adafactor, adabelief"


def resolved(o: OptimConfig) -> dict[str, Any]:
    """The optimizer's own hyper-parameters: the config's values, its defaults where null."""
    return {f: default if getattr(o, f) is None else getattr(o, f) for f, default in OPTIMIZER_FIELDS[o.name].items()}


def state_label(o: OptimConfig) -> str:
    """What the checkpoint's state keys are prefixed with: the optimizer, so another one is refused."""
    if o.name == "optax":
        return f"optax.{o.optax_name}"
    return o.name if o.moments == "float32" else f"{o.name}.{o.moments}"


def check_optax(o: OptimConfig) -> None:
    """``optim.name=optax``: ``optax_name`` names an optax optimizer taking ``learning_rate``;
    ``optax_kwargs`` are its arguments; a weight decay needs a function that takes one."""
    if not o.optax_name:
        raise UserError("optim.optax_name", "is required with optim.name=optax", _OPTAX_FIX)
    fn = getattr(optax, str(o.optax_name), None)
    if not callable(fn) or isinstance(fn, type) or str(o.optax_name).startswith("_"):
        raise UserError("optim.optax_name", f"{o.optax_name!r} is not an optax optimizer", _OPTAX_FIX)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        raise UserError("optim.optax_name", f"{o.optax_name!r} is not an optax optimizer", _OPTAX_FIX) from None
    if "learning_rate" not in params:
        raise UserError("optim.optax_name", f"optax.{o.optax_name} takes no learning_rate", _OPTAX_FIX)
    if o.weight_decay and "weight_decay" not in params:
        raise UserError("optim.weight_decay", f"optax.{o.optax_name} takes no weight_decay",
                        "set optim.weight_decay=0, or name an optimizer that decays weights")
    kw = o.optax_kwargs
    if kw is None:
        return
    if not isinstance(kw, dict):
        raise UserError("optim.optax_kwargs", f"must be a mapping, got {kw!r}", "write e.g. {b1: 0.9}")
    for k in kw:
        if k in ("learning_rate", "weight_decay"):
            raise UserError(f"optim.optax_kwargs.{k}", "is set by its own field",
                            f"use optim.{'lr' if k == 'learning_rate' else k} instead")
        if k not in params:
            raise UserError(f"optim.optax_kwargs.{k}", f"optax.{o.optax_name} takes no argument {k!r}",
                            f"use one of: {', '.join(p for p in params if p not in ('learning_rate', 'weight_decay'))}")


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
    if o.name == "muon":
        from optax.contrib import muon

        return muon(lr, ns_steps=h["ns_steps"], beta=h["momentum"], eps=h["eps"], weight_decay=wd,
                    nesterov=h["nesterov"], adam_b1=h["b1"], adam_b2=h["b2"], adam_weight_decay=wd)
    if o.name == "optax":
        check_optax(o)
        fn = getattr(optax, o.optax_name)
        kwargs = dict(o.optax_kwargs or {})
        if "weight_decay" in inspect.signature(fn).parameters:
            kwargs["weight_decay"] = wd
        tx = fn(learning_rate=lr, **kwargs)
        if not isinstance(tx, optax.GradientTransformation):
            raise UserError("optim.optax_name", f"optax.{o.optax_name} is not an optimizer", _OPTAX_FIX)
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
        self._lr = _ScheduleOnCpu(learning_rate, cpu_device) if callable(learning_rate) else None

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


# --------------------------------------------------------------------------------- state bytes


def state_bytes(optim_cfg: OptimConfig, group_tree: Any, total_steps: int | None = None) -> dict[str, int]:
    """Bytes of the optimizer state of one group, by dtype, from ``jax.eval_shape`` of its ``init``
    (nothing is allocated). ``group_tree``: the group's pytree of arrays or ``ShapeDtypeStruct``s."""
    from megatrain_jax.optim import build_host_optimizer

    steps = total_steps or optim_cfg.schedule.warmup_steps + 2  # any horizon: the state's shape is the same
    opt = build_host_optimizer(optim_cfg, steps)
    if not isinstance(opt, OptaxHostOptimizer):  # the fused kernels' own formats
        n = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(group_tree))
        total = int(round(opt.bytes_per_param() * n))
        if opt.moments == "int8":  # codes, and one fp32 absmax per block and moment
            return {"uint8": 2 * n, "float32": total - 2 * n}
        return {"float32" if opt.moments == "float32" else "uint16": total}
    shapes = jax.eval_shape(opt.tx.init, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), group_tree))
    out: dict[str, int] = {}
    for leaf in jax.tree.leaves(shapes):
        key = np.dtype(leaf.dtype).name
        out[key] = out.get(key, 0) + int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
    return out


def state_bytes_per_param(optim_cfg: OptimConfig, group_tree: Any, total_steps: int | None = None) -> float:
    """Host bytes of optimizer state per parameter of ``group_tree`` (e.g. one transformer block):
    8.0 for AdamW in fp32, 4.0 for Lion, ~0.0x for factored Adafactor on matrices."""
    n = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(group_tree))
    return sum(state_bytes(optim_cfg, group_tree, total_steps).values()) / max(n, 1)


def model_state_bytes(optim_cfg: OptimConfig, group_trees: dict[str, Any], total_steps: int | None = None) -> int:
    """Host bytes of the whole model's optimizer state: ``state_bytes`` summed over the groups
    (``streamed_parts(abstract_model(cfg)).host_trees()``), evaluated once per distinct group shape."""
    seen: dict[Any, int] = {}
    total = 0
    for tree in group_trees.values():
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        key = (treedef, tuple((tuple(x.shape), np.dtype(x.dtype).name) for x in leaves))
        if key not in seen:
            seen[key] = sum(state_bytes(optim_cfg, tree, total_steps).values())
        total += seen[key]
    return total
