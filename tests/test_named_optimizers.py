"""Named optimizers (``optim.name``): each streamed run equals the same optax transformation in the
reference trainer (fp32, 5 steps, clipping that triggers), resumes bit-exactly from a checkpoint, and
refuses a checkpoint of another optimizer and every bad field in one line."""
from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
import optax
import pytest

from megatrain_jax.config import (OPTIMIZER_FIELDS, Config, DataConfig, ModelConfig, OptimConfig, ScheduleConfig,
                                  TrainConfig, validate)
from megatrain_jax.engine import Batch
from megatrain_jax.errors import UserError
from megatrain_jax.models import init_model, streamed_parts
from megatrain_jax.optim import (NamedOptaxOptimizer, build_host_optimizer, build_reference_tx, model_state_bytes,
                                 state_bytes, state_bytes_per_param)
from megatrain_jax.reference import ReferenceTrainer
from megatrain_jax.trainer import Trainer

STEPS, CLIP = 5, 0.5
MODEL = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96)
# name -> (lr, the optimizer's own fields): values away from the defaults, so that each is passed through
NAMED = {
    "adamw": (3e-3, dict(b1=0.85, b2=0.99, eps=1e-7)),
    "lion": (3e-4, dict(b1=0.85, b2=0.98)),
    "adafactor": (1e-2, dict(min_dim_size_to_factor=32, decay_rate=0.75, momentum=0.9)),  # 64 x 96 matrices factor
    "sgd": (0.05, dict(momentum=0.9, nesterov=True)),
    "muon": (2e-2, dict(momentum=0.9, ns_steps=4, b2=0.99, ns_dtype="float32", adam_lr=3e-3)),  # bf16: tests/test_muon.py
    "optax": (3e-3, dict(optax_name="lamb", optax_kwargs={"b2": 0.99})),  # layer-wise trust ratio: per leaf
}


def _cfg(name: str, **over) -> Config:
    lr, fields = NAMED[name]
    optim = OptimConfig(name=name, kernel="optax", lr=lr, weight_decay=0.01, clip_norm=CLIP,
                        schedule=ScheduleConfig(kind="warmup_cosine", warmup_steps=2), **{**fields, **over})
    cfg = Config(model=MODEL, optim=optim, data=DataConfig(seq_len=32),
                 train=TrainConfig(steps=STEPS, batch_size=4, compute_dtype="float32", loss_chunk=48))
    validate(cfg)
    return cfg


def _batches():
    rng = np.random.default_rng(1)
    out = []
    for _ in range(STEPS):
        toks = rng.integers(0, MODEL.vocab_size, (4, 33))
        out.append(Batch(toks[:, :-1], toks[:, 1:], (rng.random((4, 32)) > 0.2).astype(np.float32)))
    return out


def _group_rel_errors(ref_tree, store):
    """‖Δ‖/‖ref‖ over each streamed group (as test_engine.py)."""
    groups = {"embed": ref_tree["embed"], "head": ref_tree["head"]}
    groups.update({f"block_{i}": t for i, t in ref_tree["layers"].items()})
    errs = {}
    for name, tree in groups.items():
        a = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(tree)])
        errs[name] = float(np.linalg.norm(a - store[name].master) / np.linalg.norm(a))
    return errs


def _state(trainer) -> dict[str, dict[str, np.ndarray]]:
    return {g.name: {"master": g.master.copy(), **{k: np.array(v) for k, v in trainer.opt.state_to_arrays(g.opt_state).items()}}
            for g in trainer.store}


DEVICE_NAMED = ["adamw", "lion", "adafactor", "sgd", "muon"]  # those with update_on=device (test_device_optax.py)


def _on_device(cfg: Config) -> Config:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, update_on="device"))


def _resumed_equals(cfg: Config, ckpt: str, straight: dict, batches) -> None:
    """Resumed from step 3: steps 4 and 5 again equal ``straight`` bit for bit (weights and every state array)."""
    resumed, _, state = Trainer.resume(cfg, ckpt, log=lambda _: None)
    assert state["count"] == 3
    with resumed:
        for batch in batches[3:]:
            resumed.step(batch)
    again = _state(resumed)
    assert again.keys() == straight.keys()
    for g in straight:
        assert again[g].keys() == straight[g].keys()
        for k in straight[g]:
            assert np.array_equal(again[g][k], straight[g][k]), (g, k)


