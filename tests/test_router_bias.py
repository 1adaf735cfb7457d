"""The router's correction bias (``glm4_moe``, ``deepseek_v3``) is a frozen leaf (``Family.frozen_leaves``): with
weight decay on, every update path leaves it bit for bit as loaded (no decay, no moment), while the other
weights train: the streamed engine's host kernel (fp32 and bf16 compute, fp32 / bf16 / int8 moments), its optax
path, its device update, and the in-memory reference trainer."""
import jax
import numpy as np
import pytest

from megatrain_jax.config import ModelConfig, OptimConfig
from megatrain_jax.engine import Batch, StreamedTrainer
from megatrain_jax.hf import model_from_store
from megatrain_jax.models import init_host_store
from megatrain_jax.optim import build_host_optimizer, build_reference_tx
from megatrain_jax.reference import ReferenceTrainer

STEPS = 3
BIAS = "mlp/gate/e_score_correction_bias"
CFG = ModelConfig(family="deepseek_v3", vocab_size=128, hidden_size=32, num_heads=2, intermediate_size=48,
                  num_layers=3, num_experts=4, experts_per_token=2, moe_intermediate_size=16, mlp_only_layers=[0],
                  head_dim=24, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16,
                  n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, init_std=0.1)


def _optim(**kw):
    return OptimConfig(lr=1e-2, weight_decay=0.5, clip_norm=1.0, **kw)


def _batches(n=STEPS, b=2, s=16):
    rng = np.random.default_rng(5)
    out = []
    for _ in range(n):
        toks = rng.integers(0, CFG.vocab_size, (b, s + 1))
        out.append(Batch(toks[:, :-1], toks[:, 1:]))
    return out


def _store(bf16_stream):
    parts, store = init_host_store(CFG, 1, bf16_stream=bf16_stream)
    for g in store:  # a bias that matters: non-zero, different per layer
        for leaf in g.layout.leaves:
            if leaf.path == BIAS:
                g.master[leaf.offset:leaf.offset + leaf.size] = np.linspace(-0.2, 0.3, leaf.size) + int(g.name[6:])
        g.sync_stream()
    assert parts.frozen == (BIAS,)
    return parts, store


def _leaves(store):
    return {f"{g.name}/{leaf.path}": g.master[leaf.offset:leaf.offset + leaf.size].copy()
            for g in store for leaf in g.layout.leaves}


def _check(before, after):
    biases = [k for k in before if k.endswith(BIAS)]
    assert len(biases) == CFG.num_layers - 1
    for k in biases:
        assert after[k].tobytes() == before[k].tobytes(), k
    moved = [k for k in before if not k.endswith(BIAS) and not np.array_equal(before[k], after[k])]
    assert len(moved) > 0.9 * (len(before) - len(biases)), sorted(set(before) - set(moved))


@pytest.mark.parametrize("compute,moments,kernel,update_on", [
    ("float32", "float32", "fused", "host"),
    ("bfloat16", "float32", "fused", "host"),
    ("float32", "int8", "fused", "host"),
    ("float32", "float32", "optax", "host"),
    ("float32", "bfloat16", "fused", "device"),
])
def test_streamed_engine_leaves_the_bias_as_loaded(compute, moments, kernel, update_on):
    parts, store = _store(bf16_stream=compute == "bfloat16" and update_on == "host")
    before = _leaves(store)
    ocfg = _optim(moments=moments, kernel=kernel)
    st = StreamedTrainer(parts, build_host_optimizer(ocfg, STEPS), compute_dtype=compute, clip_norm=1.0,
                         store=store, update_on=update_on, micro_batches=2)
    for b in _batches():
        assert np.isfinite(st.step(b).loss)
    st.finish()
    _check(before, _leaves(st.store))
    for g in st.store:
        if g.stream_bits is not None:  # the streamed bf16 copy is the master's
            np.testing.assert_array_equal(g.stream_bits, np.asarray(g.master, dtype=jax.numpy.bfloat16).view(np.uint16))
        if moments == "float32" and kernel == "fused":
            for leaf in g.layout.leaves:
                if leaf.path == BIAS:
                    for a in st.opt.state_to_arrays(g.opt_state).values():
                        assert not np.any(a[leaf.offset:leaf.offset + leaf.size])
    st.close()


def test_reference_trainer_leaves_the_bias_as_loaded():
    _, store = _store(bf16_stream=False)
    before = _leaves(store)
    ref = ReferenceTrainer(model_from_store(store, CFG), build_reference_tx(_optim(), STEPS))
    for b in _batches():
        ref.step(b)
    tree = ref.params_tree()
    after = {}
    for g in store:
        sub = tree["embed"] if g.name == "embed" else tree["head"] if g.name == "head" else tree["layers"][int(g.name[6:])]
        flat = jax.tree_util.tree_leaves_with_path(sub)
        for path, x in flat:
            after[f"{g.name}/{jax.tree_util.keystr(path, simple=True, separator='/')}"] = np.asarray(x).reshape(-1)
    assert set(after) == set(before)
    _check(before, after)
