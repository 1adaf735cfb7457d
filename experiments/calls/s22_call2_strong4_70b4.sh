# issues 45, session 22, call 2, nvidia-h200-x4. The split update's write-back now starts every GPU's share before
# waiting for one (engine/shards.py copy_into; call 1's strong4 trace: the forward waited 1.89 s for write-backs
# running one link at a time, ~45 GB/s in all). Every decision auto.
# 1. Qwen2.5-7B strong4 (32 x 1024 per GPU) with --trace. Prediction: write-back ~3x faster, the forward near its
#    compute, step 4.07 -> ~3.1 s (~42k tok/s, ~3.7x call 1's weak1 11,363).
# 2. Llama-2-70B, AdamW int8, 8 x 4096 per GPU on 4 GPUs (issue 45's 70B bar). Prediction: at least s21 call 2's
#    4,273 tok/s (30.7 s a step); plan 32.01 s at H100 rates; >= 3.5x the one-GPU 1,041 tok/s (RESULTS.md row 246).
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u
timeout 190 python experiments/bench_data_parallel.py --out $OUT --gpus 4 --runs strong --host-gb 480 --steps 5 --trace \
  --model "qwen7b_fixed128=configs/qwen2.5-7b.yaml;32" 2>&1 | grep -v "^step\|Gloo" | tail -2 | cut -c1-700
grep -h "^timeline" $OUT/*.log | cut -c1-300
date -u
timeout 370 python experiments/bench_memory_plan.py --out $OUT --steps 5 \
  --case "70b_b32_dev4=configs/llama2-70b.yaml;train.batch_size=32;train.devices=4" 2>&1 | tail -2 | cut -c1-900
date -u
grep -h "^plan\|^step\|rror\|ran out\|Killed" $OUT/*70b*.log 2>/dev/null | cut -c1-300 | tail -10
