"""GLM-4.5 (``glm4_moe``) and DeepSeek-V3 (``deepseek_v3``) against ``transformers``.

One torch subprocess (``tests/sigmoid_moe_reference.py serve``), started with the module and building its
tiny random fp32 references (eager attention and experts, norms != 1, a non-zero router correction bias
that changes the choice) while the JAX-only tests run: GLM with q/k/v biases, q/k norm, half the head
rotated, 8 experts in 4 groups (top-3 of the best 2 groups, x 1.5), layer 0 dense; GLM tied with a
quarter rotated and 2 shared experts; DeepSeek-V3 in Moonlight's form (plain q projection, latent kv,
interleaved rotary, x 2.446, layer 0 dense); DeepSeek-V3 with q's low rank, groups and YaRN (both
mscales), value heads wider than q/k. Checked: logits, loss and every gradient within 1e-4 (the
correction bias gets none), import -> export(fp32) -> import bit-exact (a release's multi-token-prediction
layer dropped with one note and no warning), the exports load in ``transformers`` with the same logits,
parameter counts against the modules and the GLM-4.5-Air / Moonlight-16B-A3B shapes, and refusals.
"""
from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from megatrain_jax.config import ModelConfig, load_config
from megatrain_jax.errors import UserError
from megatrain_jax.hf import export_hf, hf_config_to_model_config, hf_name, load_hf_into_store, model_from_store
from megatrain_jax.models import abstract_model
from megatrain_jax.models.sigmoid_moe import sigmoid_route
from tests.torch_reference import ROOT, served_refs, server_fixture
from tests.torch_reference import rel as _rel

TOL = 1e-4  # tests/test_moe.py's
VARIANTS = ["glm_gqa_bias_qknorm_groups", "glm_tied_quarter_rotary_shared2", "dsv3_moonlight_form",
            "dsv3_qlora_groups_yarn"]
EXPECT = {
    "glm_gqa_bias_qknorm_groups": dict(family="glm4_moe", num_layers=3, mlp_only_layers=[0], num_kv_heads=2,
                                       head_dim=32, qkv_bias=True, qk_norm=True, partial_rotary_factor=0.5,
                                       num_experts=8, experts_per_token=3, n_group=4, topk_group=2,
                                       routed_scaling_factor=1.5, n_shared_experts=1, rope_theta=1e6),
    "glm_tied_quarter_rotary_shared2": dict(family="glm4_moe", mlp_only_layers=None, tie_embeddings=True,
                                            partial_rotary_factor=0.25, norm_topk_prob=False, n_shared_experts=2),
    "dsv3_moonlight_form": dict(family="deepseek_v3", q_lora_rank=None, kv_lora_rank=32, head_dim=24,
                                qk_rope_head_dim=8, v_head_dim=12, routed_scaling_factor=2.446, n_shared_experts=2,
                                mlp_only_layers=[0], rope_scaling=None),
    "dsv3_qlora_groups_yarn": dict(family="deepseek_v3", q_lora_rank=24, n_group=4, topk_group=2, v_head_dim=20,
                                   norm_topk_prob=False, tie_embeddings=True),
}
ARCH = {"glm4_moe": "Glm4MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
HF_CONFIGS = ROOT / "tests" / "fixtures" / "hf_configs"


@pytest.fixture(scope="module", autouse=True)
def torch_ref(tmp_path_factory):
    """Started before the module's first test, so that the references build while JAX compiles."""
    yield from server_fixture(tmp_path_factory, "sigmoid_moe", "sigmoid_moe_reference.py")


@pytest.fixture(scope="module")
def refs(torch_ref) -> Path:
    return served_refs(torch_ref, VARIANTS)


def _import(d: Path, **over):
    cfg = ModelConfig(from_hf=str(d), **over)
    lines = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "tensors not used" warning: the dropped layers are noted instead
        parts, store = load_hf_into_store(cfg, bf16_stream=False, log=lines.append)
    return cfg, parts, store, lines


def _torch_grads(cfg: ModelConfig, grads) -> tuple[dict[str, np.ndarray], list[float]]:
    """Our gradients under transformers' in-memory names (experts fused as gate_up_proj (E, 2F, H) and
    down_proj (E, H, F)), and the correction biases' gradients (not a transformers parameter)."""
    by_group = {"embed": grads["embed"], "head": grads["head"]}
    by_group.update({f"block_{i}": grads["layers"][i] for i in range(cfg.num_layers)})
    out, bias = {}, []
    for group, tree in by_group.items():
        mlp = tree.get("mlp", {})
        if "experts" in mlp:
            pre = f"model.layers.{int(group[6:])}.mlp."
            ex = {k: np.asarray(v) for k, v in mlp.pop("experts").items()}
            out[pre + "experts.gate_up_proj"] = np.concatenate([ex["gate_proj"], ex["up_proj"]], axis=2).transpose(0, 2, 1)
            out[pre + "experts.down_proj"] = ex["down_proj"].transpose(0, 2, 1)
            bias.append(float(np.abs(np.asarray(mlp["gate"].pop("e_score_correction_bias"))).max()))
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            name, transposed = hf_name(group, jax.tree_util.keystr(path, simple=True, separator="/"), cfg.family)
            out[name] = np.asarray(leaf).T if transposed else np.asarray(leaf)
    return out, bias


def _loss_logits_grads(cfg: ModelConfig, store, tokens: np.ndarray):
    graphdef, state = nnx.split(model_from_store(store, cfg))
    toks = jnp.asarray(tokens, jnp.int32)

    @jax.jit
    def run(p):
        def f(p):
            logits = nnx.merge(graphdef, p)(toks)
            return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], toks[:, 1:])), logits

        (loss, logits), g = jax.value_and_grad(f, has_aux=True)(p)
        return loss, logits, g

    loss, logits, g = run(nnx.to_pure_dict(state))
    return float(loss), np.asarray(logits), *_torch_grads(cfg, g)


