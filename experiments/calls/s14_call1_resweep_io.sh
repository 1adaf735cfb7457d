# issue 27: grad_hold=resweep with stream_io (no hold, the head and embedding not resident), chosen by the plan where the
# host is small: (a) Llama-3.1-8B shape 8x4096 at a 10 GB budget with a 64 GB host limit (plan 55.4 GB host, 8.4 GB GPU,
# activations on the GPU every 4th input, blocks_queued=1); (b) Llama-3.2-3B shape 16x4096 at 10 GB with a 32 GB host
# limit (plan 23.9 GB, 8.2 GB). Every decision auto, int8 moments, clipping 1.0.
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
S="optim.clip_norm=1.0;train.final_checkpoint=false;optim.moments=int8;train.stream_copy=device"
timeout 280 python experiments/bench_memory_plan.py --out $OUT --steps 4 \
  --case "8b_10gb_h64_b8=configs/llama3.1-8b.yaml;$S;train.gpu_memory_gb=10;train.host_memory_gb=64;train.batch_size=8" 2>&1 | tail -2
timeout 250 python experiments/bench_memory_plan.py --out $OUT --steps 4 \
  --case "3b_10gb_h32=configs/3b.yaml;$S;train.gpu_memory_gb=10;train.host_memory_gb=32;train.batch_size=16;train.micro_batches=auto" 2>&1 | tail -2
grep -h "^step\|^plan:\|decisions\|done\|rror" $OUT/*.log 2>/dev/null | cut -c1-240
