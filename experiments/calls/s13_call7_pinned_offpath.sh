# issue 27, off the benchmarked path of the pinned reuse (sizes.pinned_in_use + PINNED_REUSE_ROOM): (a) the case that ran
# out of XLA's pinned pool in call 2 without the room, forced: 8B at 24 GB, M=4, pinned activations every 2nd input,
# pinned hold (+17 groups on the GPU), stream_io, loss chunk 2048 (plan 79.5 GB host, pinned limit 23 GiB);
# (b) Llama-3.2-3B shape 16x4096 at 10 GB, every decision auto (M=4, pinned activations and hold; plan 69.2 GB, 20 GiB)
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
S="optim.clip_norm=1.0;train.final_checkpoint=false;optim.moments=int8;train.stream_copy=device;train.gpu_memory_gb=24"
F="train.micro_batches=4;train.activations=pinned_host;train.boundary_every=2;train.grad_hold=pinned_host;train.stream_io=true;train.loss_chunk=2048"
timeout 150 python experiments/bench_memory_plan.py --out $OUT --steps 4 --case "8b_24_k2_pinned=configs/llama3.1-8b.yaml;$S;$F" 2>&1 | tail -1
timeout 120 python experiments/bench_gpu_budgets.py --out $OUT --shapes 3b --budgets 10 --steps 4 2>&1 | tail -1
grep -h "^step\|^plan:\|done\|rror" $OUT/train_*.log | cut -c1-220