# ----------------------------------------------------------------------- the router, counts, configs


def test_router_bias_picks_and_scores_weigh():
    """The correction bias decides which experts, the unbiased sigmoid scores how much; groups keep the
    best topk_group groups by their two best biased scores."""
    logits = jnp.asarray([[0.0, 1.0, 2.0, -1.0, 0.5, 0.2, 3.0, -2.0]], jnp.float32)
    s = jax.nn.sigmoid(logits)[0]
    bias = jnp.zeros(8).at[0].set(10.0)
    w, idx = sigmoid_route(logits, bias, 2, 1, 1, False, 1.0)
    assert sorted(np.asarray(idx[0]).tolist()) == [0, 6]  # expert 0 only through its bias
    np.testing.assert_allclose(np.sort(w[0]), np.sort(np.asarray([s[0], s[6]])), rtol=1e-6)
    w, idx = sigmoid_route(logits, bias, 2, 1, 1, True, 2.5)
    np.testing.assert_allclose(float(jnp.sum(w)), 2.5, rtol=1e-6)
    # 4 groups of 2, scored by their two scores' sum: (0,1) 1.23, (2,3) 1.15, (4,5) 1.17, (6,7) 1.07: the best two
    # are (0,1) and (4,5), so expert 6 (the best score) is not chosen and the top-3 inside them is 1, 4, 5
    _, idx = sigmoid_route(logits, jnp.zeros(8), 3, 4, 2, False, 1.0)
    assert sorted(np.asarray(idx[0]).tolist()) == [1, 4, 5]
    g = jax.grad(lambda b: jnp.sum(sigmoid_route(logits, b, 2, 1, 1, True, 1.0)[0] ** 2))(bias)
    assert not np.any(np.asarray(g))  # the bias is never trained by gradient


