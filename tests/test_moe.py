"""Mixture-of-experts families (Mixtral, Qwen3-MoE) against ``transformers``.

One torch subprocess (``tests/hf_reference.py serve-moe``), started when the module starts and
building the references while the JAX-only tests run, makes the tiny random fp32 references (eager
attention and experts, norms != 1, 2-3 experts per token, windows shorter than the sequence, top-k
weights renormalised or not, a Qwen3-MoE with dense layers between the sparse ones) with logits,
loss and every gradient, without and with the router's load-balancing loss
(``output_router_logits``), then loads our exports back on request. Checked: logits, loss and every
gradient within 1e-4 relative, with the auxiliary loss too on Mixtral and the mixed Qwen3-MoE
(the sorted dispatch on two variants, the dense computation on two; both agree with each other in
value and gradient), import -> export(fp32) -> import bit-exact (experts stacked on import, split
per expert on export), exports load in ``transformers`` with the same logits, the streamed engine
(2 micro-batches; and 2 devices) equals the whole-batch in-memory gradient with the auxiliary loss,
parameter counts (OLMoE-1B-7B shape), and refusals.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors.numpy import load_file

from megatrain_jax.config import ModelConfig, OptimConfig, ScheduleConfig, load_config
from megatrain_jax.engine import Batch, StreamedTrainer
from megatrain_jax.errors import UserError
from megatrain_jax.hf import export_hf, hf_name, load_hf_into_store, model_from_store
from megatrain_jax.hoststore import HostStore
from megatrain_jax.models import abstract_model, init_host_store
from megatrain_jax.models.common import streamed_parts
from megatrain_jax.models.grouped_experts import routed_experts
from megatrain_jax.models.moe import experts_dense, route
from megatrain_jax.optim import build_host_optimizer, build_reference_tx
from megatrain_jax.reference import ReferenceTrainer
from megatrain_jax.templates import Layout
from tests.cli_runner import cpu_xla_flags
from tests.torch_reference import ROOT, served_refs, server_fixture
from tests.torch_reference import rel as _rel

TOL = 1e-4
VARIANTS = ["mixtral_untied_gqa_top2of4_window7", "qwen3moe_untied_gqa_headdim32_top3of6_norm",
            "qwen3moe_tied_mqa_top2of5_window7", "qwen3moe_mixed_step2_top2of4"]
AUX_COEF = 0.25  # hf_reference.AUX_COEF
ARCH = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
EXPECT = {
    "mixtral_untied_gqa_top2of4_window7": dict(family="mixtral", num_experts=4, experts_per_token=2,
                                               moe_intermediate_size=None, norm_topk_prob=True, sliding_window=7,
                                               num_kv_heads=2, tie_embeddings=False, rope_theta=1e6),
    "qwen3moe_untied_gqa_headdim32_top3of6_norm": dict(family="qwen3_moe", num_experts=6, experts_per_token=3,
                                                       moe_intermediate_size=40, norm_topk_prob=True, head_dim=32,
                                                       sliding_window=None, tie_embeddings=False),
    "qwen3moe_tied_mqa_top2of5_window7": dict(family="qwen3_moe", num_experts=5, experts_per_token=2,
                                              moe_intermediate_size=32, norm_topk_prob=False, sliding_window=7,
                                              num_kv_heads=1, tie_embeddings=True),
    "qwen3moe_mixed_step2_top2of4": dict(family="qwen3_moe", num_experts=4, experts_per_token=2, num_layers=4,
                                         mlp_only_layers=[0, 2], moe_intermediate_size=24, norm_topk_prob=True),
}


@pytest.fixture(scope="module", autouse=True)
def torch_ref(tmp_path_factory):
    """Started before the module's first test, so that the references build while JAX compiles."""
    yield from server_fixture(tmp_path_factory, "moe", "hf_reference.py", "serve-moe")


@pytest.fixture(scope="module")
def moe_refs(torch_ref) -> Path:
    return served_refs(torch_ref, VARIANTS)


