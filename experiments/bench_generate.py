"""Generation throughput (``megatrain-jax generate``'s engine, ``megatrain_jax/generate/``): tokens per second with
resident and streamed weights at batch 1, 16 and 128, the prefill and the decode reported apart; and the bars of
issue 67, each measured against the machine's own rates in the same run.

    # on one H100 (each line well under 10 minutes):
    PYTHONPATH=. python experiments/bench_generate.py --shape qwen2.5-7b --modes resident,streamed \\
        --batches 1,16,128 --measure --out experiments/results/bench_generate_qwen7b.json
    PYTHONPATH=. python experiments/bench_generate.py --shape llama2-70b --modes streamed --int8 --batches 64 \\
        --new-tokens 16 --measure --out experiments/results/bench_generate_70b_int8.json
    # on a CPU, a tiny shape (what tests/test_bench_generate.py runs):
    PYTHONPATH=. python experiments/bench_generate.py --tiny

The model is a config's shape (``configs/<shape>.yaml``'s model section) with random weights (``model.init: fast``'s
values, bf16 on the GPU); prompts of ``--prompt-tokens`` random ids, ``--new-tokens`` generated greedily, no
end-of-sequence id (every row runs to the end).

``--measure`` measures, in the same process: the GPU's memory bandwidth (a read-only reduction and a copy over a
buffer of ``--bw-gb`` GB) and the host-to-GPU link (a DMA-registered host buffer put on the GPU, ``transfer.Transfers``
as the engine streams). Each row then carries:
- resident: ``bound_step_s``, the time one decoding step needs to read the weights (every block and the head; the
  embedding's few rows not counted) and the KV cache at its mean length once at the measured read bandwidth, and
  ``frac_of_bound`` = bound / measured step (issue 67: >= 0.70 for Qwen2.5-7B at batch 128, 128 + 128 tokens);
- streamed: ``link_step_s``, the time the streamed weight bytes need over the measured link, and ``x_link`` =
  measured step / link time (issue 67: <= 1.15 for the Llama-2-70B shape streamed in int8 at batch 64).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def synthetic_source(shape: str, tiny: bool, seed: int = 0):
    """A ``generate.source.Source`` of a config's shape with random weights (no file read)."""
    from megatrain_jax.config import ModelConfig, load_config
    from megatrain_jax.generate.source import Source, generation_cfg, group_layouts
    from megatrain_jax.hoststore import fill_fast_group

    if tiny:
        cfg = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                          intermediate_size=128)
    else:
        cfg = load_config(os.path.join(ROOT, "configs", f"{shape}.yaml")).model
        if cfg.from_hf:
            cfg = dataclasses.replace(cfg, from_hf=None)
    cfg = generation_cfg(cfg)
    layouts = group_layouts(cfg)
    names = list(layouts)

    def fill(name, flat):
        fill_fast_group(layouts[name], names.index(name), seed, 0.02, flat)

    src = Source(cfg, fill, layouts, f"{'tiny' if tiny else shape} shape, random weights", eos_ids=[])

    def quantised(name):
        """Random int8 blocks and their side buffer (scales, then norms) made directly: no fp32 pass over 70B values
        (the int8 path's arithmetic is that of ``engine._quantise_group``'s output, whatever the values)."""
        from megatrain_jax.generate.engine import quantised_leaves

        lay = layouts[name]
        pattern = np.random.default_rng(names.index(name)).integers(-127, 128, 1 << 20, dtype=np.int8)
        q = np.resize(pattern, lay.size)
        n_scales = sum(lf.shape[-1] for lf in quantised_leaves(lay))
        rest = sum(lf.size for lf in lay.leaves if len(lf.shape) < 2)
        side = np.concatenate([np.full(n_scales, 0.02 * np.sqrt(3.0) / 127, np.float32), np.ones(rest, np.float32)])
        return q, side

    src.quantised = quantised
    return src


def measure_rates(gb: float, reps: int = 10) -> dict:
    """The device's memory bandwidth (read-only and copy) and the host -> device link, in bytes/s."""
    import jax
    import jax.numpy as jnp

    from megatrain_jax.optim.host import alloc_aligned
    from megatrain_jax.transfer import Transfers

    dev = jax.local_devices()[0]
    n = int(gb * 1e9) // 2
    x = jax.device_put(np.ones(n, np.float16), dev).astype(jnp.bfloat16)
    read = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    copy = jax.jit(lambda a: a + jnp.asarray(1, a.dtype))
    out = {}
    for name, fn, factor in (("read", read, 1), ("copy", copy, 2)):
        jax.block_until_ready(fn(x))
        t = time.perf_counter()
        for _ in range(reps):
            r = fn(x)
        jax.block_until_ready(r)
        out[f"gpu_{name}_bytes_s"] = factor * x.nbytes * reps / (time.perf_counter() - t)
        del r
    del x
    host = alloc_aligned(n, np.uint16)
    host[:] = 1
    xfer = Transfers(dev)
    xfer.register("probe", host)
    jax.block_until_ready(xfer.to_device("probe", host))
    t = time.perf_counter()
    for _ in range(reps):
        y = xfer.to_device("probe", host)
        jax.block_until_ready(y)
        del y
    out["h2d_bytes_s"] = host.nbytes * reps / (time.perf_counter() - t)
    out["transfer_mode"] = xfer.mode
    xfer.close()
    return out


