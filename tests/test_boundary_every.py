"""``train.boundary_every=k``: the forward keeps every k-th block's input and the backward recomputes
the blocks between, segment by segment. The recompute runs the forward's own executables on the same
inputs and keys, so the step must train exactly what keeping every input trains."""
import numpy as np
import pytest

from megatrain_jax.config import ModelConfig, OptimConfig, ScheduleConfig
from megatrain_jax.engine import Batch, StreamedTrainer
from megatrain_jax.models.llama import init_host_store
from megatrain_jax.optim import build_host_optimizer

STEPS = 3
CLIP = 0.5  # below every step's norm here: clipping scales each step (asserted)
MODEL = dict(vocab_size=128, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=48, num_layers=5)


def _docs(b: int, s: int) -> tuple[np.ndarray, np.ndarray]:
    """Packed documents: row 0 three of them, the other rows two (segment ids, positions)."""
    seg = np.zeros((b, s), np.int32)
    seg[:, s // 3:] = 1
    seg[0, 2 * s // 3:] = 2
    pos = np.zeros((b, s), np.int32)
    for r in range(b):
        for d in np.unique(seg[r]):
            idx = np.nonzero(seg[r] == d)[0]
            pos[r, idx] = np.arange(len(idx))
    return seg, pos


def _batches(cfg: ModelConfig, docs: bool, b: int = 4, s: int = 24) -> list[Batch]:
    rng = np.random.default_rng(7)
    seg, pos = _docs(b, s) if docs else (None, None)
    out = []
    for _ in range(STEPS):
        toks = rng.integers(0, cfg.vocab_size, (b, s + 1))
        out.append(Batch(toks[:, :-1], toks[:, 1:], (rng.random((b, s)) > 0.2).astype(np.float32), seg, pos))
    return out


def _train(every: int, model: dict | None = None, docs: bool = False, **engine):
    cfg = ModelConfig(**{**MODEL, **(model or {})})
    ocfg = OptimConfig(lr=3e-3, b2=0.95, weight_decay=0.1, clip_norm=CLIP,
                       schedule=ScheduleConfig(kind="warmup_cosine", warmup_steps=1))
    parts, store = init_host_store(cfg, 0, bf16_stream=False)
    st = StreamedTrainer(parts, build_host_optimizer(ocfg, STEPS), compute_dtype="float32", clip_norm=CLIP,
                         loss_chunk=40, store=store, boundary_every=every, **engine)
    results = [st.step(b) for b in _batches(cfg, docs)]
    st.finish()
    state = {g.name: g.master.copy() for g in st.store}
    st.close()
    return [(r.loss, r.grad_norm) for r in results], state, st


def _assert_same(a, b):
    (ra, sa, _), (rb, sb, _) = a, b
    np.testing.assert_array_equal(ra, rb)  # bit for bit: the same executables on the same inputs
    assert sa.keys() == sb.keys()
    for name in sa:
        np.testing.assert_array_equal(sa[name], sb[name], err_msg=name)


CASES = {
    # name: (model overrides, documents in each sequence, engine options)
    "one_micro_batch": ({}, False, {}),
    "two_micro_batches": ({}, False, dict(micro_batches=2)),
    "pinned_host_activations": ({}, False, dict(micro_batches=2, transfer_mode="pinned", activations="pinned_host")),
    # 7-token tiles of a 24-token sequence (three tiles and a 3-token rest), three documents in a row
    "seq_tiles_document_masks": (dict(seq_tile=7), True, dict(micro_batches=2)),
    # the last two blocks keep their residuals (and so their inputs); the segments end before them
    "kept_residuals": ({}, True, dict(keep_residuals=2)),
    "device_updates": ({}, False, dict(update_on="device", micro_batches=2)),
    # blocks that add router statistics to the auxiliary loss: the recompute must not add them twice
    "moe_aux_loss": (dict(family="qwen3_moe", num_experts=4, experts_per_token=2, moe_intermediate_size=24,
                          router_aux_loss_coef=0.01), False, {}),
}


_KEEP_EVERY: dict = {}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("every", [2, 3])  # 3 does not divide the 5 layers: a short top segment
def test_boundary_every_equals_keeping_every_input(case, every):
    model, docs, engine = CASES[case]
    if case not in _KEEP_EVERY:  # the run that keeps every input: one per case, compared with both k
        _KEEP_EVERY[case] = _train(1, model, docs, **engine)
    base = _KEEP_EVERY[case]
    assert all(n > CLIP for _, n in base[0]), base[0]  # clipping scaled every step
    assert base[0][0] != base[0][-1]  # it trained
    got = _train(every, model, docs, **engine)
    _assert_same(got, base)
    if engine.get("activations") == "pinned_host":
        assert got[2].boundaries.offload
    if case == "moe_aux_loss":
        assert any(type(layer).__name__ == "EmitsStats" for layer in got[2].kernels.layers)


@pytest.mark.parametrize("every", [1, 2])
def test_a_split_placement_parks_only_the_first_blocks_and_trains_the_same(every):
    """``activations_gpu_blocks=2`` of 5: blocks 3 and 4 keep their inputs on the device, 0-2 park theirs
    (the ones kept at ``every``); the step trains bit for bit what parking every input trains."""
    pinned = dict(micro_batches=2, transfer_mode="pinned", activations="pinned_host")
    base = _train(every, **pinned)
    got = _train(every, **pinned, activations_gpu_blocks=2)
    _assert_same(got, base)
    kept = {i for i in range(5) if i % every == 0}
    assert base[2].boundaries._parked == kept
    assert got[2].boundaries._parked == kept & {0, 1, 2}
    assert got[2].boundaries.offload


@pytest.mark.slow
def test_recompute_runs_each_block_at_most_once_and_keeps_few_inputs():
    """Per step: the forward of each non-kept block's predecessor runs once more, never twice; the
    boundary inputs alive at once stay ~L/k + k, not L."""
    cfg = ModelConfig(**{**MODEL, "num_layers": 7})
    parts, store = init_host_store(cfg, 0, bf16_stream=False)
    st = StreamedTrainer(parts, build_host_optimizer(OptimConfig(lr=1e-3), 2), compute_dtype="float32",
                         store=store, boundary_every=3)
    acts, again, alive = st.boundaries, [], []
    forward = st._forward_again

    def counting(b, hs, mbs):
        again.append(b)
        alive.append(len(acts._saved) + len(acts._back))
        return forward(b, hs, mbs)

    st._forward_again = counting
    st.step(_batches(cfg, False)[0])
    kept = [i for i in range(7) if i % 3 == 0]  # 0, 3, 6
    assert again == [3, 4, 0, 1]  # segments [3..5] and [0..2], top first; block 6 kept, so no [6..6]
    assert max(alive) <= len(kept) + 3
    assert not acts._saved and not acts._back  # everything freed by the end of the step
    st.close()


class _Recorder:
    """A stand-in step: block b's forward maps its input [b, 10b] (two micro-batches) to [b+1, 10(b+1)]."""

    def __init__(self):
        self.runs = []

    def __call__(self, b, hs):
        self.runs.append(b)
        return [hs[0] + 1, hs[1] + 10]


@pytest.mark.parametrize("every,layers", [(1, 5), (2, 5), (3, 5), (3, 7), (4, 4), (5, 3)])
def test_boundaries_give_every_input_once_per_sweep_and_again_for_a_second_sweep(every, layers):
    """Boundaries alone (no accelerator): the backward's calls in its order give block i the input i, for
    one sweep and, with ``forget=False`` on the first, for a second sweep over the same kept inputs
    (``grad_hold=resweep``), each sweep recomputing each dropped input once."""
    from megatrain_jax.engine.weights import Boundaries

    acts, fwd = Boundaries(None, offload=False, every=every), _Recorder()
    acts.start(fwd)
    for i in range(layers):
        acts.keep([i, 10 * i])
    assert sorted(acts._saved) == [i for i in range(layers) if i % every == 0]
    for forget in (False, True):
        fwd.runs.clear()
        acts.bring(layers - 1)
        for i in reversed(range(layers)):
            assert acts.take(i, forget) == [i, 10 * i]
            assert acts.first(i - 1) <= i - 1
            acts.bring(i - 1)
        assert sorted(fwd.runs) == [b for b in range(layers - 1) if (b + 1) % every]  # each dropped input once
    assert not acts._saved and not acts._back
