"""End to end: the CLI in a subprocess, killed, resumed, signalled, fed NaNs; runs of a tiny model.

Every subprocess shares one persistent XLA compilation cache (conftest's ``cli_env``, kept between
runs), and independent runs go side by side, so each wave takes seconds, mostly imports. Faults
are injected as ``train.TrainHooks`` through the test-only entry point ``tests/train_with_hooks.py``.
"""
import json
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from cli_runner import cli_command, sets
from megatrain_jax import checkpoint as ck
from megatrain_jax import checkpoint_read as ckr
from megatrain_jax.cli import main as cli_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128", "data.seq_len=32",
         "train.batch_size=4", "optim.schedule.warmup_steps=2", "train.log_every=1"]


@pytest.fixture(scope="module")
def env(cli_env):
    return cli_env  # conftest: CPU, the shared persistent compilation cache


def _args(out_dir, steps=10, ckpt_every=5, extra=()):
    return ["train", "configs/tiny.yaml", *sets(*SMALL, f"train.out_dir={out_dir}", f"train.steps={steps}",
                                                f"train.ckpt_every={ckpt_every}", *extra)]


class Run:
    """One CLI run in a subprocess; ``stop_after`` sends a signal once that many steps are logged."""

    def __init__(self, env, out_dir, *, resume=False, hooks=None, steps=10, ckpt_every=5, extra=(),
                 stop_after=None, sig=None):
        self.out, self.sig, self.stop_after = out_dir, sig, stop_after
        cmd = cli_command(_args(out_dir, steps, ckpt_every, extra) + (["--resume"] if resume else []), hooks)
        self.p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.stdout = self.stderr = None
        self.returncode = None

    def poll_signal(self) -> bool:
        """Send the signal when due; True once nothing is left to do here."""
        if self.sig is None:
            return True
        metrics = os.path.join(self.out, "metrics.jsonl")
        if self.p.poll() is None and os.path.isfile(metrics) and sum(1 for _ in open(metrics)) >= self.stop_after:
            self.p.send_signal(self.sig)
            self.sig = None
        return self.sig is None or self.p.poll() is not None

    def wait(self):
        self.stdout, self.stderr = self.p.communicate(timeout=300)
        self.returncode = self.p.returncode
        return self


def run_all(runs):
    """Run subprocesses side by side (2 cores: imports and compiles overlap), signalling when due."""
    t0 = deadline = time.time()
    deadline += 300
    while not all(r.poll_signal() for r in runs) and time.time() < deadline:
        time.sleep(0.05)
    out = [r.wait() for r in runs]
    print(f"{len(runs)} run(s) in {time.time() - t0:.1f}s")
    return out


def _run(env, out_dir, **kw):
    return run_all([Run(env, out_dir, **kw)])[0]


def _metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _final_arrays(out_dir, step):
    arrays, state = ckr.load_checkpoint_arrays(os.path.join(ck.checkpoint_root(out_dir), ck.step_dirname(step)))
    return arrays, state


def _assert_same_arrays(a, b):
    assert a.keys() == b.keys()
    for g in a:
        assert a[g].keys() == b[g].keys()
        for k in a[g]:
            assert a[g][k].dtype == b[g][k].dtype and np.array_equal(a[g][k].view(np.uint8), b[g][k].view(np.uint8)), (g, k)


def _ok(r):
    assert r.returncode == 0, f"rc={r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def straight(env, tmp_path_factory):
    """10 steps without interruption, checkpoints at 5 and 10 (also fills the compilation cache)."""
    out = str(tmp_path_factory.mktemp("straight") / "run")
    _ok(_run(env, out))
    return out


