# issue 27: the 8B shape at the whole GPU, 24 GB and 10 GB, every decision auto (device-side updates with
# stream_io now searched; updates-after-norm in the predicted step; 4 pinned activation layers on the GPU)
export PYTHONPATH=.
C="configs/llama3.1-8b.yaml;optim.clip_norm=1.0"
timeout 170 python experiments/bench_memory_plan.py --out $OUT --steps 5 --case "whole=$C" 2>&1 | tail -2
timeout 200 python experiments/bench_memory_plan.py --out $OUT --steps 5 --trace --case "b24=$C;train.gpu_memory_gb=24" 2>&1 | tail -2
JAX_LOG_COMPILES=1 timeout 200 python experiments/bench_memory_plan.py --out $OUT --steps 4 --case "b10=$C;train.gpu_memory_gb=10" 2>&1 | tail -2
for f in $OUT/plan_*.json; do python - "$f" <<'PY'
import json,sys
r=json.load(open(sys.argv[1]))
print(r["case"], "rc", r.get("rc"), "steps", r.get("steps_done"), [round(x,2) for x in r.get("step_s_all") or []], "tok/s", r.get("tokens_per_s"), "gpu", r.get("peak_gpu_gb"), "plan", r.get("plan_gpu_gb"), "host", r.get("peak_host_rss_gb"), "plan", r.get("plan_host_gb"), "pred", (r.get("plan") or {}).get("step",{}).get("predicted_step_s"))
print("  ", {k: v for k, v in (r.get("decisions") or {}).items() if k not in ("attention_summary",)})
PY
done
grep -h "timeline of step" $OUT/train_*.log
grep -h "Out of memory\|Compiling.*lambda\|Finished.*lambda" $OUT/train_b10.log | cut -c1-400 | tail -40
