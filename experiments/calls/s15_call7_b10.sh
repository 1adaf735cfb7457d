# issue 27: Llama-3.1-8B shape 16x4096 at train.gpu_memory_gb=10 on the 128 GiB host, every decision auto, int8,
# clipping 1.0 (the plan: 8 micro-batches, pinned activations with the last block's input on the GPU, pinned hold,
# stream_io, host update; 89.8 GB, predicted 8.37 s): within its plan after this session's changes?
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
S="optim.clip_norm=1.0;train.final_checkpoint=false;optim.moments=int8;train.stream_copy=device"
timeout 300 python experiments/bench_memory_plan.py --out $OUT --steps 5 --case "8b_10=configs/llama3.1-8b.yaml;$S;train.gpu_memory_gb=10" 2>&1 | tail -1 | cut -c1-300
grep -h "^plan:\|^step" $OUT/*.log 2>/dev/null | cut -c1-300
