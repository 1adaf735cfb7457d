"""Layer templates: one compiled executable serves every block; the three doors agree."""
import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import monitoring

from megatrain_jax.config import ModelConfig, OptimConfig
from megatrain_jax.engine import Batch, StreamedTrainer
from megatrain_jax.models.llama import init_host_store
from megatrain_jax.optim import build_host_optimizer
from megatrain_jax.templates import Layout, StreamedModel, from_fn, from_linen

_compiles: list[str] = []
monitoring.register_event_duration_secs_listener(
    lambda name, _dur, **_kw: _compiles.append(name) if name == "/jax/core/compile/backend_compile_duration" else None)


def _compile_count_for(num_layers: int, micro_batches: int = 1) -> int:
    """Every compilation from a cold cache: initialisation, two training steps, the updates."""
    jax.clear_caches()
    before = len(_compiles)
    cfg = ModelConfig(vocab_size=256, hidden_size=32, num_layers=num_layers, num_heads=2, intermediate_size=48)
    parts, store = init_host_store(cfg, 0, bf16_stream=True)
    st = StreamedTrainer(parts, build_host_optimizer(OptimConfig(), 2), micro_batches=micro_batches,
                         clip_norm=1.0, store=store)
    toks = np.random.default_rng(0).integers(0, 256, (2, 17))
    for _ in range(2):
        st.step(Batch(toks[:, :-1], toks[:, 1:]))
    st.close()
    return len(_compiles) - before


@pytest.fixture(scope="module", autouse=True)
def _warm_process():
    """One throw-away run: process-wide one-time compilations stay out of the comparisons."""
    _compile_count_for(1)


def test_compilations_do_not_grow_with_depth():
    shallow, deep = _compile_count_for(2), _compile_count_for(12)
    assert shallow > 0  # the counter sees compilations at all
    assert deep == shallow, f"2 layers: {shallow} compilations, 12 layers: {deep}"


def test_compilations_do_not_grow_with_micro_batches():
    assert _compile_count_for(3, micro_batches=2) == _compile_count_for(3, micro_batches=1)


def test_layout_round_trip_and_order():
    tree = {"b": np.arange(6, dtype=np.float32).reshape(2, 3), "a": {"x": np.ones(4, np.float32)}}
    lay = Layout(tree)
    assert lay.size == 10
    flat = np.zeros(lay.size, np.float32)
    lay.flatten_into(tree, flat)
    back = lay.unflatten(flat)
    np.testing.assert_array_equal(back["b"], tree["b"])
    np.testing.assert_array_equal(back["a"]["x"], tree["a"]["x"])
    assert np.shares_memory(back["b"], flat)  # views, not copies
    with pytest.raises(ValueError, match="shape"):
        lay.flatten_into({"b": np.zeros((3, 2)), "a": {"x": np.ones(4)}}, flat)


def test_stack_rejects_mismatched_layers():
    with pytest.raises(ValueError, match="layer 1"):
        from_fn(lambda w, h, aux: h, [{"w": np.zeros(3)}, {"w": np.zeros(4)}])


class _LinenBlock(linen.Module):
    width: int

    @linen.compact
    def __call__(self, x, aux):
        return x + linen.Dense(self.width, use_bias=False)(jnp.tanh(x))


def _toy_model(stack, width, vocab):
    rng = np.random.default_rng(0)
    return StreamedModel(
        embed_fn=lambda w, tokens: jnp.take(w["table"], tokens, axis=0),
        blocks=stack,
        head_fn=lambda w, h, _e: (h, w["out"].astype(h.dtype)),
        aux_fn=lambda positions, segment_ids=None: {},
        embed_weights={"table": rng.standard_normal((vocab, width)).astype(np.float32) * 0.1},
        head_weights={"out": rng.standard_normal((width, vocab)).astype(np.float32) * 0.1},
        tied=False)


def test_linen_and_plain_function_doors_train_identically():
    """A Linen block and the same block as a plain function give the same streamed training run."""
    width, vocab, layers = 16, 32, 3
    block = _LinenBlock(width)
    params = [block.init(jax.random.key(i), jnp.zeros((1, 1, width)), {})["params"] for i in range(layers)]
    plain = [{"k": np.asarray(p["Dense_0"]["kernel"])} for p in params]

    def fn(w, h, aux):
        return h + jnp.tanh(h) @ w["k"]

    toks = np.random.default_rng(1).integers(0, vocab, (2, 9))
    batch = Batch(toks[:, :-1], toks[:, 1:])
    losses = {}
    for name, stack in [("linen", from_linen(block, params)), ("fn", from_fn(fn, plain))]:
        opt = build_host_optimizer(OptimConfig(lr=1e-2, clip_norm=None), 3)
        st = StreamedTrainer(_toy_model(stack, width, vocab), opt, compute_dtype="float32")
        losses[name] = [st.step(batch).loss for _ in range(3)]
        st.close()
    np.testing.assert_allclose(losses["linen"], losses["fn"], rtol=1e-6)
    assert losses["fn"][-1] < losses["fn"][0]
