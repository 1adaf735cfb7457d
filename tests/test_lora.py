"""LoRA on a frozen, streamed base (issue 30): the math against transformers + peft, the streamed
engine against the in-memory LoRA reference, the PEFT format, the int8 base, config errors, the CLI."""
from __future__ import annotations

import dataclasses
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from megatrain_jax.config import ModelConfig, load_config
from megatrain_jax.config.schema import LoraConfig
from megatrain_jax.engine.lora import LoraEngine, LoraModel, reference_lora_loss
from megatrain_jax.engine.lora_base import FrozenStore
from megatrain_jax.engine.step import Batch
from megatrain_jax.errors import UserError
from megatrain_jax.hf.peft import load_peft, peft_name, save_peft
from megatrain_jax.models.common import Decoder, streamed_parts
from megatrain_jax.models.lora import lora_decoder, split_lora

from tests.torch_reference import ROOT, child_env, torch_python

ATTN = ["q", "k", "v", "o"]
VARIANTS = {"llama": dict(family="llama"), "qwen2": dict(family="llama", qkv_bias=True),
            "mixtral": dict(family="mixtral", num_experts=4, experts_per_token=2)}


def tiny(name: str, layers: int = 2, **lora) -> ModelConfig:
    kw = dict(VARIANTS[name])
    targets = ATTN if name == "mixtral" else ATTN + ["gate", "up", "down"]
    lora = LoraConfig(**{"rank": 4, "alpha": 8.0, "targets": targets, **lora})
    return ModelConfig(vocab_size=64, hidden_size=32, num_layers=layers, num_heads=4, num_kv_heads=2,
                       intermediate_size=48, lora=lora, **kw)


def nonzero_b(adapters):
    """peft's B starts at 0 (so A gets no gradient): random adapters for the comparisons."""
    return jax.tree_util.tree_map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(a.size), a.shape), adapters)


# ---------------------------------------------------------------------------------------- peft parity


def _peft_python() -> tuple[str, dict]:
    """The reference interpreter and its environment; peft from .venv-torch or ``LORA_PEFT_PATH``."""
    py = torch_python()
    extra = {"PYTHONPATH": os.environ["LORA_PEFT_PATH"]} if os.environ.get("LORA_PEFT_PATH") else {}
    env = child_env(OMP_NUM_THREADS="2", **extra)
    # found, not imported (importing peft and torch takes seconds; the reference run imports it)
    find = "import importlib.util, sys; sys.exit(importlib.util.find_spec('peft') is None)"
    if subprocess.run([py, "-c", find], env=env, capture_output=True).returncode:
        pytest.skip("peft is not installed in .venv-torch (scripts/setup_torch_ref.sh; or set LORA_PEFT_PATH)")
    return py, env


@pytest.fixture(scope="module")
def peft_runs(tmp_path_factory):
    """Per variant: JAX's logits, loss and adapter gradients, and peft's on the saved base + adapter."""
    from megatrain_jax.hf.exporter import export_hf

    py, env = _peft_python()
    root = tmp_path_factory.mktemp("peft")
    ours = {}
    for name in VARIANTS:
        cfg = tiny(name)
        graph, ad, rngs, rest = split_lora(lora_decoder(cfg, 0))
        ad = nonzero_b(ad)
        d = root / name
        export_hf(Decoder(dataclasses.replace(cfg, lora=None), 0), cfg, str(d / "hf"), "float32", overwrite=True,
                  log=lambda _: None)
        save_peft(str(d / "adapter"), [ad["layers"][i] for i in range(cfg.num_layers)], cfg, "tiny")
        rs = np.random.default_rng(0)
        tokens, labels = rs.integers(0, 64, (2, 16)), rs.integers(0, 64, (2, 16))
        np.savez(d / "inputs.npz", tokens=tokens, labels=labels)

        def f(ad):
            logits = nnx.merge(graph, ad, rngs, rest)(jnp.asarray(tokens))
            return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(labels)).mean(), logits

        (loss, logits), g = jax.jit(jax.value_and_grad(f, has_aux=True))(ad)  # one compile, not op by op
        grads = {peft_name(i, p, proj, leaf): np.asarray(v).T for i in range(cfg.num_layers)
                 for p, mods in g["layers"][i].items() for proj, leaves in mods.items() for leaf, v in leaves.items()}
        ours[name] = (np.asarray(logits), float(loss), grads, cfg, ad)
    r = subprocess.run([py, str(ROOT / "tests" / "lora_reference.py"), *(str(root / n) for n in VARIANTS)],
                       env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-4000:]
    return root, ours


