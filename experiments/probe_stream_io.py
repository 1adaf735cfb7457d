"""What does ``stream_io`` cost and save? The resident embedding + head against the streamed ones.

A Llama-3.1-8B-shaped model cut to a few layers (vocabulary 128256, hidden 4096: the groups this is
about) trains a few steps with the resident path and with ``stream_io``; per run: median step time,
peak GPU bytes in use (XLA's own counter; each run in its own process so the peaks do not mix),
the losses (they must agree). Writes ``$OUT/stream_io.json``.

    PYTHONPATH=. python experiments/probe_stream_io.py --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np


def one_run(args: argparse.Namespace, stream: bool) -> dict:
    import jax

    from megatrain_jax.config import ModelConfig, OptimConfig
    from megatrain_jax.engine import Batch, StreamedTrainer
    from megatrain_jax.models.llama import init_host_store
    from megatrain_jax.optim import build_host_optimizer

    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=32,
                      num_kv_heads=8, intermediate_size=args.ffn, init="fast")
    parts, store = init_host_store(cfg, 0, bf16_stream=False)
    st = StreamedTrainer(parts, build_host_optimizer(OptimConfig(clip_norm=1.0, moments="int8"), args.steps),
                         compute_dtype="bfloat16", stream_copy="device", clip_norm=1.0, store=store,
                         micro_batches=args.micro, loss_chunk=args.loss_chunk, activations="pinned_host",
                         grad_hold="pinned_host", stream_io=stream, vocab_chunk=args.vocab_chunk)
    rng = np.random.default_rng(0)
    times, losses = [], []
    for _ in range(args.steps):
        t = rng.integers(0, args.vocab, (args.batch, args.seq + 1))
        t0 = time.perf_counter()
        losses.append(st.step(Batch(t[:, :-1], t[:, 1:])).loss)
        times.append(time.perf_counter() - t0)
    st.close()
    stats = jax.devices()[0].memory_stats() or {}
    return {"stream_io": stream, "step_s": float(np.median(times[2:])), "times": times, "losses": losses,
            "peak_gpu_gb": stats.get("peak_bytes_in_use", 0) / 1e9, "tokens": args.batch * args.seq}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--loss-chunk", type=int, default=1024)
    ap.add_argument("--vocab-chunk", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--child", choices=["on", "off"])
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(one_run(args, args.child == "on")))
        return
    res = {"args": vars(args), "runs": []}
    for mode in ("off", "on"):
        cmd = [sys.executable, __file__, "--child", mode] + [a for a in sys.argv[1:]]
        out = subprocess.run(cmd, capture_output=True, text=True)
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        res["runs"].append(json.loads(line[0][7:]) if line else {"mode": mode, "error": out.stderr[-3000:]})
        print(json.dumps(res["runs"][-1])[:600])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "stream_io.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
