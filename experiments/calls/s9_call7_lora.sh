# issue 30: LoRA on streamed bases, 5 steps with clipping 1.0, against the LoRA plan as corrected this session
# (the cotangent layer on the GPU; 1.5% of the base beyond the host rows, calibrated on calls 4 and 6)
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 330 python experiments/bench_memory_plan.py --out $OUT --steps 5 --case "lora70b_int8=configs/lora-llama2-70b-int8.yaml;optim.clip_norm=1.0" 2>&1 | tail -2
timeout 230 python experiments/bench_memory_plan.py --out $OUT --steps 5 --case "lora32b=configs/lora-qwen2.5-32b.yaml;optim.clip_norm=1.0" 2>&1 | tail -2
