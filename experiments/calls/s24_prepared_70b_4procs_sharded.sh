# prepared in session 22 (run in neither 23 nor before; renamed in 23 from s23_call2_...) (issue 46), nvidia-h200-x4: the re-measure of s21 call 1 with the per-process row (MULTI_PROCESS_HOST_BYTES, 0.45 GiB): four processes x one GPU, each a simulated 128 GiB host
# (train.host_memory_gb=128, train.host_state=sharded), Llama-2-70B shape (configs/llama2-70b.yaml: fp32 master,
# AdamW int8 moments, clipping 1.0), 8 x 4096 tokens per process, 5 steps, every other decision auto.
# Prediction: each process plans 110.63 GB (s21: 110.15 without the row, peaks 110.19-110.45) and peaks under it;
# the step about s21 call 1 (32.11 s, 4,083 tok/s).
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; grep MemTotal /proc/meminfo
timeout 575 python experiments/bench_data_parallel.py --out $OUT --gpus 4 --runs procs --host-gb 512 --steps 5 \
  --model "70b_sharded=configs/llama2-70b.yaml;8;train.host_state=sharded" 2>&1 | grep -v "^step\|Gloo" | tail -12 | cut -c1-1500
date -u
grep -h "^plan\|^step\|rror\|Killed\|died" $OUT/*.log 2>/dev/null | cut -c1-300 | tail -12
python - <<'PY'
import glob, json, os
for f in glob.glob(os.path.join(os.environ["OUT"], "dp_*.json")):
    d = json.load(open(f))
    print(f, {k: d.get(k) for k in ("rc", "steps_done", "tokens_per_s", "model_tflops", "step_s_median", "plan_step_s",
                                   "per_process_peak_rss_gb", "plan_host_gb", "peak_gpu_gb", "plan_gpu_gb", "wall_s")})
PY
