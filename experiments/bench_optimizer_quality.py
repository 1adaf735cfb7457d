"""Training quality of each named optimizer (issue 29): the same model, data and data order, N steps each,
through the user's own command (``python -m megatrain_jax train``), every step's loss to JSON and all
curves in one PNG.

    PYTHONPATH=. python experiments/bench_optimizer_quality.py --out $OUT          # GPU: 1B shape, 200 steps
    PYTHONPATH=. python experiments/bench_optimizer_quality.py --tiny --steps 5    # CPU smoke test
    ... --optimizers lion,adafactor,sgd --append $EARLIER/optimizer_quality.json  # the rest, in a second command

Default case: ``configs/1b.yaml`` (Llama-3.2-1B shape) with the byte tokenizer on tinyshakespeare, vocab 256,
8 x 1024 tokens per step, ``model.init=fast``, clipping 1.0, warmup-cosine. Each optimizer gets its usual
learning rate (``OPTIMIZERS``; ``lean`` is ``configs/lean-22b.yaml``'s: Adafactor, factored second moment,
no first moment). A persistent compilation cache is shared by the runs, so only the first compiles the
model's kernels. Results are written after each optimizer (a run cut short keeps what finished), and an
optimizer is skipped when the time left (``--budget-s``) cannot hold it at the pace measured so far.

Writes OUT/optimizer_quality.json (per optimizer: overrides, every step's loss, the mean of the last 10,
seconds) and OUT/optimizer_quality.png (matplotlib if installed, else Pillow).
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
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# name -> overrides (optim.*): the fused AdamW first (the yardstick), then what a user would set for each
OPTIMIZERS = {
    "adamw_fused": ["optim.name=adamw", "optim.kernel=fused", "optim.lr=3e-4"],
    "adamw_optax": ["optim.name=adamw", "optim.kernel=optax", "optim.lr=3e-4"],
    "lion": ["optim.name=lion", "optim.kernel=optax", "optim.lr=1e-4", "optim.weight_decay=0.1"],
    "adafactor": ["optim.name=adafactor", "optim.kernel=optax", "optim.lr=1e-2", "optim.momentum=0.9"],
    "sgd": ["optim.name=sgd", "optim.kernel=optax", "optim.lr=0.3", "optim.momentum=0.9"],
    "muon": ["optim.name=muon", "optim.kernel=optax", "optim.lr=0.02", "optim.adam_lr=3e-4"],
    "lean": ["optim.name=adafactor", "optim.kernel=optax", "optim.lr=1e-2", "optim.factored=true",
             "optim.weight_decay=0.0"],  # configs/lean-22b.yaml's optimizer
    "lion_int8": ["optim.name=lion", "optim.kernel=optax", "optim.moments=int8", "optim.lr=1e-4",
                  "optim.weight_decay=0.1"],
}
DEFAULT = "adamw_fused,lean,muon,adamw_optax,lion,adafactor,sgd"  # what the issue needs most first
CASE_1B = ["data.seq_len=1024", "model.vocab_size=256", "train.batch_size=8", "model.init=fast",
           "optim.clip_norm=1.0", "optim.weight_decay=0.01"]
CASE_TINY = ["train.batch_size=4", "data.seq_len=64", "optim.weight_decay=0.01"]


def run_one(name: str, config: str, steps: int, sets: list[str], data: str | None, cache: str) -> dict:
    out_dir = tempfile.mkdtemp(prefix=f"quality_{name}_")
    over = sets + OPTIMIZERS[name] + [f"train.steps={steps}", f"train.out_dir={out_dir}",
                                      "train.final_checkpoint=false", "train.log_every=25",
                                      "optim.schedule.kind=warmup_cosine",
                                      f"optim.schedule.warmup_steps={max(1, min(20, steps // 10))}"]
    if data:
        over.append(f"data.path={data}")
    flags = [x for s in over for x in ("--set", s)]
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_COMPILATION_CACHE_DIR=cache,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="1", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "megatrain_jax", "train", config, *flags], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if p.returncode != 0:
        return {"overrides": OPTIMIZERS[name], "error": (p.stdout[-1500:] + p.stderr[-1500:]).strip(),
                "seconds": seconds}
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    losses = [r["loss"] for r in rows]
    step_s = [r.get("step_time_s", r.get("step_s")) for r in rows]
    res = {"overrides": OPTIMIZERS[name], "losses": losses, "seconds": seconds, "steps_run": len(losses),
           "mean_last10": sum(losses[-10:]) / max(len(losses[-10:]), 1)}
    if all(isinstance(s, (int, float)) for s in step_s[2:]) and len(step_s) > 3:
        res["median_step_s"] = sorted(step_s[2:])[len(step_s[2:]) // 2]
    return res


def plot(results: dict, path: str, title: str) -> str | None:
    curves = {k: r["losses"] for k, r in results.items() if r.get("losses")}
    if not curves:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _plot_pillow(curves, path, title)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for k, c in curves.items():
        ax.plot(range(1, len(c) + 1), c, label=k, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title, fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return "matplotlib"


COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
          (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]


def _plot_pillow(curves: dict, path: str, title: str) -> str | None:
    """The same plot with Pillow (lines, axes with min/max labels, a legend)."""
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        return None
    w, h, left, right, top, bottom = 960, 540, 70, 170, 30, 40
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    steps = max(len(c) for c in curves.values())
    lo = min(min(c) for c in curves.values())
    hi = max(max(c) for c in curves.values())
    hi = hi if hi > lo else lo + 1.0
    x = lambda i: left + (w - left - right) * (i / max(steps - 1, 1))  # noqa: E731
    y = lambda v: top + (h - top - bottom) * (1 - (v - lo) / (hi - lo))  # noqa: E731
    d.rectangle([left, top, w - right, h - bottom], outline="black")
    for v in (lo, (lo + hi) / 2, hi):
        d.text((5, y(v) - 6), f"{v:.3f}", fill="black")
    d.text((left, h - bottom + 8), "1", fill="black")
    d.text((w - right - 20, h - bottom + 8), str(steps), fill="black")
    d.text(((w - right) // 2, h - bottom + 20), "step", fill="black")
    d.text((left, 8), f"training loss  {title}"[:150], fill="black")
    for j, (k, c) in enumerate(curves.items()):
        color = COLORS[j % len(COLORS)]
        d.line([(x(i), y(v)) for i, v in enumerate(c)], fill=color, width=2)
        d.line([(w - right + 10, top + 20 * j + 8), (w - right + 30, top + 20 * j + 8)], fill=color, width=3)
        d.text((w - right + 36, top + 20 * j + 2), k, fill="black")
    img.save(path)
    return "pillow"


def save(results, skipped, config, sets, steps, t_start, json_path, png_path, title) -> str | None:
    """The JSON and the PNG as they stand (after each run: a command cut short keeps what finished)."""
    ref = results.get("adamw_fused", {}).get("mean_last10")
    out = {"config": config, "sets": sets, "steps": steps, "results": results, "skipped": skipped,
           "ratio_to_adamw_fused": {k: (v["mean_last10"] / ref if ref and "mean_last10" in v else None)
                                    for k, v in results.items()},
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": platform.node(), "cores": os.cpu_count(), "wall_s": time.perf_counter() - t_start,
           "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])}
    with open(json_path, "w") as f:
        json.dump(out, f, indent=1)
    return plot(results, png_path, title)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="default: configs/1b.yaml (configs/tiny.yaml with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="configs/tiny.yaml at its own shape (a CPU smoke test)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--optimizers", default=DEFAULT, help=f"comma-separated, of: {', '.join(OPTIMIZERS)}")
    ap.add_argument("--set", action="append", default=[], help="more overrides for every run")
    ap.add_argument("--data", default=None, help="data.path (default: the config's, data/tinyshakespeare.txt)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip optimizers that would not finish in it")
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "experiments", "results")))
    ap.add_argument("--append", default=None, help="an earlier optimizer_quality.json: keep its runs of the same case")
    args = ap.parse_args()
    names = [n for n in args.optimizers.split(",") if n]
    bad = [n for n in names if n not in OPTIMIZERS]
    if bad:
        raise SystemExit(f"unknown optimizer(s) {bad}: use {', '.join(OPTIMIZERS)}")
    config = args.config or ("configs/tiny.yaml" if args.tiny else "configs/1b.yaml")
    sets = (CASE_TINY if args.tiny else CASE_1B) + args.set
    os.makedirs(args.out, exist_ok=True)
    cache = tempfile.mkdtemp(prefix="quality_jax_cache_")
    t_start, results, skipped = time.perf_counter(), {}, []
    json_path, png_path = (os.path.join(args.out, f"optimizer_quality.{e}") for e in ("json", "png"))
    title = f"{os.path.basename(config)} {' '.join(sets)}"
    if args.append:  # a second command's runs join the first's (same config, overrides and steps)
        with open(args.append) as f:
            before = json.load(f)
        if (before["config"], before["sets"], before["steps"]) != (config, sets, args.steps):
            raise SystemExit(f"{args.append} is another case ({before['config']}, {before['steps']} steps)")
        results.update(before["results"])  # a run of this command replaces an earlier one of the same name
    for j, name in enumerate(names):
        spent = time.perf_counter() - t_start
        done = [results[n]["seconds"] for n in names[:j] if n in results]
        # the first run compiles what the others reuse from the cache: the pace is the later runs'
        pace = (min(done[1:]) if len(done) > 1 else done[0]) if done else 0.0
        if done and spent + pace > args.budget_s:
            skipped.append(name)
            print(f"{name:>12}: skipped ({spent:.0f} s spent, ~{pace:.0f} s a run, budget {args.budget_s:.0f} s)")
            continue
        r = results[name] = run_one(name, config, args.steps, sets, args.data, cache)
        if "error" in r:
            print(f"{name:>12}: FAILED after {r['seconds']:.0f} s: {r['error'][-400:]}", flush=True)
        else:
            print(f"{name:>12}: loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} (mean of last 10 "
                  f"{r['mean_last10']:.4f}), {r['steps_run']} steps in {r['seconds']:.0f} s"
                  + (f", median step {r['median_step_s']:.3f} s" if r.get("median_step_s") else ""), flush=True)
        how = save(results, skipped, config, sets, args.steps, t_start, json_path, png_path, title)
    how = save(results, skipped, config, sets, args.steps, t_start, json_path, png_path, title)
    print(f"wrote {json_path}" + (f" and {png_path} ({how})" if how else " (no PNG: no matplotlib or Pillow)"))
    if any("error" in r for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
