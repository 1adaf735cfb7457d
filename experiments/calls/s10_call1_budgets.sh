# issue 27: the 8B (16 x 4096, clipping 1.0, every decision auto) at the whole GPU, 24 GB and 10 GB with XLA's
# pinned-host pool limit cut to the plan's pinned arrays x 1.02 + 2 GiB (was x 1.5 + 2 GiB); one bench process
# per budget so that each writes its JSON before the next starts
export PYTHONPATH=. PYTHONUNBUFFERED=1
for b in whole 24 10; do
  timeout 190 python experiments/bench_gpu_budgets.py --out $OUT --shapes 8b --budgets $b --steps 5 2>&1 | tail -2
done
