# issue 45, session 20, call 4 (the same machine as call 3, warm): s19 call 3's 4-GPU 70B again, beside call 3's one-GPU baseline.
# Prediction: as s19 call 3 (32.18 s a step, 4,073 tok/s), 5 steps, GPU within 75.0 GB.
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u
timeout 560 python experiments/bench_memory_plan.py --out $OUT --steps 5 \
  --case "70b_b32_dev4=configs/llama2-70b.yaml;train.batch_size=32;train.devices=4" 2>&1 | tail -2 | cut -c1-900
date -u
grep -h "^plan\|^step\|rror\|ran out\|Killed" $OUT/*.log 2>/dev/null | cut -c1-300 | tail -10
