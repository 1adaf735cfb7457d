"""Muon (optim/muon.py): the blocks' matrices get Newton-Schulz, the embedding, head, norms and biases AdamW;
in fp32 it equals ``optax.contrib.muon`` given the same labels; in bf16 a group's update equals the same
leaves' update in the whole-model transformation (what the streamed engine and the reference trainer
run); the plan counts its matmuls in the step."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import muon as optax_muon

from megatrain_jax.config import Config, DataConfig, ModelConfig, OptimConfig, TrainConfig
from megatrain_jax.errors import UserError
from megatrain_jax.models import init_model, streamed_parts
from megatrain_jax.optim.muon import labels, muon, muon_dims, newton_schulz_flops

MODEL = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96)


def _model_tree():
    from flax import nnx

    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(init_model(MODEL, 0))))


def _grads(tree, seed):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: (rng.standard_normal(x.shape) * 0.1).astype(np.float32), tree)


def _run(tx, params, steps=3, grads=None):
    state = tx.init(params)
    for i in range(steps):
        u, state = tx.update(_grads(params, i) if grads is None else grads[i], state, params)
        params = optax.apply_updates(params, u)
    return params, state


def _groups(whole):
    return {"embed": whole["embed"], "head": whole["head"], **{f"block_{i}": t for i, t in whole["layers"].items()}}


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_labels_give_the_embedding_head_and_vectors_to_adamw():
    whole = _model_tree()
    lab = labels(whole)
    assert lab["embed"]["embedding"] == "adam" and lab["head"]["lm_head"] == "adam"
    assert lab["head"]["norm"]["scale"] == "adam"
    block = lab["layers"][0]
    assert block["mlp"]["up_proj"]["kernel"] == block["self_attn"]["q_proj"]["kernel"] == "muon"
    assert block["input_layernorm"]["scale"] == "adam"
    # a group's pytree labels each leaf as the whole model does (by name, not by position)
    groups = streamed_parts(init_model(MODEL, 0)).host_trees()
    assert labels(groups["embed"]) == lab["embed"] and labels(groups["head"]) == lab["head"]
    assert labels(groups["block_1"]) == lab["layers"][1]
    # expert stacks (E, in, out) are a batch of matrices
    assert muon_dims({"experts": {"up_proj": np.zeros((4, 8, 16))}})["experts"]["up_proj"].reduction_axis == 1


def test_fp32_equals_optax_contrib_muon_with_the_same_labels():
    params = _model_tree()
    kw = dict(ns_steps=4, beta=0.9, weight_decay=0.01, adam_b2=0.99, adam_weight_decay=0.01)
    want, ws = _run(optax_muon(2e-2, muon_weight_dimension_numbers=muon_dims, **kw), params)
    got, gs = _run(muon(2e-2, ns_dtype=jnp.float32, **kw), params)
    assert jax.tree.structure(gs) == jax.tree.structure(ws)  # the same state: checkpoints alike
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert _rel(a, b) < 1e-6


def test_bf16_group_updates_equal_the_whole_model_update():
    """What the engine runs per group (each group's pytree alone) equals the whole-model transformation
    (the reference trainer's), leaf for leaf, with the iterations in bf16."""
    whole = _model_tree()
    tx = muon(2e-2, ns_steps=5, adam_learning_rate=3e-3)
    grads = [_grads(whole, i) for i in range(3)]
    got_whole, _ = _run(tx, whole, grads=grads)
    ref = _groups(got_whole)
    for name, tree in _groups(whole).items():
        got, _ = _run(tx, tree, grads=[_groups(g)[name] for g in grads])
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref[name]), strict=True):
            assert _rel(a, b) < 1e-6, name
    # and bf16 is near fp32 (Keller Jordan's Muon iterates in bf16)
    f32, _ = _run(muon(2e-2, ns_steps=5, adam_learning_rate=3e-3, ns_dtype=jnp.float32), whole, grads=grads)
    assert max(_rel(a, b) for a, b in zip(jax.tree.leaves(got_whole), jax.tree.leaves(f32))) < 3e-2


def test_adam_lr_reaches_the_adamw_part_only():
    params = {"w": np.ones((16, 24), np.float32), "b": np.ones(24, np.float32)}
    g = jax.tree.map(lambda x: np.full(x.shape, 0.5, np.float32), params)
    u1, _ = muon(1e-2, adam_learning_rate=1e-3).update(g, muon(1e-2).init(params), params)
    u2, _ = muon(1e-2).update(g, muon(1e-2).init(params), params)
    np.testing.assert_allclose(np.asarray(u1["b"]) * 10, np.asarray(u2["b"]), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(u1["w"]), np.asarray(u2["w"]))


def test_newton_schulz_flops():
    # X (m x n), m <= n: per iteration X X^T 2m^2n, A A 2m^3, B X 2m^2n
    assert newton_schulz_flops((3072, 8192), 5) == 5 * (4 * 3072 ** 2 * 8192 + 2 * 3072 ** 3)
    assert newton_schulz_flops((8192, 3072), 5) == newton_schulz_flops((3072, 8192), 5)
    assert newton_schulz_flops((64,), 5) == 0.0


def test_the_plan_counts_the_newton_schulz_matmuls_in_the_step():
    from megatrain_jax.optim.costs import update_cost

    cfg = OptimConfig(name="muon", kernel="optax", lr=0.02)
    trees = streamed_parts(jax.eval_shape(lambda: init_model(MODEL, 0))).host_trees()
    cost = update_cost(cfg, trees, 10)
    dims = {k: muon_dims(t) for k, t in trees.items()}
    want = sum(newton_schulz_flops(x.shape, 5) for k, t in trees.items()
               for x, d in zip(jax.tree.leaves(t), jax.tree.leaves(dims[k], is_leaf=lambda d: d is None))
               if d is not None)
    assert want <= cost.device_flops <= 1.3 * want  # the matmuls, plus the elementwise updates
    assert cost.matmul_dtype == "bfloat16"
    f32 = update_cost(dataclasses.replace(cfg, ns_dtype="float32"), trees, 10)
    assert f32.matmul_dtype == "float32"
    lion = update_cost(OptimConfig(name="lion", kernel="optax"), trees, 10)
    assert lion.device_flops < 0.05 * cost.device_flops


@pytest.mark.parametrize("field,value", [("adam_lr", 0.0), ("adam_lr", "fast"), ("ns_dtype", "float16")])
def test_bad_muon_fields_are_refused_in_one_line(field, value):
    from megatrain_jax.config import validate

    cfg = Config(model=MODEL, optim=OptimConfig(name="muon", kernel="optax", **{field: value}),
                 data=DataConfig(seq_len=32), train=TrainConfig(steps=5))
    with pytest.raises(UserError) as e:
        validate(cfg)
    assert e.value.field == f"optim.{field}" and "\n" not in str(e.value)
