# issue 27: the 3B resweep + stream_io case of call 6 ran 2.9 GB over its host plan (30.0 vs 27.1). The plan now counts
# the head chunks' staging (3 chunks) and two chunk gradients in XLA's pinned pool, and a segment's parked recomputed
# inputs (boundary_every > 2); call 6's placement now plans 30.9 GB (it measured 30.0). The same case, auto: the plan now
# keeps the activations on the GPU (25.5 GB host, 8.3 GB GPU, blocks_queued=1).
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
S="optim.clip_norm=1.0;train.final_checkpoint=false;optim.moments=int8;train.stream_copy=device;train.gpu_memory_gb=10;train.host_memory_gb=32;train.batch_size=16"
timeout 200 python experiments/bench_memory_plan.py --out $OUT --steps 4 --case "3b_10gb_h32=configs/3b.yaml;$S;train.micro_batches=auto" 2>&1 | tail -1
grep -h "^plan:\|done\|rror" $OUT/*.log 2>/dev/null | cut -c1-260
