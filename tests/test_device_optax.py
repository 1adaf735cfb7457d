"""Any optax transformation with ``train.update_on=device``: each named optimizer's update, run per group
by the device path (its state crossing as flat buffers, written back in place), equals the same
transformation in the reference trainer over 5 steps with clipping that triggers, equals the host
path, resumes bit-exactly from a checkpoint, and bad combinations are refused in one line."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

from megatrain_jax.config import Config, DataConfig, OptimConfig, TrainConfig, validate
from megatrain_jax.errors import UserError
from megatrain_jax.optim import OptaxHostOptimizer, alloc_aligned, build_host_optimizer
from megatrain_jax.reference import ReferenceTrainer
from megatrain_jax.templates import Layout
from megatrain_jax.trainer import Trainer
from test_named_optimizers import CLIP, DEVICE_NAMED, MODEL, _batches, _cfg, _group_rel_errors


def _device(cfg: Config) -> Config:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, update_on="device"))


# Each DEVICE_NAMED optimizer's device-side update against the optax reference over 5 clipped steps, and its bit-exact
# resume: tests/test_named_optimizers.py::test_streamed_equals_optax_reference_and_resumes_bit_exactly (beside the
# host update, one reference run for both)


def _group(rng):
    tree = {"b": np.zeros(24, np.float32), "w": np.zeros((24, 40), np.float32), "v": np.zeros((40, 16), np.float32)}
    layout = Layout(tree)
    flat = alloc_aligned(layout.size)
    flat[:] = rng.standard_normal(layout.size).astype(np.float32) * 0.1
    return flat, layout


def _rel(a, b) -> float:
    """‖a - b‖ / ‖b‖ (0 for two zero arrays); integer arrays (the counts) must be equal."""
    if not np.issubdtype(b.dtype, np.floating):
        return 0.0 if np.array_equal(a, b) else np.inf
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("name", DEVICE_NAMED + ["optax"])
def test_device_step_equals_host_update(name):
    """The same transformation on both sides (two compilations: XLA may contract a multiply-add
    differently, so within float32 rounding, not bit for bit); the state buffers ``state_to_arrays``
    hands out are the ones ``update`` writes."""
    rng = np.random.default_rng(0)
    opt = build_host_optimizer(_cfg(name).optim, 5)
    flat, layout = _group(rng)
    dev_p, dev_state = flat.copy(), opt.init_state(flat, layout.unflatten)
    state = opt.init_state(flat, layout.unflatten)
    arrays = opt.state_to_arrays(state)
    assert all(arrays[k] is state[k] for k in arrays) and all(k.startswith(opt.label + "/") for k in arrays)
    cpu = jax.devices("cpu")[0]
    for count in range(1, 5):
        grad = rng.standard_normal(flat.shape[0]).astype(np.float32)
        scale = 0.25 if count % 2 else 1.0
        opt.update(flat, grad, state, count, scale, None, layout.unflatten)
        p, st = opt.device_step(jax.device_put(dev_p, cpu), jax.device_put(grad, cpu),
                                {k: jax.device_put(v, cpu) for k, v in dev_state.items()},
                                opt.device_scalars(count, scale), None, unflatten=layout.unflatten)
        dev_p = np.asarray(p)
        dev_state = {k: np.asarray(v).copy() for k, v in st.items()}
        assert _rel(dev_p, flat) < 1e-6
        assert dev_state.keys() == state.keys()
        for k in state:
            assert dev_state[k].dtype == state[k].dtype
            assert _rel(dev_state[k], state[k]) < 1e-6, k


def test_device_step_compiles_once_per_group_structure():
    """Blocks share one compiled step: two groups of one layout, two layout objects, one entry."""
    rng = np.random.default_rng(1)
    opt = OptaxHostOptimizer(optax.lion(1e-3))
    (a, la), (b, lb) = _group(rng), _group(rng)
    sa, sb = opt.init_state(a, la.unflatten), opt.init_state(b, lb.unflatten)
    for flat, layout, st in ((a, la, sa), (b, lb, sb)):
        opt.update(flat, np.ones_like(flat), st, 1, 1.0, None, layout.unflatten)
    assert len(opt._jits) == 1


def test_an_optimizer_that_cannot_run_on_the_device_is_refused_in_one_line():
    from megatrain_jax.engine import StreamedTrainer
    from megatrain_jax.models.llama import init_host_store

    class HostOnly(OptaxHostOptimizer):
        runs_on_device = False

    parts, store = init_host_store(MODEL, 0, bf16_stream=False)
    with pytest.raises(UserError) as e:
        StreamedTrainer(parts, HostOnly(optax.sgd(0.1)), compute_dtype="float32", store=store, update_on="device")
    assert e.value.field == "train.update_on" and "\n" not in str(e.value)


def test_update_on_device_with_an_optax_optimizer_validates():
    for name in DEVICE_NAMED:
        validate(_device(_cfg(name)))
    cfg = Config(model=MODEL, optim=OptimConfig(name="optax", kernel="optax", optax_name="adabelief"),
                 data=DataConfig(seq_len=32), train=TrainConfig(steps=5, update_on="device"))
    validate(cfg)


# ------------------------------------------------------------------------ the lean state: int8 Lion


def test_int8_lion_runs_streamed_like_its_reference_on_both_paths(tmp_path):
    """``optim.name=lion, optim.moments=int8``: the streamed run (device and host path) equals the same
    transformation in the reference trainer over 5 steps with clipping; its state is 1 byte of code per
    parameter and one float32 scale per 2048 values (5.002 host bytes/param with the fp32 master)."""
    from megatrain_jax.optim import state_bytes

    batches = _batches()
    for update_on in ("device", "host"):
        cfg = _cfg("lion", moments="int8")
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, update_on=update_on))
        ref = ReferenceTrainer.from_config(cfg)
        with Trainer.from_config(cfg) as tr:
            assert tr.opt.label == "lion.int8"
            for batch in batches:
                r, s = ref.step(batch), tr.step(batch)
                assert r.grad_norm > CLIP and abs(r.loss - s.loss) <= 1e-5 * abs(r.loss)
        errs = _group_rel_errors(ref.params_tree(), tr.store)
        assert max(errs.values()) < 1e-5, (update_on, errs)
    st = tr.opt.state_to_arrays(tr.store["block_0"].opt_state)
    n = tr.store["block_0"].size
    assert st["lion.int8/uint8"].shape == (n,) and st["lion.int8/int32"].shape == (2,)  # its count, the schedule's
    block = tr.store["block_0"].layout
    by_dtype = state_bytes(cfg.optim, block.unflatten(np.zeros(n, np.float32)), 5)
    assert by_dtype["uint8"] == n and by_dtype["float32"] <= 4 * (n // 2048 + len(block.leaves))


def test_int8_momentum_round_trip_error_is_within_the_code():
    from megatrain_jax.optim.compact_adamw import CODE_SIGNED
    from megatrain_jax.optim.lean import dequantize, quantize

    rng = np.random.default_rng(2)
    x = (rng.standard_normal(5000) * np.exp(rng.uniform(-8, 0, 5000))).astype(np.float32)  # 3.5 decades
    q, s = quantize(x)
    back = np.asarray(dequantize(q, s, x.shape))
    assert q.dtype == np.uint8 and s.shape == (3,)
    gap = np.max(np.diff(CODE_SIGNED.astype(np.float64)))  # the widest step of the code (near +-1)
    scale = np.repeat(np.asarray(s), 2048)[:5000]
    assert np.all(np.abs(back - x) <= gap / 2 * scale + 1e-12)


def test_int8_lion_tracks_fp32_lion_within_the_quantization_error():
    """Same gradients (drawn independently of the parameters, so the runs see the same stream):
    after 30 steps the int8 run's momentum is within a few code steps of fp32 Lion's, its update
    directions agree on almost every element, and its weights moved alike."""
    from megatrain_jax.optim.lean import dequantize, lion_int8

    rng = np.random.default_rng(3)
    p0 = {"w": rng.standard_normal((64, 96)).astype(np.float32), "b": rng.standard_normal(96).astype(np.float32)}
    ref, tx8 = optax.lion(1e-3, b1=0.9, b2=0.99, weight_decay=0.01), lion_int8(1e-3, b1=0.9, b2=0.99,
                                                                                weight_decay=0.01)
    pr, p8 = p0, p0
    sr, s8 = ref.init(pr), tx8.init(p8)
    agree = []
    for _ in range(30):
        g = jax.tree.map(lambda x: (rng.standard_normal(x.shape) * 1e-3).astype(np.float32), p0)
        ur, sr = ref.update(g, sr, pr)
        u8, s8 = tx8.update(g, s8, p8)
        agree.append(float(np.mean(np.sign(np.asarray(ur["w"])) == np.sign(np.asarray(u8["w"])))))
        pr, p8 = optax.apply_updates(pr, ur), optax.apply_updates(p8, u8)
    mu8 = dequantize(s8[0].mu_q["w"], s8[0].mu_scale["w"], (64, 96))
    mur = sr[0].mu["w"]
    assert float(jnp_rel(mu8, mur)) < 0.1  # measured 0.047: each step rounds to the code, b2 = 0.99 keeps ~100 steps
    assert min(agree) > 0.98, agree  # measured 0.995
    moved = np.linalg.norm(np.asarray(pr["w"]) - p0["w"])
    assert np.linalg.norm(np.asarray(p8["w"]) - np.asarray(pr["w"])) < 0.15 * moved  # measured 0.063


def jnp_rel(a, b) -> float:
    return _rel(np.asarray(a), np.asarray(b))


def test_update_cost_for_the_plan():
    """The plan's numbers: host state from the optimizer's own ``init`` shapes, the device step's
    working set from XLA's buffer assignment, and where ``update_on=auto`` puts each optimizer."""
    from megatrain_jax.models import streamed_parts
    from megatrain_jax.models.common import abstract_model
    from megatrain_jax.optim import model_state_bytes
    from megatrain_jax.optim.costs import auto_update_on, update_cost

    trees = streamed_parts(abstract_model(MODEL)).host_trees()
    n = sum(int(np.prod(x.shape)) for t in trees.values() for x in jax.tree.leaves(t))
    fused = update_cost(OptimConfig(), trees)
    assert (fused.host_state, fused.chunked, fused.host_fast) == (8.0, True, True)
    lean = update_cost(_cfg("lion", moments="int8").optim, trees, 5)
    assert 1.0 < lean.host_state < 1.01 and 4 + lean.host_state < 5.01  # the lean configuration: 5.002
    for name in DEVICE_NAMED:
        o = _cfg(name).optim
        c = update_cost(o, trees, 5)
        assert c.host_state == pytest.approx(model_state_bytes(o, trees, 5) / n)
        assert c.runs_on_device and not c.host_fast and not c.chunked
        assert c.device_group >= 8 + c.host_state and c.device_temp > 0, (name, c)  # param + grad + state at least
        assert auto_update_on(c, on_gpu=True, devices=1, moments="float32", bf16_host_copy=False) == "device"
        assert auto_update_on(c, on_gpu=True, devices=2, moments="float32", bf16_host_copy=False) == "host"
        assert auto_update_on(c, on_gpu=False, devices=1, moments="float32", bf16_host_copy=False) == "host"
    assert auto_update_on(fused, on_gpu=True, devices=1, moments="float32", bf16_host_copy=False) == "host"


