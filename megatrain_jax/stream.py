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
"""
from __future__ import annotations

import dataclasses
import inspect
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from megatrain_jax.errors import UserError
from megatrain_jax.templates import LayerStack, Layout, StreamedModel


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


class _Reached(Exception):
    """Raised by a block recorder: the model's forward reached its blocks (or finished them)."""

    def __init__(self, x, calls):
        super().__init__("reached the blocks")
        self.x, self.calls = x, calls


class _Recorder:
    """Stands in for block ``i`` while the model's own ``__call__`` runs: records the call, passes
    the hidden state through, and stops the forward after the last block (or at the first one)."""

    def __init__(self, i: int, n: int, calls: list, stop_at_first: bool, replace: Any = None):
        self.i, self.n, self.calls, self.stop_at_first, self.replace = i, n, calls, stop_at_first, replace

    def __call__(self, x, *args, **kwargs):
        self.calls.append((self.i, x, args, kwargs))
        if self.stop_at_first or self.i == self.n - 1:
            raise _Reached(x if self.replace is None else self.replace, self.calls)
        return x


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def _tokens_and_positions(tokens):
    if isinstance(tokens, (tuple, list)):
        return tokens[0], tokens[1]
    b, s = tokens.shape
    return tokens, jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))


def _wants_positions(fn: Callable) -> bool:
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    except (TypeError, ValueError):
        return True
    return len(params) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in params)


def _placeholders(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype if not hasattr(a, "dtype")
                                                       else a.dtype), tree)


def _zeros(tree):
    return jax.tree.map(lambda a: jnp.zeros(np.shape(a), a.dtype), tree)


def _split_call(args, kwargs):
    """A recorded block call -> (static structure, dynamic leaves): arrays are per-sequence inputs
    (``aux``), everything else (bools, ints, None, strings) is fixed at ``stream()`` time."""
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    dyn = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
    static = [None if i in dyn else leaf for i, leaf in enumerate(leaves)]
    return (treedef, static, dyn), [leaves[i] for i in dyn]


def _rebuild_call(spec, dyn_leaves):
    treedef, static, dyn = spec
    leaves = list(static)
    for i, v in zip(dyn, dyn_leaves):
        leaves[i] = v
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _augment(normed, out, bias):
    """Fold an output bias into the matrix: [normed, 1] @ [[W], [b]] == normed @ W + b, exactly."""
    if bias is None:
        return normed, out
    ones = jnp.ones(normed.shape[:-1] + (1,), normed.dtype)
    return jnp.concatenate([normed, ones], -1), jnp.concatenate([out, bias.astype(out.dtype)[None, :]], 0)


def _as_names(x, field: str) -> list[str] | None:
    if x is None:
        return None
    if isinstance(x, str):
        return [x]
    if isinstance(x, (list, tuple)) and all(isinstance(n, str) for n in x):
        return list(x)
    raise UserError(field, f"{x!r} is not an attribute name or a list of them", f"pass {field}='name' or a list")


# ============================================================================================ NNX


def _list_attrs(model) -> dict[str, Any]:
    return {k: v for k, v in vars(model).items()
            if isinstance(v, (list, tuple, nnx.List)) and len(v) and all(isinstance(m, nnx.Module) for m in v)}


def _contains(module, cls) -> bool:
    if isinstance(module, cls):
        return True
    if isinstance(module, nnx.Module):
        return any(isinstance(n, cls) for _, n in nnx.iter_graph(module))
    return False


def _block_states(block, where: str):
    """(graphdef, params pure dict, rng key/count pure dicts, stream tags); refuses other state."""
    g, params, keys, counts, rest = nnx.split(block, nnx.Param, nnx.RngKey, nnx.RngCount, ...)
    flat = rest.flat_state()
    if len(flat):
        path, var = next(iter(flat))
        kind = type(var).__name__
        what = ("a plain array attribute (not an nnx.Param): it would be a constant the optimizer never sees"
                if not isinstance(var, nnx.Variable) or type(var) is nnx.Variable
                else f"{kind} state, which changes in the forward (batch statistics, caches) and cannot be "
                     "carried between streamed steps")
        raise UserError(f"{where}.{'.'.join(map(str, path))}", f"holds {what}",
                        "keep weights in nnx.Param; use a norm without batch statistics (LayerNorm/RMSNorm), "
                        "or compute constants inside __call__")
    tags = sorted({s.key.tag for _, s in nnx.iter_graph(block) if isinstance(s, nnx.RngStream)})
    return g, nnx.to_pure_dict(params), nnx.to_pure_dict(keys), nnx.to_pure_dict(counts), tags


def _uses_rng(block) -> bool:
    """Whether the block draws random numbers: an active nnx.Dropout, or another module holding RNG
    streams (an inactive dropout, rate 0 or deterministic, needs no key)."""
    for _, m in nnx.iter_graph(block):
        if isinstance(m, nnx.Dropout):
            if m.rate > 0 and not m.deterministic:
                return True
        elif isinstance(m, nnx.Module) and any(isinstance(v, (nnx.Rngs, nnx.RngStream)) for v in vars(m).values()):
            return True
    return False


def _structure(tree) -> tuple:
    return Layout(tree).signature()


