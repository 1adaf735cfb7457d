# issue 28 (session 11): the 524,288-token 8-layer slice of the Llama-3.1-8B shape on nvidia-h200, 2 steps, every
# decision auto, int8 moments, clipping 1.0, run in-process by probe_gpu_peak.py: XLA's peak bytes in use against the
# plan (session 10: 99.5 GB vs 98.8), and what is live on the GPU at the highest sample (which phase, which arrays)
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -m megatrain_jax plan configs/llama3.1-8b-512k.yaml --json > $OUT/plan_512k_full_depth.json 2>$OUT/plan_512k_full_depth.err; echo "full-depth plan rc $?"
timeout 560 python experiments/probe_gpu_peak.py configs/llama3.1-8b-512k.yaml --out $OUT/probe_512k_8layers.json \
  --set model.num_layers=8 --set model.init=fast --set train.steps=2 --set train.final_checkpoint=false \
  --set train.log_every=1 --set train.out_dir=/tmp/probe512k \
  --set optim.schedule.kind=constant --set optim.schedule.warmup_steps=0 2>&1 | grep -v "^ *$" | grep -iv warn | tail -40
