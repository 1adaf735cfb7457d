"""Preference tuning (objectives.py, data/preference.py, reference_logps.py).

- Each objective's loss and every gradient equal TRL's formulas written out on transformers' logits
  (tests/preference_reference.py, one run in .venv-torch), through the resident head and the streamed head.
- ``prepare --preference`` of TRL-format records; a DPO run whose reward accuracy rises; its cached reference
  log-probabilities equal a fresh forward pass; a stale cache is refused in one line; kill and --resume is exact.
- Held-out evaluation (``preference_eval.py``): whole pairs split off; the eval rewards equal TRL's from the
  in-memory reference trainer's log-probabilities; a held-out file's own reference entry; bad inputs one line,
  exit 2; resume exact.
"""
from __future__ import annotations

import json
import os
import subprocess

import jax
import numpy as np
import pytest

from cli_runner import cli_command, cli_env, sets
from megatrain_jax.config import ModelConfig, OptimConfig, load_config
from megatrain_jax.engine import Batch, StreamedTrainer
from megatrain_jax.errors import UserError
from megatrain_jax.hf import hf_name, load_hf_into_store
from megatrain_jax.objectives import Objective
from megatrain_jax.optim import build_host_optimizer
from torch_reference import run_reference, torch_python as reference_python

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-4  # the transformers parity tolerance (tests/test_hf.py)
BETA, GAMMA, LAM, LS = 0.2, 0.6, 0.3, 0.1  # as tests/preference_reference.py
OBJ = {"dpo": Objective("dpo", BETA, label_smoothing=LS), "ipo": Objective("ipo", BETA),
       "simpo": Objective("simpo", BETA, GAMMA, label_smoothing=LS), "orpo": Objective("orpo", BETA, lam=LAM)}


@pytest.fixture(scope="module")
def trl_ref(tmp_path_factory):
    out = tmp_path_factory.mktemp("pref_ref")
    run_reference(reference_python(), str(out), script="preference_reference.py")
    return out


def _gradients(store, before: dict) -> dict:
    """Every gradient by transformers' name: SGD at learning rate 1 moved each weight by minus its gradient."""
    out = {}
    for g in store:
        delta = before[g.name] - g.master
        for path, leaf in jax.tree_util.tree_flatten_with_path(g.layout.unflatten(delta))[0]:
            name, transposed = hf_name(g.name, jax.tree_util.keystr(path, simple=True, separator="/"))
            out[name] = np.asarray(leaf).T if transposed else np.asarray(leaf)
    return out


# (objective, engine options): the resident head for each objective, and the streamed head (stream_io, 2
# micro-batches) for the two that couple differently (a reference; an NLL term)
CASES = [("dpo", {}), ("ipo", {}), ("simpo", {}), ("orpo", {}),
         ("dpo", dict(stream_io=True, vocab_chunk=48, micro_batches=2)), ("orpo", dict(stream_io=True, vocab_chunk=48))]


@pytest.mark.parametrize("name,opts", CASES, ids=[f"{n}-{'stream' if o else 'resident'}" for n, o in CASES])
def test_loss_and_every_gradient_equal_trl_formulas_on_transformers_logits(trl_ref, name, opts):
    ref = np.load(trl_ref / "ref.npz")
    cfg = ModelConfig(from_hf=str(trl_ref / "hf"))
    parts, store = load_hf_into_store(cfg, bf16_stream=False, log=None)
    sgd = build_host_optimizer(OptimConfig(name="sgd", lr=1.0, weight_decay=0.0, clip_norm=None), 1)
    st = StreamedTrainer(parts, sgd, compute_dtype="float32", loss_chunk=40, store=store, **opts)
    st.kernels.objective = OBJ[name]
    before = {g.name: g.master.copy() for g in store}
    res = st.step(Batch(ref["tokens"], ref["labels"], ref["mask"], ref_logps=ref["ref"]))
    st.close()
    want_loss = float(ref[f"loss:{name}"])
    assert abs(res.loss - want_loss) <= TOL * abs(want_loss), (res.loss, want_loss)
    got = _gradients(store, before)
    want = {k.split(":", 2)[2]: ref[k] for k in ref.files if k.startswith(f"grad:{name}:")}
    assert sorted(got) == sorted(want)
    floor = 1e-4 * max(np.linalg.norm(g) for g in want.values())
    for n, g in want.items():
        err = np.linalg.norm(got[n].astype(np.float64) - g) / max(np.linalg.norm(g), floor)
        assert err < TOL, f"{name}: gradient of {n} differs: {err:.2e}"
    # the logged rows' log-probabilities are transformers' (TRL's logps/chosen, logps/rejected)
    cnt = ref["mask"].sum(1)
    lp = ref["seq"] / cnt if OBJ[name].averaged else ref["seq"]
    assert abs(res.preference["logps/chosen"] - lp[0::2].mean()) <= 1e-4 * abs(lp[0::2].mean())


