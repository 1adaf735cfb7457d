# issue 28 (session 11): the tiled block VJP's compiled temporaries at 131k, 262k and 524k tokens (Llama-3.1-8B shape,
# 8192-token tiles) against plan.sizes.block_working_set: the 524k slice peaked 0.7 GB over its plan in session 10
# and a perturbed run (call 1) failed allocating 41 GiB, about the VJP's temporaries; compile only, nothing allocated
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 560 python experiments/probe_block_working_set.py --seq 131072,262144,524288 --tile 8192 --out $OUT/ws_8b_tiled.json 2>&1 | grep -iv "warn\|ptxas" | tail -12
