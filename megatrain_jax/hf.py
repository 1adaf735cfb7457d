"""Hugging Face import and export, and the ``megatrain-jax convert`` command.

Import (``load_hf_into_store``) reads a ``transformers`` checkpoint directory (``config.json`` plus
one ``model.safetensors`` or shards listed in ``model.safetensors.index.json``) straight into the
host store: the store is allocated from the model's *abstract* structure, then filled tensor by
tensor from the files, so host memory peaks at the store plus one tensor (never a second copy of
the model). Export (``export_hf``) is the mirror image: safetensors shards written tensor by tensor
from the fp32 master, plus a ``config.json`` that ``from_pretrained`` loads unchanged.

This module is generic: which architectures exist, how their ``config.json`` maps to a
``ModelConfig`` and back, and what their blocks look like live in the family modules
(``megatrain_jax/models/<family>.py``), found through the registry (``models/registry.py``) by
``architectures`` (else ``model_type``). Supported: ``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
``MistralForCausalLM`` (family ``llama``), ``Qwen3ForCausalLM``, ``Phi3ForCausalLM``,
``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``, ``MixtralForCausalLM``, ``Qwen3MoeForCausalLM`` (see
docs/families.md). Tensor names follow our module tree (``hf_name``); Hugging Face ``Linear``
weights are ``(out, in)``, our kernels are ``(in, out)``, so every projection is transposed on the
way in and out. A name with ``*`` (``hf_tensors``) marks a leaf stacked along its first axis that
the checkpoint holds as one tensor per slice (MoE experts: ``...experts.*.w1.weight``).

``model.from_hf`` wins over the YAML for the architecture fields (sizes, heads, RoPE, norms, tied
embeddings, biases): they are overwritten in place on the ``ModelConfig`` from ``config.json``, with
a warning for every value the user set explicitly that disagrees.

The safetensors files are read and written here directly (an 8-byte header length, a JSON header,
then raw little-endian data): that lets the importer read one tensor at a time into the store and
the exporter stream one tensor at a time to disk, with no whole-shard buffer in between, for bf16,
fp16 and fp32 alike.

The native ``mt`` format (``convert hf-to-mt`` / ``mt-to-hf``, ``save_mt`` / ``load_mt``) is a
directory holding ``model.yaml`` (the ``ModelConfig``), one ``<group>.safetensors`` per group
(``embed``, ``block_i``, ``head``) with that group's fp32 master tensors keyed by leaf path (the
file's data section is exactly the group's flat buffer), and, when it came from Hugging Face, the
original ``hf_config.json`` so that a later export keeps its extra fields (token ids, context length).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import struct
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import ml_dtypes
import numpy as np
import yaml

from megatrain_jax.config import ModelConfig
from megatrain_jax.errors import UserError

# ModelConfig fields that a Hugging Face config.json determines (from_hf wins over the YAML for these)
STRUCTURAL = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "intermediate_size", "rope_theta", "rope_scaling", "rms_norm_eps", "tie_embeddings", "qkv_bias",
              "sliding_window", "family", "layer_types", "attn_softcap", "final_softcap", "query_pre_attn_scalar",
              "rope_local_theta", "num_experts", "experts_per_token", "moe_intermediate_size", "norm_topk_prob",
              "mlp_only_layers", "router_aux_loss_coef")
SHARD_BYTES = 5 * 10**9  # like transformers' "5GB" max_shard_size
INDEX = "model.safetensors.index.json"

Log = Callable[[str], None] | None


class HFWarning(UserWarning):
    """A Hugging Face checkpoint detail that megatrain-jax handles differently (and says how)."""


def _warn(msg: str) -> None:
    warnings.warn(msg, HFWarning, stacklevel=3)


def _say(log: Log, msg: str) -> None:
    if log is not None:
        log(msg)


# ============================================================================ safetensors, streamed

_ST_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
              "BF16": np.dtype(ml_dtypes.bfloat16), "F64": np.dtype(np.float64)}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are in a safetensors file."""

    name: str
    path: str
    dtype: str  # safetensors name: F32, BF16, ...
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def read_safetensors_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The tensors listed in a safetensors file (name -> ``TensorInfo``) and its metadata."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise ValueError("file shorter than 8 bytes")
            (n,) = struct.unpack("<Q", head)
            if n > 100 * 2**20:
                raise ValueError(f"header of {n} bytes")
            header = json.loads(f.read(n))
            size = os.fstat(f.fileno()).st_size
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        raise UserError(path, f"is not a readable safetensors file ({e})",
                        "re-save the checkpoint with save_pretrained(safe_serialization=True)") from None
    meta = header.pop("__metadata__", None) or {}
    base = 8 + n
    out = {}
    for name, spec in header.items():
        begin, end = spec["data_offsets"]
        if base + end > size:
            raise UserError(path, f"tensor {name!r} runs past the end of the file (truncated download?)",
                            "download the checkpoint again")
        out[name] = TensorInfo(name, path, spec["dtype"], tuple(int(d) for d in spec["shape"]), base + begin, end - begin)
    return out, meta