def _stream_nnx(model, *, blocks, embed, head, embed_fn, head_fn, aux_fn, block_fn, tied, vocab_size,
                logit_softcap, check, call_kwargs) -> Streamed:
    call_kwargs = dict(call_kwargs or {})
    lists = _list_attrs(model)
    if blocks is None:
        if len(lists) != 1:
            found = ", ".join(lists) or "none"
            raise UserError("blocks", f"cannot tell which attribute holds the blocks (lists of modules: {found})",
                            "name it: stream(model, blocks='layers')")
        blocks = next(iter(lists))
    if not isinstance(blocks, str):
        raise UserError("blocks", f"{blocks!r} is not an attribute name", "pass blocks='layers' (the list's name)")
    if blocks not in lists:
        v = getattr(model, blocks, None)
        why = "does not exist" if v is None else f"is a {type(v).__name__}, not a list of modules"
        if isinstance(v, nnx.Module) and _structure(nnx.to_pure_dict(nnx.state(v, nnx.Param))):
            why += " (layers stacked into one module, e.g. by nnx.vmap/nnx.scan, cannot be streamed one by one)"
        raise UserError(f"blocks={blocks!r}", why, "name a list / nnx.List attribute of block modules")
    block_mods = list(getattr(model, blocks))
    n = len(block_mods)

    # ---- the blocks: one template per distinct graph, identical weight structure
    states = [_block_states(b, f"{blocks}[{i}]") for i, b in enumerate(block_mods)]
    ref = _structure(states[0][1])
    for i, st in enumerate(states[1:], 1):
        sig = _structure(st[1])
        if sig != ref:
            diff = next(((a, b) for a, b in zip(ref[1] + ((None, None),) * 99, sig[1] + ((None, None),) * 99)
                         if a != b), (None, None))
            raise UserError(f"{blocks}[{i}]", f"has a different weight structure from {blocks}[0] "
                            f"({diff[1]} vs {diff[0]}): the blocks of a stack must be identical",
                            "stream a model whose blocks have the same parameters (a different layer kind belongs "
                            "outside the list)")
    graphs, kinds = [], []
    for st in states:
        for k, g in enumerate(graphs):
            if g == st[0]:
                break
        else:
            k = len(graphs)
            graphs.append(st[0])
        kinds.append(k)
    tags = states[0][4]
    takes_rng = bool(tags) and _uses_rng(block_mods[0])

    # ---- the other parts, by top-level attribute
    full = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    others = [k for k in full if k != blocks]
    embed_names = _as_names(embed, "embed")
    if embed_names is None:
        embed_names = [k for k in others if _contains(getattr(model, k, None), nnx.Embed)]
        if not embed_names:
            raise UserError("embed", f"no attribute of {type(model).__name__} is (or contains) an nnx.Embed",
                            f"name the embedding part: stream(model, embed='...') (attributes: {', '.join(others)})")
    head_names = _as_names(head, "head")
    if head_names is None:
        head_names = [k for k in others if k not in embed_names]
    for name in embed_names + head_names:
        if name not in full:
            v = getattr(model, name, None)
            raise UserError(f"embed/head={name!r}", "does not exist" if v is None else "holds no nnx.Param",
                            f"name attributes that hold weights: {', '.join(others)}")
    left = [k for k in others if k not in embed_names and k not in head_names]
    if left:
        raise UserError(left[0], "holds parameters but belongs to neither the embedding nor the head",
                        "add it to embed=[...] or head=[...]")
    both = set(embed_names) & set(head_names)
    if both:
        raise UserError(sorted(both)[0], "is named in both embed and head",
                        "a tied head reads the embedding's weights itself: list the attribute in embed only")

    graphdef, _, keys_all, counts_all, rest_all = nnx.split(model, nnx.Param, nnx.RngKey, nnx.RngCount, ...)
    rest_flat = [(p, v) for p, v in rest_all.flat_state() if p[0] != blocks]
    if rest_flat:
        path, var = rest_flat[0]
        raise UserError(".".join(map(str, path)), f"holds {type(var).__name__} state outside the blocks, which "
                        "cannot be carried between streamed steps", "keep weights in nnx.Param")
    rest_all = nnx.to_pure_dict(rest_all)
    # RNG streams outside the blocks are shape-only: the engine gives keys to blocks only, so an
    # embedding or head that draws random numbers fails loudly instead of reusing one mask each step
    keys_pd, counts_pd = _placeholders(nnx.to_pure_dict(keys_all)), nnx.to_pure_dict(counts_all)
    embed_w = {k: full[k] for k in embed_names}
    head_w = {k: full[k] for k in head_names}
    block_ph = _placeholders(full.get(blocks, {}))

    def shell(ew=None, hw=None):
        """The user's model object with the given parts' weights in it; the rest are shape-only
        placeholders (touching one is an error) and the blocks are left for recorders."""
        params = {k: (ew[k] if ew is not None and k in ew else hw[k] if hw is not None and k in hw
                      else _placeholders(full[k])) for k in full if k != blocks}
        if blocks in full:
            params[blocks] = block_ph
        return nnx.merge(graphdef, params, keys_pd, counts_pd, rest_all)

    def run_to_blocks(m, tokens, stop_at_first):
        calls: list = []
        object.__setattr__(m, blocks, [_Recorder(i, n, calls, stop_at_first) for i in range(n)])
        try:
            m(tokens, **call_kwargs)
        except _Reached as r:
            return r.x, r.calls
        raise UserError(f"blocks={blocks!r}", f"{type(model).__name__}.__call__(tokens) returned without calling "
                        f"its blocks in order (calls seen: {[c[0] for c in calls]})",
                        "give embed_fn= (and aux_fn=/block_fn=) to say how the parts are called")

    # ---- how the model calls its blocks (recorded from its own __call__)
    probe = jnp.zeros((1, 4), jnp.int32)

    def probe_calls(ew):
        return run_to_blocks(shell(ew), probe, stop_at_first=False)[1]

    calls_rec = None
    if aux_fn is None or embed_fn is None:
        try:
            holder = {}

            def rec(ew):
                holder["calls"] = probe_calls(ew)
                return 0
            jax.eval_shape(rec, embed_w)
            calls_rec = holder["calls"]
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - the model's own code failed on our placeholders
            raise UserError("embed", f"running {type(model).__name__}.__call__(tokens) up to its blocks failed: "
                            f"{type(e).__name__}: {str(e).splitlines()[0][:200]}",
                            "if the embedding part reads weights outside embed=[...], name them there; if it "
                            "draws random numbers (dropout outside the blocks), set that rate to 0; or give "
                            "embed_fn=lambda m, tokens, positions: ...") from None
        order = [c[0] for c in calls_rec]
        if order != list(range(n)):
            raise UserError(f"blocks={blocks!r}", f"the model calls its blocks in the order {order}, not once each "
                            "in list order", "stream a model that calls every block once, in order")
    if aux_fn is None:
        specs = [_split_call(a, kw) for _, _, a, kw in calls_rec]
        spec0, dyn0 = specs[0]
        for i, (spec, dyn) in enumerate(specs[1:], 1):
            same_static = spec[0] == spec0[0] and spec[2] == spec0[2] and spec[1] == spec0[1]
            if not same_static or any(a is not b for a, b in zip(dyn, dyn0)):
                raise UserError(f"{blocks}[{i}]", "is called with other arguments than the first block (a "
                                "per-layer value)", "the blocks share one template: pass per-layer choices as "
                                "static module attributes, or give aux_fn= and block_fn=")
        def default_aux(positions, segment_ids=None):
            del segment_ids
            toks = jnp.zeros(positions.shape, jnp.int32)
            calls = run_to_blocks(shell(_zeros(embed_w)), toks, stop_at_first=True)[1]
            return _split_call(calls[0][2], calls[0][3])[1]

        # the recorded inputs must not depend on the token values (they are rebuilt from the shape)
        t1 = np.zeros((1, 4), np.int32)
        t2 = (np.arange(4, dtype=np.int32)[None] * 7 + 1) % max(2, _vocab_guess(model, embed_names, vocab_size))
        aux_of = _aux_from_tokens(run_to_blocks, shell)
        d1, d2 = aux_of(embed_w, jnp.asarray(t1)), aux_of(embed_w, jnp.asarray(t2))
        for j, (a, b) in enumerate(zip(d1, d2)):
            if not np.array_equal(np.asarray(a), np.asarray(b)):
                raise UserError(f"{blocks}[0] argument {j + 1}", "depends on the token values (a padding mask?): "
                                "per-sequence inputs are rebuilt from positions and segment ids only",
                                "give aux_fn=(positions, segment_ids) -> aux and block_fn=(block, x, aux) -> x")
        aux_fn_final = default_aux
        if block_fn is None:
            def call_block(blk, x, aux):
                args, kwargs = _rebuild_call(spec0, aux)
                return blk(x, *args, **kwargs)
        else:
            call_block = block_fn
    else:
        aux_fn_final = aux_fn
        call_block = block_fn or (lambda blk, x, aux: blk(x, aux))

    # ---- embedding
    if embed_fn is None:
        def embed_call(ew, tokens):
            toks, _ = _tokens_and_positions(tokens)
            return run_to_blocks(shell(ew), toks, stop_at_first=True)[0]
        takes_pos = False
    else:
        takes_pos = _wants_positions(embed_fn)

        def embed_call(ew, tokens):
            toks, pos = _tokens_and_positions(tokens)
            m = shell(ew)
            return embed_fn(m, toks, pos) if takes_pos else embed_fn(m, toks)

    # ---- head
    V = None
    if head_fn is None:
        head_user, tied_auto, V = _default_nnx_head(model, embed_names, head_names, vocab_size, call_kwargs)
        if tied is None:
            tied = tied_auto
    else:
        head_user = head_fn
        if tied is None:
            tied = _head_reads_embedding(lambda ew, hw, h: head_user(shell(ew, hw), h), embed_w, head_w,
                                         _hidden_probe(embed_call, embed_w))

    def head_call(hw, hidden, ew):
        out = head_user(shell(ew, hw), hidden)
        if not isinstance(out, tuple) or len(out) not in (2, 3):
            raise UserError("head_fn", "must return (normed, out_matrix) or (normed, out_matrix, bias)",
                            "return the final-normed hidden states and the (hidden, vocab) matrix")
        normed, mat = out[0], out[1]
        bias = out[2] if len(out) == 3 else None
        normed, mat = normed.astype(hidden.dtype), mat.astype(hidden.dtype)
        return _augment(normed, mat, bias)

    # ---- templates
    def make_template(g, keys_b, counts_b):
        def template(w, x, aux, rng=None):
            blk = nnx.merge(g, w, keys_b, counts_b)
            if takes_rng:
                nnx.reseed(blk, **{t: rng for t in tags})
            return call_block(blk, x, aux)

        if takes_rng:
            return lambda w, x, aux, rng: template(w, x, aux, rng)
        return lambda w, x, aux: template(w, x, aux)

    templates = {}
    for k, g in enumerate(graphs):
        i = kinds.index(k)
        templates[k] = make_template(g, states[i][2], states[i][3])
    stack = LayerStack(templates[0], [st[1] for st in states], kinds, templates, takes_rng)
    _check_closures(stack, embed_call, embed_w, aux_fn_final, blocks)

    def assemble(trees):
        out = {k: trees["embed"][k] for k in embed_names}
        out.update({k: trees["head"][k] for k in head_names})
        out[blocks] = {i: trees[f"block_{i}"] for i in range(n)}
        return {k: out[k] for k in full}

    summary = (f"embed={embed_names} blocks={blocks}[{n}] ({len(graphs)} kind{'s' if len(graphs) > 1 else ''}"
               f"{', dropout keys' if takes_rng else ''}) head={head_names}{' tied' if tied else ''}")
    parts = Streamed(embed_fn=embed_call, blocks=stack, head_fn=lambda w, h, e: head_call(w, h, e),
                     aux_fn=aux_fn_final, embed_weights=embed_w, head_weights=head_w, tied=bool(tied),
                     logit_softcap=logit_softcap, assemble=assemble, embed_takes_positions=takes_pos,
                     summary=summary)
    if check:
        quiet = parts
        if takes_rng:  # compare with dropout off: the same split of a deterministic copy
            ref = nnx.clone(model)
            _set_deterministic(ref)
            quiet = _stream_nnx(ref, blocks=blocks, embed=embed_names, head=head_names, embed_fn=embed_fn,
                                head_fn=head_fn, aux_fn=aux_fn, block_fn=block_fn, tied=tied, vocab_size=V,
                                logit_softcap=logit_softcap, check=False, call_kwargs=call_kwargs)
        _check_against_model(quiet, model, call_kwargs, V or _vocab_guess(model, embed_names, vocab_size))
    return parts


