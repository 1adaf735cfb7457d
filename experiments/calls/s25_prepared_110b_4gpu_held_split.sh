# Prepared in session 24, not yet run (issue 45): the Qwen1.5-110B lean shape on 4 GPUs of one process after the
# held split (an optax update over several GPUs: each GPU holds its share of every held gradient). 8 x 4096 tokens per
# GPU (train.batch_size=32), every decision auto, 4 steps; ask for nvidia-h200-x4.
# Plan (CLI, 4 x 150.75 GB, 540.9 GB, 64 cores): gpu_bf16 hold of every group, a quarter each (54.4 GB a GPU),
# stream_io, split fetch, the Adafactor update whole on every GPU; host 511.5 GB, GPU 127.3 of 143.2 GB; 61.76 s
# predicted at H100 rates. s24 call 2 (resweep, 11 groups held): 105.0 s, 1,248 tok/s, 2.96x one GPU.
# Prediction: 62-72 s a step (stream_io's cost at this vocabulary is under-counted: s24 call 4's slice), 1,800-2,100
# tok/s, 4.3-5x the one-GPU 421 tok/s (s18; >= 3.3x is the bar); RSS and GPU within the plan.
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1; nproc; grep MemTotal /proc/meminfo
timeout 595 python experiments/bench_memory_plan.py --out $OUT --steps 4 --end-after-last-step 5 --limit-s 575 \
  --case "110b_lean_b32_dev4_held_split=configs/lean-110b.yaml;train.batch_size=32;train.devices=4" 2>&1 \
  | tail -2 | cut -c1-900
date -u
grep -h "^plan:\|^step\|rror\|ran out\|Killed" $OUT/*.log 2>/dev/null | cut -c1-300 | tail -10
