# issue 42, session 23, call 6 (x4, one GPU by CUDA_VISIBLE_DEVICES=0, every decision auto): call 5 again after the
# stream_io fix (at most two head chunk gradients in XLA's pinned pool; call 5 ran the pool out in step 1 with all ten
# 0.54 GB chunks in flight). Qwen1.5-110B shape, configs/lean-110b.yaml (Adafactor, fp32 master, clipping 1.0),
# 8 x 4096 tokens. 3 steps, not 4: the session's device time left (568 s) does not hold 4 (s18: 555 s wall).
# Prediction: plan as call 5 (24 groups held, stream_io, host 520.2 GB, GPU 133.5 GB, 82.4 s at H100 rates); steps run;
# ~75 s a step measured (s18's 0.908 of predicted), ~290 model-TFLOPS.
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u
CUDA_VISIBLE_DEVICES=0 timeout 470 python experiments/bench_memory_plan.py --out $OUT --steps 3 \
  --case "110b_lean_b8_cvd0=configs/lean-110b.yaml" 2>&1 | tail -3 | cut -c1-600
date -u
grep -h "^step\|rror" $OUT/*.log 2>/dev/null | cut -c1-300 | tail -8
