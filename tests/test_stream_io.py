"""``stream_io``: the embedding's rows gathered per batch and the head streamed in vocabulary chunks
equal the reference trainer (fp32), and the resident engine's loss."""
import numpy as np
import pytest

from megatrain_jax.config import ModelConfig, OptimConfig, ScheduleConfig
from megatrain_jax.engine import Batch, StreamedTrainer
from megatrain_jax.errors import UserError
from megatrain_jax.models import init_model
from megatrain_jax.models.llama import init_host_store
from megatrain_jax.optim import build_host_optimizer, build_reference_tx
from megatrain_jax.reference import ReferenceTrainer

STEPS = 5


def _batches(rng, n, b, s, vocab, used=None, pad=None):
    """Masked batches; ``used``: tokens drawn from only the last this many ids (the rows a batch needs:
    remapped ids then differ from the token ids); ``pad``: every fifth token is this id."""
    out = []
    for _ in range(n):
        toks = rng.integers(vocab - (used or vocab), vocab, (b, s + 1))
        if pad is not None:
            toks[:, ::5] = pad
        mask = (rng.random((b, s)) > 0.2).astype(np.float32)
        out.append(Batch(toks[:, :-1], toks[:, 1:], mask))
    return out


def _group_errors(ref_tree, st):
    groups = {"embed": ref_tree["embed"], "head": ref_tree["head"]}
    groups.update({f"block_{i}": t for i, t in ref_tree["layers"].items()})
    import jax
    errs = {}
    for name, tree in groups.items():
        a = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(tree)])
        errs[name] = float(np.linalg.norm(a - st.store[name].master) / np.linalg.norm(a))
    return errs


CASES = {
    # name: (model overrides, micro-batches, clip, vocab chunk, extra options, ids the batches use); one
    # vocabulary (250: a ragged last chunk) wherever its size is not the point, so that the cases share
    # the reference's and the head's compiled programs (the persistent compilation cache)
    "clip_ragged_chunks": (dict(vocab_size=250), 1, 0.5, 64, {}, None),
    "two_micro_batches": (dict(vocab_size=250), 2, 0.5, 100, {}, None),
    "no_clip_few_rows": (dict(vocab_size=250), 1, None, 96, {}, 40),
    "softcap_gemma2": (dict(vocab_size=200, family="gemma2", final_softcap=5.0, num_kv_heads=2), 1, 0.5, 64, {}, None),
    # the padding id (no gradient through the embedding) inside the gathered rows, and beyond them
    "pad_token": (dict(vocab_size=256, pad_token_id=3), 2, 0.5, 128, {}, 8),
    "pad_token_beyond_rows": (dict(vocab_size=1100, pad_token_id=1050), 1, 0.5, 512, {}, 30),
    # tied (head = embedding^T): the head's chunks are rows of the table and its gradient the embedding's
    "tied_two_micro_batches": (dict(vocab_size=250, tie_embeddings=True), 2, 0.5, 64, {}, None),
    "tied_softcap_pad_few_rows": (dict(vocab_size=200, family="gemma2", final_softcap=5.0, num_kv_heads=2,
                                       tie_embeddings=True, pad_token_id=7), 1, 0.5, 64, {}, 20),
    "pinned_slabs": (dict(vocab_size=250), 1, 0.5, 64,
                     dict(grad_hold="pinned_host", grad_slab_elems=3000, transfer_mode="pinned",
                          activations="pinned_host"), None),
    # blocks updated on the device, the embedding and head (gradients in host memory) by the host kernel
    "device_update_host_hold": (dict(vocab_size=250), 2, 0.5, 64,
                                dict(update_on="device", grad_hold="host_fp32", grad_slab_elems=3000), None),
    "device_update_tied": (dict(vocab_size=250, tie_embeddings=True), 1, 0.5, 64,
                           dict(update_on="device", grad_hold="gpu_fp32"), 30),
    # no hold: a second backward sweep from the kept top cotangents; the embedding's and head's gradients wait
    # in host memory where they were made (tied: the head's part is in the embedding's)
    "resweep": (dict(vocab_size=250), 2, 0.5, 64, dict(grad_hold="resweep"), None),
    # nothing held on the GPU: the embedding's gradient (made in host memory) still waits there for the norm, and
    # each block the second sweep updates on the device starts from the weights its backward used
    "resweep_device_update": (dict(vocab_size=250), 2, 0.5, 64, dict(grad_hold="resweep", update_on="device"), None),
    "resweep_tied_pinned": (dict(vocab_size=250, tie_embeddings=True), 1, 0.5, 64,
                            dict(grad_hold="resweep", activations="pinned_host", transfer_mode="pinned",
                                 grad_slab_elems=3000), 30),
}


