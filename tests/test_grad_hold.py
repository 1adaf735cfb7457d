"""Where deferred gradients wait for the clipping norm when memory is scarce: in pageable host memory
(fp32 or bf16, fed through the pinned slab pool), split with the GPU, or nowhere (a second backward
sweep). Each equals the reference trainer over several steps with clipping that triggers, and equals
the GPU hold it replaces bit for bit."""
import dataclasses
import functools
import weakref

import jax
import numpy as np
import pytest

from megatrain_jax.config import ModelConfig, OptimConfig, ScheduleConfig
from megatrain_jax.engine import StreamedTrainer
from megatrain_jax.models import init_model
from megatrain_jax.models.llama import init_host_store
from megatrain_jax.optim import build_host_optimizer, build_reference_tx
from megatrain_jax.reference import ReferenceTrainer
from test_engine import _batches, _group_rel_errors

STEPS = 5
CLIP = 0.05  # far under these models' gradient norms (~1.3): every step is clipped
MODEL = ModelConfig(vocab_size=256, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96, num_layers=3)
OCFG = OptimConfig(lr=1e-3, b2=0.95, weight_decay=0.1, clip_norm=CLIP,
                   schedule=ScheduleConfig(kind="warmup_cosine", warmup_steps=2))
# slabs of 5000 values through a pool of 2: every group (~31k values a block) queues for slabs
SLABS = dict(grad_slab_elems=5000, grad_slabs=2)


def _batches_5():
    return _batches(np.random.default_rng(1), STEPS, 4, 32, MODEL.vocab_size)


@functools.cache  # one reference run for the module (its trainer is only read afterwards)
def _reference():
    ref = ReferenceTrainer(init_model(MODEL, 0), build_reference_tx(OCFG, STEPS))
    out = [ref.step(b) for b in _batches_5()]
    assert all(r.grad_norm > CLIP for r in out)  # the clip scale is < 1 at every step
    return ref, [(r.loss, r.grad_norm) for r in out]


def _run(hold, **kw):
    return _run_once(hold, tuple(sorted(kw.items())))


@functools.cache  # a run repeated by several tests (the GPU hold each case is compared with) runs once
def _run_once(hold, kw):
    kw = dict(kw)
    ocfg = dataclasses.replace(OCFG, kernel=kw.pop("kernel")) if "kernel" in kw else OCFG
    parts, store = init_host_store(MODEL, 0, bf16_stream=False)
    st = StreamedTrainer(parts, build_host_optimizer(ocfg, STEPS), compute_dtype="float32", clip_norm=CLIP,
                         loss_chunk=48, store=store, grad_hold=hold, **{**SLABS, **kw})
    res = [st.step(b) for b in _batches_5()]
    st.close()  # waits for the last updates
    assert not any(r.skipped for r in res) and st.count == STEPS
    return st, [(r.loss, r.grad_norm) for r in res], {g.name: g.master.copy() for g in st.store}


def _assert_equal_weights(a, b):
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


