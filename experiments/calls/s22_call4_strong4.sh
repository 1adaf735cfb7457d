# session 22, call 4 (issue 45), right after call 3 on the same warm machine: Qwen2.5-7B strong4 (32 x 1024 per GPU,
# 128 x 1024 a step, every decision auto), with --trace. New since call 2: train.early_state_groups (auto: all 30
# groups' master and state fetched in the backward, kept residuals 27 -> 19; plan 2.76 s at H100 rates, 3.36 without).
# Its scaling is against call 3's one-GPU Qwen2.5-7B default run (the same 128 x 1024 a step; that run's host limit
# is the machine's, this one's 480 GB: both plans fit far under).
# Prediction: the forward moves only the write-backs (91 GB, ~0.8 s at call 2's rate) instead of 1.55 s of traffic;
# 8 more blocks recompute (~0.2 s): ~3.1 s a step (call 2: 3.62), ~42k tok/s, ~3.7x.
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u
timeout 170 python experiments/bench_data_parallel.py --out $OUT --gpus 4 --runs strong --host-gb 480 --steps 5 --trace \
  --model "qwen7b_fixed128=configs/qwen2.5-7b.yaml;32" 2>&1 | grep -v "^step\|Gloo" | tail -2 | cut -c1-700
grep -h "^timeline\|^plan:" $OUT/*.log | cut -c1-400
date -u
