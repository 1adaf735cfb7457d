"""Preference pairs for the DPO benchmarks (configs/dpo-qwen2.5-7b.yaml, configs/lora-dpo-llama2-70b-int8.yaml).

    python experiments/bench_preference.py --out runs/bench-pref/pairs1k --pairs 384 --seq 1024

Writes ``--pairs`` pairs in TRL's standard format (prompt / chosen / rejected strings of random printable
bytes: a 64-byte prompt and completions longer than ``--seq``) and prepares them with ``prepare --preference``
(byte tokenizer), so every chosen and every rejected row is exactly ``--seq`` tokens: chosen + rejected at
``--seq`` tokens each, the shape the benchmark compares with SFT at the same tokens per step.
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatrain_jax.data.preference import prepare_preference  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--pairs", type=int, default=384)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    src = a.out + ".jsonl"

    def text(n: int) -> str:
        return bytes(rng.integers(32, 127, n).astype(np.uint8)).decode()

    with open(src, "w") as f:
        for _ in range(a.pairs):
            f.write(json.dumps({"prompt": text(64), "chosen": text(a.seq + 64), "rejected": text(a.seq + 64)}) + "\n")
    prepare_preference([src], a.out, overwrite=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