# ------------------------------------------------------------------------------------ data and runs


def make_pairs(path: str, n: int = 48, seed: int = 0) -> str:
    """A small preference set in TRL's formats (standard strings and conversations alternate): the chosen
    answer repeats the prompt's word, the rejected one reverses it."""
    rng = np.random.default_rng(seed)
    words = ["apple", "river", "stone", "cloud", "tiger", "lamp", "music", "garden", "paper", "window"]
    with open(path, "w") as f:
        for i in range(n):
            w = words[int(rng.integers(len(words)))]
            if i % 2:
                rec = {"prompt": f"Say {w}: ", "chosen": f"{w}!", "rejected": f"no {w[::-1]}."}
            else:
                rec = {"prompt": [{"role": "user", "content": f"Say {w}"}],
                       "chosen": [{"role": "assistant", "content": f"{w}!"}],
                       "rejected": [{"role": "assistant", "content": f"no {w[::-1]}."}]}
            f.write(json.dumps(rec) + "\n")
    return path


SMALL = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
         "model.intermediate_size=64", "data.seq_len=48", "train.batch_size=8", "train.loss_chunk=128",
         "train.log_every=1", "optim.lr=3e-3", "train.ckpt_every=3"]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    from megatrain_jax.data.preference import prepare_preference

    d = tmp_path_factory.mktemp("pairs")
    prepare_preference([make_pairs(str(d / "pairs.jsonl"))], str(d / "data"), chat_template="chatml", quiet=True)
    return str(d / "data")


def _cfg(data, out, *extra):
    return load_config(os.path.join(REPO, "configs", "dpo-tiny.yaml"),
                       [*SMALL, f"data.path={data}", f"train.out_dir={out}", *extra])


def _metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def straight(pairs, tmp_path_factory):
    from megatrain_jax.train import train

    out = str(tmp_path_factory.mktemp("straight") / "run")
    train(_cfg(pairs, out, "train.steps=6"), log=lambda _m: None)
    return out


def test_prepare_puts_each_pair_in_two_adjacent_rows_with_the_prompt_masked(pairs):
    from megatrain_jax.data import load_dataset

    cfg = _cfg(pairs, "unused")
    ds = load_dataset(cfg.data, cfg.model.vocab_size, batch_size=8)
    assert ds.n_pairs == 48
    b = ds.batch(0, 8, 48)
    assert b.tokens.shape == (8, 48) and len(b.pairs) == 4
    for j in range(4):
        c, r = 2 * j, 2 * j + 1
        p = int(np.argmax(b.loss_mask[c]))  # the first completion label: the prompt is the same in both rows
        assert p > 0 and p == int(np.argmax(b.loss_mask[r]))
        assert (b.tokens[c, :p + 1] == b.tokens[r, :p + 1]).all()
        assert bytes(b.labels[c][b.loss_mask[c] > 0].astype(np.uint8)) != bytes(b.labels[r][b.loss_mask[r] > 0]
                                                                                .astype(np.uint8))
    assert (ds.batch(3, 8, 48).tokens == ds.batch(3, 8, 48).tokens).all()  # a pure function of the step


