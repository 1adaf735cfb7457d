"""The ``megatrain-jax`` command line.

Every bad input must give exactly one line on stderr, ``error: FIELD: problem (fix: ...)``, exit
code 2, and leave nothing behind (no ``train.out_dir``, no other file). Those checks run in-process
through ``cli.main(argv)``; subprocesses (``cli_runner.run_cli``, sharing the compilation cache) are
kept where a real process matters: the module and console-script entry points.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from cli_runner import SHAKESPEARE, TINY, check_user_error, run_cli, run_in_process, sets, tree_snapshot

TINY_RUN = ("model.num_layers=1", "data.seq_len=32", "train.batch_size=2", "optim.schedule.warmup_steps=1",
            f"data.path={SHAKESPEARE}")


def _wordlevel_tokenizer(folder: str, n_words: int = 300) -> str:
    """A tokenizer.json whose ids go up to ``n_words`` (0 is [UNK], w1..wN are 1..N)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, n_words + 1)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = os.path.join(folder, "tokenizer.json")
    tok.save(path)
    return path


def _train(tmp_path, capsys, *overrides, config=TINY, extra=()):
    """``train CONFIG --set ... --set train.out_dir=<tmp>/run`` in-process, watching ``tmp_path``."""
    args = ["train", config, *sets(*overrides, f"train.out_dir={tmp_path / 'run'}"), *extra]
    return run_in_process(args, capsys, watch=str(tmp_path))


# (case name, field the error must name, --set overrides)
BAD_TRAIN = {
    "unknown_key": ("model.hiden_size", ["model.hiden_size=64"]),
    "heads_not_dividing_hidden": ("model.num_heads", ["model.num_heads=3", "model.num_kv_heads=null"]),
    "kv_heads_not_dividing_heads": ("model.num_kv_heads", ["model.num_kv_heads=3"]),
    "micro_batches_not_dividing_batch": ("train.micro_batches", ["train.batch_size=10", "train.micro_batches=4"]),
    "bad_value_type": ("train.steps", ["train.steps=abc"]),
    "unknown_compute_dtype": ("train.compute_dtype", ["train.compute_dtype=fp8"]),
    "unknown_optimizer_kernel": ("optim.kernel", ["optim.kernel=cuda"]),
    "override_without_equals": ("train.steps", ["train.steps"]),
    "override_not_yaml": ("train.steps", ["train.steps=[1"]),
    # numeric ranges (config.validate): refused before anything is imported or written
    "negative_lr": ("optim.lr", ["optim.lr=-1"]),
    "nan_beta2": ("optim.b2", ["optim.b2=.nan"]),
    "infinite_weight_decay": ("optim.weight_decay", ["optim.weight_decay=.inf"]),
    "end_lr_ratio_above_one": ("optim.schedule.end_lr_ratio", ["optim.schedule.end_lr_ratio=1.5"]),
    "max_bad_steps_zero": ("train.max_bad_steps", ["train.max_bad_steps=0"]),
    # issue 26 item 9: tiny.yaml warms up for 20 steps; 10 steps leave no room, and the fix names the field
    "warmup_above_steps": ("optim.schedule.warmup_steps", ["train.steps=10"]),
    "float_for_int": ("train.steps", ["train.steps=1.5"]),
}


@pytest.mark.parametrize("name", sorted(BAD_TRAIN))
def test_bad_config_input(tmp_path, capsys, name):
    field, overrides = BAD_TRAIN[name]
    line = check_user_error(_train(tmp_path, capsys, *overrides), field, str(tmp_path))
    if name == "unknown_key":
        assert "hidden_size" in line  # the fix lists the valid keys
    if name == "micro_batches_not_dividing_batch":
        assert "train.batch_size" in line and "multiple" in line
    if name == "negative_lr":
        assert "-1" in line and "> 0" in line, line
    if name == "warmup_above_steps":
        assert "(fix: set optim.schedule.warmup_steps below 10" in line and "train.steps" in line, line
    if name == "float_for_int":
        assert "give an int" in line, line


