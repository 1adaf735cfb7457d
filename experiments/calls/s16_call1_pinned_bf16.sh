# issue 27, session 16: the pinned bf16 hold. Llama-3.1-8B shape 16x4096, int8, clipping 1.0, every decision auto,
# one call (6 steps each, 3-6 timed; the 10 GB case 5 steps):
#   whole GPU (the reference; plan unchanged: 52.0 GB host, predicted 7.20 s);
#   24 GB, 72 GB host limit: M=8, the last 23 blocks' inputs on the GPU, pinned_bf16 with 29 groups on the GPU,
#     stream_io, host update. Plan 64.4 GB (8.03 B/param; s15's pinned fp32 plan 68.7, ran 67.0), predicted 8.25 s.
#     Prediction: ~7.9 s as in s15 (0.86x), host ~63 GB;
#   24 GB, 128 GiB host: M=4, last 14 on the GPU, pinned_bf16 with 24 groups on the GPU, device update. Plan 73.0 GB
#     (s15: bf16 pageable hold, plan 75.8, ran 71.8), predicted 7.52 s. Prediction: ~7.2 s, host ~71 GB;
#   10 GB, 128 GiB host: M=8, pinned_bf16, host update. Plan 80.1 GB (9.98 B/param; s15 pinned fp32: plan 89.8, ran
#     88.7), predicted 8.38 s. Prediction: ~7.6 s as in s15, host ~79 GB.
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
S="optim.clip_norm=1.0;train.final_checkpoint=false;optim.moments=int8;train.stream_copy=device"
for c in "8b_whole=configs/llama3.1-8b.yaml;$S" "8b_24_h72=configs/llama3.1-8b.yaml;$S;train.gpu_memory_gb=24;train.host_memory_gb=72" \
         "8b_24=configs/llama3.1-8b.yaml;$S;train.gpu_memory_gb=24" "8b_10=configs/llama3.1-8b.yaml;$S;train.gpu_memory_gb=10"; do
  date -u
  timeout 140 python experiments/bench_memory_plan.py --out $OUT --steps 6 --case "$c" 2>&1 | tail -1 | cut -c1-300
done
grep -h "^plan:\|^step" $OUT/*.log 2>/dev/null | cut -c1-300
