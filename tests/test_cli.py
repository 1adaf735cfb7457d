"""The ``megatrain-jax`` command line, run as a subprocess.

Every bad input must give exactly one line on stderr, ``error: FIELD: problem (fix: ...)``, exit
code 2, and leave nothing behind (no ``train.out_dir``, no other file). Each subprocess imports JAX
(~2-4 s), so all of them are started at once from one module fixture, a few in parallel, and the
tests below only check their results.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "tiny.yaml")
SHAKESPEARE = os.path.join(REPO, "data", "tinyshakespeare.txt")
TIMEOUT_S = 240
WORKERS = 4

# lines JAX / absl / XLA may print on their own (not ours): absl's "W0101 12:00:00.000 ..." format,
# Python warnings and the CPU-fallback notice
_NOISE = re.compile(r"^([IWE]\d{4} |WARNING|.*(Warning|warnings\.warn)|An NVIDIA GPU may be present|Platform '\w+' is)")


@dataclass
class Result:
    args: list[str]
    rc: int
    stdout: str
    stderr: str
    files_before: list[str]
    files_after: list[str]

    def error_lines(self) -> list[str]:
        return [ln for ln in self.stderr.splitlines()
                if ln.strip() and (ln.startswith("error:") or not _NOISE.match(ln))]

    def __str__(self) -> str:
        return f"args={self.args}\nrc={self.rc}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


def _listing(folder: str) -> list[str]:
    out = []
    for root, dirs, files in os.walk(folder):
        for n in dirs + files:
            out.append(os.path.relpath(os.path.join(root, n), folder))
    return sorted(out)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(args: list[str], cwd: str) -> Result:
    before = _listing(cwd)
    p = subprocess.run([sys.executable, "-m", "megatrain_jax", *args], cwd=cwd, env=_env(), capture_output=True,
                       text=True, timeout=TIMEOUT_S)
    return Result(args, p.returncode, p.stdout, p.stderr, before, _listing(cwd))


def _wordlevel_tokenizer(folder: str, n_words: int = 300) -> str:
    """A tokenizer.json whose ids go up to ``n_words`` (0 is [UNK], w1..wN are 1..N)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, n_words + 1)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = os.path.join(folder, "tokenizer.json")
    tok.save(path)
    return path


