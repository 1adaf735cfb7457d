# no regression (session 18, call 5), defaults, nvidia-h100-x1, one call: after = this session's tree (the optax cost
# compiled in a CPU-only child, the resweep that runs no block, the placement objects in the engine, one file per
# model family, LoRA's plan in plan/), before = b5fa91a (the last landing, an untracked _before/ carried with the call).
# Prediction: the plans are identical (the regression set of 222 plans is), tokens/s within 1%.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for t in ${ORDER:-after before}; do
  d=.; [ $t = before ] && d=_before
  (cd $d && PYTHONPATH=. timeout 285 python experiments/bench_memory_plan.py --out $OUT/$t --steps 5 --case "7b_b16=configs/7b.yaml" --case "qwen7b_b128=configs/qwen2.5-7b.yaml" 2>&1 | tail -3)
done
