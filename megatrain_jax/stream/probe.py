"""Running the user's model with its blocks replaced by recorders, and checking the parts found
against the model: what ``stream`` learns from the model's own ``__call__``."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from megatrain_jax.errors import UserError
from megatrain_jax.templates import LayerStack, StreamedModel
from megatrain_jax.stream.common import Streamed, placeholders, split_call


class Reached(Exception):
    """Raised by a block recorder: the model's forward reached its blocks (or finished them).
    Shared by the Linen and NNX paths."""

    def __init__(self, x, calls):
        super().__init__("reached the blocks")
        self.x, self.calls = x, calls


class Recorder:
    """Stands in for block ``i`` while the model's own ``__call__`` runs: records the call, passes
    the hidden state through, and stops the forward after the last block (or at the first one).
    Used by the NNX path (from_nnx.py)."""

    def __init__(self, i: int, n: int, calls: list, stop_at_first: bool, replace: Any = None):
        self.i, self.n, self.calls, self.stop_at_first, self.replace = i, n, calls, stop_at_first, replace

    def __call__(self, x, *args, **kwargs):
        self.calls.append((self.i, x, args, kwargs))
        if self.stop_at_first or self.i == self.n - 1:
            raise Reached(x if self.replace is None else self.replace, self.calls)
        return x


def aux_from_tokens(run_to_blocks, shell):
    """A jitted function (embedding weights, tokens) -> the dynamic leaves of block 0's recorded call.
    Used by the NNX path (from_nnx.py)."""
    def f(ew, t):
        calls = run_to_blocks(shell(ew), t, stop_at_first=True)[1]
        return split_call(calls[0][2], calls[0][3])[1]
    return jax.jit(f)


def hidden_probe(embed_call, embed_w):
    """The embedding's output shape for a (1, 4) token batch. Used by the NNX path (from_nnx.py)."""
    return jax.eval_shape(embed_call, embed_w, jnp.zeros((1, 4), jnp.int32))


def head_reads_embedding(f, embed_w, head_w, hidden) -> bool:
    """Tied when the head cannot run with shape-only embedding weights.
    Used by the NNX path (from_nnx.py)."""
    try:
        jax.eval_shape(lambda hw, h: f(None, hw, h), head_w, hidden)
        return False
    except UserError:
        raise
    except Exception:  # noqa: BLE001
        jax.eval_shape(lambda ew, hw, h: f(ew, hw, h), embed_w, head_w, hidden)  # raises the real error
        return True


def check_closures(stack: LayerStack, embed_call, embed_w, aux_fn, blocks: str) -> None:
    """A block must compute only from its state: array constants captured by the traced template
    are weights the engine would neither stream nor train.
    Shared by the Linen and NNX paths."""
    x = jax.eval_shape(embed_call, embed_w, jnp.zeros((1, 4), jnp.int32))
    pos = jnp.zeros((1, 4), jnp.int32)
    aux = jax.eval_shape(aux_fn, pos)
    w = placeholders(stack.weights[0])
    args = (w, x, aux) + ((jax.ShapeDtypeStruct((), jax.random.key(0).dtype),) if stack.takes_rng else ())
    jaxpr = jax.make_jaxpr(stack.templates[stack.kinds[0]])(*args)
    for c in jaxpr.consts:
        if isinstance(c, jax.Array) and c.size > 1 and jnp.issubdtype(c.dtype, jnp.floating):
            raise UserError(f"{blocks}[0]", f"computes with an array of shape {tuple(c.shape)} that is not in its "
                            "state (captured by a closure or a global): it would not be streamed or trained",
                            "store weights as nnx.Param attributes of the block (Linen: self.param)")


def check_against_model(parts: Streamed, model, call_kwargs, vocab) -> None:
    """The composed parts must give ``model(tokens)``'s logits (with dropout off).
    Shared by the Linen and NNX paths."""
    toks = (np.arange(12, dtype=np.int32).reshape(2, 6) * 5 + 3) % max(vocab, 2)
    logits_parts = np.asarray(compose_logits(parts, toks, rng_step=None))
    try:
        if isinstance(model, nnx.Module):
            ref_model = nnx.clone(model)
            set_deterministic(ref_model)
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


def set_deterministic(m) -> None:
    """Dropout off in every module of ``m``. Used by the NNX path (from_nnx.py)."""
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
