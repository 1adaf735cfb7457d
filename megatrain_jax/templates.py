"""Stateless layer templates: a stack of identical blocks as ``(template, per-layer weights)``.

A template is a pure function ``(weights, hidden, aux) -> hidden``. Because the weights are an
argument rather than captured state, one compiled executable serves every layer of the stack: the
engine only swaps which weights it passes. Three doors lead here, and the built-in models use the
first one exactly as a user's model would:

- ``from_nnx(blocks)``: NNX modules; ``nnx.split`` gives the graphdef (the template) and the state.
- ``from_linen(module, params_per_layer)``: a Linen module's ``apply``.
- ``from_fn(fn, weights_per_layer)``: any pure function.

``Layout`` maps a weights pytree to one flat buffer and back. The host store keeps each layer as one
flat buffer so that a layer crosses PCIe as a single transfer; inside the jitted step the flat
buffer is sliced back into the pytree (free in XLA).

**Auxiliary losses from block statistics** (``AuxLoss``; e.g. a mixture of experts' router
load-balancing loss): blocks of some kinds return ``(hidden, stats)`` instead of ``hidden``, where
``stats`` is a pytree of fp32 *sums over the block's tokens* (shapes independent of the batch). The
engine adds them up over every such layer, micro-batch and device during the forward sweep; the
step's loss gains ``fn(total)``; in the backward each of those blocks' VJPs receives the cotangent
``grad(fn)(total)`` for its ``stats`` output. Because ``total`` is a sum, that is the exact gradient
of ``fn(total)`` for *any* differentiable ``fn``, although ``fn`` couples every layer and token of
the step (it need not be a sum of per-layer terms). Blocks without statistics are untouched: a
stack without ``aux_loss`` compiles and runs exactly as before.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import nnx

Template = Callable[[Any, jax.Array, dict], jax.Array]


@dataclass(frozen=True)
class Leaf:
    path: str
    shape: tuple[int, ...]
    offset: int
    size: int


class Layout:
    """Where each leaf of a weights pytree lives inside one flat 1-D buffer."""

    def __init__(self, tree: Any):
        leaves_with_path, self.treedef = jax.tree_util.tree_flatten_with_path(tree)
        self.leaves: list[Leaf] = []
        offset = 0
        for path, leaf in leaves_with_path:
            shape = tuple(int(d) for d in (leaf.shape if hasattr(leaf, "shape") else np.shape(leaf)))
            size = int(np.prod(shape, dtype=np.int64))
            self.leaves.append(Leaf(jax.tree_util.keystr(path, simple=True, separator="/"), shape, offset, size))
            offset += size
        self.size = offset

    def flatten_into(self, tree: Any, out: np.ndarray) -> None:
        """Copy a pytree's leaves into ``out`` (host numpy), leaf by leaf (no full temporary)."""
        leaves = jax.tree_util.tree_leaves(tree)
        if len(leaves) != len(self.leaves):
            raise ValueError(f"tree has {len(leaves)} leaves, layout expects {len(self.leaves)}")
        for spec, leaf in zip(self.leaves, leaves):
            arr = np.asarray(leaf)
            if arr.shape != spec.shape:
                raise ValueError(f"{spec.path}: shape {arr.shape}, layout expects {spec.shape}")
            out[spec.offset:spec.offset + spec.size] = arr.reshape(-1)

    def unflatten(self, flat: Any) -> Any:
        """Flat buffer (numpy view or traced jax array) -> pytree of views/slices."""
        leaves = [flat[s.offset:s.offset + s.size].reshape(s.shape) for s in self.leaves]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def signature(self) -> tuple:
        return (self.treedef, tuple((s.path, s.shape) for s in self.leaves))


@dataclass(frozen=True)
class AuxLoss:
    """An extra loss term computed from statistics that the blocks of some kinds emit.

    - ``kinds``: the layer kinds whose templates return ``(hidden, stats)``; the others return
      ``hidden`` as usual. Every emitting kind returns the same ``stats`` structure.
    - ``fn(total) -> scalar``: the term added to the step's loss, of ``total``: the stats summed
      over every emitting layer, every micro-batch and every device of the step. Leaves of ``stats``
      that carry no gradient (counts) are fine: their cotangents are simply unused.
    """

    kinds: frozenset
    fn: Callable[[Any], jax.Array]


