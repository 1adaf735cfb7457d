# issue 28 (session 11): the same compile-only probe for Llama-2-7B (MHA) at 65k-262k and Llama-3.1-8B at 32k/65k,
# tiled (the slope's dependence on the k/v width)
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false; timeout 280 python experiments/probe_block_working_set.py --config configs/7b.yaml --seq 65536,131072,262144 --tile 8192 --out $OUT/ws_7b_tiled.json 2>&1 | grep -iv "warn\|ptxas" | tail -5; timeout 250 python experiments/probe_block_working_set.py --seq 32768,65536 --tile 8192 --out $OUT/ws_8b_tiled_short.json 2>&1 | grep -iv "warn\|ptxas" | tail -4
