"""LoRA data parallel over several local devices (``LoraEngine(devices=...)``, ``Trainer(..., lora=, devices=)``):
2 devices train what one device trains on the same global batch (fp32, clipping on every step; losses,
norms and adapters within 1e-5). Runs in a child process: a CPU backend's device count is fixed when it starts."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from cli_runner import cpu_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(out: str) -> None:
    import dataclasses

    import jax
    import optax

    from megatrain_jax.engine.lora import LoraEngine, LoraModel
    from megatrain_jax.engine.lora_base import FrozenStore
    from megatrain_jax.engine.step import Batch
    from megatrain_jax.models.common import Decoder, streamed_parts
    from tests.test_lora import nonzero_b, tiny

    assert len(jax.devices()) == 2
    cfg = tiny("qwen2", layers=2, dropout=0.1, base_dtype="int8")
    trees = streamed_parts(Decoder(dataclasses.replace(cfg, lora=None), 0)).host_trees()
    model = LoraModel(cfg)
    ad0 = nonzero_b(model.init_adapters(0))
    res = {}
    for name, devs, micro in (("one", jax.devices()[:1], 2), ("two", jax.devices(), 2)):
        eng = LoraEngine(model, FrozenStore.from_trees(trees, "int8"), optax.adamw(1e-3, weight_decay=0.01),
                         adapters=ad0, compute_dtype="float32", micro_batches=micro, clip_norm=0.05, loss_chunk=16,
                         devices=devs)
        rs = np.random.default_rng(0)
        steps = []
        for _ in range(3):
            toks = rs.integers(0, 64, (4, 17))
            steps.append(eng.step(Batch(toks[:, :-1], toks[:, 1:])))
        res[f"loss_{name}"] = [r.loss for r in steps]
        res[f"norm_{name}"] = [r.grad_norm for r in steps]
        res[f"ad_{name}"] = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(eng.adapters_host())])
        assert len(jax.tree_util.tree_leaves(eng.adapters)[0].devices()) == len(devs)
        eng.close()
    # the same through `megatrain-jax train` (train.devices), dropout on, 2 micro-batches
    from megatrain_jax.config import load_config
    from megatrain_jax.train import train

    common = ["train.batch_size=4", "train.micro_batches=2", "data.seq_len=32", "model.num_layers=2",
              "train.steps=3", "train.log_every=100", "optim.schedule.warmup_steps=1", "model.lora.dropout=0.1",
              "train.final_checkpoint=false"]
    for n in (1, 2):
        cfg = load_config(os.path.join(ROOT, "configs", "lora-tiny.yaml"),
                          common + [f"train.devices={n}", f"train.out_dir={out}.run{n}"])
        res[f"train_{n}"] = _losses(cfg, train)
    np.savez(out, **res)


def _losses(cfg, train) -> list[float]:
    import json

    train(cfg, log=lambda _: None)
    with open(os.path.join(cfg.train.out_dir, "metrics.jsonl")) as f:
        return [json.loads(x)["loss"] for x in f]


@pytest.mark.slow  # a child process compiling the engine four times (~30 s idle CPU)
def test_two_devices_train_what_one_trains(tmp_path):
    out = tmp_path / "dp.npz"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_xla_flags(2), PYTHONPATH=ROOT)  # -O0 as conftest's
    r = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    z = np.load(out)
    # each micro-batch of 2 sequences split over the 2 devices; int8 base, adapter dropout (the same masks)
    np.testing.assert_allclose(z["loss_two"], z["loss_one"], rtol=1e-5)
    np.testing.assert_allclose(z["norm_two"], z["norm_one"], rtol=1e-5)
    assert np.linalg.norm(z["ad_two"] - z["ad_one"]) / np.linalg.norm(z["ad_one"]) < 1e-5
    assert z["norm_one"].min() > 0.05  # clipping on every step
    np.testing.assert_allclose(z["train_2"], z["train_1"], rtol=1e-5)  # megatrain-jax train, train.devices=2
    assert len(z["train_2"]) == 3


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    worker(sys.argv[1])
