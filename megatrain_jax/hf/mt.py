"""The native ``mt`` format (``convert hf-to-mt`` / ``mt-to-hf``, ``save_mt`` / ``load_mt``, ``export
--format mt``): a directory holding ``model.yaml`` (the ``ModelConfig``), one ``<group>.safetensors``
per group (``embed``, ``block_i``, ``head``) with that group's master tensors keyed by leaf path (in
fp32 the file's data section is exactly the group's flat buffer: one read), and, when it came from
Hugging Face, the original ``hf_config.json`` so that a later export keeps its extra fields."""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Callable

import numpy as np
import yaml

from megatrain_jax.atomic import check_output, output_dir, run_reason
from megatrain_jax.config import ModelConfig
from megatrain_jax.errors import UserError
from megatrain_jax.hf.config import Log, read_hf_config, read_json, resolve_hf_model_config, say
from megatrain_jax.hf.exporter import OTHER_KIND_HINT as HF_KIND_HINT
from megatrain_jax.hf.exporter import SHARD_BYTES, export_hf, one_group_at_a_time
from megatrain_jax.hf.importer import OpenFiles, load_item, plan_import, index_checkpoint
from megatrain_jax.hf.names import model_layouts
from megatrain_jax.hf.safetensors_io import ST_DTYPES, SafetensorsWriter, read_exact, read_safetensors_header, \
    read_tensor

OTHER_KIND_HINT = "choose a new directory (a Hugging Face export is replaced only by `export` or `convert mt-to-hf`)"


MT_CONFIG = "model.yaml"
MT_HF_CONFIG = "hf_config.json"


def write_mt_group(path: str, name: str, layout, master: np.ndarray, dtype=np.float32,
                   metadata: dict | None = None) -> int:
    """One group's file, its tensors in layout order (fp32: the data section is the flat buffer).
    Returns the bytes of tensor data written."""
    dtype = np.dtype(dtype)
    spec = [(leaf.path, dtype, leaf.shape) for leaf in layout.leaves]
    with SafetensorsWriter(path, spec, {"format": "megatrain-jax-mt", "group": name, **(metadata or {})}) as w:
        for leaf in layout.leaves:
            w.write(leaf.path, master[leaf.offset:leaf.offset + leaf.size].reshape(leaf.shape).astype(dtype, copy=False))
    return w.nbytes


def _model_yaml(model_cfg: ModelConfig | dict) -> dict:
    d = dict(model_cfg) if isinstance(model_cfg, dict) else dataclasses.asdict(model_cfg)
    d["from_hf"] = None  # an mt directory stands on its own
    return d


def save_mt(store, model_cfg: ModelConfig, out_dir: str, *, hf_config: dict | None = None,
            overwrite: bool = False, log: Log = print) -> str:
    """Write a host store in the native ``mt`` format (see the module docstring), group by group."""
    check_output(out_dir, "mt", overwrite=overwrite, other=OTHER_KIND_HINT)
    if hf_config is None and model_cfg.from_hf and os.path.isfile(os.path.join(model_cfg.from_hf, "config.json")):
        hf_config = read_hf_config(model_cfg.from_hf)
    with output_dir(out_dir, "mt", overwrite=overwrite) as tmp:
        for g in store:
            write_mt_group(os.path.join(tmp, f"{g.name}.safetensors"), g.name, g.layout, g.master)
        write_mt_meta(tmp, model_cfg, hf_config)
    say(log, f"mt: wrote {store.num_params() / 1e6:.1f}M parameters to {out_dir}")
    return out_dir


def write_mt_meta(d: str, model_cfg: ModelConfig | dict, hf_config: dict | None) -> None:
    """Write the model's megatrain config (and the HF config.json, when given) into ``d``. Public: hf/commands.py
    writes the export's metadata with it."""
    with open(os.path.join(d, MT_CONFIG), "w") as f:
        yaml.safe_dump(_model_yaml(model_cfg), f, sort_keys=False)
    if hf_config:
        with open(os.path.join(d, MT_HF_CONFIG), "w") as f:
            json.dump(hf_config, f, indent=2)


def read_mt_config(mt_dir: str) -> tuple[ModelConfig, dict | None]:
    path = os.path.join(mt_dir, MT_CONFIG)
    if not os.path.isfile(path):
        why = run_reason(mt_dir) if os.path.isdir(mt_dir) else None
        if why:
            raise UserError("MT_DIR", f"{mt_dir} {why}, not an mt directory",
                            f"use `megatrain-jax export {mt_dir} OUT`: it writes a Hugging Face directory")
        if os.path.isfile(os.path.join(mt_dir, "config.json")):
            raise UserError("MT_DIR", f"{mt_dir} is a Hugging Face model directory, not an mt directory",
                            "it loads as it is (model.from_hf); `convert hf-to-mt` makes an mt directory of it")
        raise UserError("MT_DIR", f"{mt_dir} has no {MT_CONFIG}", "point it at a directory written by `convert hf-to-mt`")
    with open(path) as f:
        d = yaml.safe_load(f) or {}
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - fields)
    if unknown:
        raise UserError(path, f"unknown model keys {unknown}", f"use only: {', '.join(sorted(fields))}")
    hf_path = os.path.join(mt_dir, MT_HF_CONFIG)
    hf = read_json(hf_path, "MT_DIR") if os.path.isfile(hf_path) else None
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
        if info.shape != leaf.shape or info.dtype not in ST_DTYPES:
            raise UserError("MT_DIR", f"tensor {leaf.path} in {path} is {info.dtype} {list(info.shape)}, "
                            f"model.yaml implies {list(leaf.shape)} (float)", "use the model.yaml written with these weights")
    first = min(i.start for i in infos.values()) if infos else 0
    contiguous = all(infos[leaf.path].start == first + 4 * leaf.offset and infos[leaf.path].dtype == "F32"
                     for leaf in layout.leaves)

    def read(flat: np.ndarray) -> None:
        with open(path, "rb", buffering=0) as f:
            if contiguous:  # the data section is the group's flat buffer: one read
                f.seek(first)
                read_exact(f, memoryview(flat.view(np.uint8)))
            else:  # any order; bf16/fp16 weights-only exports are upcast (exactly)
                for leaf in layout.leaves:
                    info, dst = infos[leaf.path], flat[leaf.offset:leaf.offset + leaf.size]
                    if info.dtype == "F32":
                        read_tensor(f, info, dst)
                    else:
                        np.copyto(dst, read_tensor(f, info).reshape(-1), casting="unsafe")

    return read


