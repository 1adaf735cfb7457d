"""``stream`` for a Linen module with its params: blocks by submodule name prefix, the embedding
and head by call order; dropout keys per block through Linen's rng streams."""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.errors import UserError
from megatrain_jax.templates import LayerStack
from megatrain_jax.stream.common import (
    Streamed, is_array, tokens_and_positions, wants_positions, split_call, rebuild_call, augment, structure)
from megatrain_jax.stream.probe import Reached, check_closures, check_against_model


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _flat(tree) -> dict[tuple, Any]:
    out = {}

    def walk(t, path):
        if isinstance(t, dict) or hasattr(t, "items") and not is_array(t):
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
    params, call_kwargs, model_rngs = _linen_inputs(params, call_kwargs)
    probe = jnp.zeros((1, 4), jnp.int32)
    calls, out_shape = _linen_probe(module, params, call_kwargs, model_rngs, probe)
    # ---- the blocks: sibling modules <prefix>_<i> of one class
    parent, prefix, block_calls, bpaths, first_idx, last_idx, mods, block_w = _linen_stack(module, calls, params,
                                                                                          blocks)
    # ---- embed / head: every other parameter, by when its module runs
    embed_keys, head_keys, tied_auto, flat, containers = _linen_embed_head(calls, params, bpaths, first_idx, last_idx)
    if tied is None:
        tied = tied_auto
    embed_w = _unflat({k: flat[k] for k in embed_keys})
    head_w = _unflat({k: flat[k] for k in head_keys})
    lr = _LinenRun(module, params, call_kwargs, flat, bpaths)
    embed_call, takes_pos = _linen_embed_call(lr, embed_fn)
    aux_call, apply_block = _linen_block_apply(lr, block_calls, mods[0], aux_fn, block_fn)

    # ---- randomness: which parts draw random numbers (dropout on); only the blocks get keys
    hidden = _linen_no_rng("embed", lambda: jax.eval_shape(embed_call, embed_w, probe))
    aux_shape = _linen_no_rng("embed", lambda: jax.eval_shape(aux_call, jnp.zeros(probe.shape, jnp.int32)))
    call_block, block_rngs = _linen_block_keys(apply_block, block_w[0], hidden, aux_shape)
    takes_rng = bool(block_rngs)

    # ---- head: the model's own code after the blocks, stopped at its output projection
    head_call = _linen_head_call(lr, head_fn, calls, last_idx, containers, tied)
    _linen_no_rng("head", lambda: jax.eval_shape(head_call, head_w, hidden, embed_w if tied else None))
    stack = LayerStack(call_block, block_w, takes_rng=takes_rng)
    check_closures(stack, embed_call, embed_w, aux_call, "/".join(bpaths[0]))

    summary = _linen_summary(embed_keys, head_keys, parent, prefix, len(block_calls), tied, takes_rng)
    parts = Streamed(embed_fn=embed_call, blocks=stack, head_fn=head_call, aux_fn=aux_call, embed_weights=embed_w,
                     head_weights=head_w, tied=bool(tied), logit_softcap=logit_softcap, assemble=lr.assemble,
                     embed_takes_positions=takes_pos, summary=summary)
    if check:
        check_against_model(parts, _linen_reference(lr, mods, block_w, block_rngs), {}, int(out_shape.shape[-1]))
    return parts


def _linen_inputs(params, call_kwargs) -> tuple[dict, dict, list]:
    """The user's params as a numpy tree (``{"params": ...}`` unwrapped), and the call's keyword
    arguments without ``rngs``: (params, call_kwargs, the rng stream names the call named)."""
    call_kwargs = dict(call_kwargs or {})
    # apply(..., rngs={"dropout": k}) in the user's own training code: only the stream names are
    # kept; the engine gives the blocks their keys itself
    model_rngs = list(call_kwargs.pop("rngs", None) or ())
    params = jax.tree.map(np.asarray, dict(params))
    if "params" in params and len(params) == 1 and isinstance(params["params"], dict):
        params = params["params"]
    return params, call_kwargs, model_rngs


def _linen_probe(module, params: dict, call_kwargs: dict, model_rngs: list, probe) -> tuple[list, Any]:
    """``module.apply`` once (shapes only) with every ``__call__`` / ``attend`` recorded as (path,
    method, module, args, kwargs): (the calls, the output's shape). The model's failure is the
    user's error (wrong params)."""
    import flax.linen as nn

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
        out_shape, _ = _linen_rng_streams(probe_model, model_rngs)
    except Exception as e:  # noqa: BLE001
        raise UserError("params", f"{type(module).__name__}.apply(params, tokens) failed: {type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200]}", "pass the module's params (variables['params'])") from None
    return calls, out_shape


