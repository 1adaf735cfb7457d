# issue 45, session 22, nvidia-h200-x4: Qwen2.5-7B, every decision auto (s22: auto keeps residuals with several GPUs
# and train.fetch=auto is split there). weak1 and weak4 (128 x 1024 per GPU) in one invocation, so weak4's scaling
# is against the same call's one-GPU run; then strong4 (32 x 1024 per GPU, 128 x 1024 a step) with --trace.
# Plans (H100 rates): weak4 keeps 3 blocks, split fetch, host update, 12.28 s; strong4 keeps 26, split fetch, device
# update, 2.52 s (3.19 s before). Predictions: weak4 3.9x weak1 (s21: split + kept 3 = 3.92x across two instances);
# strong4 ~3.4 s (s21: 4.18 s with none kept, 0.8 s over its compute), ~3.4x weak1.
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u
timeout 330 python experiments/bench_data_parallel.py --out $OUT --gpus 1,4 --runs weak --host-gb 480 --steps 5 \
  --model "qwen7b=configs/qwen2.5-7b.yaml;128" 2>&1 | grep -v "^step\|Gloo" | tail -3 | cut -c1-900
timeout 200 python experiments/bench_data_parallel.py --out $OUT --gpus 4 --runs strong --host-gb 480 --steps 5 --trace \
  --model "qwen7b_fixed128=configs/qwen2.5-7b.yaml;32" 2>&1 | grep -v "^step\|Gloo" | tail -2 | cut -c1-900
date -u
ls $OUT