@dataclass
class LayerStack:
    """What the engine streams: the blocks' templates and each layer's weights (host pytrees).

    Usually every layer is alike: one ``template``. Layers of several *kinds* (local and global
    attention layers, dense and mixture-of-experts blocks) give ``kinds[i]``, a hashable tag per
    layer, and ``templates[kind]``: the engine compiles one executable per kind, never per layer.
    Layers of one kind must have the same weight structure; kinds may differ.

    ``takes_rng``: templates are called as ``template(weights, hidden, aux, rng)`` with a key per
    (step, layer, micro-batch) from ``block_rng`` (dropout); the backward's recompute gets the same key.

    ``aux_loss``: the kinds whose templates also return statistics, and the loss term made of them
    (``AuxLoss``); None: every template returns the hidden state alone.
    """

    template: Template | None
    weights: list[Any]
    kinds: list[Any] | None = None
    templates: dict[Any, Template] | None = None
    takes_rng: bool = False
    aux_loss: AuxLoss | None = None

    def __post_init__(self):
        if not self.weights:
            raise ValueError("a layer stack needs at least one layer")
        if self.kinds is None:
            if self.template is None:
                raise ValueError("a layer stack needs a template (or kinds and templates)")
            self.kinds = [0] * len(self.weights)
            self.templates = {0: self.template}
        if len(self.kinds) != len(self.weights):
            raise ValueError(f"{len(self.kinds)} kinds for {len(self.weights)} layers")
        missing = sorted({repr(k) for k in self.kinds if k not in (self.templates or {})})
        if missing:
            raise ValueError(f"no template for layer kind(s) {', '.join(missing)}")
        first: dict[Any, tuple[int, tuple]] = {}
        for i, (k, w) in enumerate(zip(self.kinds, self.weights)):
            sig = Layout(w).signature()
            j, ref = first.setdefault(k, (i, sig))
            if sig != ref:
                raise ValueError(f"layer {i} has a different weight structure from layer {j} of the same kind; "
                                 "layers of one kind must be identical blocks")
        if self.aux_loss is not None:
            unknown = sorted(repr(k) for k in self.aux_loss.kinds if k not in self.templates)
            if unknown or not self.aux_loss.kinds:
                raise ValueError(f"aux_loss names no kind of this stack ({', '.join(unknown) or 'none given'})")

    def emits_stats(self, i: int) -> bool:
        """Layer ``i``'s template returns ``(hidden, stats)``."""
        return self.aux_loss is not None and self.kinds[i] in self.aux_loss.kinds

    def template_of(self, i: int) -> Template:
        return self.templates[self.kinds[i]]


_SHAREABLE: weakref.WeakSet = weakref.WeakSet()


def shareable(fn: Callable) -> Callable:
    """Marks a part function (a template, ``embed_fn``, ``head_fn``, ``aux_fn``, an ``AuxLoss.fn``) as closing over
    values alone, no weights or other state of one model: the engine may keep its compiled kernels after the
    trainer is gone and give them to the next trainer handed this same function (engine/kernels.py:
    ``program_key``). Functions not marked get kernels of their own, dropped with their trainer."""
    _SHAREABLE.add(fn)
    return fn


def is_shareable(fn: Any) -> bool:
    try:
        return fn in _SHAREABLE
    except TypeError:  # (not weakly referable: never marked)
        return False


def block_rng(seed: int | jax.Array, step: int, layer: int, micro: int) -> jax.Array:
    """The key a block sees at optimizer step ``step`` (0-based: updates done before it), layer
    ``layer`` and micro-batch ``micro``: ``fold_in`` of each into ``key(seed)``. A plain model
    trained with the same keys sees the same dropout masks."""
    is_key = isinstance(seed, jax.Array) and jax.dtypes.issubdtype(seed.dtype, jax.dtypes.prng_key)
    key = seed if is_key else jax.random.key(seed)
    for x in (step, layer, micro):
        key = jax.random.fold_in(key, x)
    return key


