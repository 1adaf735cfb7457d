# issue 42's no-regression bar on the session's final code (s27 call 4, nvidia-h200): Llama-2-7B 16 x 4096 and
# Qwen2.5-7B 128 x 1024 with defaults, before (0fee47b, the tree before s26's engine change; an untracked _before/ from
# `git archive 0fee47b`) and after (this tree), in one call, 5 steps each, steps 3-5 timed.
# Prediction: each pair within 2% (call 1: the 7B 1.003x / 0.997x; s26: Qwen 0.999x); decisions identical.
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0
date -u
run() {  # tree label case
  (cd $1 && PYTHONPATH=. timeout 150 python experiments/bench_memory_plan.py --out $OUT/$2 --steps 5 \
    --case "$3" 2>&1 | tail -1 | cut -c1-300)
}
run _before before_7b "7b_b16=configs/7b.yaml;train.devices=1"
run . after_7b "7b_b16=configs/7b.yaml;train.devices=1"
run _before before_qwen "qwen7b_b128=configs/qwen2.5-7b.yaml;train.devices=1"
run . after_qwen "qwen7b_b128=configs/qwen2.5-7b.yaml;train.devices=1"
date -u