@pytest.fixture(scope="module")
def runs(env, straight, tmp_path_factory):
    """Every other run, in two waves of parallel subprocesses (the second resumes the first's)."""
    d = tmp_path_factory.mktemp("runs")
    out = {k: str(d / k) for k in ("kill7", "killsave", "corrupt", "nan", "SIGTERM", "SIGINT")}
    shutil.copytree(straight, out["corrupt"])
    _flip_a_byte(os.path.join(ck.checkpoint_root(out["corrupt"]), ck.step_dirname(10)))
    first = run_all([
        Run(env, out["kill7"], hooks={"kill_after_step": 7}),
        Run(env, out["killsave"], hooks={"kill_in_save": 10}),
        Run(env, out["nan"], steps=10, ckpt_every=1, extra=["train.keep_last=0", "train.max_bad_steps=3"],
            hooks={"nan_steps": "3,4,6,7,8"}),
        Run(env, out["SIGTERM"], steps=100000, ckpt_every=0, stop_after=3, sig=signal.SIGTERM),
        Run(env, out["SIGINT"], steps=100000, ckpt_every=0, stop_after=3, sig=signal.SIGINT),
    ])
    res = dict(zip(["kill7", "killsave", "nan", "SIGTERM", "SIGINT"], first))
    before = {k: _snapshot(out[k]) for k in ("kill7", "killsave")}
    second = run_all([Run(env, out[k], resume=True) for k in ("kill7", "killsave", "corrupt")])
    res.update({f"{k}_resume": r for k, r in zip(("kill7", "killsave", "corrupt"), second)})
    return out, res, before


def _snapshot(out):
    root = ck.checkpoint_root(out)
    return {"checkpoints": [c.step for c in ck.list_checkpoints(root)], "leftovers": ck.leftovers(root),
            "metrics": len(_metrics(out))}


def _flip_a_byte(ckpt_dir):
    files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(ckpt_dir, "groups", "block_1")) for f in fs]
    victim = max(files, key=os.path.getsize)  # the weights' data
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))


def _assert_matches_straight(straight, out):
    ref, got = _metrics(straight), _metrics(out)
    assert [r["step"] for r in got] == list(range(1, 11))  # appended, no step twice
    assert [(r["loss"], r["grad_norm"]) for r in got] == [(r["loss"], r["grad_norm"]) for r in ref]  # bit-identical
    a, sa = _final_arrays(straight, 10)
    b, sb = _final_arrays(out, 10)
    _assert_same_arrays(a, b)  # weights and optimizer moments
    assert sa["count"] == sb["count"] == 10 and sb["data"]["position"]["step"] == 10


def test_sigkill_after_checkpoint_then_resume_is_bit_identical(straight, runs):
    out, res, before = runs
    assert res["kill7"].returncode == -signal.SIGKILL
    assert before["kill7"]["checkpoints"] == [5]
    assert before["kill7"]["metrics"] == 7  # steps 6 and 7 were logged, then lost with the kill
    r = _ok(res["kill7_resume"])
    assert "resumed from" in r.stdout and "step_00000005" in r.stdout
    assert "dropped 2 record(s) after step 5" in r.stdout
    _assert_matches_straight(straight, out["kill7"])


def test_kill_during_save_keeps_previous_checkpoint(straight, runs):
    out, res, before = runs
    assert res["killsave"].returncode == -signal.SIGKILL
    assert before["killsave"]["checkpoints"] == [5]
    assert [os.path.basename(p) for p in before["killsave"]["leftovers"]] == ["step_00000010.tmp"]  # half written
    r = _ok(res["killsave_resume"])
    assert "interrupted save" in r.stdout and "resumed from" in r.stdout and "step_00000005" in r.stdout
    assert ck.leftovers(ck.checkpoint_root(out["killsave"])) == []
    _assert_matches_straight(straight, out["killsave"])


def test_corrupted_newest_checkpoint_falls_back_to_previous(straight, runs):
    out, res, _ = runs
    r = _ok(res["corrupt_resume"])
    assert "step_00000010 is corrupted" in r.stdout and "fails its crc32" in r.stdout
    assert "falling back to the previous checkpoint" in r.stdout
    assert "resuming from" in r.stdout and "step_00000005" in r.stdout
    assert os.path.isdir(os.path.join(ck.checkpoint_root(out["corrupt"]), "step_00000010.corrupt"))
    _assert_matches_straight(straight, out["corrupt"])


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_signal_finishes_step_saves_and_exits_0(runs, sig):
    out, res, _ = runs
    r = _ok(res[sig])
    line = next(x for x in r.stdout.splitlines() if x.startswith(f"stopped by {sig} after step"))
    step = int(line.split("after step ")[1].split(":")[0])
    assert "checkpoint saved to" in line and "--resume" in line
    assert 3 <= step < 100000
    assert [c.step for c in ck.list_checkpoints(ck.checkpoint_root(out[sig]))] == [step]
    assert [r["step"] for r in _metrics(out[sig])] == list(range(1, step + 1))
    _, state = _final_arrays(out[sig], step)
    assert state["loop"]["step"] == state["count"] == step


