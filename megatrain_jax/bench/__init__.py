"""The library side of the benchmarks and probes in ``experiments/``: what those scripts share and the tests check.

- ``runner``: one benchmark case through the user's own commands (``megatrain-jax plan``, then ``train`` in a child
  process, its memory sampled from outside): ``experiments/bench_memory_plan.py`` and the benchmarks built on it.
- ``budgets``: training under GPU budgets (``experiments/bench_gpu_budgets.py``; ``--dry`` plans only).
- ``regression``: the plan's regression set (``experiments/plan_regression_set.py``).
- ``random_hf``: random Llama-shaped Hugging Face checkpoints written without torch (``experiments/bench_hf_io.py``).
- ``finetune``: import -> train -> export of a Hugging Face checkpoint, timed (``experiments/finetune_hf.py``).
- ``working_set``: the engine's compiled block against the plan's working set
  (``experiments/probe_block_working_set.py``).

Nothing in ``megatrain_jax`` outside this package imports it.
"""