def _import(d: Path, **over):
    cfg = ModelConfig(from_hf=str(d), **over)
    parts, store = load_hf_into_store(cfg, bf16_stream=False, log=None)
    return cfg, parts, store


def _torch_grads(cfg: ModelConfig, grads) -> dict[str, np.ndarray]:
    """Our gradients under transformers' in-memory names: experts fused as gate_up_proj (E, 2F, H)
    and down_proj (E, H, F), the router as mlp.gate.weight (Mixtral too)."""
    by_group = {"embed": grads["embed"], "head": grads["head"]}
    by_group.update({f"block_{i}": grads["layers"][i] for i in range(cfg.num_layers)})
    out = {}
    for group, tree in by_group.items():
        if group.startswith("block_") and "experts" in tree["mlp"]:  # (a dense layer's MLP: the plain names)
            mlp = tree.pop("mlp")
            pre = f"model.layers.{int(group[6:])}.mlp."
            ex = {k: np.asarray(v) for k, v in mlp["experts"].items()}
            out[pre + "experts.gate_up_proj"] = np.concatenate([ex["gate_proj"], ex["up_proj"]], axis=2).transpose(0, 2, 1)
            out[pre + "experts.down_proj"] = ex["down_proj"].transpose(0, 2, 1)
            out[pre + "gate.weight"] = np.asarray(mlp["gate"]["kernel"]).T
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            name, transposed = hf_name(group, jax.tree_util.keystr(path, simple=True, separator="/"), cfg.family)
            out[name] = np.asarray(leaf).T if transposed else np.asarray(leaf)
    return out


def _loss_logits_grads(cfg: ModelConfig, store, tokens: np.ndarray):
    """(CE loss, logits, CE gradients) as transformers' ``model(tokens, labels=tokens)``; with
    ``router_aux_loss_coef`` also (coef x aux loss, gradients of CE + coef x aux), from one forward."""
    graphdef, state = nnx.split(model_from_store(store, cfg))
    params = nnx.to_pure_dict(state)
    toks = jnp.asarray(tokens, jnp.int32)

    def f(p):
        model = nnx.merge(graphdef, p)
        x, aux = model.final_hidden_aux(toks)
        logits = model.head(x, model.embed.embedding[...] if cfg.tie_embeddings else None)
        ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], toks[:, 1:]))
        return (ce, jnp.zeros((), jnp.float32) if aux is None else aux), logits

    @jax.jit
    def run(p):
        (ce, aux), pull, logits = jax.vjp(f, p, has_aux=True)
        one, zero = jnp.ones((), jnp.float32), jnp.zeros((), jnp.float32)
        g_ce = pull((one, zero))[0]
        return ce, aux, logits, g_ce, (pull((one, one))[0] if cfg.router_aux_loss_coef else None)

    ce, aux, logits, g_ce, g_all = run(params)
    return (float(ce), float(aux), np.asarray(logits), _torch_grads(cfg, g_ce),
            None if g_all is None else _torch_grads(cfg, g_all))


# ----------------------------------------------------------------------- engine vs reference


# Qwen3-MoE (top-3 of 4, not renormalised, GQA, q/k norms), sorted dispatch, layer 1 dense, with the
# router's load-balancing loss; the reference takes an SGD step with lr 1 (its move is the gradient)
ENGINE_CFG = dict(family="qwen3_moe", vocab_size=256, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                  intermediate_size=96, num_experts=4, experts_per_token=3, moe_intermediate_size=32,
                  norm_topk_prob=False, moe_impl="sorted", init_std=0.1, mlp_only_layers=[1],
                  router_aux_loss_coef=AUX_COEF)
ENGINE_OPT = dict(name="sgd", kernel="optax", lr=1.0, weight_decay=0.0, clip_norm=None,
                  schedule=ScheduleConfig(kind="constant"))


def _engine_batch() -> Batch:
    rng = np.random.default_rng(1)
    toks = rng.integers(0, ENGINE_CFG["vocab_size"], (4, 17))
    return Batch(toks[:, :-1], toks[:, 1:], (rng.random((4, 16)) > 0.2).astype(np.float32))


