# issue 27: where the 8B's step at 24 GB with a 72 GB host limit goes (the plan: 16 micro-batches, pinned activations
# with the last 25 blocks' inputs on the GPU, every gradient held on the GPU in bf16, stream_io, host update): the
# last step's timeline (train.trace_step); and the stream_io probe with the head staged in bf16
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
S="optim.clip_norm=1.0;train.final_checkpoint=false;optim.moments=int8;train.stream_copy=device"
date -u
timeout 200 python experiments/bench_memory_plan.py --out $OUT --steps 4 --trace --case "8b_24_h72=configs/llama3.1-8b.yaml;$S;train.gpu_memory_gb=24;train.host_memory_gb=72" 2>&1 | tail -1 | cut -c1-300
date -u
timeout 120 python experiments/probe_stream_io.py --out $OUT --vocab-chunk 16384 --micro 16 --loss-chunk 4096 --steps 5 2>&1 | cut -c1-300
ls $OUT