@pytest.mark.parametrize("name", ["prepared", "text"])
def test_token_id_not_below_vocab_size(tmp_path, capsys, name):
    """Data tokenized with a tokenizer whose ids reach 300, a model with 260 ids (a prepared prefix,
    and the same .txt tokenized at load time)."""
    from megatrain_jax.data import prepare

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    tok = _wordlevel_tokenizer(str(data_dir))
    text = data_dir / "corpus.txt"
    text.write_text(" ".join(f"w{1 + (i * 7) % 300}" for i in range(2000)) + " w300\n")
    prefix = str(data_dir / "corpus")
    if name == "prepared":
        assert prepare([str(text)], prefix, tokenizer=tok, quiet=True)["vocab_size"] == 301
    res = _train(tmp_path, capsys, "model.vocab_size=260", f"data.tokenizer={tok}",
                 f"data.path={prefix if name == 'prepared' else text}")
    line = check_user_error(res, "model.vocab_size", str(tmp_path))
    assert "token id 300" in line and "vocab_size is 260" in line, line
    assert "model.vocab_size >= 301" in line, line


def test_missing_data_file(tmp_path, capsys):
    line = check_user_error(_train(tmp_path, capsys, f"data.path={tmp_path}/nope.txt"), "data.path", str(tmp_path))
    assert "nope.txt" in line and "prepare" in line


def test_missing_config_file(tmp_path, capsys):
    line = check_user_error(_train(tmp_path, capsys, config=str(tmp_path / "nope.yaml")), "CONFIG", str(tmp_path))
    assert "nope.yaml" in line


@pytest.mark.parametrize("name", ["plan_negative_lr", "yaml_nan_lr"])
def test_numeric_range_errors_from_plan_and_yaml(tmp_path, capsys, name):
    if name == "plan_negative_lr":  # `plan` validates the same config
        res = run_in_process(["plan", TINY, *sets("optim.lr=-1", f"train.out_dir={tmp_path}/run")], capsys,
                             watch=str(tmp_path))
    else:  # YAML's .nan in a config file
        cfg = tmp_path / "nan_lr.yaml"
        cfg.write_text(f"base: {TINY}\noptim:\n  lr: .nan\n")
        res = _train(tmp_path, capsys, config=str(cfg))
    line = check_user_error(res, "optim.lr", str(tmp_path))
    assert ("-1" if name == "plan_negative_lr" else "nan") in line, line


# issue 26 item 5: config files that are not a mapping, bad base: chains, invalid YAML
BAD_CONFIG_FILES = {
    "top_level_list": ("- a\n- b\n", "CONFIG", "list at the top level"),
    "base_is_a_list": ("base: [tiny.yaml, tiny.yaml]\n", "base", "must be one file name"),
    "base_names_itself": ("base: bad.yaml\n", "CONFIG", "already in the chain of bases"),
    "invalid_yaml": ("train:\n  steps: 3\n  out_dir: [\n", "CONFIG", "bad.yaml:4:1: not valid YAML"),
    "missing_base": ("base: nope.yaml\n", "CONFIG", "(named by base: in"),
}


@pytest.mark.parametrize("name", sorted(BAD_CONFIG_FILES))
def test_bad_config_files_are_one_line(tmp_path, capsys, name):
    text, field, want = BAD_CONFIG_FILES[name]
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    line = check_user_error(_train(tmp_path, capsys, config=str(cfg)), field, str(tmp_path))
    assert want in line, line
    if name == "missing_base":
        assert "nope.yaml" in line and "bad.yaml" in line, line


def test_prepare_with_a_missing_input(tmp_path, capsys):
    res = run_in_process(["prepare", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "out")], capsys,
                         watch=str(tmp_path))
    line = check_user_error(res, "INPUTS", str(tmp_path))
    assert "nope.txt" in line


# ---------------------------------------------------------------------- out_dir and data: before anything


@pytest.mark.parametrize("case", ["existing_file", "under_a_file", "read_only"])
def test_unusable_out_dir_is_one_line_before_the_plan(tmp_path, capsys, monkeypatch, case):
    """Issue 26 item 3: a file, a path under a file, an unwritable directory (with checkpoints on:
    once reported as "disk: ... 0.0 GB is free"): one line naming train.out_dir, before any plan
    output, nothing created."""
    (tmp_path / "afile").write_text("x")
    out = {"existing_file": tmp_path / "afile", "under_a_file": tmp_path / "afile" / "run",
           "read_only": tmp_path / "ro" / "run"}[case]
    if case == "read_only":
        import tempfile

        (tmp_path / "ro").mkdir()

        def read_only(*a, **k):
            raise OSError(errno.EROFS, "Read-only file system")

        monkeypatch.setattr(tempfile, "mkstemp", read_only)
    before = sorted(os.listdir(tmp_path))
    res = run_in_process(["train", TINY, *sets(*TINY_RUN, "train.steps=3", f"train.out_dir={out}")], capsys)
    line = check_user_error(res, "train.out_dir")
    assert {"existing_file": "is an existing file", "under_a_file": "which is a file",
            "read_only": "Read-only file system"}[case] in line, line
    assert sorted(os.listdir(tmp_path)) == before, os.listdir(tmp_path)
    if case == "read_only":
        assert os.listdir(tmp_path / "ro") == []