def from_nnx(blocks: Sequence[nnx.Module], takes_rng: bool = False,
             aux_loss: Callable[[Any], jax.Array] | None = None) -> LayerStack:
    """NNX blocks -> (graphdef as template, per-layer pure-dict states).

    Blocks whose graphs differ (a static attribute such as a local/global attention window, or
    another module structure) become separate kinds: one template, and one compiled executable,
    per distinct graph. ``takes_rng``: the blocks are called as ``block(hidden, aux, rng)``.

    ``aux_loss`` (``AuxLoss.fn``): blocks with a true ``emits_stats`` attribute return
    ``(hidden, stats)``; their kinds carry the auxiliary loss (ignored when no block emits).
    """
    graphs: list[Any] = []
    kinds, weights = [], []
    for block in blocks:
        g, state = nnx.split(block)
        for k, known in enumerate(graphs):
            if g == known:
                break
        else:
            k = len(graphs)
            graphs.append(g)
        kinds.append(k)
        weights.append(nnx.to_pure_dict(state))

    def make(graphdef):
        try:
            return _nnx_template(graphdef, bool(takes_rng))
        except TypeError:  # an unhashable static attribute: a template of its own, never shared
            return _template_of(graphdef, takes_rng)

    templates = {k: make(g) for k, g in enumerate(graphs)}
    aux = None
    if aux_loss is not None:
        emitting = frozenset(k for k, b in zip(kinds, blocks) if getattr(b, "emits_stats", False))
        aux = AuxLoss(emitting, aux_loss) if emitting else None
    return LayerStack(templates[0], weights, kinds, templates, takes_rng, aux)


@functools.lru_cache(maxsize=64)
def _nnx_template(graphdef: Any, takes_rng: bool) -> Template:
    """The template of an NNX graph: one function for equal graphs (module types and static attributes, as
    ``nnx.jit`` keys them), in this stack and the next, so that trainers of equal models share their compiled
    kernels (engine/kernels.py: ``program_key`` compares templates by identity)."""
    return shareable(_template_of(graphdef, takes_rng))


def _template_of(graphdef: Any, takes_rng: bool) -> Template:
    if takes_rng:
        return lambda w, hidden, aux, rng: nnx.merge(graphdef, w)(hidden, aux, rng)
    return lambda w, hidden, aux: nnx.merge(graphdef, w)(hidden, aux)


def from_linen(module: Any, params_per_layer: Sequence[Any], takes_aux: bool = True) -> LayerStack:
    """A Linen module and per-layer ``params`` -> template over ``module.apply``."""

    def template(w, hidden, aux):
        if takes_aux:
            return module.apply({"params": w}, hidden, aux)
        return module.apply({"params": w}, hidden)

    return LayerStack(template, list(params_per_layer))


def from_fn(fn: Template, weights_per_layer: Sequence[Any]) -> LayerStack:
    """A plain pure function ``fn(weights, hidden, aux) -> hidden``."""
    return LayerStack(fn, list(weights_per_layer))


@dataclass
class StreamedModel:
    """A decoder as the engine sees it: embedding, a stack of identical blocks, and a head.

    - ``embed_fn(weights, tokens) -> hidden`` (``embed_fn(weights, (tokens, positions))`` with
      ``embed_takes_positions``: the batch's positions, for learned position embeddings)
    - ``blocks``: the ``LayerStack`` (template + per-layer weights)
    - ``head_fn(weights, hidden, embed_weights) -> (normed_hidden, out_matrix (H, V))``: the loss
      is computed by the engine in chunks from these two, so logits never exist all at once.
      ``embed_weights`` is the embedding group's pytree when ``tied``, else ``None``.
    - ``aux_fn(positions, segment_ids) -> aux``: per-sequence inputs shared by every block.
    - ``logit_softcap``: final-logit soft-capping, applied chunk by chunk inside the loss.
    """

    embed_fn: Callable
    blocks: LayerStack
    head_fn: Callable
    aux_fn: Callable
    embed_weights: Any
    head_weights: Any
    tied: bool
    logit_softcap: float | None = None  # logits = cap * tanh(logits / cap), inside the chunked loss (Gemma 2)
    embed_takes_positions: bool = False  # embed_fn(weights, (tokens, positions)): learned position embeddings
    pad_id: int | None = None  # a token id embed_fn gives no gradient (padding_idx): stream_io's remapped ids keep it
    frozen: tuple[str, ...] = ()  # leaf paths (inside a group) no optimizer moves: Family.frozen_leaves

    def host_trees(self) -> dict[str, Any]:
        """The group name -> host pytree mapping that the host store is built from."""
        trees = {"embed": self.embed_weights}
        trees.update({f"block_{i}": w for i, w in enumerate(self.blocks.weights)})
        trees["head"] = self.head_weights
        return trees