def test_dpo_reward_accuracy_rises_and_the_cache_equals_a_fresh_forward_pass(pairs, straight):
    from megatrain_jax.models import init_model

    recs = _metrics(straight)
    assert recs[0]["rewards/accuracies"] == 0.0 and abs(recs[0]["loss"] - np.log(2)) < 1e-6  # policy = reference
    assert recs[-1]["rewards/accuracies"] == 1.0 and recs[-1]["rewards/margins"] > 0.01
    assert recs[-1]["loss"] < recs[0]["loss"]
    cached = np.load(pairs + ".reference.npy")
    cfg = _cfg(pairs, "unused")
    from megatrain_jax.data import load_dataset

    ds = load_dataset(cfg.data, cfg.model.vocab_size, batch_size=8)
    b = ds.rows(np.arange(ds.n_pairs), cfg.data.seq_len)
    model = init_model(cfg.model, cfg.train.seed)  # the initial weights, whole, in memory
    logits = np.asarray(jax.jit(lambda t: model(t))(b.tokens), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    seq = (np.take_along_axis(logp, b.labels[..., None], -1)[..., 0] * b.loss_mask).sum(1)
    np.testing.assert_allclose(cached.reshape(-1), seq, rtol=1e-5)


def test_a_stale_reference_cache_is_refused_in_one_line(pairs, straight, tmp_path):
    from megatrain_jax.train import train

    out = str(tmp_path / "other_seed")
    with pytest.raises(UserError) as e:
        train(_cfg(pairs, out, "train.steps=1", "train.seed=1"), log=lambda _m: None)
    assert e.value.field == "train.reference" and "stale" in str(e.value) and "weights.seed: 0 -> 1" in str(e.value)
    assert "\n" not in str(e.value) and not os.path.exists(out)


def test_kill_and_resume_is_exact(pairs, straight, tmp_path):
    out = str(tmp_path / "killed")
    args = ["train", os.path.join(REPO, "configs", "dpo-tiny.yaml"),
            *sets(*SMALL, f"data.path={pairs}", f"train.out_dir={out}", "train.steps=6")]
    env = cli_env(os.environ.get("JAX_COMPILATION_CACHE_DIR"))
    killed = subprocess.run(cli_command(args, {"kill_after_step": 4}), env=env, capture_output=True, text=True,
                            timeout=300, stdin=subprocess.DEVNULL)
    assert killed.returncode == -9, killed.stderr[-2000:]
    from megatrain_jax.train import train

    train(_cfg(pairs, out, "train.steps=6"), resume=True, log=lambda _m: None)
    keys = ("loss", "grad_norm", "rewards/accuracies", "rewards/margins", "logps/chosen")
    assert [[r[k] for k in keys] for r in _metrics(out)] == [[r[k] for k in keys] for r in _metrics(straight)]


# ------------------------------------------------------------------------------------ held-out evaluation

EVAL = ["data.eval_fraction=0.25", "train.eval_every=3", "train.eval_tokens=100000"]


def _eval_records(out):
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("eval") and k != "eval_time_s"}
            for r in _metrics(out) if "eval_loss" in r}


@pytest.fixture(scope="module")
def evaluated(pairs, tmp_path_factory):
    from megatrain_jax.train import train

    out = str(tmp_path_factory.mktemp("evaluated") / "run")
    train(_cfg(pairs, out, "train.steps=6", *EVAL), log=lambda _m: None)
    return out


def test_split_keeps_pairs_whole(pairs):
    """Training draws only from the training pairs (each once per epoch), the eval set only from the others."""
    from megatrain_jax.data import load_dataset
    from megatrain_jax.preference_eval import preference_split as eval_split

    cfg = _cfg(pairs, "unused", *EVAL)
    ds = load_dataset(cfg.data, cfg.model.vocab_size, batch_size=8)
    train_ds, ev = eval_split(cfg, ds, log=lambda _m: None)
    held = set(ev.pairs.tolist())
    assert len(held) == 12 and train_ds.n_pairs == 36
    seen = np.concatenate([train_ds.batch(s, 8, 48).pairs for s in range(27)])  # three epochs
    assert not held & set(seen.tolist()) and sorted(seen[:36].tolist()) == sorted(set(range(48)) - held)
    for batch, rows in ev.batches():  # each eval row pair is a chosen row and its own rejected row
        assert rows == 8 and (batch.tokens[0::2, :3] == batch.tokens[1::2, :3]).all()
    again = eval_split(cfg, load_dataset(cfg.data, cfg.model.vocab_size, batch_size=8), log=lambda _m: None)[1]
    assert np.array_equal(again.pairs, ev.pairs)  # a pure function of (pairs, fraction, data.seed)