def _vocab_guess(model, embed_names, vocab_size) -> int:
    if vocab_size:
        return int(vocab_size)
    sizes = [m.num_embeddings for k in embed_names for _, m in nnx.iter_graph(getattr(model, k))
             if isinstance(m, nnx.Embed)]
    return max(sizes) if sizes else 2


def _aux_from_tokens(run_to_blocks, shell):
    def f(ew, t):
        calls = run_to_blocks(shell(ew), t, stop_at_first=True)[1]
        return _split_call(calls[0][2], calls[0][3])[1]
    return jax.jit(f)


def _hidden_probe(embed_call, embed_w):
    return jax.eval_shape(embed_call, embed_w, jnp.zeros((1, 4), jnp.int32))


def _head_reads_embedding(f, embed_w, head_w, hidden) -> bool:
    """Tied when the head cannot run with shape-only embedding weights."""
    try:
        jax.eval_shape(lambda hw, h: f(None, hw, h), head_w, hidden)
        return False
    except UserError:
        raise
    except Exception:  # noqa: BLE001
        jax.eval_shape(lambda ew, hw, h: f(ew, hw, h), embed_w, head_w, hidden)  # raises the real error
        return True


def _default_nnx_head(model, embed_names, head_names, vocab_size, call_kwargs):
    """Final norm (0 or 1 module) + projection (nnx.Linear to the vocabulary, a 2-D Param, or the
    embedding's nnx.Embed table when there is none: tied)."""
    V = vocab_size
    if V is None:
        try:
            m2 = nnx.clone(model)
            _set_deterministic(m2)
            V = int(jax.eval_shape(lambda t: m2(t, **call_kwargs), jnp.zeros((1, 2), jnp.int32)).shape[-1])
        except Exception:  # noqa: BLE001
            V = _vocab_guess(model, embed_names, None)
    proj, norms = None, []
    for k in head_names:
        v = getattr(model, k)
        if isinstance(v, nnx.Linear) and v.out_features == V:
            cand = ("linear", k)
        elif isinstance(v, nnx.Param) and np.ndim(v[...]) == 2 and V in np.shape(v[...]):
            cand = ("param", k)
        else:
            norms.append(k)
            continue
        if proj is not None:
            raise UserError("head", f"two output projections to the vocabulary ({proj[1]}, {k})",
                            "give head_fn=lambda m, h: (normed, out_matrix)")
        proj = cand
    if len(norms) > 1:
        raise UserError("head", f"several modules besides the projection ({', '.join(norms)}): which one is the "
                        "final norm?", "give head_fn=lambda m, h: (m.norm(h), m.lm_head.kernel[...])")
    tied = proj is None
    table = None
    if tied:
        embeds = [(k, p) for k in embed_names for p, m in nnx.iter_graph(getattr(model, k))
                  if isinstance(m, nnx.Embed) and m.num_embeddings == V]
        if len(embeds) != 1:
            raise UserError("head", f"no output projection to the vocabulary ({V}) among {head_names} and "
                            f"{'no' if not embeds else 'several'} nnx.Embed of {V} rows to tie it to",
                            "name the projection with head=[...] or give head_fn=lambda m, h: (normed, out_matrix)")
        table = embeds[0]
    norm = norms[0] if norms else None

    def head(m, h):
        normed = getattr(m, norm)(h) if norm else h
        if tied:
            k, path = table
            mod = getattr(m, k)
            for p in path:
                mod = mod[p] if isinstance(p, int) else getattr(mod, p)
            return normed, mod.embedding[...].T
        v = getattr(m, proj[1])
        if proj[0] == "param":
            w = v[...]
            return normed, (w if w.shape[-1] == V else w.T)
        bias = v.bias[...] if getattr(v, "bias", None) is not None else None
        return (normed, v.kernel[...]) + ((bias,) if bias is not None else ())

    return head, tied, V