def test_out_dir_check_leaves_nothing(tmp_path):
    """The write probe is removed, a new out_dir is not created by the check, and a directory that
    cannot hold files (procfs here, as a read-only filesystem would) is refused for real."""
    from megatrain_jax.errors import UserError
    from megatrain_jax.run_start import check_out_dir

    check_out_dir(str(tmp_path / "new" / "run"))
    check_out_dir(str(tmp_path))
    assert os.listdir(tmp_path) == []
    if os.path.isdir("/proc/self"):
        with pytest.raises(UserError, match="cannot be written"):
            check_out_dir("/proc/self/megatrain-run")


# ---------------------------------------------------------------------- where a run may write (issue 47)


def _user_workspace(root):
    """A user's folder: runs/base30 (checkpoints/step_00000030 and its config.yaml), runs/opt-lion (only the
    config.yaml train writes first), notes/ (another tool's config.yaml), data/ (the input text and a
    prepared data set), configs/tiny.yaml."""
    import yaml

    from megatrain_jax.config import Config

    step = root / "runs" / "base30" / "checkpoints" / "step_00000030"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text("{}")
    (step / "state.json").write_text("{}")
    (root / "runs" / "opt-lion").mkdir()
    for run in ("base30", "opt-lion"):  # the config.yaml train writes (every section of the config)
        (root / "runs" / run / "config.yaml").write_text(yaml.safe_dump(Config().to_dict(), sort_keys=False))
    (root / "notes").mkdir()  # another tool's config.yaml: not a run
    (root / "notes" / "config.yaml").write_text("model: {name: other}\ntrain: {epochs: 3}\n")
    (root / "data").mkdir()
    shutil.copy(SHAKESPEARE, root / "data" / "tiny.txt")
    (root / "data" / "other.json").write_text("{}")
    (root / "data" / "other.tokens.bin").write_bytes(b"\0" * 8)
    (root / "configs").mkdir()
    shutil.copy(TINY, root / "configs" / "tiny.yaml")
    return root


# (field, overrides, what the line names): every one refused before anything is read, whatever else is set
BAD_PLACES = {
    "out_dir_a_checkpoint_of_another_run": ("train.out_dir", ["train.out_dir=runs/base30/checkpoints/step_00000030"],
                                            "base30"),
    "out_dir_inside_another_run": ("train.out_dir", ["train.out_dir=runs/base30/sub"], "base30"),
    "out_dir_inside_a_run_by_its_config": ("train.out_dir", ["train.out_dir=runs/opt-lion/inner"], "opt-lion"),
    "out_dir_the_folder_of_runs": ("train.out_dir", ["train.out_dir=runs"], "base30"),
    "out_dir_the_folder_of_the_data": ("train.out_dir", ["train.out_dir=data"], "tiny.txt"),
    "out_dir_the_folder_of_the_config": ("train.out_dir", ["train.out_dir=configs"], "tiny.yaml"),
    "out_dir_the_workspace": ("train.out_dir", ["train.out_dir=."], "contains"),
    "export_into_another_run": ("train.export", ["train.out_dir=runs/new", "train.export=runs/base30/export"],
                                "base30"),
    "export_into_a_run_by_its_config": ("train.export", ["train.out_dir=runs/new", "train.export=runs/opt-lion/hf"],
                                        "opt-lion"),
    "export_the_folder_of_runs": ("train.export", ["train.out_dir=new_run", "train.export=runs"], "base30"),
    "export_into_its_own_checkpoints": ("train.export", ["train.out_dir=runs/new",
                                                         "train.export=runs/new/checkpoints/hf"], "checkpoints"),
    "export_over_the_data": ("train.export", ["train.out_dir=runs/new", "train.export=data"], "data"),
}


