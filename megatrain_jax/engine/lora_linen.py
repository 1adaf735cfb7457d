"""LoRA on a Linen model: ``Trainer(module, tx, params=params, lora=LoraConfig(...))``.

A Linen module has no objects to swap for ``LoraLinear``: its blocks are applied as functions of their
params (``stream()``'s Linen parts). So the adapters are two more leaves beside each targeted kernel
(``lora_a`` (in, r), ``lora_b`` (r, out), in, out the kernel's contracted and output axes flattened),
and the block runs under ``nn.intercept_methods``: a targeted ``nn.Dense`` / ``nn.DenseGeneral`` returns
its own output plus ``scale * (x A) B``. Targets are the modules' names within a block (``Dense_0``,
``query``, ``out``...). ``lora_trainer.LoraRun`` then streams these parts as it does an NNX model's.

Adapter dropout is not offered for Linen (a one-line error); A is drawn as for NNX (peft's bound, from
``fold_in(adapter_key(seed, layer), j)`` for the j-th target in sorted path order), B is zero.
``merged_params`` gives the module's params with ``kernel + scale * A B`` for plain ``module.apply``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.errors import UserError
from megatrain_jax.models.lora import split_adapters
from megatrain_jax.templates import LayerStack


def _contracted(mod: Any) -> int:
    """How many trailing input axes a Dense(General) contracts with its kernel."""
    axis = getattr(mod, "axis", -1)
    return len(axis) if isinstance(axis, (tuple, list)) else 1


def _probe_targets(stack: LayerStack, names: set[str], hidden: Any, aux: Any) -> dict[tuple, int]:
    """Path within the block -> contracted axes, for every Dense(General) named in ``names`` (one traced
    call of the first block)."""
    import flax.linen as nn

    found: dict[tuple, int] = {}

    def record(next_fun, args, kwargs, ctx):
        mod = ctx.module
        if ctx.method_name == "__call__" and isinstance(mod, (nn.Dense, nn.DenseGeneral)) and mod.name in names:
            found[tuple(mod.path)] = _contracted(mod)
        return next_fun(*args, **kwargs)

    t = stack.templates[stack.kinds[0]]
    args = (stack.weights[0], hidden, aux) + ((jax.random.key(0),) if stack.takes_rng else ())
    with nn.intercept_methods(record):  # a new function: jax's trace cache would skip a template traced before
        jax.eval_shape(lambda *a: t(*a), *args)
    return found


def _get(tree: dict, path: tuple) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def _with(tree: dict, path: tuple, leaves: dict) -> dict:
    """``tree`` (nested dicts, copied along ``path``) with ``leaves`` added at ``path``."""
    if not path:
        return {**tree, **leaves}
    return {**tree, path[0]: _with(tree[path[0]], path[1:], leaves)}


def add_linen_adapters(parts: Any, lora: Any, seed: int) -> tuple[Any, dict[tuple, int]]:
    """``parts`` (stream()'s Linen parts) with adapter leaves in every block's weights and templates that
    apply them; returns (new parts, target path -> contracted axes)."""
    import flax.linen as nn

    from megatrain_jax.models.lora import adapter_key, target_names

    if lora.dropout:
        raise UserError("lora.dropout", "adapter dropout is not offered for Linen modules", "set dropout=0.0")
    stack = parts.blocks
    toks = jnp.zeros((1, 4), jnp.int32)
    hidden = jax.eval_shape(parts.embed_fn, parts.embed_weights, (toks, toks) if parts.embed_takes_positions else toks)
    aux = jax.eval_shape(parts.aux_fn, toks)
    targets = _probe_targets(stack, target_names(lora.targets), hidden, aux)
    if not targets:
        raise UserError("lora.targets", f"no nn.Dense or nn.DenseGeneral of a block is named {sorted(lora.targets)}",
                        "name the blocks' Dense modules (Linen names, e.g. targets=['Dense_0', 'query'])")
    order = [p for p, _ in sorted(((p, n) for p, n in targets.items()), key=lambda t: t[0])]
    weights = []
    for i, w in enumerate(stack.weights):
        base = adapter_key(seed, i)
        for j, path in enumerate(order):
            kernel = np.asarray(_get(w, path)["kernel"])
            n_in = targets[path]
            din, dout = math.prod(kernel.shape[:n_in]), math.prod(kernel.shape[n_in:])
            bound = 1.0 / din ** 0.5  # peft's kaiming_uniform(a=sqrt(5)) bound, as models.lora.attach
            a = np.asarray(jax.random.uniform(jax.random.fold_in(base, j), (din, lora.rank), jnp.float32, -bound, bound))
            w = _with(w, path, {"lora_a": a, "lora_b": np.zeros((lora.rank, dout), np.float32)})
        weights.append(w)
    scale = float(lora.scale)

    def wrap(template):
        def call(w, x, aux_, *rng):
            ad, rest = split_adapters(w)

            def icpt(next_fun, args, kwargs, ctx):
                mod = ctx.module
                path = tuple(mod.path)
                if ctx.method_name != "__call__" or path not in targets:
                    return next_fun(*args, **kwargs)
                y = next_fun(*args, **kwargs)
                xin, leaf = args[0], _get(ad, path)
                xa = xin.reshape(xin.shape[:xin.ndim - targets[path]] + (-1,))
                upd = jnp.dot(jnp.dot(xa, leaf["lora_a"].astype(xin.dtype)), leaf["lora_b"].astype(xin.dtype))
                return y + (upd * jnp.asarray(scale, xin.dtype)).reshape(y.shape).astype(y.dtype)

            with nn.intercept_methods(icpt):
                return template(rest, x, aux_, *rng)
        return call

    templates = {k: wrap(t) for k, t in stack.templates.items()}
    new_stack = dataclasses.replace(stack, template=None, weights=weights, templates=templates)
    return dataclasses.replace(parts, blocks=new_stack), targets


def merged_params(parts: Any, trees: dict, adapters: list[dict], targets: dict[tuple, int], scale: float) -> Any:
    """The Linen module's params with every targeted ``kernel`` replaced by ``kernel + scale * A B``."""
    trees = dict(trees)
    for i, ad in enumerate(adapters):
        w = trees[f"block_{i}"]
        for path, n_in in targets.items():
            leaf = _get(ad, path)
            kernel = np.asarray(_get(w, path)["kernel"], np.float32)
            delta = (np.asarray(leaf["lora_a"], np.float64) @ np.asarray(leaf["lora_b"], np.float64)) * scale
            w = _with(w, path, {"kernel": (kernel + delta.reshape(kernel.shape)).astype(kernel.dtype)})
        trees[f"block_{i}"] = w
    return parts.assemble(trees)