class _LinenRun:
    """The user's module run with its blocks intercepted, from the weights of some parts (the
    others zeros: unused, removed by XLA); and the parts' weights put back into the params tree."""

    def __init__(self, module, params: dict, call_kwargs: dict, flat: dict, bpaths: list):
        self.module, self.params, self.call_kwargs = module, params, call_kwargs
        self.flat, self.all_leaves, self.bpaths = flat, list(flat), bpaths

    def full_params(self, ew=None, hw=None):
        ef = _flat(ew) if ew is not None else {}
        hf = _flat(hw) if hw is not None else {}
        leaves = {}
        for k in self.all_leaves:
            if k in ef:
                leaves[k] = ef[k]
            elif k in hf:
                leaves[k] = hf[k]
            else:
                leaves[k] = jnp.zeros(np.shape(self.flat[k]), self.flat[k].dtype)  # unused: removed by XLA
        return _unflat(leaves)

    def run(self, p, tokens, on_block):
        """module.apply with the blocks handled by ``on_block(i, x, args, kwargs)``."""
        import flax.linen as nn

        seen = {"i": 0}

        def icpt(next_fun, args, kwargs, ctx):
            if ctx.method_name == "__call__" and tuple(ctx.module.path) in self.bpaths:
                i = seen["i"]
                seen["i"] += 1
                return on_block(i, args[0], args[1:], kwargs)
            return next_fun(*args, **kwargs)

        with nn.intercept_methods(icpt):
            return self.module.apply({"params": p}, tokens, **self.call_kwargs)

    def assemble(self, trees):
        """Host trees by group -> the module's params tree."""
        leaves = dict(_flat(trees["embed"]))
        leaves.update(_flat(trees["head"]))
        for i, bp in enumerate(self.bpaths):
            leaves.update({bp + k: v for k, v in _flat(trees[f"block_{i}"]).items()})
        return _unflat({k: leaves[k] for k in self.all_leaves})


def _stop_at_first(i, x, args, kwargs):
    raise Reached(x, [(i, x, args, kwargs)])


def _linen_embed_call(lr: _LinenRun, embed_fn) -> tuple[Callable, bool]:
    """The embedding part: the model's own forward stopped at the first block, or ``embed_fn`` on the
    bound module. Returns (embed_call, whether it takes positions)."""
    if embed_fn is None:
        def embed_call(ew, tokens):
            toks, _ = tokens_and_positions(tokens)
            try:
                lr.run(lr.full_params(ew), toks, _stop_at_first)
            except Reached as r:
                return r.x
            raise UserError("blocks", "the forward did not reach the blocks", "give embed_fn=")
        return embed_call, False
    takes_pos = wants_positions(embed_fn)

    def embed_call(ew, tokens):
        toks, pos = tokens_and_positions(tokens)
        m = lr.module.bind({"params": lr.full_params(ew)})
        return embed_fn(m, toks, pos) if takes_pos else embed_fn(m, toks)
    return embed_call, takes_pos


def _linen_block_apply(lr: _LinenRun, block_calls: list, block_mod, aux_fn, block_fn) -> tuple[Callable, Callable]:
    """The blocks' per-sequence inputs and one block applied on its own: without ``aux_fn``, the
    arrays of the first block's recorded call (every block must be called alike); rngs (its dropout
    key) are the engine's, per (step, layer, micro-batch). Returns (aux_call, apply_block)."""
    if aux_fn is None:
        spec0, _ = split_call(block_calls[0][3][1:], block_calls[0][4])
        for i, c in enumerate(block_calls[1:], 1):
            spec, _ = split_call(c[3][1:], c[4])
            if spec[0] != spec0[0] or spec[1] != spec0[1]:
                raise UserError("/".join(lr.bpaths[i]), "is called with other arguments than the first block",
                                "give aux_fn= and block_fn=")

        def aux_call(positions, segment_ids=None):
            del segment_ids
            try:
                lr.run(lr.full_params(), jnp.zeros(positions.shape, jnp.int32), _stop_at_first)
            except Reached as r:
                _, _, args, kwargs = r.calls[0]
                return split_call(args, kwargs)[1]
            raise UserError("blocks", "the forward did not reach the blocks", "give aux_fn=")

        def apply_block(w, x, aux, rngs):
            args, kwargs = rebuild_call(spec0, aux)
            return block_mod.apply({"params": w}, x, *args, rngs=rngs, **kwargs)
        return aux_call, apply_block
    if block_fn is None:
        def apply_block(w, x, aux, rngs):
            return block_mod.apply({"params": w}, x, aux, rngs=rngs)
    else:
        def apply_block(w, x, aux, rngs):
            return block_fn(block_mod.bind({"params": w}, rngs=rngs), x, aux)
    return aux_fn, apply_block


def _linen_block_keys(apply_block: Callable, w0, hidden, aux_shape) -> tuple[Callable, list[str]]:
    """The rng streams a block draws from (dropout on): (the engine's block call, taking the layer's
    key when there are any, the stream names)."""
    _, block_rngs = _linen_rng_streams(
        lambda rngs: jax.eval_shape(lambda w, x, a: apply_block(w, x, a, rngs), w0, hidden, aux_shape))
    if block_rngs:
        def call_block(w, x, aux, rng):  # every stream the block draws from gets the layer's key
            return apply_block(w, x, aux, {name: rng for name in block_rngs})
    else:
        def call_block(w, x, aux):
            return apply_block(w, x, aux, None)
    return call_block, block_rngs


