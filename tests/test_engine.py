"""The streamed engine equals the plain in-memory reference trainer (fp32), step by step."""
import jax
import numpy as np
import optax
import pytest

from megatrain_jax.config import ModelConfig, OptimConfig, ScheduleConfig
from megatrain_jax.engine import Batch, StreamedTrainer, chunked_cross_entropy
from megatrain_jax.models import init_model, streamed_parts
from megatrain_jax.models.llama import init_host_store
from megatrain_jax.optim import build_host_optimizer, build_reference_tx
from megatrain_jax.reference import ReferenceTrainer

STEPS = 5


def _batches(rng, n, b, s, vocab, masked=True):
    out = []
    for _ in range(n):
        toks = rng.integers(0, vocab, (b, s + 1))
        mask = (rng.random((b, s)) > 0.2).astype(np.float32) if masked else None
        out.append(Batch(toks[:, :-1], toks[:, 1:], mask))
    return out


def _group_rel_errors(ref_tree, st):
    """‖Δ‖/‖ref‖ over each streamed group (embed, every block, head).

    Per group rather than per leaf on purpose: the key bias of attention has an exactly-zero true
    gradient (softmax is invariant to it), so Adam turns float noise there into O(lr) steps in
    *any* two correct implementations; per group that leaf's weight is negligible.
    """
    errs = {}
    groups = {"embed": ref_tree["embed"], "head": ref_tree["head"]}
    groups.update({f"block_{i}": t for i, t in ref_tree["layers"].items()})
    for name, tree in groups.items():
        a = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(tree)])
        b = st.store[name].master
        errs[name] = float(np.linalg.norm(a - b) / np.linalg.norm(a))
    return errs


CASES = {
    # name: (model overrides, micro_batches, clip, kernel)
    "untied_gqa_3layers": (dict(num_layers=3, num_kv_heads=2), 1, 1.0, "fused"),
    "tied_1layer": (dict(num_layers=1, tie_embeddings=True), 1, 1.0, "fused"),
    "qkv_bias_gqa": (dict(num_layers=3, num_kv_heads=1, qkv_bias=True), 1, None, "fused"),
    "accumulate_2_micro_batches": (dict(num_layers=3, num_kv_heads=2, tie_embeddings=True), 2, 1.0, "fused"),
    "optax_kernel_no_clip": (dict(num_layers=1), 1, None, "optax"),
    # the dma_map fallback (pinned host copies) and activations parked in pinned host memory
    "pinned_fallback_offloaded": (dict(num_layers=2, num_kv_heads=2), 2, 1.0, "fused"),
    # gradients leave in slabs of 1000 values through a pool of 2 pinned buffers (ragged last slab;
    # the pool is far smaller than one group, so the FIFO issue/update order is exercised)
    "slabs_of_1000_pool_of_2": (dict(num_layers=2, num_kv_heads=2), 1, 1.0, "fused"),
    "slabs_no_clip": (dict(num_layers=2), 1, None, "fused"),
    # deferred gradients wait for the norm in pinned host memory instead of on the device
    "grad_hold_pinned_host": (dict(num_layers=2, num_kv_heads=2), 1, 1.0, "fused"),
}
ENGINE_OPTIONS = {"pinned_fallback_offloaded": dict(transfer_mode="pinned", activations="pinned_host"),
                  "slabs_of_1000_pool_of_2": dict(grad_slab_elems=1000, grad_slabs=2, skip_nonfinite=True),
                  "slabs_no_clip": dict(grad_slab_elems=777, grad_slabs=3),
                  "grad_hold_pinned_host": dict(grad_hold="pinned_host", grad_slab_elems=5000)}


_REFERENCE_RUNS: dict = {}


