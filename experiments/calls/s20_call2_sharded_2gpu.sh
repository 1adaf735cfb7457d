# issue 46 on GPUs (session 20, call 2), nvidia-h100-x2: the sharded host state's first GPU run.
# Llama-2-7B shape (model.init=fast), AdamW fp32 moments, clipping 1.0, 4 x 4096 tokens per GPU,
# update_on=device + fetch=split (what host_state=sharded runs), no final checkpoint (84 GB of disk).
#   weak2:  one process, 2 GPUs (its store backs everything: the replicated baseline of the same path)
#   procs2: two processes x 1 GPU, train.host_state=sharded (each backs its GPU's half), host_memory_gb 120 each
# Prediction: procs2 within 3% of weak2 in tokens/s (the same programs; gloo-free NCCL collectives), and each
# process's peak RSS about half of weak2's store (~40 GB of ~81 GB master+state) plus its runtime.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
PYTHONPATH=. timeout 560 python experiments/bench_data_parallel.py --out $OUT --gpus 2 --runs weak,procs --steps 4 \
  --model "7b_sharded=configs/7b.yaml;4;model.init=fast;train.update_on=device;train.fetch=split;train.stream_copy=device;train.host_state=sharded;train.final_checkpoint=false" 2>&1 | grep -v "^step\|Gloo" | tail -30