def _check_closures(stack: LayerStack, embed_call, embed_w, aux_fn, blocks: str) -> None:
    """A block must compute only from its state: array constants captured by the traced template
    are weights the engine would neither stream nor train."""
    x = jax.eval_shape(embed_call, embed_w, jnp.zeros((1, 4), jnp.int32))
    pos = jnp.zeros((1, 4), jnp.int32)
    aux = jax.eval_shape(aux_fn, pos)
    w = _placeholders(stack.weights[0])
    args = (w, x, aux) + ((jax.ShapeDtypeStruct((), jax.random.key(0).dtype),) if stack.takes_rng else ())
    jaxpr = jax.make_jaxpr(stack.templates[stack.kinds[0]])(*args)
    for c in jaxpr.consts:
        if isinstance(c, jax.Array) and c.size > 1 and jnp.issubdtype(c.dtype, jnp.floating):
            raise UserError(f"{blocks}[0]", f"computes with an array of shape {tuple(c.shape)} that is not in its "
                            "state (captured by a closure or a global): it would not be streamed or trained",
                            "store weights as nnx.Param attributes of the block (Linen: self.param)")


def _check_against_model(parts: Streamed, model, call_kwargs, vocab) -> None:
    """The composed parts must give ``model(tokens)``'s logits (with dropout off)."""
    toks = (np.arange(12, dtype=np.int32).reshape(2, 6) * 5 + 3) % max(vocab, 2)
    logits_parts = np.asarray(compose_logits(parts, toks, rng_step=None))
    try:
        if isinstance(model, nnx.Module):
            ref_model = nnx.clone(model)
            _set_deterministic(ref_model)
            g, st = nnx.split(ref_model)
            want = jax.jit(lambda st, t: nnx.merge(g, st)(t, **call_kwargs))(st, jnp.asarray(toks))
        else:
            want = jax.jit(model)(jnp.asarray(toks))
    except Exception:  # noqa: BLE001 - the model has no plain model(tokens) -> logits call: nothing to compare
        return
    want = np.asarray(want)
    if want.shape != logits_parts.shape:
        return
    err = float(np.max(np.abs(want - logits_parts)))
    scale = float(np.max(np.abs(want))) or 1.0
    if err > 1e-3 * scale + 1e-5:
        raise UserError("stream", f"the parts found ({parts.summary}) do not reproduce model(tokens): max "
                        f"|logits difference| {err:.3g} (logits up to {scale:.3g}); the head may do more than a "
                        "final norm and a projection (a logit scale, a soft-cap), or the parts are misassigned",
                        "give head_fn=lambda m, h: (normed, out_matrix) (and logit_softcap=) or embed_fn=; "
                        "check=False skips this comparison")