def test_a_second_sigint_during_a_save_abandons_it_and_names_the_newest_checkpoint(env, tmp_path):
    """Issue 47 item 4: a second Ctrl-C during the save the first one asked for exited 130 with an orbax
    traceback ("cannot schedule new futures after interpreter shutdown"): the writer thread was still
    saving while the interpreter shut down, and nothing said the checkpoints were intact. Now the save
    is abandoned cleanly (its .tmp removed, the writer waited for), one line names the newest complete
    checkpoint, exit 130, no traceback. (Hooks: SIGINT after step 5, again once step 5's save has
    written its first group; checkpoints every 2 steps.)"""
    from cli_runner import NOISE

    out = str(tmp_path / "run")
    r = _run(env, out, steps=100, ckpt_every=2, hooks={"sigint_after_step": 5, "sigint_in_save": 5})
    assert r.returncode == 130, f"rc={r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr and "cannot schedule" not in r.stderr, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not NOISE.match(ln)]
    first = next(i for i, ln in enumerate(lines) if ln.startswith("SIGINT: finishing the current step"))
    assert len(lines) == first + 2, lines  # the first signal's notice, then exactly one line
    last = lines[-1]
    root = ck.checkpoint_root(out)
    assert last.startswith("second SIGINT: aborted after step 5") and "save of step 5 was abandoned" in last, last
    assert f"newest complete checkpoint is {os.path.join(root, ck.step_dirname(4))} (step 4)" in last, last
    assert "--resume" in last, last
    assert [c.step for c in ck.list_checkpoints(root)] == [2, 4] and ck.leftovers(root) == []
    _, state = _final_arrays(out, 4)  # intact: every array passes its crc32
    assert state["loop"]["step"] == 4


def test_nan_steps_are_skipped_then_max_bad_steps_stops_with_a_good_checkpoint(runs):
    """NaN at steps 3, 4 (skipped, run goes on), then 6, 7, 8: the third in a row stops the run."""
    out, res, _ = runs
    r, run = res["nan"], out["nan"]
    rec = _metrics(run)
    assert [x["skipped"] for x in rec] == [False, False, True, True, False, True, True, True]
    assert not np.isfinite(rec[2]["loss"]) and not np.isfinite(rec[2]["grad_norm"]) and np.isfinite(rec[4]["loss"])
    logs = r.stdout.splitlines()
    assert any(x.startswith("step 3: non-finite loss nan") and "update skipped" in x and "1 in a row, 1 in total" in x
               for x in logs)
    assert any(x.startswith("step 4: non-finite") and "2 in a row, 2 in total" in x for x in logs)
    assert any(x.startswith("step 8: non-finite") and "3 in a row, 5 in total" in x for x in logs)
    a = {step: _final_arrays(run, step) for step in (2, 3, 4, 5, 8)}
    for step in (3, 4):  # weights and moments bit-identical across the skipped steps
        _assert_same_arrays(a[2][0], a[step][0])
        assert a[step][1]["count"] == 2 and a[step][1]["loop"]["skipped_total"] == step - 2
    assert a[5][1]["count"] == 3 and not np.array_equal(a[5][0]["block_0"]["master"], a[2][0]["block_0"]["master"])
    # the stop: exit 2, a clear message, and a checkpoint at step 8 holding step 5's model
    assert r.returncode == 2, r.stderr[-2000:]
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("error: train.max_bad_steps: 3 consecutive steps (6..8)") and "after step 5" in err
    assert "step_00000008" in err and "--resume" in err
    _assert_same_arrays(a[5][0], a[8][0])
    assert a[8][1]["count"] == 3 and a[8][1]["loop"]["step"] == 8
    assert [c.step for c in ck.list_checkpoints(ck.checkpoint_root(run))] == list(range(1, 9))


