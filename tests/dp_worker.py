"""Data-parallel training runs for tests/test_data_parallel.py, in their own processes (the device
count of a CPU backend is fixed when it starts; jax.distributed needs one process per member).

    python tests/dp_worker.py local --counts 1,2,4 --out result.npz     (under --xla_force_host_platform_device_count=4)
    python tests/dp_worker.py dist --process-id I --num-processes 2 --port P --out result.npz
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STEPS = 5
# the placements the plan searches with several GPUs (plan/search.axes_of), beyond the default and the pinned run above
PLACEMENTS = {"resweep": dict(grad_hold="resweep", grad_hold_gpu_groups=2),
              "pinned_bf16": dict(grad_hold="pinned_bf16", activations="pinned_host", grad_hold_gpu_groups=1),
              "host_bf16": dict(grad_hold="host_bf16", boundary_every=2),
              "stream_io": dict(grad_hold="gpu_bf16", stream_io=True),
              "kept_residuals": dict(keep_residuals=1)}
# device-side updates: with several GPUs each updates its share of every group (engine/shards.py)
DEVICE_UPDATES = {"device_gpu_bf16": dict(update_on="device", stream_copy="device", grad_hold="gpu_bf16"),
                  "device_resweep": dict(update_on="device", stream_copy="device", grad_hold="resweep",
                                         grad_hold_gpu_groups=2),
                  "device_pinned_bf16": dict(update_on="device", stream_copy="device", grad_hold="pinned_bf16",
                                             activations="pinned_host", grad_hold_gpu_groups=1),
                  "device_int8": dict(update_on="device", stream_copy="device", grad_hold="gpu_bf16", moments="int8"),
                  # the first groups' master and state fetched during the backward (train.early_state_groups)
                  "device_early": dict(update_on="device", stream_copy="device", grad_hold="gpu_bf16",
                                       early_state_groups=3),
                  # an optax update over whole tensors: every GPU runs it alike (no shares of the update), each
                  # holding its share of the held gradients (gathered when the update starts)
                  "device_adafactor": dict(update_on="device", stream_copy="device", grad_hold="resweep",
                                           grad_hold_gpu_groups=2, optimizer="adafactor"),
                  "device_adafactor_gpu_bf16": dict(update_on="device", stream_copy="device", grad_hold="gpu_bf16",
                                                    optimizer="adafactor")}


def run(devices, steps: int = STEPS, options: dict | None = None, shares: list | None = None):
    """Five steps of a tiny Llama through the streamed engine on ``devices``; (losses, grad norms,
    final fp32 parameters as one flat vector). ``options["moments"]``: the AdamW moments; ``shares`` gets whether
    each GPU updated its share of the groups (device-side updates over several GPUs)."""
    import numpy as np

    from megatrain_jax.config import ModelConfig, OptimConfig, ScheduleConfig
    from megatrain_jax.engine import Batch, StreamedTrainer
    from megatrain_jax.models.llama import init_host_store
    from megatrain_jax.optim import build_host_optimizer

    cfg = ModelConfig(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=48, tie_embeddings=False)
    options = dict(options or {})
    name = options.pop("optimizer", "adamw")
    ocfg = OptimConfig(name=name, lr=1e-3 if name == "adamw" else 0.1, weight_decay=0.1, clip_norm=1.0, moments=options.pop("moments", "float32"),
                       schedule=ScheduleConfig(kind="warmup_cosine", warmup_steps=2),
                       **({"b2": 0.95} if name == "adamw" else {}))
    parts, store = init_host_store(cfg, 0, bf16_stream=False)
    st = StreamedTrainer(parts, build_host_optimizer(ocfg, steps), compute_dtype="float32", micro_batches=2,
                         clip_norm=1.0, loss_chunk=40, store=store, skip_nonfinite=True, devices=devices,
                         **options)
    if shares is not None:
        shares.append(getattr(st.updates, "shards", None) is not None)
    rng = np.random.default_rng(3)
    batches = []
    for _ in range(2):  # two batches in turn: the loss on each falls as it trains
        toks = rng.integers(0, cfg.vocab_size, (8, 17))
        batches.append(Batch(toks[:, :-1], toks[:, 1:], (rng.random((8, 16)) > 0.2).astype(np.float32)))
    losses, norms = [], []
    for i in range(steps):
        r = st.step(batches[i % 2])
        losses.append(r.loss)
        norms.append(r.grad_norm)
    st.finish()
    if shares is not None and options.get("early_state_groups"):  # (how many updates took state fetched early)
        shares.append(st.updates.early_loads)
    if shares is not None and name != "adamw":  # (how many updates gathered a gradient each GPU held its share of)
        shares.append(st.updates.split_held_loads)
    flat = np.concatenate([st.store[g.name].master for g in st.store])
    st.close()
    return np.asarray(losses), np.asarray(norms), flat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["local", "dist"])
    ap.add_argument("--counts", default="1,2,4")
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import jax
    import numpy as np

    if args.mode == "local":
        out = {}
        for n in [int(c) for c in args.counts.split(",")]:
            losses, norms, flat = run(jax.devices()[:n])
            out[f"losses_{n}"], out[f"norms_{n}"], out[f"params_{n}"] = losses, norms, flat
        # slabs through a small pool, gradients held in pinned host memory, activations parked there
        losses, norms, flat = run(jax.devices()[:4], options=dict(grad_slab_elems=1000, grad_slabs=2,
                                                                  grad_hold="pinned_host",
                                                                  activations="pinned_host"))
        out["losses_4opts"], out["norms_4opts"], out["params_4opts"] = losses, norms, flat
        # every placement the plan offers with several GPUs (issue 43): each on 1, 2 and 4 devices
        for name, opts in PLACEMENTS.items():
            for n in (1, 2, 4):
                losses, norms, flat = run(jax.devices()[:n], options=opts)
                out[f"losses_{name}_{n}"], out[f"norms_{name}_{n}"], out[f"params_{name}_{n}"] = losses, norms, flat
        for name, opts in DEVICE_UPDATES.items():
            for n in (1, 2, 4):
                shares = []
                losses, norms, flat = run(jax.devices()[:n], options=opts, shares=shares)
                out[f"losses_{name}_{n}"], out[f"norms_{name}_{n}"], out[f"params_{name}_{n}"] = losses, norms, flat
                out[f"shares_{name}_{n}"] = np.asarray(shares)
        # train.fetch=split: each device fetches its share of a block, gathered from the others (host and device updates)
        for name, opts in {"split": {}, "split_device_int8": DEVICE_UPDATES["device_int8"]}.items():
            for n in (2, 4):
                losses, norms, flat = run(jax.devices()[:n], options=dict(opts, fetch="split"))
                out[f"losses_{name}_{n}"], out[f"norms_{name}_{n}"], out[f"params_{name}_{n}"] = losses, norms, flat
        # a pageable hold cannot take a split update's shares: refused by the engine in one line, naming the field
        try:
            run(jax.devices()[:2], options=dict(DEVICE_UPDATES["device_gpu_bf16"], grad_hold="host_bf16"))
            out["pageable_split_refused"] = np.asarray("")
        except Exception as e:  # noqa: BLE001 - recorded for the test to check
            out["pageable_split_refused"] = np.asarray(f"{type(e).__name__}|{getattr(e, 'field', '')}")
        np.savez(args.out, **out)
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{args.port}", num_processes=args.num_processes,
                               process_id=args.process_id, initialization_timeout=120)
    losses, norms, flat = run(jax.devices())
    np.savez(args.out, losses=losses, norms=norms, params=flat, devices=len(jax.devices()),
             local=len(jax.local_devices()))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
