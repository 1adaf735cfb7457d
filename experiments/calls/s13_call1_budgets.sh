# issue 27: Llama-3.1-8B shape 16x4096, int8, clipping 1.0, every decision auto, at the whole GPU, 24 GB and 10 GB
# (the default host limit), one bench process per budget (each writes its JSON before the next starts): the plan of
# 3486e33 (24 GB: M=8, pinned hold with 14 groups on the GPU)
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for b in whole 24 10; do
  date -u
  timeout 185 python experiments/bench_gpu_budgets.py --out $OUT --shapes 8b --budgets $b --steps 4 2>&1 | tail -2
done
grep -h "^step\|^plan:\|decisions\|done\|error" $OUT/train_*.log | cut -c1-300