@pytest.mark.parametrize("name", list(VARIANTS))
def test_equals_peft(peft_runs, name):
    """Logits, loss and every adapter gradient within 1e-4 of transformers + peft (which loaded our
    saved adapter: the format is peft's)."""
    root, ours = peft_runs
    logits, loss, grads, _, _ = ours[name]
    ref = np.load(root / name / "ref.npz")
    scale = lambda x: max(float(np.abs(x).max()), 1e-6)  # noqa: E731
    assert np.abs(logits - ref["logits"]).max() / scale(ref["logits"]) < 1e-4
    assert abs(loss - float(ref["loss"])) < 1e-4 * abs(float(ref["loss"]))
    keys = {k[5:] for k in ref.files if k.startswith("grad:")}
    assert keys == set(grads), keys ^ set(grads)
    for k in keys:
        assert np.abs(grads[k] - ref["grad:" + k]).max() / scale(ref["grad:" + k]) < 1e-4, k


def test_peft_round_trip(peft_runs):
    """What we save, we load back exactly; peft's adapter_config.json fields are there."""
    import json

    root, ours = peft_runs
    _, _, _, cfg, ad = ours["qwen2"]
    layers = [ad["layers"][i] for i in range(cfg.num_layers)]
    back = load_peft(str(root / "qwen2" / "adapter"), cfg, layers)
    for a, b in zip(jax.tree_util.tree_leaves(layers), jax.tree_util.tree_leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), b)
    conf = json.load(open(root / "qwen2" / "adapter" / "adapter_config.json"))
    assert conf["peft_type"] == "LORA" and conf["task_type"] == "CAUSAL_LM" and conf["bias"] == "none"
    assert conf["r"] == 4 and conf["lora_alpha"] == 8.0 and conf["target_modules"] == [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ---------------------------------------------------------------------------------------- the engine


@pytest.mark.parametrize("name,base_dtype,dropout,micro,compute", [
    ("llama", "float32", 0.0, 1, "float32"), ("llama", "int8", 0.1, 1, "float32"),
    ("qwen2", "bfloat16", 0.0, 2, "float32"), ("mixtral", "float32", 0.0, 2, "float32"),
    ("llama", "bfloat16", 0.0, 1, "bfloat16")])
def test_streamed_equals_reference(name, base_dtype, dropout, micro, compute):
    """5 steps of the streamed LoRA engine = the in-memory LoRA model with plain jax + optax (the same
    base values, clipping that triggers on every step, AdamW with weight decay)."""
    cfg = tiny(name, layers=3, dropout=dropout, base_dtype=base_dtype)
    store = FrozenStore.from_trees(streamed_parts(Decoder(dataclasses.replace(cfg, lora=None), 0)).host_trees(),
                                   base_dtype)
    model = LoraModel(cfg)
    tx, clip = optax.adamw(1e-3, b1=0.9, b2=0.95, weight_decay=0.01), 0.05
    ad0 = nonzero_b(model.init_adapters(0))
    eng = LoraEngine(model, store, tx, adapters=ad0, compute_dtype=compute, micro_batches=micro, clip_norm=clip,
                     loss_chunk=16)
    loss_fn = jax.jit(jax.value_and_grad(reference_lora_loss(model, store, compute)), static_argnums=(5,))
    ref_tx = optax.chain(optax.clip_by_global_norm(clip), tx)
    ad, st = ad0, ref_tx.init(ad0)
    rs = np.random.default_rng(0)
    tol = 1e-4 if compute == "float32" else 2e-2
    for step in range(5):
        toks = rs.integers(0, 64, (4, 17))
        b = Batch(toks[:, :-1], toks[:, 1:])
        res = eng.step(b)
        loss, g = loss_fn(ad, jnp.asarray(b.tokens), jnp.asarray(b.labels), jnp.ones((4, 16)), step, 0)
        norm = float(optax.global_norm(g))
        assert norm > clip  # clipping triggers
        assert abs(res.loss - float(loss)) <= tol * abs(float(loss))
        assert abs(res.grad_norm - norm) <= 10 * tol * norm
        u, st = ref_tx.update(g, st, ad)
        ad = optax.apply_updates(ad, u)
    assert eng.count == 5
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree_util.tree_leaves(eng.adapters),
                                                              jax.tree_util.tree_leaves(ad)))
    if compute == "float32":  # bf16: the same path, rounded differently (losses checked above)
        assert diff < 2e-5, diff
    eng.close()


