# issue 27, off the benchmarked path: the split placement with the head resident (Llama-3.2-3B 16x4096 at 24 GB with a
# 64 GB host limit: M=4, the last 10 blocks' inputs on the GPU, pinned hold + 29 groups on the GPU, plan 30.2 GB,
# predicted 3.21 s) and the 8B at 16 GB on the 128 GiB host (M=4, pinned activations, the last block's on the GPU,
# pinned hold, stream_io; plan 90.0 GB, predicted 7.51 s). Every decision auto, int8, clipping 1.0.
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
S="optim.clip_norm=1.0;train.final_checkpoint=false;optim.moments=int8;train.stream_copy=device"
timeout 200 python experiments/bench_memory_plan.py --out $OUT --steps 5 --case "3b_24_h64=configs/3b.yaml;$S;train.gpu_memory_gb=24;train.host_memory_gb=64;train.batch_size=16;train.micro_batches=auto" 2>&1 | tail -1 | cut -c1-300
timeout 250 python experiments/bench_memory_plan.py --out $OUT --steps 5 --case "8b_16=configs/llama3.1-8b.yaml;$S;train.gpu_memory_gb=16" 2>&1 | tail -1 | cut -c1-300
grep -h "^plan:\|^step" $OUT/*.log 2>/dev/null | cut -c1-300
