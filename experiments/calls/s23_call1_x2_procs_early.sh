# session 23, nvidia-h200-x2 (2 GPUs, 256 GiB; the four-GPU kind not lent at 11:20 UTC). Issue 45:
# 1. the two-process bar at every decision auto: Qwen2.5-7B 128 x 1024 per GPU, one process x 2 GPUs (weak2) and two
#    processes x one GPU joined through jax.distributed (procs2, replicated host state: each ~110 GB of 120).
#    Prediction: procs2 >= 0.97x weak2 (s-27 landed code: 0.98x; s20 sharded 7B: 1.08x).
# 2. the first GPU run of train.early_state_groups: Qwen2.5-7B at 128 x 1024 a step on 2 GPUs, auto (early 0; plan
#    5.93 s at H100 rates, keeps 11) and early_state_groups=30 (plan 6.17 s: kept residuals 11 -> 4, so slower
#    predicted). Prediction: both within their GPU plans; early30 no faster than auto (the step is compute-bound
#    on 2 GPUs); the trace shows the forward moving only write-backs.
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; grep MemTotal /proc/meminfo
timeout 270 python experiments/bench_data_parallel.py --out $OUT --gpus 2 --runs weak,procs --host-gb 240 --steps 5 \
  --model "qwen7b=configs/qwen2.5-7b.yaml;128" 2>&1 | grep -v "^step\|Gloo" | tail -3 | cut -c1-900
date -u
timeout 140 python experiments/bench_data_parallel.py --out $OUT --gpus 2 --runs strong --host-gb 240 --steps 5 \
  --model "qwen7b_fixed128=configs/qwen2.5-7b.yaml;64" 2>&1 | grep -v "^step\|Gloo" | tail -1 | cut -c1-600
timeout 150 python experiments/bench_data_parallel.py --out $OUT --gpus 2 --runs strong --host-gb 240 --steps 5 --trace \
  --model "qwen7b_fixed128_early30=configs/qwen2.5-7b.yaml;64;train.early_state_groups=30" 2>&1 \
  | grep -v "^step\|Gloo" | tail -2 | cut -c1-700
grep -h "^timeline\|^plan:" $OUT/*early30*.log | cut -c1-400
date -u
