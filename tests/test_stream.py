"""stream(): dropout keys equal a plain run's, a model in no example streams by the documented
contract, and everything it cannot stream is refused in one clear error."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
sys.path.insert(0, os.path.dirname(__file__))

from _porting_model import RoPEDecoder, ce_mean, group_errors, stream_rope  # noqa: E402

from megatrain_jax.errors import UserError  # noqa: E402
from megatrain_jax.stream import stream  # noqa: E402
from megatrain_jax.templates import block_rng  # noqa: E402
from megatrain_jax.trainer import Trainer  # noqa: E402


def _toks(vocab, n, b=4, s=12, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, (b, s + 1)).astype(np.int32) for _ in range(n)]


def test_dropout_streamed_equals_plain_run_with_the_same_keys():
    """GPT-2 with dropout 0.3 in its blocks, 2 micro-batches, 3 steps: the plain run reseeds block i
    with block_rng(seed, step, i, micro) (nnx.reseed, every stream tag) before its forward."""
    from gpt2_nnx import GPT2Config, build_model

    cfg = GPT2Config(vocab_size=48, block_size=12, n_layer=2, n_head=2, n_embd=16, dropout=0.3)
    seed, M, steps, tx = 5, 2, 3, optax.sgd(0.5)
    batches = _toks(cfg.vocab_size, steps)
    model = build_model(cfg)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)

    def loss_fn(p, toks, step):
        total = 0.0
        b = toks.shape[0]
        for m in range(M):
            mdl = nnx.merge(graphdef, p, rest)
            for i, blk in enumerate(mdl.h):
                nnx.reseed(blk, dropout=block_rng(seed, step, i, m))
            part = toks[m * b // M:(m + 1) * b // M]
            total = total + ce_mean(mdl(part[:, :-1]), part[:, 1:]) * part[:, 1:].size
        return total / toks[:, 1:].size

    state = tx.init(params)
    want = []
    grad_fn = jax.jit(jax.value_and_grad(loss_fn))  # the step is traced: one compilation
    for step, toks in enumerate(batches):
        loss, g = grad_fn(params, jnp.asarray(toks), jnp.asarray(step, jnp.uint32))
        upd, state = tx.update(g, state, params)
        params = optax.apply_updates(params, upd)
        want.append(float(loss))

    tr = Trainer(build_model(cfg), tx, micro_batches=M, seed=seed, loss_chunk=20, check=False)
    assert tr.parts.blocks.takes_rng
    got = [tr.step(t).loss for t in batches]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    errs = group_errors(params, tr.params())
    assert max(errs.values()) <= 1e-5, errs
    tr.close()


def test_rope_decoder_streams_by_the_documented_contract():
    """A pre-norm RMSNorm decoder with its own rotary embeddings (in no example), streamed with
    explicit adapters (embed_fn, aux_fn from the batch positions, block_fn, head_fn); 3 steps equal
    whole-model jax.grad + optax.adamw, including batches with their own positions."""
    from megatrain_jax.engine import Batch

    model = RoPEDecoder(vocab=64, d=32, heads=2, layers=2)
    batches = _toks(64, 3)
    rng = np.random.default_rng(0)
    positions = [np.sort(rng.integers(0, 40, (4, 12)), axis=1).astype(np.int32) for _ in batches]
    tx = optax.adamw(1e-3, weight_decay=0.1)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = nnx.to_pure_dict(params)
    state = tx.init(params)
    want = []
    grad_fn = jax.jit(jax.value_and_grad(
        lambda p, toks, pos: ce_mean(nnx.merge(graphdef, p, rest)(toks[:, :-1], pos), toks[:, 1:])))
    for toks, pos in zip(batches, positions):
        loss, g = grad_fn(params, toks, pos)
        upd, state = tx.update(g, state, params)
        params = optax.apply_updates(params, upd)
        want.append(float(loss))

    parts = stream_rope(model)
    assert parts.embed_takes_positions and not parts.tied
    tr = Trainer(parts, tx, loss_chunk=20)
    got = [tr.step(Batch(t[:, :-1], t[:, 1:], positions=p)).loss for t, p in zip(batches, positions)]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    errs = group_errors(params, tr.params())
    assert max(errs.values()) <= 1e-5, errs
    tr.close()


# ------------------------------------------------------------------------------------------ errors


class _Lin(nnx.Module):
    def __init__(self, d, rngs, bias=True):
        self.l = nnx.Linear(d, d, use_bias=bias, rngs=rngs)

    def __call__(self, x):
        return x + self.l(x)


class _Model(nnx.Module):
    """Embed, a list of blocks, a norm and a tied head; knobs make it unstreamable in one way each."""

    def __init__(self, blocks=None, scale=1.0, extra=None, rngs=None):
        rngs = rngs or nnx.Rngs(0)
        self.emb = nnx.Embed(16, 8, rngs=rngs)
        self.blocks = nnx.List(blocks if blocks is not None else [_Lin(8, rngs) for _ in range(2)])
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.scale = scale
        if extra is not None:
            self.extra = extra

    def __call__(self, t):
        x = self.emb(t)
        for b in self.blocks:
            x = b(x)
        return self.emb.attend(self.norm(x)) * self.scale


def test_a_simple_tied_model_streams():
    parts = stream(_Model())
    assert parts.tied and parts.summary.startswith("embed=['emb'] blocks=blocks[2]")


def test_error_blocks_with_different_weight_structure():
    rngs = nnx.Rngs(0)
    with pytest.raises(UserError, match=r"blocks\[1\].*different weight structure"):
        stream(_Model(blocks=[_Lin(8, rngs), _Lin(8, rngs, bias=False)]))


class _Closure(nnx.Module):
    def __init__(self, w):
        self.fn = lambda x: x @ w  # the array is no attribute of the block: not in its state

    def __call__(self, x):
        return self.fn(x)


def test_error_block_closing_over_an_array():
    w = jnp.ones((8, 8))
    with pytest.raises(UserError, match=r"blocks\[0\].*not in its state"):
        stream(_Model(blocks=[_Closure(w), _Closure(w)]), check=False)


class _PlainArray(nnx.Module):
    def __init__(self):
        self.w = jnp.ones((8, 8))

    def __call__(self, x):
        return x @ self.w


def test_error_block_with_a_plain_array_attribute():
    with pytest.raises(UserError, match=r"blocks\[0\]\.w.*plain array attribute"):
        stream(_Model(blocks=[_PlainArray(), _PlainArray()]))


class _BN(nnx.Module):
    def __init__(self, rngs):
        self.bn = nnx.BatchNorm(8, rngs=rngs)

    def __call__(self, x):
        return self.bn(x)


def test_error_batch_statistics():
    rngs = nnx.Rngs(0)
    with pytest.raises(UserError, match=r"blocks\[0\]\.bn.*BatchStat"):
        stream(_Model(blocks=[_BN(rngs), _BN(rngs)]))


def test_error_which_list_is_the_blocks():
    rngs = nnx.Rngs(0)
    with pytest.raises(UserError, match="cannot tell which attribute holds the blocks"):
        stream(_Model(extra=nnx.List([_Lin(8, rngs)])))
    with pytest.raises(UserError, match="does not exist"):
        stream(_Model(), blocks="layers")


def test_error_head_that_is_not_norm_plus_projection():
    with pytest.raises(UserError, match="do not reproduce model"):
        stream(_Model(scale=3.0))


def test_error_parameters_outside_the_parts():
    rngs = nnx.Rngs(0)
    with pytest.raises(UserError, match="extra: holds parameters but belongs to neither"):
        stream(_Model(extra=nnx.Linear(8, 8, rngs=rngs)), head="norm")


class _Masked(nnx.Module):
    """Gives its blocks a mask computed from the token values (padding)."""

    def __init__(self):
        rngs = nnx.Rngs(0)
        self.emb = nnx.Embed(16, 8, rngs=rngs)
        self.blocks = nnx.List([_MaskBlock(), _MaskBlock()])

    def __call__(self, t):
        x = self.emb(t)
        mask = (t > 0)[..., None]
        for b in self.blocks:
            x = b(x, mask)
        return self.emb.attend(x)


class _MaskBlock(nnx.Module):
    def __init__(self):
        self.l = nnx.Linear(8, 8, rngs=nnx.Rngs(1))

    def __call__(self, x, mask):
        return x + jnp.where(mask, self.l(x), 0.0)


def test_error_block_input_that_depends_on_token_values():
    with pytest.raises(UserError, match="depends on the token values"):
        stream(_Masked())


class _EmbedDropout(_Model):
    def __init__(self):
        super().__init__()
        self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=0))

    def __call__(self, t):
        x = self.drop(self.emb(t))
        for b in self.blocks:
            x = b(x)
        return self.emb.attend(self.norm(x))


def test_error_dropout_outside_the_blocks():
    with pytest.raises(UserError, match="dropout outside the blocks"):
        stream(_EmbedDropout())


def test_error_linen_without_params_and_not_a_model():
    import flax.linen as nn

    with pytest.raises(UserError, match="needs its parameters"):
        stream(nn.Dense(3))
    with pytest.raises(UserError, match="neither an nnx.Module nor a linen.Module"):
        stream(object())


def test_error_linen_without_numbered_blocks():
    import flax.linen as nn

    class Flat(nn.Module):
        @nn.compact
        def __call__(self, t):
            x = nn.Embed(16, 8)(t)
            return nn.Dense(16, name="out")(x)

    m = Flat()
    p = m.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    with pytest.raises(UserError, match="calls no numbered submodules"):
        stream(m, params=p)
