# issues 27/29: the engine paced to the GPU (weights.Pace), write-backs and pageable-hold copies bounded, the plan
# counting them: the 8B at 10 GB (pool whole: its real peak against the plan), the lean 22B, then the user's
# runs at whole / 24 / 10 GB (10: blocks_queued=1) and their speed
export PYTHONPATH=. PYTHONUNBUFFERED=1
COMMON="--set optim.clip_norm=1.0 --set train.final_checkpoint=false --set model.init=fast --set optim.schedule.kind=constant --set optim.schedule.warmup_steps=0 --set train.log_every=1"
timeout 110 python experiments/probe_gpu_peak.py configs/llama3.1-8b.yaml --pool-whole --out $OUT/peak_8b_10.json $COMMON --set train.gpu_memory_gb=10 --set train.steps=3 --set train.out_dir=/tmp/p10 2>&1 | grep -v "^W1125\|^I1125" | tail -12
timeout 170 python experiments/probe_gpu_peak.py configs/lean-22b.yaml --out $OUT/peak_lean22b.json $COMMON --set train.steps=3 --set train.out_dir=/tmp/p22 2>&1 | grep -v "^W1125\|^I1125" | tail -14
timeout 300 python experiments/bench_gpu_budgets.py --out $OUT --shapes 8b --budgets whole,24,10 --steps 5 2>&1 | tail -5
