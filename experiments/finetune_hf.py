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
