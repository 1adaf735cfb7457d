"""Export: a ``transformers`` checkpoint (safetensors shards + index + ``config.json`` that
``from_pretrained`` loads unchanged), written tensor by tensor from the fp32 master (kernels
transposed back to ``(out, in)``), one temporary tensor at a time."""
from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Iterable

import ml_dtypes
import numpy as np

from megatrain_jax.atomic import check_output, output_dir
from megatrain_jax.config import ModelConfig
from megatrain_jax.errors import UserError
from megatrain_jax.families import get_family
from megatrain_jax.hf.config import Log, family_of, read_hf_config, say, supported
from megatrain_jax.hf.config import architecture as hf_architecture
from megatrain_jax.hf.importer import INDEX
from megatrain_jax.hf.names import hf_tensors, interleaved_part, model_layouts
from megatrain_jax.hf.safetensors_io import SafetensorsWriter, copy_cast

SHARD_BYTES = 5 * 10**9  # like transformers' "5GB" max_shard_size
OTHER_KIND_HINT = "choose a new directory (an mt directory is replaced only by `export --format mt` or `convert hf-to-mt`)"


def one_group_at_a_time(layouts: dict, fill: Callable[[str, np.ndarray], None]) -> "_Source":
    """A source that materialises one group's flat fp32 buffer at a time (``fill(name, flat)``)."""
    cache: dict[str, np.ndarray] = {}

    def get(name: str) -> np.ndarray:
        if name not in cache:
            cache.clear()
            flat = np.empty(layouts[name].size, np.float32)
            fill(name, flat)
            cache[name] = flat
        return cache[name]

    return _Source(layouts, get, lambda name: cache.pop(name, None))


class _Source:
    """What an export reads: ``leaf(group, leaf) -> fp32 array`` in our (in, out) layout."""

    def __init__(self, layouts: dict, getter: Callable[[str], np.ndarray], release: Callable[[str], None] = lambda g: None):
        self.layouts, self._get, self.release = layouts, getter, release

    def leaf(self, group: str, leaf) -> np.ndarray:
        flat = self._get(group)
        return flat[leaf.offset:leaf.offset + leaf.size].reshape(leaf.shape)


def _source(obj: Any) -> _Source:
    from megatrain_jax.hoststore import HostStore
    from megatrain_jax.templates import Layout

    if isinstance(obj, _Source):
        return obj
    if isinstance(obj, HostStore):
        return _Source({g.name: g.layout for g in obj}, lambda name: obj[name].master)
    if hasattr(obj, "embed") and hasattr(obj, "layers") and hasattr(obj, "head"):  # a Llama module
        from flax import nnx

        trees = {"embed": nnx.to_pure_dict(nnx.state(obj.embed))}
        trees.update({f"block_{i}": nnx.to_pure_dict(nnx.state(b)) for i, b in enumerate(obj.layers)})
        trees["head"] = nnx.to_pure_dict(nnx.state(obj.head))
        obj = trees
    if isinstance(obj, dict):
        layouts = {name: Layout(tree) for name, tree in obj.items()}
        return one_group_at_a_time(layouts, lambda name, flat: layouts[name].flatten_into(obj[name], flat))
    raise TypeError(f"cannot export a {type(obj).__name__}: give a HostStore, a Llama module or group trees")


def _hf_config_out(cfg: ModelConfig, arch: str, dtype: str, base: dict | None) -> dict:
    """config.json for ``transformers``: the checkpoint's own extra fields (when it came from one),
    then our architecture fields; RoPE in both the transformers 4 and 5 spellings."""
    keep = {}
    if base and hf_architecture(base, "base config") == arch:
        keep = {k: v for k, v in base.items() if k not in (
            "rope_parameters", "rope_scaling", "rope_theta", "dtype", "torch_dtype", "transformers_version",
            "layer_types", "head_dim", "architectures", "model_type", "quantization_config", "auto_map", "_name_or_path")}
    out = {
        "architectures": [arch], "model_type": supported()[arch],
        "bos_token_id": None, "eos_token_id": None, "max_position_embeddings": 4096,
        "initializer_range": cfg.init_std, "use_cache": True, "attention_dropout": 0.0,
        **keep, "torch_dtype": dtype, "dtype": dtype,
    }
    family_of(arch).to_hf_config(cfg, arch, out)  # the family's keys (hf.config.base_to_hf's and its own)
    if out.get("max_position_embeddings") is None:
        out["max_position_embeddings"] = 4096
    return out


def _join_interleaved(entries: list) -> list:
    """Entries of the leaves that are interleaved parts of one tensor (``name[k::n]``, hf/names.py)
    become one entry, at the first part's place, whose leaf is the list of (leaf, k, n)."""
    out, at = [], {}
    for e in entries:
        part = interleaved_part(e[0])
        if part is None:
            out.append(e)
            continue
        base, k, n = part
        if base not in at:
            at[base] = len(out)
            out.append((base, e[1], [], False, e[4], None))
        out[at[base]][2].append((e[2], k, n))
    for i in at.values():
        parts = out[i][2]
        if sorted(k for _, k, _ in parts) != list(range(parts[0][2])):
            raise ValueError(f"{out[i][0]}: interleaved parts {[k for _, k, _ in parts]} do not cover the tensor")
    return out


