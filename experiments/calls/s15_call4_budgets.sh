# issue 27: Llama-3.1-8B shape 16x4096, int8, clipping 1.0, every decision auto, one call: the whole GPU (the
# reference), 24 GB with a 72 GB host limit (the plan: 8 micro-batches, pinned activations with the last 23 blocks'
# inputs on the GPU, pinned hold with 29 groups on the GPU, stream_io, host update; 68.7 GB, 8.56 bytes/param,
# predicted 8.24 s), 24 GB on the 128 GiB host (4 micro-batches, the last 14 blocks' inputs on the GPU, bf16 pageable
# hold + 24 groups on the GPU, device update; 75.8 GB, predicted 7.62 s). 6 steps each (steps 3-6 timed).
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
S="optim.clip_norm=1.0;train.final_checkpoint=false;optim.moments=int8;train.stream_copy=device"
for c in "8b_whole=configs/llama3.1-8b.yaml;$S" "8b_24_h72=configs/llama3.1-8b.yaml;$S;train.gpu_memory_gb=24;train.host_memory_gb=72" \
         "8b_24=configs/llama3.1-8b.yaml;$S;train.gpu_memory_gb=24"; do
  date -u
  timeout 170 python experiments/bench_memory_plan.py --out $OUT --steps 6 --case "$c" 2>&1 | tail -1 | cut -c1-300
done
grep -h "^plan:\|^step" $OUT/*.log 2>/dev/null | cut -c1-300
