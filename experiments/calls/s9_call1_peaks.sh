# issues 27/29: what holds the GPU at the peak the plan under-counts (8B at 10 and 24 GB with XLA's pool
# whole, so the 10 GB plan shows its real need instead of running out; the lean 22B that ran out after step 0)
export PYTHONPATH=. PYTHONUNBUFFERED=1
COMMON="--set optim.clip_norm=1.0 --set train.final_checkpoint=false --set model.init=fast --set optim.schedule.kind=constant --set optim.schedule.warmup_steps=0 --set train.log_every=1"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 150 python experiments/probe_gpu_peak.py configs/llama3.1-8b.yaml --pool-whole --out $OUT/peak_8b_10.json $COMMON --set train.gpu_memory_gb=10 --set train.steps=3 --set train.out_dir=/tmp/p10 2>&1 | grep -v "^W1125\|^I1125" | tail -22
timeout 150 python experiments/probe_gpu_peak.py configs/llama3.1-8b.yaml --pool-whole --out $OUT/peak_8b_24.json $COMMON --set train.gpu_memory_gb=24 --set train.steps=3 --set train.out_dir=/tmp/p24 2>&1 | grep -v "^W1125\|^I1125" | tail -22
timeout 240 python experiments/probe_gpu_peak.py configs/lean-22b.yaml --out $OUT/peak_lean22b.json $COMMON --set train.steps=3 --set train.out_dir=/tmp/p22 2>&1 | grep -v "^W1125\|^I1125" | tail -22