def _reference_run(cfg, ocfg, batches):
    """The reference trainer's (loss, grad_norm) per step and its final weights, run once per model and
    optimizer config (cases that differ only in the engine's options share it; the batches are the same)."""
    key = (repr(cfg), repr(ocfg))  # the configs are dataclasses: equal reprs, equal runs
    if key not in _REFERENCE_RUNS:
        ref = ReferenceTrainer(init_model(cfg, 0), build_reference_tx(ocfg, STEPS))
        steps = [(r.loss, r.grad_norm) for r in map(ref.step, batches)]
        _REFERENCE_RUNS[key] = (steps, ref.params_tree())
    return _REFERENCE_RUNS[key]


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_equals_reference(case):
    over, micro, clip, kernel = CASES[case]
    cfg = ModelConfig(vocab_size=256, hidden_size=64, num_heads=4, intermediate_size=96, **over)
    ocfg = OptimConfig(lr=1e-3, b2=0.95, weight_decay=0.1, clip_norm=clip, kernel=kernel,
                       schedule=ScheduleConfig(kind="warmup_cosine", warmup_steps=2))
    batches = _batches(np.random.default_rng(1), STEPS, 4, 32, cfg.vocab_size)
    ref_steps, ref_params = _reference_run(cfg, ocfg, batches)
    parts, store = init_host_store(cfg, 0, bf16_stream=False)
    st = StreamedTrainer(parts, build_host_optimizer(ocfg, STEPS), compute_dtype="float32",
                         micro_batches=micro, clip_norm=clip, loss_chunk=48, store=store,
                         **ENGINE_OPTIONS.get(case, {}))
    if case == "pinned_fallback_offloaded":
        assert st.xfer.mode == "pinned" and len(st.xfer._fallback) == cfg.num_layers + 2
    for batch, (r_loss, r_norm) in zip(batches, ref_steps):
        s = st.step(batch)
        assert abs(r_loss - s.loss) <= 1e-5 * abs(r_loss), (r_loss, s.loss)
        assert abs(r_norm - s.grad_norm) <= 1e-4 * r_norm
        if case == "pinned_fallback_offloaded":
            assert st.last_step_info["offload_activations"]
    st.close()  # waits for the last updates
    errs = _group_rel_errors(ref_params, st)
    assert max(errs.values()) < 1e-5, errs
    # the run must actually have moved the weights, or equality proves nothing
    init = init_model(cfg, 0)
    moved = np.linalg.norm(np.asarray(init.layers[0].mlp.up_proj.kernel[...]) - st.store["block_0"].tree()["mlp"]["up_proj"]["kernel"])
    assert moved > 1e-3


def test_init_host_store_equals_whole_model_init():
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_heads=2, intermediate_size=48)
    _, store = init_host_store(cfg, 3, bf16_stream=True)
    whole = streamed_parts(init_model(cfg, 3)).host_trees()
    for name, tree in whole.items():
        flat = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(tree)])
        np.testing.assert_array_equal(store[name].master, flat)
        np.testing.assert_array_equal(store[name].stream_view().astype(np.float32), flat.astype(store[name].stream_view().dtype).astype(np.float32))


def test_bf16_compute_tracks_fp32():
    """bf16 compute over fp32 masters: same loss to bf16 accuracy, and the loss falls."""
    cfg = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=96)
    ocfg = OptimConfig(lr=3e-3, clip_norm=1.0)
    batches = _batches(np.random.default_rng(2), 6, 4, 32, 64, masked=False)  # 64-token alphabet: learnable
    runs = {}
    for dt in ("float32", "bfloat16"):
        parts, store = init_host_store(cfg, 0, bf16_stream=dt == "bfloat16")
        st = StreamedTrainer(parts, build_host_optimizer(ocfg, 6), compute_dtype=dt, store=store)
        runs[dt] = [st.step(b).loss for b in batches]
        st.close()
    np.testing.assert_allclose(runs["bfloat16"], runs["float32"], rtol=2e-2)
    assert runs["bfloat16"][-1] < runs["bfloat16"][0] - 0.1


def test_chunked_cross_entropy_matches_full():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 37, 16)).astype(np.float32)
    w = rng.standard_normal((16, 50)).astype(np.float32)
    y = rng.integers(0, 50, (2, 37))
    m = (rng.random((2, 37)) > 0.3).astype(np.float32)
    full = optax.softmax_cross_entropy_with_integer_labels(np.einsum("bsh,hv->bsv", x, w), y)
    want = float(np.sum(np.asarray(full) * m))
    for chunk in (5, 16, 74, 1000):
        assert abs(float(chunked_cross_entropy(x, w, y, m, chunk)) - want) < 1e-4 * abs(want)


