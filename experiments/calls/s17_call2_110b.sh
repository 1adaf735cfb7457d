# issue 42, session 17, call 2 (the same warm four-GPU machine, one GPU named by CUDA_VISIBLE_DEVICES=0, every
# decision auto): the Qwen1.5-110B shape (hidden 8192, 80 layers, 64 / 8 heads, MLP 49152, vocab 152064, qkv bias,
# untied; 111.2B parameters) with configs/lean-110b.yaml's lean state (Adafactor, no first moment, fp32 master),
# clipping 1.0, 8 x 4096 tokens, 4 steps. The landed code refused it auto, and forced to a resweep was killed 20+ GB
# over its 510.9 GB plan. Prediction (plan on 540.9 GB, H200): resweep with its first 16 groups on the GPU,
# embedding and head resident (stream_io=false: the host-side optax update of the streamed head, 20 GB, is now a row),
# host 497 GB, 84.7 s a step (~258 model-TFLOPS: the second backward sweep).
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u
CUDA_VISIBLE_DEVICES=0 timeout 570 python experiments/bench_memory_plan.py --out $OUT --steps 4 \
  --case "110b_lean_b8_cvd0=configs/lean-110b.yaml" 2>&1 | tail -4 | cut -c1-700
date -u
grep -h "^plan\|^step\|rror\|Killed" $OUT/*.log 2>/dev/null | cut -c1-400 | tail -20