CASES = {
    # name: (grad_hold, engine options)
    "host_fp32": ("host_fp32", {}),
    "host_fp32_2_micro_batches_pinned_activations": ("host_fp32", dict(micro_batches=2, activations="pinned_host")),
    "host_fp32_device_update": ("host_fp32", dict(update_on="device", micro_batches=2)),
    "resweep": ("resweep", {}),
    # activations brought back twice; the kept residuals are spent by the first sweep (recompute in the second)
    "resweep_2_micro_batches_pinned_activations_kept_residuals":
        ("resweep", dict(micro_batches=2, activations="pinned_host", keep_residuals=1)),
    "resweep_device_update": ("resweep", dict(update_on="device")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_exact_hold_equals_reference_and_the_gpu_hold(case):
    hold, kw = CASES[case]
    ref, want = _reference()
    st, got, weights = _run(hold, **kw)
    if kw.get("activations") == "pinned_host":
        assert st.last_step_info["offload_activations"]
    for (rl, rn), (sl, sn) in zip(want, got):
        assert abs(rl - sl) <= 1e-5 * abs(rl) and abs(rn - sn) <= 1e-4 * rn, (want, got)
    errs = _group_rel_errors(ref.params_tree(), st)
    assert max(errs.values()) < 1e-5, errs
    moved = init_host_store(MODEL, 0, bf16_stream=False)[1]["block_0"].master - weights["block_0"]
    assert np.linalg.norm(moved) > 1e-3  # the run really trained
    # the same values reach the same update as with every gradient held on the GPU: bit for bit (CPU)
    _, base, base_w = _run("gpu_fp32", **kw)
    assert got == base
    _assert_equal_weights(weights, base_w)


@pytest.mark.parametrize("hold,update_on", [("host_bf16", "host"), ("host_bf16", "device"),
                                             ("pinned_bf16", "host"), ("pinned_bf16", "device")])
def test_bf16_host_holds_equal_the_gpu_bf16_hold_and_track_the_reference(hold, update_on):
    """bf16 on the device before the copy (norm in fp32 first), widened exactly on the host (pageable, or
    pinned beside the parked activations): the same update as the GPU's bf16 hold, bit for bit; within
    bf16 rounding of the reference (two micro-batches, so the gradients are not bf16 values already)."""
    ref, want = _reference()
    acts = dict(activations="pinned_host") if hold == "pinned_bf16" else {}
    st, got, weights = _run(hold, micro_batches=2, update_on=update_on, **acts)
    if hold == "pinned_bf16":
        assert st.last_step_info["offload_activations"]
    _, base, base_w = _run("gpu_bf16", micro_batches=2, update_on=update_on)
    assert got == base
    _assert_equal_weights(weights, base_w)
    assert got[0] == pytest.approx(want[0], rel=1e-5)  # the first step precedes any update
    np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], rtol=5e-3)
    init = init_host_store(MODEL, 0, bf16_stream=False)[1]
    ref_tree = ref.params_tree()
    ref_w = {"embed": ref_tree["embed"], "head": ref_tree["head"],
             **{f"block_{i}": t for i, t in ref_tree["layers"].items()}}
    for name, tree in ref_w.items():
        flat = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(tree)])
        dr, dh = flat - init[name].master, weights[name] - init[name].master
        assert np.linalg.norm(dr - dh) < 0.05 * np.linalg.norm(dr), name


def test_a_bf16_holds_optax_host_update_reads_it_widened_like_the_gpu_bf16_hold():
    """An optax host optimizer (no fused kernel to take the bits) reads a pinned bf16 hold widened to fp32: the
    same steps, bit for bit, as with the GPU's bf16 hold."""
    _, got, weights = _run("pinned_bf16", micro_batches=2, activations="pinned_host", kernel="optax")
    _, base, base_w = _run("gpu_bf16", micro_batches=2, kernel="optax")
    assert got == base
    _assert_equal_weights(weights, base_w)


def test_pinned_bf16_hold_waits_in_pinned_bf16_arrays_and_reads_back_exactly(monkeypatch):
    """Each block's gradient waits as one pinned bf16 array (half of pinned_host's), and the host update
    reads it widened to fp32 exactly."""
    from megatrain_jax.engine import holds

    made = []
    real = holds.PinnedHeld.__init__

    def spy(self, arr, xfer, scratch=None):
        real(self, arr, xfer, scratch)
        made.append(self)

    monkeypatch.setattr(holds.PinnedHeld, "__init__", spy)
    parts, store = init_host_store(MODEL, 0, bf16_stream=False)
    st = StreamedTrainer(parts, build_host_optimizer(OCFG, STEPS), compute_dtype="float32", clip_norm=CLIP,
                         loss_chunk=48, store=store, grad_hold="pinned_bf16", activations="pinned_host", **SLABS)
    st.step(_batches_5()[0])
    st.close()
    assert len(made) == MODEL.num_layers + 2  # every group
    for held in made:
        assert held.arr.dtype == jax.numpy.bfloat16 and held.arr.sharding.memory_kind == "pinned_host"
        bits = np.asarray(held.xfer.host_view(held.arr)).view(np.uint16)
        got = held.read(0, bits.size)
        np.testing.assert_array_equal(got.view(np.uint32), bits.astype(np.uint32) << 16)


