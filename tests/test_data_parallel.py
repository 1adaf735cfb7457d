"""Data parallel: N devices (and 2 processes through jax.distributed) train exactly what one device
trains on the same global batch (fp32: losses and final parameters within 1e-5 relative).

Each configuration runs in its own process (tests/dp_worker.py): a CPU backend's device count is
fixed when it starts, and jax.distributed needs one process per member.
"""
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from cli_runner import cpu_xla_flags

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "dp_worker.py")
RTOL = 1e-5


def _env(devices: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_xla_flags(devices))
    env.pop("MEGATRAIN_TRANSFER_MODE", None)
    return env


def _rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


@pytest.fixture(scope="module")
def local_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp") / "local.npz"
    subprocess.run([sys.executable, WORKER, "local", "--counts", "1,2,4", "--out", str(out)], env=_env(4),
                   check=True, timeout=600)
    return np.load(out)


@pytest.mark.parametrize("n", [2, 4])
def test_n_devices_train_what_one_device_trains(local_runs, n):
    r = local_runs
    np.testing.assert_allclose(r[f"losses_{n}"], r["losses_1"], rtol=RTOL)
    np.testing.assert_allclose(r[f"norms_{n}"], r["norms_1"], rtol=RTOL)
    assert _rel(r[f"params_{n}"], r["params_1"]) < RTOL
    assert r["losses_1"][-1] < r["losses_1"][0]  # it trains at all


def test_slabs_pinned_gradients_and_parked_activations_over_4_devices(local_runs):
    r = local_runs
    np.testing.assert_allclose(r["losses_4opts"], r["losses_1"], rtol=RTOL)
    assert _rel(r["params_4opts"], r["params_1"]) < RTOL


@pytest.mark.parametrize("placement", ["resweep", "pinned_bf16", "host_bf16", "stream_io", "kept_residuals"])
@pytest.mark.parametrize("n", [2, 4])
def test_each_placement_the_plan_offers_several_gpus_trains_what_one_device_trains(local_runs, placement, n):
    """Every hold, boundary_every, stream_io and kept residuals is a candidate with several GPUs (plan/search.axes_of,
    issue 43): each equals its one-device run over 5 clipped steps (the resweep holding its first groups, the pinned
    bf16 hold with a group on the device, a pageable bf16 hold recomputing every other block, the streamed embedding
    and head, the last block applying its kept VJP residuals, each device its own)."""
    r = local_runs
    np.testing.assert_allclose(r[f"losses_{placement}_{n}"], r[f"losses_{placement}_1"], rtol=RTOL)
    np.testing.assert_allclose(r[f"norms_{placement}_{n}"], r[f"norms_{placement}_1"], rtol=RTOL)
    assert _rel(r[f"params_{placement}_{n}"], r[f"params_{placement}_1"]) < RTOL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("placement", ["device_gpu_bf16", "device_resweep", "device_pinned_bf16", "device_int8",
                                       "device_adafactor", "device_adafactor_gpu_bf16", "device_early"])
@pytest.mark.parametrize("n", [2, 4])
def test_device_side_updates_over_several_gpus_train_what_one_device_trains(local_runs, placement, n):
    """``update_on=device`` with several GPUs (issue 45): the fused AdamW splits each group between them (each its
    share: reduce-scattered gradient, its share of master and state over its own link, the update gathered), with
    the gradient held on the GPUs, in pinned host memory or made again by a resweep, fp32 or int8 moments (padded
    shares of whole int8 blocks); an optax update (Adafactor) runs on every GPU alike, each GPU holding its share of
    a held gradient until the update gathers it. Each equals its one-device run over 5 clipped steps."""
    r = local_runs
    split = not placement.startswith("device_adafactor")
    assert bool(r[f"shares_{placement}_{n}"][0]) == split and not r[f"shares_{placement}_1"][0]
    if not split:  # each GPU held its share of each held gradient (the resweep's first 2 groups, or all 4), gathered
        gathered = {"device_adafactor": 2, "device_adafactor_gpu_bf16": 4}[placement] * 5  # for 5 steps' updates
        assert r[f"shares_{placement}_{n}"].tolist()[1] == gathered and r[f"shares_{placement}_1"].tolist()[1] == 0
    np.testing.assert_allclose(r[f"losses_{placement}_{n}"], r[f"losses_{placement}_1"], rtol=RTOL)
    np.testing.assert_allclose(r[f"norms_{placement}_{n}"], r[f"norms_{placement}_1"], rtol=RTOL)
    assert _rel(r[f"params_{placement}_{n}"], r[f"params_{placement}_1"]) < RTOL
    assert r[f"losses_{placement}_1"][-1] < r[f"losses_{placement}_1"][0]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_state_fetched_in_the_backward_trains_what_the_forward_fetch_trains_bit_for_bit(local_runs, n):
    """``train.early_state_groups`` moves when the first groups' master and state cross (during the backward, not
    the forward), not what the update computes: on one device and split over several, bit for bit."""
    r = local_runs
    for what in ("losses", "norms", "params"):
        assert np.array_equal(r[f"{what}_device_early_{n}"], r[f"{what}_device_gpu_bf16_{n}"]), what
    # each of the 5 steps' updates (the last one's at finish) started 3 groups (embedding, blocks 0 and 1) from the
    # state fetched in the backward
    assert r[f"shares_device_early_{n}"].tolist()[1] == 15


