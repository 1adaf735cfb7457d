"""gpt-oss (``models/gpt_oss.py``) against ``transformers``.

One torch subprocess (``tests/gpt_oss_reference.py serve``), started when the module starts, builds
two tiny random fp32 ``GptOssForCausalLM`` references (eager attention and experts; sinks of order 1;
expert weights large enough that the SwiGLU clamps bite; YaRN, truncated and not; sliding windows
shorter than the sequence on alternating layers; top-2 of 4 and of 6; GQA and MQA; tied and untied)
with logits, loss and every gradient, without and with the router's load-balancing loss, then answers
requests. Checked: logits, loss and every gradient within 1e-4 relative (the grouped dispatch with the
load-balancing loss on one variant, the dense computation on the other); import -> export(fp32) ->
import bit-exact, the fused, interleaved ``gate_up_proj`` split on import and joined on export; bf16
and fp32 exports load in transformers with the same logits; an MXFP4 checkpoint laid out as the release
(``*_blocks``/``*_scales``, random codes and exponents) imports to exactly what transformers'
dequantization gives, and transformers' own dequantized load gives our logits; the attention sinks on
the blockwise path (values and gradients equal to the plain path's); the parameter counts of
gpt-oss-20b and 120b (the released configs, tests/fixtures/); refusals.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from megatrain_jax.attention import attention
from megatrain_jax.config import ModelConfig
from megatrain_jax.errors import UserError
from megatrain_jax.hf import export_hf, load_hf_into_store, model_from_store
from megatrain_jax.hf.names import hf_tensors, interleaved_part
from megatrain_jax.hf.mxfp4 import FP4_VALUES, dequantize
from tests.torch_reference import ROOT, served_refs, server_fixture
from tests.torch_reference import rel as _rel

TOL = 1e-4
VARIANTS = ["gptoss_untied_gqa_top2of4_yarn_window7", "gptoss_tied_mqa_top2of6_yarn_window5"]
AUX_COEF = 0.25  # hf_reference.AUX_COEF
FIXTURES = ROOT / "tests" / "fixtures"


@pytest.fixture(scope="module", autouse=True)
def torch_ref(tmp_path_factory):
    """Started before the module's first test, so that the references build while JAX compiles."""
    yield from server_fixture(tmp_path_factory, "gpt_oss", "gpt_oss_reference.py")


@pytest.fixture(scope="module")
def refs(torch_ref) -> Path:
    return served_refs(torch_ref, VARIANTS)


def _import(d: Path, **over):
    cfg = ModelConfig(from_hf=str(d), **over)
    parts, store = load_hf_into_store(cfg, bf16_stream=False, log=None)
    return cfg, parts, store


def _hf_named(cfg: ModelConfig, trees: dict) -> dict[str, np.ndarray]:
    """Group trees ({"embed", "block_i", "head"}) under transformers' names, the interleaved parts
    joined into their fused tensor."""
    out = {}
    for group, tree in trees.items():
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            leaf = np.asarray(leaf)
            p = jax.tree_util.keystr(path, simple=True, separator="/")
            (name, transposed, _, shape), = hf_tensors(group, p, leaf.shape, cfg.family)
            part = interleaved_part(name)
            if part is None:
                out[name] = leaf.T if transposed else leaf
                continue
            base, k, n = part
            out.setdefault(base, np.zeros(shape, leaf.dtype))[..., k::n] = leaf
    return out


def _loss_logits_grads(cfg: ModelConfig, store, tokens: np.ndarray):
    """(CE loss, coef x aux loss, logits, CE gradients, gradients of CE + coef x aux or None) under
    transformers' names, from one forward."""
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
        return ce, aux, logits, pull((one, zero))[0], (pull((one, one))[0] if cfg.router_aux_loss_coef else None)

    ce, aux, logits, g_ce, g_all = run(params)

    def named(g):
        trees = {"embed": g["embed"], "head": g["head"], **{f"block_{i}": g["layers"][i] for i in range(cfg.num_layers)}}
        return _hf_named(cfg, trees)

    return float(ce), float(aux), np.asarray(logits), named(g_ce), None if g_all is None else named(g_all)


