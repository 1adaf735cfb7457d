# issue 30: the Llama-2-70B-shaped int8 base with rank-16 LoRA, 5 steps with clipping, against the LoRA plan
# that now counts the paced engine's 3 streamed blocks (session 9 ran 0.8% over the older plan).
# issue 27: the 8B at 24 GB with the fp32 hold in pinned memory (the plan chose host_bf16): speed and RSS;
# then Qwen2.5-14B shape at 24 GB, 5 steps, every decision auto
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 270 python experiments/bench_memory_plan.py --out $OUT --steps 5 --case "lora70b_int8=configs/lora-llama2-70b-int8.yaml;optim.clip_norm=1.0" 2>&1 | tail -2
timeout 150 python experiments/bench_memory_plan.py --out $OUT --steps 5 --case "8b_24_pinnedhold=configs/llama3.1-8b.yaml;optim.clip_norm=1.0;train.gpu_memory_gb=24;train.grad_hold=pinned_host" 2>&1 | tail -2
timeout 170 python experiments/bench_gpu_budgets.py --out $OUT --shapes 14b --budgets 24 --steps 5 2>&1 | tail -2
