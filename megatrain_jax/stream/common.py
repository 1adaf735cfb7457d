"""What the NNX and Linen paths share: the ``Streamed`` result, a block call's static/dynamic
split, the output-bias fold, argument normalisation."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.errors import UserError
from megatrain_jax.templates import Layout, StreamedModel


@dataclass
class Streamed(StreamedModel):
    """A ``StreamedModel`` that also knows the user's parameter tree.

    - ``assemble(trees)``: host trees by group (``embed``, ``block_i``, ``head``) -> the model's own
      params pytree (NNX: ``nnx.to_pure_dict(nnx.state(model, nnx.Param))``; Linen: ``params``).
    - ``embed_takes_positions`` (``StreamedModel``'s field): the embedding part reads the batch's
      positions; the engine's embedding input is then the pair ``(tokens, positions)``.
    """

    assemble: Callable[[dict], Any] | None = None
    summary: str = ""


def is_array(x) -> bool:
    """A per-sequence input (jax or numpy array). Shared by the Linen path and ``split_call``."""
    return isinstance(x, (jax.Array, np.ndarray))


def tokens_and_positions(tokens):
    """``tokens`` or ``(tokens, positions)`` -> both (positions 0..S-1 when not given). Shared by the
    Linen and NNX paths."""
    if isinstance(tokens, (tuple, list)):
        return tokens[0], tokens[1]
    b, s = tokens.shape
    return tokens, jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))


def wants_positions(fn: Callable) -> bool:
    """Whether a part function takes positions (a third positional argument). Shared by the Linen and
    NNX paths."""
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    except (TypeError, ValueError):
        return True
    return len(params) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in params)


def placeholders(tree):
    """Shape-only stand-ins for a tree's arrays. Shared by the NNX path and the probe."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype if not hasattr(a, "dtype")
                                                       else a.dtype), tree)


def zeros_like_tree(tree):
    """Zeros shaped as a tree's arrays. Used by the NNX path."""
    return jax.tree.map(lambda a: jnp.zeros(np.shape(a), a.dtype), tree)


def split_call(args, kwargs):
    """A recorded block call -> (static structure, dynamic leaves): arrays are per-sequence inputs
    (``aux``), everything else (bools, ints, None, strings) is fixed at ``stream()`` time.
    Shared by the Linen and NNX paths and the probe."""
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    dyn = [i for i, leaf in enumerate(leaves) if is_array(leaf)]
    static = [None if i in dyn else leaf for i, leaf in enumerate(leaves)]
    return (treedef, static, dyn), [leaves[i] for i in dyn]


def rebuild_call(spec, dyn_leaves):
    """``split_call`` undone: (args, kwargs) from the static spec and the dynamic leaves. Shared by the
    Linen and NNX paths."""
    treedef, static, dyn = spec
    leaves = list(static)
    for i, v in zip(dyn, dyn_leaves):
        leaves[i] = v
    return jax.tree_util.tree_unflatten(treedef, leaves)


def augment(normed, out, bias):
    """Fold an output bias into the matrix: [normed, 1] @ [[W], [b]] == normed @ W + b, exactly.
    Shared by the Linen and NNX paths."""
    if bias is None:
        return normed, out
    ones = jnp.ones(normed.shape[:-1] + (1,), normed.dtype)
    return jnp.concatenate([normed, ones], -1), jnp.concatenate([out, bias.astype(out.dtype)[None, :]], 0)


def as_names(x, field: str) -> list[str] | None:
    """``None``, a name or a list of names -> a list of names (or None). Used by the NNX path."""
    if x is None:
        return None
    if isinstance(x, str):
        return [x]
    if isinstance(x, (list, tuple)) and all(isinstance(n, str) for n in x):
        return list(x)
    raise UserError(field, f"{x!r} is not an attribute name or a list of them", f"pass {field}='name' or a list")


def structure(tree) -> tuple:
    """A weight tree's signature (tree structure, leaf paths and shapes). Shared by the Linen and NNX paths."""
    return Layout(tree).signature()