@pytest.mark.parametrize("name", list(NAMED))
def test_streamed_equals_optax_reference_and_resumes_bit_exactly(name, tmp_path):
    """The host update and, for DEVICE_NAMED, the device-side update (``train.update_on=device``: each group's state
    crossing as flat buffers, written back in place; issue 44's test_device_optax case, merged here so that both
    trainers step beside one reference run) each equal the reference and resume bit-exactly."""
    cfg = _cfg(name)
    batches = _batches()
    ref = ReferenceTrainer.from_config(cfg)
    trainers = {"host": Trainer.from_config(cfg)}
    if name in DEVICE_NAMED:
        trainers["device"] = Trainer.from_config(_on_device(cfg))
        assert trainers["device"].engine.updates.on_device
    tr = trainers["host"]
    assert isinstance(tr.opt, NamedOptaxOptimizer) and tr.opt.label == ("optax.lamb" if name == "optax" else name)
    for where, t in trainers.items():
        os.makedirs(tmp_path / where)
    for i, batch in enumerate(batches, start=1):
        r = ref.step(batch)
        assert r.grad_norm > CLIP, "clipping must trigger"
        for where, t in trainers.items():
            s = t.step(batch)
            assert abs(r.loss - s.loss) <= 1e-5 * abs(r.loss), (where, i, r.loss, s.loss)
            assert where == "device" or not s.skipped
            if i == 3:
                t.save(str(tmp_path / where))
    assert tr.lr_at(5) == pytest.approx(float(ref.lr_at(5)))
    straight = {}
    for where, t in trainers.items():
        t.close()
        errs = _group_rel_errors(ref.params_tree(), t.store)
        assert max(errs.values()) < 1e-5, (where, errs)
        straight[where] = _state(t)
    moved = np.linalg.norm(np.asarray(init_model(MODEL, 0).layers[0].mlp.up_proj.kernel[...])
                           - tr.store["block_0"].tree()["mlp"]["up_proj"]["kernel"])
    assert moved > 1e-3, "the run must move the weights, or equality proves nothing"
    assert all(k.startswith(tr.opt.label + "/") for k in straight["host"]["block_0"] if k != "master")

    # resumed from step 3: steps 4 and 5 again, bit for bit (weights and every state array)
    _resumed_equals(cfg, str(tmp_path / "host"), straight["host"], batches)
    if "device" in trainers:
        _resumed_equals(_on_device(cfg), str(tmp_path / "device"), straight["device"], batches)

    # resuming with another optimizer is refused in one line naming both
    other = "lion" if name != "lion" else "sgd"
    with pytest.raises(UserError) as e:
        Trainer.resume(_cfg(other), str(tmp_path / "host"), log=lambda _: None)
    msg = str(e.value)
    assert e.value.field == "optim" and "\n" not in msg and other in msg, msg
    assert (tr.opt.label in msg), msg


def test_a_fused_adamw_checkpoint_is_refused_by_a_named_optimizer(tmp_path):
    cfg = _cfg("adamw")
    fused = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, kernel="fused"))
    with Trainer.from_config(fused) as tr:
        tr.step(_batches()[0])
        tr.save(str(tmp_path))
    with pytest.raises(UserError) as e:
        Trainer.resume(_cfg("muon"), str(tmp_path), log=lambda _: None)
    assert e.value.field == "optim" and "\n" not in str(e.value) and "muon" in str(e.value)


@pytest.mark.parametrize("name", ["adafactor", "muon"])
def test_shape_aware_updates_need_the_groups_pytree(name):
    opt = build_host_optimizer(_cfg(name).optim, STEPS)
    flat = np.zeros(64 * 96, np.float32)
    with pytest.raises(ValueError, match="shape"):
        opt.init_state(flat)


