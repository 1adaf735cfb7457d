# issue 28: Llama-3.1-8B shape at 262,144 tokens (int8 moments, clipping 1.0, every decision auto) under the
# current plan (the pace, the pinned pool limit): 2 steps, GPU and host peaks against the plan
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 585 python experiments/bench_memory_plan.py --out $OUT --steps 2 --case "l31_8b_262k=configs/llama3.1-8b-256k.yaml" 2>&1 | tail -3
