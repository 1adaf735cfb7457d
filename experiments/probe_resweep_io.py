"""Where does ``grad_hold=resweep`` with ``stream_io`` put its GPU bytes? (issue 27)

The Llama-3.2-3B shape (from configs/3b.yaml, ``model.init=fast``), 16 x 4096 tokens of byte-range ids, the placement
the plan chose at a 10 GB budget (16 micro-batches, activations on the GPU every 4th input, stream_io), once
with the resweep and once with a host_bf16 hold, each in its own process with XLA's pool unbounded (no budget): per
block of each sweep, XLA's bytes in use and peak, and at the step's largest bytes in use the live arrays by shape.
Writes ``$OUT/probe_resweep_io_<hold>.json``.

    PYTHONPATH=. python experiments/probe_resweep_io.py --out $OUT [--hold resweep|host_bf16]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one(args) -> dict:
    import jax
    import numpy as np

    from megatrain_jax.config import OptimConfig, load_config
    from megatrain_jax.engine import Batch, StreamedTrainer
    from megatrain_jax.models.common import init_host_store
    from megatrain_jax.optim import build_host_optimizer

    cfg = load_config(os.path.join(ROOT, "configs/3b.yaml"), ["model.init=fast", *args.set]).model
    parts, store = init_host_store(cfg, 0, bf16_stream=False)
    st = StreamedTrainer(parts, build_host_optimizer(OptimConfig(clip_norm=1.0, moments="int8"), 3),
                         compute_dtype="bfloat16", stream_copy="device", clip_norm=1.0, store=store, micro_batches=16,
                         loss_chunk=4096, activations="device", boundary_every=4, grad_hold=args.hold, stream_io=True,
                         vocab_chunk=16384, update_on="host")
    dev = jax.local_devices()[0]
    marks, best = [], {"bytes": 0}

    def mark(label):
        s = dev.memory_stats() or {}
        b = int(s.get("bytes_in_use", 0))
        marks.append((label, b / 1e9, int(s.get("peak_bytes_in_use", 0)) / 1e9))
        if b > best["bytes"]:
            shapes = collections.Counter()
            for a in jax.live_arrays():
                if not a.is_deleted() and a.sharding.memory_kind != "pinned_host":
                    shapes[f"{a.dtype}{tuple(a.shape)}"] += a.nbytes
            best.update(bytes=b, label=label, live={k: v / 1e9 for k, v in shapes.most_common(12)})

    orig_bb, orig_eb = StreamedTrainer._backward_block, st.io.embed_backward

    def bb(self, i, w, acts, mbs, dhs, again=False):
        mark(f"{'2nd' if again else '1st'} bwd {i}")
        return orig_bb(self, i, w, acts, mbs, dhs, again)

    def eb(emb, mbs, dhs, scale=None):
        mark(f"embed bwd ({'2nd' if scale is not None else '1st'})")
        out = orig_eb(emb, mbs, dhs, scale)
        mark(f"after embed bwd ({'2nd' if scale is not None else '1st'})")
        return out

    StreamedTrainer._backward_block = bb
    st.io.embed_backward = eb
    rng = np.random.default_rng(0)
    steps = []
    for n in range(2):
        marks.clear()
        t = rng.integers(0, 256, (16, args.seq + 1))
        r = st.step(Batch(t[:, :-1], t[:, 1:]))
        jax.block_until_ready(jax.device_put(0))
        steps.append({"loss": r.loss, "marks": list(marks)})
    st.close()
    s = dev.memory_stats() or {}
    return {"hold": args.hold, "peak_gb": int(s.get("peak_bytes_in_use", 0)) / 1e9, "largest": best, "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--hold", default=None)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--set", action="append", default=[], help="a model override (a small shape on the CPU)")
    args = ap.parse_args()
    if args.hold:
        res = one(args)
        with open(os.path.join(args.out, f"probe_resweep_io_{args.hold}.json"), "w") as f:
            json.dump(res, f, indent=1)
        print(json.dumps({"hold": res["hold"], "peak_gb": res["peak_gb"], "largest_at": res["largest"].get("label"),
                          "largest_gb": res["largest"]["bytes"] / 1e9, "live": res["largest"].get("live")}))
        return
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    for hold in ("resweep", "host_bf16"):
        subprocess.run([sys.executable, __file__, "--out", args.out, "--hold", hold, "--seq", str(args.seq),
                        *[x for v in args.set for x in ("--set", v)]], env=env, check=False, timeout=280)


if __name__ == "__main__":
    main()