def _set_deterministic(m) -> None:
    for _, mod in nnx.iter_graph(m):
        if isinstance(mod, nnx.Dropout):
            mod.deterministic = True


def compose_logits(parts: StreamedModel, tokens, rng_step: int | None = None, seed: int = 0, dtype=jnp.float32):
    """The streamed parts run as one plain function (no engine): logits (B, S, V). For checks and
    tests. ``rng_step``: the optimizer step whose dropout keys the blocks use (None: dropout off,
    valid only for models whose dropout is off)."""
    from megatrain_jax.templates import block_rng

    toks = jnp.asarray(tokens, jnp.int32)
    b, s = toks.shape
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    st = parts.blocks

    @jax.jit
    def run(ew, bws, hw):
        cast = lambda t: jax.tree.map(lambda a: jnp.asarray(a, dtype), t)  # noqa: E731
        ew = cast(ew)
        inp = (toks, pos) if getattr(parts, "embed_takes_positions", False) else toks
        x = parts.embed_fn(ew, inp)
        aux = parts.aux_fn(pos, None)
        for i, w in enumerate(bws):
            t = st.template_of(i)
            if st.takes_rng:
                key = block_rng(seed, rng_step, i, 0) if rng_step is not None else jax.random.key(0)
                x = t(cast(w), x, aux, key)
            else:
                x = t(cast(w), x, aux)
        normed, out = parts.head_fn(cast(hw), x, ew if parts.tied else None)
        logits = jnp.einsum("bsh,hv->bsv", normed, out)
        if parts.logit_softcap:
            logits = parts.logit_softcap * jnp.tanh(logits / parts.logit_softcap)
        return logits

    return run(parts.embed_weights, list(st.weights), parts.head_weights)


# ========================================================================================== Linen


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _flat(tree) -> dict[tuple, Any]:
    out = {}

    def walk(t, path):
        if isinstance(t, dict) or hasattr(t, "items") and not _is_array(t):
            for k, v in t.items():
                walk(v, path + (k,))
        else:
            out[path] = t
    walk(tree, ())
    return out


def _unflat(flat: dict[tuple, Any]) -> dict:
    out: dict = {}
    for path, v in flat.items():
        d = out
        for k in path[:-1]:
            d = d.setdefault(k, {})
        d[path[-1]] = v
    return out


