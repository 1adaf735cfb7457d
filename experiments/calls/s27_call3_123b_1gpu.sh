# issue 42, session 27, call 3 (beyond the bar; nvidia-h200-x4, one GPU by CUDA_VISIBLE_DEVICES=0, every decision auto):
# the Mistral-Large-123B shape (configs/lean-123b.yaml: hidden 12288, 88 layers, 96 / 8 heads, MLP 28672, vocab 32768;
# Adafactor, fp32 master, clipping 1.0), 8 x 4096 tokens, 3 steps (steps 2-3 timed), no trace.
# The plan (this tree, planned on the CPU for 143771 MiB and 540.9 GB, 64 cores): resweep with the first 3 groups held on
# the GPU, pinned activations (the last 76 blocks' on the GPU), update on the GPU; host 512.0 GB, GPU 134.2 GB; 94.4 s
# predicted with the H200's memory rate.
# Prediction: 84-92 s a step (the 110B ran at 1/1.088 of its prediction), 262-287 model-TFLOPS; host RSS ~500 GB and
# GPU ~122 GB, both under the plan.
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u; nproc; grep MemTotal /proc/meminfo
CUDA_VISIBLE_DEVICES=0 timeout 575 python experiments/bench_memory_plan.py --out $OUT --steps 3 \
  --end-after-last-step 5 --limit-s 560 --case "123b_lean_b8_cvd0=configs/lean-123b.yaml" 2>&1 | tail -2 | cut -c1-600
date -u
grep -h "^plan:\|^step\|rror\|ran out\|Killed" $OUT/*.log 2>/dev/null | cut -c1-400 | tail -14
