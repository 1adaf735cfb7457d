# Prepared in session 25, not yet run (issue 42): s25 call 4 again, which the session's device time cut off before its
# traced step. Ask for nvidia-h200-x4 with at least 560 s of device time left (the run's own limit is 520 s; a call's
# limit under that ends it early, as in s25). The Qwen1.5-110B lean shape on one GPU (CUDA_VISIBLE_DEVICES=0), 8 x 4096
# tokens, every decision auto, 3 steps with the third traced (train.trace_step): where an 80 s step goes (compute,
# waits for host->GPU, GPU->host, the updates after the norm), against the plan's 82.43 s at H100 rates.
# The plan on the machine (s23 calls 5-6, s25 call 4): resweep with the first 24 groups on the GPU, stream_io, pinned
# activations (the last 19 blocks on the GPU); host 520.2 of 540.9 GB, GPU 133.5 of 143.2 GB.
# Prediction: steps 2-3 ~80 s (s25 call 4: 80.1 s), the trace's compute busy ~72 s of it; the rest waits on the
# stream_io head and the updates after the norm (the plan's updates_after_norm bound).
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u
CUDA_VISIBLE_DEVICES=0 timeout 540 python experiments/bench_memory_plan.py --out $OUT --steps 3 --trace \
  --end-after-last-step 5 --limit-s 520 --case "110b_lean_b8_cvd0_trace=configs/lean-110b.yaml" 2>&1 | tail -2 | cut -c1-600
date -u
grep -h "^plan:\|^step\|^timeline\|rror\|ran out" $OUT/*.log 2>/dev/null | cut -c1-400 | tail -14
ls -la $OUT | head
