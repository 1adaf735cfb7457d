"""The whole class of user mistakes, driven through the CLI in-process by hypothesis.

For every generated mistake (a bad value for a field, an unknown key, a malformed override, a bad path, a
broken config file, a bad flag) the command must exit 2 with exactly one line on stderr that names the field
or path at fault, and leave the workspace exactly as it was (no file created, changed or removed).
Examples are derandomized (the same ones every run: CI is never flaky) and run in-process
(``cli.main(argv)``), so a few hundred cost seconds.
"""
from __future__ import annotations

import contextlib
import io
import os
import shutil
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from megatrain_jax.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
# a valid base that would train quickly if a mistake slipped through (it must not: nothing may be written)
SAFE = ["train.steps=2", "optim.schedule.warmup_steps=0", "train.final_checkpoint=false", "train.out_dir=runs/p"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A user's directory: the tiny config, the data, a file, a run directory with checkpoints."""
    ws = tmp_path_factory.mktemp("ws")
    shutil.copytree(ROOT / "configs", ws / "configs")
    (ws / "data").mkdir()
    shutil.copy(ROOT / "data" / "tinyshakespeare.txt", ws / "data" / "tinyshakespeare.txt")
    (ws / "afile.txt").write_text("not a directory\n")
    (ws / "small.txt").write_text("tiny\n")
    run = ws / "oldrun" / "checkpoints" / "step_5"
    run.mkdir(parents=True)
    (run / "state.json").write_text("{}")
    (ws / "oldrun" / "metrics.jsonl").write_text('{"step": 5}\n')
    return ws


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st_ = os.lstat(p)
            out[os.path.relpath(p, root)] = (st_.st_size if name in filenames else -1, st_.st_mtime_ns)
    return out


def _run(ws: Path, argv: list[str]) -> tuple[int, list[str]]:
    err = io.StringIO()
    cwd = os.getcwd()
    os.chdir(ws)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                rc = main(argv)
            except SystemExit as e:  # argparse's own usage errors
                rc = e.code
    finally:
        os.chdir(cwd)
    return rc, [x for x in err.getvalue().splitlines() if x.strip()]


def _check(ws: Path, argv: list[str], names: list[str]) -> None:
    before = _snapshot(ws)
    rc, lines = _run(ws, argv)
    after = _snapshot(ws)
    assert rc == 2, (argv, rc, lines)
    assert len(lines) == 1, (argv, lines)
    assert any(n in lines[0] for n in names), (argv, lines[0], names)
    assert after == before, (argv, sorted(set(after) ^ set(before)))


POSITIVE_INT = ["model.vocab_size", "model.hidden_size", "model.num_layers", "model.num_heads",
                "model.intermediate_size", "data.seq_len", "train.steps", "train.batch_size", "train.log_every",
                "train.loss_chunk"]
NON_NEGATIVE_INT = ["train.ckpt_every", "train.keep_last", "train.keep_every"]
ENUMS = ["optim.moments", "optim.kernel", "optim.name", "train.compute_dtype", "train.engine", "optim.schedule.kind",
         "train.grad_hold", "train.activations", "train.update_on", "train.stream_copy", "model.family"]
SECTIONS = ["model", "optim", "data", "train", "optim.schedule"]
ident = st.from_regex(r"[a-z][a-z_]{2,12}", fullmatch=True)
word = st.from_regex(r"[A-Za-z][A-Za-z0-9_]{0,10}", fullmatch=True)


def bad_override():
    """(KEY=VALUE, names the error line must mention)."""
    not_int = st.sampled_from(["abc", "1.5", "[1, 2]", "{a: 1}", "''", "true"])
    return st.one_of(
        st.tuples(st.sampled_from(POSITIVE_INT), st.one_of(st.integers(-10**6, 0).map(str), not_int))
          .map(lambda kv: (f"{kv[0]}={kv[1]}", [kv[0]])),
        st.tuples(st.sampled_from(NON_NEGATIVE_INT), st.one_of(st.integers(-10**6, -1).map(str), not_int))
          .map(lambda kv: (f"{kv[0]}={kv[1]}", [kv[0]])),
        st.tuples(st.sampled_from(ENUMS), word.filter(lambda w: w.lower() not in {
            "float32", "bfloat16", "int8", "fused", "optax", "adamw", "sgd", "streamed", "reference", "constant",
            "cosine", "warmup_cosine", "linear", "auto", "gpu_fp32", "gpu_bf16", "pinned_host", "device", "host",
            "llama", "qwen3", "phi3", "gemma2", "gemma3", "mixtral", "qwen3_moe", "true", "false", "null", "none",
            "yes", "no", "on", "off", "y", "n", "qwen2", "mistral", "lion", "adafactor", "muon"}))
          .map(lambda kv: (f"{kv[0]}={kv[1]}", [kv[0]])),
        st.tuples(st.sampled_from(SECTIONS), ident).filter(lambda sk: sk[1] not in _known(sk[0]))
          .map(lambda sk: (f"{sk[0]}.{sk[1]}=1", [f"{sk[0]}.{sk[1]}", sk[1]])),
        st.sampled_from([("train.steps", ["train.steps", "--set"]), ("=3", ["--set", "="]),
                         ("nosuchsection.x=1", ["nosuchsection"])]).map(lambda kv: kv),
    )


def _known(section: str) -> set[str]:
    import dataclasses

    from megatrain_jax.config import Config

    obj = Config()
    for part in section.split("."):
        obj = getattr(obj, part)
    return {f.name for f in dataclasses.fields(obj)}


@settings(max_examples=150, **SETTINGS)
@given(mistake=bad_override(), command=st.sampled_from(["train", "plan"]))
def test_a_bad_override_is_one_line_exit_2_and_writes_nothing(workspace, mistake, command):
    override, names = mistake
    _check(workspace, [command, "configs/tiny.yaml", *[x for s in SAFE for x in ("--set", s)], "--set", override],
           names)


BAD_PATHS = [
    ("data.path=nosuch/file.txt", ["data.path", "nosuch"]),
    ("data.path=small.txt", ["data", "small.txt"]),  # too small for one batch
    ("train.out_dir=afile.txt", ["train.out_dir", "afile.txt"]),  # an existing file
    ("train.out_dir=afile.txt/sub", ["train.out_dir", "afile.txt"]),  # under a file
    ("model.from_hf=nosuch_hf_dir", ["model.from_hf", "nosuch_hf_dir"]),
    ("data.tokenizer=nosuch/tokenizer.json", ["data.tokenizer", "nosuch"]),
]


@settings(max_examples=30, **SETTINGS)
@given(case=st.sampled_from(BAD_PATHS), command=st.sampled_from(["train", "plan"]))
def test_a_bad_path_is_one_line_exit_2_and_writes_nothing(workspace, case, command):
    override, names = case
    if command == "plan" and not override.startswith("model.from_hf"):
        return  # plan reads neither the data nor the output directory (it writes nothing)
    _check(workspace, [command, "configs/tiny.yaml", *[x for s in SAFE for x in ("--set", s)], "--set", override],
           names)


@settings(max_examples=40, **SETTINGS)
@given(text=st.one_of(
    st.sampled_from(["- a\n- b\n", "base: [a.yaml, b.yaml]\n", "base: self.yaml\n", "model: {a: 1\n",
                     "model:\n  hidden_size: [\n", "base: nosuch.yaml\n", "\tmodel: 1\n", "model: 3\n",
                     "train:\n  steps: many\n", "42\n"]),
    st.text(alphabet="{}[]:,-'\"\t\n a1", min_size=1, max_size=30)))
def test_a_broken_config_file_is_one_line_exit_2(workspace, text):
    cfg = workspace / "configs" / "self.yaml"
    cfg.write_text(text)
    try:
        before = _snapshot(workspace)
        rc, lines = _run(workspace, ["plan", "configs/self.yaml"])
        after = _snapshot(workspace)
    finally:
        cfg.unlink()
    if rc == 0:
        return  # some random text is a valid (empty or partial) config: nothing to check
    assert rc == 2, (text, rc, lines)
    assert len(lines) == 1, (text, lines)
    assert any(n in lines[0] for n in ("self.yaml", "base", "model", "optim", "data", "train")), (text, lines)
    assert after == before


@settings(max_examples=40, **SETTINGS)
@given(argv=st.sampled_from([
    ["export", "oldrun", "oldrun", "--overwrite"],
    ["export", "oldrun/checkpoints/step_5", "oldrun/checkpoints", "--overwrite"],
    ["export", "oldrun/checkpoints/step_5", "oldrun", "--overwrite"],
    ["export", "oldrun", "oldrun/checkpoints/new", "--overwrite"],
    ["export", "nosuch", "out"],
    ["convert", "mt-to-hf", "oldrun", "oldrun", "--overwrite"],
    ["convert", "hf-to-mt", "nosuch", "out"],
    ["convert", "hf-to-mt", "oldrun", "oldrun/checkpoints", "--overwrite"],
    ["convert", "sideways", "a", "b"],
    ["prepare", "nosuch.txt", "--out", "data/x"],
    ["prepare", "data/tinyshakespeare.txt", "--out", "data"],  # a directory
    ["prepare", "data/tinyshakespeare.txt", "--out", "oldrun/new", "--overwrite"],  # inside a run
    ["prepare", "data/tinyshakespeare.txt", "--out", "oldrun/checkpoints/x", "--overwrite"],
    ["plan", "configs/tiny.yaml", "--devices", "0"],
    ["plan", "nosuch.yaml"],
    ["train", "nosuch.yaml"],
]))
def test_a_bad_command_line_is_one_line_exit_2_and_touches_nothing(workspace, argv):
    names = [a for a in argv[1:] if not a.startswith("--")] + ["--devices", "convert", "sideways"]
    _check(workspace, argv, names)
