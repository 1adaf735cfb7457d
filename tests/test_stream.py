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


# --------------------------------------------------------------------------- dropout in Linen blocks


def _lm1b(rate=0.3, deterministic=False, layers=2):
    from lm1b_linen import TransformerConfig, build

    cfg = TransformerConfig(vocab_size=48, emb_dim=16, num_heads=2, num_layers=layers, qkv_dim=16, mlp_dim=32,
                            max_len=12, dropout_rate=rate, attention_dropout_rate=rate, deterministic=deterministic)
    return cfg, *build(cfg)


def _apply_with_block_keys(module, p, tokens, keys):
    """``module.apply`` (the whole lm1b model) in which block ``i`` draws its ``dropout`` stream from
    ``keys[i]``: the block applied on its own with ``rngs={"dropout": keys[i]}``, as the engine does."""
    import flax.linen as nn

    def icpt(next_fun, args, kwargs, ctx):
        path = ctx.module.path
        if ctx.method_name == "__call__" and len(path) == 2 and path[1].startswith("encoderdecoderblock_"):
            i = int(path[1].rsplit("_", 1)[1])
            return ctx.module.clone(parent=None).apply({"params": p["decoder"][path[1]]}, *args,
                                                       rngs={"dropout": keys[i]}, **kwargs)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(icpt):
        return module.apply({"params": p}, tokens)


