"""The dense families beyond Llama (Qwen3, Phi-3, Gemma 2, Gemma 3) against ``transformers``.

One torch subprocess (``tests/hf_reference.py make-families``, in ``.venv-torch``) makes every
tiny random fp32 reference model (eager attention, norms != 1, windows shorter than the sequence,
soft-capping on) with its logits, loss and gradients; a second one loads all our exports back. We
check logits, loss and every gradient within 1e-4 relative, import -> export(fp32) -> import
bit-exact, that ``transformers`` loads our exports (also of models that never saw Hugging Face),
and that the streamed engine equals the in-memory reference on a Gemma 2 model.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors.numpy import load_file

from megatrain_jax.config import ModelConfig, OptimConfig, ScheduleConfig, load_config
from megatrain_jax.engine import Batch, StreamedTrainer
from megatrain_jax.errors import UserError
from megatrain_jax.hf import HFWarning, export_hf, hf_name, load_hf_into_store, model_from_store
from megatrain_jax.models import abstract_model, init_host_store, init_model, streamed_parts
from megatrain_jax.optim import build_host_optimizer, build_reference_tx
from megatrain_jax.reference import ReferenceTrainer
from torch_reference import make_references, rel, run_reference, torch_python

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4
VARIANTS = ["qwen3_untied_gqa_headdim32", "qwen3_tied_mqa_window7_mixed", "phi3_untied_gqa", "phi3_tied_window7",
            "gemma2_tied_gqa_softcaps_window7", "gemma2_untied_mqa_nocaps", "gemma3_tied_gqa_window7",
            "gemma3_untied_linear_rope"]
ARCH = {"qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
        "gemma3": "Gemma3ForCausalLM"}
# what the importer must read from each reference config.json
EXPECT = {
    "qwen3_untied_gqa_headdim32": dict(head_dim=32, num_kv_heads=2, sliding_window=None, tie_embeddings=False),
    "qwen3_tied_mqa_window7_mixed": dict(sliding_window=7, layer_types=["full_attention", "sliding_attention"],
                                         tie_embeddings=True),
    "phi3_untied_gqa": dict(sliding_window=None, tie_embeddings=False),
    "phi3_tied_window7": dict(sliding_window=7, tie_embeddings=True, rope_theta=250000.0),
    "gemma2_tied_gqa_softcaps_window7": dict(attn_softcap=1.5, final_softcap=2.5, query_pre_attn_scalar=24.0,
                                             sliding_window=7, layer_types=None, tie_embeddings=True),
    "gemma2_untied_mqa_nocaps": dict(attn_softcap=None, final_softcap=None, tie_embeddings=False),
    "gemma3_tied_gqa_window7": dict(rope_theta=1e6, rope_local_theta=1e4, final_softcap=2.5, sliding_window=7,
                                    layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "gemma3_untied_linear_rope": dict(rope_theta=5e5, rope_local_theta=2e4, rope_scaling={"rope_type": "linear", "factor": 4.0},
                                      layer_types=["full_attention", "sliding_attention"], tie_embeddings=False),
}


# ------------------------------------------------------------------------------- torch reference


@pytest.fixture(scope="session")
def torch_py() -> str:
    return torch_python()


@pytest.fixture(scope="session")
def refs(torch_py, tmp_path_factory) -> Path:
    return make_references(torch_py, tmp_path_factory.mktemp("fam_ref"), "make-families", VARIANTS)


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
    out = {}
    for group, tree in by_group.items():
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            name, transposed = hf_name(group, jax.tree_util.keystr(path, simple=True, separator="/"), cfg.family)
            out[name] = np.asarray(leaf).T if transposed else np.asarray(leaf)
    return float(loss), np.asarray(logits), out


@pytest.mark.parametrize("variant", VARIANTS)
def test_parity_with_transformers(refs, variant):
    ref = np.load(refs / variant / "ref.npz")
    cfg, parts, store = _import(refs / variant / "hf")
    assert cfg.family == variant.split("_")[0]
    for name, want in EXPECT[variant].items():
        assert getattr(cfg, name) == want, (name, getattr(cfg, name), want)
    loss, logits, grads = _loss_logits_grads(cfg, store, ref["tokens"])
    assert rel(logits, ref["logits"]) < TOL
    assert abs(loss - float(ref["loss"])) < TOL * abs(float(ref["loss"]))
    want = {k[5:]: ref[k] for k in ref.files if k.startswith("grad:")}
    assert sorted(grads) == sorted(want)  # same parameters (tied: no lm_head on either side)
    floor = 1e-4 * max(np.linalg.norm(g) for g in want.values())  # for (near-)zero true gradients
    for name, g in want.items():
        err = np.linalg.norm(grads[name].astype(np.float64) - g) / max(np.linalg.norm(g), floor)
        assert err < TOL, f"{variant}: gradient of {name} differs: {err:.2e}"
    # local and global layers are separate template kinds (one compiled executable each), not one per layer
    kinds = len(set(parts.blocks.kinds))
    assert kinds == len({(cfg.layer_window(i), cfg.resolved_layer_types()[i]) for i in range(cfg.num_layers)})


@pytest.mark.parametrize("variant", VARIANTS)
def test_round_trip_is_bit_exact(refs, tmp_path, variant):
    src = refs / variant / "hf"
    cfg, _, store = _import(src)
    out = tmp_path / "exported"
    export_hf(store, cfg, str(out), dtype="float32", log=None)
    orig, exported = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    if cfg.tie_embeddings:
        orig.pop("lm_head.weight", None)
    assert sorted(exported) == sorted(orig)
    for name, arr in orig.items():
        assert exported[name].dtype == np.float32 and np.array_equal(exported[name], arr), name
    cfg2, _, store2 = _import(out)
    assert dataclasses.replace(cfg2, from_hf=None) == dataclasses.replace(cfg, from_hf=None)  # every field
    for g in store:
        assert np.array_equal(g.master, store2[g.name].master), g.name


FRESH = {  # models trained from scratch: config.json is written from our ModelConfig alone
    "fresh_qwen3": dict(family="qwen3", num_kv_heads=2, head_dim=24, rope_theta=1e6),
    "fresh_phi3": dict(family="phi3", sliding_window=9, tie_embeddings=True),
    "fresh_gemma2": dict(family="gemma2", num_layers=3, num_kv_heads=1, head_dim=32, sliding_window=6,
                         attn_softcap=2.0, final_softcap=3.0, query_pre_attn_scalar=20.0, tie_embeddings=True),
    "fresh_gemma3": dict(family="gemma3", num_layers=3, num_kv_heads=2, sliding_window=6, rope_theta=1e6,
                         rope_local_theta=1e4, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
}


def _fresh(name: str) -> ModelConfig:
    return ModelConfig(vocab_size=128, hidden_size=64, num_heads=4, intermediate_size=96, init_std=0.1,
                       **{"num_layers": 2, **FRESH[name]})


def test_exports_load_in_transformers(refs, torch_py, tmp_path):
    """fp32 exports of every reference and of fresh models load with from_pretrained(DIR) alone and
    give the same logits; a bf16 export in shards loads too, and imports back (bf16 -> fp32 exact)."""
    dirs, expect = [], []
    tokens = np.load(refs / VARIANTS[0] / "ref.npz")["tokens"]
    for variant in VARIANTS:
        cfg, _, store = _import(refs / variant / "hf")
        dtypes = ("float32", "bfloat16") if variant.startswith(("gemma2_tied", "phi3_untied")) else ("float32",)
        for dtype in dtypes:
            out = tmp_path / f"{variant}-{dtype}"
            export_hf(store, cfg, str(out), dtype=dtype, max_shard_bytes=60_000 if dtype == "bfloat16" else 10**9,
                      log=None)
            dirs.append(str(out))
            expect.append((variant, dtype, None))
            if dtype == "bfloat16":
                assert (out / "model.safetensors.index.json").is_file()  # sharded
                cfg_b, _, back = _import(out)
                assert dataclasses.replace(cfg_b, from_hf=None) == dataclasses.replace(cfg, from_hf=None)
                for g in store:
                    np.testing.assert_array_equal(back[g.name].master,
                                                  g.master.astype(ml_dtypes.bfloat16).astype(np.float32))
    for name in FRESH:
        cfg = _fresh(name)
        _, store = init_host_store(cfg, seed=3, bf16_stream=False)
        logits = np.asarray(model_from_store(store, cfg)(jnp.asarray(tokens)))
        export_hf(store, cfg, str(tmp_path / name), dtype="float32", log=None)
        dirs.append(str(tmp_path / name))
        expect.append((name, "float32", logits))
    np.save(tmp_path / "tokens.npy", tokens)
    run_reference(torch_py, "logits", str(tmp_path / "tokens.npy"), str(tmp_path / "out.npz"), *dirs)
    got = np.load(tmp_path / "out.npz")
    info = json.loads(str(got["info"]))
    for i, (variant, dtype, mine) in enumerate(expect):
        family = FRESH[variant]["family"] if variant in FRESH else variant.split("_")[0]
        assert info[i]["class"] == ARCH[family], variant
        assert info[i]["dtype"] == f"torch.{dtype}"
        want = mine if mine is not None else np.load(refs / variant / "ref.npz")["logits"]
        err = rel(got[f"logits:{i}"], want)
        assert err < (1e-5 if dtype == "float32" else 3e-2), f"{variant} {dtype}: logits differ by {err:.2e}"


# ----------------------------------------------------------------------- engine vs reference


def test_streamed_equals_reference_gemma2():
    """Gemma 2 (tied, GQA, local window 5 < 32 tokens next to a global layer, both soft-caps on,
    query_pre_attn_scalar) trained 2 steps of 2 micro-batches by the streamed engine and the
    in-memory reference."""
    cfg = ModelConfig(family="gemma2", vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=32, intermediate_size=96, sliding_window=5, attn_softcap=3.0, final_softcap=4.0,
                      query_pre_attn_scalar=24.0, tie_embeddings=True, init_std=0.1)
    steps = 2
    ocfg = OptimConfig(lr=1e-3, b2=0.95, weight_decay=0.1, clip_norm=1.0,
                       schedule=ScheduleConfig(kind="warmup_cosine", warmup_steps=1))
    ref = ReferenceTrainer(init_model(cfg, 0), build_reference_tx(ocfg, steps))
    parts, store = init_host_store(cfg, 0, bf16_stream=False)
    assert parts.logit_softcap == 4.0 and len(set(parts.blocks.kinds)) == 2  # local, global
    st = StreamedTrainer(parts, build_host_optimizer(ocfg, steps), compute_dtype="float32", micro_batches=2,
                         clip_norm=1.0, loss_chunk=48, store=store)
    rng = np.random.default_rng(1)
    for _ in range(steps):
        toks = rng.integers(0, cfg.vocab_size, (4, 33))
        batch = Batch(toks[:, :-1], toks[:, 1:], (rng.random((4, 32)) > 0.2).astype(np.float32))
        r, s = ref.step(batch), st.step(batch)
        assert abs(r.loss - s.loss) <= 1e-5 * abs(r.loss), (r.loss, s.loss)
        assert abs(r.grad_norm - s.grad_norm) <= 1e-4 * r.grad_norm
    st.close()
    tree = ref.params_tree()
    groups = {"embed": tree["embed"], "head": tree["head"], **{f"block_{i}": t for i, t in tree["layers"].items()}}
    for name, t in groups.items():
        a = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(t)])
        assert np.linalg.norm(a - st.store[name].master) / np.linalg.norm(a) < 1e-5, name
    init = init_model(cfg, 0)
    moved = np.linalg.norm(np.asarray(init.layers[0].mlp.up_proj.kernel[...]) - st.store["block_0"].tree()["mlp"]["up_proj"]["kernel"])
    assert moved > 1e-3


# --------------------------------------------------------------------- config, counts, errors


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3", "gemma2", "gemma3"])
def test_block_params_count_the_modules(family):
    over = dict(sliding_window=4) if family.startswith("gemma") else {}
    cfg = ModelConfig(family=family, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=12, intermediate_size=40,
                      num_layers=2, **over)
    model = abstract_model(cfg)  # shapes only
    block = sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(model.layers[0])))
    total = sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(model)))
    assert cfg.block_params() == block and cfg.total_params() == total


@pytest.mark.parametrize("path,family,params", [
    ("configs/qwen3-8b.yaml", "qwen3", 8_190_735_360),
    ("configs/gemma-2-9b.yaml", "gemma2", 9_241_705_984),
    ("configs/phi-3-mini.yaml", "phi3", 3_821_079_552),
    ("configs/gemma-3-1b.yaml", "gemma3", 999_885_952),
])
def test_family_presets(path, family, params):
    cfg = load_config(str(ROOT / path))
    assert cfg.model.family == family and cfg.model.total_params() == params


def _write_config(d: Path, cfg: dict) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("arch,over,needle", [
    ("Phi3ForCausalLM", {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.0] * 4}},
     "longrope"),
    ("Phi3ForCausalLM", {"partial_rotary_factor": 0.75}, "partial_rotary_factor"),
    ("Gemma2ForCausalLM", {"hidden_activation": "gelu"}, "gelu"),
    ("Gemma3ForCausalLM", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("Gemma3ForCausalLM", {"attention_bias": True}, "attention_bias"),
    ("Qwen3ForCausalLM", {"attention_bias": True}, "attention_bias"),
    ("Gemma3ForConditionalGeneration", {}, "Gemma3ForCausalLM"),  # the multimodal model: names the text one
])
def test_unsupported_features_are_named(tmp_path, arch, over, needle):
    cfg = {"architectures": [arch], "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, **over}
    d = _write_config(tmp_path / "hf", cfg)
    with pytest.raises(UserError, match=needle) as e:
        load_hf_into_store(ModelConfig(from_hf=str(d)), bf16_stream=False, log=None)
    assert e.value.field == "model.from_hf"


def test_gemma3_attn_softcapping_is_ignored_like_transformers(tmp_path):
    from megatrain_jax.hf import read_hf_config, resolve_hf_model_config

    cfg = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "attn_logit_softcapping": 50.0}
    d = _write_config(tmp_path / "hf", cfg)
    assert read_hf_config(str(d))["attn_logit_softcapping"] == 50.0
    with pytest.warns(HFWarning, match="ignored"):
        m = resolve_hf_model_config(ModelConfig(from_hf=str(d)))
    assert m.attn_softcap is None and m.family == "gemma3" and m.head_dim == 256  # transformers' default head_dim


@pytest.mark.parametrize("over,field", [
    (["model.family=gpt2"], "model.family"),
    (["model.attn_softcap=30"], "model.attn_softcap"),  # llama has none
    (["model.family=gemma2", "model.attn_softcap=-1"], "model.attn_softcap"),
    (["model.family=gemma3", "model.attn_softcap=50"], "model.attn_softcap"),
    (["model.family=gemma2", "model.sliding_window=8", "model.layer_types=[full_attention]"], "model.layer_types"),
    (["model.family=gemma2", "model.layer_types=[sliding_attention,full_attention,full_attention,full_attention]"],
     "model.layer_types"),  # sliding layers without a window
    (["model.family=qwen3", "model.qkv_bias=true"], "model.qkv_bias"),
    (["model.family=gemma2", "model.rope_local_theta=1e4"], "model.rope_local_theta"),
    (["model.rope_scaling={rope_type: yarn, factor: 2}"], "model.rope_scaling"),
])
def test_bad_family_fields_are_user_errors(over, field):
    with pytest.raises(UserError) as e:
        load_config(str(ROOT / "configs" / "tiny.yaml"), over)
    assert e.value.field == field


def test_gemma_layer_pattern_and_kinds():
    g2 = ModelConfig(family="gemma2", num_layers=4, sliding_window=8)
    assert [g2.layer_window(i) for i in range(4)] == [8, None, 8, None]
    g3 = ModelConfig(family="gemma3", num_layers=7, sliding_window=8, rope_local_theta=1e4)
    assert [g3.layer_window(i) for i in range(7)] == [8, 8, 8, 8, 8, None, 8]
    parts = streamed_parts(abstract_model(g3))
    assert parts.blocks.kinds == [0, 0, 0, 0, 0, 1, 0]  # two compiled templates for seven layers


# ------------------------------------------------------------------------------- one file per family


def test_a_family_is_one_file_that_the_registry_finds(tmp_path, monkeypatch):
    """Each family's ``Family`` object and its block live in one module under ``megatrain_jax/models/``
    (``models/moe.py`` and ``common.py`` are shared layers: no family of their own), and the registry
    imports every module there, the default family's first, so a new family is one new file."""
    import megatrain_jax.families as families

    fams = families.families()
    assert list(fams)[0] == families.DEFAULT_FAMILY == "llama"
    for name, fam in fams.items():
        mod = type(fam).__module__
        assert mod == f"megatrain_jax.models.{name}", (name, mod)
        assert fam.block.__module__ == mod and fam.name == name
    assert issubclass(type(fams["qwen3"]), type(fams["llama"]))  # Qwen3 extends Llama's family
    for name in ("gemma3", "mixtral", "qwen3_moe"):
        assert type(fams[name]).__mro__[1] is not families.Family  # each extends a sibling's
    (tmp_path / "zeta.py").write_text("")
    (tmp_path / "llama.py").write_text("")
    (tmp_path / "alpha.py").write_text("")
    (tmp_path / "_private.py").write_text("")
    monkeypatch.setattr(families, "MODELS_DIR", tmp_path)
    assert families.family_modules() == ["megatrain_jax.models.llama", "megatrain_jax.models.alpha",
                                         "megatrain_jax.models.zeta"]
