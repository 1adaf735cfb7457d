"""Trainer: the two worked examples trained 5 steps through megatrain-jax equal the same models
trained with plain whole-model jax.grad + optax.adamw; checkpoints resume exactly; the plan."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
sys.path.insert(0, os.path.dirname(__file__))

from _porting_model import group_errors, nnx_apply, plain_train  # noqa: E402

from megatrain_jax.config import OptimConfig  # noqa: E402
from megatrain_jax.trainer import Trainer  # noqa: E402

STEPS = 5
HP = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)


def _batches(vocab, n=STEPS, b=4, s=16, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, (b, s + 1)).astype(np.int32) for _ in range(n)]


def _assert_close(losses_a, losses_b, params_a, params_b):
    np.testing.assert_allclose(losses_b, losses_a, rtol=1e-5)
    errs = group_errors(params_a, params_b)
    assert max(errs.values()) <= 1e-5, errs


def test_gpt2_nnx_example_equals_plain_optax():
    from gpt2_nnx import GPT2Config, build_model

    cfg = GPT2Config(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    batches = _batches(cfg.vocab_size)
    apply, params0 = nnx_apply(build_model(cfg))
    want_losses, want = plain_train(apply, params0, optax.adamw(1e-3, **HP), batches)

    tr = Trainer(build_model(cfg), optax.adamw(1e-3, **HP), loss_chunk=24, check=False)  # optax on the host, per group
    assert tr.parts.tied and not tr.parts.blocks.takes_rng
    losses = [tr.step(t).loss for t in batches]
    _assert_close(want_losses, losses, want, tr.params())
    tr.close()


def test_lm1b_linen_example_equals_plain_optax_and_resumes(tmp_path):
    from lm1b_linen import TransformerConfig, build

    cfg = TransformerConfig(vocab_size=64, emb_dim=32, num_heads=2, num_layers=2, qkv_dim=32, mlp_dim=64, max_len=16)
    module, params = build(cfg)
    batches = _batches(cfg.vocab_size)
    want_losses, want = plain_train(lambda p, t: module.apply({"params": p}, t), params,
                                    optax.adamw(1e-3, **HP), batches)
    # the CLI's optimizer section: the fused host AdamW (== optax.adamw), 2 micro-batches
    opt = OptimConfig(lr=1e-3, clip_norm=None, **HP)
    tr = Trainer(module, opt, params=params, micro_batches=2, loss_chunk=24, check=False)
    assert not tr.parts.tied
    losses = [tr.step(t).loss for t in batches[:3]]
    path = tr.save(str(tmp_path / "ckpt"))
    assert path.endswith("step_00000003")
    losses += [tr.step(t).loss for t in batches[3:]]
    _assert_close(want_losses, losses, want, tr.params())

    # restore the state after step 3 and redo steps 4 and 5: bit-identical
    end = tr.params()
    state = tr.restore(str(tmp_path / "ckpt"))
    assert tr.step_count == 3 and state["count"] == 3
    again = [tr.step(t).loss for t in batches[3:]]
    assert again == losses[3:]
    jax.tree.map(np.testing.assert_array_equal, end, tr.params())

    # the CLI's memory plan for this model
    plan = tr.plan(batch_size=8, seq_len=16)
    assert plan.plan.params == sum(g.size for g in tr.engine.store) or plan.plan.params > 0
    assert "verdict" in plan.table and plan.verdict() is None
    assert "attention:" in plan.table
    no_attention = tr.plan(batch_size=8, seq_len=16, attention=False)  # issue 26 item 8: no attention line
    assert "attention:" not in no_attention.table and no_attention.plan.decisions["attention"] in (None, "none")
    tr.close()


def test_batch_forms_and_errors():
    from megatrain_jax.engine import Batch
    from megatrain_jax.errors import UserError
    from megatrain_jax.trainer import as_batch, host_optimizer

    toks = np.arange(10).reshape(2, 5)
    b = as_batch(toks)
    assert b.tokens.shape == (2, 4) and (b.labels == toks[:, 1:]).all()
    assert isinstance(as_batch((toks[:, :-1], toks[:, 1:])), Batch)
    assert as_batch({"tokens": toks[:, :-1], "labels": toks[:, 1:]}).tokens.shape == (2, 4)
    import pytest

    with pytest.raises(UserError, match="steps"):
        host_optimizer(OptimConfig(schedule=__import__("megatrain_jax.config", fromlist=["x"]).ScheduleConfig(
            kind="cosine")))
    with pytest.raises(UserError, match="not an optimizer"):
        host_optimizer("adam")


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI_SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128", "data.seq_len=32",
             "train.batch_size=4", "optim.schedule.warmup_steps=2", "train.log_every=100"]


def test_the_cli_runs_through_trainer_and_equals_it(tmp_path, monkeypatch):
    """``megatrain-jax train`` builds its streamed engine through ``Trainer.from_config`` (a new run)
    and ``Trainer.resume`` (--resume): one path. A ``Trainer.from_config`` stepped by hand over the
    same batches gives the CLI run's losses bit for bit, and so does the resumed run. The reference
    engine (a separate branch) still trains."""
    import json
    import shutil

    from megatrain_jax import checkpoint as ck
    from megatrain_jax import train as train_mod
    from megatrain_jax.config import load_config
    from megatrain_jax.data import load_dataset

    for k in [k for k in os.environ if k.startswith("MEGATRAIN_DEBUG")]:
        monkeypatch.delenv(k)
    made = []
    for name in ("from_config", "resume"):
        def spy(cls, *a, _orig=getattr(Trainer, name).__func__, _name=name, **k):
            made.append(_name)
            return _orig(cls, *a, **k)
        monkeypatch.setattr(Trainer, name, classmethod(spy))

    out = tmp_path / "run"

    def cfg(*extra):
        return load_config(os.path.join(REPO, "configs/tiny.yaml"),
                           CLI_SMALL + ["train.steps=5", "train.ckpt_every=3", f"train.out_dir={out}", *extra])

    def cli_losses():
        with open(out / "metrics.jsonl") as f:
            return [json.loads(line)["loss"] for line in f]

    train_mod.train(cfg(), log=lambda _: None)
    assert made == ["from_config"]
    straight = cli_losses()
    assert len(straight) == 5

    # resume from step 3 (the step-5 checkpoint removed): steps 4 and 5 again, identically
    shutil.rmtree(os.path.join(ck.checkpoint_root(str(out)), ck.step_dirname(5)))
    summary = train_mod.train(cfg(), resume=True, log=lambda _: None)
    assert made == ["from_config", "resume"] and summary["resumed_from"] == 3
    assert cli_losses() == straight

    # the same run by hand through the Python API
    c = cfg()
    plan = train_mod.plan_or_refuse(c, lambda _: None)
    data = load_dataset(c.data, c.model.vocab_size)
    with Trainer.from_config(c, plan) as tr:
        assert tr.settings["micro_batches"] == plan.decisions["micro_batches"] and tr.engine.skip_nonfinite
        losses = [tr.step(train_mod.to_engine_batch(data.batch(i, 4, 32), False)).loss for i in range(5)]
        assert tr.step_count == 5 and tr.lr_at(5) == json.loads(
            (out / "metrics.jsonl").read_text().splitlines()[-1])["lr"]
    assert losses == straight

    # train.engine=reference: the plain in-memory trainer, not through Trainer
    made.clear()
    ref = train_mod.train(cfg("train.engine=reference", f"train.out_dir={tmp_path / 'ref'}"), log=lambda _: None)
    assert made == [] and ref["steps"] == 5 and ref["checkpoint"] is None
    np.testing.assert_allclose(ref["first_loss"], straight[0], rtol=1e-4)


def test_every_trainer_answers_the_protocol():
    """``Trainer``, its runs (full training, adapters over a user's model or a config's) and the in-memory
    reference answer ``TrainerProtocol``, which ``train.py`` drives without asking which one it holds."""
    from megatrain_jax import checkpoint as ck
    from megatrain_jax.lora_trainer import LoraRun
    from megatrain_jax.reference import ReferenceTrainer
    from megatrain_jax.trainer import StreamedRun
    from megatrain_jax.trainer_protocol import Saver, TrainerProtocol

    def members(proto):
        return [n for n in vars(proto) if not n.startswith("_")]

    assert {"step", "params", "save", "restore", "plan", "export"} <= set(members(TrainerProtocol))
    for cls in (Trainer, StreamedRun, LoraRun, ReferenceTrainer):
        assert [n for n in members(TrainerProtocol) if not hasattr(cls, n)] == [], cls.__name__
    assert [n for n in members(Saver) if not hasattr(ck.CheckpointSaver, n)] == []
