# issue 27, after the plan learnt the pageable hold's return cost: the 8B at 24 GB every decision auto (the plan
# now takes the fp32 hold pinned) with the whole-GPU run in the same process for vs_whole; then Qwen2.5-14B shape
# at 24 GB, 5 steps, with time for the bench to write its JSON (call 3 lost the peaks to the script's timeout)
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 260 python experiments/bench_gpu_budgets.py --out $OUT --shapes 8b --budgets whole,24 --steps 5 2>&1 | tail -3
timeout 300 python experiments/bench_gpu_budgets.py --out $OUT --shapes 14b --budgets 24 --steps 5 2>&1 | tail -2
