# session 25, call 3, nvidia-h200 (issues 44, 42, 45): the one-GPU no-regression pair, defaults (CUDA_VISIBLE_DEVICES=0,
# train.devices=1): after = this tree, before = 6072af1 (the after of s22 call 3, the last pair), an untracked _before/ carried with the call, made with
#   rm -rf _before && git archive 6072af1 | (mkdir _before && tar -x -C _before)
# Prediction: the one-GPU default plans identical before and after (this round changed several-GPU paths and the bench);
# tokens/s within the ~4% run-to-run spread (s22: 7B 10,490 / 10,678; Qwen 11,238 / 11,290).
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
date -u
run() {  # tree label cases...
  local d=$1 label=$2; shift 2
  (cd $d && PYTHONPATH=. timeout 250 python experiments/bench_memory_plan.py --out $OUT/$label --steps 5 "$@" 2>&1 | tail -3 | cut -c1-600)
}
run . after --case "7b_b16=configs/7b.yaml;train.devices=1" --case "qwen7b_b128=configs/qwen2.5-7b.yaml;train.devices=1"
run _before before --case "7b_b16=configs/7b.yaml;train.devices=1" --case "qwen7b_b128=configs/qwen2.5-7b.yaml;train.devices=1"
date -u
