"""The ``megatrain-jax convert`` and ``megatrain-jax export`` commands.

``export CHECKPOINT OUT`` writes a training checkpoint's weights as a Hugging Face directory
(``from_pretrained`` loads it) for a model of a built-in family, or with ``--format mt`` as one
``<group>.safetensors`` per group plus ``model.yaml`` (any model). ``convert`` moves between a
Hugging Face directory and the mt format (``convert hf-to-mt`` also takes a Hub id, ``hub.py``).
Every output directory obeys ``atomic.check_output``: the writers' rule first (never the source or
inside it, never a training run or inside one, never over a folder of runs or data sets, whatever
the flags), and ``--overwrite`` replaces only an earlier output of the same kind. Where the user
gave the other command's input, the error names that command."""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import Callable, Iterable

import numpy as np

from megatrain_jax import checkpoint as ck

from megatrain_jax import checkpoint_read as ckr
from megatrain_jax.atomic import check_output, output_dir, run_reason
from megatrain_jax.config import ModelConfig
from megatrain_jax.errors import UserError
from megatrain_jax.hf.config import Log, supported
from megatrain_jax.hf.exporter import OTHER_KIND_HINT as HF_KIND_HINT
from megatrain_jax.hf.exporter import SHARD_BYTES, export_hf, one_group_at_a_time
from megatrain_jax.hf.mt import MT_CONFIG, OTHER_KIND_HINT as MT_KIND_HINT, write_mt_meta, hf_to_mt, mt_to_hf, \
    write_mt_group
from megatrain_jax.hf.names import model_layouts

EXPORT_DTYPES = ("bfloat16", "float32")
OVERWRITE_HELP = "replace what an earlier output of the same kind wrote in OUT (never a training run or the source)"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2 through the CLI's UserError path
        raise UserError("convert", message, "see `megatrain-jax convert --help`")


def convert_main(argv: Iterable[str]) -> int:
    """``megatrain-jax convert hf-to-mt HF_DIR OUT`` | ``convert mt-to-hf MT_DIR OUT [--dtype ...]``."""
    p = _Parser(prog="megatrain-jax convert", description="Convert checkpoints between Hugging Face and megatrain-jax (mt).")
    sub = p.add_subparsers(dest="direction", required=True, parser_class=_Parser)
    a = sub.add_parser("hf-to-mt", help="Hugging Face directory -> mt directory (fp32 master)")
    a.add_argument("src", metavar="HF_DIR", help="a Hugging Face model directory, or a Hub id ORG/NAME[@REVISION]")
    a.add_argument("out", metavar="OUT")
    a.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    b = sub.add_parser("mt-to-hf", help="mt directory -> Hugging Face directory")
    b.add_argument("src", metavar="MT_DIR")
    b.add_argument("out", metavar="OUT")
    b.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    b.add_argument("--architecture", default=None, choices=list(supported()))
    b.add_argument("--max-shard-gb", type=float, default=SHARD_BYTES / 1e9, help="shard size limit (default 5)")
    b.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
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




# ------------------------------------------------------------------------------------------ export


def resolve_checkpoint(spec: str, log: Log = print) -> tuple[str, dict, dict]:
    """A checkpoint directory, a ``checkpoints/`` directory or a run's ``out_dir`` -> the newest usable
    committed checkpoint: ``(path, manifest, state)``."""
    if not os.path.isdir(spec):
        raise UserError("CHECKPOINT", f"{spec!r} is not a directory",
                        "give a checkpoint (…/checkpoints/step_N), a checkpoints/ directory or a run's train.out_dir")
    if os.path.isfile(os.path.join(spec, ck.MANIFEST)):
        try:
            manifest, state = ckr.read_checkpoint_meta(spec)
        except ck.CorruptCheckpoint as e:
            raise UserError("CHECKPOINT", f"{spec} is corrupted: {e}", "export an earlier checkpoint") from None
        return spec, manifest, state
    if os.path.basename(spec.rstrip("/")).endswith(".tmp"):
        raise UserError("CHECKPOINT", f"{spec} is an incomplete save", "export a committed step_N checkpoint")
    if ck.checkpoint_problem(spec) is not None and ck.STEP_RE.match(os.path.basename(os.path.normpath(spec))):
        raise UserError("CHECKPOINT", f"{spec} is not a complete checkpoint ({ck.checkpoint_problem(spec)})",
                        "export a complete checkpoint: its run's train.out_dir picks the newest")
    root = spec if ck.step_dirs(spec) else ck.checkpoint_root(spec)
    cks = ck.list_checkpoints(root)
    if not cks:
        raise UserError("CHECKPOINT", f"no complete checkpoint in {spec}",
                        "give a checkpoint (…/checkpoints/step_N), a checkpoints/ directory or a run's train.out_dir")
    for c in reversed(cks):
        try:
            manifest, state = ckr.read_checkpoint_meta(c.path)
        except ck.CorruptCheckpoint as e:
            log(f"export: skipping {c.path}: {e}")
            continue
        for s, why in ck.incomplete_checkpoints(root):
            if s.step > c.step:  # newer than what is exported: said, never passed over silently
                log(f"export: skipping {s.path}: not a complete checkpoint ({why}); exporting step {c.step}")
        return c.path, manifest, state
    raise UserError("CHECKPOINT", f"every checkpoint in {root} is corrupted", "restore the files from a backup")