@pytest.mark.parametrize("family,over", [
    ("glm4_moe", dict(num_heads=4, num_kv_heads=2, head_dim=12, qkv_bias=True, qk_norm=True, partial_rotary_factor=0.5)),
    ("deepseek_v3", dict(num_heads=4, head_dim=20, q_lora_rank=12, kv_lora_rank=10, qk_rope_head_dim=6, v_head_dim=14)),
    ("deepseek_v3", dict(num_heads=2, head_dim=16, kv_lora_rank=8, qk_rope_head_dim=4, v_head_dim=8)),
])
def test_params_count_the_modules(family, over):
    cfg = ModelConfig(family=family, hidden_size=32, intermediate_size=40, num_layers=3, num_experts=6,
                      experts_per_token=2, moe_intermediate_size=20, n_shared_experts=2, mlp_only_layers=[0], **over)
    model = abstract_model(cfg)
    size = lambda m: sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(m)))  # noqa: E731
    assert cfg.block_params() == max(size(layer) for layer in model.layers)
    assert cfg.total_params() == size(model)
    assert cfg.total_params() - cfg.active_params() == 2 * 4 * 3 * 32 * 20  # 4 idle experts in each sparse layer


def test_release_shapes_and_configs():
    """The fixtures' config.json (GLM-4.5-Air with its release's head_dim 128 and q/k/v biases, which the
    fixture lacks; Moonlight-16B-A3B as it is) import to the configs' models; sizes of the releases."""
    glm = json.loads((HF_CONFIGS / "glm-4.5-air" / "config.json").read_text())
    with pytest.raises(UserError, match="partial_rotary_factor"):  # 4096 / 96 heads: 21 rotated dims
        hf_config_to_model_config(glm)
    air = hf_config_to_model_config({**glm, "head_dim": 128, "attention_bias": True})
    moon = hf_config_to_model_config(json.loads((HF_CONFIGS / "moonlight-16b-a3b" / "config.json").read_text()))
    assert (air.total_params(), air.active_params()) == (106_852_251_264, 13_424_129_664)  # "106B, 12B active"
    assert (moon.total_params(), moon.active_params()) == (15_960_110_208, 2_914_776_192)  # "16B, 3B active"
    assert moon.flops_per_token() == 6 * (moon.active_params() - 2 * moon.vocab_size * moon.hidden_size)
    for path, want, layers in (("glm-4.5-air-12l-shape.yaml", air, 12), ("glm-4.5-air-shape.yaml", air, 46),
                               ("moonlight-16b-a3b-shape.yaml", moon, 27)):
        m = load_config(str(ROOT / "configs" / path)).model
        assert m.init == "fast" and m.num_layers == layers
        fields = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in ("init", "num_layers", "init_std",
                                                                                    "from_hf", "seq_tile", "moe_impl")]
        diff = {f: (getattr(m, f), getattr(want, f)) for f in fields if getattr(m, f) != getattr(want, f)}
        assert not diff or diff == {"rope_theta": (10000.0, 10000.0)}, (path, diff)
    assert load_config(str(ROOT / "configs" / "glm-4.5-air-12l-shape.yaml")).model.total_params() == 27_241_493_888


class _GradRecorder:
    """A host "optimizer" that keeps each group's gradient as it lands (nothing to compile)."""

    chunk_align = None

    def init_state(self, params, unflatten=None):
        return {}

    def update(self, params, grad, state, count, grad_scale=1.0, bf16_out=None, unflatten=None):
        state["grad"] = np.array(grad) * grad_scale