@pytest.mark.parametrize("name", sorted(BAD_PLACES))
def test_a_run_never_writes_into_another_run_its_folder_or_its_inputs(tmp_path, capsys, monkeypatch, name):
    """Issue 47 items 2 and 3: `train.out_dir=runs/base30/checkpoints/step_00000030` trained a whole run
    into that checkpoint (base30's next --resume removed it by retention), `train.out_dir=runs` and
    `train.out_dir=data` were accepted, `train.export=runs/base30/export` too. Now: one line naming the
    field, exit 2, the workspace byte-identical (nothing read first, nothing written)."""
    field, overrides, needle = BAD_PLACES[name]
    ws = _user_workspace(tmp_path / "ws")
    monkeypatch.chdir(ws)
    before = tree_snapshot(ws)
    res = run_in_process(["train", "configs/tiny.yaml", *sets(*TINY_RUN[:-1], "data.path=data/tiny.txt",
                                                               "optim.schedule.warmup_steps=0",
                                                               "train.steps=1", "train.final_checkpoint=false",
                                                               *overrides)], capsys)
    line = check_user_error(res, field)
    assert needle in line, line
    assert tree_snapshot(ws) == before


def test_a_run_may_write_beside_runs_and_export_inside_itself(tmp_path, monkeypatch):
    """The rule's other side: a new run beside the others (runs/new), its export inside it (the
    documented <out_dir>/export) or beside it, a data set beside the data; an existing run as its own."""
    from megatrain_jax.atomic import check_place, check_train_outputs

    ws = _user_workspace(tmp_path / "ws")
    monkeypatch.chdir(ws)
    inputs = ["configs/tiny.yaml", "data/tiny.txt"]
    check_train_outputs("runs/new", "runs/new/export", inputs)
    check_train_outputs("runs/new", "exports/new", inputs)
    check_train_outputs("runs/base30", "runs/base30/export", inputs)  # --resume: its own run
    check_place("data/new", inputs=["y.json"], field="--out", files=["data/new.json", "data/new.tokens.bin"])
    check_place("notes/out", field="OUT")  # beside another tool's config.yaml


@pytest.mark.parametrize("case", ["seq_len_above_data", "batch_above_data"])
def test_data_too_small_writes_nothing(tmp_path, capsys, case):
    """Issue 26 item 4: data too small for one batch is refused before config.yaml, metrics.jsonl,
    checkpoints/ or TensorBoard files are written; a sequence longer than the data names data.seq_len
    (it was refused as host memory with a fix naming optim.moments)."""
    small = tmp_path / "small.txt"
    small.write_text("hello world, this is a 40-byte text file\n")
    if case == "seq_len_above_data":
        res = _train(tmp_path, capsys, "data.seq_len=2000000", "optim.schedule.warmup_steps=1", "train.steps=3")
        line = check_user_error(res, "data.seq_len", str(tmp_path))
        assert "tinyshakespeare.txt has 1,115,394 tokens" in line and "at most 1115393" in line, line
    else:
        res = _train(tmp_path, capsys, f"data.path={small}", "data.seq_len=8", "optim.schedule.warmup_steps=1",
                     "train.steps=3")
        line = check_user_error(res, "train.batch_size", str(tmp_path))
        assert "fewer than train.batch_size=16" in line, line


# ---------------------------------------------------------------------- plan


def test_plan_json_scaling_and_devices(tmp_path, capsys):
    """Issue 26 item 8: --json --scaling carries the scaling rows; --devices 0 is refused."""
    res = run_in_process(["plan", TINY, "--json", "--scaling"], capsys)
    assert res.rc == 0, str(res)
    rows = json.loads(res.stdout)["scaling"]
    assert [r["gpus"] for r in rows] == [1, 2, 4, 8] and all(r["step_s"] > 0 for r in rows), rows
    res = run_in_process(["plan", TINY, "--devices", "0"], capsys, watch=str(tmp_path))
    line = check_user_error(res, "--devices", str(tmp_path))
    assert "got 0" in line, line


def test_plan_for_a_described_machine(capsys):
    """Issue 27 item 4: plan for a machine you are not on, from this CPU-only one: planned as a GPU run with
    the given GPU and host memory; a bad value is one line naming the flag."""
    res = run_in_process(["plan", "configs/7b.yaml", "--json", "--gpu-memory-gb", "80", "--host-memory-gb", "256",
                          "--pcie-gbps", "25", "--gpu-tflops", "165"], capsys)
    p = json.loads(res.stdout)
    assert p["machine"]["backend"] == "gpu" and p["host_limit"] == 256e9, p["machine"]
    assert p["gpu_budget"] <= 80e9 and res.rc == 0, str(res)
    assert not any("device buffers" in r["what"] for r in p["rows"])  # not host memory on a GPU target
    small = run_in_process(["plan", "configs/7b.yaml", "--json", "--gpu-memory-gb", "80", "--host-memory-gb", "64"],
                           capsys)
    assert small.rc == 2 and json.loads(small.stdout)["host_limit"] == 64e9
    res = run_in_process(["plan", TINY, "--gpu-memory-gb", "-3"], capsys)
    check_user_error(res, "--gpu-memory-gb")