def test_the_cost_compiled_in_a_cpu_only_child_equals_the_in_process_one(monkeypatch):
    """Where a GPU may be there and JAX has not started, the device step's cost is compiled in a child
    process that sees the CPU only (asking JAX for its CPU device here would start the GPU backend with XLA's
    default budgets, before the plan sets its own): the same numbers as compiled here."""
    from megatrain_jax.models import streamed_parts
    from megatrain_jax.models.common import abstract_model
    from megatrain_jax.optim import costs

    trees = streamed_parts(abstract_model(MODEL)).host_trees()
    o = _cfg("adafactor").optim
    monkeypatch.setattr(costs, "_CACHE", {})
    monkeypatch.setenv("MEGATRAIN_COST_IN_CHILD", "1")
    child = costs.update_cost(o, trees, 5)
    monkeypatch.setattr(costs, "_CACHE", {})
    monkeypatch.setenv("MEGATRAIN_COST_IN_CHILD", "0")
    here = costs.update_cost(o, trees, 5)
    assert child == here and child.device_group > 0


PLANS_START_NOTHING = r"""
import sys
from jax._src import xla_bridge
from megatrain_jax.config import load_config
from megatrain_jax.plan import make_plan
for name in ("adamw", "adafactor", "lion", "muon", "sgd"):
    cfg = load_config("configs/tiny.yaml", [f"optim.name={name}", "train.update_on=auto"])
    make_plan(cfg)
    assert not xla_bridge._backends, (name, list(xla_bridge._backends))
print("ok")
"""


