# session 26, call 4, nvidia-h200 (issue 42's no-regression bar): call 3's 7B pair again in the other order (before
# first), in the session's last 288 s of device time: call 3 ran the after first and measured 0.970x (steps 6.40, 6.93,
# 6.36 s against 6.21, 6.18, 6.24) on a path this session's change does not touch (gpu_fp32 hold, host update).
# before = 0fee47b, an untracked _before/ carried with the call (rm -rf _before && git archive 0fee47b | (mkdir _before && tar -x -C _before)).
# Prediction: within 2% either way.
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0
date -u
run() {  # tree label cases...
  local d=$1 label=$2; shift 2
  (cd $d && PYTHONPATH=. timeout 105 python experiments/bench_memory_plan.py --out $OUT/$label --steps 5 "$@" 2>&1 | tail -2 | cut -c1-600)
}
run _before before --case "7b_b16=configs/7b.yaml;train.devices=1"
run . after --case "7b_b16=configs/7b.yaml;train.devices=1"
date -u
