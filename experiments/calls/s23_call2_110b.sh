# issue 42, session 23 (the four-GPU machine, one GPU named by CUDA_VISIBLE_DEVICES=0, every decision auto): the
# Qwen1.5-110B shape with configs/lean-110b.yaml (Adafactor, fp32 master, clipping 1.0), 8 x 4096 tokens, 4 steps,
# after the search's frontier (s23: the splits between the most activation blocks on the GPU and the most held groups).
# s18 (same case, then plan: 14 groups, stream_io=false, 85.69 s predicted): 77.81 s measured, 275 model-TFLOPS.
# Prediction (plan on 540.9 GB, H200): resweep with the first 24 groups held on the GPU, stream_io=true, host 520.2 GB,
# 82.4 s predicted at H100 rates; by s18's measured/predicted ratio (0.908) ~74.8 s, ~291 model-TFLOPS (the issue's
# 300 is not predicted); host RSS and GPU peak within the plan.
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1; nproc; grep MemTotal /proc/meminfo
CUDA_VISIBLE_DEVICES=0 timeout 585 python experiments/bench_memory_plan.py --out $OUT --steps 4 \
  --case "110b_lean_b8_cvd0=configs/lean-110b.yaml" 2>&1 | tail -4 | cut -c1-900
date -u
grep -h "^plan\|^step\|rror\|Killed" $OUT/*.log 2>/dev/null | cut -c1-400 | tail -20
