# session 25, call 2, nvidia-h200-x4 (issue 45): the strong-scaling bar in one call at every decision auto.
# Qwen2.5-7B at 128 x 1024 tokens a step: one GPU (strong1), then four GPUs (32 x 1024 each, strong4), 5 steps each,
# clipping 1.0, model.init=fast. s24 call 3: strong4 auto 3.51 s, 37,293 tok/s, 3.32x s23 call 4's one GPU (11,223).
# Prediction: strong1 ~11.7 s (~11,200 tok/s), strong4 ~3.5 s (~37,000), 3.25-3.35x in this call.
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1; nproc; grep MemTotal /proc/meminfo
timeout 420 python experiments/bench_data_parallel.py --out $OUT --gpus 1,4 --runs strong --host-gb 480 --steps 5 \
  --model "qwen7b_fixed128=configs/qwen2.5-7b.yaml;32" 2>&1 | grep -v "^step\|Gloo" | tail -3 | cut -c1-700
grep -h "^plan:" $OUT/*.log | cut -c1-300
date -u