def _read_exact(f, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise UserError(f.name, "ended early while reading a tensor (truncated file?)", "download the checkpoint again")
        got += n


def read_tensor(f, info: TensorInfo, out: np.ndarray | None = None) -> np.ndarray:
    """One tensor from an open file; read straight into ``out`` when given (same dtype, contiguous)."""
    dtype = _ST_DTYPES[info.dtype]
    if out is None:
        out = np.empty(info.shape, dtype)
    f.seek(info.start)
    _read_exact(f, memoryview(out.reshape(-1).view(np.uint8)))
    return out


class SafetensorsWriter:
    """Write one safetensors file tensor by tensor: the header first (names, dtypes, shapes are
    known up front), then each tensor's bytes in the declared order. One tensor in memory at a time."""

    def __init__(self, path: str, entries: list[tuple[str, Any, tuple[int, ...]]], metadata: dict[str, str] | None = None):
        header: dict[str, Any] = {"__metadata__": dict(metadata or {})}
        offset = 0
        self.expected = []
        for name, dtype, shape in entries:
            dtype = np.dtype(dtype)
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self.expected.append((name, dtype, tuple(shape)))
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
        self.path, self.nbytes, self._next = path, offset, 0
        self._f = open(path, "wb")
        self._f.write(struct.pack("<Q", len(blob)) + blob)

    def write(self, name: str, array: np.ndarray) -> None:
        want, dtype, shape = self.expected[self._next]
        if name != want or array.dtype != dtype or tuple(array.shape) != shape:
            raise ValueError(f"{self.path}: expected {want} {dtype} {shape}, got {name} {array.dtype} {array.shape}")
        array = np.ascontiguousarray(array)
        self._f.write(memoryview(array.reshape(-1).view(np.uint8)))
        self._next += 1

    def close(self) -> None:
        if self._next != len(self.expected):
            raise ValueError(f"{self.path}: {len(self.expected) - self._next} tensors not written")
        self._f.close()

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        else:
            self._f.close()


def copy_cast(dst: np.ndarray, src: np.ndarray, tile: int = 256) -> None:
    """``dst[...] = src`` with a dtype cast; a transposed 2-D ``src`` is copied in tiles (cache
    friendly: ~3x faster than one strided copy for 7B-sized matrices)."""
    if dst.ndim != 2 or src.flags.c_contiguous:
        np.copyto(dst, src, casting="unsafe")
        return
    rows, cols = dst.shape
    for r in range(0, rows, tile):
        for c in range(0, cols, tile):
            np.copyto(dst[r:r + tile, c:c + tile], src[r:r + tile, c:c + tile], casting="unsafe")


# ==================================================================================== configuration


def _read_json(path: str, field: str) -> dict:
    if not os.path.isfile(path):
        raise UserError(field, f"{path} does not exist",
                        "point it at a Hugging Face model directory (config.json + *.safetensors)")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(field, f"{path} is not valid JSON ({e})", "fix or re-download the file") from None


def supported() -> dict[str, str]:
    """Every importable/exportable architecture -> its model_type (from the family registry)."""
    from megatrain_jax.models.registry import supported_architectures

    return supported_architectures()


def _architecture(hf: dict, where: str) -> str:
    from megatrain_jax.models.registry import architecture_of

    return architecture_of(hf, where)


def _family_of(arch: str):
    from megatrain_jax.models.registry import family_of_architecture

    return family_of_architecture(arch)


def hf_config_to_model_config(hf: dict, base: ModelConfig | None = None, where: str = "config.json") -> ModelConfig:
    """A ``ModelConfig`` from a Hugging Face ``config.json`` dict, by the architecture's family;
    non-structural fields (``init_std``, ``from_hf``) come from ``base``. Raises ``UserError`` for
    what we cannot run, naming the config field."""
    from megatrain_jax.config import validate_model

    arch = _architecture(hf, where)
    out = _family_of(arch).config_from_hf(hf, base or ModelConfig(), where, arch)
    validate_model(out)
    return out


def read_hf_config(hf_dir: str) -> dict:
    if not os.path.isdir(hf_dir):
        raise UserError("model.from_hf", f"{hf_dir!r} is not a directory",
                        "point it at a Hugging Face model directory (config.json + *.safetensors)")
    return _read_json(os.path.join(hf_dir, "config.json"), "model.from_hf")


def resolve_hf_model_config(model_cfg: ModelConfig) -> ModelConfig:
    """Overwrite ``model_cfg``'s structural fields in place from ``model_cfg.from_hf``'s config.json
    (cheap: reads only the JSON). Warns about every explicitly set YAML value that disagrees.
    Call it before anything uses the sizes (e.g. the vocabulary check of the data)."""
    hf = read_hf_config(model_cfg.from_hf)
    new = hf_config_to_model_config(hf, model_cfg, os.path.join(model_cfg.from_hf, "config.json"))
    default = ModelConfig()
    clashes = []
    for name in STRUCTURAL:
        mine, theirs = getattr(model_cfg, name), getattr(new, name)
        if mine != getattr(default, name) and mine != theirs:
            clashes.append(f"{name}={mine!r} -> {theirs!r}")
    if clashes:
        _warn(f"model.from_hf: the checkpoint's config.json overrides the YAML for {', '.join(clashes)} "
              "(architecture fields come from the checkpoint)")
    for name in STRUCTURAL:
        setattr(model_cfg, name, getattr(new, name))
    return model_cfg


# ======================================================================================== name maps


def hf_name(group: str, leaf_path: str, family: str | None = None) -> tuple[str, bool]:
    """Our (group, leaf path) -> (Hugging Face tensor name, transposed?). Names follow the module
    tree; a family whose modules are named otherwise gives its own ``hf_name`` in the registry."""
    if family is not None:
        from megatrain_jax.models.registry import get_family

        own = get_family(family).hf_name
        if own is not None:
            return own(group, leaf_path)
    if group == "embed" and leaf_path == "embedding":
        return "model.embed_tokens.weight", False
    if group == "head":
        if leaf_path == "lm_head":
            return "lm_head.weight", True
        if leaf_path in ("norm/scale", "norm/weight"):
            return "model.norm.weight", False
    if group.startswith("block_"):
        *mods, kind = leaf_path.split("/")
        prefix = f"model.layers.{int(group[6:])}." + ".".join(mods)
        if kind == "kernel":
            return prefix + ".weight", True
        if kind in ("scale", "weight"):  # RMSNorm scales; Gemma's (1 + weight) norms
            return prefix + ".weight", False
        if kind == "bias":
            return prefix + ".bias", False
    raise ValueError(f"no Hugging Face name for {group}/{leaf_path}")


def hf_tensors(group: str, leaf_path: str, shape: tuple[int, ...],
               family: str | None = None) -> list[tuple[str, bool, int | None, tuple[int, ...]]]:
    """The checkpoint tensors of one leaf: ``(name, transposed, index, hf shape)``. ``index`` is None
    for a leaf that is one tensor; a leaf whose ``hf_name`` holds ``*`` (stacked MoE experts) is one
    tensor per slice along axis 0, ``*`` replaced by the slice's index."""
    name, transposed = hf_name(group, leaf_path, family)
    if "*" not in name:
        return [(name, transposed, None, tuple(reversed(shape)) if transposed else tuple(shape))]
    inner = tuple(shape[1:])
    hf_shape = tuple(reversed(inner)) if transposed else inner
    return [(name.replace("*", str(e)), transposed, e, hf_shape) for e in range(shape[0])]


def _layouts(cfg: ModelConfig):
    from megatrain_jax.models.common import abstract_model, streamed_parts
    from megatrain_jax.templates import Layout

    parts = streamed_parts(abstract_model(cfg))
    return parts, {n: Layout(t) for n, t in parts.host_trees().items()}


def index_checkpoint(hf_dir: str) -> dict[str, TensorInfo]:
    """Every tensor of a checkpoint directory, from the (small) headers of its safetensors files."""
    index_path = os.path.join(hf_dir, INDEX)
    if os.path.isfile(index_path):
        weight_map = _read_json(index_path, "model.from_hf").get("weight_map") or {}
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


def _plan_import(layouts: dict, tensors: dict[str, TensorInfo], cfg: ModelConfig, hf_dir: str) -> list[_Item]:
    """Match every leaf of the store with a checkpoint tensor; check names, shapes, dtypes up front."""
    plan, used = [], set()
    for group, layout in layouts.items():
        for leaf, (name, transpose, index, want) in ((lf, t) for lf in layout.leaves
                                                      for t in hf_tensors(group, lf.path, lf.shape, cfg.family)):
            info = tensors.get(name)
            if info is None:
                hint = " (config.json says tie_word_embeddings is false)" if name == "lm_head.weight" else ""
                raise UserError("model.from_hf", f"tensor {name} is missing from the checkpoint in {hf_dir}{hint}",
                                "use a complete checkpoint whose config.json matches its weights")
            if info.shape != want:
                raise UserError("model.from_hf", f"tensor {name} has shape {list(info.shape)}, config.json implies {list(want)}",
                                "use a checkpoint whose config.json matches its weights")
            if info.dtype not in _ST_DTYPES:
                raise UserError("model.from_hf", f"tensor {name} has dtype {info.dtype}",
                                "use a checkpoint in bfloat16, float16 or float32")
            plan.append(_Item(group, leaf, info, transpose, index))
            used.add(name)
    ignored = [n for n in tensors if n not in used and not n.endswith("rotary_emb.inv_freq")
               and not (n == "lm_head.weight" and cfg.tie_embeddings)]
    if ignored:
        _warn(f"model.from_hf: {len(ignored)} tensors of the checkpoint are not used by the model: "
              f"{', '.join(sorted(ignored)[:5])}{' ...' if len(ignored) > 5 else ''}")
    return plan


def _load_item(f, item: _Item, master: np.ndarray) -> None:
    leaf, info = item.leaf, item.info
    dst = master[leaf.offset:leaf.offset + leaf.size]
    if item.index is not None:  # one slice of a stacked leaf (contiguous: the leading axis)
        dst = dst.reshape(leaf.shape)[item.index].reshape(-1)
    if info.dtype == "F32" and not item.transpose:
        read_tensor(f, info, dst)  # straight from disk into the store
        return
    src = read_tensor(f, info)  # the one temporary: a single tensor in its file dtype
    copy_cast(dst.reshape(info.shape[::-1] if item.transpose else info.shape), src.T if item.transpose else src)


class _Files:
    """Open checkpoint files, one handle each, closed together."""

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

    hf_dir = model_cfg.from_hf
    if not hf_dir:
        raise UserError("model.from_hf", "is not set", "point it at a Hugging Face model directory")
    hf = read_hf_config(hf_dir)
    resolve_hf_model_config(model_cfg)
    family = _family_of(_architecture(hf, "config.json"))
    if family.on_import is not None:
        family.on_import(hf, model_cfg, seq_len, lambda msg: _say(log, msg))
    tensors = index_checkpoint(hf_dir)
    parts, layouts = _layouts(model_cfg)
    plan = _plan_import(layouts, tensors, model_cfg, hf_dir)  # every check before allocating anything
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
                _load_item(f, item, store[item.group].master)
                remaining[item.group] -= 1
                if remaining[item.group] == 0:
                    store[item.group].sync_stream()
        nbytes = sum(i.info.nbytes for i in items)
        done += nbytes
        dt = time.perf_counter() - t0
        _say(log, f"hf import: shard {k}/{len(by_file)} {os.path.basename(path)}: {nbytes / 1e9:.2f} GB in {dt:.1f}s "
                  f"({nbytes / 1e9 / max(dt, 1e-9):.2f} GB/s; {done / max(total, 1):.0%} done)")
    _say(log, f"hf import: {store.num_params() / 1e6:.1f}M parameters from {hf_dir} in {time.perf_counter() - start:.1f}s")
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


# =========================================================================================== export


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
        cache: dict[str, np.ndarray] = {}

        def get(name: str) -> np.ndarray:  # one group flattened at a time
            if name not in cache:
                cache.clear()
                flat = np.empty(layouts[name].size, np.float32)
                layouts[name].flatten_into(obj[name], flat)
                cache[name] = flat
            return cache[name]

        return _Source(layouts, get, lambda name: cache.pop(name, None))
    raise TypeError(f"cannot export a {type(obj).__name__}: give a HostStore, a Llama module or group trees")


def _hf_config_out(cfg: ModelConfig, arch: str, dtype: str, base: dict | None) -> dict:
    """config.json for ``transformers``: the checkpoint's own extra fields (when it came from one),
    then our architecture fields; RoPE in both the transformers 4 and 5 spellings."""
    keep = {}
    if base and _architecture(base, "base config") == arch:
        keep = {k: v for k, v in base.items() if k not in (
            "rope_parameters", "rope_scaling", "rope_theta", "dtype", "torch_dtype", "transformers_version",
            "layer_types", "head_dim", "architectures", "model_type", "quantization_config", "auto_map", "_name_or_path")}
    from megatrain_jax.models.hfconfig import base_to_hf

    out = {
        "architectures": [arch], "model_type": supported()[arch],
        "bos_token_id": None, "eos_token_id": None, "max_position_embeddings": 4096,
        "initializer_range": cfg.init_std, "use_cache": True, "attention_dropout": 0.0,
        **keep, **base_to_hf(cfg), "torch_dtype": dtype, "dtype": dtype,
    }
    _family_of(arch).config_to_hf(cfg, arch, out)
    if out.get("max_position_embeddings") is None:
        out["max_position_embeddings"] = 4096
    return out


def _check_out_dir(out_dir: str, overwrite: bool, field: str = "OUT") -> None:
    if os.path.exists(out_dir) and not (os.path.isdir(out_dir) and not os.listdir(out_dir)) and not overwrite:
        raise UserError(field, f"{out_dir} already exists and is not empty",
                        "choose a new directory, remove it, or pass --overwrite")


def _finish_dir(tmp: str, out_dir: str) -> None:
    """Atomically put a finished temporary directory in place of ``out_dir``."""
    if os.path.exists(out_dir):
        old = out_dir.rstrip("/") + f".old-{os.getpid()}"
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        if os.path.isdir(old):
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.remove(old)
    else:
        os.replace(tmp, out_dir)


def _tmp_dir(out_dir: str) -> str:
    out_dir = os.path.abspath(out_dir)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def export_hf(source: Any, model_cfg: ModelConfig, out_dir: str, dtype: str = "bfloat16",
              architecture: str | None = None, *, hf_config: dict | None = None,
              max_shard_bytes: int = SHARD_BYTES, overwrite: bool = False, log: Log = print) -> str:
    """Write a ``transformers`` checkpoint (safetensors shards + index + config.json) to ``out_dir``.

    ``source``: a ``HostStore`` (its fp32 master), a ``Llama`` module, or group trees
    (``{"embed": ..., "block_0": ..., "head": ...}``). Tensors are converted and written one at a
    time, into a temporary directory renamed to ``out_dir`` at the end. ``architecture`` defaults
    to the source checkpoint's (``hf_config`` or ``model_cfg.from_hf``), else ``Qwen2ForCausalLM``
    with q/k/v biases and ``LlamaForCausalLM`` without. Returns ``out_dir``.
    """
    if dtype not in ("bfloat16", "float32", "float16"):
        raise UserError("dtype", f"{dtype!r} is not an export dtype", "use bfloat16 or float32")
    out_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    if hf_config is None and model_cfg.from_hf and os.path.isfile(os.path.join(model_cfg.from_hf, "config.json")):
        hf_config = read_hf_config(model_cfg.from_hf)
    from megatrain_jax.models.registry import get_family

    family = get_family(model_cfg.family)
    if architecture is None and hf_config:
        architecture = _architecture(hf_config, "hf_config")
        if architecture not in family.architectures:  # the source was another family: ours decides
            architecture = None
    if architecture is None:
        architecture = (family.export_architecture(model_cfg) if family.export_architecture
                        else family.architectures[0])
    if architecture not in supported():
        raise UserError("architecture", f"{architecture!r} is not supported", f"use one of: {', '.join(supported())}")
    if architecture not in family.architectures:
        raise UserError("architecture", f"{architecture} is not an architecture of the model's family "
                        f"{model_cfg.family!r}", f"use one of: {', '.join(family.architectures)}")
    if family.check_export is not None:
        family.check_export(model_cfg, architecture)
    _check_out_dir(out_dir, overwrite)
    src = _source(source)
    _, layouts = _layouts(model_cfg)
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
        if family.export_extras is not None and group.startswith("block_"):  # tensors the format has, we not
            for name, shape in family.export_extras(model_cfg, architecture, int(group[6:])):
                entries.append((name, group, None, False, shape, None))
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

    tmp = _tmp_dir(out_dir)
    start = time.perf_counter()
    weight_map, total = {}, 0
    try:
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
            _say(log, f"hf export: shard {k}/{n} {fname}: {w.nbytes / 1e9:.2f} GB in {dt:.1f}s "
                      f"({w.nbytes / 1e9 / max(dt, 1e-9):.2f} GB/s)")
        if n > 1:
            with open(os.path.join(tmp, INDEX), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(_hf_config_out(model_cfg, architecture, dtype, hf_config), f, indent=2, sort_keys=True)
        _finish_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _say(log, f"hf export: {architecture} ({dtype}, {n} shard{'s' if n > 1 else ''}, {total / 1e9:.2f} GB) "
              f"to {out_dir} in {time.perf_counter() - start:.1f}s")
    return out_dir


# ========================================================================================= mt format

MT_CONFIG = "model.yaml"
MT_HF_CONFIG = "hf_config.json"


def _write_mt_group(path: str, name: str, layout, master: np.ndarray) -> None:
    spec = [(leaf.path, np.float32, leaf.shape) for leaf in layout.leaves]
    with SafetensorsWriter(path, spec, {"format": "megatrain-jax-mt", "group": name}) as w:
        for leaf in layout.leaves:
            w.write(leaf.path, master[leaf.offset:leaf.offset + leaf.size].reshape(leaf.shape))


def _model_yaml(model_cfg: ModelConfig) -> dict:
    d = dataclasses.asdict(model_cfg)
    d["from_hf"] = None  # an mt directory stands on its own
    return d


def save_mt(store, model_cfg: ModelConfig, out_dir: str, *, hf_config: dict | None = None,
            overwrite: bool = False, log: Log = print) -> str:
    """Write a host store in the native ``mt`` format (see the module docstring), group by group."""
    _check_out_dir(out_dir, overwrite)
    if hf_config is None and model_cfg.from_hf and os.path.isfile(os.path.join(model_cfg.from_hf, "config.json")):
        hf_config = read_hf_config(model_cfg.from_hf)
    tmp = _tmp_dir(out_dir)
    try:
        for g in store:
            _write_mt_group(os.path.join(tmp, f"{g.name}.safetensors"), g.name, g.layout, g.master)
        _write_mt_meta(tmp, model_cfg, hf_config)
        _finish_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _say(log, f"mt: wrote {store.num_params() / 1e6:.1f}M parameters to {out_dir}")
    return out_dir


def _write_mt_meta(d: str, model_cfg: ModelConfig, hf_config: dict | None) -> None:
    with open(os.path.join(d, MT_CONFIG), "w") as f:
        yaml.safe_dump(_model_yaml(model_cfg), f, sort_keys=False)
    if hf_config:
        with open(os.path.join(d, MT_HF_CONFIG), "w") as f:
            json.dump(hf_config, f, indent=2)


def read_mt_config(mt_dir: str) -> tuple[ModelConfig, dict | None]:
    path = os.path.join(mt_dir, MT_CONFIG)
    if not os.path.isfile(path):
        raise UserError("MT_DIR", f"{mt_dir} has no {MT_CONFIG}", "point it at a directory written by `convert hf-to-mt`")
    with open(path) as f:
        d = yaml.safe_load(f) or {}
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - fields)
    if unknown:
        raise UserError(path, f"unknown model keys {unknown}", f"use only: {', '.join(sorted(fields))}")
    hf_path = os.path.join(mt_dir, MT_HF_CONFIG)
    hf = _read_json(hf_path, "MT_DIR") if os.path.isfile(hf_path) else None
    return ModelConfig(**d), hf


def _mt_group_reader(mt_dir: str, name: str, layout) -> Callable[[np.ndarray], None]:
    """Check a group file against the layout; return a function reading it into a flat buffer."""
    path = os.path.join(mt_dir, f"{name}.safetensors")
    if not os.path.isfile(path):
        raise UserError("MT_DIR", f"{path} is missing", "use a complete directory written by `convert hf-to-mt`")
    infos, _ = read_safetensors_header(path)
    for leaf in layout.leaves:
        info = infos.get(leaf.path)
        if info is None:
            raise UserError("MT_DIR", f"tensor {leaf.path} is missing from {path}", "use a complete mt directory")
        if info.shape != leaf.shape or info.dtype not in _ST_DTYPES:
            raise UserError("MT_DIR", f"tensor {leaf.path} in {path} is {info.dtype} {list(info.shape)}, "
                            f"model.yaml implies {list(leaf.shape)} (float)", "use the model.yaml written with these weights")
    first = min(i.start for i in infos.values()) if infos else 0
    contiguous = all(infos[leaf.path].start == first + 4 * leaf.offset and infos[leaf.path].dtype == "F32"
                     for leaf in layout.leaves)

    def read(flat: np.ndarray) -> None:
        with open(path, "rb", buffering=0) as f:
            if contiguous:  # the data section is the group's flat buffer: one read
                f.seek(first)
                _read_exact(f, memoryview(flat.view(np.uint8)))
            else:  # any order; bf16/fp16 weights-only exports are upcast (exactly)
                for leaf in layout.leaves:
                    info, dst = infos[leaf.path], flat[leaf.offset:leaf.offset + leaf.size]
                    if info.dtype == "F32":
                        read_tensor(f, info, dst)
                    else:
                        np.copyto(dst, read_tensor(f, info).reshape(-1), casting="unsafe")

    return read


def load_mt(mt_dir: str, bf16_stream: bool, *, log: Log = print):
    """Read an ``mt`` directory into a new host store; returns ``(model_cfg, parts, store)``."""
    from megatrain_jax.hoststore import HostStore

    cfg, _ = read_mt_config(mt_dir)
    parts, layouts = _layouts(cfg)
    readers = {name: _mt_group_reader(mt_dir, name, layout) for name, layout in layouts.items()}
    store = HostStore(layouts, bf16_stream)
    t0 = time.perf_counter()
    for name, read in readers.items():
        read(store[name].master)
        store[name].sync_stream()
    _say(log, f"mt: read {store.num_params() / 1e6:.1f}M parameters from {mt_dir} in {time.perf_counter() - t0:.1f}s")
    return cfg, parts, store


# ======================================================================================== convert


def hf_to_mt(hf_dir: str, out_dir: str, *, overwrite: bool = False, log: Log = print) -> ModelConfig:
    """Convert a Hugging Face checkpoint to the mt format one group at a time (peak memory: one
    group's fp32 buffer, never the whole model)."""
    cfg = ModelConfig(from_hf=hf_dir)
    hf = read_hf_config(hf_dir)
    resolve_hf_model_config(cfg)
    _check_out_dir(out_dir, overwrite)
    tensors = index_checkpoint(hf_dir)
    _, layouts = _layouts(cfg)
    plan = _plan_import(layouts, tensors, cfg, hf_dir)
    tmp = _tmp_dir(out_dir)
    files = _Files()
    t0 = time.perf_counter()
    try:
        for name, layout in layouts.items():
            flat = np.empty(layout.size, np.float32)
            for item in sorted((i for i in plan if i.group == name), key=lambda i: (i.info.path, i.info.start)):
                _load_item(files.get(item.info.path), item, flat)
            _write_mt_group(os.path.join(tmp, f"{name}.safetensors"), name, layout, flat)
            del flat
            _say(log, f"convert: {name} ({layout.size / 1e6:.1f}M parameters) done, {time.perf_counter() - t0:.1f}s")
        _write_mt_meta(tmp, cfg, hf)
        _finish_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        files.close()
    return cfg


def mt_to_hf(mt_dir: str, out_dir: str, dtype: str = "bfloat16", architecture: str | None = None, *,
             overwrite: bool = False, max_shard_bytes: int = SHARD_BYTES, log: Log = print) -> str:
    """Convert an mt directory to a Hugging Face checkpoint, reading one group at a time."""
    cfg, hf = read_mt_config(mt_dir)
    _, layouts = _layouts(cfg)
    readers = {name: _mt_group_reader(mt_dir, name, layout) for name, layout in layouts.items()}
    cache: dict[str, np.ndarray] = {}

    def get(name: str) -> np.ndarray:
        if name not in cache:
            cache.clear()
            flat = np.empty(layouts[name].size, np.float32)
            readers[name](flat)
            cache[name] = flat
        return cache[name]

    src = _Source(layouts, get, lambda name: cache.pop(name, None))
    return export_hf(src, cfg, out_dir, dtype, architecture, hf_config=hf, max_shard_bytes=max_shard_bytes,
                     overwrite=overwrite, log=log)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2 through the CLI's UserError path
        raise UserError("convert", message, "see `megatrain-jax convert --help`")


def convert_main(argv: Iterable[str]) -> int:
    """``megatrain-jax convert hf-to-mt HF_DIR OUT`` | ``convert mt-to-hf MT_DIR OUT [--dtype ...]``."""
    p = _Parser(prog="megatrain-jax convert", description="Convert checkpoints between Hugging Face and megatrain-jax (mt).")
    sub = p.add_subparsers(dest="direction", required=True, parser_class=_Parser)
    a = sub.add_parser("hf-to-mt", help="Hugging Face directory -> mt directory (fp32 master)")
    a.add_argument("src", metavar="HF_DIR")
    a.add_argument("out", metavar="OUT")
    a.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    b = sub.add_parser("mt-to-hf", help="mt directory -> Hugging Face directory")
    b.add_argument("src", metavar="MT_DIR")
    b.add_argument("out", metavar="OUT")
    b.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    b.add_argument("--architecture", default=None, choices=list(supported()))
    b.add_argument("--max-shard-gb", type=float, default=SHARD_BYTES / 1e9, help="shard size limit (default 5)")
    b.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    args = p.parse_args(list(argv))
    t0 = time.perf_counter()
    if args.direction == "hf-to-mt":
        cfg = hf_to_mt(args.src, args.out, overwrite=args.overwrite)
        print(f"converted {args.src} -> {args.out} ({cfg.total_params() / 1e6:.1f}M parameters) "
              f"in {time.perf_counter() - t0:.1f}s")
    else:
        if not os.path.isdir(args.src):
            raise UserError("MT_DIR", f"{args.src!r} is not a directory", "point it at a directory written by `convert hf-to-mt`")
        if not args.max_shard_gb > 0:
            raise UserError("--max-shard-gb", "must be positive", "give e.g. 5")
        mt_to_hf(args.src, args.out, args.dtype, args.architecture, overwrite=args.overwrite,
                 max_shard_bytes=int(args.max_shard_gb * 1e9))
        print(f"converted {args.src} -> {args.out} ({args.dtype}) in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(convert_main(sys.argv[1:]))
