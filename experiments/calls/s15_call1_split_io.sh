# issue 27: (a) stream_io's head gathered once a step in the background (engine/io.py), resident vs streamed on a
# 2-layer slice of the 8B shape (vocabulary chunk 16384, as the engine runs it); (b) Llama-3.1-8B shape 16x4096,
# int8, clipping 1.0, every decision auto: the whole GPU (the reference), 24 GB with a 72 GB host limit (the plan:
# pinned activations with the last 25 blocks' inputs on the GPU, every gradient held on the GPU in bf16, stream_io,
# host update; 64.5 GB host, 8.03 bytes/param, predicted 7.80 s), 24 GB on the 128 GiB host (the plan: host update,
# pinned hold + 26 groups on the GPU, 15 blocks' inputs on the GPU, predicted 7.29 s)
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
date -u
timeout 150 python experiments/probe_stream_io.py --out $OUT --vocab-chunk 16384 --micro 16 --loss-chunk 4096 --steps 5 2>&1 | cut -c1-400
S="optim.clip_norm=1.0;train.final_checkpoint=false;optim.moments=int8;train.stream_copy=device"
for c in "8b_whole=configs/llama3.1-8b.yaml;$S" "8b_24_h72=configs/llama3.1-8b.yaml;$S;train.gpu_memory_gb=24;train.host_memory_gb=72" \
         "8b_24=configs/llama3.1-8b.yaml;$S;train.gpu_memory_gb=24"; do
  date -u
  timeout 140 python experiments/bench_memory_plan.py --out $OUT --steps 4 --case "$c" 2>&1 | tail -1 | cut -c1-300
done
grep -h "^step\|^plan:\|done\|rror" $OUT/*.log 2>/dev/null | cut -c1-300