def test_split_hold_keeps_the_first_groups_on_the_gpu_in_bf16():
    """grad_hold_gpu_groups=2 with host_fp32: the embedding and block 0 (needed first by the next
    forward) wait on the GPU in bf16, the rest in pageable host memory in fp32. After two steps each
    group equals the run that held it the same way everywhere (Adam's first step is sign-like: bf16
    rounding shows from the second, whose gradients all three runs compute from the same weights);
    over five, the reference to bf16 rounding."""
    batches = _batches_5()[:2]

    def two_steps(hold, **kw):
        parts, store = init_host_store(MODEL, 0, bf16_stream=False)
        st = StreamedTrainer(parts, build_host_optimizer(OCFG, STEPS), compute_dtype="float32", clip_norm=CLIP,
                             loss_chunk=48, store=store, grad_hold=hold, micro_batches=2, **{**SLABS, **kw})
        for b in batches:
            st.step(b)
        st.close()
        return st, {g.name: g.master.copy() for g in st.store}

    st, split = two_steps("host_fp32", grad_hold_gpu_groups=2)
    assert set(st.updates.pageable._bufs) == {"head", "block_1", "block_2"}  # host-held: all but the first two
    _, gpu_bf16 = two_steps("gpu_bf16")
    _, host_fp32 = two_steps("host_fp32")
    for name in split:
        np.testing.assert_array_equal(split[name], (gpu_bf16 if name in ("embed", "block_0") else host_fp32)[name],
                                      err_msg=name)
    assert not np.array_equal(split["embed"], host_fp32["embed"])  # the bf16 hold really rounds
    _, want = _reference()
    _, got, _ = _run("host_fp32", grad_hold_gpu_groups=2, micro_batches=2)
    np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], rtol=5e-3)


RESWEEP_SPLIT = {
    # name: engine options; each run with grad_hold_gpu_groups=2 (the embedding and block 0 held on the GPU in bf16)
    "host_update": dict(micro_batches=2),
    "device_update": dict(micro_batches=2, update_on="device"),
    "pinned_activations_kept_residuals": dict(micro_batches=2, activations="pinned_host", keep_residuals=1),
    "stream_io": dict(micro_batches=2, stream_io=True),
    # block 1's input is recomputed from block 0's, which the first sweep must keep for the second
    "boundary_every_2": dict(micro_batches=2, boundary_every=2),
}


@pytest.mark.parametrize("case", list(RESWEEP_SPLIT))
def test_a_resweep_holding_its_first_groups_reruns_only_the_blocks_above_them(case, monkeypatch):
    """grad_hold=resweep with grad_hold_gpu_groups=2: the first sweep holds the embedding's and block 0's
    gradients on the GPU in bf16 (the backward's last), and the second sweep recomputes only blocks 2 and 1.
    Five clipped steps equal, bit for bit, the host hold that keeps the same two groups on the GPU in bf16 (the
    rest exact in fp32 both ways), and the steps are counted once (the schedule would show it)."""
    swept = _resweep_equals_the_host_hold(RESWEEP_SPLIT[case], 2, monkeypatch)
    assert swept == [(2, False), (1, False), (0, False), (2, True), (1, True)] * STEPS


@pytest.mark.parametrize("case", ["host_update", "device_update", "boundary_every_2"])
def test_a_resweep_holding_every_block_runs_no_block_again(case, monkeypatch):
    """grad_hold_gpu_groups=4 of a 3-block model: the embedding and every block wait on the GPU, so the second
    sweep sends the head's gradient and runs no block (it failed on an unset variable where the plan held all but
    the head: a 12-layer slice of the 110B shape on an H200), and five clipped steps equal the host hold that
    keeps the same four groups on the GPU, bit for bit."""
    swept = _resweep_equals_the_host_hold(RESWEEP_SPLIT[case], 4, monkeypatch)
    assert swept == [(2, False), (1, False), (0, False)] * STEPS


