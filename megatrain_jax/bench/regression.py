"""The plan's regression set: 150+ plans, each written as canonical JSON, so that a change meant to leave
the plans alone (a refactor of ``megatrain_jax/plan/``) can be checked to leave every byte of them alone.

Each case is one of the repo's configs (LoRA and Hugging Face ones left out: they are planned elsewhere or need a
download), with a few ``--set`` overrides, planned for a described machine as ``megatrain-jax plan CONFIG
--gpu-memory-gb G --host-memory-gb H --cpu-cores C --devices N`` plans it (``make_plan`` in-process; a CPU machine is
described directly). Nothing of this machine is read, so the set is the same everywhere. For each case the record
holds the options and decisions, the runtime settings, host and GPU need and budget, every row (where, what, bytes,
note), the GPU phases, the predicted step, the verdict's text and its fix, the notes, the state modes and the search
summary; a config or plan the code refuses with a ``UserError`` records that error.

    .venv/bin/python experiments/plan_regression_set.py --write before.json   # at the commit before the change
    .venv/bin/python experiments/plan_regression_set.py --check before.json   # after it
    .venv/bin/python experiments/plan_regression_set.py --list

``--check`` exits 1 on any difference, naming each case that differs and the first fields where it does.
``--only NAME [NAME ...]`` restricts to those cases (``--write`` then writes only those: tests/test_plan_regression.py's
fixture is made that way, from ``SUBSET``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

from megatrain_jax.config import load_config
from megatrain_jax.errors import UserError
from megatrain_jax.plan import Machine, make_plan, target_machine

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GB = 1e9

# described machines: name -> (GPU GB per device, host GB, CPU cores, GPUs); "cpu*": the CPU backend (no GPU)
MACHINES: dict[str, tuple[float | None, float, int, int]] = {
    "h100": (80, 256, 16, 1),
    "g24": (24, 128, 8, 1),
    "g10": (10, 96, 8, 1),
    "g48x2": (48, 128, 32, 2),
    "h200x4": (141, 560, 64, 4),
    "cpu16": (None, 16, 4, 1),
}

# every config of the repo the dense planner plans (the LoRA ones have their own plan; finetune_hf reads a download)
CONFIGS = ("125m", "1b", "3b", "7b", "gemma-2-9b", "gemma-3-1b", "lean-110b", "lean-22b", "llama2-70b",
           "llama3.1-8b-128k", "llama3.1-8b-256k", "llama3.1-8b-512k", "llama3.1-8b", "olmoe-1b-7b-shape-qwen3moe",
           "openllama-3b", "phi-3-mini", "qwen2.5-14b", "qwen2.5-18b", "qwen2.5-32b", "qwen2.5-7b", "qwen3-8b",
           "tiny")

HOLDS = ("gpu_fp32", "gpu_bf16", "pinned_host", "pinned_bf16", "host_fp32", "host_bf16", "resweep")
# single overrides tried on the mid-size shapes (each a decision fixed, or the run changed)
OVERRIDES: tuple[tuple[str, ...], ...] = (
    *((f"train.grad_hold={h}",) for h in HOLDS),
    ("train.update_on=host",), ("train.update_on=device",),
    ("optim.moments=int8",), ("optim.moments=bfloat16",),
    ("train.activations=pinned_host",), ("train.activations=device",),
    ("train.stream_io=true",), ("train.boundary_every=2",),
    ("train.batch_size=4",), ("data.seq_len=8192",),
    ("train.keep_residuals=2",), ("train.compute_dtype=float32",), ("train.micro_batches=2",),
    ("train.stream_copy=device",), ("train.gpu_memory_gb=16",), ("train.host_memory_gb=48",),
    ("optim.moments=int8", "train.update_on=device", "train.grad_hold=host_bf16"),
)


@dataclasses.dataclass(frozen=True)
class Case:
    config: str  # the YAML's stem under configs/
    machine: str  # a key of MACHINES
    sets: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.config}@{self.machine}" + "".join(f" {s}" for s in self.sets)


def cases() -> list[Case]:
    """The regression set, in a fixed order (each name once)."""
    out: list[Case] = []
    for config in CONFIGS:  # every config on three machines
        for machine in ("h100", "g24", "h200x4"):
            out.append(Case(config, machine))
    for config, machines in (("7b", ("g24", "h100")), ("llama3.1-8b", ("g24", "h100")), ("qwen2.5-14b", ("g24",))):
        for machine in machines:
            for sets in OVERRIDES:
                out.append(Case(config, machine, sets))
    for config in ("3b", "qwen2.5-7b"):  # the smallest GPU, with the leaner state
        for sets in ((), ("optim.moments=int8",), ("train.grad_hold=resweep",), ("train.batch_size=2",)):
            out.append(Case(config, "g10", sets))
    # optax optimizers (the update's cost compiled once per shape)
    for config, machine in (("7b", "g24"), ("7b", "h100"), ("3b", "g24")):
        out.append(Case(config, machine, ("optim.name=lion",)))
    out.append(Case("1b", "g24", ("optim.name=adafactor",)))
    # data parallel: settings that once ran on one GPU only (update_on=device, kept residuals), and a hold fixed
    for sets in ((), ("train.update_on=device",), ("train.keep_residuals=2",), ("train.grad_hold=pinned_bf16",),
                 ("train.devices=1",)):
        out.append(Case("llama3.1-8b", "g48x2", sets))
    out.append(Case("qwen2.5-32b", "g48x2"))
    # the CPU backend: without a budget, and with one (train.gpu_memory_gb)
    for config in ("tiny", "125m", "1b"):
        for sets in ((), ("train.gpu_memory_gb=2",), ("train.grad_hold=pinned_host", "train.gpu_memory_gb=2")):
            out.append(Case(config, "cpu16", sets))
    # long sequences: tiling decided by the plan, a shorter batch
    for sets in (("data.seq_len=65536", "train.batch_size=1", "model.seq_tile=auto"),
                 ("data.seq_len=131072", "train.batch_size=1", "model.seq_tile=auto"),
                 ("data.seq_len=32768", "train.batch_size=2")):
        for machine in ("h100", "g24"):
            out.append(Case("llama3.1-8b", machine, sets))
    # the largest shapes on the largest machines (groups over 1B parameters: the huge-group headroom)
    for config, sets in (("lean-110b", ("train.grad_hold=pinned_bf16",)), ("llama2-70b", ("optim.moments=int8",)),
                         ("llama2-70b", ("train.grad_hold=pinned_bf16",))):
        out.append(Case(config, "h200x4", sets))
    names = [c.name for c in out]
    assert len(names) == len(set(names)), "case names repeat"
    return out


# a small, fast subset (tests/test_plan_regression.py: under 20 s on two cores), each a different path
SUBSET = ("tiny@h100", "125m@cpu16 train.gpu_memory_gb=2", "3b@g10 train.grad_hold=resweep",
          "7b@g24 train.grad_hold=host_bf16", "7b@g24 train.activations=pinned_host", "7b@g24 train.stream_io=true",
          "7b@g24 train.update_on=device", "llama3.1-8b@g24 train.grad_hold=pinned_bf16",
          "qwen2.5-7b@g10 optim.moments=int8", "phi-3-mini@h200x4", "llama3.1-8b@g48x2 train.update_on=device")


def machine_of(name: str) -> Machine:
    gpu, host, cores, devices = MACHINES[name]
    if gpu is None:  # the CPU backend, described (target_machine would read this machine's GPU)
        return Machine(backend="cpu", host_bytes=host * GB, host_available=host * GB, host_source="--host-memory-gb",
                       gpu_bytes=None, gpu_source="none", gpu_count=0, gpu_name="", cpu_cores=cores, target=True)
    return target_machine(gpu_memory_gb=gpu, host_memory_gb=host, cpu_cores=cores, gpu_count=devices)


def plan_record(case: Case) -> dict[str, Any]:
    """The plan of ``case`` as a JSON-able dict (or the ``UserError`` the config or the plan raised)."""
    devices = MACHINES[case.machine][3]
    try:
        cfg = load_config(os.path.join(REPO, "configs", case.config + ".yaml"), list(case.sets))
        p = make_plan(cfg, machine_of(case.machine), devices=devices if devices > 1 else None)
        v = p.verdict()
    except UserError as e:
        return {"error": str(e), "error_field": e.field}
    return {
        "options": p.options.to_dict(),
        "decisions": p.decisions,
        "settings": dataclasses.asdict(p.settings),
        "host_need": p.host_need, "host_limit": p.host_limit, "host_source": p.host_source,
        "gpu_need": p.gpu_need, "gpu_budget": p.gpu_budget,
        "rows": [[r.where, r.what, r.bytes, r.note] for r in p.rows],
        "gpu_phases": [[k, v_] for k, v_ in p.gpu_phases.items()],
        "disk_need": p.disk_need,
        "step": p.step, "step_basis": p.step_basis,
        "verdict": None if v is None else str(v),
        "fix": p.fix, "token_bytes": p.token_bytes,
        "notes": list(p.notes),
        "modes": p.modes,
        "search": p.search,
        "params": p.params,
    }


def canonical(record: dict[str, Any]) -> str:
    """One case's record as canonical JSON (sorted keys; floats as Python's shortest exact repr)."""
    return json.dumps(record, sort_keys=True, default=str)


def compute(selected: list[Case], verbose: bool = True) -> dict[str, Any]:
    out = {}
    t0 = time.time()
    for i, case in enumerate(selected):
        t = time.time()
        out[case.name] = json.loads(canonical(plan_record(case)))
        if verbose:
            rec = out[case.name]
            state = "error" if "error" in rec else ("fits" if rec["verdict"] is None else "refused")
            print(f"[{i + 1}/{len(selected)}] {case.name}: {state} ({time.time() - t:.1f} s)", file=sys.stderr,
                  flush=True)
    if verbose:
        print(f"{len(selected)} cases in {time.time() - t0:.0f} s", file=sys.stderr)
    return out


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two records differ (paths, first differences first)."""
    if type(a) is not type(b):
        return [f"{path}: {a!r} in the file, {b!r} now"]
    if isinstance(a, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out.append(f"{path}.{k}: {'missing before' if k not in a else 'missing now'}")
            else:
                out += differences(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items in the file, {len(b)} now"] + [
                d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")][:3]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} in the file, {b!r} now"]


def check(expected: dict[str, Any], got: dict[str, Any], show: int = 5) -> list[str]:
    """One line per case that differs (with its first ``show`` differences); empty where all are identical."""
    lines = []
    for name in expected:
        if name not in got:
            lines.append(f"{name}: not computed")
            continue
        if canonical(expected[name]) != canonical(got[name]):
            diffs = differences(expected[name], got[name])
            lines.append(f"{name}: {len(diffs)} differences\n    " + "\n    ".join(diffs[:show]))
    lines += [f"{name}: new case (not in the file)" for name in got if name not in expected]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", metavar="FILE")
    g.add_argument("--check", metavar="FILE")
    g.add_argument("--list", action="store_true")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="these cases only (names as --list prints them)")
    ap.add_argument("--subset", action="store_true", help="the test's subset (SUBSET) only")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()
    every = cases()
    names = args.only or (SUBSET if args.subset else None)
    if names is not None:
        by_name = {c.name: c for c in every}
        unknown = [n for n in names if n not in by_name]
        if unknown:
            print(f"unknown cases: {unknown}", file=sys.stderr)
            return 2
        every = [by_name[n] for n in names]
    if args.list:
        print("\n".join(c.name for c in every))
        print(f"{len(every)} cases", file=sys.stderr)
        return 0
    if args.write:
        got = compute(every, verbose=not args.quiet)
        with open(args.write, "w") as f:
            json.dump({"cases": got}, f, sort_keys=True, indent=1)
            f.write("\n")
        print(f"wrote {len(got)} cases to {args.write}")
        return 0
    with open(args.check) as f:
        expected = json.load(f)["cases"]
    if names is not None or args.only:
        expected = {n: expected[n] for n in (c.name for c in every) if n in expected}
    else:
        every = [c for c in every if c.name in expected] + [c for c in every if c.name not in expected]
    got = compute(every, verbose=not args.quiet)
    lines = check(expected, got)
    if lines:
        print(f"{len(lines)} of {len(expected)} cases differ:\n" + "\n".join(lines))
        return 1
    print(f"{len(expected)} cases identical")
    return 0
