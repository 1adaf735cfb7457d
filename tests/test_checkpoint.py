"""Checkpoint saver and loader against a stand-in engine (fast; the real engine is in test_train.py).

``FakeTrainer`` follows the engine's protocol exactly: a step waits for each group's pending update
(``_fetch``), bumps ``count``, and queues one in-place update per group on a single host thread
that calls ``before_update(name, count)`` first. Update ``k`` adds ``k`` to the weights and to every
optimizer array, so the state after any number of steps is known exactly.
"""
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from megatrain_jax import checkpoint as ck

from megatrain_jax import checkpoint_read as ckr
from megatrain_jax.cli import main as cli_main
from megatrain_jax.errors import UserError
from megatrain_jax.hoststore import HostStore
from megatrain_jax.optim import FusedAdamW
from megatrain_jax.templates import Layout

H = 32  # large enough that orbax's OCDBT stores the arrays in data files (small values go inline)
TREES = {"embed": {"embedding": np.zeros((64, H), np.float32)},
         "block_0": {"attn": {"q": np.zeros((H, H), np.float32)}, "norm": np.zeros((H,), np.float32)},
         "block_1": {"attn": {"q": np.zeros((H, H), np.float32)}, "norm": np.zeros((H,), np.float32)},
         "head": {"lm_head": np.zeros((H, 64), np.float32)}}
MODEL_META = {"config": {"model": {"vocab_size": 64, "hidden_size": H, "num_layers": 2}}}


def make_store(seed=0, bf16=True, trees=TREES):
    store = HostStore({n: Layout(t) for n, t in trees.items()}, bf16_stream=bf16)
    rng = np.random.default_rng(seed)
    opt = FusedAdamW(1e-3)
    for g in store:
        g.master[:] = rng.standard_normal(g.size, dtype=np.float32)
        g.sync_stream()
        g.opt_state = opt.init_state(g.master)
        g.opt_state["mu"][:] = rng.standard_normal(g.size, dtype=np.float32)
        g.opt_state["nu"][:] = rng.random(g.size, dtype=np.float32)
    return store, opt


def snapshot(store):
    return {g.name: {"master": g.master.copy(), "mu": g.opt_state["mu"].copy(), "nu": g.opt_state["nu"].copy()}
            for g in store}


class FakeTrainer:
    def __init__(self, store, opt, update_delay=0.0):
        self.store, self.opt, self.count = store, opt, 0
        self._pending, self.before_update, self.update_delay = {}, None, update_delay
        self._pool = ThreadPoolExecutor(max_workers=1)
        self.update_log = []  # (name, count, time)

    def _forward_order(self):
        return [g.name for g in self.store]

    def pending_updates(self):
        """The queued updates by group (what the saver waits for), as the engine's trainer gives them."""
        return dict(self._pending)

    def step(self):
        for name in self._forward_order():  # the forward fetches every group
            fut = self._pending.pop(name, None)
            if fut is not None:
                fut.result()
        self.count += 1
        for name in self._forward_order():
            self._pending[name] = self._pool.submit(self._update, name, self.count)

    def _update(self, name, count):
        time.sleep(self.update_delay)
        if self.before_update is not None:
            self.before_update(name, count)
        g = self.store[name]
        g.master += count
        g.opt_state["mu"] += count
        g.opt_state["nu"] += count
        g.sync_stream()
        self.update_log.append((name, count, time.perf_counter()))

    def finish(self):
        for name in list(self._pending):
            self._pending.pop(name).result()

    def close(self):
        self.finish()
        self._pool.shutdown()


def expected(base, steps):
    out = {g: {k: a.copy() for k, a in d.items()} for g, d in base.items()}
    for count in range(1, steps + 1):  # the same fp32 additions, in the same order, as the updates
        for d in out.values():
            for a in d.values():
                a += count
    return out


def assert_state(arrays, want):
    assert arrays.keys() == want.keys()
    for g in want:
        for k in want[g]:
            assert np.array_equal(arrays[g][k], want[g][k]), (g, k)


_orbax_checkpointer = ck.checkpointer


class SlowCheckpointer:
    """Wraps orbax's checkpointer: each group's write takes ``delay`` seconds more."""

    def __init__(self, delay, fail_on=None):
        self.inner, self.delay, self.fail_on = _orbax_checkpointer(), delay, fail_on

    def save(self, path, item):
        if self.fail_on and os.path.basename(path) == self.fail_on:
            raise OSError(28, "No space left on device")
        time.sleep(self.delay)
        return self.inner.save(path, item)

    def restore(self, *a, **kw):
        return self.inner.restore(*a, **kw)


