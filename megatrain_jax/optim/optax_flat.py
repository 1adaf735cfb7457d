"""Any ``optax.GradientTransformation`` per group, with its state in flat host buffers, run by XLA on the
jax CPU device (``update``, ``train.update_on=host``) or on the accelerator (``device_step``,
``train.update_on=device``): one jitted function of the group's flat buffers, the same on both sides.

Why flat: the state of a group is the optax state pytree's leaves laid end to end, one page-aligned
buffer per dtype (``float32``, ``int32`` for the counts, ``bfloat16``/``uint8`` where a transformation
keeps them), so it crosses PCIe and is written back in place as the fused AdamW's ``mu``/``nu`` are,
and a checkpoint stores it without a copy. The jitted step unflattens the group's flat param and
gradient into the group's pytree (every leaf in its real shape: Muon's matrices, Adafactor's factored
moments, masks that see the tree), runs ``tx.update``, and flattens the results back. One compilation
per group structure (all blocks share one) and backend.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from megatrain_jax.optim.fused_adamw import to_bf16_bits_
from megatrain_jax.optim.host import Unflatten, check_keys, device_or_cpu, alloc_aligned


@dataclass(frozen=True)
class _Spec:
    """A group's structure: its param leaves (in flat order) and its optax state's leaves, each in
    one of the per-dtype flat buffers at an offset."""

    p_treedef: Any
    p_shapes: tuple
    s_treedef: Any
    s_leaves: tuple  # per state leaf: (dtype name, offset, shape)
    sizes: tuple  # ((dtype name, total elements), ...) in first-use order

    @property
    def key(self):
        return (self.p_treedef, self.p_shapes)


def _split(flat, shapes):
    out, off = [], 0
    for s in shapes:
        n = int(np.prod(s, dtype=np.int64))
        out.append(flat[off:off + n].reshape(s))
        off += n
    return out


class OptaxHostOptimizer:
    """Any ``optax.GradientTransformation``, run per group on flat buffers (see the module docstring).

    optax sees the group's pytree (``unflatten(params)``: views laid out end to end in leaf order, as
    ``templates.Layout`` makes them), so structure-aware masks work; without ``unflatten`` it sees the
    flat array as a single leaf. State: ``{key: page-aligned 1-D array}``, one per dtype of the state's
    leaves, ``key`` = ``<prefix>float32`` etc.; ``state_to_arrays`` hands out these buffers themselves
    (a checkpoint restores into them; the device path writes them back in place). The state carries
    optax's own step counts, so ``count`` is not used: call ``update`` once per applied step.
    """

    runs_on_device = True  # ``device_step`` runs the same jitted update on the accelerator
    key_prefix = ""  # state keys are ``key_prefix + dtype name``

    def __init__(self, tx: optax.GradientTransformation, cpu_device=None):
        self.tx = tx
        self._device = cpu_device  # None: the first CPU device, asked for on first use (``device``)
        self._specs: dict[Any, _Spec] = {}  # per unflatten (or group size without one)
        self._jits: dict[Any, Any] = {}  # per group structure (_Spec.key)
        self._lock = threading.Lock()

    @property
    def device(self):
        """The device the host update runs on. Asked for on first use, not when the optimizer is made: the
        plan builds optimizers to cost them, and asking JAX for a device starts its backends, the GPU's with
        XLA's default budgets instead of the plan's (optim/costs.py)."""
        if self._device is None:
            self._device = device_or_cpu(None)
        return self._device

    # ---- structure

    def _spec(self, n: int, unflatten: Unflatten | None, flat: np.ndarray | None = None) -> _Spec:
        cache_key = (n, unflatten)
        spec = self._specs.get(cache_key)
        if spec is not None:
            return spec
        if unflatten is None:
            p_treedef, p_shapes = jax.tree.structure(0), ((n,),)
        else:
            if flat is not None:
                _check_views(flat, unflatten)
            abstract = jax.eval_shape(unflatten, jax.ShapeDtypeStruct((n,), jnp.float32))
            leaves, p_treedef = jax.tree.flatten(abstract)
            p_shapes = tuple(tuple(x.shape) for x in leaves)
            if sum(int(np.prod(s, dtype=np.int64)) for s in p_shapes) != n:
                raise ValueError(f"unflatten's leaves hold {sum(int(np.prod(s)) for s in p_shapes)} values, the "
                                 f"group has {n}")
        p_abs = jax.tree.unflatten(p_treedef, [jax.ShapeDtypeStruct(s, jnp.float32) for s in p_shapes])
        s_leaves, s_treedef = jax.tree.flatten(jax.eval_shape(self.tx.init, p_abs))
        sizes: dict[str, int] = {}
        placed = []
        for leaf in s_leaves:
            dt = np.dtype(leaf.dtype).name
            placed.append((dt, sizes.get(dt, 0), tuple(leaf.shape)))
            sizes[dt] = sizes.get(dt, 0) + int(np.prod(leaf.shape, dtype=np.int64))
        spec = _Spec(p_treedef, p_shapes, s_treedef, tuple(placed), tuple(sizes.items()))
        with self._lock:
            self._specs[cache_key] = spec
        return spec

    def _state_tree(self, spec: _Spec, st: dict):
        leaves = [st[self.key_prefix + dt][off:off + int(np.prod(shape, dtype=np.int64))].reshape(shape)
                  for dt, off, shape in spec.s_leaves]
        return jax.tree.unflatten(spec.s_treedef, leaves)

    def _flat_state(self, spec: _Spec, tree) -> dict:
        leaves = jax.tree.leaves(tree)
        out = {}
        for dt, _ in spec.sizes:
            parts = [jnp.ravel(x) for x, (d, _, _) in zip(leaves, spec.s_leaves, strict=True) if d == dt]
            out[self.key_prefix + dt] = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
        return out

    def _step_fn(self, spec: _Spec):
        """(host, device) jitted steps of this structure. Both take the flat buffers; the host one
        returns the leaves (copied into the numpy views: a concatenation would cost a pass and a fresh
        buffer on the CPU), the device one the flat buffers (what crosses back and streams)."""
        fn = self._jits.get(spec.key)
        if fn is not None:
            return fn

        def leaves(p_flat, g_flat, st, scale):
            p = jax.tree.unflatten(spec.p_treedef, _split(p_flat, spec.p_shapes))
            g = jax.tree.unflatten(spec.p_treedef, [x.astype(jnp.float32) * scale
                                                    for x in _split(g_flat, spec.p_shapes)])
            updates, new_state = self.tx.update(g, self._state_tree(spec, st), p)
            return jax.tree.leaves(optax.apply_updates(p, updates)), new_state

        def flat(p_flat, g_flat, st, scale):
            new_p, new_state = leaves(p_flat, g_flat, st, scale)
            new_p = [jnp.ravel(x) for x in new_p]
            return (new_p[0] if len(new_p) == 1 else jnp.concatenate(new_p)), self._flat_state(spec, new_state)

        host = jax.jit(lambda *a: (lambda p, s: (p, jax.tree.leaves(s)))(*leaves(*a)))  # inputs alias the host
        device = jax.jit(flat, donate_argnums=(0, 2))  # buffers (zero-copy): nothing donated on the host
        with self._lock:
            self._jits[spec.key] = fn = (host, device)
        return fn

    # ---- the host path

    def init_state(self, params: np.ndarray, unflatten: Unflatten | None = None) -> dict[str, np.ndarray]:
        spec = self._spec(params.shape[0], unflatten, params)
        state = {self.key_prefix + dt: alloc_aligned(n, np.dtype(dt)) for dt, n in spec.sizes}
        if state:  # op by op on the CPU device (optax's inits are fills): no compilation per group. The leaves
            # are the buffer's numpy views put on the CPU device (zero-copy where 64-byte aligned): slicing one
            # device array would copy the whole group first (the embedding's 1.6 GB at the 3B shape)
            leaves = [jax.device_put(x, self.device) for x in _split(params, spec.p_shapes)]
            p = jax.tree.unflatten(spec.p_treedef, leaves)
            with jax.default_device(self.device):
                init = jax.tree.leaves(self.tx.init(p))
            for dst, src in zip(jax.tree.leaves(self._state_tree(spec, state)), init, strict=True):
                np.copyto(dst, np.asarray(src))  # leaf by leaf into the buffers' views: no concatenation
        return state

    def update(self, params, grad, state, count, grad_scale=1.0, bf16_out=None, unflatten=None) -> None:
        if params.dtype != np.float32 or grad.dtype != np.float32 or params.shape != grad.shape:
            raise TypeError(f"params and grad must be float32 of one shape, got {params.dtype} "
                            f"{params.shape} and {grad.dtype} {grad.shape}")
        spec = self._spec(params.shape[0], unflatten, params)
        host, _ = self._step_fn(spec)
        put = lambda a: jax.device_put(a, self.device)  # noqa: E731  zero-copy for aligned buffers
        new_p, new_st = host(put(params), put(grad), {k: put(v) for k, v in state.items()},
                             put(np.float32(grad_scale)))
        for dst, src in zip(_split(params, spec.p_shapes), new_p, strict=True):
            np.copyto(dst, np.asarray(src))  # np.asarray waits for the step
        for dst, src in zip(jax.tree.leaves(self._state_tree(spec, state)), new_st, strict=True):
            np.copyto(dst, np.asarray(src))
        if bf16_out is not None and bf16_out.shape[0]:
            to_bf16_bits_(params, bf16_out)

    # ---- the device path (``train.update_on=device``, engine/updaters.py DeviceUpdates)

    def device_scalars(self, count: int, grad_scale: float = 1.0) -> tuple:
        """The step's scalars for ``device_step``: the clip factor (optax counts its own steps)."""
        return (np.float32(grad_scale),)

    def device_step(self, param, grad, state: dict, scalars: tuple, chunk: int | None = None,
                    unflatten: Unflatten | None = None):
        """This update on the accelerator: (new param, new state) of the same keys, dtypes and shapes.
        ``param`` f32 (n,) and the state arrays are donated; ``grad`` f32 or bf16 (n,). ``chunk`` is not
        used (a transformation may need whole leaves); ``unflatten``: the group's, as for ``update``."""
        spec = self._spec(int(param.shape[0]), unflatten)
        _, device = self._step_fn(spec)
        return device(param, grad, dict(state), np.float32(scalars[0]))

    # ---- checkpoints

    def state_to_arrays(self, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(state)

    def state_from_arrays(self, arrays, params, unflatten=None) -> dict[str, np.ndarray]:
        spec = self._spec(params.shape[0], unflatten, params)
        want = {self.key_prefix + dt: n for dt, n in spec.sizes}
        check_keys(arrays, set(want))
        state = {}
        for dt, n in spec.sizes:
            k = self.key_prefix + dt
            a = np.asarray(arrays[k])
            if a.shape != (n,) or a.dtype != np.dtype(dt):
                raise ValueError(f"optimizer state {k!r}: expected {dt} ({n},), got {a.dtype} {a.shape}")
            state[k] = alloc_aligned(n, np.dtype(dt))
            state[k][:] = a
        return state

    def state_tree(self, state: dict, params: np.ndarray, unflatten: Unflatten | None = None):
        """The optax state pytree of a group (numpy views of the flat buffers): for inspection."""
        return self._state_tree(self._spec(params.shape[0], unflatten, params), state)

    def as_optax(self) -> optax.GradientTransformation:
        return self.tx


def _check_views(flat: np.ndarray, unflatten: Unflatten) -> None:
    """The flat step relies on ``unflatten`` laying the leaves end to end in leaf order (``Layout``)."""
    base = flat.__array_interface__["data"][0]
    off = 0
    for leaf in jax.tree.leaves(unflatten(flat)):
        if not isinstance(leaf, np.ndarray) or (leaf.size and not np.may_share_memory(leaf, flat)):
            raise ValueError("unflatten must return views into the flat array it is given")
        if leaf.size and (leaf.__array_interface__["data"][0] - base != off * flat.itemsize
                          or not leaf.flags.c_contiguous):
            raise ValueError("unflatten must return views laid end to end in leaf order (as templates.Layout)")
        off += leaf.size
