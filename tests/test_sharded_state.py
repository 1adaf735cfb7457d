"""``train.host_state=sharded`` (issue 46): each process backs only its GPUs' shares of the host store.

Two real processes (one CPU device each, gloo) train what one process with two devices trains, bit for bit: the
losses and every array of the final checkpoint (gathered from the two shards). Each process's store is backed by
memory only for its half (``HostStore.own``: the other pages are given back). The sharded checkpoint resumes in two
processes, and re-shards into one process, each bit for bit with the one-process run resumed alike.
"""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from cli_runner import HOOKS_SCRIPT, cpu_xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETS = ["--set", "optim.schedule.warmup_steps=1", "--set", "train.batch_size=4", "--set", "data.seq_len=32",
        "--set", "model.num_layers=2", "--set", "train.log_every=1", "--set", "train.update_on=device",
        "--set", "train.fetch=split", "--set", "train.stream_copy=device", "--set", "train.grad_hold=gpu_fp32",
        "--set", "train.steps=5"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env(devices: int, **extra) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_xla_flags(devices), **extra)
    env.pop("MEGATRAIN_TRANSFER_MODE", None)
    return env


def _train(out, processes: int, *extra: str) -> list[str]:
    """``megatrain-jax train configs/tiny.yaml`` as ``processes`` processes of one device each (1: one process of
    two devices); returns each process's output. Through the test entry point without hooks (``cli.main`` as the
    console script runs it): there process 1 caches its compiled programs too (tests/every_process_caches.py)."""
    args = [sys.executable, HOOKS_SCRIPT, "--", "train", "configs/tiny.yaml", *SETS, "--set", f"train.out_dir={out}",
            *extra]
    if processes == 1:
        envs = [_env(2)]
    else:
        port = _free_port()
        envs = [_env(1, MEGATRAIN_COORDINATOR=f"localhost:{port}", MEGATRAIN_NUM_PROCESSES=str(processes),
                     MEGATRAIN_PROCESS_ID=str(i)) for i in range(processes)]
    procs = [subprocess.Popen(args, env=e, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for e in envs]
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return logs


def _result(out):
    from megatrain_jax.checkpoint_read import load_checkpoint_arrays

    with open(os.path.join(out, "metrics.jsonl")) as f:
        losses = [json.loads(line)["loss"] for line in f]
    arrays, _ = load_checkpoint_arrays(os.path.join(out, "checkpoints", "step_00000005"))
    return losses, arrays


def _assert_same(a, b):
    assert a[0] == b[0]  # losses, bit for bit
    assert sorted(a[1]) == sorted(b[1])
    for g in b[1]:
        for k in b[1][g]:
            np.testing.assert_array_equal(a[1][g][k], b[1][g][k], err_msg=f"{g}/{k}")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One process, two devices, a replicated store: 5 steps straight, and 3 then resumed to 5."""
    straight, resumed = tmp_path_factory.mktemp("one") / "straight", tmp_path_factory.mktemp("one") / "resumed"
    _train(straight, 1)
    _train(resumed, 1, "--set", "train.steps=3")
    _train(resumed, 1, "--resume")
    return _result(straight), _result(resumed)


def test_two_sharded_processes_train_what_one_process_trains_bit_for_bit(one_process, tmp_path):
    out = tmp_path / "sharded"
    _train(out, 2, "--set", "train.host_state=sharded")
    ck = out / "checkpoints" / "step_00000005"
    assert sorted(os.listdir(ck)) == ["manifest.json", "shard_0", "shard_1", "state.json"]  # each wrote its own
    _assert_same(_result(out), one_process[0])


def test_a_sharded_checkpoint_resumes_in_two_processes_and_reshards_into_one(one_process, tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    _train(two, 2, "--set", "train.host_state=sharded", "--set", "train.steps=3")
    os.makedirs(one)  # the same step-3 state, resumed by one process of two devices
    subprocess.run(["cp", "-r", str(two / "checkpoints"), str(two / "metrics.jsonl"), str(two / "config.yaml"),
                    str(one)], check=True)
    _train(two, 2, "--set", "train.host_state=sharded", "--resume")
    _train(one, 1, "--resume")
    _assert_same(_result(two), one_process[1])
    _assert_same(_result(one), one_process[1])


def test_processes_that_do_not_see_one_out_dir_are_refused_before_training(tmp_path):
    """A sharded checkpoint is committed by process 0 once it sees every process's shard under train.out_dir: two
    processes whose out_dir are different folders (as two hosts' own local disks would be) both refuse in one line
    naming the field, before any step, and leave nothing behind (no run folder, no probe file)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "megatrain_jax", "train", "configs/tiny.yaml", *SETS, "--set",
                               "train.host_state=sharded", "--set", f"train.out_dir={tmp_path / x / 'run'}"],
                              env=_env(1, MEGATRAIN_COORDINATOR=f"localhost:{port}", MEGATRAIN_NUM_PROCESSES="2",
                                       MEGATRAIN_PROCESS_ID=str(i), MEGATRAIN_SHARD_WAIT_S="60"),
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, x in enumerate("ab")]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 2, err[-2000:]
        last = err.strip().splitlines()[-1]
        assert last.startswith("error: train.out_dir: process 1 of 2 does not see"), err[-2000:]
    assert sorted(os.listdir(tmp_path / "a")) == [] and sorted(os.listdir(tmp_path / "b")) == []


