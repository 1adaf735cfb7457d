# issue 29: the lean 22B (Adafactor factored, update on the GPU), 5 steps, with the engine paced (its OOM after
# step 0-1 in s8); issue 30: LoRA on the Qwen2.5-32B-shaped bf16 base, 5 steps, within the corrected plan
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 250 python experiments/bench_memory_plan.py --out $OUT --steps 5 --case "lean22b=configs/lean-22b.yaml" 2>&1 | tail -3
timeout 230 python experiments/bench_memory_plan.py --out $OUT --steps 5 --case "lora32b=configs/lora-qwen2.5-32b.yaml;optim.clip_norm=1.0" 2>&1 | tail -3
