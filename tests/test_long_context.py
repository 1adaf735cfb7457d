"""Long sequences packed from shorter documents (issue 28 item 4): the data path builds them (windows over
the packed stream, segment ids and positions restarting at each document), and document masking keeps
them exact: each document of a long packed sequence gets the logits and gradients it gets alone, through
the long-sequence attention path (blockwise), sequence-tiled blocks and recompute from every k-th input."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from megatrain_jax.config import ModelConfig, OptimConfig, ScheduleConfig
from megatrain_jax.data.packed import PackedDataset
from megatrain_jax.engine import Batch, StreamedTrainer
from megatrain_jax.models import init_model
from megatrain_jax.models.llama import init_host_store
from megatrain_jax.optim import build_host_optimizer, build_reference_tx
from megatrain_jax.reference import ReferenceTrainer

pytestmark = pytest.mark.slow

CFG = ModelConfig(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48)
DOCS = [700, 1, 1299, 1001]  # a one-token document, and two longer than the plain attention path's 1024
S = sum(DOCS) - 1  # one window of S + 1 tokens: the whole stream


def _packed(seed: int = 0, lengths: list[int] = DOCS) -> tuple[PackedDataset, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, CFG.vocab_size, n).astype(np.uint16) for n in lengths]
    starts = np.cumsum([0] + lengths[:-1])
    return PackedDataset(np.concatenate(docs), starts, seed=seed, seq_len=sum(lengths) - 1, doc_masking=True), docs


def test_the_data_path_packs_short_documents_into_one_long_sequence():
    ds, docs = _packed()
    b = ds.batch(0, 1, S)
    assert b.tokens.shape == (1, S)
    np.testing.assert_array_equal(np.unique(b.segment_ids[0]), np.arange(len(DOCS)))
    at = 0
    for d, doc in enumerate(docs):
        n = min(len(doc), S - at)
        np.testing.assert_array_equal(b.segment_ids[0, at:at + n], d)
        np.testing.assert_array_equal(b.positions[0, at:at + n], np.arange(n))
        np.testing.assert_array_equal(b.tokens[0, at:at + n], doc[:n])
        at += n


def _loss(model, tokens, labels, positions, segment_ids):
    logits = model(tokens, positions, segment_ids)
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.take_along_axis(logp, labels[..., None], -1).sum(), logits


def test_each_packed_document_gets_what_it_gets_alone_tiled_blockwise():
    """fp32: a 3000-token packed sequence (blockwise attention) in 256-token block tiles (11 and a rest)
    against each document alone, untiled: logits per token, and the summed loss's gradient."""
    ds, docs = _packed()
    b = ds.batch(0, 1, S)
    tiled = init_model(dataclasses.replace(CFG, seq_tile=256), 0)
    alone = init_model(CFG, 0)
    grad = nnx.jit(nnx.grad(_loss, has_aux=True))  # one program per length, not XLA op by op (1500 compiles)
    gp, logits = grad(tiled, *(jnp.asarray(x) for x in (b.tokens, b.labels, b.positions, b.segment_ids)))
    g_sum, at = None, 0
    for doc in docs:
        n = min(len(doc), S - at)
        sl = slice(at, at + n)
        g, lg = grad(alone, jnp.asarray(b.tokens[:, sl]), jnp.asarray(b.labels[:, sl]), None, None)
        np.testing.assert_allclose(logits[:, sl], lg, atol=2e-5, rtol=0)
        g_sum = g if g_sum is None else jax.tree_util.tree_map(jnp.add, g_sum, g)
        at += n
    a, c = (np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(nnx.to_pure_dict(t))]) for t in (gp, g_sum))
    assert np.linalg.norm(a - c) <= 1e-5 * np.linalg.norm(c)
    # without the masks the documents would see each other: the comparison would notice
    _, leaky = grad(tiled, jnp.asarray(b.tokens), jnp.asarray(b.labels), None, None)
    assert float(jnp.abs(leaky[:, 800:] - logits[:, 800:]).max()) > 1e-3


# the streamed test's packed sequence: past the plain attention path's 1024 (blockwise, 3 query blocks of 512, the
# last partial), 5 tiles of 256 and a rest, documents across tile and block edges, a one-token one. (It was the 3000
# tokens above: the same paths at ~3x the attention's work, most of the test's CPU at -O0: 77 CPU-s cold, now 36.)
STREAMED_DOCS = [300, 1, 600, 400]


def test_streamed_packed_long_sequence_equals_the_reference():
    """The streamed engine on the packed sequence (256-token tiles, every 2nd block input kept, two
    micro-batches) trains what the in-memory reference trains on it, untiled, over 2 clipped steps."""
    cfg = dataclasses.replace(CFG, num_layers=3)
    ocfg = OptimConfig(lr=3e-3, b2=0.95, clip_norm=0.05, schedule=ScheduleConfig(kind="warmup_cosine", warmup_steps=1))
    rows = [_packed(seed, STREAMED_DOCS)[0].batch(0, 1, sum(STREAMED_DOCS) - 1) for seed in (0, 1)]
    batch = Batch(*(np.concatenate([getattr(r, f) for r in rows]) for f in
                    ("tokens", "labels", "loss_mask", "segment_ids", "positions")))
    ref = ReferenceTrainer(init_model(cfg, 0), build_reference_tx(ocfg, 2))
    parts, store = init_host_store(dataclasses.replace(cfg, seq_tile=256), 0, bf16_stream=False)
    st = StreamedTrainer(parts, build_host_optimizer(ocfg, 2), compute_dtype="float32", clip_norm=0.05,
                         micro_batches=2, loss_chunk=512, store=store, boundary_every=2)
    for _ in range(2):
        r, s = ref.step(batch), st.step(batch)
        assert r.grad_norm > 0.05
        assert abs(r.loss - s.loss) <= 1e-5 * abs(r.loss) and abs(r.grad_norm - s.grad_norm) <= 1e-4 * r.grad_norm
    st.close()
    tree = ref.params_tree()
    for name, t in {"embed": tree["embed"], "head": tree["head"],
                    **{f"block_{i}": x for i, x in tree["layers"].items()}}.items():
        a = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(t)])
        assert np.linalg.norm(a - st.store[name].master) <= 1e-5 * np.linalg.norm(a), name