def test_gradients_cross_in_slabs_of_the_configured_size():
    """Every group's gradient is cut into slabs of at most grad_slab_elems values."""
    cfg = ModelConfig(vocab_size=256, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=48)
    parts, store = init_host_store(cfg, 0, bf16_stream=False)
    st = StreamedTrainer(parts, build_host_optimizer(OptimConfig(), 1), compute_dtype="float32", store=store,
                         grad_slab_elems=1000)
    out = st.updates.grad_out("embed", None)
    assert out.chunks[0] == (0, 1000) and out.chunks[-1][1] == store["embed"].size
    assert all(hi - lo <= 1000 for lo, hi in out.chunks) and len(out.chunks) == -(-store["embed"].size // 1000)
    st.close()
    # the optax kernel updates whole groups (its state is a pytree): one slab per group
    st = StreamedTrainer(parts, build_host_optimizer(OptimConfig(kernel="optax"), 1), compute_dtype="float32",
                         store=store, grad_slab_elems=1000)
    assert len(st.updates.grad_out("embed", None).chunks) == 1
    st.close()


def _bf16_run(cfg, ocfg, batches, stream_copy: str, grad_hold: str = "gpu_fp32", micro: int = 1):
    parts, store = init_host_store(cfg, 0, bf16_stream=stream_copy == "host")
    st = StreamedTrainer(parts, build_host_optimizer(ocfg, len(batches)), compute_dtype="bfloat16", store=store,
                         micro_batches=micro,
                         clip_norm=ocfg.clip_norm, grad_hold=grad_hold, grad_slab_elems=3000)
    losses = [st.step(b).loss for b in batches]
    st.close()
    return losses, {g.name: g.master.copy() for g in st.store}


def test_device_side_cast_equals_host_bf16_copy():
    """train.stream_copy=device (fp32 master streamed, cast on the device) computes exactly what the
    host's bf16 copy computes: both round to nearest even, so losses and weights are bit-identical."""
    cfg = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96)
    ocfg = OptimConfig(lr=3e-3, clip_norm=1.0)
    batches = _batches(np.random.default_rng(4), 4, 4, 32, 64)
    host_l, host_w = _bf16_run(cfg, ocfg, batches, "host")
    dev_l, dev_w = _bf16_run(cfg, ocfg, batches, "device")
    assert host_l == dev_l
    for name in host_w:
        np.testing.assert_array_equal(host_w[name], dev_w[name])


def test_bf16_gradient_hold_tracks_fp32_hold():
    """Gradients held in bf16 for clipping (norm taken in fp32 first): the loss curve stays within
    bf16 rounding of the fp32 hold's, and the weights move the same way. Two micro-batches: with one,
    a bf16 model's weight gradients are bf16 values already and the hold loses nothing."""
    cfg = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=96)
    ocfg = OptimConfig(lr=3e-3, clip_norm=1.0)
    batches = _batches(np.random.default_rng(5), 6, 4, 32, 64, masked=False)
    f_l, f_w = _bf16_run(cfg, ocfg, batches, "host", "gpu_fp32", micro=2)
    b_l, b_w = _bf16_run(cfg, ocfg, batches, "host", "gpu_bf16", micro=2)
    assert f_l[0] == b_l[0]  # the first loss precedes any update
    np.testing.assert_allclose(b_l, f_l, rtol=5e-3)
    assert any(not np.array_equal(f_w[n], b_w[n]) for n in f_w)  # the bf16 hold really rounds
    init = init_host_store(cfg, 0, bf16_stream=False)[1]
    for name in f_w:
        df, db = f_w[name] - init[name].master, b_w[name] - init[name].master
        assert np.linalg.norm(df - db) < 0.05 * np.linalg.norm(df)


