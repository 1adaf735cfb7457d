# Run as s27 call 1 (RESULTS.md s27: 1.003x and 0.997x). Prepared in session 26 (issue 42's no-regression bar): s26 calls 3-4 measured Llama-2-7B 16 x 4096 at
# 0.970x and 0.961x of 0fee47b on one H200 (Qwen2.5-7B level, 0.999x), on a path the change does not reach (gpu_fp32
# hold, host update, no resweep). Here the pair alternates twice in one call: before, after, before, after.
# Ask nvidia-h200 with >= 330 s of device time left. before = 0fee47b, an untracked _before/ carried with the call:
#   rm -rf _before && git archive 0fee47b | (mkdir _before && tar -x -C _before)
# Prediction: within 2% (the s25 pair: 1.008x).
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0
date -u
run() {  # tree label
  (cd $1 && PYTHONPATH=. timeout 75 python experiments/bench_memory_plan.py --out $OUT/$2 --steps 5 \
    --case "7b_b16=configs/7b.yaml;train.devices=1" 2>&1 | tail -1 | cut -c1-300)
}
run _before before1; run . after1; run _before before2; run . after2
date -u
