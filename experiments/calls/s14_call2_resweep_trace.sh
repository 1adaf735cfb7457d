# issue 27: why call 1's Llama-3.2-3B resweep + stream_io run took 27.4 s a step (plan 6.8 s) and peaked at 9.9 GB of GPU
# (plan 8.2): the same case with the last block's outputs let go after the first loss (they no longer wait for a second
# one), with step 3's timeline (train.trace_step=3); then the same placement with a host_bf16 hold instead of the
# resweep (host limit 64 GB so that it fits), traced too.
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
S="optim.clip_norm=1.0;train.final_checkpoint=false;optim.moments=int8;train.stream_copy=device;train.gpu_memory_gb=10;train.batch_size=16;train.trace_step=3"
timeout 200 python experiments/bench_memory_plan.py --out $OUT --steps 3 \
  --case "3b_10gb_h32_resweep=configs/3b.yaml;$S;train.host_memory_gb=32;train.micro_batches=auto" 2>&1 | tail -2
timeout 200 python experiments/bench_memory_plan.py --out $OUT --steps 3 \
  --case "3b_10gb_hostbf16=configs/3b.yaml;$S;train.host_memory_gb=64;train.micro_batches=16;train.grad_hold=host_bf16;train.activations=device;train.boundary_every=4;train.stream_io=true;train.update_on=host;train.loss_chunk=4096" 2>&1 | tail -2
grep -h "^step\|^plan:\|timeline\|exposed\|done\|rror" $OUT/*.log 2>/dev/null | cut -c1-300
ls $OUT
