# issue 45, session 21, call 5 (nvidia-h100-x4, fresh; the session's last 4.5 device minutes): Qwen2.5-7B weak4
# (128 x 1024 per GPU, 4 GPUs) with kept residuals on several GPUs (new in 011a5b4: train.keep_residuals=3, the most
# the plan takes; auto keeps none with several GPUs until this is measured) and train.fetch=split, 4 steps.
# Prediction (plan, H100 rates): 12.28 s against 12.59 without them (2.5% faster than call 4's 12.13 s: ~11.8 s).
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u
timeout 200 python experiments/bench_data_parallel.py --out $OUT --gpus 4 --runs weak --host-gb 480 --steps 4 \
  --model "qwen7b_split_kept3=configs/qwen2.5-7b.yaml;128;train.fetch=split;train.keep_residuals=3" 2>&1 | grep -v "^step\|Gloo" | tail -3 | cut -c1-900
date -u
grep -h "^step\|rror" $OUT/*.log | cut -c1-160 | tail -6