def _engine_store(cfg: ModelConfig):
    """(abstract parts, host store) with seeded numpy weights: norm scales 1 +- 0.1, the rest N(0, 0.1)
    (cheaper than the nnx initialisers, and the same in every process)."""
    parts = streamed_parts(abstract_model(cfg))
    store = HostStore({n: Layout(t) for n, t in parts.host_trees().items()}, bf16_stream=False)
    rng = np.random.default_rng(0)
    for g in store:
        for leaf in g.layout.leaves:
            x = rng.normal(0.0, 0.1, leaf.size).astype(np.float32)
            g.master[leaf.offset:leaf.offset + leaf.size] = x + 1.0 if leaf.path.endswith("scale") else x
        g.sync_stream()
    return parts, store


class _GradRecorder:
    """A host "optimizer" that keeps each group's gradient as it lands (nothing to compile)."""

    chunk_align = None  # whole groups

    def init_state(self, params, unflatten=None):
        return {}

    def update(self, params, grad, state, count, grad_scale=1.0, bf16_out=None, unflatten=None):
        state["grad"] = np.array(grad) * grad_scale


def _engine_grads(devices: int | None = None, micro_batches: int = 2, skip_nonfinite: bool = False):
    """One step of the streamed engine: (loss, aux loss, grad norm, {group: gradient})."""
    cfg = ModelConfig(**ENGINE_CFG)
    parts, store = _engine_store(cfg)
    st = StreamedTrainer(parts, _GradRecorder(), compute_dtype="float32", micro_batches=micro_batches,
                         clip_norm=None, loss_chunk=48, store=store, skip_nonfinite=skip_nonfinite,
                         devices=jax.devices()[:devices] if devices else None)
    r = st.step(_engine_batch())
    st.close()
    return r.loss, r.aux_loss, r.grad_norm, {g.name: g.opt_state["grad"] for g in st.store}


def _dp_main(out: str) -> None:
    """``python -c`` entry of the 2-device test (a CPU backend's device count is fixed at its start)."""
    loss, aux, norm, grads = _engine_grads(devices=2, micro_batches=1, skip_nonfinite=True)
    np.savez(out, loss=loss, aux=aux, norm=norm, **{f"g:{k}": v for k, v in grads.items()})


