"""Training under GPU budgets: 3B, 8B and 14B shapes at 10, 16, 24, 40 GB and the whole GPU, through the user's
own ``megatrain-jax train`` (the code: ``megatrain_jax/bench/budgets.py``, which says what each result holds).

    PYTHONPATH=. python experiments/bench_gpu_budgets.py --out $OUT [--shapes 3b,8b,14b] [--budgets 10,16,24,40,whole]
    PYTHONPATH=. python experiments/bench_gpu_budgets.py --dry [--gpu-gb 80 --host-gb 128]   # plans only (any machine)

One JSON per case (``budget_<shape>_<budget>.json``) in ``--out`` (default ``$OUT``, else experiments/results/).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatrain_jax.bench.budgets import main  # noqa: E402

if __name__ == "__main__":
    main()
