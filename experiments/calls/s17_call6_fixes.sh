# issue 43, session 17, call 6 (nvidia-h100-x1): three cases the landed code (a415f32) refused, run as the plan now
# takes them (or with the fix its refusal names applied), 3 steps each, clipping 1.0:
#   lean-22b on a 24 GB budget with a 128 GB host limit: refused before ("cannot hold this model ... 143 GB"); now
#     auto fits (resweep, device update, stream_io): plan 114.2 GB, predicted 43.1 s;
#   7B on a 10 GB budget with a 32 GB host limit: refused; the fix named, applied ("optim.moments=int8
#     train.stream_copy=device train.micro_batches=auto with a host limit of 69 GB"): plan 65.4 GB, predicted 8.6 s;
#   7B with optim.name=lion (no optim.kernel): refused before ("the fused kernel implements adamw only"); now
#     optim.kernel=auto takes optax.
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 560 python experiments/bench_memory_plan.py --out $OUT --steps 3 \
  --case "lean22b_g24_h128=configs/lean-22b.yaml;train.gpu_memory_gb=24;train.host_memory_gb=128;optim.clip_norm=1.0" \
  --case "7b_g10_h69_fix=configs/7b.yaml;train.gpu_memory_gb=10;train.host_memory_gb=69;optim.moments=int8;train.stream_copy=device;train.micro_batches=auto;optim.clip_norm=1.0" \
  --case "7b_lion=configs/7b.yaml;optim.name=lion;optim.clip_norm=1.0" 2>&1 | tail -5 | cut -c1-400
