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
import json
import os
import shutil
import zlib
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from megatrain_jax.cli import main  # noqa: E402
from cli_runner import tree_snapshot  # noqa: E402

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
    before = tree_snapshot(ws)
    rc, lines = _run(ws, argv)
    after = tree_snapshot(ws)
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
        before = tree_snapshot(workspace)
        rc, lines = _run(workspace, ["plan", "configs/self.yaml"])
        after = tree_snapshot(workspace)
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


# ------------------------------------------------------------------ every writer under the one rule (issue 47)

SMALL_RUN = ["model.num_layers=1", "model.hidden_size=64", "model.intermediate_size=128", "data.seq_len=32",
             "train.batch_size=2", "optim.schedule.warmup_steps=0", "train.steps=1", "data.path=data/text.txt"]
RUNS = ["runs/base", "runs/cfgonly"]  # the workspace's training runs (checkpoints/; only its config.yaml)
DATA_SET_FOLDERS = ["data"]  # folders holding a prepared data set
OWN_RUN = "newrun"  # train.out_dir of the train.export commands
_TRAIN = ["train", "configs/tiny.yaml", *[x for s in SMALL_RUN for x in ("--set", s)], "--set",
          "train.final_checkpoint=false"]
# name -> (argv for an output path, the command's inputs, what the output is: dir | files | run | export)
WRITERS = {
    "prepare_chat": (lambda o: ["prepare", "y.json", "--out", o, "--chat-template", "chatml", "--quiet"],
                     ["y.json"], "files"),
    "prepare_text": (lambda o: ["prepare", "data/text.txt", "--out", o, "--quiet"], ["data/text.txt"], "files"),
    "export_hf": (lambda o: ["export", "runs/base", o], ["runs/base"], "dir"),
    "export_mt": (lambda o: ["export", "runs/base", o, "--format", "mt"], ["runs/base"], "dir"),
    "convert_hf_to_mt": (lambda o: ["convert", "hf-to-mt", "models/hf", o], ["models/hf"], "dir"),
    "convert_mt_to_hf": (lambda o: ["convert", "mt-to-hf", "models/mt", o], ["models/mt"], "dir"),
    "train_out_dir": (lambda o: [*_TRAIN, "--set", f"train.out_dir={o}"], ["configs/tiny.yaml", "data/text.txt"],
                      "run"),
    "train_export": (lambda o: [*_TRAIN, "--set", f"train.out_dir={OWN_RUN}", "--set", f"train.export={o}"],
                     ["configs/tiny.yaml", "data/text.txt"], "export"),
}
# outputs: one of these places in the workspace (or a new one), then nothing, a new name or two below it
PLACES = [".", "data", "data/ds", "data/text.txt", "y", "y.json", "runs", "runs/base", "runs/base/checkpoints",
          "runs/base/checkpoints/step_00000001", "runs/cfgonly", "models", "models/hf", "models/mt", "configs",
          "configs/tiny.yaml", OWN_RUN, "fresh"]
TAILS = ["", "/new", "/new/deeper"]
PREPARED = (".json", ".tokens.bin", ".mask.bin", ".docs.npy")


@pytest.fixture(scope="module")
def writers_ws(tmp_path_factory) -> Path:
    """A user's folder made by the commands themselves: configs/, data/ (a text and a data set prepared from
    it), y.json (conversations), runs/base (a real run), runs/cfgonly (a run that has written only its
    config.yaml), models/hf and models/mt (model directories, not outputs of a writer: no marker)."""
    ws = tmp_path_factory.mktemp("writers")
    (ws / "configs").mkdir()
    shutil.copy(ROOT / "configs" / "tiny.yaml", ws / "configs" / "tiny.yaml")
    (ws / "data").mkdir()
    (ws / "data" / "text.txt").write_bytes((ROOT / "data" / "tinyshakespeare.txt").read_bytes()[:20_000])
    chat = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i} " * 6}]}
            for i in range(8)]
    (ws / "y.json").write_text("".join(json.dumps(c) + "\n" for c in chat))
    for argv in (["prepare", "data/text.txt", "--out", "data/ds", "--quiet"],
                 [*_TRAIN[:-2], "--set", "train.out_dir=runs/base"],
                 ["export", "runs/base", "models/hf", "--dtype", "float32"],
                 ["convert", "hf-to-mt", "models/hf", "models/mt"]):
        rc, lines = _run(ws, argv)
        assert rc == 0, (argv, lines)
    for d in ("models/hf", "models/mt"):
        os.remove(ws / d / "megatrain_export.json")
    (ws / "runs" / "cfgonly").mkdir()
    shutil.copy(ws / "runs" / "base" / "config.yaml", ws / "runs" / "cfgonly" / "config.yaml")
    return ws