def test_planning_starts_no_jax_backend():
    """The plan gives XLA its GPU budgets (pool fraction, preallocation, pinned limit) through environment
    variables read when JAX starts its backends: planning itself must start none, for every optimizer (an
    optax optimizer's cost once did: a 110B run got XLA's default GPU pool, 0.75 of the GPU, under a plan of
    0.95). Run in a fresh process that plans as if a GPU were there."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "MEGATRAIN_GPU_MEMORY_GB": "80", "MEGATRAIN_COST_IN_CHILD": "1", "PYTHONPATH": root}
    env.pop("JAX_PLATFORMS", None)
    out = subprocess.run([sys.executable, "-c", PLANS_START_NOTHING], cwd=root, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


PLAN_STARTING_JAX = r"""
from megatrain_jax.config import load_config
from megatrain_jax.plan import plan_or_refuse
plan_or_refuse(load_config("configs/tiny.yaml", ["optim.name=adafactor", "train.update_on=auto"]), print)
"""


def test_a_plan_that_started_jax_says_so():
    """Were planning ever to start JAX again (here: the optax cost compiled in-process, as it once was), the run
    says in one line that XLA took its default budgets, not the plan's."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "MEGATRAIN_GPU_MEMORY_GB": "80", "MEGATRAIN_COST_IN_CHILD": "0", "PYTHONPATH": root}
    env.pop("JAX_PLATFORMS", None)
    out = subprocess.run([sys.executable, "-c", PLAN_STARTING_JAX], cwd=root, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    warned = [x for x in out.stdout.splitlines() if x.startswith("plan: warning: JAX started while planning")]
    assert len(warned) == 1, out.stdout[-3000:]
