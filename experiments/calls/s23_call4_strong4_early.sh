# session 23, nvidia-h200-x4 (issue 45): the strong-scaling bar in one call, with the early-state fetch.
# Qwen2.5-7B at 128 x 1024 tokens a step: one GPU every decision auto (strong1), then four GPUs with
# train.early_state_groups=30 (the plan's note for this case: 30 groups, kept residuals 26-27 -> 19, 2.76 s predicted
# at H100 rates against 3.36 without), --trace. s22 call 2: strong4 auto 36,164 tok/s (3.62 s), 3.18x call 1's one GPU.
# Prediction: strong4 early ~3.1 s (the forward moves only the write-backs; two GPUs, s23 call 1, showed the forward
# as pure compute with all 30 groups early), ~42k tok/s, ~3.7x strong1; GPU peak under its plan.
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1; nproc; grep MemTotal /proc/meminfo
timeout 150 python experiments/bench_data_parallel.py --out $OUT --gpus 1 --runs strong --host-gb 480 --steps 5 \
  --model "qwen7b_fixed128=configs/qwen2.5-7b.yaml;128" 2>&1 | grep -v "^step\|Gloo" | tail -1 | cut -c1-400
timeout 190 python experiments/bench_data_parallel.py --out $OUT --gpus 4 --runs strong --host-gb 480 --steps 5 --trace \
  --model "qwen7b_fixed128_early30=configs/qwen2.5-7b.yaml;32;train.early_state_groups=30" 2>&1 \
  | grep -v "^step\|Gloo" | tail -2 | cut -c1-700
grep -h "^timeline\|^plan:" $OUT/*early30*.log | cut -c1-300
date -u
