"""Hugging Face import/export: parity with ``transformers`` and the error paths.

The parity tests run ``tests/hf_reference.py`` in ``.venv-torch`` (Python 3.11 + CPU torch +
transformers, built by ``scripts/setup_torch_ref.sh``; .ci/run builds it, and the first test here
builds it if it is missing). They compare logits, loss and every parameter's gradient of tiny random
Llama / Qwen2 / Mistral models with ours (fp32, ‖ours − theirs‖ / ‖theirs‖ < 1e-4 per tensor),
check that our exports load back in ``transformers`` with the same logits, and that import ->
export(fp32) -> import is bit-exact. The remaining tests need no torch: they write checkpoints with
the ``safetensors`` library directly.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from megatrain_jax import cli
from megatrain_jax.config import ModelConfig
from megatrain_jax.errors import UserError
from megatrain_jax.hf import (HFWarning, convert_main, export_hf, hf_name, index_checkpoint, load_hf_into_store,
                              load_mt, model_from_store, save_mt)
from megatrain_jax.models.llama import init_host_store
from torch_reference import make_references, rel, run_reference
from torch_reference import torch_python as reference_python

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ["llama_untied_gqa_llama3rope", "llama_tied_mqa_headdim32", "qwen2_tied_bias", "mistral_untied_window",
            "mistral_untied_mqa_window7"]
WINDOWS = {"mistral_untied_window": 4096, "mistral_untied_mqa_window7": 7}  # sliding_window; the 24-token sequences
#                                                                         are longer than 7 only
ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
TOL = 1e-4


# ------------------------------------------------------------------------------- torch reference


@pytest.fixture(scope="session")
def torch_python() -> str:
    return reference_python()


@pytest.fixture(scope="session")
def hf_refs(torch_python, tmp_path_factory) -> Path:
    return make_references(torch_python, tmp_path_factory.mktemp("hf_ref"), "make", VARIANTS)


def _import(d: Path, bf16_stream: bool = False):
    cfg = ModelConfig(from_hf=str(d))
    parts, store = load_hf_into_store(cfg, bf16_stream=bf16_stream, log=None)
    return cfg, parts, store


def _loss_logits_grads(cfg: ModelConfig, store, tokens: np.ndarray):
    graphdef, state = nnx.split(model_from_store(store, cfg))
    params = nnx.to_pure_dict(state)
    toks = jnp.asarray(tokens, jnp.int32)

    def loss_fn(p):
        logits = nnx.merge(graphdef, p)(toks)  # fp32 compute
        ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], toks[:, 1:])
        return jnp.mean(ce), logits

    (loss, logits), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
    by_group = {"embed": grads["embed"], "head": grads["head"]}
    by_group.update({f"block_{i}": grads["layers"][i] for i in range(cfg.num_layers)})
    hf_grads = {}
    for group, tree in by_group.items():
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            name, transposed = hf_name(group, jax.tree_util.keystr(path, simple=True, separator="/"))
            hf_grads[name] = np.asarray(leaf).T if transposed else np.asarray(leaf)
    return float(loss), np.asarray(logits), hf_grads


@pytest.mark.parametrize("variant", VARIANTS)
def test_parity_with_transformers(hf_refs, variant):
    ref = np.load(hf_refs / variant / "ref.npz")
    cfg, _, store = _import(hf_refs / variant / "hf")
    assert cfg.tie_embeddings == ("_tied" in variant) and cfg.qkv_bias == variant.startswith("qwen2")
    assert cfg.sliding_window == WINDOWS.get(variant)
    loss, logits, grads = _loss_logits_grads(cfg, store, ref["tokens"])
    assert rel(logits, ref["logits"]) < TOL
    assert abs(loss - float(ref["loss"])) < TOL * abs(float(ref["loss"]))
    want = {k[5:]: ref[k] for k in ref.files if k.startswith("grad:")}
    assert sorted(grads) == sorted(want)  # same parameters (tied: no lm_head on either side)
    floor = 1e-4 * max(np.linalg.norm(g) for g in want.values())  # for (near-)zero true gradients
    for name, g in want.items():
        err = np.linalg.norm(grads[name].astype(np.float64) - g) / max(np.linalg.norm(g), floor)
        assert err < TOL, f"{variant}: gradient of {name} differs: {err:.2e}"


EXTRA = ["llama_untied_linear_rope_pad3", "qwen2_tied_linear_rope_pad5", "mistral_untied_linear_rope_window7",
         "phi3_untied_pad0", "gemma2_tied_pad0_linear_rope", "gemma3_untied_pad0"]
PAD = {"llama_untied_linear_rope_pad3": 3, "qwen2_tied_linear_rope_pad5": 5, "phi3_untied_pad0": 0,
       "gemma2_tied_pad0_linear_rope": 0, "gemma3_untied_pad0": 0}


@pytest.fixture(scope="session")
def extra_refs(torch_python, tmp_path_factory) -> Path:
    return make_references(torch_python, tmp_path_factory.mktemp("hf_ref_extra"), "make-extra", EXTRA)


@pytest.mark.parametrize("variant", EXTRA)
def test_parity_linear_rope_and_pad_token(extra_refs, variant):
    """Issue 26 items 11 and 12: linear RoPE scaling is read for Llama, Qwen2, Mistral (and Gemma 2),
    and the pad token's embedding row gets no gradient from the lookup, as transformers' padding_idx
    (a tied head still trains it): logits, loss, every gradient and the pad row within 1e-4."""
    ref = np.load(extra_refs / variant / "ref.npz")
    cfg, _, store = _import(extra_refs / variant / "hf")
    if "linear_rope" in variant:
        assert cfg.rope_scaling["rope_type"] == "linear"
    if variant in PAD:
        assert cfg.pad_token_id == PAD[variant] and (ref["tokens"] == PAD[variant]).sum() >= 8
    loss, logits, grads = _loss_logits_grads(cfg, store, ref["tokens"])
    assert rel(logits, ref["logits"]) < TOL
    assert abs(loss - float(ref["loss"])) < TOL * abs(float(ref["loss"]))
    want = {k[5:]: ref[k] for k in ref.files if k.startswith("grad:")}
    assert sorted(grads) == sorted(want)
    floor = 1e-4 * max(np.linalg.norm(g) for g in want.values())
    for name, g in want.items():
        err = np.linalg.norm(grads[name].astype(np.float64) - g) / max(np.linalg.norm(g), floor)
        assert err < TOL, f"{variant}: gradient of {name} differs: {err:.2e}"
    if variant in PAD:  # the pad row itself, against its own size
        ours, theirs = grads["model.embed_tokens.weight"][PAD[variant]], want["model.embed_tokens.weight"][PAD[variant]]
        typical = np.linalg.norm(want["model.embed_tokens.weight"], axis=1).mean()
        assert np.linalg.norm(ours - theirs) <= TOL * max(np.linalg.norm(theirs), typical), variant
        assert (np.linalg.norm(theirs) > 0) == cfg.tie_embeddings  # untied: transformers keeps the row fixed


def test_exports_load_in_transformers(hf_refs, torch_python, tmp_path):
    dirs, expect = [], []
    for variant in VARIANTS:
        cfg, _, store = _import(hf_refs / variant / "hf")
        for dtype in ("float32", "bfloat16") if variant.startswith("llama") else ("float32",):
            out = tmp_path / f"{variant}-{dtype}"
            export_hf(store, cfg, str(out), dtype=dtype, max_shard_bytes=60_000 if dtype == "float32" else 10**9, log=None)
            dirs.append(str(out))
            expect.append((variant, dtype))
    tokens = np.load(hf_refs / VARIANTS[0] / "ref.npz")["tokens"]
    # models that never saw Hugging Face (trained from scratch): config.json is written from ours alone
    fresh = {"fresh_llama_untied": ModelConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                               intermediate_size=96, rope_theta=5e5, init_std=0.1),
             "fresh_qwen2_tied": ModelConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=1,
                                             intermediate_size=96, tie_embeddings=True, qkv_bias=True, init_std=0.1)}
    fresh_logits = {}
    for name, cfg in fresh.items():
        _, store = init_host_store(cfg, seed=3, bf16_stream=False)
        fresh_logits[name] = np.asarray(model_from_store(store, cfg)(jnp.asarray(tokens)))
        export_hf(store, cfg, str(tmp_path / name), dtype="float32", log=None)
        dirs.append(str(tmp_path / name))
        expect.append((name, "float32"))
    np.save(tmp_path / "tokens.npy", tokens)
    run_reference(torch_python, "logits", str(tmp_path / "tokens.npy"), str(tmp_path / "out.npz"), *dirs)
    got = np.load(tmp_path / "out.npz")
    info = json.loads(str(got["info"]))
    for i, (variant, dtype) in enumerate(expect):
        if variant in fresh:
            assert info[i]["class"] == ("Qwen2ForCausalLM" if fresh[variant].qkv_bias else "LlamaForCausalLM")
            assert rel(got[f"logits:{i}"], fresh_logits[variant]) < 1e-5, variant
            continue
        ref = np.load(hf_refs / variant / "ref.npz")
        assert info[i]["class"] == ARCH[variant.split("_")[0]]
        assert info[i]["dtype"] == f"torch.{dtype}"  # config.json's dtype is honoured
        err = rel(got[f"logits:{i}"], ref["logits"])
        assert err < (1e-5 if dtype == "float32" else 3e-2), f"{variant} {dtype}: logits differ by {err:.2e}"
    assert os.path.isfile(os.path.join(dirs[0], "model.safetensors.index.json"))  # the small shard limit split it


@pytest.mark.parametrize("variant", VARIANTS)
def test_round_trip_is_bit_exact(hf_refs, tmp_path, variant):
    src = hf_refs / variant / "hf"
    cfg, _, store = _import(src, bf16_stream=True)
    for g in store:  # the bf16 streaming copy (blocks only) is made from the imported master
        want = g.master.astype(ml_dtypes.bfloat16) if g.name.startswith("block_") else g.master
        np.testing.assert_array_equal(g.stream_view(), want)
    out = tmp_path / "exported"
    export_hf(store, cfg, str(out), dtype="float32", max_shard_bytes=50_000, log=None)
    orig = load_file(str(src / "model.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    exported = {}
    for f in set(index["weight_map"].values()):
        exported.update(load_file(str(out / f)))
    if cfg.tie_embeddings:
        orig.pop("lm_head.weight", None)
    assert sorted(exported) == sorted(orig)
    for name, arr in orig.items():
        assert exported[name].dtype == np.float32 and np.array_equal(exported[name], arr), name
    cfg2, _, store2 = _import(out)
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "intermediate_size", "rope_theta", "rope_scaling", "rms_norm_eps", "tie_embeddings", "qkv_bias",
                 "sliding_window"):
        assert getattr(cfg2, name) == getattr(cfg, name), name
    for g in store:
        assert np.array_equal(g.master, store2[g.name].master), g.name


# ------------------------------------------------------------------ torch-free checkpoints and errors


def _hf_config(arch="LlamaForCausalLM", tied=False, **over) -> dict:
    model_type = {v: k for k, v in ARCH.items()}[arch]
    cfg = {"architectures": [arch], "model_type": model_type, "vocab_size": 96, "hidden_size": 32,
           "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": tied,
           "max_position_embeddings": 128, "bos_token_id": 1, "eos_token_id": 2}
    cfg.update(over)
    return cfg


def _hf_tensors(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights in the transformers layout, written out by hand (independent of hf.hf_name)."""
    rng = np.random.default_rng(seed)
    h, v, f = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    nh, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // nh
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (nh * d, h), p + "self_attn.k_proj.weight": (kv * d, h),
                       p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, nh * d),
                       p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
        if cfg["architectures"][0] == "Qwen2ForCausalLM":
            shapes.update({p + "self_attn.q_proj.bias": (nh * d,), p + "self_attn.k_proj.bias": (kv * d,),
                           p + "self_attn.v_proj.bias": (kv * d,)})
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def _write_hf(d: Path, cfg: dict, tensors: dict, dtype=np.float32, shards: int = 1) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    items = sorted(tensors.items())
    if shards == 1:
        save_file({k: a.astype(dtype) for k, a in items}, str(d / "model.safetensors"), metadata={"format": "pt"})
        return d
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: a.astype(dtype) for k, a in items[s::shards]}
        save_file(part, str(d / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def _leaf(store, group: str, path: str) -> np.ndarray:
    g = store[group]
    leaf = next(x for x in g.layout.leaves if x.path == path)
    return g.master[leaf.offset:leaf.offset + leaf.size].reshape(leaf.shape)


@pytest.mark.parametrize("dtype,shards", [(np.float32, 1), (ml_dtypes.bfloat16, 3), (np.float16, 2)])
def test_import_dtypes_and_shards(tmp_path, dtype, shards):
    cfg_json = _hf_config("Qwen2ForCausalLM", tied=False)
    tensors = _hf_tensors(cfg_json)
    d = _write_hf(tmp_path / "hf", cfg_json, tensors, dtype=dtype, shards=shards)
    cfg, parts, store = _import(d, bf16_stream=True)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads, cfg.qkv_bias) == (96, 32, 2, 2, True)
    exact = lambda a: a.astype(dtype).astype(np.float32)  # noqa: E731  (upcasting is exact)
    np.testing.assert_array_equal(_leaf(store, "embed", "embedding"), exact(tensors["model.embed_tokens.weight"]))
    np.testing.assert_array_equal(_leaf(store, "head", "lm_head"), exact(tensors["lm_head.weight"]).T)
    np.testing.assert_array_equal(_leaf(store, "block_1", "self_attn/k_proj/kernel"),
                                  exact(tensors["model.layers.1.self_attn.k_proj.weight"]).T)
    np.testing.assert_array_equal(_leaf(store, "block_0", "self_attn/q_proj/bias"),
                                  exact(tensors["model.layers.0.self_attn.q_proj.bias"]))
    np.testing.assert_array_equal(_leaf(store, "block_1", "mlp/down_proj/kernel"),
                                  exact(tensors["model.layers.1.mlp.down_proj.weight"]).T)
    np.testing.assert_array_equal(store["block_0"].stream_view(), store["block_0"].master.astype(ml_dtypes.bfloat16))
    assert len(parts.blocks.weights) == 2


def test_tied_checkpoint_with_lm_head_ignores_it(tmp_path):
    cfg_json = _hf_config(tied=True)
    tensors = _hf_tensors(cfg_json)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()  # some exports keep it
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)  # old checkpoints
    d = _write_hf(tmp_path / "hf", cfg_json, tensors)
    with warnings.catch_warnings():
        warnings.simplefilter("error", HFWarning)  # nothing to warn about
        cfg, _, store = _import(d)
    assert cfg.tie_embeddings and [leaf.path for leaf in store["head"].layout.leaves] == ["norm/scale"]


