# no regression (prepared in session 21 for session 22), defaults, nvidia-h100-x1, one call: after = this tree
# (s20-s21: the sharded host state, per-process plan rows, kept residuals on several GPUs, the shared out_dir check),
# before = 606c46d (s19's landing, the after of s20 call 1); an untracked _before/ carried with the call, made with
#   rm -rf _before && git archive 606c46d | (mkdir _before && tar -x -C _before)
# Order: after, before, after again (7B only), so a first-run effect on a fresh machine shows as after#1 != after#2.
# Prediction: the one-GPU plans identical apart from the fetch/host_state keys (s20-s21 changed only multi-GPU and
# multi-process rows; the 222-plan regression set is identical), tokens/s within the 7B's ~4% run-to-run spread.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
run() {  # tree label cases...
  local d=$1 label=$2; shift 2
  (cd $d && PYTHONPATH=. timeout 240 python experiments/bench_memory_plan.py --out $OUT/$label --steps 5 "$@" 2>&1 | tail -3)
}
run . after1 --case "7b_b16=configs/7b.yaml" --case "qwen7b_b128=configs/qwen2.5-7b.yaml"
run _before before --case "7b_b16=configs/7b.yaml" --case "qwen7b_b128=configs/qwen2.5-7b.yaml"
run . after2 --case "7b_b16=configs/7b.yaml"
