# issue 27: Qwen2.5-14B shape 16x4096 at train.gpu_memory_gb=24 on the 128 GiB host, every decision auto, int8,
# clipping 1.0: 5 steps within its plan
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
S="optim.clip_norm=1.0;train.final_checkpoint=false;optim.moments=int8;train.stream_copy=device"
timeout 560 python experiments/bench_memory_plan.py --out $OUT --steps 5 --case "14b_24=configs/qwen2.5-14b.yaml;$S;train.gpu_memory_gb=24" 2>&1 | tail -1 | cut -c1-300
grep -h "^plan:\|^step" $OUT/*.log 2>/dev/null | cut -c1-300
