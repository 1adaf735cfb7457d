# issue 27: where resweep + stream_io puts its GPU bytes (calls 1-2 ran past the plan), against a host_bf16 hold with
# the same placement; the 3B shape, 16 x 4096, XLA's pool unbounded (experiments/probe_resweep_io.py).
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 420 python experiments/probe_resweep_io.py --out $OUT 2>&1 | grep -v "^W1\|Warning\|warn"
