"""Mixture-of-experts families (Mixtral, Qwen3-MoE) against ``transformers``.

One torch subprocess (``tests/hf_reference.py serve-moe``), started when the module starts and
building the references while the JAX-only tests run, makes the tiny random fp32 references (eager
attention and experts, norms != 1, 2-3 experts per token, windows shorter than the sequence, top-k
weights renormalised or not) with logits, loss and every gradient, then loads our exports back on
request. Checked: logits, loss and every gradient within 1e-4 relative (the sorted dispatch on two
variants, the dense computation on one; both agree with each other in value and gradient),
import -> export(fp32) -> import bit-exact (experts stacked on import, split per expert on export),
exports load in ``transformers`` with the same logits, the streamed engine equals the in-memory
reference, parameter counts (OLMoE-1B-7B shape), and refusals.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
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
from megatrain_jax.models import abstract_model, init_host_store, init_model
from megatrain_jax.models.moe import experts_dense, experts_sorted, route
from megatrain_jax.optim import build_host_optimizer, build_reference_tx
from megatrain_jax.reference import ReferenceTrainer
from tests.test_families import ROOT, TORCH_VENV, _rel

TOL = 1e-4
VARIANTS = ["mixtral_untied_gqa_top2of4_window7", "qwen3moe_untied_gqa_headdim32_top3of6_norm",
            "qwen3moe_tied_mqa_top2of5_window7"]
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
}


class _Torch:
    """``hf_reference.py serve-moe`` in .venv-torch: builds the references, then answers requests."""

    def __init__(self, d: Path):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "JAX", "XLA", "VIRTUAL_ENV"))}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false")
        self.dir, self.err = d, open(d / "stderr.txt", "w+")
        self.proc = subprocess.Popen([str(TORCH_VENV / "bin" / "python"), str(ROOT / "tests" / "hf_reference.py"),
                                      "serve-moe", str(d / "refs")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, text=True, env=env)
        self.ready = False

    def wait(self, word: str) -> None:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.err.seek(0)
                pytest.fail(f"hf_reference.py serve-moe died:\n{self.err.read()[-4000:]}")
            if line.strip() == word:
                return

    def refs(self) -> Path:
        if not self.ready:
            self.wait("ready")
            self.ready = True
        return self.dir / "refs"

    def logits(self, tokens: str, out: str, dirs: list[str]) -> None:
        self.refs()
        self.proc.stdin.write(json.dumps(["logits", tokens, out, *dirs]) + "\n")
        self.proc.stdin.flush()
        self.wait("done")

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.err.close()


@pytest.fixture(scope="module", autouse=True)
def torch_ref(tmp_path_factory):
    """Started before the module's first test, so that the references build while JAX compiles."""
    if not (TORCH_VENV / ".ready").exists():  # the JAX-only tests still run
        yield None
        return
    server = _Torch(tmp_path_factory.mktemp("moe"))
    yield server
    server.close()


@pytest.fixture(scope="module")
def moe_refs(torch_ref) -> Path:
    if torch_ref is None:
        pytest.skip("no transformers reference environment (scripts/setup_torch_ref.sh)")
    d = torch_ref.refs()
    assert sorted(p.name for p in d.iterdir() if p.is_dir()) == sorted(VARIANTS)
    return d


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
        if group.startswith("block_"):
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
    graphdef, state = nnx.split(model_from_store(store, cfg))
    params = nnx.to_pure_dict(state)
    toks = jnp.asarray(tokens, jnp.int32)

    def loss_fn(p):
        logits = nnx.merge(graphdef, p)(toks)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], toks[:, 1:])
        return jnp.mean(ce), logits

    (loss, logits), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
    return float(loss), np.asarray(logits), _torch_grads(cfg, grads)


# ----------------------------------------------------------------------- engine vs reference