def test_linen_dropout_streamed_equals_plain_run_with_the_same_keys():
    """The lm1b-style Linen decoder with dropout 0.3 (residual, MLP and attention weights), 2
    micro-batches, 3 steps of adamw: equal to whole-model jax.grad of ``module.apply`` in which
    block i of micro-batch m at step s draws ``dropout`` from block_rng(seed, s, i, m)."""
    cfg, module, params = _lm1b()
    seed, M, steps, L = 7, 2, 3, cfg.num_layers
    tx = optax.adamw(3e-3, b1=0.9, b2=0.95, weight_decay=0.1)
    batches = _toks(cfg.vocab_size, steps)

    def loss_fn(p, toks, step):
        total, b = 0.0, toks.shape[0]
        for m in range(M):
            part = toks[m * b // M:(m + 1) * b // M]
            keys = [block_rng(seed, step, i, m) for i in range(L)]
            logits = _apply_with_block_keys(module, p, part[:, :-1], keys)
            total = total + ce_mean(logits, part[:, 1:]) * part[:, 1:].size
        return total / toks[:, 1:].size

    p, state, want = params, tx.init(params), []
    grad_fn = jax.jit(jax.value_and_grad(loss_fn))
    for step, toks in enumerate(batches):
        loss, g = grad_fn(p, jnp.asarray(toks), jnp.asarray(step, jnp.uint32))
        upd, state = tx.update(g, state, p)
        p = optax.apply_updates(p, upd)
        want.append(float(loss))
    # the masks matter: the same run without dropout has other losses
    plain0 = float(jax.jit(lambda q, t: ce_mean(module.apply({"params": q}, t[:, :-1], rngs={"dropout": jax.random.key(0)}),
                                                t[:, 1:]))(params, jnp.asarray(batches[0])))
    assert abs(plain0 - want[0]) > 1e-3

    tr = Trainer(module, tx, params=params, micro_batches=M, seed=seed, loss_chunk=20)  # with stream()'s check
    assert tr.parts.blocks.takes_rng and "(dropout keys)" in tr.parts.summary
    got = [tr.step(t).loss for t in batches]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    errs = group_errors(p, tr.params())
    assert max(errs.values()) <= 1e-5, errs
    tr.close()


def test_linen_dropout_recompute_sees_the_forward_mask():
    """The engine's block backward (a recompute from the saved input, then the VJP) gives the
    gradients of one forward of the block with that layer's key: the mask of the forward."""
    from lm1b_linen import EncoderDecoder1DBlock

    cfg, module, params = _lm1b()
    seed, M = 3, 2
    tr = Trainer(module, optax.sgd(0.1), params=params, micro_batches=M, seed=seed, loss_chunk=20, check=False)
    eng, fwd, bwd = tr.engine, {}, []
    real_fwd, real_bwd = eng.kernels.block_fwd, eng.kernels.block_bwd

    def rec_fwd(i, w, h, aux, rng, *rest):
        out = real_fwd(i, w, h, aux, rng, *rest)
        fwd[(i, len([k for k in fwd if k[0] == i]))] = (rng, np.array(h), np.array(out))
        return out

    def rec_bwd(i, w, h, aux, rng, dh, g, *rest):
        args = (np.array(w), np.array(h), [np.array(a) for a in aux], rng, np.array(dh), np.array(g))
        dh_in, g_out = real_bwd(i, w, h, aux, rng, dh, g, *rest)
        bwd.append((i, args, np.array(dh_in), np.array(g_out)))
        return dh_in, g_out

    eng.kernels.block_fwd, eng.kernels.block_bwd = rec_fwd, rec_bwd
    tr.step(_toks(cfg.vocab_size, 1)[0])
    assert len(bwd) == cfg.num_layers * M
    block = EncoderDecoder1DBlock(config=cfg)
    for n, (i, (w, h, aux, rng, dh, g_in), dh_in, g_out) in enumerate(bwd):
        m = n % M
        f_rng, f_h, f_out = fwd[(i, m)]
        want_key = jax.random.key_data(block_rng(seed, 0, i, m))
        np.testing.assert_array_equal(jax.random.key_data(rng), want_key)
        np.testing.assert_array_equal(jax.random.key_data(f_rng), want_key)
        np.testing.assert_array_equal(f_h, h)  # the saved input the backward recomputes from
        lay = eng.store[f"block_{i}"].layout

        def one(tree, x, key):
            return block.apply({"params": tree}, x, decoder_mask=aux[0], rngs={"dropout": key})

        out, vjp = jax.vjp(lambda t, x: one(t, x, block_rng(seed, 0, i, m)), lay.unflatten(w), h)
        np.testing.assert_allclose(f_out, out, rtol=1e-6, atol=1e-6)  # the forward's mask is this key's
        dtree, dx = vjp(dh)
        dw = np.zeros(lay.size, np.float32)
        lay.flatten_into(dtree, dw)
        np.testing.assert_allclose(dh_in, dx, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g_out - g_in, dw, rtol=1e-4, atol=1e-6)
        # another key's mask gives other gradients: the comparison has teeth
        _, vjp2 = jax.vjp(lambda x: one(lay.unflatten(w), x, block_rng(seed, 0, i, m + 1)), h)
        assert np.max(np.abs(vjp2(dh)[0] - dx)) > 1e-3 * np.max(np.abs(dx))
    tr.close()


def test_linen_dropout_off_is_unchanged():
    """Rate 0, or rate 0.3 with deterministic=True: no keys (the template takes no rng) and the same
    training as before, to the bit."""
    runs = []
    for rate, det in ((0.0, False), (0.3, True)):
        cfg, module, params = _lm1b(rate, det)
        tr = Trainer(module, optax.sgd(0.5), params=params, micro_batches=2, loss_chunk=20)
        assert not tr.parts.blocks.takes_rng and "dropout" not in tr.parts.summary
        runs.append(([tr.step(t).loss for t in _toks(cfg.vocab_size, 2)], tr.params()))
        tr.close()
    assert runs[0][0] == runs[1][0]
    jax.tree.map(np.testing.assert_array_equal, runs[0][1], runs[1][1])


def test_errors_linen_dropout_outside_the_blocks_and_the_check_with_dropout_on():
    """Dropout after the embedding is refused; with dropout on in the blocks, stream()'s check still
    compares the parts with the model (each block given the same key) and refuses a scaled head."""
    import flax.linen as nn

    class Blk(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + nn.Dropout(0.5, deterministic=False)(nn.Dense(8)(x))

    class Model(nn.Module):
        emb_drop: float = 0.0
        scale: float = 1.0

        @nn.compact
        def __call__(self, t):
            emb = nn.Embed(16, 8)
            x = nn.Dropout(self.emb_drop, deterministic=False)(emb(t))
            for i in range(2):
                x = Blk(name=f"block_{i}")(x)
            return emb.attend(nn.LayerNorm()(x)) * self.scale

    def params(m):
        return m.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]

    parts = stream(Model(), params=params(Model()))
    assert parts.blocks.takes_rng and parts.tied
    with pytest.raises(UserError, match=r"embed: draws random numbers .*dropout outside the blocks"):
        stream(Model(emb_drop=0.5), params=params(Model()))
    with pytest.raises(UserError, match="do not reproduce model"):
        stream(Model(scale=3.0), params=params(Model()))


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


def test_gpt2_example_fused_optimizer_equals_its_optax_path():
    """The GPT-2 example's two optimizers (``--optimizer fused``: OptimConfig, the numba AdamW host
    kernel; ``optax``: optax.adamw per group), both with clipping 1.0 and dropout 0.1, 3 steps:
    losses and weights within 1e-5 (the fused kernel is optax's AdamW arithmetic)."""
    from gpt2_nnx import GPT2Config, build_model, optimizer

    from megatrain_jax.optim import FusedAdamW, OptaxHostOptimizer

    cfg = GPT2Config(vocab_size=48, block_size=12, n_layer=2, n_head=2, n_embd=16, dropout=0.1)
    batches = _toks(cfg.vocab_size, 3)
    runs = {}
    for kind, cls in (("fused", FusedAdamW), ("optax", OptaxHostOptimizer)):
        opt, clip = optimizer(kind, 3e-3)
        tr = Trainer(build_model(cfg), opt, clip_norm=clip, micro_batches=2, loss_chunk=20, check=False)
        assert isinstance(tr.opt, cls) and tr.engine.clip_norm == 1.0
        runs[kind] = ([tr.step(t).loss for t in batches], tr.params())
        tr.close()
    np.testing.assert_allclose(runs["fused"][0], runs["optax"][0], rtol=1e-5)
    errs = group_errors(runs["optax"][1], runs["fused"][1])
    assert max(errs.values()) <= 1e-5, errs


def test_the_three_spellings_of_stream(cli_env):
    """Issue 26 item 13: ``megatrain_jax.stream(model)`` (the README's), ``from megatrain_jax import
    stream; stream(model)`` and ``megatrain_jax.stream.stream(model)`` are one function; in a fresh
    interpreter the first works without importing the subpackage first."""
    import subprocess

    import megatrain_jax
    from gpt2_nnx import GPT2Config, build_model
    from megatrain_jax import stream as pkg

    cfg = GPT2Config(vocab_size=48, block_size=12, n_layer=2, n_head=2, n_embd=16, dropout=0.0)
    model = build_model(cfg)
    got = [megatrain_jax.stream(model), pkg(model), megatrain_jax.stream.stream(model)]
    assert got[0].summary == got[1].summary == got[2].summary and len(got[0].blocks.weights) == 2
    assert megatrain_jax.stream.stream is stream and callable(megatrain_jax.stream)
    code = ("import megatrain_jax, sys; assert 'megatrain_jax.stream' not in sys.modules; "
            "s = megatrain_jax.stream; from megatrain_jax import stream; "
            "assert callable(s) and stream is s and s.stream.__name__ == 'stream'; print('ok')")
    p = subprocess.run([sys.executable, "-c", code], env=cli_env, capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-2000:]