def test_a_split_update_refuses_a_pageable_hold_naming_the_field(local_runs):
    """The engine's own check (beside the plan's, tests/test_device_update.py): a whole gradient in pageable memory
    cannot feed each GPU's share."""
    assert str(local_runs["pageable_split_refused"]) == "UserError|train.grad_hold"


@pytest.mark.parametrize("n", [2, 4])
def test_a_split_fetch_trains_what_the_full_fetch_trains_bit_for_bit(local_runs, n):
    """``train.fetch=split`` (issue 45): each device fetches its share of a block and the block is gathered from the
    others; the weights the blocks compute with are the same bits, so 5 clipped steps equal the full fetch's exactly,
    with the host update and with the device-side update split between the devices."""
    r = local_runs
    for name, full in (("split", ""), ("split_device_int8", "device_int8_")):
        for what in ("losses", "norms", "params"):
            np.testing.assert_array_equal(r[f"{what}_{name}_{n}"], r[f"{what}_{full}{n}"])


def test_two_processes_through_jax_distributed_train_what_one_process_trains(local_runs, tmp_path):
    """Two real processes (one CPU device each, gloo collectives): both end with the same
    parameters (each applied the same update to its own replica), equal to the one-device run."""
    port = _free_port()
    outs = [tmp_path / f"p{i}.npz" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, WORKER, "dist", "--process-id", str(i), "--num-processes", "2",
                               "--port", str(port), "--out", str(outs[i])], env=_env(1),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    r0, r1 = (np.load(o) for o in outs)
    assert int(r0["devices"]) == 2 and int(r0["local"]) == 1
    np.testing.assert_array_equal(r0["params"], r1["params"])  # replicas stay bit-identical
    np.testing.assert_array_equal(r0["losses"], r1["losses"])
    np.testing.assert_allclose(r0["losses"], local_runs["losses_1"], rtol=RTOL)
    assert _rel(r0["params"], local_runs["params_1"]) < RTOL


