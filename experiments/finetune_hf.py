"""Fine-tune a Hugging Face checkpoint on prepared data and export it back: import -> train -> export.

    # the whole path on a real checkpoint (see docs/finetune_hf.md)
    python experiments/finetune_hf.py --hf models/llama --data data/my --out runs/finetune_hf/export --steps 100

    # a random Llama-2-7B-shaped checkpoint (bf16 safetensors, written without torch)
    python experiments/finetune_hf.py --make-random-7b /tmp/hf7b --hf /tmp/hf7b \\
        --data data/tinyshakespeare.txt --out /tmp/export7b --steps 3 --seq-len 4096 --batch 16 --micro 4

    # the same at 2 blocks and a short sequence: a check on a CPU laptop
    python experiments/finetune_hf.py --make-random-7b /tmp/hf7b_L2 --layers 2 \\
        --data data/tinyshakespeare.txt --out /tmp/export_L2 --steps 3 --seq-len 128 --batch 2 --micro 1

What it runs and measures (phase times, peak RSS, the export check) and where it writes: the docstring of
``megatrain_jax/bench/finetune.py``, which this script runs.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatrain_jax.bench.finetune import main  # noqa: E402
from megatrain_jax.errors import UserError  # noqa: E402

if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