def test_forward_only_passes_see_the_whole_adapters():
    """Evaluation (``evaluate.ForwardPass``) and the reference log-probabilities (``reference_logps.forward_logps``)
    of a LoRA run: through the frozen ends' head and, with adapter dropout, the blocks without it; each equals the
    in-memory LoRA model's per-token cross-entropy."""
    from megatrain_jax.evaluate import ForwardPass
    from megatrain_jax.objectives import Objective
    from megatrain_jax.reference_logps import forward_logps

    cfg = tiny("llama", dropout=0.3, base_dtype="int8")
    store = FrozenStore.from_trees(streamed_parts(Decoder(dataclasses.replace(cfg, lora=None), 0)).host_trees(), "int8")
    plain = LoraModel(dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, dropout=0.0)))
    ad = nonzero_b(plain.init_adapters(0))
    eng = LoraEngine(LoraModel(cfg), store, optax.sgd(0.0), adapters=ad, compute_dtype="float32", micro_batches=2,
                     loss_chunk=16)
    rs = np.random.default_rng(1)
    toks = rs.integers(0, 64, (4, 17))
    mask = (rs.random((4, 16)) < 0.7).astype(np.float32)
    b = Batch(toks[:, :-1], toks[:, 1:], mask)
    got = ForwardPass(eng).run(b)
    for r in range(4):
        one = reference_lora_loss(plain, store, "float32")(ad, jnp.asarray(b.tokens[r:r + 1]),
                                                            jnp.asarray(b.labels[r:r + 1]), jnp.asarray(mask[r:r + 1]),
                                                            0, 0)
        np.testing.assert_allclose(got.nll[r], float(one) * mask[r].sum(), rtol=1e-4, atol=1e-5)
    eng.kernels.objective = Objective("dpo", 0.1, 0.0, 0.0, 0.0)
    np.testing.assert_allclose(forward_logps(eng, b), got.logprobs, rtol=1e-4, atol=1e-5)
    eng.close()


def test_nonfinite_step_is_skipped():
    cfg = tiny("llama")
    store = FrozenStore.from_trees(streamed_parts(Decoder(dataclasses.replace(cfg, lora=None), 0)).host_trees(),
                                   "float32")
    eng = LoraEngine(LoraModel(cfg), store, optax.adamw(1e-3), compute_dtype="float32")
    before = eng.adapters_host()
    toks = np.random.default_rng(0).integers(0, 64, (2, 9))
    with eng.nan_forward():
        res = eng.step(Batch(toks[:, :-1], toks[:, 1:]))
    assert res.skipped and eng.count == 0
    for a, b in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(eng.adapters_host())):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------- int8 base


