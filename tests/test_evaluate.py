"""Held-out evaluation (``evaluate.py``): the streamed forward-only pass equals the in-memory reference's forward,
a split never shares a sample with training, ``--resume`` reproduces the eval figures exactly, and bad eval inputs
are one line with exit 2."""
import json
import os

import numpy as np
import pytest

from cli_runner import TINY, check_user_error, run_in_process, sets
from megatrain_jax.data.packed import PackedDataset
from megatrain_jax.evaluate import SplitDataset, split_windows, window_batch

SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128", "data.seq_len=32",
         "train.batch_size=4", "optim.schedule.warmup_steps=1", "train.log_every=1"]


def test_split_is_disjoint_deterministic_and_complete():
    n = 1000
    tr, ev = split_windows(n, 0.1, seed=3)
    assert len(ev) == 100 and len(tr) == 900
    assert not set(tr) & set(ev) and set(tr) | set(ev) == set(range(n))
    tr2, ev2 = split_windows(n, 0.1, seed=3)
    assert np.array_equal(ev, ev2) and np.array_equal(tr, tr2)
    assert not np.array_equal(split_windows(n, 0.1, seed=4)[1], ev)  # the seed moves it
    # training draws only from its windows, every one of them once per epoch, over many epochs
    ds = PackedDataset(np.arange(n * 8 + 1, dtype=np.uint16) % 250, seed=3, seq_len=8)
    train = SplitDataset(ds, tr, 8, "train")
    seen = np.concatenate([train.sample_indices(step, 16, 8) for step in range(0, 3 * 900 // 16)])
    assert not set(seen.tolist()) & set(ev.tolist())
    assert sorted(seen[:900].tolist()) == tr.tolist()  # the first epoch: each training window once
    b = train.batch(5, 16, 8)
    assert np.array_equal(b.tokens, window_batch(ds, train.sample_indices(5, 16, 8), 8).tokens)
    assert np.array_equal(ds.batch(2, 4, 8).tokens, window_batch(ds, ds.sample_indices(2, 4, 8), 8).tokens)


MOE = ["model.family=qwen3_moe", "model.num_experts=4", "model.experts_per_token=2", "model.moe_intermediate_size=32",
       "model.router_aux_loss_coef=0.01"]


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "llama_stream_io"])
def test_forward_pass_equals_reference(family):
    """Per-sequence NLL over a partial (assistant-only) mask, micro-batched, against the reference's full logits
    (MoE: blocks that emit router statistics, the eval loss leaves the auxiliary loss out; stream_io: the head's
    vocabulary chunks streamed past the tokens, its online log-sum-exp)."""
    import optax

    from megatrain_jax.config import load_config
    from megatrain_jax.evaluate import ForwardPass
    from megatrain_jax.models import init_model
    from megatrain_jax.reference import ReferenceTrainer
    from megatrain_jax.trainer import Trainer

    cfg = load_config(TINY, [*SMALL, "train.micro_batches=2", "train.steps=2", "train.loss_chunk=24",
                             *(MOE if family == "qwen3_moe" else [])])
    model = init_model(cfg.model, 0)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, cfg.model.vocab_size, (4, 33)).astype(np.int32)
    mask = (rng.random((4, 32)) < 0.6).astype(np.float32)
    mask[3] = 0.0  # a padding row: nothing counts
    from megatrain_jax.engine import Batch

    batch = Batch(toks[:, :-1], toks[:, 1:], mask)
    ref = ReferenceTrainer(model, optax.sgd(0.0), compute_dtype="float32").forward_nll(batch)
    if family == "llama_stream_io":  # the head in vocabulary chunks of 96 (of 256)
        from megatrain_jax.models import streamed_parts
        from megatrain_jax.plan import plan_or_refuse

        options = plan_or_refuse(cfg, lambda _: None).options.with_(stream_io=True, vocab_chunk=96)
        tr = Trainer(streamed_parts(model), cfg.optim, options=options, steps=2)
        assert type(tr.engine.io).__name__ == "StreamIO" and tr.engine.io.head.n == 3
    else:
        tr = Trainer.from_config(cfg, model=model)
    with tr:
        got = ForwardPass(tr.engine).run(batch)
        again = ForwardPass(tr.engine).run(batch)
    assert np.array_equal(got.tokens, mask.sum(1)) and np.array_equal(ref.tokens, got.tokens)
    np.testing.assert_allclose(got.nll, ref.nll, rtol=2e-5, atol=1e-4)
    assert got.nll[3] == 0.0
    np.testing.assert_allclose(got.mean_loss, ref.mean_loss, rtol=2e-5)
    assert np.array_equal(got.nll, again.nll)  # deterministic
    np.testing.assert_allclose(got.logprobs, -got.nll)


def _train_args(out_dir, *extra):
    return ["train", TINY, *sets(*SMALL, f"train.out_dir={out_dir}", "train.steps=4", "train.ckpt_every=2",
                                 "train.eval_every=2", "train.eval_tokens=96", *extra)]