@pytest.fixture(scope="module")
def engine_reference():
    """The whole batch in memory: plain jax.grad of CE + coef x aux loss (ReferenceTrainer), as
    (loss, grad norm, {group: gradient}), and the 2-device run started in the background."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_xla_flags(2))
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"moe_dp_{os.getpid()}.npz"
    dp = subprocess.Popen([sys.executable, "-c",
                           f"import tests.test_moe as t; t._dp_main({str(out)!r})"], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cfg = ModelConfig(**ENGINE_CFG)
    model = model_from_store(_engine_store(cfg)[1], cfg)
    before = jax.tree_util.tree_map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
    ref = ReferenceTrainer(model, build_reference_tx(OptimConfig(**ENGINE_OPT), 1))
    r = ref.step(_engine_batch())
    after = ref.params_tree()
    flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(t)])  # noqa: E731
    grads = {"embed": flat(before["embed"]) - flat(after["embed"]), "head": flat(before["head"]) - flat(after["head"])}
    grads.update({f"block_{i}": flat(before["layers"][i]) - flat(after["layers"][i]) for i in range(cfg.num_layers)})
    yield r.loss, r.grad_norm, grads, dp, out
    if dp.poll() is None:
        dp.kill()
    out.unlink(missing_ok=True)


def _same_grads(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want)
    for name, g in want.items():
        err = np.linalg.norm(got[name] - g) / np.linalg.norm(g)
        assert err < 1e-5, f"{what}: gradient of {name} differs by {err:.2e}"


def test_streamed_aux_loss_equals_whole_batch_reference(engine_reference):
    """Two micro-batches through the streamed engine (a sparse, a dense, a sparse layer: two
    compiled kinds) give the loss and every gradient of the whole batch's CE + coef x load-balancing
    loss, which couples both sparse layers and both micro-batches."""
    want_loss, want_norm, want, *_ = engine_reference
    loss, aux, norm, got = _engine_grads()
    assert abs(loss - want_loss) <= 1e-5 * want_loss and abs(norm - want_norm) <= 1e-5 * want_norm
    assert 0 < aux < loss  # included in the loss: ~coef * k here (top-3 of 4, near-uniform routing)
    _same_grads(got, want, "1 device, 2 micro-batches")
    parts, _ = _engine_store(ModelConfig(**ENGINE_CFG))
    assert parts.blocks.kinds == [0, 1, 0] and parts.blocks.aux_loss.kinds == {0}
    for i in (0, 2):
        g = Layout(parts.blocks.weights[i]).unflatten(got[f"block_{i}"])["mlp"]["experts"]["down_proj"]
        assert np.all(np.linalg.norm(g.reshape(4, -1), axis=1) > 1e-6)  # every expert gets a gradient


def test_data_parallel_aux_loss_equals_one_device(engine_reference):
    """Two (virtual CPU) devices, one sequence each: the statistics are summed over the devices, so
    the loss and gradients are the whole batch's again."""
    want_loss, want_norm, want, dp, out = engine_reference
    log = dp.communicate(timeout=600)[0]
    assert dp.returncode == 0, log[-3000:]
    r = np.load(out)
    assert abs(float(r["loss"]) - want_loss) <= 1e-5 * want_loss
    _same_grads({k[2:]: r[k] for k in r.files if k.startswith("g:")}, want, "2 devices")


def test_aux_loss_off_is_the_plain_model():
    """router_aux_loss_coef 0 (the default): no block emits statistics, the stack has no auxiliary
    loss, the templates return the hidden state alone (the engine compiles what it always did)."""
    cfg = ModelConfig(**{**ENGINE_CFG, "router_aux_loss_coef": 0.0})
    parts = streamed_parts(abstract_model(cfg))
    assert parts.blocks.aux_loss is None
    model = abstract_model(cfg)
    assert not any(layer.emits_stats for layer in model.layers)
    w = parts.blocks.weights[0]
    x = jax.ShapeDtypeStruct((1, 4, 64), jnp.float32)
    aux = jax.eval_shape(parts.aux_fn, jnp.zeros((1, 4), jnp.int32))
    out = jax.eval_shape(parts.blocks.templates[0], w, x, aux)
    assert isinstance(out, jax.ShapeDtypeStruct) and out.shape == (1, 4, 64)


# ----------------------------------------------------------------------- the expert computations


def test_sorted_equals_dense_with_an_idle_expert():
    """Both computations agree in value and gradient, also when an expert gets no token (a zero-size
    group) and when k = E."""
    rng = np.random.default_rng(0)
    t, h, f, e = 12, 8, 6, 5
    x = jnp.asarray(rng.normal(size=(t, h)), jnp.float32)
    w = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((e, h, f), (e, h, f), (e, f, h))]
    logits = jnp.asarray(rng.normal(size=(t, e)), jnp.float32).at[:, 3].set(-1e4)  # expert 3 never chosen
    for k in (2, e):
        def run(fn, x, w, logits):
            weights, idx = route(logits, k, normalize=k < e)
            return jnp.sum(jnp.sin(fn(x, weights, idx, *w)))

        sorted_ = functools.partial(routed_experts, impl="sorted")
        a = jax.jit(jax.value_and_grad(lambda *z: run(sorted_, *z), argnums=(0, 1, 2)))(x, w, logits)
        b = jax.jit(jax.value_and_grad(lambda *z: run(experts_dense, *z), argnums=(0, 1, 2)))(x, w, logits)
        for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
            # summation order differs (sorted groups vs a dense sum): 3e-5 seen on CI's CPU for values ~10
            np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------- config, counts, errors


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_block_params_count_the_modules(family):
    cfg = ModelConfig(family=family, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=12, intermediate_size=40,
                      num_layers=2, num_experts=6, experts_per_token=2,
                      moe_intermediate_size=20 if family == "qwen3_moe" else None)
    model = abstract_model(cfg)  # shapes only
    block = sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(model.layers[0])))
    total = sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(model)))
    assert cfg.block_params() == block and cfg.total_params() == total
    f = 20 if family == "qwen3_moe" else 40
    assert cfg.total_params() - cfg.active_params() == 2 * 4 * 3 * 32 * f  # 4 idle experts per layer


