"""Optimizers from ``OptimConfig``: the learning-rate schedule, the host optimizer (fused kernels or a
named optax transformation), its whole-model optax equivalent for the reference trainer, and the bytes
of its state (for the memory plan). Re-exported by ``megatrain_jax.optim``."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax

from megatrain_jax.config import OptimConfig
from megatrain_jax.errors import UserError
from megatrain_jax.optim.host import CompactAdamW, FusedAdamW, HostOptimizer
from megatrain_jax.optim.optax_flat import OptaxHostOptimizer
from megatrain_jax.optim.named import SHAPE_AWARE, NamedOptaxOptimizer, named_tx, resolved, state_label


def build_schedule(optim_cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """The learning rate per step (the schedule sees 0 at the first update, as in optax).

    - ``constant``: ``lr``.
    - ``cosine``: cosine decay from ``lr`` to ``lr * end_lr_ratio`` over ``decay_steps``.
    - ``warmup_cosine``: linear warmup from 0 to ``lr`` over ``warmup_steps``, then cosine decay to
      ``lr * end_lr_ratio``; ``decay_steps`` counts the warmup too (optax's convention).
    - ``linear``: linear decay from ``lr`` to ``lr * end_lr_ratio`` over ``decay_steps``.
    For ``constant``, ``cosine`` and ``linear``, ``warmup_steps > 0`` prepends a linear warmup from 0 and
    the decay then takes the remaining ``decay_steps - warmup_steps`` steps.
    ``decay_steps = 0`` means ``total_steps``.
    """
    s = optim_cfg.schedule
    lr, end = float(optim_cfg.lr), float(optim_cfg.lr) * float(s.end_lr_ratio)
    decay = s.decay_steps or total_steps
    warm = s.warmup_steps
    if warm < 0 or decay <= 0:
        raise UserError("optim.schedule", f"warmup_steps={warm}, decay_steps={decay}",
                        "use warmup_steps >= 0 and decay_steps > 0 (or train.steps > 0)")
    if s.kind != "constant" and warm >= decay:
        raise UserError("optim.schedule.warmup_steps",
                        f"warmup ({warm} steps) leaves no room to decay within {decay} steps",
                        "make optim.schedule.decay_steps (or train.steps) larger than warmup_steps")
    if s.kind == "warmup_cosine":
        return optax.warmup_cosine_decay_schedule(0.0, lr, warm, decay, end_value=end)
    if s.kind == "constant":
        main = optax.constant_schedule(lr)
    elif s.kind == "cosine":
        main = optax.cosine_decay_schedule(lr, decay - warm, alpha=float(s.end_lr_ratio))
    elif s.kind == "linear":
        main = optax.linear_schedule(lr, end, decay - warm)
    else:
        raise UserError("optim.schedule.kind", f"{s.kind!r} is not a schedule",
                        "use constant, cosine, warmup_cosine or linear")
    if warm == 0:
        return main
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warm), main], [warm])


def learning_rate_or_schedule(optim_cfg: OptimConfig, total_steps: int) -> float | optax.Schedule:
    """The learning rate optax gets: a float for a constant rate without warmup (no schedule state),
    else the schedule. Public: the LoRA trainer builds its optimizer with it."""
    s = optim_cfg.schedule
    if s.kind == "constant" and s.warmup_steps == 0:
        return float(optim_cfg.lr)  # optax then scales by a constant, no schedule state
    return build_schedule(optim_cfg, total_steps)


def build_host_optimizer(optim_cfg: OptimConfig, total_steps: int) -> HostOptimizer:
    """``kernel: fused`` -> ``FusedAdamW`` / ``CompactAdamW`` (adamw only); ``kernel: optax`` -> a
    ``NamedOptaxOptimizer`` (an ``OptaxHostOptimizer``) over ``named.named_tx``: adamw, lion, adafactor,
    sgd (``add_decayed_weights`` before it when weight_decay > 0), lion with ``moments=int8``
    (``lean.lion_int8``), muon (``optax.contrib.muon``), or
    ``optax.<optax_name>(learning_rate=schedule, weight_decay=..., **optax_kwargs)``."""
    o = optim_cfg
    lr = learning_rate_or_schedule(o, total_steps)
    if o.kernel == "fused":
        if o.name != "adamw":
            raise UserError("optim.kernel", f"the fused kernel implements adamw only, not {o.name}",
                            "set optim.kernel=optax")
        h = resolved(o)
        kw = dict(b1=h["b1"], b2=h["b2"], eps=h["eps"], eps_root=0.0, weight_decay=o.weight_decay)
        if o.moments != "float32":
            return CompactAdamW(lr, o.moments, **kw)
        return FusedAdamW(lr, **kw)
    if o.moments != "float32" and (o.name, o.moments) != ("lion", "int8"):
        raise UserError("optim.moments", f"{o.moments} moments are implemented by the fused kernel and int8 Lion only",
                        "set optim.kernel=fused (adamw), optim.name=lion (int8), or optim.moments=float32")
    if o.kernel == "optax":
        return NamedOptaxOptimizer(state_label(o), named_tx(o, lr), lr, shape_aware=o.name in SHAPE_AWARE)
    raise UserError("optim.kernel", f"{o.kernel!r} is not a kernel", "use fused or optax")


def build_reference_tx(optim_cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """The whole-model optax transformation the host optimizer is equivalent to, clipping included."""
    c = optim_cfg.clip_norm
    clip = optax.clip_by_global_norm(c) if c else optax.identity()
    return optax.chain(clip, build_host_optimizer(optim_cfg, total_steps).as_optax())


# --------------------------------------------------------------------------------- state bytes


def state_bytes(optim_cfg: OptimConfig, group_tree: Any, total_steps: int | None = None) -> dict[str, int]:
    """Bytes of the optimizer state of one group, by dtype, from ``jax.eval_shape`` of its ``init``
    (nothing is allocated). ``group_tree``: the group's pytree of arrays or ``ShapeDtypeStruct``s."""
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
