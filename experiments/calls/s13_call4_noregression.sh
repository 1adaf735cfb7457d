# no regression (every issue's last line), defaults, nvidia-h100-x1, one call: after = this session's tree (the plan's
# pinned reuse and staging rows; the engine's model-free helpers jitted once per process), before = ce9ed8d (the last
# landing, in an untracked _before/ carried with the call); the plans of both cases are identical at both commits
# (checked on the CPU)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
PYTHONPATH=. timeout 285 python experiments/bench_memory_plan.py --out $OUT/after --steps 5 --case "7b_b16=configs/7b.yaml" --case "qwen7b_b128=configs/qwen2.5-7b.yaml" 2>&1 | tail -4
cd _before && PYTHONPATH=. timeout 285 python experiments/bench_memory_plan.py --out $OUT/before --steps 5 --case "7b_b16=configs/7b.yaml" --case "qwen7b_b128=configs/qwen2.5-7b.yaml" 2>&1 | tail -4