def mt_group_reader(mt_dir: str, name: str, layout) -> Callable[[np.ndarray], None]:
    """One group's reader of an mt directory, checked against ``layout`` (shared: ``generate/source.py`` reads an mt
    export group by group)."""
    return _mt_group_reader(mt_dir, name, layout)


def load_mt(mt_dir: str, bf16_stream: bool, *, log: Log = print):
    """Read an ``mt`` directory into a new host store; returns ``(model_cfg, parts, store)``."""
    from megatrain_jax.hoststore import HostStore

    cfg, _ = read_mt_config(mt_dir)
    parts, layouts = model_layouts(cfg)
    readers = {name: _mt_group_reader(mt_dir, name, layout) for name, layout in layouts.items()}
    store = HostStore(layouts, bf16_stream)
    t0 = time.perf_counter()
    for name, read in readers.items():
        read(store[name].master)
        store[name].sync_stream()
    say(log, f"mt: read {store.num_params() / 1e6:.1f}M parameters from {mt_dir} in {time.perf_counter() - t0:.1f}s")
    return cfg, parts, store


def hf_to_mt(hf_dir: str, out_dir: str, *, overwrite: bool = False, log: Log = print) -> ModelConfig:
    """Convert a Hugging Face checkpoint to the mt format one group at a time (peak memory: one
    group's fp32 buffer, never the whole model). ``hf_dir`` may be a Hub id (``hub.local_model_dir``)."""
    from megatrain_jax.hf.hub import input_paths, local_model_dir

    # the one rule before anything is read (a Hub id: the output stays out of the Hugging Face cache)
    check_output(out_dir, "mt", sources=input_paths(hf_dir), overwrite=overwrite, other=OTHER_KIND_HINT)
    hf_dir = local_model_dir(hf_dir, "HF_DIR", log=log)
    why = run_reason(hf_dir) if os.path.isdir(hf_dir) else None
    if why:
        raise UserError("HF_DIR", f"{hf_dir} {why}, not a Hugging Face model directory",
                        f"use `megatrain-jax export {hf_dir} OUT --format mt`")
    if os.path.isfile(os.path.join(hf_dir, MT_CONFIG)) and not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise UserError("HF_DIR", f"{hf_dir} is an mt directory already", "use `megatrain-jax convert mt-to-hf`")
    cfg = ModelConfig(from_hf=hf_dir)
    hf = read_hf_config(hf_dir)
    resolve_hf_model_config(cfg)
    check_output(out_dir, "mt", sources=[hf_dir], overwrite=overwrite, other=OTHER_KIND_HINT)
    tensors = index_checkpoint(hf_dir)
    _, layouts = model_layouts(cfg)
    plan = plan_import(layouts, tensors, cfg, hf_dir)
    files = OpenFiles()
    t0 = time.perf_counter()
    try:
        with output_dir(out_dir, "mt", sources=[hf_dir], overwrite=overwrite) as tmp:
            for name, layout in layouts.items():
                flat = np.empty(layout.size, np.float32)
                for item in sorted((i for i in plan if i.group == name), key=lambda i: (i.info.path, i.info.start)):
                    load_item(files.get(item.info.path), item, flat)
                write_mt_group(os.path.join(tmp, f"{name}.safetensors"), name, layout, flat)
                del flat
                say(log, f"convert: {name} ({layout.size / 1e6:.1f}M parameters) done, {time.perf_counter() - t0:.1f}s")
            write_mt_meta(tmp, cfg, hf)
    finally:
        files.close()
    return cfg


def mt_to_hf(mt_dir: str, out_dir: str, dtype: str = "bfloat16", architecture: str | None = None, *,
             overwrite: bool = False, max_shard_bytes: int = SHARD_BYTES, log: Log = print) -> str:
    """Convert an mt directory to a Hugging Face checkpoint, reading one group at a time."""
    check_output(out_dir, "hf", sources=[mt_dir], overwrite=overwrite, other=HF_KIND_HINT)  # before any read
    cfg, hf = read_mt_config(mt_dir)
    _, layouts = model_layouts(cfg)
    readers = {name: _mt_group_reader(mt_dir, name, layout) for name, layout in layouts.items()}
    src = one_group_at_a_time(layouts, lambda name, flat: readers[name](flat))
    return export_hf(src, cfg, out_dir, dtype, architecture, hf_config=hf, max_shard_bytes=max_shard_bytes,
                     overwrite=overwrite, sources=[mt_dir], log=log)
