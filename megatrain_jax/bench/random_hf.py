"""Random Llama-shaped Hugging Face checkpoints (``config.json`` + bf16 safetensors shards), written tensor by tensor
with the package's streaming writer: no torch, and never more than one tensor in memory (values are slices of one
random pool). ``experiments/bench_hf_io.py`` and ``experiments/finetune_hf.py`` time the import, training and export
of one; the tests fine-tune a toy-sized one."""
from __future__ import annotations

import json
import os
import shutil
from typing import Any

import ml_dtypes
import numpy as np

from megatrain_jax.errors import UserError
from megatrain_jax.hf import INDEX, SafetensorsWriter

GB = 1e9
LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-5, rope_theta=10000.0,
                 max_position_embeddings=4096, hidden_act="silu", tie_word_embeddings=False)


def hf_shapes(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    d = h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    out = [("model.embed_tokens.weight", (v, h))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
                (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                (p + "mlp.down_proj.weight", (h, f)), (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return out


def write_random_checkpoint(d: str, c: dict, shard_bytes: int, seed: int = 0) -> tuple[int, dict]:
    """bf16 shards written tensor by tensor; returns (bytes, {name: pool offset}) to check values later."""
    shapes = hf_shapes(c)
    largest = max(int(np.prod(s)) for _, s in shapes)
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(largest + largest // 4, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    shards, size = [[]], 0
    for name, shape in shapes:
        n = int(np.prod(shape)) * 2
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    k = len(shards)
    weight_map, offsets, total = {}, {}, 0
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{k:05d}.safetensors" if k > 1 else "model.safetensors"
        with SafetensorsWriter(os.path.join(d, fname), [(n, ml_dtypes.bfloat16, s) for n, s in shard], {"format": "pt"}) as w:
            for name, shape in shard:
                n = int(np.prod(shape))
                off = int(rng.integers(0, len(pool) - n + 1))
                w.write(name, pool[off:off + n].reshape(shape))
                offsets[name] = off
                weight_map[name] = fname
        total += w.nbytes
    if k > 1:
        with open(os.path.join(d, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
                   "bos_token_id": 1, "eos_token_id": 2, **c}, f, indent=2)
    check = {name: offsets[name] for name in ("model.layers.0.mlp.down_proj.weight", "lm_head.weight")}
    return total, {"pool": pool, "offsets": check}


def drop_from_page_cache(d: str) -> None:
    for f in os.listdir(d):
        fd = os.open(os.path.join(d, f), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def make_random_hf(out_dir: str, layers: int = 32, *, seed: int = 0, shard_gb: float = 5.0,
                   drop_cache: bool = True, **overrides: Any) -> dict:
    """A random Llama-2-7B-shaped checkpoint (``config.json`` + bf16 safetensors shards of at most
    ``shard_gb``, with an index when there are several) in ``out_dir``, written tensor by tensor by
    ``write_random_checkpoint`` (no torch). ``overrides`` replace config.json fields
    (e.g. ``hidden_size=64`` for a test). An existing checkpoint with the same config.json is
    reused. Returns ``{"bytes": ..., "reused": bool, "config": {...}}``."""
    c = dict(LLAMA2_7B, num_hidden_layers=layers, **overrides)
    cfg_path = os.path.join(out_dir, "config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            have = json.load(f)
        if all(have.get(k) == v for k, v in c.items()):
            nbytes = sum(os.path.getsize(os.path.join(out_dir, n)) for n in os.listdir(out_dir) if n.endswith(".safetensors"))
            if nbytes:
                return {"bytes": nbytes, "reused": True, "config": c}
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise UserError("--make-random-7b", f"{out_dir} exists and holds something other than this random checkpoint",
                        "give a new or empty directory (or remove it)")
    tmp = out_dir.rstrip("/") + f".tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        nbytes, check = write_random_checkpoint(tmp, c, int(shard_gb * GB), seed=seed)
        del check  # the writer's random pool (a few hundred MB at 7B): not kept
        if drop_cache:  # the import then reads from disk, as it would for a downloaded checkpoint
            drop_from_page_cache(tmp)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty (checked above)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"bytes": nbytes, "reused": False, "config": c}
