# issue 29 (b): the lean 22B (Adafactor factored, no momentum, update on the GPU), 5 steps, clipping on
export PYTHONPATH=.
timeout 560 python experiments/bench_memory_plan.py --out $OUT --steps 5 --case "lean22b=configs/lean-22b.yaml" 2>&1 | tail -3
