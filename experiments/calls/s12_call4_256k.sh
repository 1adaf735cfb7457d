# issue 28: Llama-3.1-8B shape at 262,144 tokens (int8, clip 1.0, every decision auto) under this session's plan (the
# tiled working-set refit moved the plan from the fp32 to the bf16 gradient hold on the GPU): 2 steps, peaks vs plan
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 560 python experiments/bench_memory_plan.py --out $OUT --steps 2 --case "l31_8b_262k=configs/llama3.1-8b-256k.yaml" 2>&1 | tail -3
grep -h "^step\|^plan:\|done\|error" $OUT/train_*.log | cut -c1-400
