# issue 45 (prepared in session 21 for session 22), nvidia-h100-x4: the same-machine pair that decides whether auto
# keeps residuals with several GPUs: Qwen2.5-7B weak1 (auto: keeps 6 on one GPU) and weak4 with
# train.keep_residuals=3 (the most the plan takes at 128 x 1024 per GPU) and train.fetch=split, 5 steps each.
# s21 (two machine instances): weak1 11,321 tok/s, weak4 kept 3 + split 44,390 (3.92x).
# Then strong4 (128 x 1024 per step) with --trace (train.trace_step=5, out of the median): the timeline that tests docs/design.md 7.5's hypothesis.
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u
timeout 170 python experiments/bench_data_parallel.py --out $OUT --gpus 1 --runs weak --host-gb 480 --steps 5 \
  --model "qwen7b=configs/qwen2.5-7b.yaml;128" 2>&1 | grep -v "^step\|Gloo" | tail -2 | cut -c1-600
timeout 200 python experiments/bench_data_parallel.py --out $OUT --gpus 4 --runs weak --host-gb 480 --steps 5 \
  --model "qwen7b_split_kept3=configs/qwen2.5-7b.yaml;128;train.fetch=split;train.keep_residuals=3" 2>&1 \
  | grep -v "^step\|Gloo" | tail -2 | cut -c1-600
timeout 150 python experiments/bench_data_parallel.py --out $OUT --gpus 4 --runs strong --host-gb 480 --steps 5 --trace \
  --model "qwen7b_fixed128_trace=configs/qwen2.5-7b.yaml;32" 2>&1 | grep -v "^step\|Gloo" | tail -2 | cut -c1-600
date -u
ls $OUT
