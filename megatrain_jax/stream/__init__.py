"""Bring your own Flax model: ``stream(model)`` -> the engine's ``StreamedModel``.

The engine streams three parts: an *embedding* (tokens -> hidden), a *stack of blocks* (hidden ->
hidden, one compiled template for all of them) and a *head* (hidden -> ``(normed, out_matrix)``,
from which the loss is computed in chunks). ``stream`` finds the three parts in an NNX model (or a
Linen module with its params) and builds the engine's callables from the model's own code:

- **blocks**: the list attribute of identical modules (``blocks="h"``; found automatically when
  the model has exactly one list of modules). Each block is called the way the model's own
  ``__call__`` calls it: ``stream`` runs the model once with its blocks replaced by recorders and
  keeps what every block was given besides the hidden state (a causal mask, a position range):
  that is the per-sequence ``aux``. Arguments that are not arrays (``deterministic=False``) are
  static: fixed at ``stream()`` time.
- **embed**: the attributes before the blocks (default: those that are or contain an
  ``nnx.Embed``); computed by running the model's ``__call__(tokens)`` up to its first block, so
  positional embeddings, embedding scaling and embedding dropout come along unchanged.
- **head**: the other attributes (a final norm and an output projection): the projection is an
  ``nnx.Linear`` to the vocabulary (its bias is folded into the matrix), a 2-D ``nnx.Param``, or
  none at all, in which case the head is tied to the embedding's ``nnx.Embed`` table.

Adapters replace any of these where the model's own code does not expose them (see docs/porting.md):
``embed_fn(m, tokens, positions) -> hidden``, ``head_fn(m, hidden) -> (normed, out_matrix[, bias])``,
``aux_fn(positions, segment_ids) -> aux`` with ``block_fn(block, hidden, aux) -> hidden``. ``m`` is
your model itself (NNX: the real object, with the part's streamed weights in it; Linen: the module
bound to its params), so adapters may call its submodules and methods.

Dropout: the engine gives every block a key per (step, layer, micro-batch) (``templates.block_rng``),
the same key in the backward's recompute. NNX: a block with RNG streams (``nnx.Dropout(rate,
rngs=rngs)``) is reseeded with it before each call, exactly as ``nnx.reseed(block, dropout=key)``
(every stream tag of the block) would. Linen: a block that draws random numbers (``nn.Dropout`` with
``deterministic=False``) is applied as ``block.apply({"params": w}, x, ..., rngs={"dropout": key})``
(every stream it asks for gets the key). Blocks without randomness get no key. Dropout outside the
blocks is refused (the engine has no key there).

Before returning, ``stream`` checks its split against the model: the parts, composed, must give the
logits of ``model(tokens)`` on a small input (NNX: dropout off; Linen blocks with dropout: the
model's own forward with each block given the parts' key); a head that does more than norm +
projection (a logit scale, a soft-cap) is refused there, naming the parts.

The package: ``from_nnx`` and ``from_linen`` (one per model API), ``probe`` (the recorded forward and
the checks against the model), ``common`` (what both share). The package itself is callable:
``megatrain_jax.stream(model)``, ``from megatrain_jax import stream; stream(model)`` and
``megatrain_jax.stream.stream(model)`` are the same call.
"""
from __future__ import annotations

import sys
import types
from typing import Any, Callable, Sequence

from flax import nnx

from megatrain_jax.errors import UserError
from megatrain_jax.templates import StreamedModel  # noqa: F401 - re-exported
from megatrain_jax.stream.common import Streamed  # noqa: F401 - re-exported
from megatrain_jax.stream.probe import compose_logits  # noqa: F401 - re-exported
from megatrain_jax.stream.from_nnx import stream_nnx
from megatrain_jax.stream.from_linen import stream_linen  # noqa: F401 - re-exported


def stream(model, *, params: Any = None, blocks: str | None = None, embed: str | Sequence[str] | None = None,
           head: str | Sequence[str] | None = None, embed_fn: Callable | None = None,
           head_fn: Callable | None = None, aux_fn: Callable | None = None, block_fn: Callable | None = None,
           tied: bool | None = None, vocab_size: int | None = None, logit_softcap: float | None = None,
           check: bool = True, call_kwargs: dict | None = None) -> Streamed:
    """An NNX model (or a Linen module with ``params``) -> the engine's ``StreamedModel``.

    ``blocks``: the attribute holding the list of blocks (NNX; Linen: the submodule name prefix,
    e.g. ``"encoderdecoderblock"``). ``embed`` / ``head``: attribute names of the two other parts
    (NNX; Linen finds them by call order). Adapters (``m`` is your model with the part's weights):
    ``embed_fn(m, tokens, positions)``, ``head_fn(m, hidden) -> (normed, out_matrix[, bias])``,
    ``aux_fn(positions, segment_ids)`` with ``block_fn(block, hidden, aux)``. ``tied``: whether the
    head reads the embedding's weights (found out when not given). ``check``: compare the composed
    parts with ``model(tokens)``. ``call_kwargs``: extra keyword arguments of ``model(tokens, ...)``.
    """
    if isinstance(model, nnx.Module):
        if params is not None:
            raise UserError("params", "an NNX model carries its own weights", "call stream(model) without params=")
        return stream_nnx(model, blocks=blocks, embed=embed, head=head, embed_fn=embed_fn, head_fn=head_fn,
                           aux_fn=aux_fn, block_fn=block_fn, tied=tied, vocab_size=vocab_size,
                           logit_softcap=logit_softcap, check=check, call_kwargs=call_kwargs)
    import flax.linen as linen

    if isinstance(model, linen.Module):
        if params is None:
            raise UserError("params", f"a Linen module ({type(model).__name__}) needs its parameters",
                            "call stream(module, params=variables['params'])")
        return stream_linen(model, params, blocks=blocks, embed_fn=embed_fn, head_fn=head_fn, aux_fn=aux_fn,
                            block_fn=block_fn, tied=tied, logit_softcap=logit_softcap, check=check,
                            call_kwargs=call_kwargs)
    raise UserError("model", f"a {type(model).__name__} is neither an nnx.Module nor a linen.Module",
                    "pass a Flax model (or build a StreamedModel with templates.from_fn)")


class _CallableModule(types.ModuleType):
    """The package as a function: the README's ``megatrain_jax.stream(model)`` calls ``stream``."""

    def __call__(self, model, **kwargs: Any) -> Streamed:
        return stream(model, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
