# issue 27, session 16, after 8f04f3c (XLA's pinned-pool limit counts a pinned_bf16 hold at 2 bytes a value): every
# decision auto, clipping 1.0 (the configs' own), one call:
#   Llama-3.1-8B 16x4096 int8 at 10 GB on the 128 GiB host: M=8, pinned_bf16, host update; plan 80.1 GB, predicted
#     8.38 s. Prediction: ~7.7 s (call 1), host within 5% of 80.1 (call 1, with the limit taken at 4 bytes: 88.7);
#   Llama-3.2-3B shape (configs/3b.yaml, fp32 moments) at 10 GB: M=1, the last 8 blocks' inputs on the GPU,
#     pinned_bf16 with 9 groups on the GPU; plan 63.5 GB, predicted 2.13 s;
#   Qwen2.5-7B 128x1024 (configs/qwen2.5-7b.yaml, fp32 moments) at 24 GB: M=4, pinned activations every 2nd block,
#     pinned_bf16, stream_io; plan 122.9 GB, predicted 14.32 s (before this session: resweep, 23.2 s predicted).
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
S="optim.clip_norm=1.0;train.final_checkpoint=false;optim.moments=int8;train.stream_copy=device"
date -u
timeout 150 python experiments/bench_memory_plan.py --out $OUT --steps 6 --case "8b_10=configs/llama3.1-8b.yaml;$S;train.gpu_memory_gb=10" 2>&1 | tail -1 | cut -c1-300
date -u
timeout 120 python experiments/bench_memory_plan.py --out $OUT --steps 6 --case "3b_10=configs/3b.yaml;train.final_checkpoint=false;train.gpu_memory_gb=10" 2>&1 | tail -1 | cut -c1-300
date -u
timeout 250 python experiments/bench_memory_plan.py --out $OUT --steps 4 --case "qwen7b_24=configs/qwen2.5-7b.yaml;train.final_checkpoint=false;train.gpu_memory_gb=24" 2>&1 | tail -1 | cut -c1-300
grep -h "^plan:\|^step\|rror" $OUT/*.log 2>/dev/null | cut -c1-300
