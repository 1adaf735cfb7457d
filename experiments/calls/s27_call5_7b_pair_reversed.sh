# s27 call 5 (nvidia-h200): call 4 measured Llama-2-7B 16 x 4096 at 0.947x (before 0fee47b first, 6.44 s; after 6.80
# s) where call 1 (alternating twice) measured 1.003x and 0.997x at 6.0 s. Here the pair once more, the after tree first.
# Prediction: within 3% (no line the 7B's plan runs changed: s26's engine lines run only in a resweep's second sweep).
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0
date -u
run() {  # tree label
  (cd $1 && PYTHONPATH=. timeout 110 python experiments/bench_memory_plan.py --out $OUT/$2 --steps 5 \
    --case "7b_b16=configs/7b.yaml;train.devices=1" 2>&1 | tail -1 | cut -c1-300)
}
run . after_7b; run _before before_7b
date -u
