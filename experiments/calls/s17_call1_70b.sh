# issue 42, session 17, call 1 (the 512 GiB four-GPU machine, one GPU named by CUDA_VISIBLE_DEVICES=0, every decision
# auto): Llama-2-70B shape, AdamW int8 moments, fp32 master, clipping 1.0, 8 x 4096 tokens, 5 steps.
# The landed code died after step 2 in XLA's pinned pool (a 1.59 GiB bf16 block gradient did not fit: its regions hold
# only whole chunks). Prediction (plan on 540.9 GB, H200): pinned_bf16 hold with its first 53 groups on the GPU, the
# pool's limit from sizes.bfc_capacity (52 GiB for 29 chunks + 2 spare), host 475.9 GB, GPU 128.6 GB, 32.4 s a step
# (the landed code measured 36.2 s at 372 model-TFLOPS); on an H100: resweep, 468 GB, 51.7 s.
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; grep -E "MemTotal|MemAvailable" /proc/meminfo; df -h /tmp | tail -1
date -u
CUDA_VISIBLE_DEVICES=0 python -m megatrain_jax plan configs/llama2-70b.yaml --set train.batch_size=8 --set optim.clip_norm=1.0 \
  --set train.final_checkpoint=false 2>&1 | tail -12
CUDA_VISIBLE_DEVICES=0 timeout 500 python experiments/bench_memory_plan.py --out $OUT --steps 5 \
  --case "70b_b8_cvd0=configs/llama2-70b.yaml;train.batch_size=8;optim.clip_norm=1.0" 2>&1 | tail -4 | cut -c1-600
date -u
grep -h "^plan\|^step\|rror" $OUT/*.log 2>/dev/null | cut -c1-400 | tail -20
