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


class _Windowed(linen.Module):
    """A block whose behaviour depends on a static attribute (like a local/global attention window)."""

    width: int
    local: bool

    @linen.compact
    def __call__(self, x, aux):
        y = linen.Dense(self.width, use_bias=False)(jnp.tanh(x))
        return x + (0.5 * y if self.local else y)


def test_layers_of_several_kinds_compile_once_per_kind_and_equal_a_plain_loop():
    """Alternating local/global blocks (same weight structure, different static attribute) stream as
    two kinds: compilations grow with the number of kinds, not with depth, and the training run
    equals the same model written as one plain function over the layers."""
    from megatrain_jax.templates import LayerStack

    width, vocab = 8, 16
    toks = np.random.default_rng(1).integers(0, vocab, (2, 7))
    batch = Batch(toks[:, :-1], toks[:, 1:])

    def run(layers):
        kinds = [i % 2 for i in range(layers)]
        mods = {k: _Windowed(width, local=bool(k)) for k in (0, 1)}
        params = [mods[k].init(jax.random.key(i), jnp.zeros((1, 1, width)), {})["params"] for i, k in enumerate(kinds)]
        templates = {k: (lambda m: lambda w, h, aux: m.apply({"params": w}, h, aux))(m) for k, m in mods.items()}
        stack = LayerStack(None, params, kinds, templates)
        jax.clear_caches()
        before = len(_compiles)
        st = StreamedTrainer(_toy_model(stack, width, vocab), build_host_optimizer(OptimConfig(lr=1e-2, clip_norm=None), 2),
                             compute_dtype="float32")
        losses = [st.step(batch).loss for _ in range(2)]
        st.close()
        plain = [{"k": np.asarray(p["Dense_0"]["kernel"])} for p in params]
        return len(_compiles) - before, losses, plain, kinds

    n2, _, _, _ = run(2)
    n8, losses, plain, kinds = run(8)
    assert n8 == n2, f"2 layers: {n2} compilations, 8 layers: {n8}"

    # the same model as one function, differentiated whole: the first loss must agree
    m = _toy_model(from_fn(lambda w, h, aux: h, [{}]), width, vocab)

    def loss(ws):
        h = jnp.take(m.embed_weights["table"], batch.tokens, axis=0)
        for w, k in zip(ws, kinds):
            y = jnp.tanh(h) @ w["k"]
            h = h + (0.5 * y if k else y)
        logits = h @ m.head_weights["out"]
        return jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits), batch.labels[..., None], -1))

    assert abs(float(loss(plain)) - losses[0]) <= 1e-5 * abs(losses[0])


def test_stack_of_kinds_rejects_mismatched_layers_of_one_kind():
    from megatrain_jax.templates import LayerStack

    with pytest.raises(ValueError, match="same kind"):
        LayerStack(None, [{"w": np.zeros(3)}, {"w": np.zeros(4)}, {"w": np.zeros(3)}], [0, 1, 1],
                   {0: lambda w, h, a: h, 1: lambda w, h, a: h})
    with pytest.raises(ValueError, match="no template"):
        LayerStack(None, [{"w": np.zeros(3)}], ["local"], {"global": lambda w, h, a: h})


def test_dropout_key_is_the_same_in_the_backward_recompute():
    """A block that drops units with its per-(step, layer, micro-batch) key: the streamed gradient
    equals the gradient of a plain model that uses the same keys (so the recompute in the backward
    saw the same mask as the forward), and different steps see different masks."""
    from megatrain_jax.templates import block_rng

    width, vocab, layers, rate = 8, 16, 3, 0.5

    def block(w, h, aux, rng):
        keep = jax.random.bernoulli(rng, 1 - rate, h.shape)
        return h + jnp.where(keep, jnp.tanh(h) @ w["k"], 0.0) / (1 - rate)

    rng = np.random.default_rng(0)
    ws = [{"k": rng.standard_normal((width, width)).astype(np.float32) * 0.3} for _ in range(layers)]
    from megatrain_jax.templates import LayerStack
    stack = LayerStack(block, [dict(w) for w in ws], takes_rng=True)
    model = _toy_model(stack, width, vocab)
    toks = rng.integers(0, vocab, (4, 7))
    batch = Batch(toks[:, :-1], toks[:, 1:])
    opt = build_host_optimizer(OptimConfig(lr=1e-2, clip_norm=1.0), 2)
    st = StreamedTrainer(model, opt, compute_dtype="float32", micro_batches=2, clip_norm=1.0, rng_seed=7)
    res = st.step(batch)

    def loss(ws, emb, out):
        total = 0.0
        for m in range(2):
            sl = slice(m * 2, m * 2 + 2)
            h = jnp.take(emb, batch.tokens[sl], axis=0)
            for i, w in enumerate(ws):
                h = block(w, h, {}, block_rng(7, 0, i, m))
            logits = h @ out
            total += jnp.sum(-jnp.take_along_axis(jax.nn.log_softmax(logits), batch.labels[sl][..., None], -1))
        return total / batch.tokens.size

    want, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(ws, model.embed_weights["table"], model.head_weights["out"])
    assert abs(float(want) - res.loss) <= 1e-5 * abs(res.loss)
    norm = float(np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree_util.tree_leaves(grads))))
    assert abs(norm - res.grad_norm) <= 1e-4 * norm
    assert not np.array_equal(np.asarray(jax.random.key_data(block_rng(7, 0, 0, 0))),
                              np.asarray(jax.random.key_data(block_rng(7, 1, 0, 0))))
    st.close()
