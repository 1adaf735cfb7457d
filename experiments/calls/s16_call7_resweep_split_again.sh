# session 16 call 7: call 6 again after the fix (the first sweep kept too few inputs with boundary_every=4), after only
# (ORDER=after); call 6 measured before.
# issue 27, session 16: a resweep that holds its first groups on the GPU in bf16 and reruns only the blocks above
# them. Llama-3.1-8B 16x4096, int8, clipping 1.0, every decision auto, train.gpu_memory_gb=24 with a 64 GB host limit
# (an RTX 4090 with 64 GB): after = this tree (M=8, activations on the GPU every 4th input, resweep with the first 15
# groups on the GPU, stream_io, host update; plan 58.0 GB, predicted 12.49 s); before = f697dba (the plain resweep;
# predicted 13.98 s). One call, 5 steps each. Prediction: after ~10% faster, host within its plan.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
S="optim.clip_norm=1.0;train.final_checkpoint=false;optim.moments=int8;train.stream_copy=device;train.gpu_memory_gb=24;train.host_memory_gb=64"
for t in ${ORDER:-after before}; do
  d=.; [ $t = before ] && d=_before
  date -u
  (cd $d && PYTHONPATH=. timeout 270 python experiments/bench_memory_plan.py --out $OUT/$t --steps 5 --case "8b_24_h64=configs/llama3.1-8b.yaml;$S" 2>&1 | tail -1 | cut -c1-300)
done
grep -h "^plan:\|^step\|rror" $OUT/*/*.log 2>/dev/null | cut -c1-300