def master_reader(path: str, manifest: dict) -> Callable[[str, np.ndarray], None]:
    """``read(group, flat)``: a committed checkpoint's fp32 master of one group into ``flat``,
    checked against its crc32 (``UserError`` naming the checkpoint when it fails). For exports."""
    ckptr = ck.checkpointer()
    try:
        parts = ckr.shard_parts(path, manifest)  # a sharded store's checkpoint: gathered group by group
    except ck.CorruptCheckpoint as e:
        raise UserError("CHECKPOINT", f"{path} is corrupted: {e}", "export an earlier checkpoint") from None

    def read(name: str, flat: np.ndarray) -> None:
        try:
            if parts is None:
                flat[:] = ckr.load_group_array(ckptr, path, name, "master", manifest["groups"][name]["arrays"]["master"])
            else:
                flat[:] = ckr.group_arrays(ckptr, path, manifest, parts, name, align=ck.BLOCK_ALIGN)[1]["master"]
        except ck.CorruptCheckpoint as e:
            raise UserError("CHECKPOINT", f"{path} is corrupted: {e}", "export an earlier checkpoint") from None

    return read


def _not_a_checkpoint(spec: str) -> None:
    """A Hugging Face or mt directory given to ``export``: name the command that takes it."""
    if not os.path.isdir(spec) or run_reason(spec):
        return
    if os.path.isfile(os.path.join(spec, MT_CONFIG)):
        raise UserError("CHECKPOINT", f"{spec} is an mt directory, not a training checkpoint",
                        f"use `megatrain-jax convert mt-to-hf {spec} OUT`")
    if os.path.isfile(os.path.join(spec, "config.json")) and any(f.endswith(".safetensors") for f in os.listdir(spec)):
        raise UserError("CHECKPOINT", f"{spec} is a Hugging Face model directory, not a training checkpoint",
                        f"it loads as it is; `megatrain-jax convert hf-to-mt {spec} OUT` makes an mt directory")


def _leaves(saved: list) -> list:
    from megatrain_jax.templates import Leaf

    return [Leaf(p, tuple(shape), offset, size) for p, shape, offset, size in saved]


def _family_layouts(state: dict, path: str) -> tuple[ModelConfig, dict]:
    """The checkpoint's ModelConfig and layouts, when its weights are those of a built-in family."""
    model = dict(state.get("config", {}).get("model") or {})
    fix = "export it with --format mt (one safetensors file per group)"
    try:
        cfg = ModelConfig(**model)
        _, layouts = model_layouts(cfg)
    except (TypeError, ValueError, UserError) as e:
        raise UserError("CHECKPOINT", f"{path} holds a model that is not a built-in family ({e})", fix) from None
    saved = state.get("layouts", {})
    mine = {n: [[leaf.path, list(leaf.shape), leaf.offset, leaf.size] for leaf in lay.leaves] for n, lay in layouts.items()}
    if mine != saved:
        raise UserError("CHECKPOINT", f"{path} holds weights that are not those of its model config (family "
                        f"{cfg.family}): a model of your own, not a built-in family", fix)
    return cfg, layouts


def family_layouts(state: dict, path: str) -> tuple[ModelConfig, dict]:
    """A training checkpoint's ModelConfig and group layouts when its weights are a built-in family's (shared:
    ``generate/source.py`` reads a run's weights group by group as ``export`` does)."""
    return _family_layouts(state, path)


