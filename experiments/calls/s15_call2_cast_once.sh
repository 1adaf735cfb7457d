# issue 27: call 1's 8B cases after each block's fp32 master is cast once a pass (not per micro-batch) and the plan
# counts micro-batch traffic: the whole GPU, 24 GB with a 72 GB host limit, 24 GB on the 128 GiB host; plus the
# stream_io probe again. Every decision auto, int8, clipping 1.0.
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
S="optim.clip_norm=1.0;train.final_checkpoint=false;optim.moments=int8;train.stream_copy=device"
for c in "8b_whole=configs/llama3.1-8b.yaml;$S" "8b_24_h72=configs/llama3.1-8b.yaml;$S;train.gpu_memory_gb=24;train.host_memory_gb=72" \
         "8b_24=configs/llama3.1-8b.yaml;$S;train.gpu_memory_gb=24"; do
  date -u
  timeout 140 python experiments/bench_memory_plan.py --out $OUT --steps 4 --case "$c" 2>&1 | tail -1 | cut -c1-300
done
date -u
timeout 120 python experiments/probe_stream_io.py --out $OUT --vocab-chunk 16384 --micro 16 --loss-chunk 4096 --steps 5 2>&1 | cut -c1-300
grep -h "^plan:" $OUT/*.log 2>/dev/null | cut -c1-400