def test_a_resweep_starts_the_embeddings_host_update_at_the_norm_and_updates_from_the_swept_weights(monkeypatch):
    """The 110B's one-GPU plan: resweep with its first groups held, stream_io, update_on=device. The embedding's
    gradient waits in host memory, and its host update starts once the norm is known, before the second sweep's
    first block (applied after the sweep, it held back the next forward 6.6 s: bench_memory_plan.py); each block
    the second sweep updates starts from the weights its backward used, with no second fetch of its master. Five
    clipped steps still equal the host hold bit for bit, counted once."""
    from megatrain_jax.engine.device_updates import DeviceUpdates

    events, start, state = [], DeviceUpdates._start_on_host, DeviceUpdates._state_to_device
    real = StreamedTrainer._backward_block

    def started(self, name, grad, scale, count):
        events.append(("host update", name))
        return start(self, name, grad, scale, count)

    def fetched(self, name, master=True):
        events.append(("state", name, master))
        return state(self, name, master)

    def swept(self, i, w, acts, mbs, dhs, again=False):
        events.append(("backward", i, again))
        return real(self, i, w, acts, mbs, dhs, again)

    monkeypatch.setattr(DeviceUpdates, "_start_on_host", started)
    monkeypatch.setattr(DeviceUpdates, "_state_to_device", fetched)
    monkeypatch.setattr(StreamedTrainer, "_backward_block", swept)
    _resweep_equals_the_host_hold(dict(micro_batches=2, stream_io=True, update_on="device", early_state_groups=0),
                                  2, monkeypatch)
    step = events[:events.index(("backward", 2, False), 1)]  # the first step (the next starts at its backward)
    second = step.index(("backward", 2, True))
    assert step.index(("host update", "embed")) < step.index(("host update", "head")) < second, step
    fetches = [e for e in step[second:] if e[0] == "state" and e[1] in ("block_2", "block_1")]
    assert fetches == [("state", "block_2", False), ("state", "block_1", False)], step


def _resweep_equals_the_host_hold(kw: dict, held: int, monkeypatch) -> list[tuple[int, bool]]:
    """Five clipped steps of a resweep holding its first ``held`` groups on the GPU equal, bit for bit, the host
    hold that keeps the same groups there (steps counted once); returns the (block, second sweep?) backward calls
    of the resweep, in order."""
    swept = []
    real = StreamedTrainer._backward_block

    def spy(self, i, w, acts, mbs, dhs, again=False):
        swept.append((i, again))
        return real(self, i, w, acts, mbs, dhs, again)

    monkeypatch.setattr(StreamedTrainer, "_backward_block", spy)
    st, got, weights = _run_once("resweep", tuple(sorted({**kw, "grad_hold_gpu_groups": held}.items())))
    monkeypatch.setattr(StreamedTrainer, "_backward_block", real)
    _, base, base_w = _run("host_fp32", grad_hold_gpu_groups=held, **kw)
    assert got == base and st.count == STEPS
    _assert_equal_weights(weights, base_w)
    return swept


def test_resweep_with_a_nan_step_changes_nothing_and_skips_the_second_sweep():
    parts, store = init_host_store(MODEL, 0, bf16_stream=False)
    st = StreamedTrainer(parts, build_host_optimizer(OCFG, STEPS), compute_dtype="float32", clip_norm=CLIP,
                         skip_nonfinite=True, loss_chunk=48, store=store, grad_hold="resweep", **SLABS)
    sweeps = []
    real = st._resweep
    st._resweep = lambda *a: (sweeps.append(1), real(*a))
    batch = _batches_5()[0]
    before = {g.name: g.master.copy() for g in st.store}
    with st.nan_forward():
        bad = st.step(batch)
    st.finish()
    assert bad.skipped and not np.isfinite(bad.loss) and st.count == 0 and not sweeps
    for g in st.store:
        np.testing.assert_array_equal(g.master, before[g.name], err_msg=g.name)
    good = [st.step(batch) for _ in range(2)]  # (the warmup's first learning rate is 0)
    st.finish()
    assert not any(r.skipped for r in good) and st.count == 2 and sweeps == [1, 1]
    assert [g.name for g in st.store if np.array_equal(g.master, before[g.name])] == []
    st.close()