def test_state_bytes_per_param_from_eval_shape():
    """Bytes per parameter of one block's state, from ``jax.eval_shape`` of ``init`` (nothing allocated)."""
    block = jax.eval_shape(lambda: streamed_parts(init_model(MODEL, 0)).host_trees()["block_0"])
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(block))
    per = {name: state_bytes_per_param(_cfg(name).optim, block, STEPS) for name in NAMED}
    assert per["adamw"] == pytest.approx(8.0, abs=1e-3) and per["optax"] == pytest.approx(8.0, abs=1e-3)
    assert per["lion"] == pytest.approx(4.0, abs=1e-3) and per["sgd"] == pytest.approx(4.0, abs=1e-3)
    assert per["muon"] == pytest.approx(4.0, abs=0.1)  # one momentum; the norms' scales take Adam's two
    assert per["adafactor"] < 4.5  # momentum (4) + a factored second moment (rows + columns)
    no_momentum = state_bytes_per_param(_cfg("adafactor", momentum=None).optim, block, STEPS)
    assert no_momentum < 0.2
    sgd_plain = _cfg("sgd", momentum=None, nesterov=None)
    assert state_bytes_per_param(sgd_plain.optim, block, STEPS) < 1e-3
    # the fused kernels' own formats
    fused = OptimConfig()
    assert state_bytes_per_param(fused, block) == 8.0
    int8 = state_bytes(OptimConfig(moments="int8"), block)
    assert int8["uint8"] == 2 * n and 0 < int8["float32"] < 0.01 * n
    by_dtype = state_bytes(_cfg("muon").optim, block, STEPS)
    assert set(by_dtype) == {"float32", "int32"}
    # the whole model, as the plan would count it: every group, from the abstract model
    from megatrain_jax.models.common import abstract_model

    trees = streamed_parts(abstract_model(MODEL)).host_trees()
    for name in ("adafactor", "muon"):
        o = _cfg(name).optim
        want = sum(sum(state_bytes(o, t, STEPS).values()) for t in trees.values())
        assert model_state_bytes(o, trees, STEPS) == want > 0


# ---------------------------------------------------------------------------------- bad fields


def _refused(field: str, **optim) -> str:
    cfg = Config(model=MODEL, optim=OptimConfig(**optim), data=DataConfig(seq_len=32), train=TrainConfig(steps=5))
    with pytest.raises(UserError) as e:
        validate(cfg)
    assert e.value.field == field, str(e.value)
    assert "\n" not in str(e.value) and e.value.fix
    return str(e.value)


BAD = [
    # (field, optim fields)
    ("optim.name", dict(name="adam", kernel="optax")),
    ("optim.kernel", dict(name="lion", kernel="fused")),  # fused is AdamW's (auto takes optax)
    ("optim.kernel", dict(name="muon", kernel="numba")),
    ("optim.moments", dict(name="lion", kernel="optax", moments="bfloat16")),
    ("optim.moments", dict(name="sgd", kernel="optax", moments="int8")),  # int8: AdamW (fused) and Lion only
    ("optim.moments", dict(name="muon", kernel="optax", moments="int8")),
    ("optim.kernel", dict(name="lion", kernel="fused", moments="int8")),  # int8 Lion is an optax transformation
    ("optim.b1", dict(name="lion", kernel="optax", b1=1.0)),
    ("optim.b2", dict(name="muon", kernel="optax", b2=-0.1)),
    ("optim.eps", dict(name="adafactor", kernel="optax", eps=0.0)),
    ("optim.momentum", dict(name="sgd", kernel="optax", momentum=1.5)),
    ("optim.momentum", dict(name="muon", kernel="optax", momentum=float("nan"))),
    ("optim.decay_rate", dict(name="adafactor", kernel="optax", decay_rate=0.0)),
    ("optim.ns_steps", dict(name="muon", kernel="optax", ns_steps=0)),
    ("optim.ns_steps", dict(name="muon", kernel="optax", ns_steps=2.5)),
    ("optim.min_dim_size_to_factor", dict(name="adafactor", kernel="optax", min_dim_size_to_factor=-1)),
    ("optim.factored", dict(name="adafactor", kernel="optax", factored="yes please")),
    ("optim.nesterov", dict(name="sgd", kernel="optax", nesterov=True)),  # without momentum
    ("optim.optax_name", dict(name="optax", kernel="optax")),
    ("optim.optax_name", dict(name="optax", kernel="optax", optax_name="nope")),
    ("optim.optax_name", dict(name="optax", kernel="optax", optax_name="clip_by_global_norm")),
    ("optim.optax_name", dict(name="optax", kernel="optax", optax_name="GradientTransformation")),
    ("optim.weight_decay", dict(name="optax", kernel="optax", optax_name="adabelief", weight_decay=0.1)),
    ("optim.optax_kwargs", dict(name="optax", kernel="optax", optax_name="lamb", optax_kwargs=[1])),
    ("optim.optax_kwargs.b3", dict(name="optax", kernel="optax", optax_name="lamb", optax_kwargs={"b3": 0.9})),
    ("optim.optax_kwargs.learning_rate", dict(name="optax", kernel="optax", optax_name="lamb",
                                              optax_kwargs={"learning_rate": 0.1})),
]