def _check_grads(grads: dict, ref, prefix: str, what: str) -> None:
    want = {k[len(prefix):]: ref[k] for k in ref.files if k.startswith(prefix)}
    assert sorted(grads) == sorted(want)
    floor = 1e-4 * max(np.linalg.norm(g) for g in want.values())
    for name, g in want.items():
        assert grads[name].shape == g.shape, name
        err = np.linalg.norm(grads[name].astype(np.float64) - g) / max(np.linalg.norm(g), floor)
        assert err < TOL, f"{what}: gradient of {name} differs: {err:.2e}"


# ----------------------------------------------------------------------- JAX only (while torch builds)


def test_sinks_on_the_blockwise_path_equal_the_plain_path():
    """Several query and key blocks, a window and a document mask together: values and every gradient
    (the sinks' too) of the blockwise path equal the plain path's."""
    b, t, n, k, d = 2, 40, 4, 2, 8
    ks = jax.random.split(jax.random.key(0), 4)
    q, kk, v = (jax.random.normal(ks[i], (b, t, m, d)) for i, m in ((0, n), (1, k), (2, k)))
    sinks = 2.0 * jax.random.normal(ks[3], (n,))
    seg = jnp.asarray(np.repeat([[0] * 25 + [1] * 15], b, axis=0))
    w = jnp.cos(jnp.arange(n * d)).reshape(n, d)

    def run(impl, window, segs):
        def f(q, kk, v, s):
            kw = dict(block_q=16, block_k=8) if impl == "xla_blockwise" else {}
            return jnp.sum(attention(q, kk, v, window=window, segment_ids=segs, impl=impl, sinks=s, **kw) * w)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))(q, kk, v, sinks)

    (v0, g0), (v1, g1) = run("xla", 6, seg), run("xla_blockwise", 6, seg)
    assert abs(float(v1 - v0)) < 1e-5 * abs(float(v0))
    for a, c in zip(g1, g0):
        assert _rel(a, c) < 1e-5
    assert float(jnp.abs(g0[3]).max()) > 1e-3  # the sinks do get a gradient


def test_the_released_shapes_count_their_parameters():
    """gpt-oss-20b: 20.9B parameters, 3.6B active; 120b: 116.8B, 5.1B active (the model card's
    figures, whose active count leaves out the embedding table, a lookup: ``active_params`` counts it);
    from the configs in tests/fixtures/ (transformers' config.json of each)."""
    from megatrain_jax.hf import hf_config_to_model_config

    got = {}
    for name in ("gpt-oss-20b", "gpt-oss-120b"):
        hf = json.loads((FIXTURES / name / "config.json").read_text())
        cfg = hf_config_to_model_config(hf)
        assert cfg.family == "gpt_oss" and cfg.rope_scaling["rope_type"] == "yarn" and cfg.sliding_window == 128
        assert cfg.resolved_layer_types()[:2] == ["sliding_attention", "full_attention"]
        got[name] = (cfg.total_params() / 1e9, (cfg.active_params() - cfg.vocab_size * cfg.hidden_size) / 1e9)
    assert abs(got["gpt-oss-20b"][0] - 20.91) < 0.01 and abs(got["gpt-oss-20b"][1] - 3.61) < 0.01, got
    assert abs(got["gpt-oss-120b"][0] - 116.83) < 0.01 and abs(got["gpt-oss-120b"][1] - 5.13) < 0.01, got


def _hf_cfg(**over) -> dict:
    hf = json.loads((FIXTURES / "gpt-oss-20b" / "config.json").read_text())
    hf.update(num_hidden_layers=2, layer_types=None, **over)
    return hf


