# session 22, call 4 (issue 45), right after call 3 on the same warm machine: Qwen2.5-7B strong4 (32 x 1024 per GPU,
# 128 x 1024 a step, every decision auto): its scaling against call 3's one-GPU Qwen2.5-7B default run (the same
# 128 x 1024 a step; that run's host limit is the machine's, this one's 480 GB: both plans fit far under).
# Prediction: as call 2 (36,164 tok/s, 3.61 s), ~3.2x.
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u
timeout 170 python experiments/bench_data_parallel.py --out $OUT --gpus 4 --runs strong --host-gb 480 --steps 5 \
  --model "qwen7b_fixed128=configs/qwen2.5-7b.yaml;32" 2>&1 | grep -v "^step\|Gloo" | tail -1 | cut -c1-400
date -u
