# issue 45, session 24, nvidia-h200-x4 (the 269 s of device time left): a rehearsal on a slice, not a figure for the
# bar. The Qwen1.5-110B lean shape's layers (configs/lean-110b.yaml) with 8 of its 80 layers, 8 x 4096 tokens per GPU
# on 4 GPUs, after the held-split change (an optax update over several GPUs: each GPU holds its share of a held
# gradient, gathered when the update starts). Forced to the decisions the full 110B's plan now takes on 4 H200s
# (gpu_bf16 hold of every group, split 4 ways; stream_io; 2 micro-batches); then the slice's own auto plan.
# Prediction: both run 3 steps within their plans (host and GPU peaks under them), losses finite and falling.
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u
S="configs/lean-110b.yaml;model.num_layers=8;train.batch_size=32;train.devices=4"
timeout 150 python experiments/bench_memory_plan.py --out $OUT --steps 3 --end-after-last-step 3 --limit-s 140 \
  --case "slice8_fullsize_decisions=$S;train.grad_hold=gpu_bf16;train.stream_io=true;train.micro_batches=2" 2>&1 \
  | tail -1 | cut -c1-400
date -u
timeout 80 python experiments/bench_memory_plan.py --out $OUT --steps 3 --end-after-last-step 3 --limit-s 75 \
  --case "slice8_auto=$S" 2>&1 | tail -1 | cut -c1-400
date -u
grep -h "^plan:\|^step\|rror\|ran out" $OUT/*.log 2>/dev/null | cut -c1-250 | tail -12