def stream_linen(module, params, *, blocks, embed_fn, head_fn, aux_fn, block_fn, tied, logit_softcap, check,
                 call_kwargs) -> Streamed:
    """Linen: the parts are found by running ``module.apply`` once with method interceptors: the
    blocks are sibling submodules ``<prefix>_<i>`` of one class and configuration, the embedding is
    what runs before them and the head what runs after (ending in an ``nn.Dense`` to the vocabulary
    or an ``nn.Embed.attend``: tied)."""
    import flax.linen as nn

    call_kwargs = dict(call_kwargs or {})
    # apply(..., rngs={"dropout": k}) in the user's own training code: only the stream names are
    # kept; the engine gives the blocks their keys itself
    model_rngs = list(call_kwargs.pop("rngs", None) or ())
    params = jax.tree.map(np.asarray, dict(params))
    if "params" in params and len(params) == 1 and isinstance(params["params"], dict):
        params = params["params"]
    probe = jnp.zeros((1, 4), jnp.int32)
    calls: list = []

    def record(next_fun, args, kwargs, ctx):
        if ctx.method_name in ("__call__", "attend"):
            calls.append((tuple(ctx.module.path), ctx.method_name, ctx.module, args, kwargs))
        return next_fun(*args, **kwargs)

    def probe_model(rngs):
        calls.clear()
        with nn.intercept_methods(record):
            return jax.eval_shape(lambda p, t: module.apply({"params": p}, t, rngs=rngs, **call_kwargs), params,
                                  probe)

    try:  # a model with dropout on draws random numbers: the probe gives it keys for what it asks
        out_shape, model_rngs = _linen_rng_streams(probe_model, model_rngs)
    except Exception as e:  # noqa: BLE001
        raise UserError("params", f"{type(module).__name__}.apply(params, tokens) failed: {type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200]}", "pass the module's params (variables['params'])") from None
    # ---- the blocks: sibling modules <prefix>_<i> of one class
    groups: dict[tuple, list] = {}
    for idx, (path, meth, mod, args, kwargs) in enumerate(calls):
        mt = re.match(r"^(.*?)_?(\d+)$", path[-1]) if path and meth == "__call__" else None
        if mt:
            groups.setdefault((path[:-1], mt.group(1), type(mod)), []).append((int(mt.group(2)), idx))
    if blocks is not None:
        groups = {k: v for k, v in groups.items() if k[1] == blocks.rstrip("_")}
        if not groups:
            raise UserError(f"blocks={blocks!r}", "no submodules named like that are called",
                            "name the prefix of the block submodules, e.g. blocks='encoderdecoderblock'")
    if not groups:
        raise UserError("blocks", f"{type(module).__name__} calls no numbered submodules (<name>_<i>)",
                        "build the blocks as a list attribute or with name=f'block_{i}', and pass blocks='block'")
    if blocks is None:  # automatic names (Dense_0, LayerNorm_1) are parts of blocks, not blocks
        named = {k: v for k, v in groups.items() if k[1] != k[2].__name__}
        groups = named or {k: v for k, v in groups.items() if len(v) >= 2}
    if not groups:
        raise UserError("blocks", f"{type(module).__name__} calls no numbered submodules (<name>_<i>)",
                        "build the blocks as a list attribute or with name=f'block_{i}', and pass blocks='block'")
    best = max(len(v) for v in groups.values())
    top = [k for k, v in groups.items() if len(v) == best]
    shallow = min(len(k[0]) for k in top)
    top = [k for k in top if len(k[0]) == shallow]
    if len(top) > 1 and blocks is None:
        raise UserError("blocks", f"several stacks of {best} numbered submodules: "
                        f"{', '.join('/'.join(k[0] + (k[1],)) for k in top)}", "name one: blocks='prefix'")
    parent, prefix, _cls = top[0]
    members = sorted(groups[top[0]])
    if [i for i, _ in members] != list(range(len(members))) or [j for _, j in members] != sorted(j for _, j in members):
        raise UserError(f"blocks={prefix!r}", "the blocks are not called once each, in order", "stream a model "
                        "that calls every block once, in order")
    n = len(members)
    block_calls = [calls[j] for _, j in members]
    bpaths = [c[0] for c in block_calls]
    first_idx, last_idx = members[0][1], members[-1][1]
    mods = [c[2].clone(parent=None) for c in block_calls]
    cfg0 = {f.name: getattr(mods[0], f.name) for f in dataclasses.fields(mods[0]) if f.name not in ("parent", "name")}
    for i, m in enumerate(mods[1:], 1):
        cfg = {f.name: getattr(m, f.name) for f in dataclasses.fields(m) if f.name not in ("parent", "name")}
        if cfg != cfg0:
            raise UserError("/".join(bpaths[i]), f"is configured differently from {'/'.join(bpaths[0])}",
                            "the blocks of a stack must be identical modules")
    block_w = [_get(params, p) for p in bpaths]
    ref = _structure(block_w[0])
    for i, w in enumerate(block_w[1:], 1):
        if _structure(w) != ref:
            raise UserError("/".join(bpaths[i]), f"has a different weight structure from {'/'.join(bpaths[0])}",
                            "the blocks of a stack must be identical")
    block_mod = mods[0]

    # ---- embed / head: every other parameter, by when its module runs
    flat = _flat(params)
    owners = {}
    containers = {bpaths[0][:k] for k in range(len(bpaths[0]))}
    for idx, (path, meth, mod, _, _) in enumerate(calls):
        if path in containers or any(path[:len(b)] == b for b in bpaths):
            continue
        owners.setdefault(path, set()).add(idx)
    embed_keys, head_keys, tied_auto = [], [], False
    for leaf in flat:
        if any(leaf[:len(b)] == b for b in bpaths):
            continue
        own = [p for p in owners if leaf[:len(p)] == p]
        if not own:
            raise UserError("/".join(map(str, leaf)), "is a parameter of no submodule that runs before or after "
                            "the blocks (owned by the model itself)", "move it into a submodule (nn.Embed, "
                            "nn.Dense, a norm)")
        idxs = owners[max(own, key=len)]
        if min(idxs) < first_idx:
            embed_keys.append(leaf)
            tied_auto |= max(idxs) > last_idx
        else:
            head_keys.append(leaf)
    if tied is None:
        tied = tied_auto
    embed_w = _unflat({k: flat[k] for k in embed_keys})
    head_w = _unflat({k: flat[k] for k in head_keys})
    embed_flat_keys, head_flat_keys = list(embed_keys), list(head_keys)
    all_leaves = list(flat)

    def full_params(ew=None, hw=None):
        ef = _flat(ew) if ew is not None else {}
        hf = _flat(hw) if hw is not None else {}
        leaves = {}
        for k in all_leaves:
            if k in ef:
                leaves[k] = ef[k]
            elif k in hf:
                leaves[k] = hf[k]
            else:
                leaves[k] = jnp.zeros(np.shape(flat[k]), flat[k].dtype)  # unused: removed by XLA
        return _unflat(leaves)

    def run(p, tokens, on_block):
        """module.apply with the blocks handled by ``on_block(i, x, args, kwargs)``."""
        seen = {"i": 0}

        def icpt(next_fun, args, kwargs, ctx):
            if ctx.method_name == "__call__" and tuple(ctx.module.path) in bpaths:
                i = seen["i"]
                seen["i"] += 1
                return on_block(i, args[0], args[1:], kwargs)
            return next_fun(*args, **kwargs)

        with nn.intercept_methods(icpt):
            return module.apply({"params": p}, tokens, **call_kwargs)

    def stop_at_first(i, x, args, kwargs):
        raise _Reached(x, [(i, x, args, kwargs)])

    if embed_fn is None:
        def embed_call(ew, tokens):
            toks, _ = _tokens_and_positions(tokens)
            try:
                run(full_params(ew), toks, stop_at_first)
            except _Reached as r:
                return r.x
            raise UserError("blocks", "the forward did not reach the blocks", "give embed_fn=")
        takes_pos = False
    else:
        takes_pos = _wants_positions(embed_fn)

        def embed_call(ew, tokens):
            toks, pos = _tokens_and_positions(tokens)
            m = module.bind({"params": full_params(ew)})
            return embed_fn(m, toks, pos) if takes_pos else embed_fn(m, toks)

    # a block is applied on its own: rngs (its dropout key) are the engine's, per (step, layer, micro-batch)
    if aux_fn is None:
        spec0, _ = _split_call(block_calls[0][3][1:], block_calls[0][4])
        for i, c in enumerate(block_calls[1:], 1):
            spec, _ = _split_call(c[3][1:], c[4])
            if spec[0] != spec0[0] or spec[1] != spec0[1]:
                raise UserError("/".join(bpaths[i]), "is called with other arguments than the first block",
                                "give aux_fn= and block_fn=")

        def aux_call(positions, segment_ids=None):
            del segment_ids
            try:
                run(full_params(), jnp.zeros(positions.shape, jnp.int32), stop_at_first)
            except _Reached as r:
                _, _, args, kwargs = r.calls[0]
                return _split_call(args, kwargs)[1]
            raise UserError("blocks", "the forward did not reach the blocks", "give aux_fn=")

        def apply_block(w, x, aux, rngs):
            args, kwargs = _rebuild_call(spec0, aux)
            return block_mod.apply({"params": w}, x, *args, rngs=rngs, **kwargs)
    else:
        aux_call = aux_fn
        if block_fn is None:
            def apply_block(w, x, aux, rngs):
                return block_mod.apply({"params": w}, x, aux, rngs=rngs)
        else:
            def apply_block(w, x, aux, rngs):
                return block_fn(block_mod.bind({"params": w}, rngs=rngs), x, aux)

    # ---- randomness: which parts draw random numbers (dropout on); only the blocks get keys
    hidden = _linen_no_rng("embed", lambda: jax.eval_shape(embed_call, embed_w, probe))
    aux_shape = _linen_no_rng("embed", lambda: jax.eval_shape(aux_call, jnp.zeros(probe.shape, jnp.int32)))
    _, block_rngs = _linen_rng_streams(
        lambda rngs: jax.eval_shape(lambda w, x, a: apply_block(w, x, a, rngs), block_w[0], hidden, aux_shape))
    takes_rng = bool(block_rngs)
    if takes_rng:
        def call_block(w, x, aux, rng):  # every stream the block draws from gets the layer's key
            return apply_block(w, x, aux, {name: rng for name in block_rngs})
    else:
        def call_block(w, x, aux):
            return apply_block(w, x, aux, None)

    # ---- head: the model's own code after the blocks, stopped at its output projection
    if head_fn is None:
        after = [c for c in calls[last_idx + 1:] if not any(c[0][:len(p)] == p for p in containers if p != c[0])
                 or c[0] not in containers]
        after = [c for c in after if c[0] not in containers]
        proj = after[-1] if after else None
        if proj is None or not ((isinstance(proj[2], nn.Dense) and proj[1] == "__call__")
                                or (isinstance(proj[2], nn.Embed) and proj[1] == "attend")):
            raise UserError("head", "the model does not end in an nn.Dense or nn.Embed.attend after its blocks "
                            f"(last call: {'/'.join(proj[0]) if proj else 'none'})",
                            "give head_fn=lambda m, h: (normed, out_matrix)")
        ppath, pmeth = proj[0], proj[1]

        def head_call(hw, hidden, ew):
            p = full_params(ew if tied else None, hw)

            def on_block(i, x, args, kwargs):
                return hidden if i == 0 else x

            def icpt(next_fun, args, kwargs, ctx):
                if tuple(ctx.module.path) == ppath and ctx.method_name == pmeth:
                    raise _Reached(args[0], None)
                return next_fun(*args, **kwargs)

            try:
                with nn.intercept_methods(icpt):
                    run(p, jnp.zeros(hidden.shape[:2], jnp.int32), on_block)
            except _Reached as r:
                normed = r.x
            else:
                raise UserError("head", "the output projection was not reached", "give head_fn=")
            sub = _get(p, ppath)
            if pmeth == "attend":
                mat, bias = sub["embedding"].T, None
            else:
                mat, bias = sub["kernel"], sub.get("bias")
            return _augment(normed.astype(hidden.dtype), mat.astype(hidden.dtype), bias)
    else:
        def head_call(hw, hidden, ew):
            out = head_fn(module.bind({"params": full_params(ew if tied else None, hw)}), hidden)
            normed, mat = out[0].astype(hidden.dtype), out[1].astype(hidden.dtype)
            return _augment(normed, mat, out[2] if len(out) == 3 else None)

    _linen_no_rng("head", lambda: jax.eval_shape(head_call, head_w, hidden, embed_w if tied else None))
    stack = LayerStack(call_block, block_w, takes_rng=takes_rng)
    _check_closures(stack, embed_call, embed_w, aux_call, "/".join(bpaths[0]))

    def assemble(trees):
        leaves = dict(_flat(trees["embed"]))
        leaves.update(_flat(trees["head"]))
        for i, bp in enumerate(bpaths):
            leaves.update({bp + k: v for k, v in _flat(trees[f"block_{i}"]).items()})
        return _unflat({k: leaves[k] for k in all_leaves})

    names = lambda keys: sorted({"/".join(map(str, k[:-1])) for k in keys})  # noqa: E731
    summary = (f"embed={names(embed_flat_keys)} blocks={'/'.join(parent + (prefix,))}_*[{n}] "
               f"head={names(head_flat_keys)}{' tied' if tied else ''}{' (dropout keys)' if takes_rng else ''}")
    parts = Streamed(embed_fn=embed_call, blocks=stack, head_fn=head_call, aux_fn=aux_call, embed_weights=embed_w,
                     head_weights=head_w, tied=bool(tied), logit_softcap=logit_softcap, assemble=assemble,
                     embed_takes_positions=takes_pos, summary=summary)
    if check:
        V = int(out_shape.shape[-1])
        if takes_rng:
            # dropout on: the model's own forward with every block given the key that
            # compose_logits gives it (key(0)), so embedding, aux and head are compared exactly
            def reference(t):
                def on_block(i, x, args, kwargs):
                    rngs = {name: jax.random.key(0) for name in block_rngs}
                    return mods[i].apply({"params": block_w[i]}, x, *args, rngs=rngs, **kwargs)
                return run(params, t, on_block)
        else:
            def reference(t):
                return module.apply({"params": params}, t, **call_kwargs)
        _check_against_model(parts, reference, {}, V)
    return parts