def export_checkpoint(checkpoint: str, out: str, dtype: str = "bfloat16", fmt: str = "hf", *,
                      architecture: str | None = None, overwrite: bool = False,
                      max_shard_bytes: int = SHARD_BYTES, log: Log = print) -> str:
    """A training checkpoint's weights to ``out``: a Hugging Face directory (``fmt="hf"``) or the mt
    format (``fmt="mt"``: ``model.yaml``, ``<group>.safetensors`` in ``dtype``, and ``config.json``
    describing them). Read one group at a time, checked against the checkpoint's crc32."""
    if dtype not in EXPORT_DTYPES:
        raise UserError("--dtype", f"{dtype!r} is not an export dtype", "use bfloat16 or float32")
    if fmt not in ("hf", "mt"):
        raise UserError("--format", f"{fmt!r} is not an export format", "use hf (default) or mt")
    hint = HF_KIND_HINT if fmt == "hf" else MT_KIND_HINT
    check_output(out, fmt, sources=[checkpoint], overwrite=overwrite, other=hint)
    _not_a_checkpoint(checkpoint)
    path, manifest, state = resolve_checkpoint(checkpoint, log)
    sources = [checkpoint, path]
    check_output(out, fmt, sources=sources, overwrite=overwrite, other=hint)
    read = master_reader(path, manifest)
    t0 = time.perf_counter()
    if fmt == "hf":
        cfg, layouts = _family_layouts(state, path)
        export_hf(one_group_at_a_time(layouts, read), cfg, out, dtype, architecture, overwrite=overwrite,
                  max_shard_bytes=max_shard_bytes, sources=sources, log=log)
        log(f"export: {path} (step {state['step']}) -> {out}: Hugging Face {dtype} in {time.perf_counter() - t0:.1f}s")
        return out
    out_dtype = np.dtype(np.float32) if dtype == "float32" else _bf16()
    weight_map, total = {}, 0
    with output_dir(out, "mt", sources=sources, overwrite=overwrite) as tmp:
        for name, saved in state["layouts"].items():
            leaves = _leaves(saved)
            flat = np.empty(sum(leaf.size for leaf in leaves), np.float32)
            read(name, flat)
            total += write_mt_group(os.path.join(tmp, f"{name}.safetensors"), name, _Layout(leaves), flat,
                                    out_dtype, {"dtype": dtype})
            for leaf in leaves:
                prefix = f"layers.{name[6:]}" if name.startswith("block_") else name
                weight_map[f"{prefix}.{leaf.path.replace('/', '.')}"] = [f"{name}.safetensors", leaf.path]
            del flat
        model_cfg = dict(state["config"]["model"])
        write_mt_meta(tmp, model_cfg, None)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump({"format": "megatrain-jax-weights", "dtype": dtype, "model": {**model_cfg, "from_hf": None},
                       "groups": list(state["layouts"]), "weight_map": weight_map, "total_bytes": total,
                       "source": {"checkpoint": os.path.abspath(path), "step": state["step"],
                                  "optimizer_count": state["count"]}}, f, indent=1)
    log(f"export: {path} (step {state['step']}) -> {out}: {len(state['layouts'])} groups, {dtype}, "
        f"{total / 1e9:.3f} GB in {time.perf_counter() - t0:.1f}s")
    return out


def _bf16() -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


class _Layout:
    def __init__(self, leaves: list):
        self.leaves = leaves


class _ExportParser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2 through the CLI's UserError path
        raise UserError("export", f"bad arguments ({message})",
                        "run `megatrain-jax export CHECKPOINT_DIR OUT [--format hf|mt] [--dtype bfloat16|float32]`")


def export_main(argv: Iterable[str]) -> int:
    """``megatrain-jax export CHECKPOINT_DIR OUT [--format hf|mt] [--dtype ...] [--overwrite]``."""
    from megatrain_jax.hf.merge import lora_export  # a run of adapters: --merge-lora (merge.py), or refused

    args = export_parser().parse_args(list(argv))
    rc = lora_export(args)
    if rc is not None:
        return rc
    if not args.max_shard_gb > 0:
        raise UserError("--max-shard-gb", "must be positive", "give e.g. 5")
    export_checkpoint(args.checkpoint, args.out, args.dtype, args.format, architecture=args.architecture,
                      overwrite=args.overwrite, max_shard_bytes=int(args.max_shard_gb * 1e9))
    return 0


def export_parser() -> argparse.ArgumentParser:
    """``export``'s arguments."""
    p = _ExportParser(prog="megatrain-jax export",
                      description="Export a training checkpoint's weights: a Hugging Face directory (default) "
                                  "or the per-group mt format.")
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR",
                   help="a checkpoint (…/checkpoints/step_N), a checkpoints/ directory or a run's out_dir (newest)")
    p.add_argument("out", metavar="OUT", help="output directory (new, or empty; outside the run and the source)")
    p.add_argument("--format", default="hf", choices=["hf", "mt"],
                   help="hf: config.json + safetensors that from_pretrained loads (default); mt: one file per group")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (default) or float32")
    p.add_argument("--architecture", default=None, choices=list(supported()), help="hf only (default: the model's)")
    p.add_argument("--max-shard-gb", type=float, default=SHARD_BYTES / 1e9, help="hf shard size limit (default 5)")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.add_argument("--merge-lora", action="store_true",
                   help="a LoRA run: its base with the adapter merged in (hf only; hf/merge.py)")
    return p