def test_a_sharded_store_backs_only_its_own_values():
    """``HostStore.own``: the pages outside this process's values are given back (they read as zeros), its own keep
    their values; the resident bytes fall to its share (mincore)."""
    from megatrain_jax.hoststore import HostStore
    from megatrain_jax.templates import Layout

    n = 1 << 22
    store = HostStore({"block_0": Layout({"w": np.zeros(n, np.float32)})}, bf16_stream=False)
    g = store["block_0"]
    g.master[:] = np.arange(n, dtype=np.float32)
    whole = store.resident_bytes()
    assert whole >= 4 * n
    store.own(lambda size: (size // 2, size), 2048)
    assert store.resident_bytes() <= whole // 2 + 2 * 4096
    np.testing.assert_array_equal(g.master[n // 2:], np.arange(n // 2, n, dtype=np.float32))
    assert not g.master[:n // 2].any()


def test_a_sharded_host_state_refuses_what_cannot_run_it_in_one_line(tmp_path):
    """The plan refuses a host update, stream_io and an optax optimizer with a sharded host state, naming the
    field; an unknown value of train.host_state is refused by the config check."""
    from megatrain_jax.config import load_config
    from megatrain_jax.errors import UserError
    from megatrain_jax.plan import make_plan

    base = ["train.host_state=sharded", "model.num_layers=2", f"train.out_dir={tmp_path / 'o'}"]
    for extra, field in [(["train.update_on=host"], "train.update_on"), (["train.stream_io=true"], "train.stream_io"),
                         (["optim.name=lion"], "train.host_state")]:
        cfg = load_config(os.path.join(REPO, "configs/tiny.yaml"), base + extra)
        with pytest.raises(UserError) as e:
            make_plan(cfg)
        assert e.value.field == field, str(e.value)
    with pytest.raises(UserError) as e:
        load_config(os.path.join(REPO, "configs/tiny.yaml"), ["train.host_state=mirrored"])
    assert e.value.field == "train.host_state"


def test_plan_says_what_each_of_n_processes_needs(capsys):
    """``plan --processes N``: the 70B (AdamW int8) on four 128 GB hosts fits with a sharded host state (each process
    plans its quarter of the store) and is refused replicated; a process count below 1 is refused in one line."""
    from cli_runner import run_in_process

    def plan(*extra):
        res = run_in_process(["plan", os.path.join(REPO, "configs/llama2-70b.yaml"), "--gpu-memory-gb", "80",
                              "--host-memory-gb", "128", "--set", "train.batch_size=8", "--json", *extra], capsys)
        return res, (json.loads(res.stdout) if res.stdout.strip().startswith("{") else None)

    res, sharded = plan("--processes", "4", "--set", "train.host_state=sharded")
    assert res.rc == 0, str(res)[-2000:]
    rows = {r["what"]: r["bytes"] for r in sharded["rows"] if r["where"] == "host"}
    assert rows["fp32 master weights"] == pytest.approx(4.0 * sharded["params"] / 4, rel=1e-6)
    assert sharded["options"]["host_state"] == "sharded" and sharded["options"]["update_on"] == "device"
    from megatrain_jax.plan.sizes import RUNTIME_HOST_BYTES
    assert rows["runtime (Python, JAX, CUDA context)"] == RUNTIME_HOST_BYTES["gpu"]  # its own GPU's context, not 4
    from megatrain_jax.plan.sizes import MULTI_PROCESS_HOST_BYTES
    assert rows["multi-process runtime (coordination client, collectives' host buffers)"] == MULTI_PROCESS_HOST_BYTES
    disk = [r for r in sharded["rows"] if r["where"] == "disk"]  # the whole checkpoint, on the filesystem all share
    assert len(disk) == 1 and disk[0]["bytes"] >= 4.0 * sharded["params"] and "shards together" in disk[0]["note"]
    res, _ = plan("--processes", "4")
    assert res.rc == 2  # a whole replica in each 128 GB host does not fit
    res, _ = plan("--processes", "0")
    assert res.rc == 2 and "--processes" in res.stderr and len(res.error_lines()) == 1


def _hooked(out, hooks_of, *extra: str, processes: int = 4, timeout: float = 300):
    """tests/train_with_hooks.py as ``processes`` sharded processes (``hooks_of(p)``: process p's hook arguments);
    returns (return codes, outputs). A process whose save waits for a killed one fails that save after 2 s, long
    before the 30 s heartbeat ends it. ``processes=1``: one process of four devices, the host store replicated (what
    the sharded processes must equal)."""
    port = _free_port()
    if processes == 1:
        extra = ("--set", "train.host_state=replicated", "--set", "train.update_on=device", "--set", "train.fetch=split",
                 *extra)
    launch = (lambda i: _env(4)) if processes == 1 else (
        lambda i: _env(1, MEGATRAIN_COORDINATOR=f"localhost:{port}", MEGATRAIN_NUM_PROCESSES=str(processes),
                       MEGATRAIN_PROCESS_ID=str(i), MEGATRAIN_SHARD_WAIT_S="2", MEGATRAIN_HEARTBEAT_S="30"))
    sets = ["--set", "train.steps=4", "--set", "train.ckpt_every=2", "--set", "optim.schedule.warmup_steps=1",
            "--set", "train.batch_size=4", "--set", "data.seq_len=32", "--set", "model.num_layers=2",
            "--set", "train.log_every=1", "--set", "train.host_state=sharded", "--set", "train.stream_copy=device",
            "--set", "train.grad_hold=gpu_fp32", "--set", f"train.out_dir={out}", *extra]
    procs = [subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "train_with_hooks.py"), *hooks_of(i), "--",
                               "train", "configs/tiny.yaml", *sets],
                              env=launch(i), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(processes)]
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [p.returncode for p in procs], logs


def test_one_of_four_processes_killed_mid_save_loses_nothing_and_a_nan_step_is_skipped_by_all(tmp_path):
    """Four sharded processes train what one process of four devices trains (replicated store), with clipping, 4
    steps: to float rounding, not bit for bit (gloo sums four members' gradients in another order than the in-process
    collective; with two members the order is the same, and the two-process test above is bit for bit). Then
    process 2 is killed in the middle of its shard of step 4's save: process 0 commits nothing (it fails that save naming the missing shard, or is ended by the heartbeat first); step 2's checkpoint
    resumes, and the run ends bit for bit as one never interrupted. Step 3's forward is NaN in every process: all
    skip it (the same end as the straight run and the one-process run)."""
    nan = ["--nan-steps", "3"]
    straight, killed, one = tmp_path / "straight", tmp_path / "killed", tmp_path / "one"
    rcs, logs = _hooked(straight, lambda p: nan)
    assert rcs == [0] * 4, logs[0][-3000:]
    assert "step 3: non-finite loss" in logs[0]
    assert sorted(os.listdir(straight / "checkpoints" / "step_00000004")) == [
        "manifest.json", "shard_0", "shard_1", "shard_2", "shard_3", "state.json"]
    rcs, logs = _hooked(one, lambda p: nan, processes=1)
    assert rcs == [0], logs[0][-3000:]
    assert "step 3: non-finite loss" in logs[0]
    rcs, logs = _hooked(killed, lambda p: nan + (["--kill-in-save", "4"] if p == 2 else []))
    assert all(rc != 0 for rc in rcs), rcs
    # process 0 says so: its save failed for the missing shard, or (when its next collective waits for the dead
    # process first) JAX's coordination service ended it once the heartbeat stopped
    assert ("shard_2" in logs[0] and "not written" in logs[0]) or "another task died" in logs[0], logs[0][-3000:]
    assert "step_00000004" not in os.listdir(killed / "checkpoints")  # step 4 never committed
    rcs, logs = _hooked(killed, lambda p: nan, "--resume")
    assert rcs == [0] * 4, logs[0][-3000:]
    assert sorted(os.listdir(killed / "checkpoints")) == ["step_00000002", "step_00000004"]  # nothing half-left
    with open(straight / "metrics.jsonl") as f, open(killed / "metrics.jsonl") as g:
        assert [json.loads(x)["loss"] for x in f] == [json.loads(x)["loss"] for x in g]
    from megatrain_jax.checkpoint_read import load_checkpoint_arrays

    with open(one / "metrics.jsonl") as f, open(straight / "metrics.jsonl") as g:
        np.testing.assert_allclose([json.loads(x)["loss"] for x in f], [json.loads(x)["loss"] for x in g], rtol=1e-6)
    a, _ = load_checkpoint_arrays(str(straight / "checkpoints" / "step_00000004"))
    b, _ = load_checkpoint_arrays(str(killed / "checkpoints" / "step_00000004"))
    c, _ = load_checkpoint_arrays(str(one / "checkpoints" / "step_00000004"))
    assert sorted(a) == sorted(c)
    for grp in a:
        for k in a[grp]:
            np.testing.assert_array_equal(b[grp][k], a[grp][k], err_msg=f"{grp}/{k}")
            np.testing.assert_allclose(c[grp][k], a[grp][k], rtol=1e-5, atol=1e-7, err_msg=f"one process: {grp}/{k}")


def test_a_device_update_run_saving_at_its_last_step_ends(tmp_path):
    """update_on=device, a checkpoint every 2 steps of 4: the save at step 4 waits for updates that only the final
    save applies; the final save used to wait for it first, and the run hung until its watchdog."""
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "megatrain_jax", "train", "configs/tiny.yaml", "--set", "train.steps=4",
                        "--set", "train.ckpt_every=2", "--set", "optim.schedule.warmup_steps=1", "--set",
                        "train.batch_size=4", "--set", "data.seq_len=32", "--set", "model.num_layers=2", "--set",
                        "train.update_on=device", "--set", "train.stream_copy=device", "--set",
                        f"train.out_dir={out}"], env=_env(1), cwd=REPO, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    assert sorted(os.listdir(out / "checkpoints")) == ["step_00000002", "step_00000004"]


@pytest.mark.parametrize("name", ["MEGATRAIN_HEARTBEAT_S", "MEGATRAIN_SHARD_WAIT_S"])
def test_a_bad_heartbeat_or_shard_wait_is_refused_in_one_line(monkeypatch, name):
    """MEGATRAIN_HEARTBEAT_S and MEGATRAIN_SHARD_WAIT_S must be positive numbers of seconds: refused before anything
    joins, naming the variable."""
    from megatrain_jax.distributed import initialize_from_env
    from megatrain_jax.errors import UserError

    monkeypatch.setenv("MEGATRAIN_COORDINATOR", "localhost:1")
    monkeypatch.setenv("MEGATRAIN_NUM_PROCESSES", "2")
    monkeypatch.setenv("MEGATRAIN_PROCESS_ID", "0")
    for bad in ("abc", "0", "-5"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(UserError) as e:
            initialize_from_env()
        assert e.value.field == name and bad in str(e.value) and "\n" not in str(e.value)