def test_a_failing_host_update_raises_instead_of_holding_the_slab_pool():
    """An exception on the optimizer thread returns its slabs: with a pool far smaller than one group,
    the next step raises that exception (it used to wait forever for a slab)."""
    import concurrent.futures

    cfg = ModelConfig(vocab_size=256, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=48)
    parts, store = init_host_store(cfg, 0, bf16_stream=False)
    opt = build_host_optimizer(OptimConfig(), 3)

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    opt.update = boom
    st = StreamedTrainer(parts, opt, compute_dtype="float32", store=store, clip_norm=1.0, grad_slab_elems=1000,
                         grad_slabs=2)
    batch = _batches(np.random.default_rng(0), 1, 2, 16, 256)[0]
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(lambda: [st.step(batch) for _ in range(3)])
        with pytest.raises(OSError, match="No space"):
            fut.result(timeout=120)
    with pytest.raises(OSError):
        st.close()


def test_the_optimizer_thread_never_waits_for_the_copy_lock_held_by_a_slab_waiter():
    """The interleaving that hung a CI run: the dispatching thread holds the copy lock while it waits
    for a slab, and the optimizer thread, which alone frees slabs, timed out on a chunk's event and
    waited for that lock. Slow copies and an instant issue timeout make it happen every step."""
    import concurrent.futures
    import time

    cfg = ModelConfig(vocab_size=256, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=48)
    parts, store = init_host_store(cfg, 0, bf16_stream=False)
    st = StreamedTrainer(parts, build_host_optimizer(OptimConfig(), 4), compute_dtype="float32", store=store,
                         clip_norm=1.0, grad_slab_elems=500, grad_slabs=2)
    st.updates.issue_wait_s = 1e-4
    to_host = st.xfer.to_host

    def slow_to_host(x):
        time.sleep(0.01)  # the issuing thread holds the copy lock meanwhile
        return to_host(x)

    st.xfer.to_host = slow_to_host
    batch = _batches(np.random.default_rng(0), 1, 2, 16, 256)[0]
    ex = concurrent.futures.ThreadPoolExecutor(1)
    fut = ex.submit(lambda: ([st.step(batch) for _ in range(3)], st.finish()))
    try:
        fut.result(timeout=120)  # a deadlock never returns
    finally:
        ex.shutdown(wait=False)
    st.close()


