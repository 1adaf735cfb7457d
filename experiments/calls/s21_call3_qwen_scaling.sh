# issue 45, session 21, call 3 (the same warm machine): Qwen2.5-7B (configs/qwen2.5-7b.yaml, defaults, clipping 1.0)
# on 1 and 4 GPUs, every decision auto, 5 steps: weak (128 x 1024 per GPU) and strong (128 x 1024 per step on 4 GPUs,
# against the weak1 run: the same 128 x 1024 on one GPU).
# Prediction (plan, H100 rates): strong4 3.19 s a step with update_on=device split four ways (3.8x of one GPU's ~12 s);
# weak4 within 3% of 4x (s19: 3.81x with the host update).
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u
timeout 400 python experiments/bench_data_parallel.py --out $OUT --gpus 1,4 --runs weak --host-gb 480 --steps 5 \
  --model "qwen7b=configs/qwen2.5-7b.yaml;128" 2>&1 | grep -v "^step\|Gloo" | tail -6 | cut -c1-1200
date -u
timeout 170 python experiments/bench_data_parallel.py --out $OUT --gpus 4 --runs strong --host-gb 480 --steps 5 \
  --model "qwen7b_fixed128=configs/qwen2.5-7b.yaml;32" 2>&1 | grep -v "^step\|Gloo" | tail -4 | cut -c1-1200
date -u
