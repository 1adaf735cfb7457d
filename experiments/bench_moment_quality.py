"""Training quality of the compact optimizer states: the same run with fp32, bf16 and int8 Adam
moments, through the user's own command, and the loss curves side by side.

    PYTHONPATH=. python experiments/bench_moment_quality.py --config configs/tiny.yaml --steps 300 --out DIR
    PYTHONPATH=. python experiments/bench_moment_quality.py --config configs/1b.yaml --steps 200 \\
        --set data.seq_len=1024 --set model.vocab_size=256 --out $OUT          # the GPU curve

Writes DIR/moment_quality.json (per mode: every step's loss, the mean of the last 10, its ratio to
fp32's) and DIR/moment_quality.png (the three curves; needs matplotlib).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("float32", "bfloat16", "int8")


def run_mode(config: str, steps: int, mode: str, sets: list[str]) -> list[float]:
    out_dir = tempfile.mkdtemp(prefix=f"quality_{mode}_")
    flags = [x for s in sets + [f"optim.moments={mode}", f"train.steps={steps}", f"train.out_dir={out_dir}",
                                "train.final_checkpoint=false", "train.log_every=50"] for x in ("--set", s)]
    p = subprocess.run([sys.executable, "-m", "megatrain_jax", "train", config, *flags], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{mode}: train failed:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        losses = [json.loads(line)["loss"] for line in f]
    if len(losses) != steps:  # e.g. stopped early by a signal (it saves and exits 0)
        raise SystemExit(f"{mode}: {len(losses)} of {steps} steps ran:\n{p.stdout[-1000:]}")
    return losses


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "experiments", "results")))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    curves = {}
    for mode in args.modes.split(","):
        curves[mode] = run_mode(args.config, args.steps, mode, args.set)
        print(f"{mode:>8}: loss {curves[mode][0]:.4f} -> {curves[mode][-1]:.4f} "
              f"(mean of last 10: {sum(curves[mode][-10:]) / 10:.4f})", flush=True)
    last10 = {m: sum(c[-10:]) / len(c[-10:]) for m, c in curves.items()}
    ref = last10.get("float32")
    res = {"config": args.config, "sets": args.set, "steps": args.steps, "curves": curves, "mean_last10": last10,
           "ratio_to_fp32": {m: (v / ref if ref else None) for m, v in last10.items()},
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": platform.node(), "cores": os.cpu_count(),
           "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])}
    with open(os.path.join(args.out, "moment_quality.json"), "w") as f:
        json.dump(res, f, indent=1)
    for m, r in res["ratio_to_fp32"].items():
        print(f"{m:>8}: mean of last 10 = {last10[m]:.4f}, {r:.4f}x fp32")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for m, c in curves.items():
        ax.plot(range(1, len(c) + 1), c, label=f"{m} moments", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"{os.path.basename(args.config)} {' '.join(args.set)}".strip(), fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "moment_quality.png"), dpi=120)
    print(f"wrote {os.path.join(args.out, 'moment_quality.png')}")


if __name__ == "__main__":
    main()
