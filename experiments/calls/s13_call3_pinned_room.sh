# issue 27: sizes.pinned_in_use with PINNED_REUSE_ROOM (3 GiB over the modelled exchange; call 2's 10 GB run ran out of
# XLA's pinned pool at a 30 GiB limit). Llama-3.1-8B shape 16x4096, int8, clipping 1.0, every decision auto:
# 10 GB (plan 88.7 GB host, limit 33 GiB), 24 GB with train.host_memory_gb=74 (the plan's leanest fast candidate:
# activations on the GPU every 4th input, bf16 hold in pageable memory + 11 groups on the GPU, 8.41 bytes/param),
# 24 GB (plan 83.8, limit 27 GiB); one process per case
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
date -u
timeout 170 python experiments/bench_gpu_budgets.py --out $OUT --shapes 8b --budgets 10 --steps 4 2>&1 | tail -1
date -u
S="optim.clip_norm=1.0;train.final_checkpoint=false;optim.moments=int8;train.stream_copy=device;train.gpu_memory_gb=24"
timeout 170 python experiments/bench_memory_plan.py --out $OUT --steps 4 --case "8b_24_host74=configs/llama3.1-8b.yaml;$S;train.host_memory_gb=74" 2>&1 | tail -1
date -u
timeout 170 python experiments/bench_gpu_budgets.py --out $OUT --shapes 8b --budgets 24 --steps 4 2>&1 | tail -1
grep -h "^step\|^plan:\|done\|rror" $OUT/train_*.log | cut -c1-300
