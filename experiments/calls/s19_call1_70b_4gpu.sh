# issue 45, session 19, call 1 (nvidia-h200-x4, every decision auto, clipping 1.0): update_on=device over several GPUs,
# each GPU updating its share of every group (engine/shards.py). First a 3-step rehearsal (Llama-2-7B shape, int8
# moments, update_on=device on 4 GPUs): if it does not train, stop. Then Llama-2-70B, AdamW int8, 8 x 4096 per GPU on
# 4 GPUs (32 x 4096 a step), 5 steps. Prediction (plan on 540.9 GB, H200, H100 rates): update_on=device split 4 ways,
# gpu_fp32 hold split 4 ways, activations on the GPU, host 444.6 GB, GPU 100.6 GB, 32.3 s a step (4,060 tok/s; 4.0x the
# one-GPU plan's 32.4 s at 8 x 4096; s18 measured one GPU at 31.5 s on this kind).
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -4
date -u
timeout 170 python experiments/bench_memory_plan.py --out $OUT/rehearsal --steps 3 \
  --case "7b_int8_dev4=configs/7b.yaml;train.devices=4;optim.moments=int8;train.update_on=device" 2>&1 | tail -3 | cut -c1-600
grep -h "^step\|rror" $OUT/rehearsal/*.log 2>/dev/null | tail -5 | cut -c1-300
grep -q "^step      3/3" $OUT/rehearsal/*.log || { echo "rehearsal failed: stop"; exit 1; }
date -u
timeout 420 python experiments/bench_memory_plan.py --out $OUT --steps 5 \
  --case "70b_b32_dev4=configs/llama2-70b.yaml;train.batch_size=32;train.devices=4" 2>&1 | tail -3 | cut -c1-900
date -u
grep -h "^plan\|^step\|rror\|Killed" $OUT/*.log 2>/dev/null | cut -c1-400 | tail -14