def test_int8_round_trip_within_stated_error():
    """Per output channel: |W - dequant(quant(W))| <= max|W[:, j]| / 254 (half a step of 127 levels);
    vectors (norm scales, biases) and the embedding/head exactly as bf16 / fp32."""
    cfg = tiny("qwen2")
    trees = streamed_parts(Decoder(dataclasses.replace(cfg, lora=None), 0)).host_trees()
    store = FrozenStore.from_trees(trees, "int8")
    assert store["embed"].dtype == "bfloat16" and store["block_0"].dtype == "int8"
    for name in ("block_0", "block_1"):
        back = store[name].tree()
        for w, q in zip(jax.tree_util.tree_leaves(trees[name]), jax.tree_util.tree_leaves(back)):
            w = np.asarray(w, np.float32)
            if w.ndim < 2:
                np.testing.assert_array_equal(w, q)
                continue
            bound = np.abs(w).max(axis=-2, keepdims=True) / 254 * (1 + 1e-6)
            assert np.all(np.abs(w - q) <= bound)
    g = store["block_0"]
    assert g.nbytes < 0.3 * 4 * g.layout.size + 4096  # about 1 byte per parameter (plus scales)
    # the device's dequantisation is the host's
    dev = g.dequantise(tuple(jnp.asarray(b) for b in g.buffers()), jnp.float32)
    for a, b in zip(jax.tree_util.tree_leaves(dev), jax.tree_util.tree_leaves(g.tree())):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------- config


@pytest.mark.parametrize("override,field", [
    ("model.lora.rank=0", "model.lora.rank"), ("model.lora.alpha=-1", "model.lora.alpha"),
    ("model.lora.dropout=1.5", "model.lora.dropout"), ("model.lora.targets=[q,x]", "model.lora.targets"),
    ("model.lora.base_dtype=fp8", "model.lora.base_dtype"), ("model.lora.bogus=1", "model.lora.bogus")])
def test_config_errors(override, field):
    with pytest.raises(UserError) as e:
        load_config(str(ROOT / "configs" / "tiny.yaml"), [override])
    assert e.value.field == field


def test_config_refuses_expert_targets():
    with pytest.raises(UserError) as e:
        load_config(str(ROOT / "configs" / "tiny.yaml"),
                    ["model.family=mixtral", "model.num_experts=4", "model.experts_per_token=2", "model.lora.rank=4"])
    assert e.value.field == "model.lora.targets"


