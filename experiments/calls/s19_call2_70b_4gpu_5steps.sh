# issue 45, session 19, call 2 (the same nvidia-h100-x4 machine as call 1, warm; nvidia-h200-x4 was asked for in call
# 1 and H100s came): Llama-2-70B AdamW int8, 8 x 4096 per GPU on 4 GPUs, alone, 5 steps (call 1's run reached step 3,
# 30.9 s a step, before its 420 s limit: the 70B store's set-up takes ~4 minutes). Prediction: as planned in call 1
# (device update split 4 ways, gpu_bf16 hold, host 432.6 GB, GPU 75.3 of 81.2 GB, 32.4 s a step at H100 rates).
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u
timeout 575 python experiments/bench_memory_plan.py --out $OUT --steps 5 \
  --case "70b_b32_dev4=configs/llama2-70b.yaml;train.batch_size=32;train.devices=4" 2>&1 | tail -2 | cut -c1-900
date -u
grep -h "^step\|rror\|Killed" $OUT/*.log 2>/dev/null | cut -c1-300 | tail -8