@pytest.mark.parametrize("hold", ["host_fp32", "host_bf16"])
def test_host_hold_keeps_pinned_memory_at_the_slab_pool(hold):
    """Every pinned array the step creates is one slab (<= grad_slab_elems values), never a whole
    group, and at most grad_slabs of them exist at once; the held gradients are plain numpy buffers,
    allocated once (the same memory every step)."""
    parts, store = init_host_store(MODEL, 0, bf16_stream=False)
    st = StreamedTrainer(parts, build_host_optimizer(OCFG, STEPS), compute_dtype="float32", clip_norm=CLIP,
                         loss_chunk=48, store=store, grad_hold=hold, grad_slab_elems=1000, grad_slabs=2)
    to_host, sizes, live, peak = st.xfer.to_host, [], set(), [0]

    def counting_to_host(x):
        arr = to_host(x)
        sizes.append(arr.size)
        key = id(arr)
        live.add(key)
        peak[0] = max(peak[0], len(live))
        weakref.finalize(arr, live.discard, key)
        return arr

    st.xfer.to_host = counting_to_host
    batches = _batches_5()[:3]
    st.step(batches[0])
    st.finish()
    bufs = {n: b.ctypes.data for n, b in st.updates.pageable._bufs.items()}
    for b in batches[1:]:
        st.step(b)
    st.close()
    assert sizes and max(sizes) <= 1000 and peak[0] <= 2, (max(sizes), peak[0])
    assert len(sizes) >= 3 * sum(-(-g.size // 1000) for g in st.store)  # every group left in slabs, every step
    held = st.updates.pageable._bufs
    assert {n: b.ctypes.data for n, b in held.items()} == bufs and set(held) == {g.name for g in st.store}
    itemsize = 2 if hold == "host_bf16" else 4
    assert all(isinstance(b, np.ndarray) and b.itemsize == itemsize for b in held.values())
    assert st.updates.pageable.nbytes() == itemsize * store.num_params()
    assert st.updates.slabs._value == 2  # every slab returned to the pool


def test_a_resweeps_sent_gradients_wait_on_the_device_at_most_the_planned_few(monkeypatch):
    """A resweep's second sweep sends each block's gradient as it completes, and its copies wait for the pinned
    slabs: at most HOLD_COPIES_IN_FLIGHT gradients may wait on the device for theirs, as the plan counts. Unbounded,
    26 of the 3B's 28 block gradients piled up on the H100 (experiments/probe_resweep_io.py)."""
    from megatrain_jax.engine.updaters import HostUpdates
    from megatrain_jax.bounds import HOLD_COPIES_IN_FLIGHT

    waiting, send = [], HostUpdates.send

    def counted(self, name, grad, scale=1.0, current=None):
        send(self, name, grad, scale, current)
        waiting.append(sum(1 for _, out in self._queue if not out.on_host))

    monkeypatch.setattr(HostUpdates, "send", counted)
    parts, store = init_host_store(MODEL, 0, bf16_stream=False)
    # one slab of 1000 values: every block (~31k values) needs 31 copies in turn, far slower than its backward
    st = StreamedTrainer(parts, build_host_optimizer(OCFG, STEPS), compute_dtype="float32", clip_norm=CLIP,
                         loss_chunk=48, store=store, grad_hold="resweep", grad_slab_elems=1000, grad_slabs=1)
    for b in _batches_5()[:2]:
        st.step(b)
    st.close()
    assert len(waiting) == 2 * (MODEL.num_layers + 2) and max(waiting) <= HOLD_COPIES_IN_FLIGHT, waiting