def test_resume_errors_are_user_errors(tmp_path, capsys, straight):
    base = ["train", os.path.join(REPO, "configs/tiny.yaml")] + [x for s in SMALL for x in ("--set", s)]
    assert cli_main(base + ["--set", f"train.out_dir={tmp_path / 'none'}", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--resume: no complete checkpoint" in err and "fix:" in err
    assert not os.path.exists(tmp_path / "none")  # nothing written
    assert cli_main(base + ["--set", f"train.out_dir={straight}"]) == 2  # a fresh run over an existing one
    assert "already holds checkpoints" in capsys.readouterr().err
    other = str(tmp_path / "other")
    shutil.copytree(straight, other)
    assert cli_main(base + ["--set", f"train.out_dir={other}", "--set", "model.num_layers=3", "--resume"]) == 2
    assert "model: checkpoint" in capsys.readouterr().err


def test_export_of_a_training_run_matches_the_model(straight, tmp_path):
    """`megatrain-jax export RUN OUT`: every tensor of the inference model, named as in its state."""
    import jax
    import yaml
    from flax import nnx
    from safetensors.numpy import load_file

    from megatrain_jax.config import ModelConfig
    from megatrain_jax.models.llama import abstract_model

    out = str(tmp_path / "export")
    assert cli_main(["export", straight, out, "--format", "mt", "--dtype", "float32"]) == 0
    meta = json.load(open(os.path.join(out, "config.json")))
    cfg = ModelConfig(**yaml.safe_load(open(os.path.join(out, "model.yaml"))))
    state = nnx.to_pure_dict(nnx.state(abstract_model(cfg)))
    want = {".".join(str(getattr(k, "key", k)) for k in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}
    assert set(meta["weight_map"]) == set(want) and meta["source"]["step"] == 10
    arrays, ckpt_state = _final_arrays(straight, 10)
    files = {}
    for name, (fname, key) in meta["weight_map"].items():
        t = files.setdefault(fname, load_file(os.path.join(out, fname)))[key]
        assert t.shape == want[name].shape and t.dtype == np.float32
    for g, leaves in ckpt_state["layouts"].items():  # fp32 export == the master weights, leaf by leaf
        for path, shape, offset, size in leaves:
            want_leaf = arrays[g]["master"][offset:offset + size].reshape(shape)
            assert np.array_equal(files[f"{g}.safetensors"][path], want_leaf)


def test_int8_moments_kill_and_resume_is_bit_identical_and_other_modes_are_refused(env, tmp_path, capsys):
    """Compact state is checkpointed as it is (codes and scales): a SIGKILLed int8 run resumes
    bit-identical to an uninterrupted one; resuming it with float32 moments is refused (exit 2, checked
    in-process: ``cli.main``)."""
    int8 = ["optim.moments=int8"]
    straight8, killed = str(tmp_path / "straight8"), str(tmp_path / "killed8")
    first = run_all([Run(env, straight8, extra=int8),
                     Run(env, killed, extra=int8, hooks={"kill_after_step": 7})])
    _ok(first[0])
    assert first[1].returncode == -signal.SIGKILL
    _ok(_run(env, killed, resume=True, extra=int8))
    _assert_matches_straight(straight8, killed)
    a, _ = _final_arrays(straight8, 10)
    assert a["block_0"]["opt/mu_q"].dtype == np.uint8 if "opt/mu_q" in a["block_0"] else any(
        v.dtype == np.uint8 for v in a["block_0"].values())
    args = _args(killed, steps=12, extra=["optim.moments=float32"]) + ["--resume"]
    capsys.readouterr()
    rc = cli_main([args[0], os.path.join(REPO, args[1]), *args[2:]])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip().count("\n") == 0, err
    assert "optim" in err and "mu_q" in err


def test_background_failure_is_one_line_with_the_traceback_in_a_log(tmp_path, monkeypatch, capsys):
    """An exception on the host optimizer thread reaches the user as the one-line error (exit 2);
    the full traceback is in train.out_dir/error.log."""
    from megatrain_jax.cli import main as cli_main
    from megatrain_jax.optim.host import FusedAdamW

    def boom(self, *a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FusedAdamW, "update", boom)
    out = tmp_path / "run"
    rc = cli_main(["train", os.path.join(REPO, "configs/tiny.yaml"), *[x for s in SMALL + [
        f"train.out_dir={out}", "train.steps=3", "train.final_checkpoint=false"] for x in ("--set", s)]])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and err.startswith("error: disk:"), err
    log = (out / "error.log").read_text()
    assert "Traceback" in log and "No space left on device" in log


def test_trace_step_writes_the_timeline_of_that_step(tmp_path, capsys):
    """``train.trace_step=N``: that step's per-layer timeline (every lane, each block's forward and
    backward on the compute lane) lands next to the metrics, and the log says where compute waited."""
    from megatrain_jax.cli import main as cli_main

    out = tmp_path / "run"
    rc = cli_main(["train", os.path.join(REPO, "configs/tiny.yaml"), *[x for s in SMALL + [
        f"train.out_dir={out}", "train.steps=3", "train.trace_step=2", "train.final_checkpoint=false"]
        for x in ("--set", s)]])
    assert rc == 0
    rec = json.loads((out / "timeline_step2.json").read_text())
    lanes = {e["lane"] for e in rec["events"]}
    assert {"h2d", "compute", "d2h", "optimizer"} <= lanes, lanes
    labels = {e["label"] for e in rec["events"] if e["lane"] == "compute"}
    assert {"fwd 0", "bwd 0"} <= labels, labels
    t0, t1 = rec["window_s"]
    assert 0 < rec["exposed_s"]["compute_busy"] <= t1 - t0
    assert "timeline of step 2" in capsys.readouterr().out
    assert not (out / "timeline_step1.json").exists() and not (out / "timeline_step3.json").exists()


def test_hooks_are_arguments_and_the_environment_is_not_read(tmp_path, monkeypatch):
    """Issue 25: ``train()`` takes its test hooks as ``TrainHooks``; the old MEGATRAIN_DEBUG_*
    variables do nothing in the production loop."""
    from megatrain_jax.config import load_config
    from megatrain_jax.train import TrainHooks, train

    monkeypatch.setenv("MEGATRAIN_DEBUG_NAN_STEPS", "1")
    cfg = load_config(os.path.join(REPO, "configs/tiny.yaml"), SMALL + [
        f"train.out_dir={tmp_path / 'run'}", "train.steps=3", "train.final_checkpoint=false"])
    summary = train(cfg, log=lambda _: None, hooks=TrainHooks(nan_steps=frozenset({2})))
    assert [r["skipped"] for r in _metrics(str(tmp_path / "run"))] == [False, True, False]
    assert summary["skipped_steps"] == 1


def test_reference_trainer_answers_the_trainer_interface(tmp_path):
    """The loop drives ``ReferenceTrainer`` as it drives ``Trainer``: step count, the schedule's
    learning rate (the host optimizer's), no saver, a memory device, close."""
    from megatrain_jax.config import load_config
    from megatrain_jax.engine import Batch
    from megatrain_jax.optim import build_host_optimizer
    from megatrain_jax.reference import ReferenceTrainer

    cfg = load_config(os.path.join(REPO, "configs/tiny.yaml"), SMALL + ["train.engine=reference", "train.steps=5"])
    rt = ReferenceTrainer.from_config(cfg)
    host = build_host_optimizer(cfg.optim, cfg.train.steps)
    assert rt.step_count == 0 and rt.saver(str(tmp_path), keep_last=2) is None and rt.memory_device is None
    assert [rt.lr_at(c) for c in (1, 3, 5)] == [float(host.lr_at(c)) for c in (1, 3, 5)]
    toks = np.random.default_rng(0).integers(0, 256, (4, 33)).astype(np.int32)
    res = rt.step(Batch(toks[:, :-1], toks[:, 1:]))
    assert rt.step_count == 1 and np.isfinite(res.loss)
    rt.close()
    assert os.listdir(tmp_path) == []


def test_from_hf_seq_len_above_max_position_embeddings_warns(tmp_path):
    """Issue 26 item 10: one warning line when data.seq_len exceeds the checkpoint's positions."""
    from megatrain_jax.config import Config
    from megatrain_jax.run_start import _warn_positions

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    cfg = Config()
    cfg.model.from_hf = str(tmp_path)
    logged = []
    cfg.data.seq_len = 4096
    _warn_positions(cfg, logged.append)
    assert logged == []
    cfg.data.seq_len = 8192
    _warn_positions(cfg, logged.append)
    assert len(logged) == 1 and logged[0].startswith("warning: data.seq_len=8192") and "4096" in logged[0]
