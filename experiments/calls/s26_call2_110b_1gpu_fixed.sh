# issue 42, session 26, call 2 (nvidia-h200-x4, one GPU by CUDA_VISIBLE_DEVICES=0, every decision auto): the Qwen1.5-110B
# lean shape (configs/lean-110b.yaml: Adafactor, fp32 master, clipping 1.0), 8 x 4096 tokens, 4 steps, the fourth traced,
# after two engine changes from call 1's trace (79.84 s, compute busy 75.42 s):
# - the embedding's host update (6.6 s, stream_io) starts once the norm is known, before the resweep's second sweep,
#   instead of after it, where the next forward waited for it with the GPU idle;
# - each block the second sweep updates on the GPU starts from the fp32 weights its backward computed with, instead of
#   fetching its master again (5.4 GB a block over PCIe; that sweep ran 0.50 s a block against the first's 0.40).
# Prediction: the plan's decisions unchanged (resweep, 24 groups held, stream_io); step 3 ~68-73 s (79.8 - 6.6, and up to
# 56 x 0.1 s less), 298-323 model-TFLOPS; host and GPU peaks within the plan (520.2 / 133.5 GB).
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u
CUDA_VISIBLE_DEVICES=0 timeout 560 python experiments/bench_memory_plan.py --out $OUT --steps 4 --trace \
  --end-after-last-step 5 --limit-s 540 --case "110b_lean_b8_cvd0=configs/lean-110b.yaml" 2>&1 | tail -2 | cut -c1-600
date -u
grep -h "^plan:\|^step\|^timeline\|rror\|ran out" $OUT/*.log 2>/dev/null | cut -c1-400 | tail -14
ls -la $OUT | head
