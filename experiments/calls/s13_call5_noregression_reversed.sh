# call 4 again with the order reversed (before = ce9ed8d first, then this session's tree): call 4 ran the 7B 3.6%
# slower after than before, with "after" first on a fresh machine
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
(cd _before && PYTHONPATH=. timeout 285 python experiments/bench_memory_plan.py --out $OUT/before --steps 5 --case "7b_b16=configs/7b.yaml" --case "qwen7b_b128=configs/qwen2.5-7b.yaml" 2>&1 | tail -4)
PYTHONPATH=. timeout 285 python experiments/bench_memory_plan.py --out $OUT/after --steps 5 --case "7b_b16=configs/7b.yaml" --case "qwen7b_b128=configs/qwen2.5-7b.yaml" 2>&1 | tail -4
