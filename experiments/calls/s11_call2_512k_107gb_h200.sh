# issue 28 (session 11): call 1's probe started XLA before the plan's settings (a 112.6 GB pool, budget 107 GB) and the
# 8-layer 524,288-token slice ran out of GPU memory at step 2 allocating 41 GiB (plan 99.1 of 107). The same case as a
# user would run it, train.gpu_memory_gb=107, the allocator's chunk map kept at the failure (what splits the free space)
export PYTHONPATH=. PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=0
timeout 420 python -m megatrain_jax train configs/llama3.1-8b-512k.yaml --set model.num_layers=8 --set model.init=fast \
  --set train.steps=2 --set train.final_checkpoint=false --set train.log_every=1 --set train.out_dir=/tmp/r107 \
  --set optim.schedule.kind=constant --set optim.schedule.warmup_steps=0 --set train.gpu_memory_gb=107 \
  > $OUT/train_512k_8layers_107.log 2> $OUT/train_512k_8layers_107.err; echo "rc $?"
grep -h "^plan\|^step\|^done\|^error" $OUT/train_512k_8layers_107.log | cut -c1-600
grep -c "" $OUT/train_512k_8layers_107.err
# the chunk map: every chunk of 100 MB or more, in address order, and the free ones
grep -E "Chunk at|Free  at|InUse at" $OUT/train_512k_8layers_107.err | awk '{for(i=1;i<=NF;i++) if($i=="Size:"||$i=="of") s=$(i+1)} {print}' | \
  python -c "
import re,sys
for l in sys.stdin:
    m=re.search(r'(Chunk|Free|InUse)\s+at ([0-9a-f]+) of size (\d+)(.*)', l)
    if m and int(m.group(3))>=100e6: print(m.group(1), m.group(2), round(int(m.group(3))/1e9,2), m.group(4)[:120])
" | head -120
cp /tmp/r107/error.log $OUT/ 2>/dev/null; true
