"""``megatrain-jax`` command line: train, plan, prepare, convert, export, generate.

Every user mistake surfaces as a ``UserError`` and becomes one line on stderr with exit code 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from megatrain_jax.errors import UserError


def _train(args: argparse.Namespace) -> int:
    from megatrain_jax.config import load_config

    cfg = load_config(args.config, args.set or [])  # before importing jax: config errors come fast
    from megatrain_jax.distributed import initialize_from_env
    from megatrain_jax.train import train

    initialize_from_env()  # MEGATRAIN_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID: one of several processes

    train(cfg, resume=args.resume, inputs=[args.config])  # the config file: an input no output may be or hold
    return 0


def _plan(args: argparse.Namespace) -> int:
    """Print the memory plan; exit 2 (after printing it) when it does not fit."""
    from megatrain_jax.config import load_config

    if args.devices is not None and args.devices < 1:  # before the config: 0 is not "one GPU"
        raise UserError("--devices", f"must be a positive number of GPUs, got {args.devices}",
                        "pass --devices N with N >= 1, or leave it out for train.devices")
    if args.processes is not None and args.processes < 1:
        raise UserError("--processes", f"must be a positive number of processes, got {args.processes}",
                        "pass --processes N with N >= 1, or leave it out for one process")
    cfg = load_config(args.config, args.set or [])
    if cfg.model.from_hf:
        from megatrain_jax.hf import resolve_hf_model_config

        resolve_hf_model_config(cfg.model, lambda msg: print(msg, file=sys.stderr))  # notices: lines, not warnings
    if args.processes is None:
        return _plan_printed(args, cfg)
    before = os.environ.get("MEGATRAIN_NUM_PROCESSES")
    os.environ["MEGATRAIN_NUM_PROCESSES"] = str(args.processes)  # what the plan reads (plan.machine.process_count)
    try:
        return _plan_printed(args, cfg)
    finally:
        if before is None:
            os.environ.pop("MEGATRAIN_NUM_PROCESSES", None)
        else:
            os.environ["MEGATRAIN_NUM_PROCESSES"] = before


def _plan_printed(args: argparse.Namespace, cfg) -> int:
    """``plan``'s table (or JSON) of ``cfg``; 2 when it does not fit."""
    from megatrain_jax.plan import plan_of, plan_table, scaling_rows, scaling_table, target_machine

    target = {k: getattr(args, k) for k in ("gpu_memory_gb", "host_memory_gb", "pcie_gbps", "gpu_tflops", "cpu_cores")}
    machine = None
    if any(v is not None for v in target.values()):  # a machine described, not this one
        machine = target_machine(**target, gpu_count=args.devices or 1)  # its disk is not this one's
    p = plan_of(cfg, machine, devices=args.devices)  # a model with adapters: the plan's LoRA rows
    if args.json:
        out = p.to_dict()
        if args.scaling:  # (refused for LoRA before anything is printed)
            out["scaling"] = scaling_rows(cfg, p.machine)
        print(json.dumps(out, indent=1, default=str))
    else:
        scaling = scaling_table(cfg, p.machine) if args.scaling else None
        print(plan_table(p))
        if scaling is not None:
            print(scaling)
    err = p.verdict()
    if err is not None:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def _version() -> str:
    """The installed distribution's version (the source tree's pyproject.toml where it is not installed)."""
    try:
        from importlib.metadata import version

        return version("megatrain-jax")
    except Exception:  # noqa: BLE001 - not installed: read the source tree's
        import re

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        try:
            with open(os.path.join(root, "pyproject.toml")) as f:
                m = re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.M)
            return m.group(1) if m else "unknown"
        except OSError:
            return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatrain-jax", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"megatrain-jax {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model from a YAML config")
    p.add_argument("config", help="YAML config, e.g. configs/tiny.yaml")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.set_defaults(func=_train)

    p = sub.add_parser("plan", help="print the memory plan (host, GPU, disk, predicted step) without training")
    p.add_argument("config", help="YAML config, e.g. configs/7b.yaml")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--devices", type=int, default=None, help="plan for N GPUs (default: train.devices)")
    p.add_argument("--scaling", action="store_true", help="also predict 1, 2, 4 and 8 GPUs (data parallel)")
    p.add_argument("--processes", type=int, default=None,
                   help="plan one of N processes (hosts) of a multi-host run: what each needs (with "
                        "train.host_state=sharded its 1/N of the store); default: MEGATRAIN_NUM_PROCESSES or 1")
    # plan for a machine you are not on (any of these describes the target; the rest is this machine's)
    p.add_argument("--gpu-memory-gb", type=float, default=None, help="the target GPU's memory")
    p.add_argument("--host-memory-gb", type=float, default=None, help="the target host's memory limit")
    p.add_argument("--pcie-gbps", type=float, default=None, help="the target's host<->GPU GB/s (default: H100's)")
    p.add_argument("--gpu-tflops", type=float, default=None, help="the target GPU's bf16 TFLOP/s (default: H100's)")
    p.add_argument("--cpu-cores", type=int, default=None,
                   help="the target host's CPU cores (the host optimizer's speed; default: this machine's)")
    p.set_defaults(func=_plan)

    # these parse their own arguments (see main); listed here for --help
    sub.add_parser("prepare", help="tokenize text / JSONL into a packed token file", add_help=False)
    sub.add_parser("convert", help="hf-to-mt / mt-to-hf checkpoint conversion", add_help=False)
    sub.add_parser("export", help="export a training checkpoint (Hugging Face directory; --format mt)", add_help=False)
    sub.add_parser("generate", help="generate text from a run, an export or a Hugging Face model", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "prepare" and "--preference" in argv[1:]:  # preference pairs (data/preference.py)
            from megatrain_jax.data.preference import preference_main

            return preference_main(argv[1:])
        if argv and argv[0] == "prepare":
            from megatrain_jax.data import prepare_main

            return prepare_main(argv[1:])
        if argv and argv[0] == "convert":  # hf-to-mt / mt-to-hf
            from megatrain_jax.hf import convert_main

            return convert_main(argv[1:])
        if argv and argv[0] == "generate":  # sample from a run, an export or a Hugging Face model
            from megatrain_jax.generate.cli import generate_main

            return generate_main(argv[1:])
        if argv and argv[0] == "export":  # a training checkpoint -> Hugging Face (or mt) directory
            from megatrain_jax.hf import export_main

            return export_main(argv[1:])
        args = build_parser().parse_args(argv)
        return args.func(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a read-only folder, a permission, wherever it was met: one line naming the path
        from megatrain_jax.atomic import io_error

        print(f"error: {io_error(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # one line (train: what became of the save, the newest checkpoint)
        print(str(e) or "interrupted", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
