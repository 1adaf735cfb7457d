# issue 30: LoRA on streamed bases, 5 steps with clipping, within the corrected plan (GPU allocator table
# counted): Llama-2-70B shape with an int8 base, Qwen2.5-32B shape in bf16. issue 27: the 8B at 10 GB again
# (call 2's run lost its JSON to the script's timeout), every decision auto
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 250 python experiments/bench_memory_plan.py --out $OUT --steps 5 --case "lora70b_int8=configs/lora-llama2-70b-int8.yaml;optim.clip_norm=1.0" 2>&1 | tail -2
timeout 170 python experiments/bench_memory_plan.py --out $OUT --steps 5 --case "lora32b=configs/lora-qwen2.5-32b.yaml;optim.clip_norm=1.0" 2>&1 | tail -2
timeout 150 python experiments/bench_gpu_budgets.py --out $OUT --shapes 8b --budgets 10 --steps 5 2>&1 | tail -3
