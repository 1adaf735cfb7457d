"""End to end: a random Hugging Face checkpoint is imported, fine-tuned on prepared prompt/response
data for 3 steps and exported, through ``megatrain_jax/bench/finetune.py`` (experiments/finetune_hf.py: ``train()`` on
``configs/finetune_hf.yaml``) and through the CLI on the same config."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from megatrain_jax import cli
from megatrain_jax.config import ModelConfig, load_config
from megatrain_jax.data import prepare_main
from megatrain_jax.bench import finetune as finetune_hf
from megatrain_jax.bench.random_hf import make_random_hf
from megatrain_jax.hf import index_checkpoint, load_hf_into_store

ROOT = Path(__file__).resolve().parents[1]

# a Llama-2-shaped model at toy size: 2 blocks, hidden 64, 4 heads of 16 (2 kv heads)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("ft")
    made = make_random_hf(str(d / "hf"), layers=2, drop_cache=False, **TINY)
    assert not made["reused"]
    again = make_random_hf(str(d / "hf"), layers=2, drop_cache=False, **TINY)
    assert again["reused"]  # same config.json: the checkpoint is reused, not rewritten
    rows = [{"prompt": f"Q{i}: what is {i} + {i}? ", "response": f"A: {2 * i}. " * 3} for i in range(40)]
    (d / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert prepare_main([str(d / "sft.jsonl"), "--out", str(d / "data" / "sft"), "--quiet"]) == 0
    return d


def _masters(hf_dir: str) -> dict[str, np.ndarray]:
    _, store = load_hf_into_store(ModelConfig(from_hf=hf_dir), bf16_stream=False, log=None)
    return {g.name: g.master.copy() for g in store}


def test_config_is_a_finetuning_config():
    cfg = load_config(str(ROOT / "configs" / "finetune_hf.yaml"))
    assert cfg.train.compute_dtype == "bfloat16" and cfg.train.export_dtype == "bfloat16"
    assert cfg.train.export == "runs/finetune_hf/export" and cfg.optim.clip_norm == 1.0
    assert cfg.optim.lr <= 1e-4 and cfg.optim.schedule.warmup_steps > 0 and cfg.model.from_hf


def test_import_train_export(tiny, tmp_path):
    hf_dir, export = str(tiny / "hf"), str(tmp_path / "export")
    r = finetune_hf.main(["--hf", hf_dir, "--data", str(tiny / "data" / "sft"), "--out", export,
                          "--run-dir", str(tmp_path / "run"), "--steps", "3", "--seq-len", "32", "--batch", "4",
                          "--micro", "2", "--lr", "1e-3", "--warmup", "1", "--json", str(tmp_path / "r.json")])
    assert [s["step"] for s in r["steps"]] == [1, 2, 3]
    assert all(math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]) for s in r["steps"])
    assert r["skipped_steps"] == 0 and r["model"]["layers"] == 2 and r["model"]["hidden_size"] == 64
    assert set(r["phases"]) >= {"setup", "import", "train", "export"}
    assert r["export_check"]["same_tensors_as_source"] and r["export_check"]["dtype"] == ["BF16"]
    assert json.loads((tmp_path / "r.json").read_text())["last_loss"] == r["last_loss"]
    assert not (tmp_path / "run" / "checkpoints").exists() or not os.listdir(tmp_path / "run" / "checkpoints")

    # the export loads back through the importer, and every group's weights moved
    before, after = _masters(hf_dir), _masters(export)
    assert before.keys() == after.keys()
    for name in before:
        assert np.isfinite(after[name]).all()
        assert not np.array_equal(before[name], after[name]), f"{name} did not change"
    rel = np.linalg.norm(after["block_0"] - before["block_0"]) / np.linalg.norm(before["block_0"])
    assert 1e-4 < rel < 0.5


def test_cli_on_the_same_config(tiny, tmp_path, capsys):
    export = tmp_path / "export"
    rc = cli.main(["train", str(ROOT / "configs" / "finetune_hf.yaml"), "--set", f"model.from_hf={tiny / 'hf'}",
                   "--set", f"data.path={tiny / 'data' / 'sft'}", "--set", "train.steps=2",
                   "--set", "optim.schedule.warmup_steps=1", "--set", "data.seq_len=32", "--set", "train.batch_size=2",
                   "--set", "train.micro_batches=1", "--set", f"train.out_dir={tmp_path / 'run'}",
                   "--set", f"train.export={export}"])
    assert rc == 0, capsys.readouterr().err
    assert sorted(index_checkpoint(str(export))) == sorted(index_checkpoint(str(tiny / "hf")))
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_hidden_layers"] == 2
