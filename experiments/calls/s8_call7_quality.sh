# issue 29 item 5: 200 steps of the 1B shape (8 x 1024 tokens, tinyshakespeare) per named optimizer, one PNG
export PYTHONPATH=.
timeout 420 python experiments/bench_optimizer_quality.py --out $OUT --budget-s 380 2>&1 | tail -15