def _saver(trainer, root, monkeypatch=None, delay=0.0, fail_on=None, **kw):
    if monkeypatch is not None:
        monkeypatch.setattr(ck, "checkpointer", lambda: SlowCheckpointer(delay, fail_on))
    logs = []
    saver = ck.CheckpointSaver(trainer, str(root), log=logs.append, **kw)
    return saver, logs


def test_background_save_is_consistent_while_training_continues(tmp_path, monkeypatch):
    store, opt = make_store()
    base = snapshot(store)
    tr = FakeTrainer(store, opt, update_delay=0.02)
    saver, _ = _saver(tr, tmp_path, monkeypatch, delay=0.1)
    tr.step()
    tr.step()  # update 2 of every group is still queued when the save starts
    assert tr._pending and not all(f.done() for f in tr._pending.values())
    path = saver.save(2, MODEL_META)
    t0 = time.perf_counter()
    tr.step()  # updates 3 are held back group by group until the writer has saved that group
    tr.step()
    loop_s = time.perf_counter() - t0
    stats = saver.wait()
    tr.finish()
    arrays, state = ckr.load_checkpoint_arrays(path)
    assert_state(arrays, expected(base, 2))  # exactly update 2, although 3 and 4 ran meanwhile
    assert state["count"] == 2 and state["step"] == 2
    assert_state(snapshot(store), expected(base, 4))  # and no update was lost
    assert stats.held_s > 0.1  # the writer (0.1 s per group) really held updates back
    # save() itself did not wait for the writer: a blocking save would take at least 0.1 s per group.
    # (No bound on loop_s: the loop rightly waits for held updates, and a loaded CI machine, with two
    # test workers, stretched it past a wall-clock bound that said nothing about blocking.)
    assert stats.call_s < 0.1 * len(store.groups)
    assert loop_s > 0
    saver.close()
    tr.close()


def test_restore_roundtrip_into_an_empty_store(tmp_path):
    store, opt = make_store(bf16=True)
    tr = FakeTrainer(store, opt)
    saver, _ = _saver(tr, tmp_path)
    tr.step()
    tr.finish()
    saver.save(1, MODEL_META, wait=True)
    fresh = HostStore({n: Layout(t) for n, t in TREES.items()}, bf16_stream=True)
    path, state = ckr.restore_latest(str(tmp_path), fresh, opt)
    assert path.endswith("step_00000001") and state["count"] == 1
    for g, h in zip(store, fresh):
        assert np.array_equal(g.master, h.master) and np.array_equal(g.stream_bits, h.stream_bits)
        for k in ("mu", "nu"):
            assert np.array_equal(g.opt_state[k], h.opt_state[k])
    saver.close()


def test_retention_keeps_last_k_and_every_nth(tmp_path):
    store, opt = make_store()
    tr = FakeTrainer(store, opt)
    saver, logs = _saver(tr, tmp_path, keep_last=2, keep_every=3)
    for step in range(1, 8):
        tr.step()
        saver.save(step, MODEL_META)
    saver.close()
    assert [c.step for c in ck.list_checkpoints(str(tmp_path))] == [3, 6, 7]
    assert sum("retention" in x for x in logs) == 4
    assert sorted(os.listdir(tmp_path)) == ["step_00000003", "step_00000006", "step_00000007"]
    assert ck.prune(str(tmp_path), 0, 0) == []  # keep_last=0 keeps everything


def _flip(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))


