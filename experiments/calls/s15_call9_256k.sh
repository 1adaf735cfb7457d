# issue 27's split placement on the long-context path: Llama-3.1-8B shape at 262,144 tokens (configs/llama3.1-8b-256k.yaml,
# every decision auto) now plans pinned activations with the last 18 blocks' inputs on the GPU and stream_io (GPU 74.5 of
# 81.2 GB, host 95.2 GB where session 10's plan parked every input: 125.4, measured 123.0). 2 steps against the plan.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 585 python experiments/bench_memory_plan.py --out $OUT --steps 2 --case "l31_8b_262k=configs/llama3.1-8b-256k.yaml" 2>&1 | tail -3
grep -h "^plan:\|^step" $OUT/*.log 2>/dev/null | cut -c1-300
