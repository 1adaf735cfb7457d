# issue 28: 524,288 tokens on nvidia-h200 (141 GB GPU, 128 GiB host), Llama-3.1-8B shape, int8, clip 1.0, every
# decision auto, after the plan's stream_io rows (the H100's 8-layer slice, call s11-5, ran host 62.4 GB against 58.5)
# and the tiled working-set refit: the full-depth plan on this machine, then the 8-layer slice, 2 steps
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -m megatrain_jax plan configs/llama3.1-8b-512k.yaml --json > $OUT/plan_512k_full_depth.json 2>$OUT/plan_512k_full_depth.err; echo "full-depth plan rc $?"
python - <<'PY'
import json, os
p = json.load(open(os.environ["OUT"] + "/plan_512k_full_depth.json"))
print("full depth: fits", p.get("fits"), "host", round(p["host_need"] / 1e9, 1), "gpu", round((p["gpu_need"] or 0) / 1e9, 1),
      "of", round((p["gpu_budget"] or 0) / 1e9, 1), "predicted step", round(p["step"]["predicted_step_s"], 1))
PY
timeout 520 python experiments/bench_memory_plan.py --out $OUT --steps 2 --case "l31_8b_512k_8layers=configs/llama3.1-8b-512k.yaml;model.num_layers=8" 2>&1 | tail -3
grep -h "^step\|^plan\|done\|error" $OUT/train_*.log | cut -c1-400
