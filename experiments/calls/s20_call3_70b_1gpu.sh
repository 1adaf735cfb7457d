# issue 45, session 20, call 3 (nvidia-h100-x4, fresh): the one-GPU baseline of s19 call 3, Llama-2-70B AdamW
# int8, 8 x 4096, one GPU named by CUDA_VISIBLE_DEVICES=0, every decision auto, 4 steps.
export PYTHONPATH=. PYTHONUNBUFFERED=1
date -u
CUDA_VISIBLE_DEVICES=0 timeout 575 python experiments/bench_memory_plan.py --out $OUT --steps 4 \
  --case "70b_b8_cvd0=configs/llama2-70b.yaml;train.batch_size=8" 2>&1 | tail -2 | cut -c1-900
date -u
grep -h "^plan\|^step\|rror\|Killed" $OUT/*.log 2>/dev/null | cut -c1-300 | tail -8