@pytest.mark.parametrize("over,needle", [
    (dict(attention_bias=False), "attention_bias"),
    (dict(swiglu_limit=10.0), "swiglu_limit"),
    (dict(attention_dropout=0.1), "attention_dropout"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization 'fp8'"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), "llama3"),
])
def test_unsupported_features_are_named(over, needle):
    from megatrain_jax.hf import hf_config_to_model_config

    with pytest.raises(UserError) as e:
        hf_config_to_model_config(_hf_cfg(**over))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_mxfp4_dequantization_is_exact_in_numpy():
    """Every code of the FP4 table at several exponents, low nibble first, transposed as transformers'."""
    blocks = np.arange(256, dtype=np.uint8).reshape(1, 2, 8, 16)  # E=1, R=2 rows, G=8 blocks of 32
    scales = np.array([[[127, 128, 126, 100, 130, 127, 140, 120]] * 2], np.uint8)
    out = dequantize(blocks, scales)
    assert out.shape == (1, 256, 2) and out.dtype == np.float32
    r, g, j = 1, 3, 5  # row 1, block 3, byte 5: values 2j (low nibble) and 2j + 1 (high nibble)
    byte = int(blocks[0, r, g, j])
    assert out[0, g * 32 + 2 * j, r] == FP4_VALUES[byte & 15] * 2.0 ** (int(scales[0, r, g]) - 127)
    assert out[0, g * 32 + 2 * j + 1, r] == FP4_VALUES[byte >> 4] * 2.0 ** (int(scales[0, r, g]) - 127)


# ----------------------------------------------------------------------- against transformers


@pytest.mark.parametrize("variant,impl,aux", [(VARIANTS[0], "sorted", True), (VARIANTS[1], "dense", False)])
def test_parity_with_transformers(refs, variant, impl, aux):
    ref = np.load(refs / variant / "ref.npz")
    cfg, parts, store = _import(refs / variant / "hf", moe_impl=impl, router_aux_loss_coef=AUX_COEF if aux else 0.0)
    assert cfg.family == "gpt_oss" and cfg.qkv_bias and cfg.rope_scaling["rope_type"] == "yarn"
    assert cfg.sliding_window in (5, 7) and len(set(cfg.resolved_layer_types())) == 2
    assert len(set(parts.blocks.kinds)) == 2  # one compiled template per attention kind
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


@pytest.mark.parametrize("variant", VARIANTS)
def test_round_trip_is_bit_exact(refs, tmp_path, variant):
    src = refs / variant / "hf"
    cfg, _, store = _import(src)
    orig = load_file(str(src / "model.safetensors"))
    exp = store["block_1"].tree()["mlp"]["experts"]
    fused = orig["model.layers.1.mlp.experts.gate_up_proj"]
    np.testing.assert_array_equal(exp["gate_proj"], fused[..., 0::2])
    np.testing.assert_array_equal(exp["up_proj"], fused[..., 1::2])
    np.testing.assert_array_equal(exp["up_bias"], orig["model.layers.1.mlp.experts.gate_up_proj_bias"][..., 1::2])
    out = tmp_path / "exported"
    export_hf(store, cfg, str(out), dtype="float32", log=None)
    exported = load_file(str(out / "model.safetensors"))
    if cfg.tie_embeddings:
        orig.pop("lm_head.weight", None)
    assert sorted(exported) == sorted(orig)
    for name, arr in orig.items():
        assert exported[name].dtype == np.float32 and np.array_equal(exported[name], arr), name
    hf_out, hf_src = (json.loads((d / "config.json").read_text()) for d in (out, src))
    for key in ("num_local_experts", "num_experts_per_tok", "sliding_window", "layer_types", "rope_parameters",
                "attention_bias", "swiglu_alpha", "swiglu_limit", "head_dim", "tie_word_embeddings"):
        assert hf_out.get(key) == hf_src[key], key
    cfg2, _, store2 = _import(out)
    assert dataclasses.replace(cfg2, from_hf=None) == dataclasses.replace(cfg, from_hf=None)
    for g in store:
        assert np.array_equal(g.master, store2[g.name].master), g.name


def _mxfp4_checkpoint(src: Path, out: Path, seed: int) -> dict[str, np.ndarray]:
    """``src`` with every expert matrix replaced by random MXFP4 codes and exponents, laid out as the
    release: ``*_blocks`` (E, rows, blocks, 16) and ``*_scales`` (E, rows, blocks) uint8, and
    config.json's ``quantization_config``. Returns the blocks and scales."""
    rng = np.random.default_rng(seed)
    tensors = load_file(str(src / "model.safetensors"))
    packed = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, cin, cout = tensors.pop(name).shape  # (E, in, out): the blocks run along `in`
        packed[name + "_blocks"] = rng.integers(0, 256, (e, cout, cin // 32, 16), dtype=np.uint8)
        packed[name + "_scales"] = rng.integers(119, 130, (e, cout, cin // 32), dtype=np.uint8)
    out.mkdir()
    save_file({**tensors, **packed}, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = json.loads((src / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(hf))
    return packed


def test_mxfp4_checkpoint_imports_as_transformers_dequantizes(refs, torch_ref, tmp_path):
    src = refs / VARIANTS[0] / "hf"
    packed = _mxfp4_checkpoint(src, tmp_path / "mxfp4", seed=5)
    np.savez(tmp_path / "packed.npz", **packed)
    torch_ref.ask("dequant", str(tmp_path / "packed.npz"), str(tmp_path / "dequant.npz"))
    want = np.load(tmp_path / "dequant.npz")
    cfg, _, store = _import(tmp_path / "mxfp4")
    tensors = _hf_named(cfg, {g.name: g.tree() for g in store})
    for name in want.files:  # (E, in, out), gate and up interleaved: exactly transformers' values
        assert tensors[name].dtype == np.float32 and np.array_equal(tensors[name], want[name]), name
    # transformers' own MXFP4 load (dequantize=True) of the same directory gives our logits
    tokens = np.load(refs / VARIANTS[0] / "ref.npz")["tokens"]
    np.save(tmp_path / "tokens.npy", tokens)
    torch_ref.ask("logits_fp32", str(tmp_path / "tokens.npy"), str(tmp_path / "out.npz"), str(tmp_path / "mxfp4"))
    got = np.load(tmp_path / "out.npz")
    np.testing.assert_array_equal(got["gate_up_proj:0"], want["model.layers.0.mlp.experts.gate_up_proj"])
    graphdef, state = nnx.split(model_from_store(store, cfg))
    mine = np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, jnp.asarray(tokens)))
    assert _rel(mine, got["logits:0"]) < 1e-5


def test_exports_load_in_transformers(refs, torch_ref, tmp_path):
    """fp32 and bf16 (sharded) exports load with from_pretrained(DIR) alone: the fp32 ones give the
    reference's logits, the bf16 ones (run in fp32 by transformers) ours of the bf16-rounded weights
    (rounding moves these large-weight models' routing, so the reference's logits are no yardstick)."""
    dirs, expect = [], []
    tokens = np.load(refs / VARIANTS[0] / "ref.npz")["tokens"]
    for variant in VARIANTS:
        cfg, _, store = _import(refs / variant / "hf")
        for dtype in ("float32", "bfloat16"):
            out = tmp_path / f"{variant}-{dtype}"
            export_hf(store, cfg, str(out), dtype=dtype, max_shard_bytes=40_000 if dtype == "bfloat16" else 10**9,
                      log=None)
            if dtype == "bfloat16":
                assert (out / "model.safetensors.index.json").is_file()
                for g in store:
                    g.master[:] = g.master.astype(jnp.bfloat16).astype(np.float32)
                graphdef, state = nnx.split(model_from_store(store, cfg))
                want = np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, jnp.asarray(tokens)))
            else:
                want = np.load(refs / variant / "ref.npz")["logits"]
            dirs.append(str(out))
            expect.append((variant, dtype, want))
    np.save(tmp_path / "tokens.npy", tokens)
    torch_ref.ask("logits", str(tmp_path / "tokens.npy"), str(tmp_path / "out.npz"), *dirs)
    got = np.load(tmp_path / "out.npz")
    info = json.loads(str(got["info"]))
    for i, (variant, dtype, want) in enumerate(expect):
        assert info[i]["class"] == "GptOssForCausalLM" and info[i]["dtype"] == f"torch.{dtype}", info[i]
        err = _rel(got[f"logits:{i}"], want)
        assert err < 1e-5, f"{variant} {dtype}: logits differ by {err:.2e}"


def test_plans_of_the_released_shapes():
    """configs/gpt-oss-20b-shape.yaml (16 x 4096 tokens, leanest host state) fits one 80 GB GPU with a
    128 GiB host; gpt-oss-120b does not fit 80 GB / 512 GB with the fp32 master: its master alone is
    467 GB, and the refusal says host memory."""
    from megatrain_jax.config import load_config
    from megatrain_jax.plan import make_plan, target_machine
    from megatrain_jax.plan.refusal import fits

    cfg = load_config(str(ROOT / "configs" / "gpt-oss-20b-shape.yaml"))
    assert cfg.model.family == "gpt_oss" and abs(cfg.model.total_params() / 1e9 - 20.915) < 1e-3
    p = make_plan(cfg, target_machine(gpu_memory_gb=80, host_memory_gb=137.4, cpu_cores=16), _modes=False)
    assert fits(p) and p.decisions["attention"] == "xla_blockwise", p.decisions["attention_summary"]
    big = load_config(str(ROOT / "configs" / "gpt-oss-120b-shape.yaml"))
    p = make_plan(big, target_machine(gpu_memory_gb=80, host_memory_gb=512, cpu_cores=64), _modes=False)
    assert not fits(p) and not p.fits_host() and p.host_need > 512e9
