# issue 42, session 18, call 2 (one H200): does making the GPU-held gradients' buffers once, before the first step,
# keep a large free block in XLA's GPU pool? A 12-layer slice of the 110B lean shape, every decision auto (the plan:
# resweep with the first 13 groups held on the GPU in bf16, update_on=device, stream_io=false, GPU peak 124.9 of 143.2),
# 3 steps, once with the per-step allocation of the held gradients (as landed) and once with the buffers made at start.
# Sampled every 5 ms: bytes in use, the least largest-free-block. Prediction: the buffers made at start leave the
# least largest free block >= the 10.1 GiB block-backward temporary; the per-step allocation leaves a smaller one.
# (after this call the probe's --no-gpu-hold-buffers option went away with the buffers it compared: the per-step
# allocation of the held gradients, as landed, is kept; experiments/probe_gpu_fragmentation.py says why)
export PYTHONPATH=. PYTHONUNBUFFERED=1
date -u
for mode in --no-gpu-hold-buffers ""; do
  name=slice12${mode:+_per_step}
  rm -rf /tmp/r18
  timeout 280 python experiments/probe_gpu_fragmentation.py --out $OUT --name ${name:-slice12} $mode -- train \
    configs/lean-110b.yaml --set model.num_layers=12 --set train.steps=3 --set model.init=fast --set train.devices=1 \
    --set train.final_checkpoint=false --set train.out_dir=/tmp/r18 --set train.log_every=1 \
    --set optim.schedule.kind=constant --set optim.schedule.warmup_steps=0 > $OUT/${name}.log 2>&1
  grep -v "^  " $OUT/${name}.log | grep "^plan: host\|^step\|rror\|^fragmentation" | cut -c1-600
  date -u
done