def _within(a: str, b: str) -> bool:
    """``a`` is ``b`` or lies inside it (workspace-relative, normalised paths; "." is the workspace)."""
    return b == "." or a == b or a.startswith(b + "/")


def _breaks_the_rule(name: str, out: str) -> bool:
    """The oracle: the rule of atomic.py written out for this workspace, independently of the code."""
    _, inputs, what = WRITERS[name]
    targets = _outputs_of(name, out) if what == "files" else [out]
    if any(_within(t, i) or (what != "files" and _within(i, t)) for t in targets for i in inputs):
        return True
    for run in RUNS:
        if any(_within(t, run) for t in targets) and not (what == "run" and out == run):
            return True  # in a run (train.out_dir may be a run: its own)
        if what != "files" and _within(run, out) and run != out:
            return True  # holds a run
    if what == "files":
        return False
    if any(_within(d, out) for d in DATA_SET_FOLDERS):
        return True  # is or holds a folder of data sets
    if what == "export" and (_within(OWN_RUN, out) or _within(out, OWN_RUN + "/checkpoints")):
        return True  # the run itself, a folder holding it, or its checkpoints
    return False


def _files(root: Path) -> dict[str, tuple]:
    """Every entry: a file's size, mtime and crc32 (its bytes), a directory's mtime."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, root)] = ("dir", os.lstat(p).st_mtime_ns)
        for n in filenames:
            p = os.path.join(dirpath, n)
            st_ = os.lstat(p)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = (st_.st_size, st_.st_mtime_ns, zlib.crc32(f.read()))
    return out


def _under_a_directory(ws: Path, out: str) -> bool:
    parent = os.path.dirname(os.path.join(ws, out))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    return os.path.isdir(parent)


def _outputs_of(name: str, out: str) -> list[str]:
    what = WRITERS[name][2]
    if what == "files":  # prepare's --out is a prefix; a .json or .tokens.bin on it names the same prefix
        prefix = next((out[: -len(x)] for x in (".json", ".tokens.bin") if out.endswith(x)), out)
        return [prefix + x for x in PREPARED]
    return [out, OWN_RUN] if what == "export" else [out]


@settings(max_examples=200, **SETTINGS)
@given(name=st.sampled_from(sorted(WRITERS)), place=st.sampled_from(PLACES), tail=st.sampled_from(TAILS),
       overwrite=st.booleans())
def test_every_writer_keeps_off_inputs_runs_and_data(writers_ws, name, place, tail, overwrite):
    """Issue 47: for every writer (prepare, train.out_dir, train.export, export, convert), an output placed
    anywhere relative to the command's inputs, the runs and the data: a refusal is one line, exit 2, the
    workspace byte-identical; a success changes nothing outside its output. What the rule forbids is
    refused whatever the flags; a new place the rule allows is written."""
    ws = writers_ws
    out = os.path.normpath(place + tail)
    argv = WRITERS[name][0](out) + (["--overwrite"] if overwrite and not name.startswith("train") else [])
    forbidden = _breaks_the_rule(name, out)
    outputs = _outputs_of(name, out)
    existed = [o for o in outputs if os.path.lexists(ws / o)]
    backup = ws.parent / f"{ws.name}-backup"
    shutil.rmtree(backup, ignore_errors=True)
    for o in existed:  # put back after a success, so that every example sees the same workspace
        (backup / o).parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if os.path.isdir(ws / o) else shutil.copy2)(ws / o, backup / o)
    before = _files(ws)
    rc, lines = _run(ws, argv)
    after = _files(ws)
    event(f"{name}: {'written' if rc == 0 else 'refused by the rule' if forbidden else 'refused'}")  # statistics
    try:
        if forbidden:
            assert rc == 2, (argv, rc, lines)
        elif not existed and not os.path.isdir(ws / out) and _under_a_directory(ws, out):
            assert rc == 0, (argv, rc, lines)  # a new place the rule allows
        if rc != 0:
            assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (argv, rc, lines)
            assert after == before, (argv, lines, sorted(set(after.items()) ^ set(before.items()))[:6])
            return
        dirs_above = {os.path.normpath(os.path.join(*o.split("/")[:k])) for o in outputs
                      for k in range(1, o.count("/") + 1)}

        def outside(p: str, v: tuple) -> bool:
            return not any(_within(p, o) for o in outputs) and not (v[0] == "dir" and p in dirs_above)

        assert {p: v for p, v in before.items() if outside(p, v)} == \
               {p: v for p, v in after.items() if outside(p, v)}, (argv, lines)
    finally:
        if rc == 0:
            for o in outputs:
                p = ws / o
                if os.path.isdir(p) and not os.path.islink(p):
                    shutil.rmtree(p)
                elif os.path.lexists(p):
                    os.remove(p)
            for o in existed:
                (shutil.copytree if os.path.isdir(backup / o) else shutil.copy2)(backup / o, ws / o)
            for d in sorted(set(after) - set(before), key=len, reverse=True):  # directories made on the way
                if os.path.isdir(ws / d) and not os.listdir(ws / d):
                    os.rmdir(ws / d)
        shutil.rmtree(backup, ignore_errors=True)


# ------------------------------------------------------------------ commands interleaved with damage (issue 66)

DAMAGE_RUN = [*SMALL_RUN, "train.ckpt_every=1", "train.keep_last=0", "train.log_every=1000"]


@pytest.fixture(scope="module")
def damage_base(tmp_path_factory) -> Path:
    """A run of 2 steps with a checkpoint after each (every example damages its own copy)."""
    ws = tmp_path_factory.mktemp("damage")
    (ws / "configs").mkdir()
    shutil.copy(ROOT / "configs" / "tiny.yaml", ws / "configs" / "tiny.yaml")
    (ws / "data").mkdir()
    (ws / "data" / "text.txt").write_bytes((ROOT / "data" / "tinyshakespeare.txt").read_bytes()[:20_000])
    rc, lines = _run(ws, ["train", "configs/tiny.yaml", *[x for s in DAMAGE_RUN + ["train.steps=2",
                                                                                  "train.out_dir=run"]
                                                          for x in ("--set", s)]])
    assert rc == 0, lines
    return ws


def _damage_checkpoint(step_dir: Path, how: str) -> None:
    if how == "no_manifest":
        os.remove(step_dir / "manifest.json")
    elif how == "no_state":
        os.remove(step_dir / "state.json")
    elif how == "truncated":  # every data file cut short: its arrays (the weights too) fail their checks when read
        for dirpath, _, names in os.walk(step_dir / "groups"):
            for n in names:
                p = os.path.join(dirpath, n)
                if os.path.getsize(p) > 1024:
                    with open(p, "r+b") as f:
                        f.truncate(os.path.getsize(p) // 3)


FAULTS = st.one_of(
    st.just(("none", "")),
    st.tuples(st.just("damage"), st.sampled_from(["no_manifest", "no_state", "truncated"])),
    st.tuples(st.just("full_disk"), st.sampled_from(["metrics", "checkpoint"])),
    st.tuples(st.just("held"), st.sampled_from(["resume", "fresh"])),
    st.tuples(st.just("killed"), st.sampled_from(["save", "metrics", "export"])),
)


@settings(max_examples=25, **SETTINGS)
@given(plan=st.lists(st.tuples(FAULTS, st.sampled_from(["resume", "export"])), min_size=1, max_size=3))
def test_commands_interleaved_with_damage_lose_nothing_silently(damage_base, plan):
    """Issue 66: `train --resume` and `export` between damage to the run (a checkpoint missing a file or truncated,
    a full disk at a write of the metrics or of a save, a second command while one holds the run, what a kill leaves
    behind: a save's .tmp, a torn metrics line, an export's temporary). Invariants: exit 0 or 2, never a traceback;
    a refusal is one line; every checkpoint not damaged stays and loads; --resume and export take the newest
    undamaged one, and a newer damaged one is named in a line (no step is lost silently)."""
    import errno

    from megatrain_jax import checkpoint as ck
    from megatrain_jax import checkpoint_read as ckr
    from megatrain_jax.atomic import RunLock
    from megatrain_jax.metrics import MetricsWriter

    ws = damage_base
    run = ws / "run"
    backup = ws / "run-base"
    if not backup.exists():
        shutil.copytree(run, backup)
    shutil.rmtree(run)
    shutil.copytree(backup, run)
    shutil.rmtree(ws / "out", ignore_errors=True)
    root = ck.checkpoint_root(str(run))
    good = {1, 2}  # the oracle: steps whose checkpoint is whole (never damaged by this test)
    damaged: list[str] = []
    actions = plan  # (named in the assertions' messages)
    for (kind, arg), command in plan:
        pending = None  # a fault for this command
        event(f"{kind} {arg}, then {command}".replace(" , ", ", "))
        if kind == "damage":
            step = max(good)
            _damage_checkpoint(Path(root) / ck.step_dirname(step), arg)
            good.discard(step)
            damaged.append(os.path.join(root, ck.step_dirname(step)))
            if not good:
                return  # nothing left to resume from: covered by the checkpoint tests
        elif kind == "killed":
            if arg == "save":
                os.makedirs(os.path.join(root, ck.step_dirname(max(good) + 1) + ".tmp", "groups", "embed"),
                            exist_ok=True)
            elif arg == "metrics":
                with open(run / "metrics.jsonl", "a") as f:
                    f.write('{"step": 99, "lo')
            else:
                os.makedirs(ws / "out.tmp-999999999", exist_ok=True)
        elif kind in ("full_disk", "held"):
            pending = (kind, arg)
        kind = command
        steps = max(good) + 1
        argv = ["export", "run", "out", "--overwrite"] if kind == "export" else \
            ["train", "configs/tiny.yaml", *[x for s in DAMAGE_RUN + [f"train.steps={steps}", "train.out_dir=run"]
                                             for x in ("--set", s)], "--resume"]
        out, err = io.StringIO(), io.StringIO()
        with pytest.MonkeyPatch.context() as mp:
            lock = None
            if pending == ("full_disk", "metrics"):
                real = MetricsWriter.write
                mp.setattr(MetricsWriter, "write", lambda self, r: (_ for _ in ()).throw(
                    OSError(errno.ENOSPC, "No space left on device")) if r.get("step") == steps else real(self, r))
            elif pending == ("full_disk", "checkpoint"):
                real_ck = ck.checkpointer

                class Full:
                    def __init__(self):
                        self.inner = real_ck()

                    def save(self, path, item):
                        raise OSError(errno.ENOSPC, "No space left on device")

                    def __getattr__(self, name):
                        return getattr(self.inner, name)

                mp.setattr(ck, "checkpointer", Full)
            elif pending is not None and pending[0] == "held":
                lock = RunLock(str(run))
                if pending[1] == "fresh":
                    argv = [a for a in argv if a != "--resume"]
            cli_tree = tree_snapshot(run)  # (the holder's lock file written)
            cwd = os.getcwd()
            os.chdir(ws)
            try:
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    rc = main(argv)
            finally:
                os.chdir(cwd)
                if lock is not None:
                    lock.release()
        was, pending = pending, None
        text, errs = out.getvalue(), [x for x in err.getvalue().splitlines() if x.strip()]
        assert "Traceback" not in text + err.getvalue(), (actions, text, errs)
        assert rc in (0, 2), (actions, rc, errs)
        if rc == 2:
            assert len(errs) == 1 and errs[0].startswith("error: "), (actions, errs)
        if was is not None and was[0] == "held" and kind == "export":
            assert rc == 0 or "corrupted" in errs[0], (actions, errs)  # a reader: never held off by a run
            was = None
        elif was is not None and was[0] == "held":
            assert rc == 2 and ("is in use" in errs[0] or "already holds checkpoints" in errs[0]), (actions, errs)
            assert tree_snapshot(run) == cli_tree, actions  # nothing of the holder's run moved or rewritten
        elif was is not None and was[0] == "full_disk" and kind == "resume":
            assert rc == 2 and ("the disk is full" in errs[0]), (actions, errs)
            assert "newest complete checkpoint" in errs[0] or "no complete checkpoint" in errs[0], errs
        newest = max(good)
        if kind == "resume" and (was is None or was[0] == "full_disk"):
            assert f"resumed from {os.path.join(root, ck.step_dirname(newest))}: step {newest}," in text, (actions, text)
            for d in damaged:  # a damaged checkpoint newer than the one resumed from is named, never skipped silently
                if int(os.path.basename(d)[5:]) > newest:
                    assert d in text, (actions, d, text)
            damaged = [d for d in damaged if int(os.path.basename(d)[5:]) <= newest]
            if rc == 0:
                good.add(steps)
        if kind == "export" and was is None:
            if rc == 0:
                assert f"export: {os.path.join(root, ck.step_dirname(newest))} (step {newest})" in text, (actions, text)
                for d in damaged:
                    if os.path.isdir(d) and int(os.path.basename(d)[5:]) > newest:
                        assert f"skipping {d}" in text, (actions, d, text)
            else:
                assert any(d in errs[0] for d in damaged), (actions, errs)
        for s in good:  # every undamaged checkpoint is still there and loads
            assert os.path.isdir(os.path.join(root, ck.step_dirname(s))), (actions, s, sorted(os.listdir(root)))
        ckr.load_checkpoint_arrays(os.path.join(root, ck.step_dirname(max(good))))