def _damage(path, how):
    files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(path, "groups", "block_0")) for f in fs]
    big = max(files, key=os.path.getsize)  # the arrays' data
    if how == "flip_all":  # densely, in every data file: the master's bytes are hit whichever file and
        # offset orbax's OCDBT gave them (it writes arrays in completion order, so one flipped byte in
        # the middle of a file sometimes landed in a moment instead: 1 failure in 5 runs)
        data_files = [p for p in files if os.path.getsize(p) > 1024]
        assert data_files, files  # H is large enough that no array is inlined in OCDBT's small files
        for p in data_files:  # every 61st byte: each array (4 KiB here) gets ~70 flipped bytes
            with open(p, "r+b") as f:
                data = bytearray(f.read())
                for i in range(0, len(data), 61):
                    data[i] ^= 0x10
                f.seek(0)
                f.write(data)
    if how == "flip_byte":
        _flip(big)
    elif how == "truncate":
        with open(big, "r+b") as f:
            f.truncate(os.path.getsize(big) // 3)
    elif how == "delete_file":
        os.remove(big)
    elif how == "state_json":
        with open(os.path.join(path, "state.json"), "r+b") as f:
            f.seek(10)
            f.write(b"X")
    elif how == "manifest":
        with open(os.path.join(path, "manifest.json"), "w") as f:
            f.write("{not json")


@pytest.mark.parametrize("how", ["flip_all", "truncate", "delete_file", "state_json", "manifest"])
def test_damaged_newest_checkpoint_is_reported_and_skipped(tmp_path, how):
    store, opt = make_store()
    tr = FakeTrainer(store, opt)
    saver, _ = _saver(tr, tmp_path)
    base = snapshot(store)
    for step in (1, 2):
        tr.step()
        saver.save(step, MODEL_META, wait=True)
    saver.close()
    newest = os.path.join(tmp_path, "step_00000002")
    _damage(newest, how)
    fresh, _ = make_store(seed=1)
    logs = []
    path, state = ckr.restore_latest(str(tmp_path), fresh, opt, log=logs.append)
    assert path.endswith("step_00000001") and state["step"] == 1
    assert_state(snapshot(fresh), expected(base, 1))
    assert any("step_00000002 is corrupted" in x and "falling back to the previous checkpoint" in x for x in logs)
    assert any("resuming from" in x for x in logs)
    assert os.path.isdir(newest + ".corrupt") and not os.path.exists(newest)


def test_all_corrupted_or_none_is_a_user_error(tmp_path):
    store, opt = make_store()
    with pytest.raises(UserError) as e:
        ckr.restore_latest(str(tmp_path / "nothing"), store, opt)
    assert e.value.field == "--resume" and "no complete checkpoint" in e.value.problem
    tr = FakeTrainer(store, opt)
    saver, _ = _saver(tr, tmp_path)
    saver.save(1, MODEL_META, wait=True)
    saver.close()
    _damage(os.path.join(tmp_path, "step_00000001"), "flip_all")  # (one flipped byte may land in unchecked bytes)
    with pytest.raises(UserError) as e:
        ckr.restore_latest(str(tmp_path), store, opt, log=lambda s: None)
    assert "every checkpoint" in e.value.problem and "corrupted" in e.value.problem and e.value.fix


def test_checkpoint_of_another_model_is_a_user_error(tmp_path):
    store, opt = make_store()
    tr = FakeTrainer(store, opt)
    saver, _ = _saver(tr, tmp_path)
    saver.save(1, MODEL_META, wait=True)
    saver.close()
    other = {**TREES, "head": {"lm_head": np.zeros((H, 128), np.float32)}}
    store2, _ = make_store(trees=other)
    with pytest.raises(UserError) as e:
        ckr.restore_latest(str(tmp_path), store2, opt)
    assert e.value.field == "model" and "head" in e.value.problem
    assert ck.list_checkpoints(str(tmp_path))  # not moved aside: it is fine, the config is not


def test_failed_save_never_blocks_training_and_is_reported(tmp_path, monkeypatch):
    store, opt = make_store()
    tr = FakeTrainer(store, opt)
    saver, _ = _saver(tr, tmp_path, monkeypatch, delay=0.0)
    tr.step()
    saver.save(1, MODEL_META, wait=True)
    monkeypatch.setattr(saver._ckptr, "fail_on", "block_1")  # disk full in the middle of the next save
    tr.step()
    saver.save(2, MODEL_META)
    done = threading.Event()
    threading.Thread(target=lambda: (tr.step(), tr.step(), tr.finish(), done.set()), daemon=True).start()
    assert done.wait(10), "training deadlocked behind a failed save"
    with pytest.raises(UserError) as e:
        saver.wait()
    assert e.value.field == "train.out_dir" and "No space left" in e.value.problem and "intact" in e.value.fix
    assert [c.step for c in ck.list_checkpoints(str(tmp_path))] == [1] and ck.leftovers(str(tmp_path)) == []
    saver.close()
    tr.close()


def test_leftovers_of_a_killed_save_are_removed_by_the_next_saver(tmp_path):
    os.makedirs(tmp_path / "step_00000009.tmp" / "groups")
    store, opt = make_store()
    tr = FakeTrainer(store, opt)
    saver, logs = _saver(tr, tmp_path)
    assert not os.path.exists(tmp_path / "step_00000009.tmp") and any("interrupted save" in x for x in logs)
    saver.close()


# ------------------------------------------------------------------------------------- export


@pytest.fixture
def saved(tmp_path):
    store, opt = make_store()
    tr = FakeTrainer(store, opt)
    saver, _ = _saver(tr, tmp_path / "run" / "checkpoints")
    tr.step()
    tr.finish()
    saver.save(1, MODEL_META, wait=True)
    saver.close()
    return store, str(tmp_path / "run")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_weights(saved, tmp_path, dtype):
    import json

    import ml_dtypes
    import yaml
    from safetensors.numpy import load_file

    store, run = saved
    out = str(tmp_path / f"export_{dtype}")
    assert cli_main(["export", run, out, "--dtype", dtype, "--format", "mt"]) == 0  # a run's out_dir: its newest checkpoint
    assert sorted(os.listdir(out)) == sorted([f"{g.name}.safetensors" for g in store]
                                             + ["config.json", "model.yaml", "megatrain_export.json"])
    meta = json.load(open(os.path.join(out, "config.json")))
    assert meta["dtype"] == dtype and meta["source"]["step"] == 1
    assert yaml.safe_load(open(os.path.join(out, "model.yaml")))["hidden_size"] == H
    assert meta["weight_map"]["layers.1.attn.q"] == ["block_1.safetensors", "attn/q"]
    assert meta["weight_map"]["embed.embedding"] == ["embed.safetensors", "embedding"]
    want_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    for g in store:
        tensors = load_file(os.path.join(out, f"{g.name}.safetensors"))
        for leaf in g.layout.leaves:
            want = g.master[leaf.offset:leaf.offset + leaf.size].reshape(leaf.shape).astype(want_dtype)
            assert tensors[leaf.path].dtype == want_dtype and np.array_equal(tensors[leaf.path], want)


def test_export_errors_are_user_errors(saved, tmp_path, capsys):
    _, run = saved
    out = tmp_path / "busy"
    out.mkdir()
    (out / "x").write_text("x")
    assert cli_main(["export", run, str(out)]) == 2
    assert "error: OUT:" in capsys.readouterr().err
    assert cli_main(["export", run, str(tmp_path / "o"), "--dtype", "int8"]) == 2
    assert "error: --dtype:" in capsys.readouterr().err
    assert cli_main(["export", str(tmp_path / "missing"), str(tmp_path / "o")]) == 2
    assert "error: CHECKPOINT:" in capsys.readouterr().err
    assert cli_main(["export", run]) == 2  # OUT missing
    assert "error: export: bad arguments" in capsys.readouterr().err
    ckpt = os.path.join(run, "checkpoints", "step_00000001")
    _damage(ckpt, "flip_all")
    assert cli_main(["export", ckpt, str(tmp_path / "o"), "--format", "mt"]) == 2
    err = capsys.readouterr().err
    assert "is corrupted" in err and "block_0" in err and not os.path.exists(tmp_path / "o"), err


def _tree_state(root):
    """Every path under ``root`` with its size and bytes: equal before and after means nothing changed."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs:
            out[os.path.join(d, name)] = "dir"
        for name in files:
            p = os.path.join(d, name)
            with open(p, "rb") as f:
                out[p] = f.read()
    return out


@pytest.fixture
def llama_run(tmp_path):
    """A run directory whose checkpoint holds a real (tiny) Llama: its weights export to Hugging Face."""
    import dataclasses

    from megatrain_jax.config import ModelConfig
    from megatrain_jax.models import abstract_model, streamed_parts

    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48)
    parts = streamed_parts(abstract_model(cfg))
    store, opt = make_store(trees=parts.host_trees(), bf16=False)
    tr = FakeTrainer(store, opt)
    saver, _ = _saver(tr, tmp_path / "run" / "checkpoints")
    saver.save(1, {"config": {"model": dataclasses.asdict(cfg)}}, wait=True)
    saver.close()
    tr.close()
    return cfg, store, str(tmp_path / "run")


def test_export_writes_a_hugging_face_directory_by_default(llama_run, tmp_path):
    """Issue 26 item 14: one command from a training checkpoint to what from_pretrained loads."""
    import json

    from megatrain_jax.config import ModelConfig
    from megatrain_jax.hf import load_hf_into_store

    cfg, store, run = llama_run
    out = tmp_path / "hf"
    assert cli_main(["export", run, str(out), "--dtype", "float32"]) == 0
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLM"] and conf["torch_dtype"] == "float32"
    assert (out / "model.safetensors").exists()
    back = ModelConfig(from_hf=str(out))
    _, store2 = load_hf_into_store(back, bf16_stream=False, log=None)
    for g in store:  # exact in fp32
        assert np.array_equal(g.master, store2[g.name].master), g.name


@pytest.mark.parametrize("case", ["run_itself", "its_checkpoints", "a_step", "the_parent", "another_run",
                                  "inside_checkpoints", "the_source_step"])
@pytest.mark.parametrize("fmt", ["hf", "mt"])
def test_export_never_replaces_a_run_whatever_the_flags(llama_run, tmp_path, capsys, case, fmt):
    """Issue 26 item 1: `export RUN RUN --overwrite` replaced the whole run. Now refused: exit 2, one
    line, nothing on disk changed."""
    _, _, run = llama_run
    step = os.path.join(run, "checkpoints", "step_00000001")
    other = tmp_path / "other"
    (other / "checkpoints" / "step_00000003").mkdir(parents=True)
    (other / "checkpoints" / "step_00000003" / "manifest.json").write_text("{}")
    src, out = {"run_itself": (run, run), "its_checkpoints": (step, os.path.join(run, "checkpoints")),
                "a_step": (run, step), "the_parent": (run, str(tmp_path)), "another_run": (run, str(other)),
                "inside_checkpoints": (run, os.path.join(run, "checkpoints", "export")),
                "the_source_step": (step, step)}[case]
    before = _tree_state(tmp_path)
    capsys.readouterr()
    flags = ["--overwrite"] + (["--format", "mt"] if fmt == "mt" else [])  # hf: the plain command of the issue
    assert cli_main(["export", src, out, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: OUT:"), err
    assert _tree_state(tmp_path) == before


def test_export_never_writes_into_another_run_or_over_a_folder_of_data(llama_run, tmp_path, capsys):
    """Issue 47 item 3: `export runs/tiny runs/opt-lion/hf` exited 0, though an output inside a run is
    refused (that run's retention or --overwrite can later remove it, or it removes files of the run).
    Another run is known by its checkpoints/ or by the config.yaml train writes first; a folder of
    prepared data sets is never an output either. Whatever the flags: exit 2, one line, nothing changed."""
    import yaml

    from megatrain_jax.config import Config

    _, _, run = llama_run
    lion = tmp_path / "opt-lion"  # a run that has written its config.yaml, no checkpoint yet
    lion.mkdir()
    (lion / "config.yaml").write_text(yaml.safe_dump(Config().to_dict(), sort_keys=False))
    other = tmp_path / "other" / "checkpoints" / "step_00000003"
    other.mkdir(parents=True)
    (other / "manifest.json").write_text("{}")
    data = tmp_path / "data"
    data.mkdir()
    (data / "ds.json").write_text("{}")
    (data / "ds.tokens.bin").write_bytes(b"\0" * 8)
    before = _tree_state(tmp_path)
    for out, needle in [(lion / "hf", "opt-lion"), (lion / "hf" / "deeper", "opt-lion"),
                        (tmp_path / "other" / "export", "other"), (os.path.join(run, "hf"), "run"),
                        (data, "data set"), (tmp_path, "contains")]:
        for flags in ([], ["--overwrite"], ["--format", "mt", "--overwrite"]):
            capsys.readouterr()
            assert cli_main(["export", run, str(out), *flags]) == 2, (out, flags)
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and err[0].startswith("error: OUT:") and needle in err[0], err
            assert _tree_state(tmp_path) == before
    assert cli_main(["export", run, str(tmp_path / "exports" / "hf")]) == 0  # beside the runs: fine


def test_export_overwrite_replaces_only_an_earlier_export(llama_run, tmp_path, capsys):
    """--overwrite replaces what an earlier export of the same kind wrote and keeps the rest (e.g.
    tokenizer files); a directory it did not write, or one of the other kind, is refused untouched."""
    _, _, run = llama_run
    out = tmp_path / "hf"
    assert cli_main(["export", run, str(out), "--dtype", "float32"]) == 0
    (out / "tokenizer.json").write_text("{}")
    assert cli_main(["export", run, str(out)]) == 2  # no --overwrite
    assert "already exists" in capsys.readouterr().err
    assert cli_main(["export", run, str(out), "--overwrite"]) == 0  # bf16 now
    assert (out / "tokenizer.json").read_text() == "{}"
    assert '"bfloat16"' in (out / "config.json").read_text()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    mt = tmp_path / "mt"
    assert cli_main(["export", run, str(mt), "--format", "mt"]) == 0
    for target, fmt, needle in [(mine, "hf", "not written by megatrain-jax"), (mine, "mt", "not written by megatrain-jax"),
                                (mt, "hf", "holds an mt"), (out, "mt", "holds a Hugging Face export")]:
        before = _tree_state(tmp_path)
        capsys.readouterr()
        assert cli_main(["export", run, str(target), "--overwrite", "--format", fmt]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
        assert _tree_state(tmp_path) == before


def test_export_of_a_hugging_face_or_mt_directory_names_convert(tmp_path, capsys):
    hf = tmp_path / "hfdir"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    mt = tmp_path / "mtdir"
    mt.mkdir()
    (mt / "model.yaml").write_text("{}")
    for src, needle in [(hf, "convert hf-to-mt"), (mt, "convert mt-to-hf")]:
        assert cli_main(["export", str(src), str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "o").exists()


def test_train_export_cannot_replace_a_run(llama_run, tmp_path):
    """The training loop's export (overwrite=True) is held to the same rules; train.py can check
    train.export before training starts (hf.check_export_dir)."""
    from megatrain_jax.hf import check_export_dir, export_hf

    cfg, store, run = llama_run
    before = _tree_state(tmp_path)
    for target in (run, os.path.join(run, "checkpoints"), str(tmp_path)):
        with pytest.raises(UserError):
            export_hf(store, cfg, target, overwrite=True, log=None)
        with pytest.raises(UserError):
            check_export_dir(target, run)
    assert _tree_state(tmp_path) == before
    fresh = str(tmp_path / "fresh_run")
    with pytest.raises(UserError, match="train.export"):
        check_export_dir(fresh, fresh)  # not there yet: it would be, by the end of the run
    check_export_dir(os.path.join(run, "export"), run)  # the documented place: fine
    export_hf(store, cfg, os.path.join(run, "export"), overwrite=True, own_run=run, log=None)
    export_hf(store, cfg, os.path.join(run, "export"), overwrite=True, own_run=run, log=None)  # its resume's export
    with pytest.raises(UserError, match="lies inside"):  # issue 47: from anything but that run, it lies in a run
        export_hf(store, cfg, os.path.join(run, "export"), overwrite=True, log=None)
    with pytest.raises(UserError, match="lies inside"):
        check_export_dir(os.path.join(run, "export"), str(tmp_path / "another_run"))


def test_optax_optimizer_state_roundtrip(tmp_path):
    """A host optimizer whose ``state_to_arrays`` gives copies: restored through ``state_from_arrays``."""
    import optax

    from megatrain_jax.optim import OptaxHostOptimizer

    opt = OptaxHostOptimizer(optax.adamw(1e-3))
    store, _ = make_store()
    for g in store:
        g.opt_state = opt.init_state(g.master, g.layout.unflatten)
        opt.update(g.master, np.ones(g.size, np.float32), g.opt_state, 1, 1.0, g.stream_bits, g.layout.unflatten)
    tr = FakeTrainer(store, opt)
    saver, _ = _saver(tr, tmp_path)
    saver.save(1, MODEL_META, wait=True)
    saver.close()
    fresh = HostStore({n: Layout(t) for n, t in TREES.items()}, bf16_stream=True)
    ckr.restore_latest(str(tmp_path), fresh, opt)
    for g, h in zip(store, fresh):
        assert np.array_equal(g.master, h.master) and np.array_equal(g.stream_bits, h.stream_bits)
        a, b = opt.state_to_arrays(g.opt_state), opt.state_to_arrays(h.opt_state)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    with pytest.raises(UserError) as e:  # FusedAdamW cannot take optax's state
        ckr.restore_latest(str(tmp_path), make_store()[0], FusedAdamW(1e-3))
    assert e.value.field == "optim"


def test_abandoned_save_releases_training_and_never_commits(tmp_path, monkeypatch):
    """A second Ctrl-C: the save in flight is given up at once; it must not commit a torn state."""
    store, opt = make_store()
    tr = FakeTrainer(store, opt)
    saver, _ = _saver(tr, tmp_path, monkeypatch, delay=0.3)
    tr.step()
    saver.save(1, MODEL_META)
    tr.step()  # update 2 of the first groups now waits for the slow writer
    t0 = time.perf_counter()
    saver.abandon()
    tr.finish()
    assert time.perf_counter() - t0 < 0.3 * len(store.groups) - 0.3
    job = saver._job
    job.thread.join()
    assert ck.list_checkpoints(str(tmp_path)) == [] and ck.leftovers(str(tmp_path)) == []
    assert tr.before_update is None
    tr.close()


def test_a_damaged_export_marker_never_removes_anything_outside(tmp_path):
    """The marker lists what an export wrote; names that are not plain file names are ignored."""
    import json

    from megatrain_jax.atomic import MARKER, output_dir

    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    victim.write_text("keep")
    with output_dir(str(out), "hf") as tmp:
        open(os.path.join(tmp, "a.safetensors"), "w").close()
    (out / MARKER).write_text(json.dumps({"kind": "hf", "files": ["a.safetensors", "../victim.txt", "..", "/etc"]}))
    with output_dir(str(out), "hf", overwrite=True) as tmp:
        open(os.path.join(tmp, "b.safetensors"), "w").close()
    assert victim.read_text() == "keep" and sorted(os.listdir(out)) == ["b.safetensors", MARKER]


# ------------------------------------------------------------------ complete or not a checkpoint (issue 66)


def test_a_checkpoint_is_complete_or_it_is_not_one(tmp_path):
    """Resume, retention and a save agree on one definition of complete (manifest, state.json and every group
    it names): an incomplete step_N is set aside as .corrupt with one line, never resumed from, never counted
    by retention, and a save of its step writes it anew instead of returning the folder it did not write."""
    import shutil

    store, opt = make_store()
    tr = FakeTrainer(store, opt)
    saver, _ = _saver(tr, tmp_path, keep_last=0)
    for step in (1, 2, 3):
        tr.step()
        saver.save(step, MODEL_META, wait=True)
    saver.close()
    root = str(tmp_path)
    os.remove(tmp_path / "step_00000003" / "manifest.json")
    shutil.rmtree(tmp_path / "step_00000002" / "groups" / "block_0")
    os.remove(tmp_path / "step_00000001" / "state.json")
    assert [c.step for c in ck.list_checkpoints(root)] == []
    assert [(c.step, why) for c, why in ck.incomplete_checkpoints(root)] == [
        (1, "no state.json"), (2, "groups/block_0/ is missing"), (3, "no manifest.json")]
    shutil.rmtree(tmp_path / "step_00000001")
    shutil.rmtree(tmp_path / "step_00000002")
    tr.finish()
    saver, logs = _saver(tr, tmp_path, keep_last=1)  # the next start sets it aside, with one line naming it
    assert logs == [f"checkpoint: {tmp_path / 'step_00000003'} is corrupted or incomplete (no manifest.json); "
                    f"moved it to {tmp_path / 'step_00000003.corrupt'}"]
    os.makedirs(tmp_path / "step_00000003" / "groups")  # a folder of the very step to save, left incomplete
    path = saver.save(3, MODEL_META, wait=True)
    assert ck.checkpoint_problem(path) is None and any("saving step 3 anew" in x for x in logs), logs
    # retention counts complete checkpoints only: a newer incomplete one never pushes the good one out
    os.makedirs(tmp_path / "step_00000009")
    shutil.copy(tmp_path / "step_00000003" / "manifest.json", tmp_path / "step_00000009" / "manifest.json")
    assert ck.prune(root, 1, 0) == [] and [c.step for c in ck.list_checkpoints(root)] == [3]
    saver.close()
    fresh = HostStore({n: Layout(t) for n, t in TREES.items()}, bf16_stream=True)
    restore_logs = []
    got, state = ckr.restore_latest(root, fresh, opt, log=restore_logs.append)
    assert got == path and state["step"] == 3
    assert restore_logs == [f"checkpoint: {tmp_path / 'step_00000009'} is corrupted or incomplete (no state.json); "
                            f"moved it to "
                            f"{tmp_path / 'step_00000009.corrupt'}; falling back to the previous checkpoint: "
                            f"resuming from step 3 ({path})"]
    tr.close()
