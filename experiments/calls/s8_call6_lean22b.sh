# issue 29 (b), second try: call 5 ran out of GPU memory after step 0 (3.92 GiB, plan 64.4 of 76 GB); the same
# config with train.gpu_memory_gb=66, every decision auto (the plan then keeps every 2nd block input)
export PYTHONPATH=.
timeout 560 python experiments/bench_memory_plan.py --out $OUT --steps 5 --case "lean22b_66=configs/lean-22b.yaml;train.gpu_memory_gb=66" 2>&1 | tail -3
grep -h "error" $OUT/train_*.log | cut -c1-300 | tail -2