@pytest.mark.parametrize("case", list(CASES))
def test_stream_io_equals_reference(case):
    over, micro, clip, chunk, extra, used = CASES[case]
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=48, **over)
    ocfg = OptimConfig(lr=1e-2, b2=0.95, weight_decay=0.1, clip_norm=clip,
                       schedule=ScheduleConfig(kind="warmup_cosine", warmup_steps=2))
    ref = ReferenceTrainer(init_model(cfg, 0), build_reference_tx(ocfg, STEPS))
    runs = {}
    for stream in (True, False):
        parts, store = init_host_store(cfg, 0, bf16_stream=False)
        runs[stream] = StreamedTrainer(parts, build_host_optimizer(ocfg, STEPS), compute_dtype="float32",
                                       micro_batches=micro, clip_norm=clip, loss_chunk=24, store=store,
                                       stream_io=stream, vocab_chunk=chunk, **extra)
    st, plain = runs[True], runs[False]
    assert st.io.head.n == -(-cfg.vocab_size // chunk)
    clipped = False
    for batch in _batches(np.random.default_rng(1), STEPS, 4, 16, cfg.vocab_size, used, cfg.pad_token_id):
        r, s, p = ref.step(batch), st.step(batch), plain.step(batch)
        assert abs(r.loss - s.loss) <= 1e-5 * abs(r.loss), (r.loss, s.loss)
        assert abs(p.loss - s.loss) <= 1e-5 * abs(p.loss), (p.loss, s.loss)
        assert abs(r.grad_norm - s.grad_norm) <= 1e-4 * r.grad_norm, (r.grad_norm, s.grad_norm)
        clipped |= clip is not None and r.grad_norm > clip
    assert clip is None or clipped
    st.close()
    plain.close()
    errs = _group_errors(ref.params_tree(), st)
    assert max(errs.values()) < 1e-5, errs
    init = init_host_store(cfg, 0, bf16_stream=False)[1]
    for name in ("embed", "head"):  # the streamed groups really moved
        assert np.linalg.norm(st.store[name].master - init[name].master) > 1e-3


def test_only_the_batch_rows_and_a_chunk_reach_the_device():
    cfg = ModelConfig(vocab_size=4096, hidden_size=32, num_layers=1, num_heads=4, intermediate_size=48)
    parts, store = init_host_store(cfg, 0, bf16_stream=False)
    st = StreamedTrainer(parts, build_host_optimizer(OptimConfig(clip_norm=1.0), 2), compute_dtype="float32",
                         clip_norm=1.0, store=store, stream_io=True, vocab_chunk=512)
    batch = _batches(np.random.default_rng(0), 1, 2, 16, cfg.vocab_size, used=50)[0]
    rows = st.io.rows.take(batch, st._micro_batches(batch))
    assert rows.U == 1024 < cfg.vocab_size and rows.w.size == 1024 * 32  # one bucket of rows, not the table
    assert st.io.head._stages[0].size == 32 * 512
    st.step(batch)
    st.close()


@pytest.mark.parametrize("tied", [False, True])
def test_the_head_is_gathered_once_per_step_off_the_dispatching_thread(monkeypatch, tied):
    """The output matrix is staged chunk-major once per step (both passes transfer from it), on
    background threads, and the gradient chunks are scattered into the host gradient there too."""
    import threading

    from megatrain_jax.engine.io import HeadStream
    seen = {"gather": [], "scatter": []}
    real_gather, real_scatter = HeadStream._gather_rows, HeadStream._scatter_rows

    def gather(self, c, lo, hi, readers):
        seen["gather"].append((c, hi - lo, threading.current_thread()))
        return real_gather(self, c, lo, hi, readers)

    def scatter(self, c, lo, hi, fetch):
        seen["scatter"].append((c, hi - lo, threading.current_thread()))
        return real_scatter(self, c, lo, hi, fetch)

    monkeypatch.setattr(HeadStream, "_gather_rows", gather)
    monkeypatch.setattr(HeadStream, "_scatter_rows", scatter)
    V, H, Vc, steps = 250, 32, 64, 2
    cfg = ModelConfig(vocab_size=V, hidden_size=H, num_layers=2, num_heads=4, intermediate_size=48,
                      tie_embeddings=tied)
    parts, store = init_host_store(cfg, 0, bf16_stream=False)
    st = StreamedTrainer(parts, build_host_optimizer(OptimConfig(clip_norm=0.5), steps), compute_dtype="float32",
                         clip_norm=0.5, store=store, stream_io=True, vocab_chunk=Vc)
    head = st.io.head
    assert sum(b.size for b in head._stages) == head.n * H * Vc  # the whole head, one buffer per chunk
    for batch in _batches(np.random.default_rng(0), steps, 2, 16, V):
        st.step(batch)
    st.close()
    main = threading.main_thread()
    for what, rows in (("gather", lambda c: Vc if tied else H),
                       ("scatter", lambda c: min(Vc, V - c * Vc) if tied else H)):
        assert all(t is not main for _, _, t in seen[what]), what
        done = {c: sum(r for cc, r, _ in seen[what] if cc == c) for c in range(head.n)}
        assert done == {c: steps * rows(c) for c in range(head.n)}, (what, done)  # every row once per step




def test_at_most_two_head_chunk_gradients_are_on_their_way_to_the_host(monkeypatch):
    """Each chunk's gradient crosses to the host through XLA's pinned pool, whose size the plan sets for
    IO_HEAD_GRADS_IN_FLIGHT (2) chunks. The engine issued every chunk's copy without waiting, and kept each until
    the loss ended: the Qwen1.5-110B shape's ten 0.54 GB chunks ran the pool out in step 1 (bench_memory_plan.py).
    Counted here: the chunk gradients' host copies alive as each next one is issued (8 chunks + the small ones)."""
    import gc
    import weakref

    from megatrain_jax.engine.io import HeadStream
    from megatrain_jax.bounds import IO_HEAD_GRADS_IN_FLIGHT

    views, most = [], [0]
    real_fetch, real_out = HeadStream._fetch, HeadStream._out

    def fetch(self, arr):
        out = real_fetch(self, arr)
        views.append(weakref.ref(out))
        return out

    def out(self, c, g):
        # counted after a full collection (a copy held only by garbage is not on its way) wherever that can change
        # the verdict: over the bound, or while no live copy has been seen yet (a collection costs ~0.2 s here)
        alive = sum(v() is not None for v in views)
        if alive > IO_HEAD_GRADS_IN_FLIGHT or most[0] == 0:
            gc.collect()
            alive = sum(v() is not None for v in views)
        most[0] = max(most[0], alive)
        return real_out(self, c, g)

    monkeypatch.setattr(HeadStream, "_fetch", fetch)
    monkeypatch.setattr(HeadStream, "_out", out)
    V, H, Vc = 250, 32, 32
    cfg = ModelConfig(vocab_size=V, hidden_size=H, num_layers=2, num_heads=4, intermediate_size=48)
    parts, store = init_host_store(cfg, 0, bf16_stream=False)
    st = StreamedTrainer(parts, build_host_optimizer(OptimConfig(clip_norm=0.5), 2), compute_dtype="float32",
                         clip_norm=0.5, store=store, stream_io=True, vocab_chunk=Vc)
    assert st.io.head.n == 8
    for batch in _batches(np.random.default_rng(0), 2, 2, 16, V):
        st.step(batch)
    st.close()
    assert len(views) == 2 * (8 + 1)  # every chunk's gradient (and the small weights') went to the host
    assert 1 <= most[0] <= IO_HEAD_GRADS_IN_FLIGHT, most[0]


def test_bf16_stream_io_tracks_the_resident_head():
    """bf16 compute: the streamed loss follows the resident one to well within bf16 rounding."""
    cfg = ModelConfig(vocab_size=250, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=96)
    ocfg = OptimConfig(lr=3e-3, clip_norm=1.0)
    batches = [Batch(t[:, :-1], t[:, 1:], None) for t in np.random.default_rng(0).integers(0, 64, (4, 4, 33))]
    runs = {}
    for stream in (True, False):
        parts, store = init_host_store(cfg, 0, bf16_stream=True)
        st = StreamedTrainer(parts, build_host_optimizer(ocfg, 4), compute_dtype="bfloat16", clip_norm=1.0,
                             store=store, stream_io=stream, vocab_chunk=64, loss_chunk=48)
        runs[stream] = [st.step(b).loss for b in batches]
        if stream:  # the head is staged in bf16, cast on the host exactly as the device casts it
            import jax.numpy as jnp

            st.finish()
            head = st.io.head
            head._gather_rows(0, 0, head.H, [])
            assert head._stages[0].dtype == jnp.bfloat16
            on_device = np.asarray(jnp.asarray(head.out[:, :head.Vc]).astype(jnp.bfloat16))
            np.testing.assert_array_equal(head._stages[0].reshape(head.H, head.Vc).view(np.uint16),
                                          on_device.view(np.uint16))
        st.close()
    np.testing.assert_allclose(runs[True], runs[False], rtol=1e-3)


DP_SCRIPT = """
import jax, numpy as np
from megatrain_jax.config import ModelConfig, OptimConfig
from megatrain_jax.engine import Batch, StreamedTrainer
from megatrain_jax.models.llama import init_host_store
from megatrain_jax.optim import build_host_optimizer
cfg = ModelConfig(vocab_size=250, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=48)
ocfg = OptimConfig(lr=1e-2, clip_norm=0.5)
rng = np.random.default_rng(0)
toks = rng.integers(0, 250, (3, 4, 17))
batches = [Batch(t[:, :-1], t[:, 1:], (rng.random((4, 16)) > .2).astype(np.float32)) for t in toks]
out = {}
for stream in (True, False):
    parts, store = init_host_store(cfg, 0, bf16_stream=False)
    st = StreamedTrainer(parts, build_host_optimizer(ocfg, 3), compute_dtype="float32", clip_norm=0.5, store=store,
                         devices=jax.devices()[:2], micro_batches=2, stream_io=stream, vocab_chunk=64, loss_chunk=8)
    losses = [st.step(b).loss for b in batches]
    st.close()
    out[stream] = (np.array(losses), np.concatenate([g.master for g in st.store]))
np.testing.assert_allclose(out[True][0], out[False][0], rtol=1e-5)
assert np.linalg.norm(out[True][1] - out[False][1]) < 1e-5 * np.linalg.norm(out[False][1])
print("ok")
"""


def test_stream_io_over_two_devices_equals_the_resident_engine():
    """Data parallel (2 CPU devices, in a child process: the device count is fixed at start)."""
    import os
    import subprocess
    import sys

    from cli_runner import cpu_xla_flags
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_xla_flags(2))
    r = subprocess.run([sys.executable, "-c", DP_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_a_non_finite_step_changes_nothing_with_stream_io():
    """``nan_forward`` (train.py's NaN drill) poisons the streamed embedding too; with
    ``skip_nonfinite`` the step changes no weight (nor the host gradients' next use)."""
    cfg = ModelConfig(vocab_size=256, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=48)
    parts, store = init_host_store(cfg, 0, bf16_stream=False)
    st = StreamedTrainer(parts, build_host_optimizer(OptimConfig(), 3), compute_dtype="float32", store=store,
                         skip_nonfinite=True, stream_io=True, vocab_chunk=100)
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
    assert all(np.isfinite(g.master).all() for g in st.store)
    assert not np.array_equal(st.store["embed"].master, before["embed"])
    st.close()
