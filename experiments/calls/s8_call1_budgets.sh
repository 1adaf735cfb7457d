set -x
export PYTHONPATH=.
nvidia-smi --query-gpu=name,memory.total --format=csv
C="configs/llama3.1-8b.yaml;optim.clip_norm=1.0"
python experiments/bench_memory_plan.py --out $OUT --steps 4 --trace --case "b24_auto=$C;train.gpu_memory_gb=24" 2>&1 | tail -5
python experiments/bench_memory_plan.py --out $OUT --steps 4 --trace --case "b24_actdev_k4_io=$C;train.gpu_memory_gb=24;train.micro_batches=16;train.activations=device;train.boundary_every=4;train.grad_hold=host_bf16;train.stream_io=true;train.update_on=host" 2>&1 | tail -5
TF_CPP_MIN_LOG_LEVEL=0 timeout 200 python experiments/bench_memory_plan.py --out $OUT --steps 3 --case "b10_auto=$C;train.gpu_memory_gb=10" 2>&1 | tail -5
for f in $OUT/*.json; do python - "$f" <<'PY'
import json,sys
r=json.load(open(sys.argv[1]))
if isinstance(r,dict) and "case" in r:
    print(r["case"], r.get("rc"), r.get("steps_done"), r.get("step_s_all"), r.get("tokens_per_s"), "gpu", r.get("peak_gpu_gb"), r.get("plan_gpu_gb"), "host", r.get("peak_host_rss_gb"), r.get("plan_host_gb"), r.get("decisions"))
PY
done
grep -h "timeline of step" $OUT/train_*.log
grep -h -i "out of memory\|Sum Total\|InUse\|Chunks of size\|limit:\|bytes_in_use\|largest_free" $OUT/train_b10_auto.log | tail -60
