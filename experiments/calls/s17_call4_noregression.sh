# no regression (session 17, call 4), defaults, nvidia-h100-x1, one call: after = this session's tree (plan search,
# update_on compared, the chunk-aware pinned limit, kernels.sqnorm over rows above 2^28 values: Qwen2.5-7B's 545M-value
# embedding and head take it), before = a415f32 (the last landing, an untracked _before/ carried with the call).
# Prediction: the plans are identical (7B: host update, 6.28 s; Qwen2.5-7B: host update, 12.64 s), tokens/s within 1%.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for t in ${ORDER:-after before}; do
  d=.; [ $t = before ] && d=_before
  (cd $d && PYTHONPATH=. timeout 285 python experiments/bench_memory_plan.py --out $OUT/$t --steps 5 --case "7b_b16=configs/7b.yaml" --case "qwen7b_b128=configs/qwen2.5-7b.yaml" 2>&1 | tail -3)
done
