"""Import: a ``transformers`` checkpoint directory (``config.json`` plus one ``model.safetensors`` or
shards listed in ``model.safetensors.index.json``) read straight into the host store. The store is
allocated from the model's abstract structure and filled tensor by tensor, so host memory peaks at
the store plus one tensor, never a second copy of the model. Hugging Face ``Linear`` weights are
``(out, in)``, our kernels ``(in, out)``: projections are transposed on the way in."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatrain_jax.config import ModelConfig
from megatrain_jax.errors import UserError
from megatrain_jax.families import get_family as family_of_name
from megatrain_jax.hf.config import Log, architecture, family_of, read_hf_config, read_json, \
    resolve_hf_model_config, say, warn
from megatrain_jax.hf.mxfp4 import Mxfp4Tensor, mxfp4_tensor
from megatrain_jax.hf.names import hf_tensors, interleaved_part, model_layouts
from megatrain_jax.hf.safetensors_io import ST_DTYPES, TensorInfo, copy_cast, read_safetensors_header, read_tensor

INDEX = "model.safetensors.index.json"


def index_checkpoint(hf_dir: str) -> dict[str, TensorInfo]:
    """Every tensor of a checkpoint directory, from the (small) headers of its safetensors files."""
    index_path = os.path.join(hf_dir, INDEX)
    if os.path.isfile(index_path):
        weight_map = read_json(index_path, "model.from_hf").get("weight_map") or {}
        files = list(dict.fromkeys(weight_map.values()))
    elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        weight_map, files = None, ["model.safetensors"]
    else:
        weight_map, files = None, sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    if not files:
        has_bin = any(f.endswith(".bin") or f.endswith(".pt") for f in os.listdir(hf_dir))
        raise UserError("model.from_hf", f"no *.safetensors weights in {hf_dir}"
                        + (" (only PyTorch .bin files)" if has_bin else ""),
                        "save the model with transformers' save_pretrained(safe_serialization=True)")
    tensors: dict[str, TensorInfo] = {}
    for fname in files:
        path = os.path.join(hf_dir, fname)
        if not os.path.isfile(path):
            raise UserError("model.from_hf", f"{INDEX} lists {fname}, which is missing from {hf_dir}",
                            "download the complete checkpoint")
        infos, _ = read_safetensors_header(path)
        for name, info in infos.items():
            tensors.setdefault(name, info)
    if weight_map is not None:
        for name, fname in weight_map.items():
            if name not in tensors:
                raise UserError("model.from_hf", f"tensor {name} is listed in {INDEX} but not in {fname}",
                                "download the checkpoint again")
    return tensors


@dataclass
class _Item:
    group: str
    leaf: Any  # templates.Leaf
    info: TensorInfo
    transpose: bool
    index: int | None = None  # a slice along axis 0 of a stacked leaf (hf_tensors)
    part: tuple[int, int] | None = None  # (k, n): the leaf is the tensor's [..., k::n] (hf_tensors)


def plan_import(layouts: dict, tensors: dict[str, TensorInfo], cfg: ModelConfig, hf_dir: str) -> list[_Item]:
    """Match every leaf of the store with a checkpoint tensor; check names, shapes, dtypes up front.
    Public: hf/mt.py and the LoRA loader/exporter plan their reads with it."""
    plan, used = [], set()
    for group, layout in layouts.items():
        for leaf, (name, transpose, index, want) in ((lf, t) for lf in layout.leaves
                                                      for t in hf_tensors(group, lf.path, lf.shape, cfg.family)):
            part = interleaved_part(name)
            name = part[0] if part else name
            info = tensors.get(name) or mxfp4_tensor(name, tensors)  # MXFP4: the *_blocks and *_scales pair
            if info is None:
                hint = " (config.json says tie_word_embeddings is false)" if name == "lm_head.weight" else ""
                raise UserError("model.from_hf", f"tensor {name} is missing from the checkpoint in {hf_dir}{hint}",
                                "use a complete checkpoint whose config.json matches its weights")
            if info.shape != want:
                raise UserError("model.from_hf", f"tensor {name} has shape {list(info.shape)}, config.json implies {list(want)}",
                                "use a checkpoint whose config.json matches its weights")
            if info.dtype not in ST_DTYPES and not isinstance(info, Mxfp4Tensor):
                raise UserError("model.from_hf", f"tensor {name} has dtype {info.dtype}",
                                "use a checkpoint in bfloat16, float16 or float32 (or gpt-oss's MXFP4 experts)")
            plan.append(_Item(group, leaf, info, transpose, index, part[1:] if part else None))
            used.update(info.sources if isinstance(info, Mxfp4Tensor) else (name,))
    fam = family_of_name(cfg.family)
    ignored = [n for n in tensors if n not in used and not n.endswith("rotary_emb.inv_freq")
               and not (n == "lm_head.weight" and cfg.tie_embeddings) and not fam.drops_tensor(n, cfg)]
    if ignored:
        warn(f"model.from_hf: {len(ignored)} tensors of the checkpoint are not used by the model: "
              f"{', '.join(sorted(ignored)[:5])}{' ...' if len(ignored) > 5 else ''}")
    return plan


def load_item(f, item: _Item, master: np.ndarray) -> None:
    """One planned tensor (``plan_import``) from its open file into the flat store ``master``, cast to
    float32 and transposed as planned. Public: hf/mt.py and the LoRA loader/exporter load with it."""
    leaf, info = item.leaf, item.info
    dst = master[leaf.offset:leaf.offset + leaf.size]
    if item.index is not None:  # one slice of a stacked leaf (contiguous: the leading axis)
        dst = dst.reshape(leaf.shape)[item.index].reshape(-1)
    if isinstance(info, Mxfp4Tensor):  # dequantized exactly into fp32 (only the part's columns)
        src = info.read(f, item.part)
    elif info.dtype == "F32" and not item.transpose and item.part is None:
        read_tensor(f, info, dst)  # straight from disk into the store
        return
    else:
        src = read_tensor(f, info)  # the one temporary: a single tensor in its file dtype
        if item.part is not None:
            src = src[..., item.part[0]::item.part[1]]
    src = src.T if item.transpose else src
    copy_cast(dst.reshape(src.shape), src)


class OpenFiles:
    """Open checkpoint files, one handle each, closed together.
    Public: hf/mt.py and the LoRA loader/exporter read checkpoint tensors through it."""

    def __init__(self):
        self.handles: dict[str, Any] = {}

    def get(self, path: str):
        if path not in self.handles:
            self.handles[path] = open(path, "rb", buffering=0)
        return self.handles[path]

    def close(self) -> None:
        for f in self.handles.values():
            f.close()
        self.handles.clear()


def load_hf_into_store(model_cfg: ModelConfig, bf16_stream: bool, *, seq_len: int | None = None, log: Log = print):
    """Read ``model_cfg.from_hf`` into a new host store; returns ``(parts, store)``.

    ``model_cfg``'s architecture fields are overwritten from the checkpoint's ``config.json``
    (see ``resolve_hf_model_config``). Files are read shard by shard, tensor by tensor, straight into
    the store's fp32 master (bf16/fp16 upcast exactly); each group's bf16 streaming copy is made once
    the group is complete. ``seq_len`` (the training length) only words the family's log lines
    (e.g. about a sliding window longer than the sequences).
    """
    from megatrain_jax.hoststore import HostStore

    if not model_cfg.from_hf:
        raise UserError("model.from_hf", "is not set", "point it at a Hugging Face model directory")
    resolve_hf_model_config(model_cfg)  # a Hub id becomes its snapshot directory here
    hf_dir = model_cfg.from_hf
    hf = read_hf_config(hf_dir)
    family_of(architecture(hf, "config.json")).on_import(hf, model_cfg, seq_len, lambda msg: say(log, msg))
    tensors = index_checkpoint(hf_dir)
    parts, layouts = model_layouts(model_cfg)
    plan = plan_import(layouts, tensors, model_cfg, hf_dir)  # every check before allocating anything
    store = HostStore(layouts, bf16_stream)
    remaining = {g: sum(1 for i in plan if i.group == g) for g in layouts}
    by_file: dict[str, list[_Item]] = {}
    for item in plan:
        by_file.setdefault(item.info.path, []).append(item)
    start = time.perf_counter()
    total = sum(i.info.nbytes for i in plan)
    done = 0
    for k, (path, items) in enumerate(by_file.items(), 1):
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            for item in sorted(items, key=lambda i: i.info.start):  # sequential reads
                load_item(f, item, store[item.group].master)
                remaining[item.group] -= 1
                if remaining[item.group] == 0:
                    store[item.group].sync_stream()
        nbytes = sum(i.info.nbytes for i in items)
        done += nbytes
        dt = time.perf_counter() - t0
        say(log, f"hf import: shard {k}/{len(by_file)} {os.path.basename(path)}: {nbytes / 1e9:.2f} GB in {dt:.1f}s "
                  f"({nbytes / 1e9 / max(dt, 1e-9):.2f} GB/s; {done / max(total, 1):.0%} done)")
    say(log, f"hf import: {store.num_params() / 1e6:.1f}M parameters from {hf_dir} in {time.perf_counter() - start:.1f}s")
    return parts, store


def model_from_store(store, cfg: ModelConfig):
    """The whole decoder NNX module (on the default device) with the store's fp32 master weights."""
    import jax.numpy as jnp
    from flax import nnx

    from megatrain_jax.models.common import abstract_model

    graphdef, state = nnx.split(abstract_model(cfg))
    tree = {"embed": store["embed"].tree(), "head": store["head"].tree(),
            "layers": {i: store[f"block_{i}"].tree() for i in range(cfg.num_layers)}}
    nnx.replace_by_pure_dict(state, {k: _map(jnp.asarray, v) for k, v in tree.items()})
    return nnx.merge(graphdef, state)


def _map(fn, tree):
    import jax

    return jax.tree_util.tree_map(fn, tree)


