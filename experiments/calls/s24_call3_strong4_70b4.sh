# issue 45, session 24, nvidia-h200-x4, every decision auto (the device time left holds one call).
# 1. Qwen2.5-7B strong4: 128 x 1024 tokens a step on 4 GPUs (32 x 1024 each). Prediction: ~3.6 s a step (s22 call 2:
#    3.62 s, 36,164 tok/s), ~3.2x s23 call 4's one GPU on this machine kind (11,223 tok/s; not this call).
# 2. Llama-2-70B, AdamW int8, 8 x 4096 per GPU on 4 GPUs (the 70B bar: >= 5 steps within the plan, >= 3.5x one GPU).
#    Plan (CLI): gpu_fp32 hold, device update split 4 ways, host 445.5 GB, GPU 113.0 of 143.2, 32.20 s at H100 rates.
#    Prediction: ~31.5 s a step (s22: 4,064 tok/s in steps 3-4, its script's timeout ended step 5), ~3.9x the
#    one-GPU 1,041 tok/s (s18); RSS and GPU peaks within the plan. The bench ends it 5 s after step 5's record.
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1; nproc; grep MemTotal /proc/meminfo
timeout 140 python experiments/bench_data_parallel.py --out $OUT --gpus 4 --runs strong --host-gb 480 --steps 5 \
  --model "qwen7b_fixed128=configs/qwen2.5-7b.yaml;32" 2>&1 | grep -v "^step\|Gloo" | tail -1 | cut -c1-500
date -u
timeout 445 python experiments/bench_memory_plan.py --out $OUT --steps 5 --end-after-last-step 5 --limit-s 425 \
  --case "70b_b32_dev4=configs/llama2-70b.yaml;train.batch_size=32;train.devices=4" 2>&1 | tail -2 | cut -c1-900
date -u
grep -h "^plan:\|^step\|rror\|ran out\|Killed" $OUT/*70b*.log 2>/dev/null | cut -c1-300 | tail -8
