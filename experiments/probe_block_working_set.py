"""The plan's per-block working set against the compiled executable's own memory analysis.

Compiles the engine's block backward (engine/kernels.py: the recompute + VJP of one block in one
executable, flat streamed weights in, the fp32 gradient accumulated into a donated buffer) for a
config's block shape at several sequence lengths, tiled and untiled, from abstract shapes only
(nothing is allocated, no weights exist), and prints per case XLA's temporaries next to
``plan.sizes.block_working_set`` plus the attention row the plan adds for this backend's path.

    python experiments/probe_block_working_set.py                     # Llama-3.1-8B shape, 32k..512k
    python experiments/probe_block_working_set.py --seq 4096,16384 --tile 0,2048 --docs --out ws.json

On the GPU run it with XLA_PYTHON_CLIENT_PREALLOCATE=false (compiling allocates nothing, but the
client should not take the GPU's memory either). Writes JSON with --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from megatrain_jax.bench.working_set import compiled_block, planned_block  # noqa: E402
from megatrain_jax.config import load_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/llama3.1-8b-128k.yaml")
    ap.add_argument("--seq", default="32768,65536,131072,262144,524288")
    ap.add_argument("--tile", default="0,8192", help="sequence tiles to compare (0: untiled)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--stream", default="float32", choices=("float32", "bfloat16"),
                    help="streamed weight dtype (float32: train.stream_copy=device)")
    ap.add_argument("--docs", action="store_true", help="document masks (segment ids): the blockwise path")
    ap.add_argument("--width", type=float, default=1.0, help="scale hidden/MLP/heads (a reduced width)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    m = load_config(a.config, ["model.num_layers=1", "model.vocab_size=256"]).model
    if a.width != 1.0:
        heads = max(int(m.num_heads * a.width), m.kv_heads)
        m = dataclasses.replace(m, num_heads=heads, hidden_size=heads * m.dim_per_head,
                                intermediate_size=int(m.intermediate_size * a.width) // 64 * 64)
    rows = []
    print(f"{jax.devices()[0].device_kind}  {m.hidden_size=} {m.intermediate_size=} {m.num_heads=} {m.kv_heads=}")
    print(f"{'seq':>8} {'tile':>6} {'attention':>14} {'plan GB':>8} {'compiled GB':>11} {'plan/xla':>8}  (fwd temp GB)")
    for seq in (int(s) for s in a.seq.split(",")):
        for tile in (int(t) for t in a.tile.split(",")):
            cfg = dataclasses.replace(m, seq_tile=tile)
            got = compiled_block(cfg, seq, batch=a.batch, stream_dtype=a.stream, docs=a.docs)
            plan = planned_block(cfg, seq, batch=a.batch, docs=a.docs)
            ratio = plan["total"] / max(got["bwd"]["temp"], 1)
            print(f"{seq:>8} {tile:>6} {plan['attention']:>14} {plan['total'] / 1e9:>8.2f} "
                  f"{got['bwd']['temp'] / 1e9:>11.2f} {ratio:>8.3f}  ({got['fwd']['temp'] / 1e9:.2f})", flush=True)
            rows.append({"seq_len": seq, "seq_tile": tile, "batch": a.batch, "plan": plan, "compiled": got,
                         "plan_over_compiled": ratio})
    if a.out:
        Path(a.out).write_text(json.dumps({
            "device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "model": dataclasses.asdict(m) if dataclasses.is_dataclass(m) else str(m), "stream_dtype": a.stream,
            "docs": a.docs, "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