def _cli(args, env, cwd):
    return subprocess.Popen([sys.executable, "-m", "megatrain_jax", *args], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _losses(out_dir):
    import json

    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def test_the_train_command_as_two_processes_equals_one_process(tmp_path, capsys):
    """`megatrain-jax train` launched twice with the MEGATRAIN_* variables (the README's command):
    only process 0 writes (metrics, checkpoint, summary), and its losses equal a one-process run (that
    one in this process: ``cli.main``)."""
    from cli_runner import run_in_process

    repo = os.path.dirname(HERE)
    sets = ["--set", "train.steps=3", "--set", "optim.schedule.warmup_steps=1", "--set", "train.batch_size=4",
            "--set", "data.seq_len=32",
            "--set", "model.num_layers=2", "--set", "train.log_every=1"]
    one = tmp_path / "one"
    res = run_in_process(["train", os.path.join(repo, "configs/tiny.yaml"), *sets, "--set", f"train.out_dir={one}"],
                         capsys)
    assert res.rc == 0, str(res)[-2000:]
    two = tmp_path / "two"
    port = _free_port()
    procs = []
    for i in range(2):
        env = dict(_env(1), MEGATRAIN_COORDINATOR=f"localhost:{port}", MEGATRAIN_NUM_PROCESSES="2",
                   MEGATRAIN_PROCESS_ID=str(i))
        procs.append(_cli(["train", "configs/tiny.yaml", *sets, "--set", f"train.out_dir={two}"], env, repo))
    logs = [q.communicate(timeout=300)[0] for q in procs]
    for q, log in zip(procs, logs):
        assert q.returncode == 0, log[-3000:]
    assert "step      3/3" in logs[0] and "step" not in logs[1]  # process 1 trains silently
    np.testing.assert_allclose(_losses(two), _losses(one), rtol=RTOL)
    assert os.path.isfile(two / "summary.json") and os.listdir(two / "checkpoints")


def test_multi_process_variables_are_checked_in_one_line(tmp_path, capsys, monkeypatch):
    """In-process (``cli.main``): the variables are refused before any process joins a run."""
    from cli_runner import run_in_process

    tiny = os.path.join(os.path.dirname(HERE), "configs", "tiny.yaml")
    for env, field in [(dict(MEGATRAIN_COORDINATOR="localhost:1"), "MEGATRAIN_NUM_PROCESSES"),
                       (dict(MEGATRAIN_COORDINATOR="nohostport", MEGATRAIN_NUM_PROCESSES="2",
                             MEGATRAIN_PROCESS_ID="0"), "MEGATRAIN_COORDINATOR"),
                       (dict(MEGATRAIN_COORDINATOR="localhost:1", MEGATRAIN_NUM_PROCESSES="2",
                             MEGATRAIN_PROCESS_ID="2"), "MEGATRAIN_PROCESS_ID")]:
        with monkeypatch.context() as mp:
            for k in ("MEGATRAIN_COORDINATOR", "MEGATRAIN_NUM_PROCESSES", "MEGATRAIN_PROCESS_ID"):
                mp.delenv(k, raising=False)
            for k, v in env.items():
                mp.setenv(k, v)
            res = run_in_process(["train", tiny, "--set", f"train.out_dir={tmp_path / 'x'}"], capsys)
        assert res.rc == 2, str(res)
        assert res.stderr.strip().splitlines()[-1].startswith(f"error: {field}"), str(res)
        assert not os.path.exists(tmp_path / "x")


def test_plan_predicts_1_2_4_8_gpus_without_them():
    """The plan for N GPUs (no GPU here: a simulated 2-GPU H200 host): the per-GPU batch and peak
    shrink with N, GPU->host spreads over N links, the step's matmul term divides by N."""
    from megatrain_jax.config import load_config
    from megatrain_jax.plan import GiB, Machine, make_plan, scaling_table

    m = Machine("gpu", 256 * GiB, 250 * GiB, "MemTotal", 141 * 10 ** 9, "sim", 2, "H200", 32, {})
    # no kept residuals: with them the single-GPU step recomputes less than 1/N of it; the host update
    # (auto may take the device-side one with several GPUs, whose state crosses each link 1/N: tested below)
    cfg = load_config(os.path.join(os.path.dirname(HERE), "configs/7b.yaml"),
                      ["train.batch_size=32", "train.keep_residuals=0", "train.update_on=host"])
    plans = {n: make_plan(cfg, m, devices=n) for n in (1, 2, 4, 8)}
    for n in (2, 4, 8):
        assert plans[n].decisions["devices"] == n
        assert plans[n].gpu_need < plans[1].gpu_need
        matmuls = [q.step["compute_s"] - q.step["gpu_memory_s"] for q in (plans[n], plans[1])]  # (memory passes:
        assert abs(matmuls[0] * n - matmuls[1]) < 1e-9  # each GPU makes them for its share of every micro-batch)
        assert abs(plans[n].step["d2h_s"] * n - plans[1].step["d2h_s"]) < 1e-9
    auto = load_config(os.path.join(os.path.dirname(HERE), "configs/7b.yaml"), ["train.batch_size=32"])
    one, two = make_plan(auto, m, devices=1), make_plan(auto, m, devices=2)
    k = one.decisions["keep_residuals"]
    # the 141 GB GPU has room: auto keeps residuals on one GPU and on each of two (each its own micro-batches',
    # half the batch each: at least as many blocks)
    assert k > 0 and two.decisions["keep_residuals"] >= k
    assert two.decisions["fetch"] == "split" and one.decisions["fetch"] == "full"  # auto: split with several GPUs
    assert one.step["compute_s"] < plans[1].step["compute_s"]  # k blocks' recompute is saved
    dev = load_config(os.path.join(os.path.dirname(HERE), "configs/7b.yaml"),
                      ["train.batch_size=32", "train.keep_residuals=0", "train.update_on=device"])
    d1, d4 = make_plan(dev, m, devices=1), make_plan(dev, m, devices=4)
    assert d4.decisions["update_on"] == "device"  # split: each link carries 1/4 of the state both ways
    assert d4.step["d2h_s"] < d1.step["d2h_s"] / 3
    # the state crosses in the forward, each group's in just before its block and back just after its update: the
    # forward lasts at least every GPU's read and write of host memory together (4 H200s: 91 GB each way for
    # Qwen2.5-7B, a 1.55 s forward, where its matmuls alone take ~0.7 s: bench_data_parallel.py), so four GPUs at a small
    # per-GPU batch are bound by it, and one GPU at the same per-GPU batch by its own link's share
    from megatrain_jax.plan.sizes import RATES
    q = load_config(os.path.join(os.path.dirname(HERE), "configs/qwen2.5-7b.yaml"),
                    ["train.batch_size=128", "train.update_on=device", "train.keep_residuals=0"])
    q4 = make_plan(q, m, devices=4)
    state = (4 + 8) * q4.params  # fp32 master and moments
    assert q4.step["binding"] == "updates_after_norm_s"
    assert q4.step["updates_after_norm_s"] > q4.step["compute_s"]
    forward_floor = 2 * state / RATES["host_traffic"]
    assert q4.step["updates_after_norm_s"] > forward_floor > q4.step["h2d_s"]
    table = scaling_table(cfg, m)
    assert "predictions" in table and all(f"\n{n:>4} |" in table for n in (1, 2, 4, 8))
    # train.devices=all counts every GPU of the host
    assert make_plan(cfg, m).decisions["devices"] == 2


def test_train_starts_no_jax_backend_before_the_plan_has_configured_xla(tmp_path):
    """The plan's GPU budget reaches XLA only if no backend has started before it (a backend started
    early keeps XLA's default fraction of the GPU: seen on the H100 as a 60.6 GB budget)."""
    repo = os.path.dirname(HERE)
    script = f"""
import megatrain_jax.plan as mem
from megatrain_jax.config import load_config
from megatrain_jax.train import train
orig = mem.apply_gpu_settings
def check(plan):
    assert not mem.jax_backend_ready(), "a JAX backend started before the plan configured XLA"
    orig(plan)
mem.apply_gpu_settings = check
train(load_config("configs/tiny.yaml", ["train.steps=1", "optim.schedule.kind=constant", "optim.schedule.warmup_steps=0", "train.batch_size=2", "data.seq_len=16",
      "model.num_layers=1", "train.final_checkpoint=false", "train.out_dir={tmp_path / 'run'}"]), log=lambda m: None)
print("ok")
"""
    p = subprocess.run([sys.executable, "-c", script], env=_env(1), cwd=repo, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-2000:]


def test_a_run_split_over_4_gpus_resumes_exactly(tmp_path):
    """``update_on=device`` split over 4 devices (each GPU's share of master and int8 moments written back into the
    host store): 3 steps, a checkpoint, 3 more with ``--resume`` give the losses of 6 straight steps bit for bit."""
    import json

    from cli_runner import cli_env, run_cli

    env = cli_env(XLA_FLAGS=cpu_xla_flags(4))
    base = ["train", "configs/tiny.yaml"] + [x for s in (
        "train.devices=4", "train.update_on=device", "optim.moments=int8", "train.batch_size=8", "model.num_layers=2",
        "optim.schedule.kind=constant", "optim.schedule.warmup_steps=0", "train.log_every=1") for x in ("--set", s)]

    def losses(out):
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [r["loss"] for r in map(json.loads, f) if "loss" in r]

    straight, parts = str(tmp_path / "straight"), str(tmp_path / "parts")
    for args in ([*base, "--set", "train.steps=6", "--set", f"train.out_dir={straight}"],
                 [*base, "--set", "train.steps=3", "--set", f"train.out_dir={parts}"],
                 [*base, "--set", "train.steps=6", "--set", f"train.out_dir={parts}", "--resume"]):
        r = run_cli(args, env=env)
        assert r.rc == 0, r.stderr[-2000:]
    assert losses(parts)[-3:] == losses(straight)[-3:] and len(losses(straight)) == 6
