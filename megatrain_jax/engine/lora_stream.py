"""A user's own model with adapters as the LoRA engine sees it: ``StreamLoraModel`` over ``stream()``'s parts.

The targeted ``nnx.Linear`` modules of every block (matched by attribute name: ``q`` .. ``down`` mean
``q_proj`` .. ``down_proj``, anything else is a ``Linear``'s own name, peft's ``target_modules`` rule)
become ``LoraLinear`` in a clone of the model (``lora_trainer.LoraRun``), which ``stream()``
then splits as usual: its block template reads the adapters as two more leaves. Here those leaves are
separated from the frozen rest: the base goes to a ``FrozenStore`` (``lora.base_dtype``), the adapters
to ``LoraEngine``, whose backward differentiates only with respect to the adapters and the hidden state.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from megatrain_jax.errors import UserError
from megatrain_jax.models.lora import merge_adapters, split_adapters
from megatrain_jax.templates import Layout


class StreamLoraModel:
    """``engine.lora.LoraModel``'s interface over ``stream()``'s parts of a model with adapters attached."""

    frozen: tuple[str, ...] = ()  # no leaf singled out: the whole base is frozen, only adapters train

    def __init__(self, parts: Any):
        stack = parts.blocks
        if stack.aux_loss is not None:
            raise UserError("lora", "blocks that add an auxiliary loss (a router's) train every weight",
                            "stream a model without aux_loss for LoRA")
        self.parts = parts
        self.embed_fn, self.head_fn, self.aux_fn = parts.embed_fn, parts.head_fn, parts.aux_fn
        self.tied, self.softcap = parts.tied, parts.logit_softcap
        self.embed_takes_positions = bool(parts.embed_takes_positions)
        order = list(dict.fromkeys(stack.kinds))
        self.kinds = [order.index(k) for k in stack.kinds]
        self.templates = [stack.templates[k] for k in order]
        self.takes_rng = stack.takes_rng
        split = [split_adapters(w) for w in stack.weights]
        self.initial = [jax.tree_util.tree_map(lambda a: np.asarray(a, np.float32), a) for a, _ in split]
        self.adapter_shapes = [jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.float32), a)
                               for a in self.initial]
        self.trees = {"embed": parts.embed_weights, **{f"block_{i}": r for i, (_, r) in enumerate(split)},
                      "head": parts.head_weights}
        self.layouts = {n: Layout(t) for n, t in self.trees.items()}

    @property
    def num_kinds(self) -> int:
        return len(self.templates)

    def without_dropout(self) -> None:
        """An evaluation runs the blocks as they are (``LoraModel.without_dropout``)."""
        return None

    def apply(self, kind: int):
        t = self.templates[kind]
        if self.takes_rng:
            return lambda base, adapters, h, aux, key: t(merge_adapters(adapters, base), h, aux, key)
        return lambda base, adapters, h, aux, key: t(merge_adapters(adapters, base), h, aux)

    def init_adapters(self, seed: int = 0) -> list[Any]:
        """The adapters as attached (A peft-uniform from ``adapter_key(seed, layer)``, B zeros)."""
        return self.initial
