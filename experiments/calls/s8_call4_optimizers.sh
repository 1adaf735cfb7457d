# issue 29 (a): the 3B shape at 16 x 4096, fused AdamW against each named optimizer through optax on the GPU
export PYTHONPATH=.
C="configs/3b.yaml;train.batch_size=16"
python experiments/bench_memory_plan.py --out $OUT --steps 4 \
 --case "fused=$C" \
 --case "muon=$C;optim.kernel=optax;optim.name=muon" \
 --case "adamw_optax=$C;optim.kernel=optax" \
 --case "lion=$C;optim.kernel=optax;optim.name=lion" \
 --case "adafactor=$C;optim.kernel=optax;optim.name=adafactor" \
 --case "sgd=$C;optim.kernel=optax;optim.name=sgd;optim.momentum=0.9" 2>&1 | tail -9
