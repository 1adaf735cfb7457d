"""Fine-tune a Hugging Face checkpoint on prepared data and export it back: import -> train -> export.

    # the whole path on a real checkpoint (see docs/finetune_hf.md)
    python experiments/finetune_hf.py --hf models/llama --data data/my --out runs/finetune_hf/export --steps 100

    # a random Llama-2-7B-shaped checkpoint (bf16 safetensors, written without torch)
    python experiments/finetune_hf.py --make-random-7b /tmp/hf7b --hf /tmp/hf7b \\
        --data data/tinyshakespeare.txt --out /tmp/export7b --steps 3 --seq-len 4096 --batch 16 --micro 4

    # the same at 2 blocks and a short sequence: a check on a CPU laptop
    python experiments/finetune_hf.py --make-random-7b /tmp/hf7b_L2 --layers 2 \\
        --data data/tinyshakespeare.txt --out /tmp/export_L2 --steps 3 --seq-len 128 --batch 2 --micro 1

A thin wrapper around the library's ``train()``: the config is ``configs/finetune_hf.yaml`` plus the
flags below as overrides (``model.from_hf``, ``data.path``, ``train.export``, ...), i.e. exactly what
``megatrain-jax train configs/finetune_hf.yaml --set model.from_hf=DIR --set data.path=PREFIX`` runs.
The checkpoint is read straight into the host store (``load_hf_into_store``: the store plus one
tensor, never a second copy), trained with the streamed engine, and written back as Hugging Face
safetensors (``train.export``) from the fp32 master, one tensor at a time.

What this adds to ``train()`` is measurement, taken by wrapping ``hf.load_hf_into_store`` and
``hf.export_hf`` (no copies, no change in behaviour):

- wall time per phase: writing the random source (``--make-random-7b``), import, train (from the
  end of the import to the start of the export: optimizer state allocation, compilation, the
  steps, the final weight update), export; per-step times and losses from ``metrics.jsonl``;
- peak RSS per phase (a thread samples ``VmRSS`` every 50 ms), the kernel's ``VmHWM`` for the
  whole process, and the lowest ``MemAvailable`` seen (the host's head room);
- a check of the export: same tensor names and shapes as the source, and how far a few tensors moved.

**No final training checkpoint by default** (``train.final_checkpoint=false``): it holds the fp32
master and the Adam moments (12 bytes per parameter: ~81 GB for a 7B model), which does not fit next
to the source and the export on a 64 GiB disk, and a one-off fine-tune that ends in an export does
not need it. ``--checkpoint`` keeps it (a resumable run in ``train.out_dir``, as the CLI does).

Writes ``$OUT/finetune_hf.json`` when ``$OUT`` is set, else ``experiments/results/finetune_hf[_L<layers>].json``
(or ``--json PATH``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import sys
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from megatrain_jax import hf
from megatrain_jax.bench.random_hf import make_random_hf
from megatrain_jax.config import Config, load_config
from megatrain_jax.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GB = 1e9
DEFAULT_CONFIG = os.path.join(REPO, "configs", "finetune_hf.yaml")


# ---------------------------------------------------------------------------------- measurement


def _proc(path: str, key: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


class Phases:
    """Wall time and peak RSS per named phase; a thread samples VmRSS and MemAvailable every 50 ms."""

    def __init__(self, period: float = 0.05):
        self.period = period
        self.phase = "setup"
        self.t_phase = time.perf_counter()
        self.wall: dict[str, float] = {}
        self.peak: dict[str, int] = {}
        self.min_avail = _proc("/proc/meminfo", "MemAvailable")
        self.mem_total = _proc("/proc/meminfo", "MemTotal")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _sample(self) -> None:
        rss = _proc("/proc/self/status", "VmRSS")
        avail = _proc("/proc/meminfo", "MemAvailable")
        with self._lock:
            self.peak[self.phase] = max(self.peak.get(self.phase, 0), rss)
            self.min_avail = min(self.min_avail, avail)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def enter(self, name: str) -> None:
        self._sample()  # the end of the previous phase
        now = time.perf_counter()
        with self._lock:
            self.wall[self.phase] = self.wall.get(self.phase, 0.0) + now - self.t_phase
            self.phase, self.t_phase = name, now
        self._sample()

    def __enter__(self) -> "Phases":
        self.t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.enter("done")
        self._stop.set()
        self._thread.join()
        self.total = time.perf_counter() - self.t0

    def report(self) -> dict:
        phases = {name: {"wall_s": round(self.wall.get(name, 0.0), 2),
                         "rss_peak_gb": round(self.peak.get(name, 0) / GB, 3)}
                  for name in self.wall if name != "done"}
        return {"phases": phases, "total_wall_s": round(self.total, 2),
                "rss_peak_gb": round(max(self.peak.values()) / GB, 3),
                "vm_hwm_gb": round(_proc("/proc/self/status", "VmHWM") / GB, 3),
                "ru_maxrss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB, 3),
                "host_mem_total_gb": round(self.mem_total / GB, 3),
                "host_mem_available_min_gb": round(self.min_avail / GB, 3)}


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _timed(phases: Phases, name: str, fn: Callable, after: str, info: dict) -> Callable:
    def wrapper(*args, **kw):
        phases.enter(name)
        try:
            out = fn(*args, **kw)
        finally:
            phases.enter(after)
        if name == "import":
            store = out[1]
            info.update(params=store.num_params(), store_gb=round(store.nbytes() / GB, 3))
        elif name == "export":  # the optimizer state exists by now; no reference to the store is kept
            info["host_state_gb"] = round(args[0].nbytes() / GB, 3)
        return out

    return wrapper


# ------------------------------------------------------------------------------------ the check


def _check_export(src_dir: str, out_dir: str) -> dict:
    """Same tensors as the source (names, shapes), and the relative change of a few of them."""
    a, b = hf.index_checkpoint(src_dir), hf.index_checkpoint(out_dir)
    same = sorted(a) == sorted(b) and all(a[k].shape == b[k].shape for k in a)
    moved = {}
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight", "model.norm.weight"):
        if name not in a or name not in b:
            continue
        with open(a[name].path, "rb") as fa, open(b[name].path, "rb") as fb:
            x = hf.read_tensor(fa, a[name]).astype(np.float32)
            y = hf.read_tensor(fb, b[name]).astype(np.float32)
        moved[name] = {"rel_change": float(np.linalg.norm(y - x) / max(np.linalg.norm(x), 1e-30)),
                       "changed_fraction": float(np.mean(x != y))}
        del x, y
    return {"same_tensors_as_source": same, "n_tensors": len(b), "dtype": sorted({i.dtype for i in b.values()}),
            "bytes_gb": round(sum(i.nbytes for i in b.values()) / GB, 3), "moved": moved}


def _metrics(out_dir: str) -> list[dict]:
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ------------------------------------------------------------------------------------------ main


def build_config(args: argparse.Namespace) -> tuple[Config, list[str]]:
    """``configs/finetune_hf.yaml`` (or ``--config``) with the flags as ``key=value`` overrides."""
    sets = []
    for flag, key in (("hf", "model.from_hf"), ("data", "data.path"), ("tokenizer", "data.tokenizer"),
                      ("out", "train.export"), ("run_dir", "train.out_dir"), ("steps", "train.steps"),
                      ("seq_len", "data.seq_len"), ("batch", "train.batch_size"), ("micro", "train.micro_batches"),
                      ("lr", "optim.lr"), ("warmup", "optim.schedule.warmup_steps"),
                      ("compute_dtype", "train.compute_dtype"), ("export_dtype", "train.export_dtype")):
        v = getattr(args, flag)
        if v is not None:
            sets.append(f"{key}={v}")
    sets += args.set or []
    cfg = load_config(args.config, sets)
    cfg.train.out_dir = os.path.abspath(cfg.train.out_dir)  # orbax (--checkpoint) wants an absolute path
    notes = []
    s = cfg.optim.schedule
    if s.kind != "constant" and s.warmup_steps >= (s.decay_steps or cfg.train.steps):
        new = (s.decay_steps or cfg.train.steps) // 4
        notes.append(f"optim.schedule.warmup_steps {s.warmup_steps} -> {new} (a run of {cfg.train.steps} steps "
                     "leaves no room to decay after the configured warmup)")
        s.warmup_steps = new
    return cfg, notes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=DEFAULT_CONFIG, help="base YAML (default configs/finetune_hf.yaml)")
    ap.add_argument("--hf", metavar="DIR", help="Hugging Face checkpoint directory (model.from_hf); "
                    "default: the --make-random-7b directory")
    ap.add_argument("--data", metavar="PREFIX_OR_TXT", help="prepared data prefix or a .txt file (data.path)")
    ap.add_argument("--tokenizer", help="data.tokenizer (byte, or the tokenizer.json the data was prepared with)")
    ap.add_argument("--out", metavar="EXPORT_DIR", help="where the fine-tuned Hugging Face checkpoint goes (train.export)")
    ap.add_argument("--run-dir", help="train.out_dir (metrics.jsonl, config.yaml; checkpoints with --checkpoint)")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--batch", type=int, help="sequences per optimizer step (train.batch_size)")
    ap.add_argument("--micro", type=int, help="micro-batches per step (train.micro_batches)")
    ap.add_argument("--lr", type=float)
    ap.add_argument("--warmup", type=int, help="optim.schedule.warmup_steps")
    ap.add_argument("--compute-dtype", choices=("bfloat16", "float32"))
    ap.add_argument("--export-dtype", choices=("bfloat16", "float32"))
    ap.add_argument("--set", action="append", metavar="KEY=VALUE", help="any other config override (repeatable)")
    ap.add_argument("--checkpoint", action="store_true",
                    help="keep train()'s final training checkpoint (12 bytes/parameter on disk; off by default)")
    ap.add_argument("--make-random-7b", metavar="DIR",
                    help="first write a random Llama-2-7B-shaped bf16 checkpoint to DIR (reused if already there)")
    ap.add_argument("--layers", type=int, default=32, help="blocks of the --make-random-7b model (default 32)")
    ap.add_argument("--warm", action="store_true", help="leave the random checkpoint in the page cache")
    ap.add_argument("--json", help="result file (default $OUT/finetune_hf.json or experiments/results/)")
    args = ap.parse_args(argv)
    if args.hf is None:
        args.hf = args.make_random_7b
    return args


def run(args: argparse.Namespace, argv: list[str] | None = None) -> dict:
    result: dict[str, Any] = {"host": platform.node(), "cpus": os.cpu_count(),
                              "argv": sys.argv[1:] if argv is None else list(argv)}
    info: dict[str, Any] = {}
    with Phases() as ph:
        if args.make_random_7b:
            ph.enter("write_source")
            made = make_random_hf(args.make_random_7b, args.layers, drop_cache=not args.warm)
            result["source"] = {"dir": args.make_random_7b, "layers": args.layers, "reused": made["reused"],
                                "bytes_gb": round(made["bytes"] / GB, 3)}
            print(f"random source: {made['bytes'] / GB:.2f} GB bf16 in {args.make_random_7b}"
                  + (" (reused)" if made["reused"] else ""), flush=True)
            ph.enter("setup")
        cfg, notes = build_config(args)
        for n in notes:
            print(f"note: {n}", flush=True)
        if not cfg.model.from_hf:
            raise UserError("--hf", "no Hugging Face checkpoint given", "pass --hf DIR (or --make-random-7b DIR)")
        if not cfg.train.export:
            raise UserError("--out", "no export directory", "pass --out DIR (or set train.export in the config)")
        from megatrain_jax.train import train

        patches = contextlib.ExitStack()
        with patches:
            patches.enter_context(_patched(hf, "load_hf_into_store", _timed(ph, "import", hf.load_hf_into_store, "train", info)))
            patches.enter_context(_patched(hf, "export_hf", _timed(ph, "export", hf.export_hf, "finish", info)))
            cfg.train.final_checkpoint = bool(args.checkpoint)
            summary = train(cfg)
        ph.enter("verify")
        exported = os.path.isfile(os.path.join(cfg.train.export, "config.json"))
        check = _check_export(cfg.model.from_hf, cfg.train.export) if exported else None
    recs = _metrics(cfg.train.out_dir)[-summary["steps"]:] if summary["steps"] else []
    steps_s = [r["step_time_s"] for r in recs]
    m = cfg.model
    result.update({
        "model": {"from_hf": m.from_hf, "params": info.get("params", m.total_params()), "layers": m.num_layers,
                  "hidden_size": m.hidden_size, "vocab_size": m.vocab_size, "store_gb": info.get("store_gb"),
                  "host_state_gb": info.get("host_state_gb")},
        "config": {"steps": cfg.train.steps, "seq_len": cfg.data.seq_len, "batch_size": cfg.train.batch_size,
                   "micro_batches": cfg.train.micro_batches, "compute_dtype": cfg.train.compute_dtype,
                   "export_dtype": cfg.train.export_dtype, "lr": cfg.optim.lr, "data": cfg.data.path,
                   "export": cfg.train.export, "final_checkpoint": bool(args.checkpoint), "notes": notes},
        "device": _device(),
        "steps": [{"step": r["step"], "loss": r["loss"], "grad_norm": r["grad_norm"], "step_time_s": round(r["step_time_s"], 3),
                   "tokens_per_s": round(r["tokens_per_s"], 1)} for r in recs],
        "step_s_first": round(steps_s[0], 3) if steps_s else None,
        "step_s_median_after_first": round(float(np.median(steps_s[1:])), 3) if len(steps_s) > 1 else None,
        "first_loss": summary["first_loss"], "last_loss": summary["last_loss"],
        "skipped_steps": summary["skipped_steps"], "stopped_by": summary["stopped_by"],
        "export_check": check,
        **ph.report(),
    })
    return result


def _device() -> dict:
    d = jax.devices()[0]
    out = {"platform": d.platform, "kind": d.device_kind}
    try:
        stats = d.memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            out["peak_gb"] = round(stats["peak_bytes_in_use"] / GB, 3)
    except Exception:  # noqa: BLE001 - not every backend has memory stats
        pass
    return out


def _summary(r: dict) -> str:
    p = r["phases"]
    lines = [f"model: {r['model']['params'] / 1e9:.2f}B parameters ({r['model']['layers']} layers), "
             f"host store {r['model']['store_gb']} GB (weights) / {r['model']['host_state_gb']} GB (with optimizer "
             f"state); device {r['device']['kind']}"]
    for name, v in p.items():
        lines.append(f"  {name:<13} {v['wall_s']:>9.1f} s   peak RSS {v['rss_peak_gb']:.2f} GB")
    steps = ", ".join(f"{s['step_time_s']:.2f}" for s in r["steps"])
    lines.append(f"  per-step s    {steps}  (first includes compilation)")
    lines.append(f"  loss          {r['first_loss']:.4f} -> {r['last_loss']:.4f}")
    lines.append(f"peak RSS {r['rss_peak_gb']:.2f} GB (VmHWM {r['vm_hwm_gb']:.2f} GB), host MemTotal "
                 f"{r['host_mem_total_gb']:.1f} GB, lowest MemAvailable {r['host_mem_available_min_gb']:.1f} GB; "
                 f"total {r['total_wall_s']:.1f} s")
    c = r["export_check"]
    if c:
        moved = ", ".join(f"{k.split('.', 1)[1]} {v['rel_change']:.2e}" for k, v in c["moved"].items())
        lines.append(f"export: {c['n_tensors']} tensors, {c['bytes_gb']} GB {'/'.join(c['dtype'])}, same names and shapes "
                     f"as the source: {c['same_tensors_as_source']}; relative change {moved}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = run(args, argv)
    print(_summary(result), flush=True)
    path = args.json
    if path is None:
        out = os.environ.get("OUT")
        if out:
            path = os.path.join(out, "finetune_hf.json")
        else:
            layers = result["model"]["layers"]
            path = os.path.join(REPO, "experiments", "results", "finetune_hf.json" if layers == 32 else f"finetune_hf_L{layers}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}", flush=True)
    return result
