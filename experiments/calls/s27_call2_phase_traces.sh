# Run as s27 call 2 (RESULTS.md s27; fitted with experiments/fit_backward_rate.py). Prepared in session 26 (issue 42: the step model's backward rate). The one matmul rate (600 TFLOP/s)
# puts the 110B's first backward at 0.457 s a block where an H200 ran 0.40 (s26 call 2; the forward is right, 0.148
# against 0.152), while the 7B defaults are predicted within 1-3% or under. One traced step per shape on one H200 gives
# each one's forward and backward time a block (the timeline JSONs' "fwd i" / "bwd i" bars), to fit a rate that grows
# with the GEMMs' size. Ask nvidia-h200 with >= 420 s of device time left.
# Prediction: the backward's rate per forward unit rises with hidden x MLP width (7B < 14B < 110B).
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0 PYTHONPATH=.
date -u
timeout 380 python experiments/bench_memory_plan.py --out $OUT --steps 4 --trace \
  --case "7b_b16=configs/7b.yaml;train.devices=1" \
  --case "qwen7b_b128=configs/qwen2.5-7b.yaml;train.devices=1" \
  --case "qwen14b_b16=configs/qwen2.5-14b.yaml;train.devices=1" 2>&1 | tail -4 | cut -c1-300
date -u