def test_soft_capped_chunked_cross_entropy_and_its_gradient_match_the_plain_formula():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 19, 8)).astype(np.float32)
    w = (rng.standard_normal((8, 30)) * 3).astype(np.float32)
    y = rng.integers(0, 30, (2, 19))
    m = (rng.random((2, 19)) > 0.3).astype(np.float32)

    def plain(x, w):
        logits = 5.0 * jax.numpy.tanh(jax.numpy.einsum("bsh,hv->bsv", x, w) / 5.0)
        return jax.numpy.sum(optax.softmax_cross_entropy_with_integer_labels(logits, y) * m)

    # jitted: one compilation each instead of every op (and each chunk's) on its own
    want, (gx, gw) = jax.jit(jax.value_and_grad(plain, argnums=(0, 1)))(x, w)
    got, (cx, cw) = jax.jit(jax.value_and_grad(lambda x, w: chunked_cross_entropy(x, w, y, m, 7, 5.0),
                                               argnums=(0, 1)))(x, w)
    assert abs(float(got) - float(want)) < 1e-5 * abs(float(want))
    np.testing.assert_allclose(cx, gx, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(cw, gw, rtol=1e-4, atol=1e-6)
    # and capping changes the result (the test would notice it being ignored)
    assert abs(float(jax.jit(lambda x, w: chunked_cross_entropy(x, w, y, m, 7))(x, w)) - float(want)) > 1e-3


def _kept_run(cfg, ocfg, batches, keep: int, micro: int, dtype: str, update_on: str = "host"):
    parts, store = init_host_store(cfg, 0, bf16_stream=False)
    st = StreamedTrainer(parts, build_host_optimizer(ocfg, len(batches)), compute_dtype=dtype, store=store,
                         micro_batches=micro, clip_norm=ocfg.clip_norm, loss_chunk=48, keep_residuals=keep,
                         update_on=update_on, stream_copy="device")  # the store has no bf16 copy
    res = [st.step(b) for b in batches]
    st.close()
    return st, [(r.loss, r.grad_norm) for r in res], {g.name: g.master.copy() for g in st.store}


@pytest.mark.parametrize("dtype,micro,update_on", [("float32", 2, "host"), ("bfloat16", 1, "host"),
                                                   ("bfloat16", 2, "device")])
def test_kept_residuals_equal_recompute(dtype, micro, update_on):
    """The last blocks' backward from their forward's kept VJP residuals computes exactly what the
    recompute computes: same losses, norms and weights, bit for bit (the same operations run)."""
    cfg = ModelConfig(vocab_size=256, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                      intermediate_size=96)
    ocfg = OptimConfig(lr=3e-3, clip_norm=1.0)
    batches = _batches(np.random.default_rng(7), 3, 4, 32, cfg.vocab_size)
    _, base, w0 = _kept_run(cfg, ocfg, batches, 0, micro, dtype, update_on)
    st, kept, w2 = _kept_run(cfg, ocfg, batches, 2, micro, dtype, update_on)
    assert st.keep_residuals == 2 and len(st.kernels.vjp_jits) == 1  # one compiled pair serves both blocks
    assert kept == base
    for name in w0:
        np.testing.assert_array_equal(w0[name], w2[name], err_msg=name)
    # all blocks asked for: the first still recomputes (its weights are the next update's start)
    st_all, _, _ = _kept_run(cfg, ocfg, batches[:1], 10, micro, dtype, update_on)
    assert st_all.keep_residuals == cfg.num_layers - 1
    h = jax.ShapeDtypeStruct((4 // micro, 32, cfg.hidden_size), dtype)
    aux = st.kernels.aux_of(jax.numpy.zeros((4 // micro, 32), jax.numpy.int32), None)
    res = st.residual_bytes(h, aux)
    assert res > 4 // micro * 32 * cfg.intermediate_size  # at least the MLP's activations
    # neither the block's weights (one copy per micro-batch, as jit outputs) nor its input, which the step
    # keeps anyway: the residuals are per token, under (q + 2 kv + H + 2 F) values plus the rotary tables
    per_token = (cfg.hidden_size + 2 * 2 * 16 + cfg.hidden_size + 2 * cfg.intermediate_size) \
        * np.dtype(dtype).itemsize + 4 * 16
    assert res <= 4 // micro * 32 * per_token, (res, per_token)


class _Recorder:
    """A tracer that keeps the order in which the step reports its transfers and computations."""

    def __init__(self):
        self.events: list[tuple[str, str]] = []

    def watch(self, lane, label, arr):
        self.events.append((lane, label))

    def interval(self, lane, label, t0, t1):
        pass


@pytest.mark.parametrize("update_on", ["host", "device"])
def test_the_step_issues_each_transfer_before_the_compute_it_hides_behind(update_on):
    """Issue order decides overlap (docs/design.md section 2), checked on the order of dispatch, not on time: block
    i+1's weights are put in flight before block i's forward is dispatched, block i-1's before block i's
    backward, and the head during the last blocks only; a device-side update is dispatched before the
    next block's transfer (an update dispatched after a transfer would wait for it)."""
    cfg = ModelConfig(vocab_size=256, hidden_size=32, num_layers=4, num_heads=2, intermediate_size=48)
    parts, store = init_host_store(cfg, 0, bf16_stream=False)
    rec = _Recorder()
    st = StreamedTrainer(parts, build_host_optimizer(OptimConfig(), 3), compute_dtype="float32", store=store,
                         clip_norm=1.0, update_on=update_on)
    st.tracer = rec  # set between steps, as train.trace_step does
    batch = _batches(np.random.default_rng(0), 1, 2, 16, 256)[0]
    st.step(batch)
    if update_on == "host":
        st.finish()  # every host update done: no block waits for its own (the order is then fixed)
    rec.events.clear()
    st.step(batch)  # the steady state: last step's updates are applied as this one fetches each group
    ev = [e for e in rec.events if e[0] in ("h2d", "compute")]
    st.close()

    def at(lane, label, after=-1):
        return next(j for j, e in enumerate(ev) if j > after and e == (lane, label))

    L = cfg.num_layers
    first = 1 if update_on == "device" else 0  # device-side: block 0's weights stayed on the device
    for i in range(first, L - 1):
        assert at("h2d", f"block_{i + 1}") < at("compute", f"fwd {i}"), (i, ev)
        if update_on == "device":
            assert at("compute", f"update block_{i}") < at("h2d", f"block_{i + 1}"), (i, ev)
    loss = at("compute", "loss")
    for i in range(1, L - (update_on == "device")):  # the backward fetches block i-1 before block i's VJP
        assert at("h2d", f"block_{i - 1}", after=loss) < at("compute", f"bwd {i}"), (i, ev)
    if update_on == "host":  # the head: in flight while the last two blocks compute, not earlier
        assert at("compute", f"fwd {L - 3}") < at("h2d", "head") < at("compute", f"fwd {L - 2}"), ev
    else:  # its update after the last block's forward, which it must not hold back
        assert at("compute", f"fwd {L - 1}") < at("compute", "update head"), ev


def test_nan_forward_makes_one_step_non_finite_and_it_changes_nothing():
    """``nan_forward`` (the fault-injection point of train.py's NaN drill): a step run inside it has a
    NaN loss and, with ``skip_nonfinite``, leaves every weight as it was; the next step trains."""
    cfg = ModelConfig(vocab_size=256, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=48)
    parts, store = init_host_store(cfg, 0, bf16_stream=False)
    st = StreamedTrainer(parts, build_host_optimizer(OptimConfig(), 3), compute_dtype="float32", store=store,
                         skip_nonfinite=True)
    batch = _batches(np.random.default_rng(0), 1, 2, 16, 256)[0]
    before = {g.name: g.master.copy() for g in st.store}
    with st.nan_forward():
        bad = st.step(batch)
    st.finish()
    assert bad.skipped and not np.isfinite(bad.loss) and st.count == 0
    for g in st.store:
        np.testing.assert_array_equal(g.master, before[g.name], err_msg=g.name)
    good = st.step(batch)
    st.finish()
    assert not good.skipped and np.isfinite(good.loss) and st.count == 1
    assert any(not np.array_equal(g.master, before[g.name]) for g in st.store)
    st.close()



def test_trainers_share_kernels_only_with_an_equal_model():
    """Kernels are kept across trainers (engine/kernels.py: ``program_key``) only for what compiles alike: an
    equal model, layouts, mesh, dtype and loss chunk; another config, chunk or dtype gets kernels of its own,
    and a model whose functions may hold its weights (``templates.from_fn``) is never kept."""
    from jax.sharding import Mesh

    from megatrain_jax.engine.kernels import program_key
    from megatrain_jax.templates import StreamedModel, from_fn

    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=48)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))

    def key(c, dtype="float32", chunk=48, seed=0):
        parts, store = init_host_store(c, seed, bf16_stream=False)
        return program_key(parts, store, mesh, dtype, chunk)

    k = key(cfg)
    assert k is not None and key(cfg, seed=1) == k  # another seed, the same programs
    whole = streamed_parts(init_model(cfg, 2))  # the whole model's parts: the same functions as the abstract one's
    _, store = init_host_store(cfg, 0, bf16_stream=False)
    assert program_key(whole, store, mesh, "float32", 48) == k
    for other in (key(ModelConfig(**{**vars(cfg), "rope_theta": 5e5})),
                  key(ModelConfig(**{**vars(cfg), "qkv_bias": True})), key(cfg, dtype="bfloat16"), key(cfg, chunk=64)):
        assert other is not None and other != k
    own = StreamedModel(whole.embed_fn, from_fn(lambda w, h, aux: h, [{"w": np.zeros(2)}] * 2), whole.head_fn,
                        whole.aux_fn, None, None, False)
    assert program_key(own, store, mesh, "float32", 48) is None
