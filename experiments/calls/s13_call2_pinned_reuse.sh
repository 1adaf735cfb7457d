# issue 27: the plan's pinned pool counts held gradients landing where the activations they follow were (sizes.pinned_in_use):
# XLA's pinned-host limit is cut to that peak x 1.02 + 2 GiB. Llama-3.1-8B shape 16x4096, int8, clipping 1.0, every
# decision auto: 10 GB and 24 GB on this host (plans 86.6 / ~80 GB host), then 24 GB with train.host_memory_gb=80
# (the plan takes boundary_every=2 with pinned activations and hold: 9.5 bytes/param); one process per case
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for b in 10 24; do
  date -u
  timeout 175 python experiments/bench_gpu_budgets.py --out $OUT --shapes 8b --budgets $b --steps 4 2>&1 | tail -1
done
date -u
S="optim.clip_norm=1.0;train.final_checkpoint=false;optim.moments=int8;train.stream_copy=device;train.gpu_memory_gb=24"
timeout 175 python experiments/bench_memory_plan.py --out $OUT --steps 4 --case "8b_24_host80=configs/llama3.1-8b.yaml;$S;train.host_memory_gb=80" 2>&1 | tail -2
grep -h "^step\|^plan:\|done\|rror" $OUT/train_*.log | cut -c1-300
