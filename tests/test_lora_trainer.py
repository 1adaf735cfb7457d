"""LoRA through ``Trainer(model, tx, lora=...)`` for a user's own NNX model (issue 30): the streamed
adapters over a frozen base equal the same model with adapters trained in memory (plain jax + optax)."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from megatrain_jax import checkpoint as ck
from megatrain_jax.config.schema import LoraConfig
from megatrain_jax.lora_trainer import LoraRun
from megatrain_jax.models.lora import merge_adapters, split_adapters
from megatrain_jax.errors import UserError
from megatrain_jax.models.lora import LoraLinear, LoraParam, add_named_adapters, target_names
from megatrain_jax.trainer import Trainer

from tests._porting_model import RoPEDecoder, ce_mean, rotary

LORA = LoraConfig(rank=4, alpha=8.0, targets=["qkv", "out", "down"], base_dtype="float32")


def _kwargs(model):
    dim = model.tok.features // model.heads
    return dict(blocks="layers", embed="tok", head=["final_norm", "unembed"],
                embed_fn=lambda m, tokens, positions: m.tok(tokens),
                aux_fn=lambda positions, segment_ids=None: rotary(positions, dim),
                block_fn=lambda block, x, aux: block(x, *aux),
                head_fn=lambda m, h: (m.final_norm(h), m.unembed.kernel[...]))


def _reference(model, lora, seed, tx, clip, batches):
    """The model with the same adapters attached, trained in memory: jax.grad over the adapters only;
    with dropout, block i of step s reseeded with ``block_rng(seed, s, i, 0)`` (the engine's key)."""
    from megatrain_jax.templates import block_rng

    ref = nnx.clone(model)
    for i, blk in enumerate(ref.layers):
        add_named_adapters(blk, target_names(lora.targets), lora.rank, lora.scale, i, seed, lora.dropout)
    graph, ad, rest = nnx.split(ref, LoraParam, ...)
    ad, rest = nnx.to_pure_dict(ad), nnx.to_pure_dict(rest)
    full_tx = optax.chain(optax.clip_by_global_norm(clip), tx)
    state = full_tx.init(ad)

    @jax.jit
    def step(ad, state, toks, s):
        def loss(a):
            mdl = nnx.merge(graph, a, rest)
            if lora.dropout:
                for i, blk in enumerate(mdl.layers):
                    nnx.reseed(blk, dropout=block_rng(seed, s, i, 0))
            return ce_mean(mdl(toks[:, :-1]), toks[:, 1:])

        val, g = jax.value_and_grad(loss)(ad)
        upd, state = full_tx.update(g, state, ad)
        return optax.apply_updates(ad, upd), state, val, optax.global_norm(g)

    losses, norms = [], []
    for s, toks in enumerate(batches):
        ad, state, val, norm = step(ad, state, jnp.asarray(toks), jnp.asarray(s, jnp.uint32))
        losses.append(float(val))
        norms.append(float(norm))
    return losses, norms, ad


@pytest.mark.slow  # compiles the stream check, the LoRA engine and the reference (~15 s idle CPU)
@pytest.mark.parametrize("dropout,micro", [(0.0, 2), (0.3, 1)])
def test_trainer_lora_equals_in_memory(dropout, micro, base_dtype="float32"):
    """5 steps of ``Trainer(..., lora=)`` = the in-memory LoRA model (clipping triggers on every step,
    AdamW with weight decay): losses, norms and every adapter; the base is untouched."""
    model = RoPEDecoder(vocab=64, d=32, heads=2, layers=2, seed=0)
    before = jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    tx, clip = optax.adamw(3e-3, b1=0.9, b2=0.95, weight_decay=0.01), 0.02
    batches = [np.random.default_rng(s).integers(0, 64, (4, 17)) for s in range(5)]
    lora = LoraConfig(**{**vars(LORA), "base_dtype": base_dtype, "dropout": dropout})
    tr = Trainer(model, tx, lora=lora, clip_norm=clip, compute_dtype="float32", micro_batches=micro, loss_chunk=16,
                 seed=0, **_kwargs(model))
    assert tr.parts.blocks.takes_rng == (dropout > 0)
    assert isinstance(tr, Trainer) and isinstance(tr.run, LoraRun)
    got = [tr.step(b) for b in batches]
    losses, norms, ad = _reference(model, lora, 0, tx, clip, batches)
    for r, loss, norm in zip(got, losses, norms):
        assert norm > clip
        assert abs(r.loss - loss) <= 1e-5 * loss and abs(r.grad_norm - norm) <= 1e-4 * norm
    assert tr.step_count == 5
    mine = tr.adapters()
    for i in range(2):
        for (pa, a), (pb, b) in zip(jax.tree_util.tree_leaves_with_path(mine[i]),
                                    jax.tree_util.tree_leaves_with_path(ad["layers"][i])):
            assert pa == pb
            # every entry within 1e-5 (a wrong update moves one by up to lr = 3e-3) and the leaf within 1e-6 RMS: on
            # an AVX-512 host one entry of 128 (layer 0's qkv A, 2 micro-batches) ends 3.4e-6 away at -O3 (its
            # summation order rounds differently; AdamW's m/sqrt(v) is scale-free, so a tiny gradient's rounding
            # moves its update as much as a large one's would), the rest 1e-8..7e-7
            d = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
            assert d.max() <= 1e-5 and np.sqrt(np.mean(d ** 2)) <= 1e-6, (pa, d.max(), np.sqrt(np.mean(d ** 2)))
    # 3 targets per block, A (in, r) and B (r, out); B has moved off zero
    assert sorted(mine[0]) == ["down", "out", "qkv"] and np.abs(mine[0]["qkv"]["lora_b"]).max() > 0
    # the user's model is unchanged; update_model attaches the trained adapters and its logits follow
    after = jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    jax.tree.map(np.testing.assert_array_equal, before, after)
    assert not isinstance(model.layers[0].qkv, LoraLinear)
    tr.update_model(model)
    assert isinstance(model.layers[0].qkv, LoraLinear)
    graph, _, rest = nnx.split(model, LoraParam, ...)
    toks = jnp.asarray(batches[0][:, :-1])
    want = nnx.merge(graph, ad, rest)
    want.eval(), model.eval()  # adapter dropout off
    np.testing.assert_allclose(np.asarray(model(toks)), np.asarray(want(toks)), atol=1e-5)
    tr.close()


@pytest.mark.slow  # compiles the LoRA engine (the configuration of the test above: its kernels are cached)
def test_trainer_lora_save_restore_continues_exactly(tmp_path):
    """``save`` after 3 steps, 2 more steps; a new ``Trainer(..., lora=)`` that ``restore``s runs the same 2
    steps bit for bit (adapters, their AdamW state, the count: dropout keys continue). A corrupted newest
    checkpoint is moved aside for the one before it; other adapters are refused in one line."""
    model = RoPEDecoder(vocab=64, d=32, heads=2, layers=2, seed=0)
    tx = optax.adamw(3e-3, b1=0.9, b2=0.95, weight_decay=0.01)
    lora = LoraConfig(**{**vars(LORA), "dropout": 0.3})
    kw = dict(clip_norm=0.02, compute_dtype="float32", micro_batches=1, loss_chunk=16, seed=0, **_kwargs(model))
    batches = [np.random.default_rng(s).integers(0, 64, (4, 17)) for s in range(5)]
    tr = Trainer(model, tx, lora=lora, **kw)
    for b in batches[:2]:
        tr.step(b)
    first = tr.save(str(tmp_path))
    tr.step(batches[2])
    path = tr.save(str(tmp_path))
    assert os.path.basename(path) == ck.step_dirname(3) and os.path.basename(first) == ck.step_dirname(2)
    want = [tr.step(b).loss for b in batches[3:]]
    want_ad = tr.adapters()
    tr.close()

    again = Trainer(model, tx, lora=lora, **kw)
    state = again.restore(str(tmp_path))
    assert state["count"] == 3 and again.step_count == 3
    got = [again.step(b).loss for b in batches[3:]]
    assert got == want
    jax.tree.map(np.testing.assert_array_equal, again.adapters(), want_ad)
    again.close()

    with open(os.path.join(path, "adapters.npz"), "r+b") as f:  # the newest checkpoint corrupted
        f.seek(100)
        f.write(b"garbage")
    third = Trainer(model, tx, lora=lora, **kw)
    assert third.restore(str(tmp_path))["count"] == 2 and os.path.isdir(path + ".corrupt")
    other = Trainer(model, tx, lora=LoraConfig(**{**vars(lora), "rank": 2}), **kw)
    with pytest.raises(UserError) as e:
        other.restore(str(tmp_path))
    assert e.value.field == "lora" and "other adapters" in str(e.value)
    # nothing of a user's is replaced or pruned: an existing step, a directory with another run's checkpoint
    with pytest.raises(UserError, match="already exists"):
        third.save(str(tmp_path))  # third is at step 2: step_2 is there
    full = tmp_path / "full"
    (full / ck.step_dirname(7)).mkdir(parents=True)
    (full / ck.step_dirname(7) / ck.STATE).write_text('{"step": 7}')
    (full / ck.step_dirname(7) / ck.MANIFEST).write_text('{"files": {}}')
    with pytest.raises(UserError, match="not a checkpoint of Trainer"):
        other.save(str(full))
    with pytest.raises(UserError, match="not a checkpoint of Trainer"):
        other.restore(str(full))
    assert sorted(os.listdir(full / ck.step_dirname(7))) == [ck.MANIFEST, ck.STATE]
    with pytest.raises(UserError, match="no complete checkpoint"):
        other.restore(str(tmp_path / "empty"))
    with pytest.raises(UserError) as e:
        other.merged_params()  # an NNX model: update_model is its way
    assert e.value.field == "merged_params"
    other.close()
    third.close()


@pytest.mark.slow  # compiles the lm1b Linen decoder's stream check, the LoRA engine and the reference
def test_trainer_lora_on_a_linen_module_equals_merged_kernels_in_memory():
    """``Trainer(linen_module, tx, params=, lora=)`` on the lm1b-style Linen decoder, adapters on its
    attention's DenseGeneral (query, value, out: 3-D kernels) and the MLP's first Dense: 5 clipped AdamW
    steps equal jax.grad over the adapters of ``module.apply`` with each kernel replaced by
    ``kernel + scale * (A B)`` (an independent formulation); ``merged_params`` gives the same logits."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from lm1b_linen import TransformerConfig, build

    cfg = TransformerConfig(vocab_size=48, emb_dim=16, num_heads=2, num_layers=2, qkv_dim=16, mlp_dim=32,
                            max_len=12, dropout_rate=0.0, attention_dropout_rate=0.0, deterministic=True)
    module, params = build(cfg)
    lora = LoraConfig(rank=4, alpha=8.0, targets=["query", "value", "out", "Dense_0"], base_dtype="float32")
    tx, clip = optax.adamw(3e-3, b1=0.9, b2=0.95, weight_decay=0.01), 0.02
    tr = Trainer(module, tx, params=params, lora=lora, clip_norm=clip, compute_dtype="float32", micro_batches=2,
                 loss_chunk=16, seed=0)
    assert isinstance(tr, Trainer) and isinstance(tr.run, LoraRun)
    ad = {f"encoderdecoderblock_{i}": a for i, a in enumerate(tr.adapters())}
    assert sorted(jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(ad["encoderdecoderblock_0"])) \
        == sorted(f"['{m}']['{t}']['{leaf}']" for m, t in [("MlpBlock_0", "Dense_0")] +
                  [("MultiHeadDotProductAttention_0", n) for n in ("out", "query", "value")] for leaf in ("lora_a", "lora_b"))
    assert all(np.abs(x).max() == 0 for p, x in jax.tree_util.tree_leaves_with_path(ad) if "lora_b" in str(p))

    def merged(params, ad):
        def block(w, a):
            out = dict(w)
            for k, v in a.items():
                if "lora_a" in v:
                    kern = w[k]["kernel"]
                    out[k] = {**w[k], "kernel": kern + lora.scale * (v["lora_a"] @ v["lora_b"]).reshape(kern.shape)}
                else:
                    out[k] = block(w[k], v)
            return out
        dec = dict(params["decoder"])
        for name, a in ad.items():
            dec[name] = block(dec[name], a)
        return {**params, "decoder": dec}

    full_tx = optax.chain(optax.clip_by_global_norm(clip), tx)
    state = full_tx.init(ad)
    grad = jax.jit(jax.value_and_grad(lambda a, t: ce_mean(module.apply({"params": merged(params, a)}, t[:, :-1]),
                                                           t[:, 1:])))
    for s in range(5):
        toks = np.random.default_rng(s).integers(0, 48, (4, 13))
        res = tr.step(toks)
        loss, g = grad(ad, jnp.asarray(toks))
        assert optax.global_norm(g) > clip
        assert abs(res.loss - float(loss)) <= 1e-5 * float(loss), (s, res.loss, float(loss))
        upd, state = full_tx.update(g, state, ad)
        ad = optax.apply_updates(ad, upd)
    for i, mine in enumerate(tr.adapters()):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, np.asarray(b), atol=2e-6, rtol=0), mine,
                     ad[f"encoderdecoderblock_{i}"])
    toks = jnp.asarray(np.random.default_rng(9).integers(0, 48, (2, 12)))
    np.testing.assert_allclose(np.asarray(module.apply({"params": tr.merged_params()}, toks)),
                               np.asarray(module.apply({"params": merged(params, ad)}, toks)), atol=1e-5)
    jax.tree.map(np.testing.assert_array_equal, tr.params(), jax.tree.map(np.asarray, params))  # the base: frozen
    with pytest.raises(UserError) as e:
        tr.update_model(module)
    assert e.value.field == "update_model"
    tr.close()
    for kw, field in [(dict(lora=LoraConfig(rank=4, targets=["nope"])), "lora.targets"),
                      (dict(lora=LoraConfig(rank=4, dropout=0.1, targets=["query"])), "lora.dropout")]:
        with pytest.raises(UserError) as e:
            Trainer(module, tx, params=params, **kw)
        assert e.value.field == field
    with pytest.raises(UserError) as e:
        Trainer(module, tx, lora=lora)
    assert e.value.field == "params"


def test_split_merge_adapters_round_trip():
    tree = {"attn": {"q": {"kernel": 1, "lora_a": 2, "lora_b": 3}, "norm": {"scale": 4}}, "w": 5}
    ad, rest = split_adapters(tree)
    assert ad == {"attn": {"q": {"lora_a": 2, "lora_b": 3}}}
    assert rest == {"attn": {"q": {"kernel": 1}, "norm": {"scale": 4}}, "w": 5}
    assert merge_adapters(ad, rest) == tree


@pytest.mark.parametrize("lora,field", [
    (dict(rank=4, targets=["nope"]), "lora.targets"), (dict(rank=0, targets=["qkv"]), "lora.rank"),
    (dict(rank=4, dropout=1.5, targets=["qkv"]), "lora.dropout"), (dict(rank=4, bogus=1), "model.lora.bogus")])
def test_trainer_lora_errors(lora, field):
    model = RoPEDecoder(vocab=64, d=32, heads=2, layers=2, seed=0)
    with pytest.raises(UserError) as e:
        Trainer(model, optax.adamw(1e-3), lora=lora, **_kwargs(model))
    assert e.value.field == field




@pytest.mark.slow  # compiles the LoRA engine and the reference (~10 s idle CPU)
def test_trainer_lora_on_a_registry_model():
    """``Trainer(Decoder, tx, lora=)``: a registry model's own LoRA blocks (q .. down, as model.lora), 4
    clipped steps = the in-memory ``lora_decoder`` trained with jax.grad over its adapters."""
    import dataclasses

    from megatrain_jax.models.common import Decoder
    from megatrain_jax.models.lora import LoraRng, lora_decoder

    from tests.test_lora import tiny

    cfg = tiny("qwen2", layers=2)
    base = Decoder(dataclasses.replace(cfg, lora=None), 0)
    tx, clip = optax.adamw(3e-3, weight_decay=0.01), 0.02
    tr = Trainer(base, tx, lora=dataclasses.replace(cfg.lora, base_dtype="float32"), clip_norm=clip,
                 compute_dtype="float32", loss_chunk=16, seed=0)
    graph, ad, rngs, rest = nnx.split(lora_decoder(cfg, 0), LoraParam, LoraRng, ...)
    ad, rest = nnx.to_pure_dict(ad), nnx.to_pure_dict(rest)
    full_tx = optax.chain(optax.clip_by_global_norm(clip), tx)
    state = full_tx.init(ad)
    grad = jax.jit(jax.value_and_grad(lambda a, t: ce_mean(nnx.merge(graph, a, rngs, rest)(t[:, :-1]), t[:, 1:])))
    for s in range(4):
        toks = np.random.default_rng(s).integers(0, 64, (4, 17))
        res = tr.step(toks)
        loss, g = grad(ad, jnp.asarray(toks))
        assert optax.global_norm(g) > clip and abs(res.loss - float(loss)) <= 1e-5 * float(loss)
        upd, state = full_tx.update(g, state, ad)
        ad = optax.apply_updates(ad, upd)
    for i, mine in enumerate(tr.adapters()):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, np.asarray(b), atol=2e-6, rtol=0), mine,
                     ad["layers"][i])
    tr.update_model(base)
    assert isinstance(base.layers[0].self_attn.q_proj, LoraLinear)
    toks = jnp.asarray(np.random.default_rng(9).integers(0, 64, (2, 8)))
    np.testing.assert_allclose(np.asarray(base(toks)), np.asarray(nnx.merge(graph, ad, rngs, rest)(toks)), atol=1e-5)
    tr.close()
