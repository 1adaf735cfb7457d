# issue 45, session 24, nvidia-h200-x4: the Qwen1.5-110B lean shape (configs/lean-110b.yaml: Adafactor, fp32 master,
# clipping 1.0) on 4 GPUs of one process, 8 x 4096 tokens per GPU (train.batch_size=32), every decision auto, 3 steps.
# Plan (CLI, 4 x 150.75 GB, 540.9 GB host, 64 cores): resweep with the first 11 groups held on the GPUs, stream_io,
# split fetch, device update; host 511.5 GB, GPU 130.4 of 143.2 GB; 95.03 s predicted at H100 rates.
# Run first at 13:35 UTC: XLA's pinned pool ran out in step 1 (a 5.06 GiB group: the replicated Adafactor update's
# write-back staged through it; fixed in transfer.copy_into). Run again after the fix.
# Prediction: by s18's measured/predicted ratio on one GPU (0.908) ~86 s a step, ~1,520 tok/s: ~3.6x the one-GPU
# 110B (s18: 77.8 s, 421 tok/s; the bar is >= 3.3x); RSS and GPU peaks within the plan. The bench ends the process
# 10 s after step 3's record (its ~150 s exit measures nothing).
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1; nproc; grep MemTotal /proc/meminfo
timeout 590 python experiments/bench_memory_plan.py --out $OUT --steps 3 --end-after-last-step 10 --limit-s 570 \
  --case "110b_lean_b32_dev4=configs/lean-110b.yaml;train.batch_size=32;train.devices=4" 2>&1 | tail -3 | cut -c1-900
date -u
grep -h "^plan\|^step\|rror\|ran out\|Killed" $OUT/*.log 2>/dev/null | cut -c1-400 | tail -12
