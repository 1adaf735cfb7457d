# issue 45, session 19, call 2 (the same nvidia-h200-x4 machine, warm): the one-GPU baseline of call 1's 70B (8 x 4096,
# the GPU named by CUDA_VISIBLE_DEVICES=0, every decision auto; 4 steps), then Qwen2.5-7B 128 x 1024 per GPU on 1 and 4
# GPUs (weak) and 128 x 1024 a step on 4 (strong). Prediction: 70B one GPU 32.4 s (s18: 31.5 s); Qwen2.5-7B 4 GPUs
# weak: host update as before (12.6 s); strong: update_on=device split 4 ways, 3.19 s (host update: 4.39 s).
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u
CUDA_VISIBLE_DEVICES=0 timeout 330 python experiments/bench_memory_plan.py --out $OUT --steps 4 \
  --case "70b_b8_cvd0=configs/llama2-70b.yaml;train.batch_size=8" 2>&1 | tail -2 | cut -c1-600
date -u
timeout 240 python experiments/bench_data_parallel.py --out $OUT/dp --gpus 1,4 --runs weak,strong --steps 5 \
  --model "qwen7b_b128=configs/qwen2.5-7b.yaml;128" 2>&1 | tail -4 | cut -c1-600
date -u
grep -h "^plan\|^step\|rror\|Killed" $OUT/*.log $OUT/dp/*.log 2>/dev/null | cut -c1-300 | tail -30
