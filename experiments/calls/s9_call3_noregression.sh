# issue 25 (and every issue's last line): no regression, defaults, before = d23958d (this session's start, in an
# untracked _before/ carried with the call) and after = the tree; after first this time, then before
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
PYTHONPATH=. timeout 280 python experiments/bench_memory_plan.py --out $OUT/after --steps 5 --case "7b_b16=configs/7b.yaml" --case "qwen7b_b128=configs/qwen2.5-7b.yaml" 2>&1 | tail -4
cd _before && PYTHONPATH=. timeout 280 python experiments/bench_memory_plan.py --out $OUT/before --steps 5 --case "7b_b16=configs/7b.yaml" --case "qwen7b_b128=configs/qwen2.5-7b.yaml" 2>&1 | tail -4
