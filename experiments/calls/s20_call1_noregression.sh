# no regression (session 20, call 1), defaults, nvidia-h100-x1, one call: after = this tree (606c46d: s19's split
# device update, split fetch, watchdog, LoRA as a variant of the one engine), before = b5fa91a (the tree s18 compared
# against and found 0.91x at 7B, after-first on a fresh machine); an untracked _before/ carried with the call.
# Order: after, before, after again (7B only), so a first-run effect on a fresh machine shows as after#1 != after#2.
# Prediction: the one-GPU plans are identical (s19 changed only several-GPU rows), tokens/s within 1%; if s18's
# 0.91x was the fresh machine, after#2 matches before.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
run() {  # tree label cases...
  local d=$1 label=$2; shift 2
  (cd $d && PYTHONPATH=. timeout 240 python experiments/bench_memory_plan.py --out $OUT/$label --steps 5 "$@" 2>&1 | tail -3)
}
run . after1 --case "7b_b16=configs/7b.yaml" --case "qwen7b_b128=configs/qwen2.5-7b.yaml"
run _before before --case "7b_b16=configs/7b.yaml" --case "qwen7b_b128=configs/qwen2.5-7b.yaml"
run . after2 --case "7b_b16=configs/7b.yaml"
