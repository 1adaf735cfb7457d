"""``stream`` for an NNX model: blocks from its list attribute, embedding and head from the other
attributes, each run through the model's own code."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from megatrain_jax.errors import UserError
from megatrain_jax.templates import LayerStack
from megatrain_jax.stream.common import (
    Streamed, as_names, augment, placeholders, rebuild_call, split_call, structure, tokens_and_positions,
    wants_positions, zeros_like_tree)
from megatrain_jax.stream.probe import (
    Reached, Recorder, aux_from_tokens, check_against_model, check_closures, head_reads_embedding, hidden_probe,
    set_deterministic)


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


def find_blocks(model, blocks: str | None) -> tuple[str, list]:
    """The attribute holding the list of blocks (found when the model has exactly one) and its modules.
    Public: the LoRA streamer (lora_trainer.py) finds the blocks the same way."""
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
        if isinstance(v, nnx.Module) and structure(nnx.to_pure_dict(nnx.state(v, nnx.Param))):
            why += " (layers stacked into one module, e.g. by nnx.vmap/nnx.scan, cannot be streamed one by one)"
        raise UserError(f"blocks={blocks!r}", why, "name a list / nnx.List attribute of block modules")
    return blocks, list(getattr(model, blocks))


def _block_kinds(block_mods: list, blocks: str) -> tuple[list, list, list]:
    """Each block's state (``_block_states``), checked to have one weight structure, and the distinct
    graphs among them: one compiled template per graph. Returns (states, graphs, kind of each block)."""
    states = [_block_states(b, f"{blocks}[{i}]") for i, b in enumerate(block_mods)]
    ref = structure(states[0][1])
    for i, st in enumerate(states[1:], 1):
        sig = structure(st[1])
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
    return states, graphs, kinds


def _part_names(model, full: dict, blocks: str, embed, head) -> tuple[list[str], list[str]]:
    """The top-level attributes of the embedding (default: those holding an ``nnx.Embed``) and of the
    head (default: the rest); every parameter outside the blocks must belong to exactly one."""
    others = [k for k in full if k != blocks]
    embed_names = as_names(embed, "embed")
    if embed_names is None:
        embed_names = [k for k in others if _contains(getattr(model, k, None), nnx.Embed)]
        if not embed_names:
            raise UserError("embed", f"no attribute of {type(model).__name__} is (or contains) an nnx.Embed",
                            f"name the embedding part: stream(model, embed='...') (attributes: {', '.join(others)})")
    head_names = as_names(head, "head")
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

    return embed_names, head_names


def stream_nnx(model, *, blocks, embed, head, embed_fn, head_fn, aux_fn, block_fn, tied, vocab_size,
               logit_softcap, check, call_kwargs) -> Streamed:
    """``stream`` for an NNX model (the arguments already normalised by ``stream``). Public:
    stream/__init__.py dispatches to it."""
    call_kwargs = dict(call_kwargs or {})
    blocks, block_mods = find_blocks(model, blocks)
    n = len(block_mods)

    # ---- the blocks: one template per distinct graph, identical weight structure
    states, graphs, kinds = _block_kinds(block_mods, blocks)
    tags = states[0][4]
    takes_rng = bool(tags) and _uses_rng(block_mods[0])

    # ---- the other parts, by top-level attribute
    full = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    embed_names, head_names = _part_names(model, full, blocks, embed, head)
    sh = _NnxShell(model, full, blocks, n, call_kwargs)
    embed_w = {k: full[k] for k in embed_names}
    head_w = {k: full[k] for k in head_names}

    # ---- how the model calls its blocks (recorded from its own __call__)
    calls_rec = _nnx_recorded_calls(sh, embed_w) if aux_fn is None or embed_fn is None else None
    if aux_fn is None:
        aux_fn_final, call_block = _nnx_default_aux(sh, calls_rec, embed_w, embed_names, vocab_size, block_fn)
    else:
        aux_fn_final = aux_fn
        call_block = block_fn or (lambda blk, x, aux: blk(x, aux))
    embed_call, takes_pos = _nnx_embed_call(sh, embed_fn)
    head_call, tied, V = _nnx_head_call(sh, head_fn, tied, embed_names, head_names, vocab_size, embed_call, embed_w,
                                        head_w)

    stack = _nnx_stack(states, graphs, kinds, call_block, takes_rng, tags)
    check_closures(stack, embed_call, embed_w, aux_fn_final, blocks)

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
            set_deterministic(ref)
            quiet = stream_nnx(ref, blocks=blocks, embed=embed_names, head=head_names, embed_fn=embed_fn,
                               head_fn=head_fn, aux_fn=aux_fn, block_fn=block_fn, tied=tied, vocab_size=V,
                               logit_softcap=logit_softcap, check=False, call_kwargs=call_kwargs)
        check_against_model(quiet, model, call_kwargs, V or _vocab_guess(model, embed_names, vocab_size))
    return parts


class _NnxShell:
    """The user's model object rebuilt around some parts' weights, and run up to its blocks. The
    state outside the blocks must be weights and RNG streams only; the RNG streams outside the blocks
    are shape-only: the engine gives keys to blocks only, so an embedding or head that draws random
    numbers fails loudly instead of reusing one mask each step."""

    def __init__(self, model, full: dict, blocks: str, n: int, call_kwargs: dict):
        graphdef, _, keys_all, counts_all, rest_all = nnx.split(model, nnx.Param, nnx.RngKey, nnx.RngCount, ...)
        rest_flat = [(p, v) for p, v in rest_all.flat_state() if p[0] != blocks]
        if rest_flat:
            path, var = rest_flat[0]
            raise UserError(".".join(map(str, path)), f"holds {type(var).__name__} state outside the blocks, which "
                            "cannot be carried between streamed steps", "keep weights in nnx.Param")
        self.model, self.full, self.blocks, self.n, self.call_kwargs = model, full, blocks, n, call_kwargs
        self.graphdef, self.rest_all = graphdef, nnx.to_pure_dict(rest_all)
        self.keys_pd, self.counts_pd = placeholders(nnx.to_pure_dict(keys_all)), nnx.to_pure_dict(counts_all)
        self.block_ph = placeholders(full.get(blocks, {}))

    def shell(self, ew=None, hw=None):
        """The user's model object with the given parts' weights in it; the rest are shape-only
        placeholders (touching one is an error) and the blocks are left for recorders."""
        full, blocks = self.full, self.blocks
        params = {k: (ew[k] if ew is not None and k in ew else hw[k] if hw is not None and k in hw
                      else placeholders(full[k])) for k in full if k != blocks}
        if blocks in full:
            params[blocks] = self.block_ph
        return nnx.merge(self.graphdef, params, self.keys_pd, self.counts_pd, self.rest_all)

    def run_to_blocks(self, m, tokens, stop_at_first):
        """The model's own ``__call__`` with recorders for its blocks: (hidden at the first block, the
        recorded calls)."""
        calls: list = []
        object.__setattr__(m, self.blocks, [Recorder(i, self.n, calls, stop_at_first) for i in range(self.n)])
        try:
            m(tokens, **self.call_kwargs)
        except Reached as r:
            return r.x, r.calls
        raise UserError(f"blocks={self.blocks!r}", f"{type(self.model).__name__}.__call__(tokens) returned without "
                        f"calling its blocks in order (calls seen: {[c[0] for c in calls]})",
                        "give embed_fn= (and aux_fn=/block_fn=) to say how the parts are called")


def _nnx_recorded_calls(sh: _NnxShell, embed_w: dict) -> list:
    """Every block call of the model's own ``__call__`` on a probe batch (shapes only), checked to be
    once each, in list order."""
    probe = jnp.zeros((1, 4), jnp.int32)
    try:
        holder = {}

        def rec(ew):
            holder["calls"] = sh.run_to_blocks(sh.shell(ew), probe, stop_at_first=False)[1]
            return 0
        jax.eval_shape(rec, embed_w)
        calls_rec = holder["calls"]
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - the model's own code failed on our placeholders
        raise UserError("embed", f"running {type(sh.model).__name__}.__call__(tokens) up to its blocks failed: "
                        f"{type(e).__name__}: {str(e).splitlines()[0][:200]}",
                        "if the embedding part reads weights outside embed=[...], name them there; if it "
                        "draws random numbers (dropout outside the blocks), set that rate to 0; or give "
                        "embed_fn=lambda m, tokens, positions: ...") from None
    order = [c[0] for c in calls_rec]
    if order != list(range(sh.n)):
        raise UserError(f"blocks={sh.blocks!r}", f"the model calls its blocks in the order {order}, not once each "
                        "in list order", "stream a model that calls every block once, in order")
    return calls_rec


def _nnx_default_aux(sh: _NnxShell, calls_rec: list, embed_w: dict, embed_names: list, vocab_size, block_fn):
    """Without ``aux_fn``: the blocks' per-sequence inputs are the arrays of the recorded calls, the
    same for every block and independent of the token values (they are rebuilt from the shape).
    Returns (aux_fn, call_block)."""
    blocks = sh.blocks
    specs = [split_call(a, kw) for _, _, a, kw in calls_rec]
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
        calls = sh.run_to_blocks(sh.shell(zeros_like_tree(embed_w)), toks, stop_at_first=True)[1]
        return split_call(calls[0][2], calls[0][3])[1]

    # the recorded inputs must not depend on the token values (they are rebuilt from the shape)
    t1 = np.zeros((1, 4), np.int32)
    t2 = (np.arange(4, dtype=np.int32)[None] * 7 + 1) % max(2, _vocab_guess(sh.model, embed_names, vocab_size))
    aux_of = aux_from_tokens(sh.run_to_blocks, sh.shell)
    d1, d2 = aux_of(embed_w, jnp.asarray(t1)), aux_of(embed_w, jnp.asarray(t2))
    for j, (a, b) in enumerate(zip(d1, d2)):
        if not np.array_equal(np.asarray(a), np.asarray(b)):
            raise UserError(f"{blocks}[0] argument {j + 1}", "depends on the token values (a padding mask?): "
                            "per-sequence inputs are rebuilt from positions and segment ids only",
                            "give aux_fn=(positions, segment_ids) -> aux and block_fn=(block, x, aux) -> x")
    if block_fn is not None:
        return default_aux, block_fn

    def call_block(blk, x, aux):
        args, kwargs = rebuild_call(spec0, aux)
        return blk(x, *args, **kwargs)
    return default_aux, call_block


def _nnx_embed_call(sh: _NnxShell, embed_fn):
    """The embedding part: the model's own ``__call__`` up to its first block, or ``embed_fn`` on the
    shell. Returns (embed_call, whether it takes positions)."""
    if embed_fn is None:
        def embed_call(ew, tokens):
            toks, _ = tokens_and_positions(tokens)
            return sh.run_to_blocks(sh.shell(ew), toks, stop_at_first=True)[0]
        return embed_call, False
    takes_pos = wants_positions(embed_fn)

    def embed_call(ew, tokens):
        toks, pos = tokens_and_positions(tokens)
        m = sh.shell(ew)
        return embed_fn(m, toks, pos) if takes_pos else embed_fn(m, toks)
    return embed_call, takes_pos


def _nnx_head_call(sh: _NnxShell, head_fn, tied, embed_names, head_names, vocab_size, embed_call, embed_w, head_w):
    """The head part (hw, hidden, ew) -> (normed, matrix) with any output bias folded in: the default
    head (final norm + projection) or ``head_fn``; tied found when not given. Returns (head_call,
    tied, the vocabulary size when the default head found it, else None)."""
    V = None
    if head_fn is None:
        head_user, tied_auto, V = _default_nnx_head(sh.model, embed_names, head_names, vocab_size, sh.call_kwargs)
        if tied is None:
            tied = tied_auto
    else:
        head_user = head_fn
        if tied is None:
            tied = head_reads_embedding(lambda ew, hw, h: head_user(sh.shell(ew, hw), h), embed_w, head_w,
                                        hidden_probe(embed_call, embed_w))

    def head_call(hw, hidden, ew):
        out = head_user(sh.shell(ew, hw), hidden)
        if not isinstance(out, tuple) or len(out) not in (2, 3):
            raise UserError("head_fn", "must return (normed, out_matrix) or (normed, out_matrix, bias)",
                            "return the final-normed hidden states and the (hidden, vocab) matrix")
        normed, mat = out[0], out[1]
        bias = out[2] if len(out) == 3 else None
        normed, mat = normed.astype(hidden.dtype), mat.astype(hidden.dtype)
        return augment(normed, mat, bias)
    return head_call, tied, V


def _nnx_stack(states: list, graphs: list, kinds: list, call_block, takes_rng: bool, tags: list) -> LayerStack:
    """One template per distinct block graph (the block merged from its weights, reseeded with the
    layer's key when it draws random numbers), over every block's weights."""
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
    return LayerStack(templates[0], [st[1] for st in states], kinds, templates, takes_rng)


def _vocab_guess(model, embed_names, vocab_size) -> int:
    if vocab_size:
        return int(vocab_size)
    sizes = [m.num_embeddings for k in embed_names for _, m in nnx.iter_graph(getattr(model, k))
             if isinstance(m, nnx.Embed)]
    return max(sizes) if sizes else 2


def _default_nnx_head(model, embed_names, head_names, vocab_size, call_kwargs):
    """Final norm (0 or 1 module) + projection (nnx.Linear to the vocabulary, a 2-D Param, or the
    embedding's nnx.Embed table when there is none: tied)."""
    V = vocab_size
    if V is None:
        try:
            m2 = nnx.clone(model)
            set_deterministic(m2)
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
