# session 26, call 3, nvidia-h200 (issues 44, 42, 45): the one-GPU no-regression pair, defaults (CUDA_VISIBLE_DEVICES=0,
# train.devices=1): after = this tree, before = 0fee47b (main before this session), an untracked _before/ carried with the call, made with
#   rm -rf _before && git archive 0fee47b | (mkdir _before && tar -x -C _before)
# Prediction: the one-GPU default plans identical before and after (this session changed the resweep path only);
# tokens/s within the ~4% run-to-run spread (s25: 7B 10,948 / 10,856; Qwen 11,406 / 11,283).
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
date -u
run() {  # tree label cases...
  local d=$1 label=$2; shift 2
  (cd $d && PYTHONPATH=. timeout 225 python experiments/bench_memory_plan.py --out $OUT/$label --steps 5 "$@" 2>&1 | tail -3 | cut -c1-600)
}
run . after --case "7b_b16=configs/7b.yaml;train.devices=1" --case "qwen7b_b128=configs/qwen2.5-7b.yaml;train.devices=1"
run _before before --case "7b_b16=configs/7b.yaml;train.devices=1" --case "qwen7b_b128=configs/qwen2.5-7b.yaml;train.devices=1"
date -u
