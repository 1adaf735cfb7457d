# issue 27: the 8B at 10 GB (pinned activation copies bounded to 3 layers in flight) and the Qwen2.5-14B shape at
# 24 GB, every decision auto, clipping 1.0 (bench_gpu_budgets adds int8 moments where the host needs them)
export PYTHONPATH=.
timeout 210 python experiments/bench_gpu_budgets.py --out $OUT --shapes 8b --budgets 10 --steps 5 2>&1 | tail -3
timeout 330 python experiments/bench_gpu_budgets.py --out $OUT --shapes 14b --budgets 24 --steps 5 2>&1 | tail -3
for f in $OUT/budget_*.json; do python - "$f" <<'PY'
import json,sys
r=json.load(open(sys.argv[1]))
print(r.get("case"), "rc", r.get("rc"), "steps", r.get("steps_done"), [round(x,2) for x in r.get("step_s_all") or []], "tok/s", r.get("tokens_per_s"), "TFLOPS", r.get("model_tflops"), "gpu", r.get("peak_gpu_gb"), "plan", r.get("plan_gpu_gb"), "host", r.get("peak_host_rss_gb"), "plan", r.get("plan_host_gb"))
print("  ", {k: v for k, v in (r.get("decisions") or {}).items() if k not in ("attention_summary",)})
PY
done
grep -h "error\|Out of memory" $OUT/train_*.log | cut -c1-400 | tail -5