def export_hf(source: Any, model_cfg: ModelConfig, out_dir: str, dtype: str = "bfloat16",
              architecture: str | None = None, *, hf_config: dict | None = None,
              max_shard_bytes: int = SHARD_BYTES, overwrite: bool = False, sources: Iterable[str] = (),
              own_run: str | None = None, log: Log = print) -> str:
    """Write a ``transformers`` checkpoint (safetensors shards + index + config.json) to ``out_dir``.

    ``source``: a ``HostStore`` (its fp32 master), a ``Llama`` module, or group trees
    (``{"embed": ..., "block_0": ..., "head": ...}``). Tensors are converted and written one at a
    time, into a temporary directory renamed to ``out_dir`` at the end. ``architecture`` defaults
    to the source checkpoint's (``hf_config`` or ``model_cfg.from_hf``), else ``Qwen2ForCausalLM``
    with q/k/v biases and ``LlamaForCausalLM`` without. ``out_dir`` obeys ``atomic.check_output``
    (never a training run or the ``sources``; ``overwrite`` replaces only an earlier Hugging Face
    export; ``own_run``: the training run writing it, inside which it may lie). Returns ``out_dir``.
    """
    if dtype not in ("bfloat16", "float32", "float16"):
        raise UserError("dtype", f"{dtype!r} is not an export dtype", "use bfloat16 or float32")
    out_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    sources = list(sources)  # the one rule (atomic.check_place) before anything is read
    check_output(out_dir, "hf", sources=sources, overwrite=overwrite, other=OTHER_KIND_HINT, own_run=own_run)
    if hf_config is None and model_cfg.from_hf and os.path.isfile(os.path.join(model_cfg.from_hf, "config.json")):
        hf_config = read_hf_config(model_cfg.from_hf)
    family = get_family(model_cfg.family)
    if architecture is None and hf_config:
        architecture = hf_architecture(hf_config, "hf_config")
        if architecture not in family.architectures:  # the source was another family: ours decides
            architecture = None
    if architecture is None:
        architecture = family.export_architecture(model_cfg)
    if architecture not in supported():
        raise UserError("architecture", f"{architecture!r} is not supported", f"use one of: {', '.join(supported())}")
    if architecture not in family.architectures:
        raise UserError("architecture", f"{architecture} is not an architecture of the model's family "
                        f"{model_cfg.family!r}", f"use one of: {', '.join(family.architectures)}")
    family.check_export(model_cfg, architecture)
    src = _source(source)
    _, layouts = model_layouts(model_cfg)
    for name, layout in layouts.items():
        have = src.layouts.get(name)
        if have is None or have.signature() != layout.signature():
            raise UserError("model", f"the weights' group {name} does not match the model config",
                            "export with the ModelConfig the weights were made with")

    # plan: (hf name, group, leaf or None for a zero bias, transposed, hf shape, slice index), grouped in order
    entries = []
    for group, layout in layouts.items():
        for leaf in layout.leaves:
            for name, transpose, index, shape in hf_tensors(group, leaf.path, leaf.shape, model_cfg.family):
                entries.append((name, group, leaf, transpose, shape, index))
        if group.startswith("block_"):  # tensors the format has, we not
            for name, shape in family.export_extras(model_cfg, architecture, int(group[6:])):
                entries.append((name, group, None, False, shape, None))
    entries = _join_interleaved(entries)
    shards: list[list] = [[]]
    size = 0
    for e in entries:
        nbytes = int(np.prod(e[4], dtype=np.int64)) * out_dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += nbytes
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]

    start = time.perf_counter()
    weight_map, total = {}, 0
    with output_dir(out_dir, "hf", sources=sources, overwrite=overwrite, own_run=own_run) as tmp:
        for k, (fname, shard) in enumerate(zip(names, shards), 1):
            t0 = time.perf_counter()
            spec = [(e[0], out_dtype, e[4]) for e in shard]
            with SafetensorsWriter(os.path.join(tmp, fname), spec, {"format": "pt"}) as w:
                last_group = None
                for name, group, leaf, transpose, shape, index in shard:
                    if last_group is not None and group != last_group:
                        src.release(last_group)
                    last_group = group
                    if leaf is None:
                        w.write(name, np.zeros(shape, out_dtype))
                        continue
                    if isinstance(leaf, list):  # interleaved parts of one tensor
                        out = np.empty(shape, out_dtype)
                        for part, k, step in leaf:
                            np.copyto(out[..., k::step], src.leaf(group, part), casting="unsafe")
                        w.write(name, out)
                        weight_map[name] = fname
                        del out
                        continue
                    arr = src.leaf(group, leaf)
                    if index is not None:  # one slice of a stacked leaf
                        arr = arr[index]
                    if transpose:
                        out = np.empty(shape, out_dtype)  # the one temporary: a single tensor
                        copy_cast(out, arr.T)
                    elif arr.dtype != out_dtype:
                        out = arr.astype(out_dtype)
                    else:
                        out = arr
                    w.write(name, out)
                    del out
                    weight_map[name] = fname
            total += w.nbytes
            dt = time.perf_counter() - t0
            say(log, f"hf export: shard {k}/{n} {fname}: {w.nbytes / 1e9:.2f} GB in {dt:.1f}s "
                      f"({w.nbytes / 1e9 / max(dt, 1e-9):.2f} GB/s)")
        if n > 1:
            with open(os.path.join(tmp, INDEX), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(_hf_config_out(model_cfg, architecture, dtype, hf_config), f, indent=2, sort_keys=True)
    say(log, f"hf export: {architecture} ({dtype}, {n} shard{'s' if n > 1 else ''}, {total / 1e9:.2f} GB) "
              f"to {out_dir} in {time.perf_counter() - start:.1f}s")
    return out_dir


