# prepared in session 22 for session 23 (issue 45), nvidia-h200-x4: the strong-scaling bar in one call, and the first
# GPU measurement of train.early_state_groups (auto takes none until this is measured).
# 1. Qwen2.5-7B at 128 x 1024 a step on 1 and 4 GPUs (--gpus 1,4 --runs strong: strong1 is the one-GPU run, so
#    strong4's `scaling` is against the same call), every decision auto. s22 call 2: strong4 36,164 tok/s (3.62 s).
# 2. strong4 again with train.early_state_groups=30 (the plan's note for this case: 30 groups, kept residuals 27 -> 19,
#    2.76 s predicted at H100 rates against 3.36), with --trace. Prediction: ~3.1 s (the forward moves only the
#    write-backs, ~0.8 s at s22's 117 GB/s; 8 more blocks recompute, ~0.2 s), ~42k tok/s, ~3.7x; GPU peak under its
#    plan. If it holds, let auto take it (plan/build.py _early_state) and record the figures in docs/design.md 7.6.
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u
timeout 300 python experiments/bench_data_parallel.py --out $OUT --gpus 1,4 --runs strong --host-gb 480 --steps 5 \
  --model "qwen7b_fixed128=configs/qwen2.5-7b.yaml;32" 2>&1 | grep -v "^step\|Gloo" | tail -1 | cut -c1-500
timeout 170 python experiments/bench_data_parallel.py --out $OUT --gpus 4 --runs strong --host-gb 480 --steps 5 --trace \
  --model "qwen7b_fixed128_early30=configs/qwen2.5-7b.yaml;32;train.early_state_groups=30" 2>&1 \
  | grep -v "^step\|Gloo" | tail -2 | cut -c1-700
grep -h "^timeline\|^plan:" $OUT/*early30*.log | cut -c1-400
date -u
