"""Merged export of a LoRA run (``megatrain-jax export CHECKPOINT OUT --merge-lora``): transformers loads the
directory alone and its logits equal peft's ``merge_and_unload()`` of the same adapter; the merged kernels
are the base's plus ``scale * A B``; a LoRA run exported without the flag is refused in one line."""
from __future__ import annotations

import dataclasses
import json
import subprocess
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from megatrain_jax.cli import main as cli_main
from megatrain_jax import checkpoint as ck
from megatrain_jax.lora_io import AdapterFiles, PeftAdapters
from megatrain_jax.hf.peft import save_peft
from megatrain_jax.models.common import Decoder
from megatrain_jax.models.lora import lora_decoder, split_lora

from tests.test_lora import _peft_python, nonzero_b, tiny
from tests.torch_reference import ROOT


def _lora_run(tmp_path, cfg, seed=0):
    """A LoRA checkpoint as ``megatrain-jax train`` writes it (``AdapterFiles``), of adapters with B != 0;
    returns (run dir, the adapters as one tree per layer)."""
    _, ad, _, _ = split_lora(lora_decoder(cfg, seed))
    layers = [jax.tree_util.tree_map(np.asarray, nonzero_b(ad)["layers"][i]) for i in range(cfg.num_layers)]
    engine = SimpleNamespace(adapters_host=lambda: layers, opt_state={"mu": np.zeros(3, np.float32)}, count=3)
    run = tmp_path / "run"
    saver = ck.CheckpointSaver(engine, str(run / "checkpoints"), files=AdapterFiles(engine, PeftAdapters(cfg)))
    saver.save(3, {"config": {"model": dataclasses.asdict(cfg), "train": {"seed": seed}}}, wait=True)
    return run, layers


def test_merged_kernels_are_base_plus_scaled_product(tmp_path):
    """A base from the config's initialisation (no from_hf): each merged kernel = the seed's kernel +
    (alpha / r) A B; every other weight is the base's, exactly (float32 export)."""
    cfg = tiny("qwen2", layers=2)
    run, layers = _lora_run(tmp_path, cfg, seed=5)
    out = tmp_path / "merged"
    assert cli_main(["export", str(run), str(out), "--merge-lora", "--dtype", "float32"]) == 0
    w = load_file(str(out / "model.safetensors"))
    base = nnx.to_pure_dict(nnx.state(Decoder(dataclasses.replace(cfg, lora=None), 5)))
    for i in range(2):
        q = base["layers"][i]["self_attn"]["q_proj"]
        ab = layers[i]["self_attn"]["q_proj"]
        want = np.asarray(q["kernel"]) + cfg.lora.scale * (ab["lora_a"].astype(np.float64) @ ab["lora_b"])
        np.testing.assert_allclose(w[f"model.layers.{i}.self_attn.q_proj.weight"], want.T, rtol=0, atol=1e-6)
        np.testing.assert_array_equal(w[f"model.layers.{i}.self_attn.q_proj.bias"], np.asarray(q["bias"]))
        np.testing.assert_array_equal(w[f"model.layers.{i}.input_layernorm.weight"],
                                      np.asarray(base["layers"][i]["input_layernorm"]["scale"]))
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]


def test_lora_run_without_merge_flag_is_refused(tmp_path, capsys):
    run, _ = _lora_run(tmp_path, tiny("llama"))
    assert cli_main(["export", str(run), str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--merge-lora" in err and "LoRA run" in err
    assert not (tmp_path / "x").exists()
    assert cli_main(["export", str(run), str(tmp_path / "y"), "--merge-lora", "--format", "mt"]) == 2


@pytest.mark.slow  # a transformers + peft subprocess (~20 s)
def test_merged_export_equals_peft_merge_and_unload(tmp_path):
    """From a Hugging Face base (model.from_hf): transformers loads the merged directory alone and its
    logits equal peft's merge_and_unload() of the same adapter over the same base, and our LoRA model's."""
    from megatrain_jax.hf.exporter import export_hf

    py, env = _peft_python()
    d = tmp_path / "case"
    plain = tiny("llama", layers=2)
    export_hf(Decoder(dataclasses.replace(plain, lora=None), 0), plain, str(d / "hf"), "float32", log=lambda _: None)
    cfg = dataclasses.replace(plain, from_hf=str(d / "hf"))
    run, layers = _lora_run(tmp_path, cfg)
    save_peft(str(d / "adapter"), layers, cfg, str(d / "hf"))
    assert cli_main(["export", str(run), str(d / "merged"), "--merge-lora", "--dtype", "float32"]) == 0
    tokens = np.random.default_rng(0).integers(0, 64, (2, 16))
    np.savez(d / "inputs.npz", tokens=tokens)
    r = subprocess.run([py, str(ROOT / "tests" / "lora_reference.py"), "--merged", str(d)], env=env,
                       capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-4000:]
    ref = np.load(d / "merged_ref.npz")
    scale = float(np.abs(ref["peft"]).max())
    assert np.abs(ref["merged"] - ref["peft"]).max() / scale < 1e-4
    graph, ad, rngs, rest = split_lora(lora_decoder(plain, 0))
    ad = {"layers": {i: layers[i] for i in range(2)}}
    ours = np.asarray(nnx.merge(graph, ad, rngs, rest)(jnp.asarray(tokens)))
    assert np.abs(ours - ref["merged"]).max() / scale < 1e-4
