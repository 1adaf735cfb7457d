# session 22, call 3, nvidia-h200 (the four-GPU kind was not lent at the time; issues 42, 44, 45, 46): the one-GPU no-regression pair, defaults (CUDA_VISIBLE_DEVICES=0,
# train.devices=1): after = this tree, before = 606c46d (s19's landing, the after of s20 call 1), an untracked _before/ carried with the call, made with
#   rm -rf _before && git archive 606c46d | (mkdir _before && tar -x -C _before)
# Prediction: the one-GPU plans identical apart from the fetch/host_state decisions and the device-update
# predicted step (no one-GPU default plan takes update_on=device here); tokens/s within the ~4% run-to-run spread.
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
