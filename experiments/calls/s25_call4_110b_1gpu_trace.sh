# issue 42, session 25, call 4 (nvidia-h200-x4, one GPU by CUDA_VISIBLE_DEVICES=0, every decision auto): the Qwen1.5-110B
# lean shape (configs/lean-110b.yaml: Adafactor, fp32 master, clipping 1.0), 8 x 4096 tokens, 4 steps, the last traced.
# The auto plan changed since its last run (s23 call 6: 24 groups + stream_io, 79.2 s): now the resweep with the first
# 17 groups on the GPU, no stream_io, pinned activations (the last 9 blocks' on the GPU); host 500.6 of 540.9 GB, GPU
# 134.7 of 143.2 GB, 84.26 s predicted at H100 rates.
# Prediction: within the plan; ~76 s a step (s18's 14-group plan 77.8 s, scaled by the step model's units
# 1+3+3x(80-G)/80), ~285 model-TFLOPS; the trace says where step 4's time goes (compute vs waits) for the 300 bar.
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u
CUDA_VISIBLE_DEVICES=0 timeout 560 python experiments/bench_memory_plan.py --out $OUT --steps 4 --trace \
  --end-after-last-step 5 --limit-s 540 --case "110b_lean_b8_cvd0=configs/lean-110b.yaml" 2>&1 | tail -2 | cut -c1-600
date -u
grep -h "^plan:\|^step\|^timeline\|rror\|ran out" $OUT/*.log 2>/dev/null | cut -c1-400 | tail -14
ls -la $OUT | head