def _evals(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {r["step"]: (r["eval_loss"], r["eval_ppl"], r["eval_tokens"]) for r in map(json.loads, f)
                if "eval_loss" in r}


def test_train_evaluates_and_resume_reproduces_it(tmp_path, capsys):
    """A split run evaluates at steps 2 and 4; resumed from step 2, step 4's figures are the same to the bit."""
    a, b = tmp_path / "a", tmp_path / "b"
    res = run_in_process(_train_args(a, "data.eval_fraction=0.1"), capsys)
    assert res.rc == 0, str(res)
    ev = _evals(a)
    assert sorted(ev) == [2, 4] and ev[2][2] == 96 and ev[4][0] < ev[2][0]
    assert np.isclose(ev[4][1], np.exp(ev[4][0]))
    assert "eval_loss" in res.stdout
    # the same run, stopped after step 2's checkpoint: resumed, it evaluates step 4 exactly as the whole run did
    import shutil

    shutil.copytree(a, b)
    shutil.rmtree(b / "checkpoints" / "step_00000004")
    res = run_in_process(_train_args(b, "data.eval_fraction=0.1") + ["--resume"], capsys)
    assert res.rc == 0, str(res)
    assert _evals(b) == ev
    with open(b / "summary.json") as f:
        assert json.load(f)["eval"]["eval_loss"] == ev[4][0]


def test_held_out_file_and_reference_engine(tmp_path, capsys):
    """``data.eval`` a held-out .txt file; the reference engine evaluates the same set (the same figures as the
    streamed engine's, within float tolerance: both run the same steps)."""
    held = tmp_path / "held.txt"
    held.write_bytes(b"To be, or not to be, that is the question. " * 8)
    args = lambda out, eng: ["train", TINY, *sets(*SMALL, f"train.out_dir={out}", "train.steps=2",  # noqa: E731
                                                  f"data.eval={held}", f"train.engine={eng}",
                                                  "train.final_checkpoint=false")]
    assert run_in_process(args(tmp_path / "s", "streamed"), capsys).rc == 0
    assert run_in_process(args(tmp_path / "r", "reference"), capsys).rc == 0
    s, r = _evals(tmp_path / "s"), _evals(tmp_path / "r")
    assert list(s) == [2] and list(r) == [2] and s[2][2] == r[2][2] == 128
    np.testing.assert_allclose(s[2][0], r[2][0], rtol=1e-5)


@pytest.mark.parametrize("case", ["eval_file_too_short", "fraction_0", "fraction_1", "every_without_set",
                                  "eval_file_missing", "both"])
def test_bad_eval_inputs(tmp_path, capsys, case):
    short = tmp_path / "short.txt"
    short.write_bytes(b"too short")
    overrides, field = {
        "eval_file_too_short": ([f"data.eval={short}"], "data.eval"),
        "fraction_0": (["data.eval_fraction=0"], "data.eval_fraction"),
        "fraction_1": (["data.eval_fraction=1"], "data.eval_fraction"),
        "every_without_set": (["train.eval_every=5"], "train.eval_every"),
        "eval_file_missing": ([f"data.eval={tmp_path / 'nope.jsonl'}"], "data.eval"),
        "both": ([f"data.eval={short}", "data.eval_fraction=0.1"], "data.eval_fraction"),
    }[case]
    args = ["train", TINY, *sets(*SMALL, *overrides, f"train.out_dir={tmp_path / 'run'}")]
    line = check_user_error(run_in_process(args, capsys, watch=str(tmp_path)), field, str(tmp_path))
    assert "fix:" in line


def test_held_out_jsonl_counts_only_the_response(tmp_path):
    """A JSONL held-out file is tokenized as ``prepare`` would; only the responses' tokens count (as in training)."""
    from megatrain_jax.config import load_config
    from megatrain_jax.data import load_dataset
    from megatrain_jax.evaluate import eval_split

    held = tmp_path / "held.jsonl"
    rows = [{"prompt": "Q: what is two and two? ", "response": "four."}] * 12
    held.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(TINY, [*SMALL, f"data.eval={held}", "train.eval_tokens=10000"])
    train_ds = load_dataset(cfg.data, cfg.model.vocab_size, batch_size=4)
    ds, ev = eval_split(cfg, train_ds, log=lambda _: None)
    assert ds is train_ds and ev.dataset.mask is not None
    counted = sum(float(b.loss_mask.sum()) for b in ev.batches())
    windows = len(ev.windows)
    # each record is 24 prompt bytes + 5 response bytes: about 5/29 of the labels count
    assert 0 < counted < 0.3 * windows * 32


def test_eval_schedule_and_eta():
    """Evaluations every N steps and at the end; the ETA counts the steps and the evaluations to come apart."""
    from types import SimpleNamespace

    from megatrain_jax.evaluate import EvalRuns, EvalSet, eta_with_evals

    ev = EvalSet(None, np.arange(3), 4, 8, "test")
    for steps, every, due in ((10, 3, [3, 6, 9, 10]), (9, 3, [3, 6, 9]), (10, 0, [10])):
        cfg = SimpleNamespace(train=SimpleNamespace(eval_every=every, steps=steps), data=SimpleNamespace())
        runs = EvalRuns(cfg, ev, None, log=lambda _: None)
        assert [s for s in range(1, steps + 1) if runs.due(s)] == due
        assert [runs.remaining(s) for s in (0, steps)] == [len(due), 0]
    runs.pass_s = [5.0]  # (10 steps, at the end only) one pass of 5 s done after 2 steps of 1 s each
    assert eta_with_evals(runs, 7.0, 2, 0, 10) == 8 * 1.0 + 1 * 5.0
    assert eta_with_evals(None, 7.0, 2, 0, 10) == 7.0 / 2 * 8