def test_plan_scaling_is_refused(capsys):
    """LoRA data parallel (tests/test_lora_dp.py) has no multi-GPU prediction: ``plan --scaling`` is refused."""
    from megatrain_jax.cli import main as cli_main

    assert load_config(str(ROOT / "configs" / "lora-tiny.yaml"), ["train.devices=2"]).train.devices == 2
    assert cli_main(["plan", str(ROOT / "configs" / "lora-tiny.yaml"), "--scaling"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--scaling" in err


def test_a_sharded_host_state_is_refused(capsys):
    """A sharded host state is for full training (each process backs its GPUs' shares of the master and moments);
    LoRA's frozen base streams whole: ``train.host_state=sharded`` is refused in one line naming the field."""
    from megatrain_jax.cli import main as cli_main

    assert cli_main(["plan", str(ROOT / "configs" / "lora-tiny.yaml"), "--set", "train.host_state=sharded"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "train.host_state" in err and "replicated" in err


# ---------------------------------------------------------------------------------------- the training loop


def test_train_resume_exact_and_export(tmp_path):
    """``train()`` with model.lora: 6 steps = 3 steps, checkpoint, ``--resume`` to 6 (adapters bit for bit, in
    the exported PEFT directory); the checkpoint holds a PEFT adapter and its optimizer state."""
    from safetensors.numpy import load_file

    from megatrain_jax.train import train

    common = ["optim.schedule.warmup_steps=2", "train.batch_size=4", "data.seq_len=32", "model.num_layers=2",
              "train.log_every=100"]
    cfg = lambda *o: load_config(str(ROOT / "configs" / "lora-tiny.yaml"), common + list(o))  # noqa: E731
    quiet = lambda _: None  # noqa: E731
    a = train(cfg(f"train.out_dir={tmp_path}/a", "train.steps=6", f"train.export={tmp_path}/a_x"), log=quiet)
    train(cfg(f"train.out_dir={tmp_path}/b", "train.steps=3"), log=quiet)
    ck3 = tmp_path / "b" / "checkpoints" / "step_00000003"
    assert (ck3 / "adapter" / "adapter_config.json").is_file() and (ck3 / "opt_state.npz").is_file()
    c = train(cfg(f"train.out_dir={tmp_path}/b", "train.steps=6", f"train.export={tmp_path}/b_x"), resume=True,
              log=quiet)
    assert c["resumed_from"] == 3 and c["last_loss"] == a["last_loss"]
    x, y = load_file(f"{tmp_path}/a_x/adapter_model.safetensors"), load_file(f"{tmp_path}/b_x/adapter_model.safetensors")
    assert set(x) == set(y) and len(x) == 2 * 7 * 2
    for k in x:
        np.testing.assert_array_equal(x[k], y[k])
    from megatrain_jax.cli import main as cli_main  # the run merged into its base: a plain HF directory

    assert cli_main(["export", f"{tmp_path}/b", f"{tmp_path}/m", "--merge-lora", "--dtype", "float32"]) == 0
    merged = load_file(f"{tmp_path}/m/model.safetensors")
    assert "model.layers.1.mlp.down_proj.weight" in merged and not any("lora" in k for k in merged)


def test_a_config_run_is_the_one_lora_run(tmp_path):
    """``Trainer.from_config`` with model.lora runs ``LoraRun`` (as ``Trainer(model, lora=)`` does): saved by the one
    saver (the PEFT pair and the optimizer state) and restored in place, exactly."""
    from megatrain_jax import checkpoint as ck
    from megatrain_jax.lora_trainer import LoraRun
    from megatrain_jax.trainer import Trainer

    cfg = load_config(str(ROOT / "configs" / "lora-tiny.yaml"),
                      ["optim.schedule.warmup_steps=1", "train.batch_size=4", "data.seq_len=32", "model.num_layers=2",
                       "train.steps=3"])
    tr = Trainer.from_config(cfg)
    saver = tr.saver(str(tmp_path / "s"))
    assert isinstance(tr.run, LoraRun) and isinstance(saver, ck.CheckpointSaver)
    saver.close()
    rng = np.random.default_rng(0)
    tr.step(rng.integers(0, cfg.model.vocab_size, (4, 33), dtype=np.int32))
    path = tr.save(str(tmp_path / "ck"))
    assert os.path.isfile(os.path.join(path, "adapter", "adapter_config.json"))
    saved = tr.adapters()
    tr.step(rng.integers(0, cfg.model.vocab_size, (4, 33), dtype=np.int32))
    assert tr.restore(str(tmp_path / "ck"))["count"] == 1 and tr.step_count == 1
    jax.tree.map(np.testing.assert_array_equal, tr.adapters(), saved)
    tr.close()


@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
def test_fast_init_base(dtype):
    """``model.init: fast`` fills the frozen base group by group: matrices with the configured std, norm scales 1."""
    model = LoraModel(tiny("llama"))
    store = FrozenStore(model.layouts, dtype)
    store.fill_fast(0, 0.02)
    tree = store["block_1"].tree()
    assert abs(float(np.std(tree["mlp"]["up_proj"]["kernel"])) - 0.02) < 0.002
    np.testing.assert_array_equal(tree["input_layernorm"]["scale"], 1.0)


def test_cli_plan_70b_int8_fits_bf16_refused(capsys):
    """``megatrain-jax plan`` on the LoRA config: a Llama-2-70B int8 base fits an 80 GB GPU and 128 GiB host;
    the same base in bf16 (140 GB) is refused with the one-line host-memory error (``cli.main``, in-process)."""
    from cli_runner import run_in_process

    cmd = ["plan", str(ROOT / "configs" / "lora-llama2-70b-int8.yaml"), "--gpu-memory-gb", "80",
           "--host-memory-gb", "137.4"]
    ok = run_in_process(cmd, capsys)
    assert ok.rc == 0, ok.stderr[-2000:]
    assert "frozen base (int8" in ok.stdout and "micro_batches=" in ok.stdout
    bad = run_in_process(cmd + ["--set", "model.lora.base_dtype=bfloat16"], capsys)
    assert bad.rc == 2 and "host memory" in bad.stderr and "base_dtype=int8" in bad.stderr