# ---------------------------------------------------------------------- real processes and runs


def test_help(capsys):
    res = run_in_process(["--help"], capsys)
    assert res.rc == 0, str(res)
    for cmd in ("train", "prepare", "convert", "export"):
        assert cmd in res.stdout
    res = run_in_process(["train", "--help"], capsys)
    assert res.rc == 0 and "--set" in res.stdout and "--resume" in res.stdout, str(res)


def test_module_entry_point_gives_one_line_errors(tmp_path, cli_env):
    """``python -m megatrain_jax``: a real process exits 2 with the one line (stderr, no traceback)."""
    res = run_cli(["train", TINY, *sets("optim.lr=-1", "train.out_dir=run")], cwd=str(tmp_path), env=cli_env)
    check_user_error(res, "optim.lr", str(tmp_path))


def test_console_script_help(cli_env):
    exe = os.path.join(os.path.dirname(sys.executable), "megatrain-jax")
    if not os.path.isfile(exe):
        exe = shutil.which("megatrain-jax")
    if not exe:
        pytest.skip("the megatrain-jax console script is not installed")
    p = subprocess.run([exe, "--help"], env=cli_env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "usage: megatrain-jax" in p.stdout, p.stderr


def test_happy_path_trains_and_logs(tmp_path, capsys):
    res = _train(tmp_path, capsys, *TINY_RUN, "train.steps=3", "train.log_every=1")
    assert res.rc == 0, str(res)
    step_lines = [ln for ln in res.stdout.splitlines() if ln.startswith("step ")]
    assert len(step_lines) == 3, str(res)  # log_every=1
    for ln in step_lines:
        assert "loss" in ln and "tokens/s" in ln and "model TFLOPS" in ln, ln
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        recs = [json.loads(ln) for ln in f if ln.strip()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert r["loss"] == r["loss"] and 0 < r["loss"] < 20  # finite, near ln(256) = 5.5
        assert r["tokens_per_s"] > 0 and r["model_tflops"] > 0 and r["skipped"] is False
    assert os.path.isfile(tmp_path / "run" / "config.yaml")


def test_relative_out_dir_saves_resumes_and_exports(tmp_path, capsys, monkeypatch):
    """The README's own command uses a relative train.out_dir; orbax wants absolute paths."""
    monkeypatch.chdir(tmp_path)
    args = sets(*TINY_RUN, "train.out_dir=rel_run", "train.ckpt_every=2")
    first = run_in_process(["train", TINY, *sets("train.steps=2"), *args], capsys)
    assert first.rc == 0, str(first)
    resumed = run_in_process(["train", TINY, *sets("train.steps=3"), "--resume", *args], capsys)
    assert resumed.rc == 0, str(resumed)
    exported = run_in_process(["export", "rel_run", "rel_export"], capsys)
    assert exported.rc == 0, str(exported)
    assert os.path.isdir(tmp_path / "rel_export")


# ------------------------------------------------------------------ nothing lost, round three (issue 66)

RUN3 = (*TINY_RUN, "train.ckpt_every=1", "train.keep_last=3", "train.log_every=1", "train.steps=3")


@pytest.fixture(scope="module")
def run3(tmp_path_factory):
    """A run of 3 steps with a checkpoint after each, whose saves are slower than its steps (each group's
    write waits 0.2 s): the run the damage below is done to, each test on its own copy."""
    import time

    from megatrain_jax import checkpoint as ck
    from megatrain_jax.cli import main

    real = ck.checkpointer

    class Slow:
        def __init__(self):
            self.inner = real()

        def save(self, *a, **kw):
            time.sleep(0.2)
            return self.inner.save(*a, **kw)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    out = tmp_path_factory.mktemp("run3") / "run"
    import contextlib
    import io

    buf = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(buf):
        mp.setattr(ck, "checkpointer", Slow)
        rc = main(["train", TINY, *sets(*RUN3, f"train.out_dir={out}")])
    assert rc == 0, buf.getvalue()
    return out, buf.getvalue()


def _copy_run(run3, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(run3[0], dst)
    return dst


def test_every_committed_save_is_reported_also_when_saves_are_slower_than_steps(run3):
    out, stdout = run3
    for step in (1, 2, 3):
        assert f"checkpoint: step {step} saved to" in stdout, stdout


def test_a_checkpoint_without_its_manifest_is_set_aside_and_its_step_saved_again(run3, tmp_path, capsys):
    """Issue 66 item 1: export and --resume name the incomplete newest checkpoint and the step they take; the
    resumed run saves that step anew (the done line names a checkpoint it wrote); a changed optimizer field is
    warned about."""
    run = _copy_run(run3, tmp_path)
    step3 = run / "checkpoints" / "step_00000003"
    os.remove(step3 / "manifest.json")
    exp = run_in_process(["export", str(run), str(tmp_path / "exported")], capsys)
    assert exp.rc == 0 and f"export: skipping {step3}: not a complete checkpoint (no manifest.json); exporting step 2" \
        in exp.stdout, str(exp)
    res = run_in_process(["train", TINY, *sets(*RUN3, f"train.out_dir={run}", "optim.lr=0.002"), "--resume"], capsys)
    assert res.rc == 0, str(res)
    assert f"checkpoint: {step3} is corrupted or incomplete (no manifest.json); moved it to {step3}.corrupt; " \
           "falling back to the previous checkpoint: resuming from step 2" in res.stdout, str(res)
    assert "warning: optim.lr was" in res.stdout and "now 0.002" in res.stdout, str(res)
    assert os.path.isfile(step3 / "manifest.json") and f"checkpoint {step3}" in res.stdout, str(res)
    assert sorted(os.listdir(run / "checkpoints")) == ["step_00000001", "step_00000002", "step_00000003",
                                                       "step_00000003.corrupt"]


def test_a_second_command_in_a_run_directory_is_refused_and_touches_nothing(run3, tmp_path, capsys):
    """Issue 66 item 2: while one command holds the run (the lock, taken here as a first command would), a second
    `train --resume` or a fresh `train` into it is one line naming the holder, exit 2, and nothing of the run is
    moved or rewritten."""
    from megatrain_jax.atomic import RunLock

    run = _copy_run(run3, tmp_path)
    lock = RunLock(str(run))
    try:
        before = tree_snapshot(run)
        for extra in (["--resume"], []):
            res = run_in_process(["train", TINY, *sets(*RUN3, f"train.out_dir={run}"), *extra], capsys)
            lines = res.error_lines()
            assert res.rc == 2 and len(lines) == 1, str(res)
            assert f"is in use: process {os.getpid()}" in lines[0] or "already holds checkpoints" in lines[0], lines
            assert tree_snapshot(run) == before
    finally:
        lock.release()
    res = run_in_process(["train", TINY, *sets(*RUN3, f"train.out_dir={run}"), "--resume"], capsys)
    assert res.rc == 0, str(res)  # released: the run continues (nothing left to do at step 3)


def test_a_full_disk_while_training_is_one_line_naming_the_newest_checkpoint(run3, tmp_path, capsys, monkeypatch):
    """Issue 66 item 3: the disk fills while training (the metrics' write fails with ENOSPC): one line naming the
    file and the newest complete checkpoint, exit 2, no traceback, and that checkpoint loads."""
    import errno

    from megatrain_jax import checkpoint_read as ckr
    from megatrain_jax.metrics import MetricsWriter

    run = _copy_run(run3, tmp_path)
    real = MetricsWriter.write

    def full(self, record):
        if record.get("step", 0) >= 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, record)

    monkeypatch.setattr(MetricsWriter, "write", full)
    res = run_in_process(["train", TINY, *sets(*RUN3, f"train.out_dir={run}", "train.steps=6", "train.ckpt_every=0",
                                               "train.final_checkpoint=false"), "--resume"], capsys)
    lines = res.error_lines()
    assert res.rc == 2 and len(lines) == 1 and "Traceback" not in res.stderr, str(res)
    step3 = run / "checkpoints" / "step_00000003"
    assert lines[0].startswith("error: disk: writing ") and "the disk is full" in lines[0], lines
    assert f"newest complete checkpoint {step3} (step 3) is intact" in lines[0], lines
    ckr.load_checkpoint_arrays(str(step3))


def test_the_tensorboard_writer_failing_is_raised_in_the_loop_never_from_its_thread(tmp_path):
    """A full disk under the TensorBoard writer: its thread keeps the error (no traceback from a thread), the
    next record raises it naming the folder, and close() closes both files before raising."""
    import errno

    from megatrain_jax.metrics import MetricsWriter, _GuardedEvents

    w = MetricsWriter(str(tmp_path / "metrics.jsonl"), tensorboard=True)

    class Full:
        def write_event(self, event):
            raise OSError(errno.ENOSPC, "No space left on device")

        flush = close = write_event

    guard = _GuardedEvents(Full(), w)
    guard.write_event(None)
    assert isinstance(w.tb_error, OSError) and w.tb_error.filename == w.tb_dir
    with pytest.raises(OSError) as e:
        w.write({"step": 1, "loss": 1.0})
    assert e.value.errno == errno.ENOSPC
    with pytest.raises(OSError):
        w.close()
    assert w._f.closed


def test_io_failures_of_export_and_prepare_are_one_line_and_leave_nothing(run3, tmp_path, capsys, monkeypatch):
    """Issue 66 items 4-5: export onto a read-only folder or a full disk, prepare onto a full disk: one line naming
    the output, exit 2, no temporary left; a killed writer's temporaries are removed by the next one."""
    import errno

    from megatrain_jax.data import packed

    ro = tmp_path / "ro"
    ro.mkdir()
    real_makedirs = os.makedirs

    def read_only(path, *a, **kw):
        if str(path).startswith(str(ro)):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_makedirs(path, *a, **kw)

    with monkeypatch.context() as mp:
        mp.setattr(os, "makedirs", read_only)
        line = check_user_error(run_in_process(["export", str(run3[0]), str(ro / "out")], capsys), "OUT")
    assert "read-only" in line and str(ro / "out") in line
    real_commit = packed.PackedWriter.commit

    def full(self, extra):
        raise OSError(errno.ENOSPC, "No space left on device")

    (tmp_path / "ds.tokens.bin.tmp999999999").write_bytes(b"left by a killed prepare")
    with monkeypatch.context() as mp:
        mp.setattr(packed.PackedWriter, "commit", full)
        line = check_user_error(run_in_process(["prepare", SHAKESPEARE, "--out", str(tmp_path / "ds"), "--quiet"],
                                               capsys), "--out")
    assert "the disk is full" in line and str(tmp_path / "ds") in line
    assert sorted(os.listdir(tmp_path)) == ["ro"], os.listdir(tmp_path)
    assert real_commit is packed.PackedWriter.commit


def test_plan_refusals_and_fixes_that_work(capsys):
    """Issue 66 items 6, 7, 9, 10: an infinite size is refused in one line; a plan for a described machine states
    the cores, GPU and link it assumed (never this machine's cores); sizes below 1 GB are in MB; a refusal's closest
    placement names only settings --set takes."""
    from megatrain_jax.plan.units import size_text

    line = check_user_error(run_in_process(["plan", "configs/7b.yaml", "--gpu-memory-gb", "inf",
                                            "--host-memory-gb", "inf"], capsys), "--gpu-memory-gb")
    assert "finite" in line
    res = run_in_process(["plan", TINY, "--gpu-memory-gb", "141", "--host-memory-gb", "512"], capsys)
    assert res.rc == 0, str(res)
    machine = next(ln for ln in res.stdout.splitlines() if ln.startswith("machine (described):"))
    assert "16 CPU cores (assumed" in machine and "host<->GPU link 52 GB/s" in machine and "141 GB" in machine
    res = run_in_process(["plan", TINY, "--gpu-memory-gb", "141", "--cpu-cores", "32"], capsys)
    assert "32 CPU cores (--cpu-cores)" in res.stdout, str(res)
    assert size_text(0.04e9) == "40.0 MB" and size_text(2.5e9) == "2.5 GB"
    table = [ln for ln in res.stdout.splitlines() if ln.startswith(("┏", "│", "└"))]
    assert table and max(len(ln) for ln in table) <= 100  # (no terminal here: 100 columns)


def test_config_and_data_small_ones(tmp_path, capsys):
    """Issue 66 items 11 and 14: --set into a section a base: left empty; a duplicate YAML key refused; a BOM
    is no token; --version; the ETA as h:mm:ss."""
    from megatrain_jax.config import load_config
    from megatrain_jax.data import load_dataset
    from megatrain_jax.train import _eta

    (tmp_path / "child.yaml").write_text(f"base: {os.path.join(os.path.dirname(TINY), 'tiny.yaml')}\n")
    assert load_config(str(tmp_path / "child.yaml"), ["model.lora.rank=4"]).model.lora.rank == 4
    (tmp_path / "dup.yaml").write_text("train:\n  steps: 5\n  log_every: 1\n  steps: 7\n")
    line = check_user_error(run_in_process(["plan", str(tmp_path / "dup.yaml")], capsys), "CONFIG")
    assert "dup.yaml:4" in line and "'steps' appears twice" in line
    text = "To be, or not to be, that is the question. " * 40
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf" + text.encode())
    cfg = load_config(TINY, ["data.seq_len=16", f"data.path={tmp_path / 'bom.txt'}"])
    ds = load_dataset(cfg.data, 256)
    assert bytes(np.asarray(ds.tokens[:5])) == b"To be"
    assert run_in_process(["prepare", str(tmp_path / "bom.txt"), "--out", str(tmp_path / "p"), "--quiet"],
                          capsys).rc == 0
    dtype = json.loads((tmp_path / "p.json").read_text())["dtype"]
    assert bytes(np.fromfile(tmp_path / "p.tokens.bin", dtype=dtype)[:5].astype(np.uint8)) == b"To be"
    res = run_in_process(["--version"], capsys)
    assert res.rc == 0 and res.stdout.startswith("megatrain-jax "), str(res)
    assert _eta(90061) == "1d 1:01:01" and _eta(3725) == "1:02:05" and _eta(float("nan")) == "?"


def test_fixes_name_what_set_takes_and_what_can_work(tmp_path, capsys):
    """Issue 66 items 8-9: the closest placement of a refusal is written as --set overrides that load (the plan's
    own grad_hold_gpu_groups is no setting); with model.from_hf, data whose ids pass its vocabulary is refused
    naming the data and the model's tokenizer (its config.json sets vocab_size), and the override notice is one
    line of output, not a Python warning."""
    import warnings

    from megatrain_jax.config import load_config
    from megatrain_jax.placements import PINNED_ACTIVATIONS, PINNED_HOST
    from megatrain_jax.plan.decisions import Candidate, Placement
    from megatrain_jax.plan.search import describe

    cand = Candidate(4, PINNED_ACTIVATIONS, PINNED_HOST, boundary_every=2, stream_io=True, loss_chunk=1024,
                     grad_hold_gpu_groups=5, activations_gpu_blocks=3)
    words = describe(Placement(cand, {}, [], 0.0, False)).split()
    assert not any("grad_hold_gpu_groups" in w for w in words), words
    load_config(TINY, words)  # every one a key --set takes
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "max_position_embeddings": 128}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = _train(tmp_path, capsys, *TINY_RUN, f"model.from_hf={hf}", "model.hidden_size=64")
    line = check_user_error(res, "data.path") if not res.stdout.strip() else res.error_lines()[0]
    assert res.rc == 2 and line.startswith("error: data.path: ") and "tokenizer" in line and "vocab_size >=" not in line
    assert "warning: model.from_hf: the checkpoint's config.json overrides the YAML for hidden_size=64 -> 32" \
        in res.stdout, str(res)


def test_ctrl_c_stops_prepare_within_a_second_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    """Issue 66 item 14: a Ctrl-C while a tokenizer encodes a long text (a native call of many seconds) stops
    prepare at once: exit 130, no file of the data set and no temporary left."""
    import _thread
    import threading
    import time

    from megatrain_jax.data import pipeline

    class SlowTokenizer:
        vocab_size, eos_id, path = 300, None, None

        def encode_batch(self, texts):
            time.sleep(30)  # (a long encode: the thread that calls it is held, the GIL is not)
            return [np.zeros(len(t), np.uint32) for t in texts]

        def describe(self):
            return {"kind": "test"}

    monkeypatch.setattr(pipeline, "load_tokenizer", lambda spec, field: SlowTokenizer())
    threading.Timer(0.3, _thread.interrupt_main).start()
    t0 = time.perf_counter()
    res = run_in_process(["prepare", SHAKESPEARE, "--out", str(tmp_path / "ds"), "--tokenizer", "x.json"], capsys)
    assert time.perf_counter() - t0 < 1.5 and res.rc == 130, str(res)
    assert os.listdir(tmp_path) == []