def test_eval_rewards_equal_a_direct_computation(pairs, evaluated):
    """The final evaluation's figures equal TRL's, computed from the in-memory reference trainer's log-probabilities
    of the held-out pairs under the final weights and the initial ones."""
    import optax

    from megatrain_jax.data import load_dataset
    from megatrain_jax.preference_eval import preference_split as eval_split
    from megatrain_jax.models import init_model
    from megatrain_jax.reference import ReferenceTrainer
    from megatrain_jax.trainer import Trainer

    ev = _eval_records(evaluated)
    assert sorted(ev) == [3, 6]
    cfg = _cfg(pairs, evaluated, "train.steps=6", *EVAL)
    ds = load_dataset(cfg.data, cfg.model.vocab_size, batch_size=8)
    held = eval_split(cfg, ds, log=lambda _m: None)[1].pairs
    b = ds.rows(held, cfg.data.seq_len)
    tr, _, _ = Trainer.resume(cfg, os.path.join(evaluated, "checkpoints"), None, lambda _m: None)
    with tr:
        final = tr.update_model(init_model(cfg.model, cfg.train.seed))
    pol = -ReferenceTrainer(final, optax.sgd(0.0)).forward_nll(b).nll
    ref = -ReferenceTrainer(init_model(cfg.model, cfg.train.seed), optax.sgd(0.0)).forward_nll(b).nll
    beta = cfg.train.beta
    rc, rr = beta * (pol[0::2] - ref[0::2]), beta * (pol[1::2] - ref[1::2])
    z = (pol[0::2] - pol[1::2]) - (ref[0::2] - ref[1::2])
    got = ev[6]
    assert got["eval_pairs"] == len(held) == 12
    assert got["eval/rewards/accuracies"] == float((rc > rr).mean())
    for key, want in (("eval/rewards/margins", (rc - rr).mean()), ("eval/rewards/chosen", rc.mean()),
                      ("eval/rewards/rejected", rr.mean()), ("eval/logps/chosen", pol[0::2].mean()),
                      ("eval_loss", np.mean(np.logaddexp(0.0, -beta * z)))):
        assert abs(got[key] - want) <= 1e-4 * max(abs(want), 1e-2), (key, got[key], want)
    assert got["eval/rewards/margins"] > 0 and got["eval_loss"] < np.log(2)


def test_eval_resume_is_exact(pairs, evaluated, tmp_path):
    """Resumed from step 3's checkpoint, step 6's evaluation is the same to the bit (the reference from the cache)."""
    import shutil

    from megatrain_jax.train import train

    out = str(tmp_path / "resumed")
    shutil.copytree(evaluated, out)
    shutil.rmtree(os.path.join(out, "checkpoints", "step_00000006"))
    train(_cfg(pairs, out, "train.steps=6", *EVAL), resume=True, log=lambda _m: None)
    assert _eval_records(out) == _eval_records(evaluated)


@pytest.mark.parametrize("case", ["jsonl", "not_pairs", "too_few_left"])
def test_bad_preference_eval_inputs(pairs, tmp_path, capsys, case):
    from cli_runner import check_user_error, run_in_process

    held = tmp_path / "held.jsonl"
    make_pairs(str(held), 4)
    text = tmp_path / "held.txt"
    text.write_bytes(b"plain text, no pairs. " * 20)
    overrides, field = {"jsonl": ([f"data.eval={held}"], "data.eval"),
                        "not_pairs": ([f"data.eval={text}"], "data.eval"),
                        "too_few_left": (["data.eval_fraction=0.95"], "data.eval_fraction")}[case]
    args = ["train", os.path.join(REPO, "configs", "dpo-tiny.yaml"),
            *sets(*SMALL, f"data.path={pairs}", f"train.out_dir={tmp_path / 'run'}", *overrides)]
    check_user_error(run_in_process(args, capsys, watch=str(tmp_path)), field, str(tmp_path))


def test_held_out_file_has_its_own_reference_entry(pairs, tmp_path):
    """``data.eval`` a held-out preference set: its reference log-probabilities are made by the same pass of the
    initial weights, cached next to it, equal to the initial model's."""
    from dataclasses import replace

    from megatrain_jax.data import load_dataset
    from megatrain_jax.data.preference import prepare_preference
    from megatrain_jax.models import init_model
    from megatrain_jax.train import train

    held = str(tmp_path / "held")
    prepare_preference([make_pairs(str(tmp_path / "held.jsonl"), 6, seed=1)], held, chat_template="chatml", quiet=True)
    out = str(tmp_path / "run")
    cfg = _cfg(pairs, out, "train.steps=2", f"data.eval={held}", "train.final_checkpoint=false")
    train(cfg, log=lambda _m: None)
    ev = _eval_records(out)
    assert list(ev) == [2] and ev[2]["eval_pairs"] == 4  # one training step's tokens: 4 pairs of the 6
    cached = np.load(held + ".reference.npy")
    ds = load_dataset(replace(cfg.data, path=held, eval=None), cfg.model.vocab_size)
    b = ds.rows(np.arange(6), cfg.data.seq_len)
    logits = np.asarray(init_model(cfg.model, cfg.train.seed)(b.tokens), np.float64)
    m = logits.max(-1, keepdims=True)
    logp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    seq = (np.take_along_axis(logp, b.labels[..., None], -1)[..., 0] * b.loss_mask).sum(1)
    np.testing.assert_allclose(cached.reshape(-1), seq, rtol=1e-5)
