# issue 42, session 18, call 1 (one H200): who asks jit_grad_sqnorm for 10.1 GiB in the 110B lean step?
# An 8-layer slice of the 110B shape with the full run's decisions forced (update_on=device, resweep, stream_io=false,
# 2 micro-batches, train.gpu_memory_gb=100: the first 3 groups held, the rest resweept), 2 steps, XLA dumping every executable's buffer assignment; listed: each executable's
# allocations over 256 MB, and the GPU's peak.
export PYTHONPATH=. PYTHONUNBUFFERED=1
rm -rf /tmp/dump /tmp/r18; mkdir -p /tmp/dump
export XLA_FLAGS="--xla_dump_to=/tmp/dump"
date -u
timeout 500 python -m megatrain_jax.cli train configs/lean-110b.yaml --set model.num_layers=8 --set train.steps=2 \
  --set model.init=fast --set train.stream_io=false --set train.micro_batches=2 --set train.update_on=device \
  --set train.grad_hold=resweep --set train.devices=1 --set train.gpu_memory_gb=100 --set train.final_checkpoint=false --set train.out_dir=/tmp/r18 \
  --set train.log_every=1 --set optim.schedule.kind=constant --set optim.schedule.warmup_steps=0 > $OUT/train.log 2>&1; grep -v "^  " $OUT/train.log | cut -c1-400 | tail -25; grep -i "InUse\|Limit:\|MaxAllocSize\|Sum Total" $OUT/train.log | head
date -u
ls /tmp/dump | wc -l
python - <<'PY' | tee $OUT/big_allocations.txt
import glob, re, os
for f in sorted(glob.glob("/tmp/dump/*buffer-assignment.txt")):
    txt = open(f).read()
    big = [(int(m.group(2)), m.group(0)[:160]) for m in re.finditer(r"allocation (\d+): size (\d+)[^\n]*", txt)]
    big = [b for b in big if b[0] > 256e6]
    if big or "sqnorm" in f:
        print(os.path.basename(f))
        for s, line in big:
            print("   ", line)
PY
for f in /tmp/dump/*sqnorm*buffer-assignment.txt; do echo "== $f"; head -30 $f; done | cut -c1-300 | head -80
cat /tmp/dump/*sqnorm*buffer-assignment.txt > $OUT/sqnorm_buffers.txt 2>/dev/null; ls $OUT