def run_row(src, weights, mode: str, batch: int, prompt: int, new: int, rates: dict | None) -> dict:
    from megatrain_jax.generate.engine import Decoder, Sampling, Timing, cache_bucket

    rng = np.random.default_rng(batch)
    prompts = [rng.integers(0, src.cfg.vocab_size, prompt).tolist() for _ in range(batch)]
    dec = Decoder(src, weights)
    cache = cache_bucket(prompt + new)
    dec.run_batch(prompts, 2, Sampling(), cache_len=cache)  # compiles the prefill and the decoding step
    timing = Timing()
    dec.run_batch(prompts, new, Sampling(), timing=timing, cache_len=cache)
    steps = max(timing.decode_steps, 1)
    step_s = timing.decode_s / steps
    row = {"weights": mode, "int8": weights.int8, "batch": batch, "prompt_tokens": prompt, "new_tokens": new,
           "prefill_s": timing.prefill_s, "prefill_tokens_per_s": timing.prefill_tokens / max(timing.prefill_s, 1e-9),
           "decode_s": timing.decode_s, "decode_steps": steps, "decode_step_s": step_s,
           "decode_tokens_per_s": batch * steps / max(timing.decode_s, 1e-9),
           "weights_on_device_gb": weights.device_bytes / 1e9, "weights_streamed_gb": weights.host_bytes / 1e9}
    if rates:
        cfg, item = src.cfg, weights.dtype.itemsize
        kv_mean = 2 * cfg.num_layers * batch * (prompt + new / 2) * cfg.kv_heads * cfg.dim_per_head * item
        if mode == "resident":
            layouts = weights.layouts
            read = sum(layouts[n].size for n in layouts if n != "embed") * item + kv_mean
            row["bytes_per_step"] = read
            row["bound_step_s"] = read / rates["gpu_read_bytes_s"]
            row["frac_of_bound"] = row["bound_step_s"] / step_s
        else:
            row["link_step_s"] = weights.host_bytes / rates["h2d_bytes_s"]
            row["x_link"] = step_s / row["link_step_s"]
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2.5-7b", help="a config in configs/ (its model section)")
    ap.add_argument("--tiny", action="store_true", help="a tiny shape on any backend (the CPU test)")
    ap.add_argument("--modes", default="resident,streamed")
    ap.add_argument("--batches", default=None, help="comma-separated (default 1,16,128; --tiny 1,4)")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="default 128 (--tiny 8)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 128 (--tiny 4)")
    ap.add_argument("--int8", action="store_true", help="streamed blocks as int8")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--measure", action="store_true", help="measure the GPU bandwidth and host link (--tiny: on)")
    ap.add_argument("--bw-gb", type=float, default=4.0)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # (before JAX starts) more than XLA's 0.75
    import jax

    from megatrain_jax.generate.engine import Weights

    on_gpu = jax.default_backend() == "gpu"
    batches = [int(b) for b in (a.batches or ("1,4" if a.tiny else "1,16,128")).split(",")]
    prompt = a.prompt_tokens or (8 if a.tiny else 128)
    new = a.new_tokens or (4 if a.tiny else 128)
    dtype = a.dtype or ("bfloat16" if on_gpu else "float32")
    src = synthetic_source(a.shape, a.tiny)
    rates = measure_rates(0.01 if a.tiny else a.bw_gb, reps=3 if a.tiny else 10) if (a.measure or a.tiny) else None
    if rates:
        print(f"rates: GPU read {rates['gpu_read_bytes_s'] / 1e9:.0f} GB/s, copy {rates['gpu_copy_bytes_s'] / 1e9:.0f} "
              f"GB/s, host->GPU {rates['h2d_bytes_s'] / 1e9:.1f} GB/s ({rates['transfer_mode']})", flush=True)
    rows = []
    for mode in a.modes.split(","):
        t0 = time.perf_counter()
        weights = Weights(src, dtype, streamed=mode == "streamed", int8=a.int8 and mode == "streamed")
        load_s = time.perf_counter() - t0
        try:
            for b in batches:
                row = run_row(src, weights, mode, b, prompt, new, rates)
                row["load_s"] = load_s
                rows.append(row)
                extra = (f", {row['frac_of_bound']:.2f} of the bandwidth bound" if "frac_of_bound" in row else
                         f", {row['x_link']:.2f}x the link time" if "x_link" in row else "")
                print(f"{mode}{' int8' if weights.int8 else ''} batch {b}: prefill {row['prefill_tokens_per_s']:,.0f} "
                      f"tok/s, decode {row['decode_tokens_per_s']:,.1f} tok/s ({row['decode_step_s'] * 1e3:.2f} ms a "
                      f"step){extra}", flush=True)
        finally:
            weights.close()
    result = {"shape": "tiny" if a.tiny else a.shape, "dtype": dtype, "backend": jax.default_backend(),
              "device": str(jax.local_devices()[0].device_kind), "rates": rates, "rows": rows}
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
