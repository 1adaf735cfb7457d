# issue 46, session 21, call 2 (the same warm machine as call 1): the one-process four-GPU baseline of call 1,
# s20 call 4's case again (configs/llama2-70b.yaml, 32 x 4096 = 8 x 4096 per GPU, train.devices=4, every decision auto).
# Prediction: as s20 call 4 (31.4 s a step, 4,178 tok/s on 4 H200).
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u
timeout 575 python experiments/bench_memory_plan.py --out $OUT --steps 5 \
  --case "70b_b32_dev4=configs/llama2-70b.yaml;train.batch_size=32;train.devices=4" 2>&1 | tail -2 | cut -c1-900
date -u
grep -h "^plan\|^step\|rror\|ran out\|Killed" $OUT/*.log 2>/dev/null | cut -c1-300 | tail -10
