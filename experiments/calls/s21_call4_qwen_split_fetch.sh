# issue 45, session 21, call 4 (nvidia-h100-x4, fresh): call 3's two four-GPU Qwen2.5-7B runs again with
# train.fetch=split (each GPU fetches 1/4 of a group over its own link, the rest over NVLink), every other decision auto.
# Call 3 (fetch=full, 4 H200): strong4 4.17 s a step (31,376 tok/s, 2.77x one GPU), weak4 12.35 s (42,463, 3.75x).
# Prediction: with 1/4 of the weights' PCIe traffic per GPU (host traffic ~300 -> ~210 GB a step at strong4), the
# strong step falls toward its compute (~3.4 s at call 3's one-GPU rate); weak4 moves less (its step is 3x longer).
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u
timeout 170 python experiments/bench_data_parallel.py --out $OUT --gpus 4 --runs strong --host-gb 480 --steps 5 \
  --model "qwen7b_fixed128_split=configs/qwen2.5-7b.yaml;32;train.fetch=split" 2>&1 | grep -v "^step\|Gloo" | tail -3 | cut -c1-1200
date -u
timeout 230 python experiments/bench_data_parallel.py --out $OUT --gpus 4 --runs weak --host-gb 480 --steps 5 \
  --model "qwen7b_split=configs/qwen2.5-7b.yaml;128;train.fetch=split" 2>&1 | grep -v "^step\|Gloo" | tail -3 | cut -c1-1200
date -u
grep -h "^step" $OUT/*.log | cut -c1-120
