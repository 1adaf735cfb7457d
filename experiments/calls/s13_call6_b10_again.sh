# issue 27: the 8B at 10 GB again (every decision auto, int8, clipping 1.0, 5 steps): call 3 ran it at 7,469 tok/s
# under the plan's new pinned limit (33 GiB) where call 1 ran 7,988 under the old one (44.8 GiB), the same decisions
# and the same 32 GiB pool in both; is the difference the limit or the run?
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 230 python experiments/bench_gpu_budgets.py --out $OUT --shapes 8b --budgets 10 --steps 5 2>&1 | tail -1
grep -h "^step\|^plan:\|done\|rror" $OUT/train_*.log | cut -c1-200
