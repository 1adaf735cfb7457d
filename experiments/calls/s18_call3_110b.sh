# issue 42, session 18, call 3 (the four-GPU machine, one GPU named by CUDA_VISIBLE_DEVICES=0, every decision auto):
# the Qwen1.5-110B shape with configs/lean-110b.yaml (Adafactor, fp32 master, clipping 1.0), 8 x 4096 tokens, 4 steps.
# s17's two tries ran out of GPU memory in step 1. Found in s18 (calls 1-2, one H200): the plan's optax cost started
# JAX's backends while planning, so XLA kept its default GPU pool (0.75 of the GPU: 112.6 GB on an H200) under a plan of
# 122.8 of 143.2 GB, and its pinned-pool limit too; the plan now costs optax in a CPU-only child. Prediction (plan on
# 540.9 GB, H200): resweep with the first 14 groups held on the GPU, host 504.9 GB, GPU 122.8 GB, 85.7 s a step
# (~255 model-TFLOPS: the second backward sweep over 66 of 80 blocks; the 300 is not predicted).
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u
CUDA_VISIBLE_DEVICES=0 timeout 580 python experiments/bench_memory_plan.py --out $OUT --steps 4 \
  --case "110b_lean_b8_cvd0=configs/lean-110b.yaml" 2>&1 | tail -4 | cut -c1-900
date -u
grep -h "^plan\|^step\|rror\|Killed" $OUT/*.log 2>/dev/null | cut -c1-400 | tail -20