def _linen_rng_streams(f: Callable, names: Sequence[str] = ()) -> tuple[Any, list[str]]:
    """``f(rngs)`` (a Linen apply under ``eval_shape``) with keys for ``names`` and for every further
    stream Linen reports missing (``make_rng("dropout")`` without it): (result, the stream names)."""
    from flax.errors import InvalidRngError

    names = list(names)
    while True:
        try:
            return f({n: jax.random.key(0) for n in names} or None), names
        except InvalidRngError as e:
            m = re.search(r'needs PRNG for "([^"]+)"', str(e))
            if m is None or m.group(1) in names or len(names) >= 16:
                raise
            names.append(m.group(1))


def _linen_no_rng(part: str, f: Callable) -> Any:
    """``f()``; a part outside the blocks that draws random numbers is refused (no key there)."""
    from flax.errors import InvalidRngError

    try:
        return f()
    except InvalidRngError as e:
        m = re.search(r'needs PRNG for "([^"]+)"', str(e))
        stream_name = m.group(1) if m else "?"
        raise UserError(part, f"draws random numbers (rng stream {stream_name!r}: dropout outside the blocks); the "
                        "engine gives keys to the blocks only", "set that dropout rate to 0 (or make it "
                        "deterministic), or move it into the first block") from None


# =========================================================================================== entry


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
        return _stream_nnx(model, blocks=blocks, embed=embed, head=head, embed_fn=embed_fn, head_fn=head_fn,
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
