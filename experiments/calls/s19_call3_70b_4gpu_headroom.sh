# issue 45, session 19, call 3 (nvidia-h100-x4, a fresh machine): calls 1-2's 70B on 4 GPUs ran 3 steps (30.9 s a step,
# 4,279 tok/s) and then one GPU ran out of memory for a 6.66 GiB block-backward temporary (plan 75.3 of 81.2 GB) while
# the other three waited for it in a collective until the time limit. The plan now keeps two fp32 copies of the largest
# group free where several GPUs split the update (6.8 GB at 70B). Prediction: boundary_every=2, stream_io, gpu_bf16 hold
# split 4 ways, GPU 70.4 of 81.2 GB, host 442.1 GB, 36.4 s a step (H100 rates), 5 steps.
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u
timeout 560 python experiments/bench_memory_plan.py --out $OUT --steps 5 \
  --case "70b_b32_dev4=configs/llama2-70b.yaml;train.batch_size=32;train.devices=4" 2>&1 | tail -2 | cut -c1-900
date -u
grep -h "^plan\|^step\|rror\|ran out\|Killed" $OUT/*.log 2>/dev/null | cut -c1-300 | tail -10