def test_streamed_equals_reference_qwen3_moe():
    """Qwen3-MoE (top-3 of 4, not renormalised, GQA, q/k norms), sorted dispatch: one AdamW step of
    2 micro-batches by the streamed engine and by the in-memory reference (loss, gradient norm, every
    updated weight; the optimizer's later steps do not depend on the family)."""
    cfg = ModelConfig(family="qwen3_moe", vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=96, num_experts=4, experts_per_token=3, moe_intermediate_size=32,
                      norm_topk_prob=False, moe_impl="sorted", init_std=0.1)
    steps = 1
    ocfg = OptimConfig(lr=1e-3, b2=0.95, weight_decay=0.1, clip_norm=1.0, schedule=ScheduleConfig(kind="constant"))
    ref = ReferenceTrainer(init_model(cfg, 0), build_reference_tx(ocfg, steps))
    parts, store = init_host_store(cfg, 0, bf16_stream=False)
    before = store["block_0"].tree()["mlp"]["experts"]["down_proj"].copy()
    st = StreamedTrainer(parts, build_host_optimizer(ocfg, steps), compute_dtype="float32", micro_batches=2,
                         clip_norm=1.0, loss_chunk=48, store=store)
    rng = np.random.default_rng(1)
    for _ in range(steps):
        toks = rng.integers(0, cfg.vocab_size, (4, 17))
        batch = Batch(toks[:, :-1], toks[:, 1:], (rng.random((4, 16)) > 0.2).astype(np.float32))
        r, s = ref.step(batch), st.step(batch)
        assert abs(r.loss - s.loss) <= 1e-5 * abs(r.loss), (r.loss, s.loss)
        assert abs(r.grad_norm - s.grad_norm) <= 1e-4 * r.grad_norm
    st.close()
    tree = ref.params_tree()
    groups = {"embed": tree["embed"], "head": tree["head"], **{f"block_{i}": t for i, t in tree["layers"].items()}}
    for name, t in groups.items():
        a = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(t)])
        assert np.linalg.norm(a - st.store[name].master) / np.linalg.norm(a) < 1e-5, name
    moved = before - st.store["block_0"].tree()["mlp"]["experts"]["down_proj"]
    assert np.all(np.linalg.norm(moved.reshape(4, -1), axis=1) > 1e-4)  # every expert was trained


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

        a = jax.jit(jax.value_and_grad(lambda *z: run(experts_sorted, *z), argnums=(0, 1, 2)))(x, w, logits)
        b = jax.jit(jax.value_and_grad(lambda *z: run(experts_dense, *z), argnums=(0, 1, 2)))(x, w, logits)
        for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
            np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-5)


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
    ("Qwen3MoeForCausalLM", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ("Qwen3MoeForCausalLM", {"mlp_only_layers": [0]}, "mlp_only_layers"),
    ("Qwen3MoeForCausalLM", {"output_router_logits": True}, "output_router_logits"),
    ("MixtralForCausalLM", {"output_router_logits": True}, "output_router_logits"),
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


MOE_OK = ["model.family=qwen3_moe", "model.num_experts=4", "model.experts_per_token=2"]


@pytest.mark.parametrize("over,field", [
    (MOE_OK + ["model.router_aux_loss_coef=0.01"], "model.router_aux_loss_coef"),
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


# ----------------------------------------------------------------------- against transformers
# (last: the torch subprocess builds the references while the tests above run)


@pytest.mark.parametrize("variant,impl", [(VARIANTS[0], "sorted"), (VARIANTS[1], "dense"), (VARIANTS[2], "sorted")])
def test_parity_with_transformers(moe_refs, variant, impl):
    ref = np.load(moe_refs / variant / "ref.npz")
    cfg, parts, store = _import(moe_refs / variant / "hf", moe_impl=impl)
    for name, want in EXPECT[variant].items():
        assert getattr(cfg, name) == want, (name, getattr(cfg, name), want)
    assert cfg.moe_impl == impl  # not a checkpoint field: the YAML's choice survives the import
    loss, logits, grads = _loss_logits_grads(cfg, store, ref["tokens"])
    assert _rel(logits, ref["logits"]) < TOL
    assert abs(loss - float(ref["loss"])) < TOL * abs(float(ref["loss"]))
    want = {k[5:]: ref[k] for k in ref.files if k.startswith("grad:")}
    assert sorted(grads) == sorted(want)
    floor = 1e-4 * max(np.linalg.norm(g) for g in want.values())
    for name, g in want.items():
        assert grads[name].shape == g.shape, name
        err = np.linalg.norm(grads[name].astype(np.float64) - g) / max(np.linalg.norm(g), floor)
        assert err < TOL, f"{variant} {impl}: gradient of {name} differs: {err:.2e}"
    assert len(set(parts.blocks.kinds)) == 1  # one compiled template for every MoE layer


@pytest.mark.parametrize("variant", VARIANTS)
def test_round_trip_is_bit_exact(moe_refs, tmp_path, variant):
    src = moe_refs / variant / "hf"
    cfg, _, store = _import(src)
    exp = store["block_0"].tree()["mlp"]["experts"]
    orig = load_file(str(src / "model.safetensors"))
    e1 = "model.layers.0." + ("block_sparse_moe.experts.1.w1.weight" if cfg.family == "mixtral"
                              else "mlp.experts.1.gate_proj.weight")
    np.testing.assert_array_equal(exp["gate_proj"][1], orig[e1].T)  # expert 1's slice of the stack
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
                "num_experts", "sliding_window", "use_sliding_window", "output_router_logits"):
        if key in hf_src and not (key == "num_local_experts" and cfg.family == "qwen3_moe"):
            assert hf_out.get(key) == hf_src[key], key
    cfg2, _, store2 = _import(out)
    assert dataclasses.replace(cfg2, from_hf=None) == dataclasses.replace(cfg, from_hf=None)
    for g in store:
        assert np.array_equal(g.master, store2[g.name].master), g.name


FRESH = {  # trained from scratch: config.json from our ModelConfig alone
    "fresh_mixtral": dict(family="mixtral", num_experts=3, experts_per_token=2, num_kv_heads=2, sliding_window=9),
    "fresh_qwen3_moe": dict(family="qwen3_moe", num_experts=4, experts_per_token=3, moe_intermediate_size=24,
                            norm_topk_prob=False, head_dim=24, tie_embeddings=True),
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
    torch_ref.logits(str(tmp_path / "tokens.npy"), str(tmp_path / "out.npz"), dirs)
    got = np.load(tmp_path / "out.npz")
    info = json.loads(str(got["info"]))
    for i, (variant, family, dtype, mine) in enumerate(expect):
        assert info[i]["class"] == ARCH[family], variant
        assert info[i]["dtype"] == f"torch.{dtype}"
        want = mine if mine is not None else np.load(moe_refs / variant / "ref.npz")["logits"]
        err = _rel(got[f"logits:{i}"], want)
        assert err < (1e-5 if dtype == "float32" else 3e-2), f"{variant} {dtype}: logits differ by {err:.2e}"