def _linen_head_projection(calls: list, last_idx: int, containers: set) -> tuple[tuple, str]:
    """The head's output projection: the last call after the blocks (their containers aside), which
    must be an ``nn.Dense`` or an ``nn.Embed.attend``. Returns (its module path, its method)."""
    import flax.linen as nn

    after = [c for c in calls[last_idx + 1:] if not any(c[0][:len(p)] == p for p in containers if p != c[0])
             or c[0] not in containers]
    after = [c for c in after if c[0] not in containers]
    proj = after[-1] if after else None
    if proj is None or not ((isinstance(proj[2], nn.Dense) and proj[1] == "__call__")
                            or (isinstance(proj[2], nn.Embed) and proj[1] == "attend")):
        raise UserError("head", "the model does not end in an nn.Dense or nn.Embed.attend after its blocks "
                        f"(last call: {'/'.join(proj[0]) if proj else 'none'})",
                        "give head_fn=lambda m, h: (normed, out_matrix)")
    return proj[0], proj[1]


def _linen_head_call(lr: _LinenRun, head_fn, calls: list, last_idx: int, containers: set, tied) -> Callable:
    """The head part (hw, hidden, ew) -> (normed, matrix) with any output bias folded in: the model's
    own code after the blocks stopped at its output projection, or ``head_fn`` on the bound module."""
    import flax.linen as nn

    if head_fn is not None:
        def head_call(hw, hidden, ew):
            out = head_fn(lr.module.bind({"params": lr.full_params(ew if tied else None, hw)}), hidden)
            normed, mat = out[0].astype(hidden.dtype), out[1].astype(hidden.dtype)
            return augment(normed, mat, out[2] if len(out) == 3 else None)
        return head_call
    ppath, pmeth = _linen_head_projection(calls, last_idx, containers)

    def head_call(hw, hidden, ew):
        p = lr.full_params(ew if tied else None, hw)

        def on_block(i, x, args, kwargs):
            return hidden if i == 0 else x

        def icpt(next_fun, args, kwargs, ctx):
            if tuple(ctx.module.path) == ppath and ctx.method_name == pmeth:
                raise Reached(args[0], None)
            return next_fun(*args, **kwargs)

        try:
            with nn.intercept_methods(icpt):
                lr.run(p, jnp.zeros(hidden.shape[:2], jnp.int32), on_block)
        except Reached as r:
            normed = r.x
        else:
            raise UserError("head", "the output projection was not reached", "give head_fn=")
        sub = _get(p, ppath)
        if pmeth == "attend":
            mat, bias = sub["embedding"].T, None
        else:
            mat, bias = sub["kernel"], sub.get("bias")
        return augment(normed.astype(hidden.dtype), mat.astype(hidden.dtype), bias)
    return head_call


def _linen_summary(embed_keys: list, head_keys: list, parent: tuple, prefix: str, n: int, tied, takes_rng: bool
                   ) -> str:
    names = lambda keys: sorted({"/".join(map(str, k[:-1])) for k in keys})  # noqa: E731
    return (f"embed={names(embed_keys)} blocks={'/'.join(parent + (prefix,))}_*[{n}] "
            f"head={names(head_keys)}{' tied' if tied else ''}{' (dropout keys)' if takes_rng else ''}")


def _linen_reference(lr: _LinenRun, mods: list, block_w: list, block_rngs: list) -> Callable:
    """What the composed parts are checked against: the model's own forward; with dropout on, every
    block given the key that compose_logits gives it (key(0)), so embedding, aux and head are
    compared exactly."""
    if block_rngs:
        def reference(t):
            def on_block(i, x, args, kwargs):
                rngs = {name: jax.random.key(0) for name in block_rngs}
                return mods[i].apply({"params": block_w[i]}, x, *args, rngs=rngs, **kwargs)
            return lr.run(lr.params, t, on_block)
        return reference

    def reference(t):
        return lr.module.apply({"params": lr.params}, t, **lr.call_kwargs)
    return reference


def _linen_stack(module, calls: list, params: dict, blocks: str | None):
    """The blocks among the recorded calls: sibling submodules ``<prefix>_<i>`` of one class and
    configuration, called once each, in order, with the same weight structure. Returns (parent path,
    prefix, their calls, their paths, first and last call index, unbound clones, weights)."""
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
    ref = structure(block_w[0])
    for i, w in enumerate(block_w[1:], 1):
        if structure(w) != ref:
            raise UserError("/".join(bpaths[i]), f"has a different weight structure from {'/'.join(bpaths[0])}",
                            "the blocks of a stack must be identical")
    return parent, prefix, block_calls, bpaths, first_idx, last_idx, mods, block_w


def _linen_embed_head(calls: list, params: dict, bpaths: list, first_idx: int, last_idx: int):
    """Every parameter outside the blocks, by when its module runs: before the first block it is the
    embedding's (tied when the same module also runs after the last), after it the head's. Returns
    (embed leaf paths, head leaf paths, tied, the flat params, the blocks' container paths)."""
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
    return embed_keys, head_keys, tied_auto, flat, containers


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