def test_streamed_engine_equals_whole_model_gradient():
    """DeepSeek-V3 (latent attention with q's low rank, YaRN, groups, a dense and two sparse layers: two
    compiled kinds) through the streamed engine in 2 micro-batches: the whole batch's loss and gradients."""
    from megatrain_jax.engine import Batch, StreamedTrainer
    from megatrain_jax.models import init_host_store
    from megatrain_jax.models.common import streamed_parts

    cfg = ModelConfig(family="deepseek_v3", vocab_size=64, hidden_size=32, num_layers=3, num_heads=2, head_dim=12,
                      intermediate_size=40, num_experts=8, experts_per_token=3, moe_intermediate_size=8,
                      n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.0, mlp_only_layers=[0],
                      q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4, v_head_dim=8, moe_impl="sorted", init_std=0.2,
                      rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4,
                                    "mscale_all_dim": 1.0})
    _, store = init_host_store(cfg, seed=1, bf16_stream=False)
    for g in store:  # a correction bias that moves the choice
        for leaf in g.layout.leaves:
            if leaf.path.endswith("e_score_correction_bias"):
                g.master[leaf.offset:leaf.offset + leaf.size] = np.random.default_rng(2).normal(0, 0.3, leaf.size)
    toks = np.random.default_rng(3).integers(0, 64, (4, 13))
    graphdef, state = nnx.split(model_from_store(store, cfg))

    def f(p):
        logits = nnx.merge(graphdef, p)(jnp.asarray(toks[:, :-1]))
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(toks[:, 1:])))

    want_loss, g = jax.value_and_grad(f)(nnx.to_pure_dict(state))
    parts = streamed_parts(abstract_model(cfg))
    assert parts.blocks.kinds == [0, 1, 1]
    st = StreamedTrainer(parts, _GradRecorder(), compute_dtype="float32", micro_batches=2, clip_norm=None,
                         loss_chunk=16, store=store)
    r = st.step(Batch(toks[:, :-1], toks[:, 1:]))
    st.close()
    assert abs(r.loss - float(want_loss)) <= 1e-5 * float(want_loss)
    flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(t)])  # noqa: E731
    want = {"embed": flat(g["embed"]), "head": flat(g["head"])}
    want.update({f"block_{i}": flat(g["layers"][i]) for i in range(cfg.num_layers)})
    for grp in store:
        got = grp.opt_state["grad"]
        err = np.linalg.norm(got - want[grp.name]) / np.linalg.norm(want[grp.name])
        assert err < 1e-5, f"{grp.name}: {err:.2e}"