@pytest.mark.parametrize("field,optim", BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD)])
def test_a_bad_field_is_refused_in_one_line(field, optim):
    _refused(field, **optim)


@pytest.mark.parametrize("name", list(OPTIMIZER_FIELDS))
def test_a_field_of_another_optimizer_is_refused(name):
    """Every optimizer-specific field given to an optimizer that does not use it names itself and the
    optimizers that do."""
    values = {"b1": 0.9, "b2": 0.9, "eps": 1e-8, "momentum": 0.9, "nesterov": True, "ns_steps": 5, "factored": True,
              "decay_rate": 0.8, "min_dim_size_to_factor": 8, "multiply_by_parameter_scale": False,
              "optax_name": "lamb", "optax_kwargs": {}, "adam_lr": 1e-3, "ns_dtype": "float32"}
    assert set(values) == {k for fields in OPTIMIZER_FIELDS.values() for k in fields}
    base = {"optax_name": "lamb"} if name == "optax" else {}
    for f, v in values.items():
        if f in OPTIMIZER_FIELDS[name]:
            continue
        msg = _refused(f"optim.{f}", name=name, kernel="optax", **base, **{f: v})
        assert f"optim.name={name} does not use it" in msg and "optim.name=" in msg.split("fix:")[1]


def test_good_fields_build_the_optax_transformation_with_them():
    """The fields reach optax: the host optimizer's transformation equals one built by hand."""
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((40, 48)).astype(np.float32), "b": rng.standard_normal(48).astype(np.float32)}
    grads = jax.tree.map(lambda x: (rng.standard_normal(x.shape) * 0.1).astype(np.float32), params)
    import jax.numpy as jnp

    from megatrain_jax.optim.muon import muon

    by_hand = {
        "lion": optax.lion(3e-4, b1=0.85, b2=0.98, weight_decay=0.01),
        "adafactor": optax.adafactor(1e-2, min_dim_size_to_factor=32, decay_rate=0.75, momentum=0.9,
                                     weight_decay_rate=0.01),
        "sgd": optax.chain(optax.add_decayed_weights(0.01), optax.sgd(0.05, momentum=0.9, nesterov=True)),
        "muon": muon(2e-2, ns_steps=4, beta=0.9, weight_decay=0.01, adam_b2=0.99, adam_weight_decay=0.01,
                     adam_learning_rate=3e-3, ns_dtype=jnp.float32),
        "optax": optax.lamb(3e-3, b2=0.99, weight_decay=0.01),
    }
    for name, want_tx in by_hand.items():
        o = dataclasses.replace(_cfg(name).optim, schedule=ScheduleConfig())  # constant lr: no schedule state
        got_tx = build_reference_tx(dataclasses.replace(o, clip_norm=None), STEPS)
        want, got = params, params
        ws, gs = want_tx.init(want), got_tx.init(got)
        for _ in range(3):
            u, ws = want_tx.update(grads, ws, want)
            want = optax.apply_updates(want, u)
            u, gs = got_tx.update(grads, gs, got)
            got = optax.apply_updates(got, u)
        for k in params:
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=name)