# (case name, field the error must name, --set overrides or full argv builder)
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
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Run every CLI case once, in parallel; returns {case: (Result, case_dir)}."""
    base = tmp_path_factory.mktemp("cli")
    jobs: dict[str, tuple[list[str], str]] = {}

    def case_dir(name: str) -> str:
        d = os.path.join(base, name)
        os.makedirs(d)
        return d

    # the slowest first: one real (short) training run
    d = case_dir("happy")
    jobs["happy"] = (["train", TINY, "--set", "train.steps=3", "--set", "model.num_layers=1", "--set", "data.seq_len=32",
                      "--set", "train.batch_size=2", "--set", "train.log_every=1",
                      # tiny.yaml warms up for 20 steps; a warmup_cosine schedule needs warmup < train.steps
                      "--set", "optim.schedule.warmup_steps=1",
                      "--set", f"data.path={SHAKESPEARE}", "--set", f"train.out_dir={d}/run"], d)

    # token id >= vocab: data tokenized with a tokenizer whose ids reach 300, a model with 260 ids
    d = case_dir("token_id_ge_vocab_prepared")
    data_dir = os.path.join(base, "vocab_data")
    os.makedirs(data_dir)
    tok = _wordlevel_tokenizer(data_dir)
    text = os.path.join(data_dir, "corpus.txt")
    with open(text, "w") as f:
        f.write(" ".join(f"w{1 + (i * 7) % 300}" for i in range(2000)) + " w300\n")
    from megatrain_jax.data import prepare

    prefix = os.path.join(data_dir, "corpus")
    index = prepare([text], prefix, tokenizer=tok, quiet=True)
    assert index["vocab_size"] == 301
    vocab_sets = ["--set", "model.vocab_size=260", "--set", f"data.tokenizer={tok}"]
    jobs["token_id_ge_vocab_prepared"] = (["train", TINY, *vocab_sets, "--set", f"data.path={prefix}",
                                           "--set", f"train.out_dir={d}/run"], d)
    d = case_dir("token_id_ge_vocab_text")  # the same .txt, tokenized at load time
    jobs["token_id_ge_vocab_text"] = (["train", TINY, *vocab_sets, "--set", f"data.path={text}",
                                       "--set", f"train.out_dir={d}/run"], d)

    d = case_dir("missing_data_file")
    jobs["missing_data_file"] = (["train", TINY, "--set", f"data.path={d}/nope.txt",
                                  "--set", f"train.out_dir={d}/run"], d)
    d = case_dir("missing_config_file")
    jobs["missing_config_file"] = (["train", os.path.join(d, "nope.yaml"), "--set", f"train.out_dir={d}/run"], d)
    for name, (_, sets) in BAD_TRAIN.items():
        d = case_dir(name)
        argv = ["train", TINY]
        for s in sets:
            argv += ["--set", s]
        jobs[name] = (argv + ["--set", f"train.out_dir={d}/run"], d)

    d = case_dir("plan_negative_lr")  # `plan` validates the same config
    jobs["plan_negative_lr"] = (["plan", TINY, "--set", "optim.lr=-1", "--set", f"train.out_dir={d}/run"], d)
    d = case_dir("yaml_nan_lr")  # YAML's .nan in a config file
    nan_yaml = os.path.join(base, "nan_lr.yaml")
    with open(nan_yaml, "w") as f:
        f.write(f"base: {TINY}\noptim:\n  lr: .nan\n")
    jobs["yaml_nan_lr"] = (["train", nan_yaml, "--set", f"train.out_dir={d}/run"], d)

    d = case_dir("prepare_missing_input")
    jobs["prepare_missing_input"] = (["prepare", os.path.join(d, "nope.txt"), "--out", os.path.join(d, "out")], d)
    jobs["help"] = (["--help"], case_dir("help"))
    jobs["train_help"] = (["train", "--help"], case_dir("train_help"))

    with ThreadPoolExecutor(WORKERS) as pool:
        futs = {name: pool.submit(_run, argv, cwd) for name, (argv, cwd) in jobs.items()}
        return {name: (f.result(), jobs[name][1]) for name, f in futs.items()}


def _check_user_error(res: Result, case_dir: str, field: str) -> str:
    assert res.rc == 2, str(res)
    lines = res.error_lines()
    assert len(lines) == 1, f"expected one error line:\n{res}"
    line = lines[0]
    assert line.startswith(f"error: {field}: "), f"does not name {field!r}:\n{res}"
    assert "(fix: " in line and line.rstrip().endswith(")"), str(res)
    assert "Traceback" not in res.stderr, str(res)
    assert res.stdout.strip() == "", f"nothing but the error expected:\n{res}"
    # nothing half-written: no out_dir, no file at all appeared in the case's (working) directory
    assert not os.path.exists(os.path.join(case_dir, "run")), str(res)
    assert res.files_after == res.files_before, f"{res.files_before} -> {res.files_after}\n{res}"
    return line


@pytest.mark.parametrize("name", sorted(BAD_TRAIN))
def test_bad_config_input(results, name):
    res, d = results[name]
    field = BAD_TRAIN[name][0]
    line = _check_user_error(res, d, field)
    if name == "unknown_key":
        assert "hidden_size" in line  # the fix lists the valid keys
    if name == "micro_batches_not_dividing_batch":
        assert "train.batch_size" in line and "multiple" in line
    if name == "negative_lr":
        assert "-1" in line and "> 0" in line, line


@pytest.mark.parametrize("name", ["token_id_ge_vocab_prepared", "token_id_ge_vocab_text"])
def test_token_id_not_below_vocab_size(results, name):
    res, d = results[name]
    line = _check_user_error(res, d, "model.vocab_size")
    assert "token id 300" in line and "vocab_size is 260" in line, line
    assert "model.vocab_size >= 301" in line, line


def test_missing_data_file(results):
    res, d = results["missing_data_file"]
    line = _check_user_error(res, d, "data.path")
    assert "nope.txt" in line and "prepare" in line


def test_missing_config_file(results):
    res, d = results["missing_config_file"]
    line = _check_user_error(res, d, "CONFIG")
    assert "nope.yaml" in line


@pytest.mark.parametrize("name", ["plan_negative_lr", "yaml_nan_lr"])
def test_numeric_range_errors_from_plan_and_yaml(results, name):
    res, d = results[name]
    line = _check_user_error(res, d, "optim.lr")
    assert ("-1" if name == "plan_negative_lr" else "nan") in line, line


def test_prepare_with_a_missing_input(results):
    res, d = results["prepare_missing_input"]
    line = _check_user_error(res, d, "INPUTS")
    assert "nope.txt" in line


def test_help(results):
    res, _ = results["help"]
    assert res.rc == 0, str(res)
    for cmd in ("train", "prepare", "convert", "export"):
        assert cmd in res.stdout
    res, _ = results["train_help"]
    assert res.rc == 0 and "--set" in res.stdout and "--resume" in res.stdout, str(res)


def test_console_script_help():
    exe = os.path.join(os.path.dirname(sys.executable), "megatrain-jax")
    if not os.path.isfile(exe):
        exe = shutil.which("megatrain-jax")
    if not exe:
        pytest.skip("the megatrain-jax console script is not installed")
    p = subprocess.run([exe, "--help"], env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert p.returncode == 0 and "usage: megatrain-jax" in p.stdout, p.stderr


def test_happy_path_trains_and_logs(results):
    res, d = results["happy"]
    assert res.rc == 0, str(res)
    assert "Traceback" not in res.stderr, str(res)
    step_lines = [ln for ln in res.stdout.splitlines() if ln.startswith("step ")]
    assert len(step_lines) == 3, str(res)  # log_every=1
    for ln in step_lines:
        assert "loss" in ln and "tokens/s" in ln and "model TFLOPS" in ln, ln
    metrics = os.path.join(d, "run", "metrics.jsonl")
    with open(metrics) as f:
        recs = [json.loads(ln) for ln in f if ln.strip()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert r["loss"] == r["loss"] and 0 < r["loss"] < 20  # finite, near ln(256) = 5.5
        assert r["tokens_per_s"] > 0 and r["model_tflops"] > 0 and r["skipped"] is False
    assert os.path.isfile(os.path.join(d, "run", "config.yaml"))


def test_relative_out_dir_saves_resumes_and_exports(tmp_path):
    """The README's own command uses a relative train.out_dir; orbax wants absolute paths."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tiny = ["--set", "model.num_layers=1", "--set", "data.seq_len=32", "--set", "train.batch_size=2",
            "--set", "optim.schedule.warmup_steps=1", "--set", f"data.path={repo}/data/tinyshakespeare.txt",
            "--set", "train.out_dir=rel_run", "--set", "train.ckpt_every=2"]
    first = _run(["train", os.path.join(repo, "configs/tiny.yaml"), "--set", "train.steps=2", *tiny], str(tmp_path))
    assert first.rc == 0, str(first)
    resumed = _run(["train", os.path.join(repo, "configs/tiny.yaml"), "--set", "train.steps=3", "--resume", *tiny],
                   str(tmp_path))
    assert resumed.rc == 0, str(resumed)
    exported = _run(["export", "rel_run", "rel_export"], str(tmp_path))
    assert exported.rc == 0, str(exported)
    assert os.path.isdir(tmp_path / "rel_export")
