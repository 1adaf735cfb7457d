# no regression (session 16, call 8: the final code, after the split resweep), defaults, nvidia-h100-x1, one call: after = this session's tree, before = f697dba (the last landing,
# an untracked _before/ carried with the call). ORDER: "after before" or "before after".
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for t in ${ORDER:-after before}; do
  d=.; [ $t = before ] && d=_before
  (cd $d && PYTHONPATH=. timeout 285 python experiments/bench_memory_plan.py --out $OUT/$t --steps 5 --case "7b_b16=configs/7b.yaml" --case "qwen7b_b128=configs/qwen2.5-7b.yaml" 2>&1 | tail -3)
done
