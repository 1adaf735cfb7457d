# issue 27, session 16: Qwen2.5-14B shape 16x4096 at train.gpu_memory_gb=24 on the 128 GiB host, every decision auto,
# int8, clipping 1.0, 5 steps. The plan changed this session: M=8, activations on the GPU every 4th block, pinned_bf16
# with 2 groups on the GPU, stream_io, host update; 129.0 GB, predicted 17.58 s (s15: host_bf16, M=16, 19.66 s
# predicted, ran 19.52 s at 125.1 GB). Prediction: ~17.5 s, host within 129.0.
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
S="optim.clip_norm=1.0;train.final_checkpoint=false;optim.moments=int8;train.stream_copy=device"
timeout 500 python experiments/bench_memory_plan.py --out $OUT --steps 5 --case "14b_24=configs/qwen2.5-14b.yaml;$S;train.gpu_memory_gb=24" 2>&1 | tail -1 | cut -c1-300
grep -h "^plan:\|^step\|rror" $OUT/*.log 2>/dev/null | cut -c1-300