def test_unsupported_architecture(tmp_path):
    cfg_json = _hf_config()
    d = _write_hf(tmp_path / "hf", cfg_json, _hf_tensors(cfg_json))
    (d / "config.json").write_text(json.dumps({**cfg_json, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(UserError) as e:
        _import(d)
    assert "GPT2LMHeadModel" in str(e.value) and "LlamaForCausalLM" in str(e.value) and "Qwen2ForCausalLM" in str(e.value)


@pytest.mark.parametrize("over,needle", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "gelu"),
])
def test_unsupported_config_features(tmp_path, over, needle):
    cfg_json = _hf_config(**over)
    d = _write_hf(tmp_path / "hf", cfg_json, _hf_tensors(cfg_json))
    with pytest.raises(UserError, match=needle):
        _import(d)


def test_missing_tensor_is_named(tmp_path):
    cfg_json = _hf_config()
    tensors = _hf_tensors(cfg_json)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    d = _write_hf(tmp_path / "hf", cfg_json, tensors, shards=2)
    with pytest.raises(UserError, match=r"model\.layers\.1\.mlp\.up_proj\.weight is missing"):
        _import(d)


def test_untied_without_lm_head_is_named(tmp_path):
    cfg_json = _hf_config(tied=False)
    tensors = _hf_tensors({**cfg_json, "tie_word_embeddings": True})
    d = _write_hf(tmp_path / "hf", cfg_json, tensors)
    with pytest.raises(UserError, match=r"lm_head\.weight is missing.*tie_word_embeddings"):
        _import(d)


def test_shape_mismatch_is_named(tmp_path):
    cfg_json = _hf_config()
    tensors = _hf_tensors(cfg_json)
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((24, 32), np.float32)
    d = _write_hf(tmp_path / "hf", cfg_json, tensors)
    with pytest.raises(UserError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight has shape \[24, 32\]"):
        _import(d)


def test_no_safetensors_and_missing_dir(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text(json.dumps(_hf_config()))
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(UserError, match="only PyTorch .bin"):
        _import(tmp_path / "bin")
    with pytest.raises(UserError, match="not a directory"):
        _import(tmp_path / "nope")


def test_yaml_values_are_overridden_with_a_warning(tmp_path):
    cfg_json = _hf_config()
    d = _write_hf(tmp_path / "hf", cfg_json, _hf_tensors(cfg_json))
    cfg = ModelConfig(from_hf=str(d), hidden_size=512, num_layers=7, init_std=0.01)
    with pytest.warns(HFWarning, match=r"hidden_size=512 -> 32.*num_layers=7 -> 2"):
        load_hf_into_store(cfg, bf16_stream=False, log=None)
    assert (cfg.hidden_size, cfg.num_layers, cfg.init_std, cfg.from_hf) == (32, 2, 0.01, str(d))


def test_sliding_window_is_read_and_written(tmp_path):
    """Mistral's sliding_window (and Qwen2's, when every layer uses it) becomes model.sliding_window
    and goes back into the exported config.json; a mix of windowed and full layers is warned about."""
    cfg_json = _hf_config("MistralForCausalLM", sliding_window=64)
    d = _write_hf(tmp_path / "mistral", cfg_json, _hf_tensors(cfg_json))
    with warnings.catch_warnings():
        warnings.simplefilter("error", HFWarning)
        cfg = ModelConfig(from_hf=str(d))
        _, store = load_hf_into_store(cfg, bf16_stream=False, seq_len=128, log=None)
    assert cfg.sliding_window == 64
    export_hf(store, cfg, str(tmp_path / "out"), dtype="float32", log=None)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["sliding_window"] == 64
    for over, want in [(dict(use_sliding_window=False, sliding_window=64), None),
                       (dict(use_sliding_window=True, sliding_window=64, max_window_layers=0), 64),
                       (dict(use_sliding_window=True, sliding_window=64, layer_types=["sliding_attention"] * 2), 64)]:
        q = _hf_config("Qwen2ForCausalLM", **over)
        cfg, _, _ = _import(_write_hf(tmp_path / f"qwen{len(str(over))}", q, _hf_tensors(q)))
        assert cfg.sliding_window == want, over
    q = _hf_config("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=64, max_window_layers=1)
    d = _write_hf(tmp_path / "qwen_mixed", q, _hf_tensors(q))
    with pytest.warns(HFWarning, match="mixes full and sliding-window"):
        load_hf_into_store(ModelConfig(from_hf=str(d)), bf16_stream=False, seq_len=128, log=None)
    # a model trained from scratch with a window exports as Mistral (Llama has no window)
    fresh = ModelConfig(vocab_size=96, hidden_size=32, num_layers=1, num_heads=4, intermediate_size=48,
                        sliding_window=16)
    _, store = init_host_store(fresh, seed=0, bf16_stream=False)
    export_hf(store, fresh, str(tmp_path / "fresh"), dtype="float32", log=None)
    conf = json.loads((tmp_path / "fresh" / "config.json").read_text())
    assert conf["architectures"] == ["MistralForCausalLM"] and conf["sliding_window"] == 16
    with pytest.raises(UserError, match="export as MistralForCausalLM"):
        export_hf(store, fresh, str(tmp_path / "llama"), architecture="LlamaForCausalLM", log=None)


def test_export_writes_readable_shards_and_refuses_to_clobber(tmp_path):
    cfg_json = _hf_config(tied=False)
    tensors = _hf_tensors(cfg_json)
    cfg, _, store = _import(_write_hf(tmp_path / "hf", cfg_json, tensors))
    out = tmp_path / "out"
    export_hf(store, cfg, str(out), dtype="bfloat16", max_shard_bytes=8_000, log=None)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    got = {}
    for f in files:
        got.update(load_file(str(out / f)))  # the reference safetensors reader accepts our files
    assert sorted(got) == sorted(tensors) and index["metadata"]["total_size"] == sum(a.nbytes for a in got.values())
    for name, arr in tensors.items():
        np.testing.assert_array_equal(got[name], arr.astype(ml_dtypes.bfloat16))
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLM"] and conf["torch_dtype"] == "bfloat16"
    assert (conf["bos_token_id"], conf["max_position_embeddings"]) == (1, 128)  # kept from the source config
    with pytest.raises(UserError, match="already exists"):
        export_hf(store, cfg, str(out), log=None)
    export_hf(store, cfg, str(out), dtype="float32", overwrite=True, log=None)
    assert (out / "model.safetensors").exists() and not (out / "model.safetensors.index.json").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    # a whole Llama module exports the same tensors as the store it came from
    export_hf(model_from_store(store, cfg), cfg, str(tmp_path / "from_module"), dtype="float32", log=None)
    a, b = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "from_module" / "model.safetensors"))
    assert all(np.array_equal(a[k], b[k]) for k in a) and sorted(a) == sorted(b)


def test_convert_round_trip(tmp_path, capsys):
    cfg_json = _hf_config("Qwen2ForCausalLM", tied=True)
    tensors = _hf_tensors(cfg_json)
    src = _write_hf(tmp_path / "hf", cfg_json, tensors, shards=2)
    assert cli.main(["convert", "hf-to-mt", str(src), str(tmp_path / "mt")]) == 0
    assert sorted(os.listdir(tmp_path / "mt")) == ["block_0.safetensors", "block_1.safetensors", "embed.safetensors",
                                                  "head.safetensors", "hf_config.json", "megatrain_export.json",
                                                  "model.yaml"]
    cfg_mt, parts, store_mt = load_mt(str(tmp_path / "mt"), bf16_stream=True, log=None)
    cfg_hf, _, store_hf = _import(src)
    assert cfg_mt.from_hf is None and cfg_mt.hidden_size == 32 and cfg_mt.tie_embeddings and cfg_mt.qkv_bias
    for g in store_hf:
        assert np.array_equal(g.master, store_mt[g.name].master), g.name
    assert convert_main(["mt-to-hf", str(tmp_path / "mt"), str(tmp_path / "back"), "--dtype", "float32"]) == 0
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(back) == sorted(tensors) and all(np.array_equal(back[k], tensors[k]) for k in tensors)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    # save_mt from a live store equals the converter's output
    save_mt(store_hf, cfg_hf, str(tmp_path / "mt2"), log=None)
    for f in ("embed", "block_0", "block_1", "head"):
        assert (tmp_path / "mt" / f"{f}.safetensors").read_bytes() == (tmp_path / "mt2" / f"{f}.safetensors").read_bytes()
    assert "converted" in capsys.readouterr().out


def test_convert_bad_arguments_exit_2(tmp_path, capsys):
    assert cli.main(["convert"]) == 2
    assert cli.main(["convert", "sideways", "a", "b"]) == 2
    assert cli.main(["convert", "hf-to-mt", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert cli.main(["convert", "mt-to-hf", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert cli.main(["convert", "mt-to-hf", str(tmp_path), str(tmp_path / "out"), "--dtype", "int8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 5 and all(line.startswith("error: ") for line in err)
    assert not (tmp_path / "out").exists()
    r = subprocess.run([sys.executable, "-m", "megatrain_jax", "convert", "hf-to-mt"], capture_output=True, text=True,
                       cwd=ROOT, stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and r.stderr.startswith("error: convert:")


def test_index_lists_missing_shard(tmp_path):
    cfg_json = _hf_config()
    d = _write_hf(tmp_path / "hf", cfg_json, _hf_tensors(cfg_json), shards=2)
    os.remove(d / "model-00002-of-00002.safetensors")
    with pytest.raises(UserError, match="model-00002-of-00002.safetensors, which is missing"):
        index_checkpoint(str(d))


def test_load_mt_accepts_bf16_groups_in_any_order(tmp_path):
    cfg_json = _hf_config(tied=True)
    cfg, _, store = _import(_write_hf(tmp_path / "hf", cfg_json, _hf_tensors(cfg_json)))
    save_mt(store, cfg, str(tmp_path / "mt"), log=None)
    for g in store:  # rewrite each group as bf16 with the safetensors library (its own tensor order)
        path = tmp_path / "mt" / f"{g.name}.safetensors"
        save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in load_file(str(path)).items()}, str(path))
    _, _, back = load_mt(str(tmp_path / "mt"), bf16_stream=False, log=None)
    for g in store:
        np.testing.assert_array_equal(back[g.name].master, g.master.astype(ml_dtypes.bfloat16).astype(np.float32))


def _tree_state(root: Path) -> dict:
    return {str(p): (p.read_bytes() if p.is_file() else "dir") for p in sorted(root.rglob("*"))}


def _fake_run(d: Path) -> Path:
    step = d / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text("{}")
    (step / "state.json").write_text("{}")
    return d


def test_convert_never_replaces_a_run_or_its_source(tmp_path, capsys):
    """Issue 26 item 1 for convert: an output that is, contains or lies inside the source, or that is or
    holds a training run, is refused whatever the flags (exit 2, one line, nothing changed)."""
    cfg_json = _hf_config(tied=True)
    src = _write_hf(tmp_path / "hf", cfg_json, _hf_tensors(cfg_json))
    assert cli.main(["convert", "hf-to-mt", str(src), str(tmp_path / "mt")]) == 0
    run = _fake_run(tmp_path / "run")
    step = run / "checkpoints" / "step_00000004"
    cases = [["hf-to-mt", src, src], ["hf-to-mt", src, src / "sub"], ["hf-to-mt", src, tmp_path],
             ["hf-to-mt", src, run], ["hf-to-mt", src, run / "checkpoints"], ["hf-to-mt", src, step],
             ["mt-to-hf", tmp_path / "mt", tmp_path / "mt"], ["mt-to-hf", tmp_path / "mt", run],
             ["mt-to-hf", tmp_path / "mt", run / "checkpoints"], ["mt-to-hf", tmp_path / "mt", tmp_path]]
    for direction, a, b in cases:
        before = _tree_state(tmp_path)
        capsys.readouterr()
        assert cli.main(["convert", direction, str(a), str(b), "--overwrite"]) == 2, (direction, a, b)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: OUT:"), (direction, a, b, err)
        assert _tree_state(tmp_path) == before, (direction, a, b)


def test_convert_overwrite_replaces_only_its_own_kind(tmp_path, capsys):
    cfg_json = _hf_config(tied=True)
    src = _write_hf(tmp_path / "hf", cfg_json, _hf_tensors(cfg_json))
    mt, back, mine = tmp_path / "mt", tmp_path / "back", tmp_path / "mine"
    assert cli.main(["convert", "hf-to-mt", str(src), str(mt)]) == 0
    (mt / "README").write_text("mine")
    assert cli.main(["convert", "hf-to-mt", str(src), str(mt), "--overwrite"]) == 0
    assert (mt / "README").read_text() == "mine"  # not written by convert: kept
    assert cli.main(["convert", "mt-to-hf", str(mt), str(back)]) == 0
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    for direction, a, b, needle in [("hf-to-mt", src, mine, "not written by megatrain-jax"),
                                    ("mt-to-hf", mt, mine, "not written by megatrain-jax"),
                                    ("hf-to-mt", src, back, "holds a Hugging Face export"),
                                    ("mt-to-hf", mt, tmp_path / "mt2", None)]:
        if needle is None:  # an mt directory is not replaced by a Hugging Face export
            assert cli.main(["convert", "hf-to-mt", str(src), str(b)]) == 0
            needle = "holds an mt"
        before = _tree_state(tmp_path)
        capsys.readouterr()
        assert cli.main(["convert", direction, str(a), str(b), "--overwrite"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
        assert _tree_state(tmp_path) == before


def test_convert_of_a_training_checkpoint_names_export(tmp_path, capsys):
    """Issue 26 item 14: the error names the command the user wanted."""
    run = _fake_run(tmp_path / "run")
    for direction, src in [("mt-to-hf", run), ("mt-to-hf", run / "checkpoints" / "step_00000004"),
                           ("hf-to-mt", run), ("hf-to-mt", run / "checkpoints")]:
        assert cli.main(["convert", direction, str(src), str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "megatrain-jax export" in err[0], err
    assert not (tmp_path / "out").exists()


def test_export_of_a_training_checkpoint_loads_in_transformers(torch_python, tmp_path):
    """Issue 26 item 14: `megatrain-jax export RUN OUT` alone gives what from_pretrained loads."""
    import dataclasses
    from types import SimpleNamespace

    from megatrain_jax import checkpoint as ck

    cfg = ModelConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96,
                      qkv_bias=True, tie_embeddings=True, init_std=0.1)
    _, store = init_host_store(cfg, seed=5, bf16_stream=False)
    saver = ck.CheckpointSaver(SimpleNamespace(store=store, opt=None, count=0, before_update=None),
                               str(tmp_path / "run" / "checkpoints"), log=lambda m: None)
    saver.save(1, {"config": {"model": dataclasses.asdict(cfg)}, "count": 0}, wait=True)
    saver.close()
    assert cli.main(["export", str(tmp_path / "run"), str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    tokens = np.random.default_rng(0).integers(0, 128, (2, 16)).astype(np.int32)
    np.save(tmp_path / "tokens.npy", tokens)
    run_reference(torch_python, "logits", str(tmp_path / "tokens.npy"), str(tmp_path / "out.npz"), str(tmp_path / "hf"))
    got = np.load(tmp_path / "out.npz")
    assert json.loads(str(got["info"]))[0]["class"] == "Qwen2ForCausalLM"
    assert rel(got["logits:0"], np.asarray(model_from_store(store, cfg)(jnp.asarray(tokens)))) < 1e-5


# ------------------------------------------------------------------------------ Hub ids (issue 47 item 5)

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _hub_model(cache: Path, repo: str, cfg_json: dict, tensors: dict, refs=("main",)) -> Path:
    """A model laid out in a Hugging Face cache as the hub lays it: ``models--ORG--NAME/refs/<ref>``
    holding the commit hash, ``snapshots/<commit>/`` the files. Returns the snapshot directory."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    snap = _write_hf(folder / "snapshots" / COMMIT, cfg_json, tensors)
    (folder / "refs").mkdir(parents=True)
    for ref in refs:
        (folder / "refs" / ref).write_text(COMMIT)
    return snap


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An offline Hugging Face cache in ``tmp_path`` (no network here): HF_HUB_OFFLINE=1 and HF_HUB_CACHE, in
    the environment and in huggingface_hub's constants (which it reads once, when imported)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf_cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_from_hf_takes_a_hub_id_from_the_cache(hub_cache, tmp_path, capsys):
    """Issue 47 item 5: `--set model.from_hf=Qwen/Qwen2.5-0.5B` gave "is not a directory". A Hub id
    ORG/NAME[@REVISION] goes through huggingface_hub (its cache, its offline setting) to the snapshot,
    which then loads exactly as that directory does: the import, plan, train, convert hf-to-mt."""
    cfg_json = _hf_config("Qwen2ForCausalLM", tied=True, vocab_size=256)
    snap = _hub_model(hub_cache, "tiny-org/tiny-qwen", cfg_json, _hf_tensors(cfg_json), refs=("main", "v1"))
    _, want = load_hf_into_store(ModelConfig(from_hf=str(snap)), bf16_stream=False, log=None)
    for spec in ("tiny-org/tiny-qwen", "tiny-org/tiny-qwen@v1", f"tiny-org/tiny-qwen@{COMMIT}"):
        cfg = ModelConfig(from_hf=spec)
        _, got = load_hf_into_store(cfg, bf16_stream=False, log=None)
        assert os.path.realpath(cfg.from_hf) == os.path.realpath(snap) and cfg.qkv_bias and cfg.hidden_size == 32
        for g in want:
            assert np.array_equal(g.master, got[g.name].master), (spec, g.name)
    tiny = str(ROOT / "configs" / "tiny.yaml")
    assert cli.main(["plan", tiny, "--set", "model.from_hf=tiny-org/tiny-qwen"]) == 0
    run = tmp_path / "run"
    assert cli.main(["train", tiny, "--set", "model.from_hf=tiny-org/tiny-qwen@v1", "--set", "train.steps=2",
                     "--set", "optim.schedule.warmup_steps=0", "--set", "data.seq_len=32", "--set", "train.batch_size=2",
                     "--set", "train.final_checkpoint=false", "--set", f"train.out_dir={run}"]) == 0
    printed = capsys.readouterr().out
    assert f"hf: tiny-org/tiny-qwen@v1 is {snap}" in printed and "hf import: " in printed, printed
    assert (run / "metrics.jsonl").is_file()
    mt = tmp_path / "mt"
    assert cli.main(["convert", "hf-to-mt", "tiny-org/tiny-qwen@v1", str(mt)]) == 0
    assert (mt / "model.yaml").is_file() and json.loads((mt / "hf_config.json").read_text()) == cfg_json
    capsys.readouterr()  # an output inside the Hugging Face cache (the input of a Hub id) is refused
    assert cli.main(["convert", "hf-to-mt", "tiny-org/tiny-qwen", str(hub_cache / "mt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: OUT:") and "input" in err[0], err
    assert not (hub_cache / "mt").exists()


def test_a_hub_id_that_cannot_be_had_is_one_line_naming_it_and_the_fix(hub_cache, tmp_path, capsys):
    """Offline and not in the cache, or a revision the cache does not hold: one line naming the field and
    the id, with the fix (HF_HUB_OFFLINE, a local path); nothing written."""
    cfg_json = _hf_config(tied=True)
    _hub_model(hub_cache, "tiny-org/tiny-llama", cfg_json, _hf_tensors(cfg_json))
    tiny = str(ROOT / "configs" / "tiny.yaml")
    for argv, field, spec in [
        (["plan", tiny, "--set", "model.from_hf=Qwen/Qwen2.5-0.5B"], "model.from_hf", "Qwen/Qwen2.5-0.5B"),
        (["plan", tiny, "--set", "model.from_hf=tiny-org/tiny-llama@v9"], "model.from_hf", "tiny-org/tiny-llama@v9"),
        (["train", tiny, "--set", "model.from_hf=Qwen/Qwen2.5-0.5B", "--set", f"train.out_dir={tmp_path / 'run'}"],
         "model.from_hf", "Qwen/Qwen2.5-0.5B"),
        (["convert", "hf-to-mt", "tiny-org/nope", str(tmp_path / "mt")], "HF_DIR", "tiny-org/nope"),
    ]:
        before = sorted(os.listdir(tmp_path))
        capsys.readouterr()
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {field}: {spec} "), err
        assert "HF_HUB_OFFLINE" in err[0] and "local" in err[0] and "(fix: " in err[0], err
        assert sorted(os.listdir(tmp_path)) == before


def test_a_hub_id_through_the_environment_in_a_fresh_process(tmp_path, cli_env):
    """The real settings, read by huggingface_hub at import: HF_HOME (its hub/ cache) and HF_HUB_OFFLINE."""
    from cli_runner import run_cli

    cfg_json = _hf_config(tied=True)
    _hub_model(tmp_path / "hf_home" / "hub", "tiny-org/tiny-llama", cfg_json, _hf_tensors(cfg_json))
    env = dict(cli_env, HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1")
    for k in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        env.pop(k, None)
    r = run_cli(["convert", "hf-to-mt", "tiny-org/tiny-llama", str(tmp_path / "mt")], env=env)
    assert r.rc == 0 and "hf: tiny-org/tiny-llama is " in r.stdout, str(r)
    assert (tmp_path / "mt" / "model.yaml").is_file()