def test_olmoe_shape_preset():
    """OLMoE-1B-7B's shape (16 layers, hidden 2048, 64 experts top-8 of width 1024, vocab 50304):
    ~6.9B parameters, ~1.3B active per token."""
    cfg = load_config(str(ROOT / "configs" / "olmoe-1b-7b-shape-qwen3moe.yaml"))
    m = cfg.model
    assert m.family == "qwen3_moe" and (m.num_experts, m.experts_per_token) == (64, 8)
    assert m.total_params() == 6_919_100_416 and m.active_params() == 1_281_955_840
    assert m.block_params() == 419_565_824  # what one streamed group holds
    assert cfg.train.batch_size * cfg.data.seq_len == 16 * 4096


def _write_config(d: Path, cfg: dict) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("arch,over,needle", [
    ("Qwen3MoeForCausalLM", {"decoder_sparse_step": 3}, "every layer dense"),  # 2 layers: none is sparse
    ("Qwen3MoeForCausalLM", {"mlp_only_layers": [0, 1]}, "every layer dense"),
    ("Qwen3MoeForCausalLM", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ("Qwen3MoeForCausalLM", {"output_router_logits": True, "router_aux_loss_coef": -1}, "router_aux_loss_coef"),
    ("MixtralForCausalLM", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
    ("Qwen3MoeForCausalLM", {"attention_bias": True}, "attention_bias"),
])
def test_unsupported_features_are_named(tmp_path, arch, over, needle):
    cfg = {"architectures": [arch], "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
           "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, **over}
    d = _write_config(tmp_path / "hf", cfg)
    with pytest.raises(UserError, match=needle) as e:
        load_hf_into_store(ModelConfig(from_hf=str(d)), bf16_stream=False, log=None)
    assert e.value.field == "model.from_hf"


def _hf_cfg(arch: str, **over) -> dict:
    return {"architectures": [arch], "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, **over}


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen3MoeForCausalLM"])
def test_router_aux_loss_follows_output_router_logits(arch):
    """As transformers trains: coef x the load-balancing loss when output_router_logits is true (the
    class default 0.001 when config.json has no coefficient); off otherwise, unless the YAML's
    model.router_aux_loss_coef turns it on. An export writes the same two keys back."""
    from megatrain_jax.hf import hf_config_to_model_config
    from megatrain_jax.families import get_family

    def coef(hf, base=None):
        return hf_config_to_model_config(hf, base).router_aux_loss_coef

    assert coef(_hf_cfg(arch, output_router_logits=True, router_aux_loss_coef=0.02)) == 0.02
    assert coef(_hf_cfg(arch, output_router_logits=True)) == 0.001
    assert coef(_hf_cfg(arch, output_router_logits=False, router_aux_loss_coef=0.02)) == 0.0
    assert coef(_hf_cfg(arch, router_aux_loss_coef=0.02), ModelConfig(router_aux_loss_coef=0.05)) == 0.05
    for c, on in ((0.02, True), (0.0, False)):
        cfg = hf_config_to_model_config(_hf_cfg(arch, output_router_logits=on, router_aux_loss_coef=0.02))
        out = {}
        get_family(cfg.family).to_hf_config(cfg, arch, out)
        assert out["output_router_logits"] is on and out["router_aux_loss_coef"] == (c or 0.001)


@pytest.mark.parametrize("over,dense,out", [
    ({}, None, (1, [])),
    ({"decoder_sparse_step": 2}, [0, 2], (2, [])),
    ({"mlp_only_layers": [3]}, [3], (1, [3])),
    ({"decoder_sparse_step": 2, "mlp_only_layers": [1]}, [0, 1, 2], (4, [])),  # = the dense layers of step 4
])
def test_qwen3_moe_dense_layers_as_transformers_picks_them(over, dense, out):
    """Layer i is sparse unless it is in mlp_only_layers or (i + 1) % decoder_sparse_step != 0; the
    export writes a step where one reproduces the dense layers exactly, else the list."""
    from megatrain_jax.hf import hf_config_to_model_config
    from megatrain_jax.models.qwen3_moe import mlp_only_layers_to_hf

    cfg = hf_config_to_model_config(_hf_cfg("Qwen3MoeForCausalLM", **over))
    assert cfg.mlp_only_layers == dense and mlp_only_layers_to_hf(cfg) == out
    n_dense = len(dense or [])
    model = abstract_model(cfg)
    assert cfg.total_params() == sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(model)))
    idle = (4 - n_dense) * 2 * 3 * 32 * 16  # 2 idle experts (3 x 32 x 16) per sparse layer
    assert cfg.total_params() - cfg.active_params() == idle


MOE_OK = ["model.family=qwen3_moe", "model.num_experts=4", "model.experts_per_token=2"]


@pytest.mark.parametrize("over,field", [
    (MOE_OK + ["model.router_aux_loss_coef=-0.01"], "model.router_aux_loss_coef"),
    (["model.router_aux_loss_coef=0.01"], "model.router_aux_loss_coef"),  # llama is dense
    (["model.mlp_only_layers=[0]"], "model.mlp_only_layers"),
    (MOE_OK + ["model.mlp_only_layers=[0, 0]"], "model.mlp_only_layers"),
    (MOE_OK + ["model.mlp_only_layers=[99]"], "model.mlp_only_layers"),
    (MOE_OK[1:] + ["model.family=mixtral", "model.mlp_only_layers=[0]"], "model.mlp_only_layers"),
    (["model.num_experts=4"], "model.num_experts"),  # llama is dense
    (["model.family=qwen3_moe"], "model.num_experts"),  # MoE without experts
    (MOE_OK + ["model.experts_per_token=5"], "model.experts_per_token"),
    (MOE_OK + ["model.moe_intermediate_size=0"], "model.moe_intermediate_size"),
    (MOE_OK + ["model.moe_impl=megablocks"], "model.moe_impl"),
    (MOE_OK[1:] + ["model.family=mixtral", "model.norm_topk_prob=false"], "model.norm_topk_prob"),
])
def test_bad_moe_fields_are_user_errors(over, field):
    with pytest.raises(UserError) as e:
        load_config(str(ROOT / "configs" / "tiny.yaml"), over)
    assert e.value.field == field


def test_cli_logs_the_router_loss_inside_the_loss(tmp_path):
    """``megatrain-jax train`` of a tiny MoE with the router loss on: metrics.jsonl carries ``aux_loss``
    (positive, the load-balancing term), which the reported ``loss`` includes."""
    from megatrain_jax.cli import main as cli_main

    out = tmp_path / "run"
    sets = MOE_OK + ["model.router_aux_loss_coef=0.5", "model.num_layers=2", "train.steps=2",
                     "train.batch_size=2", "data.seq_len=32", "train.final_checkpoint=false",
                     "optim.schedule.kind=constant", "optim.schedule.warmup_steps=0", f"train.out_dir={out}"]
    assert cli_main(["train", str(ROOT / "configs" / "tiny.yaml"), *[x for s in sets for x in ("--set", s)]]) == 0
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 2 and all(r["aux_loss"] > 0 and r["loss"] > r["aux_loss"] for r in recs), recs


# ----------------------------------------------------------------------- against transformers
# (last: the torch subprocess builds the references while the tests above run)


def _check_grads(grads: dict, ref, prefix: str, what: str) -> None:
    want = {k[len(prefix):]: ref[k] for k in ref.files if k.startswith(prefix)}
    assert sorted(grads) == sorted(want)
    floor = 1e-4 * max(np.linalg.norm(g) for g in want.values())
    for name, g in want.items():
        assert grads[name].shape == g.shape, name
        err = np.linalg.norm(grads[name].astype(np.float64) - g) / max(np.linalg.norm(g), floor)
        assert err < TOL, f"{what}: gradient of {name} differs: {err:.2e}"


@pytest.mark.parametrize("variant,impl,aux", [(VARIANTS[0], "sorted", True), (VARIANTS[1], "dense", False),
                                              (VARIANTS[2], "sorted", False), (VARIANTS[3], "dense", True)])
def test_parity_with_transformers(moe_refs, variant, impl, aux):
    """Logits, loss and every gradient; with ``aux`` the model is imported with
    ``model.router_aux_loss_coef`` set (config.json has output_router_logits off) and is checked both
    on the CE alone and on CE + coef x load-balancing loss (transformers' output_router_logits=True)."""
    ref = np.load(moe_refs / variant / "ref.npz")
    cfg, parts, store = _import(moe_refs / variant / "hf", moe_impl=impl, router_aux_loss_coef=AUX_COEF if aux else 0.0)
    for name, want in EXPECT[variant].items():
        assert getattr(cfg, name) == want, (name, getattr(cfg, name), want)
    assert cfg.moe_impl == impl  # not a checkpoint field: the YAML's choice survives the import
    assert cfg.router_aux_loss_coef == (AUX_COEF if aux else 0.0)
    loss, aux_loss, logits, grads, grads_aux = _loss_logits_grads(cfg, store, ref["tokens"])
    assert _rel(logits, ref["logits"]) < TOL
    assert abs(loss - float(ref["loss"])) < TOL * abs(float(ref["loss"]))
    _check_grads(grads, ref, "grad:", f"{variant} {impl}")
    if aux:
        assert abs(aux_loss - AUX_COEF * float(ref["aux:aux_loss"])) < TOL * AUX_COEF * float(ref["aux:aux_loss"])
        assert abs(loss + aux_loss - float(ref["aux:loss"])) < TOL * float(ref["aux:loss"])
        _check_grads(grads_aux, ref, "aux:grad:", f"{variant} {impl} with the load-balancing loss")
    else:
        assert grads_aux is None and parts.blocks.aux_loss is None
    dense, kinds = cfg.mlp_only_layers or [], parts.blocks.kinds
    assert len(set(kinds)) == (2 if dense else 1)  # one compiled template per kind of layer (sparse, dense)
    assert [k != kinds[1] for k in kinds] == [i in dense for i in range(cfg.num_layers)]  # layer 1 is sparse


@pytest.mark.parametrize("variant", VARIANTS)
def test_round_trip_is_bit_exact(moe_refs, tmp_path, variant):
    src = moe_refs / variant / "hf"
    cfg, _, store = _import(src)
    sparse = 1  # a sparse layer in every variant (the mixed one's layers 0 and 2 are dense)
    exp = store[f"block_{sparse}"].tree()["mlp"]["experts"]
    orig = load_file(str(src / "model.safetensors"))
    e1 = f"model.layers.{sparse}." + ("block_sparse_moe.experts.1.w1.weight" if cfg.family == "mixtral"
                                      else "mlp.experts.1.gate_proj.weight")
    np.testing.assert_array_equal(exp["gate_proj"][1], orig[e1].T)  # expert 1's slice of the stack
    if cfg.mlp_only_layers:  # a dense layer: Qwen3MoeMLP's plain names
        np.testing.assert_array_equal(store["block_0"].tree()["mlp"]["gate_proj"]["kernel"],
                                      orig["model.layers.0.mlp.gate_proj.weight"].T)
    out = tmp_path / "exported"
    export_hf(store, cfg, str(out), dtype="float32", log=None)
    exported = load_file(str(out / "model.safetensors"))
    if cfg.tie_embeddings:
        orig.pop("lm_head.weight", None)
    assert sorted(exported) == sorted(orig)
    for name, arr in orig.items():
        assert exported[name].dtype == np.float32 and np.array_equal(exported[name], arr), name
    hf_out, hf_src = (json.loads((d / "config.json").read_text()) for d in (out, src))
    for key in ("num_experts_per_tok", "norm_topk_prob", "moe_intermediate_size", "num_local_experts",
                "num_experts", "sliding_window", "use_sliding_window", "output_router_logits", "router_aux_loss_coef",
                "decoder_sparse_step", "mlp_only_layers"):
        if key in hf_src and not (key == "num_local_experts" and cfg.family == "qwen3_moe"):
            assert hf_out.get(key) == hf_src[key], key
    cfg2, _, store2 = _import(out)
    assert dataclasses.replace(cfg2, from_hf=None) == dataclasses.replace(cfg, from_hf=None)
    for g in store:
        assert np.array_equal(g.master, store2[g.name].master), g.name


FRESH = {  # trained from scratch: config.json from our ModelConfig alone
    "fresh_mixtral": dict(family="mixtral", num_experts=3, experts_per_token=2, num_kv_heads=2, sliding_window=9),
    # layer 1 dense; trained with the load-balancing loss: config.json says output_router_logits
    "fresh_qwen3_moe": dict(family="qwen3_moe", num_experts=4, experts_per_token=3, moe_intermediate_size=24,
                            norm_topk_prob=False, head_dim=24, tie_embeddings=True, mlp_only_layers=[1],
                            router_aux_loss_coef=0.01),
}


def test_exports_load_in_transformers(moe_refs, torch_ref, tmp_path):
    """fp32 exports of the references and of fresh models load with from_pretrained(DIR) alone and
    give the same logits; one bf16 export in shards loads too."""
    dirs, expect = [], []
    tokens = np.load(moe_refs / VARIANTS[0] / "ref.npz")["tokens"]
    for variant in VARIANTS:
        cfg, _, store = _import(moe_refs / variant / "hf")
        for dtype in ("float32", "bfloat16") if variant == VARIANTS[1] else ("float32",):
            out = tmp_path / f"{variant}-{dtype}"
            export_hf(store, cfg, str(out), dtype=dtype, max_shard_bytes=40_000 if dtype == "bfloat16" else 10**9,
                      log=None)
            if dtype == "bfloat16":
                assert (out / "model.safetensors.index.json").is_file()
            dirs.append(str(out))
            expect.append((variant, cfg.family, dtype, None))
    for name, over in FRESH.items():
        cfg = ModelConfig(vocab_size=128, hidden_size=64, num_heads=4, intermediate_size=48, num_layers=2,
                          init_std=0.1, **over)
        _, store = init_host_store(cfg, seed=3, bf16_stream=False)
        graphdef, state = nnx.split(model_from_store(store, cfg))
        logits = np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, jnp.asarray(tokens)))
        export_hf(store, cfg, str(tmp_path / name), dtype="float32", log=None)
        dirs.append(str(tmp_path / name))
        expect.append((name, cfg.family, "float32", logits))
    np.save(tmp_path / "tokens.npy", tokens)
    torch_ref.ask("logits", str(tmp_path / "tokens.npy"), str(tmp_path / "out.npz"), *dirs)
    got = np.load(tmp_path / "out.npz")
    info = json.loads(str(got["info"]))
    for i, (variant, family, dtype, mine) in enumerate(expect):
        assert info[i]["class"] == ARCH[family], variant
        assert info[i]["dtype"] == f"torch.{dtype}"
        want = mine if mine is not None else np.load(moe_refs / variant / "ref.npz")["logits"]
        err = _rel(got[f"logits:{i}"], want)
        assert err < (1e-5 if dtype == "float32" else 3e-2), f"{variant} {dtype}: logits differ by {err:.2e}"