def _write(d: Path, cfg: dict) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _hf(arch: str, **over) -> dict:
    base = {"architectures": [arch], "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 16, "first_k_dense_replace": 1}
    if arch == "DeepseekV3ForCausalLM":
        base.update(kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    return {**base, **over}


@pytest.mark.parametrize("arch,over,needle", [
    ("Glm4MoeForCausalLM", {"quantization_config": {"quant_method": "fp8"}}, "quantized checkpoint"),
    ("Glm4MoeForCausalLM", {"output_router_logits": True}, "output_router_logits"),
    ("Glm4MoeForCausalLM", {"first_k_dense_replace": 3}, "first_k_dense_replace"),
    ("Glm4MoeForCausalLM", {"n_group": 3}, "n_group"),
    ("Glm4MoeForCausalLM", {"hidden_act": "gelu"}, "hidden_act"),
    ("DeepseekV3ForCausalLM", {"rope_interleave": False}, "rope_interleave"),
    ("DeepseekV3ForCausalLM", {"attention_bias": True}, "attention_bias"),
    ("DeepseekV3ForCausalLM", {"num_key_value_heads": 2}, "num_key_value_heads"),
    ("DeepseekV3ForCausalLM", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
    ("Glm4vMoeForConditionalGeneration", {}, "Glm4vMoeForConditionalGeneration"),  # GLM-4.5V: not a text model here
])
def test_unsupported_features_are_named(tmp_path, arch, over, needle):
    d = _write(tmp_path / "hf", _hf(arch, **over))
    with pytest.raises(UserError, match=needle) as e:
        load_hf_into_store(ModelConfig(from_hf=str(d)), bf16_stream=False, log=None)
    assert e.value.field in ("model.from_hf", "model.n_group")


OK = ["model.family=glm4_moe", "model.num_experts=4", "model.experts_per_token=2"]


@pytest.mark.parametrize("over,field", [
    (OK + ["model.router_bias_update_rate=0.001"], "model.router_bias_update_rate"),  # not implemented: refused
    (OK + ["model.router_aux_loss_coef=0.01"], "model.router_aux_loss_coef"),
    (OK + ["model.mlp_only_layers=[1]"], "model.mlp_only_layers"),  # only the first layers may be dense
    (OK + ["model.num_experts=8", "model.n_group=4", "model.topk_group=1", "model.experts_per_token=3"],
     "model.experts_per_token"),
    (OK + ["model.n_group=4"], "model.n_group"),  # groups of one expert
    (OK + ["model.kv_lora_rank=8"], "model.kv_lora_rank"),  # an MLA field on GLM
    (["model.n_shared_experts=1"], "model.n_shared_experts"),  # llama
    (["model.family=qwen3_moe", "model.num_experts=4", "model.experts_per_token=2", "model.partial_rotary_factor=0.5"],
     "model.partial_rotary_factor"),
    (["model.family=deepseek_v3", "model.num_experts=4", "model.experts_per_token=2", "model.num_kv_heads=null",
      "model.head_dim=24"], "model.kv_lora_rank"),
])
def test_bad_fields_are_user_errors(over, field):
    with pytest.raises(UserError) as e:
        load_config(str(ROOT / "configs" / "tiny.yaml"), over)
    assert e.value.field == field


# ----------------------------------------------------------------------- against transformers
# (last: the torch subprocess builds the references while the tests above run)


@pytest.mark.parametrize("variant,impl", [(VARIANTS[0], "sorted"), (VARIANTS[1], "dense"), (VARIANTS[2], "sorted"),
                                          (VARIANTS[3], "dense")])
def test_parity_with_transformers(refs, variant, impl):
    """Logits, loss and every gradient; the correction bias's gradient is zero."""
    ref = np.load(refs / variant / "ref.npz")
    cfg, parts, store, lines = _import(refs / variant / "hf", moe_impl=impl)
    for name, want in EXPECT[variant].items():
        assert getattr(cfg, name) == want, (name, getattr(cfg, name), want)
    assert any("multi-token-prediction" in line for line in lines)  # config.json says 1 (with no tensors)
    loss, logits, grads, bias_grads = _loss_logits_grads(cfg, store, ref["tokens"])
    assert _rel(logits, ref["logits"]) < TOL
    assert abs(loss - float(ref["loss"])) < TOL * abs(float(ref["loss"]))
    want = {k[5:]: ref[k] for k in ref.files if k.startswith("grad:")}
    assert sorted(grads) == sorted(want)
    floor = 1e-4 * max(np.linalg.norm(g) for g in want.values())
    for name, g in want.items():
        assert grads[name].shape == g.shape, name
        err = np.linalg.norm(grads[name].astype(np.float64) - g) / max(np.linalg.norm(g), floor)
        assert err < TOL, f"{variant} {impl}: gradient of {name} differs: {err:.2e}"
    assert bias_grads and not any(bias_grads)
    dense, kinds = cfg.mlp_only_layers or [], parts.blocks.kinds
    assert len(set(kinds)) == (2 if dense else 1)


def _with_mtp(src: Path, dst: Path, cfg: ModelConfig) -> Path:
    """The checkpoint as a release lays it out: plus a multi-token-prediction layer's tensors (layer L)."""
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    n, h = cfg.num_layers, cfg.hidden_size
    tensors.update({f"model.layers.{n}.eh_proj.weight": np.ones((h, 2 * h), np.float32),
                    f"model.layers.{n}.enorm.weight": np.ones((h,), np.float32)})
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


@pytest.mark.parametrize("variant", [VARIANTS[0], VARIANTS[3]])
def test_round_trip_is_bit_exact(refs, tmp_path, variant):
    """Import (a release's MTP tensors dropped with one note, no warning) -> fp32 export -> import: every
    value equal, every tensor of the source back, the correction bias included."""
    src = refs / variant / "hf"
    cfg0, _, _, _ = _import(src)
    mtp = _with_mtp(src, tmp_path / "with_mtp", cfg0)
    cfg, _, store, lines = _import(mtp)
    note = [line for line in lines if "multi-token-prediction" in line]
    assert len(note) == 1 and f"model.layers.{cfg.num_layers}" in note[0], lines
    orig = load_file(str(src / "model.safetensors"))
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    np.testing.assert_array_equal(store["block_1"].tree()["mlp"]["gate"]["e_score_correction_bias"], orig[bias])
    assert np.any(orig[bias])
    out = tmp_path / "exported"
    export_hf(store, cfg, str(out), dtype="float32", log=None)
    exported = load_file(str(out / "model.safetensors"))
    if cfg.tie_embeddings:
        orig.pop("lm_head.weight", None)
    assert sorted(exported) == sorted(orig)
    for name, arr in orig.items():
        assert np.array_equal(exported[name], arr), name
    hf_out, hf_src = (json.loads((d / "config.json").read_text()) for d in (out, src))
    assert hf_out["num_nextn_predict_layers"] == 0
    for key in ("n_routed_experts", "num_experts_per_tok", "n_shared_experts", "n_group", "topk_group",
                "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace", "moe_intermediate_size",
                "attention_bias", "use_qk_norm", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "rope_interleave", "head_dim", "rope_parameters"):
        if key in hf_src:
            assert hf_out.get(key) == hf_src[key], key
    cfg2, _, store2, _ = _import(out)
    assert dataclasses.replace(cfg2, from_hf=None) == dataclasses.replace(cfg, from_hf=None)
    for g in store:
        assert np.array_equal(g.master, store2[g.name].master), g.name


def test_exports_load_in_transformers(refs, torch_ref, tmp_path):
    """fp32 exports of every reference, and of a fresh GLM and DeepSeek-V3 made from a ModelConfig
    alone, load with from_pretrained(DIR) and give the same logits."""
    from megatrain_jax.models import init_host_store

    dirs, expect = [], []
    tokens = np.load(refs / VARIANTS[0] / "ref.npz")["tokens"]
    for variant in VARIANTS:
        cfg, _, store, _ = _import(refs / variant / "hf")
        export_hf(store, cfg, str(tmp_path / variant), dtype="float32", log=None)
        dirs.append(str(tmp_path / variant))
        expect.append((variant, cfg.family, np.load(refs / variant / "ref.npz")["logits"]))
    fresh = {"fresh_glm4_moe": dict(family="glm4_moe", num_kv_heads=2, qkv_bias=True, partial_rotary_factor=0.5,
                                    n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.0),
             "fresh_deepseek_v3": dict(family="deepseek_v3", head_dim=24, q_lora_rank=16, kv_lora_rank=16,
                                       qk_rope_head_dim=8, v_head_dim=16, n_shared_experts=1, routed_scaling_factor=2.5,
                                       rope_scaling={"rope_type": "yarn", "factor": 2.0,
                                                     "original_max_position_embeddings": 16, "mscale": 1.0,
                                                     "mscale_all_dim": 1.0})}
    for name, over in fresh.items():
        cfg = ModelConfig(vocab_size=128, hidden_size=64, num_heads=4, intermediate_size=48, num_layers=2,
                          num_experts=4, experts_per_token=2, moe_intermediate_size=16, mlp_only_layers=[0],
                          init_std=0.1, **over)
        _, store = init_host_store(cfg, seed=3, bf16_stream=False)
        block = store["block_1"]  # a non-zero correction bias, exported and used by transformers
        for leaf in block.layout.leaves:
            if leaf.path.endswith("e_score_correction_bias"):
                block.master[leaf.offset:leaf.offset + leaf.size] = np.linspace(-0.3, 0.3, leaf.size)
        graphdef, state = nnx.split(model_from_store(store, cfg))
        logits = np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, jnp.asarray(tokens)))
        export_hf(store, cfg, str(tmp_path / name), dtype="float32", log=None)
        dirs.append(str(tmp_path / name))
        expect.append((name, cfg.family, logits))
    np.save(tmp_path / "tokens.npy", tokens)
    torch_ref.ask("logits", str(tmp_path / "tokens.npy"), str(tmp_path / "out.npz"), *dirs)
    got = np.load(tmp_path / "out.npz")
    info = json.loads(str(got["info"]))
    for i, (name, family, want) in enumerate(expect):
        assert info[i]["class"] == ARCH[family], name
        err = _rel(got[f"logits:{i}"], want)
        assert err < 1e-5, f"{name}: logits differ by {err:.2e}"
