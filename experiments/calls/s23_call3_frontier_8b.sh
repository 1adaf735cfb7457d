# issue 42, session 23, one H200 (128 GiB host): the search's frontier (214b5a5) measured on the plan it moved most in
# the regression set: Llama-3.1-8B shape (configs/llama3.1-8b.yaml: int8 moments, clipping 1.0), 16 x 4096 tokens,
# train.grad_hold=resweep, a 24 GB GPU budget (train.gpu_memory_gb=24), every other decision auto, 5 steps.
# before (ff347d0, an untracked _before/ carried with the call: git archive ff347d0 | (mkdir _before && tar -x -C _before)).
# Planned here for this machine (H200, 135.1 GB MemTotal, 16 cores): before M=8, pinned activations, no block on the
# GPU, 25 groups held, host update, 9.58 s predicted at H100 rates; after M=8, 1 block on the GPU, 26 groups held,
# device update, 8.92 s. (On the regression set's 24 GB / 128 GB / 8-core machine: 10.88 -> 9.57 s.) Prediction:
# after/before ~0.93 in step time, both within their plans.
export PYTHONUNBUFFERED=1
date -u
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1; nproc; grep MemTotal /proc/meminfo
CASE="llama3.1-8b.yaml;train.grad_hold=resweep;train.gpu_memory_gb=24"
PYTHONPATH=. timeout 270 python experiments/bench_memory_plan.py --out $OUT/after --steps 5 \
  --case "8b_resweep_g24_after=configs/$CASE" 2>&1 | tail -2 | cut -c1-700
date -u
(cd _before && PYTHONPATH=. timeout 270 python experiments/bench_memory_plan.py --out $OUT/before --steps 5 \
  --case "8b_resweep_g24_before=configs/$CASE" 2>&1 | tail -2 | cut -c1-700)
date -u
grep -h "^plan:\|^step\|rror" $OUT/*/*.log 2>/dev/null | cut -c1-330
