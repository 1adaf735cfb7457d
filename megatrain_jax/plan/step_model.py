"""The predicted step: each placement's floor terms (compute, PCIe both ways, the host optimizer, host copies)
and the one that binds, from the H100's rates or a described machine's (``--pcie-gbps``, ``--gpu-tflops``).

The search (``search.py``) ranks candidates by it; ``build.py`` reports the chosen one's.
"""
from __future__ import annotations

from typing import Any

from megatrain_jax.config import Config
from megatrain_jax.optim.costs import device_update_s, update_cost
import megatrain_jax.plan.decisions as choose
import megatrain_jax.plan.moe as plan_moe
from megatrain_jax.plan.machine import Machine
from megatrain_jax.placements import FETCHES, GPU_FP32, UpdatePlace
from megatrain_jax.plan.sizes import (DISPATCH_BLOCK_S, DISPATCH_CALL_S, HOLD_RETURN_RATE, HOST_COPY_PARALLEL_RATE,
                                      HOST_COPY_RATE, IO_GATHER_RATE, MICRO_BATCH_BYTES_PER_PARAM, MICRO_TOKENS,
                                      RATES, Shapes, early_params, kept_on_gpu)

GPU_MEMORY_RATE = 3.0e12  # bytes/s of the GPU's memory (H100: 3.35 TB/s), for an elementwise pass
# an H200's (4.8 TB/s): a device-to-device copy on this project's H200 machines moved 4.3 TB/s, read and written
# (docs/design.md section 1); its matmul rates are the H100's (the same chip)
GPU_MEMORY_RATES = {"H200": 4.3e12}
# the backward of a block that recomputes its forward (and a resweep's second sweep) runs its matmuls faster than the
# one rate: 584-652 TFLOP/s on an H100 (an 8B, three traces), 648-701 on an H200 (7B, Qwen2.5-7B and -14B, the 110B),
# 648 the mean of the seven, against 600; the forward and a kept block's backward stay at it (572-720 and 559-593;
# experiments/fit_backward_rate.py)
RECOMPUTE_BACKWARD_SPEEDUP = 1.08


_OPTAX_COSTS: dict[str, Any] = {}
_HOST_TREES: dict[str, Any] = {}


def optax_update_cost(cfg: Config):
    """The configured optax optimizer's ``UpdateCost`` (compiled once per model and optimizer; shared with
    ``build.py``, which places the update by it, so that both read the one cached cost)."""
    key = repr((cfg.model, cfg.optim))
    if key not in _OPTAX_COSTS:
        _OPTAX_COSTS[key] = update_cost(cfg.optim, _host_trees(cfg.model), cfg.train.steps)
    return _OPTAX_COSTS[key]


def _host_trees(model_cfg) -> dict[str, Any]:
    """The model's groups as ``ShapeDtypeStruct`` trees, built once per model (the whole model abstractly: 1.6 s
    of CPU for 80 layers) and shared by every optimizer's cost; ``update_cost`` only reads them."""
    key = repr(model_cfg)
    if key not in _HOST_TREES:
        from megatrain_jax.models.common import abstract_model, streamed_parts

        _HOST_TREES[key] = streamed_parts(abstract_model(model_cfg)).host_trees()
    return _HOST_TREES[key]


def step_rates(machine: Machine) -> dict[str, float]:
    """The floor rates of the predicted step: the H100 machine's (RATES), or a target's PCIe and TFLOPS."""
    rates = {k: v for k, v in RATES.items() if k != "adamw_elems"}
    rates["gpu_memory"] = next((r for name, r in GPU_MEMORY_RATES.items() if name in machine.gpu_name), GPU_MEMORY_RATE)
    if machine.pcie_bytes_s:
        rates["h2d"] = rates["d2h"] = machine.pcie_bytes_s
    if machine.gpu_flops:
        rates["matmul_bf16"] = machine.gpu_flops
        rates["matmul_fp32"] = machine.gpu_flops * RATES["matmul_fp32"] / RATES["matmul_bf16"]
    return rates


def step_basis(machine: Machine) -> str:
    """What the predicted step's rates are (the plan's report names them beside the figure: ``build.py``)."""
    if machine.backend != "gpu":
        return "H100 rates: a GPU prediction; this run is on the CPU backend, which is far slower"
    if machine.pcie_bytes_s or machine.gpu_flops:
        return "the target's rates" + ("" if machine.pcie_bytes_s and machine.gpu_flops else
                                       " where given, the H100's elsewhere")
    memory = next((name for name in GPU_MEMORY_RATES if name in machine.gpu_name), None)
    return f"H100 rates, the {memory}'s memory" if memory else "H100 rates"


def predicted_step(cfg: Config, shapes: Shapes, rates: dict[str, float], *, n_dev: int, n_keep: int, stream_bytes: int,
                   moment_bytes: float, update_on: UpdatePlace, cpu_cores: int, attention: bool = True,
                   n_early: int = 0, placement: choose.Placement | None = None, non_emb: int | None = None,
                   optax_cost: Any = None) -> dict[str, Any]:
    """The step's floor terms (compute, host->GPU, GPU->host, optimizer, host copies) and the largest of
    them; ``work_s`` is their sum (the search's second key). N GPUs: each receives every block over its
    own link, all read the one host memory at once; the summed gradient leaves once, its chunks spread
    over the N links. ``placement`` adds its costs: ``boundary_every`` k recomputes (k-1)/k of the blocks'
    forward; ``resweep`` runs the backward (with its recompute) once more and streams the blocks again;
    pinned activations cross both ways; a host hold's gradient crosses back for a device-side update and
    a pageable one is copied by one host thread; ``stream_io`` sends the head twice and the batch's
    embedding rows instead of the whole embedding and head once. ``non_emb``, ``optax_cost``: the model's
    ``non_embedding_params()`` and ``optax_update_cost(cfg)``, where the caller has them (the search asks thousands)."""
    train, optim, model, p = cfg.train, cfg.optim, cfg.model, placement
    k = p.boundary_every if p else 1
    hold = p.hold if p else GPU_FP32
    device_update = update_on.on_device
    io = bool(p and p.stream_io)
    # GPUs sharing each group's device-side update (the elementwise fused AdamW: engine/shards.py); an optax update
    # runs on every GPU alike
    shares = n_dev if (device_update and optim.kernel == "fused") else 1
    tokens = train.batch_size * cfg.data.seq_len
    non_emb = plan_moe.step_matmul_params(model, min(tokens, MICRO_TOKENS)) if non_emb is None else non_emb  # (MoE)
    attn = 12.0 * model.num_layers * model.num_heads * model.dim_per_head * cfg.data.seq_len if attention else 0.0
    fwd_blocks = tokens * (2 * non_emb + attn / 6.0)
    # a resweep runs the recompute (1 forward) and backward (2 forwards) once more: ~+75%, over the blocks above
    # those whose gradients it holds on the GPU (grad_hold_gpu_groups: the embedding and the lowest blocks)
    again = 0.0
    if hold.is_resweep:
        again = (shapes.layers - min(max((p.grad_hold_gpu_groups if p else 0) - 1, 0), shapes.layers)) / shapes.layers
    rate = rates["matmul_bf16" if train.compute_dtype == "bfloat16" else "matmul_fp32"] * n_dev
    compute_s = _matmul_s(tokens, non_emb, attn, fwd_blocks, shapes, n_keep, k, again, rate)
    # the cast of each gradient held in bf16 (gpu_bf16, host_bf16, a split hold's GPU groups): 6 bytes/param
    cast = shapes.params if hold.bf16 else (p.grad_hold_gpu_params if p else 0)
    memory_rate = rates.get("gpu_memory", GPU_MEMORY_RATE)
    memory_s = 6.0 * cast / memory_rate
    # each micro-batch's gradient accumulation in fp32, per block (a resweep's second sweep accumulates again)
    mb = p.micro_batches if p else (train.micro_batches if isinstance(train.micro_batches, int) else 1)
    per_param = MICRO_BATCH_BYTES_PER_PARAM / (1 if (stream_bytes == 4 and train.compute_dtype == "bfloat16") else 2)
    # (each GPU of a data-parallel run accumulates every micro-batch of its share: not divided by the GPUs)
    memory_s += per_param * shapes.layers * shapes.block * mb * (1 + again) / memory_rate
    compute_s += memory_s  # (the GPU's memory-bound passes: they do not scale with its TFLOPS)
    if p and p.blocks_queued == 1:  # a dispatch bubble per block, forward and backward (and each recompute)
        sweeps = 2 + (k - 1) / k + 2 * again
        compute_s += sweeps * shapes.layers * (DISPATCH_BLOCK_S + p.micro_batches * DISPATCH_CALL_S)
    if io:  # the head gathered vocabulary-major from the (H, V) store once a step, off the dispatching thread
        compute_s += 4.0 * shapes.vocab * shapes.hidden / IO_GATHER_RATE
    # blocks twice (forward, backward), embedding and head once (stream_io: head twice, the batch's rows)
    out_matrix = shapes.vocab * shapes.hidden + shapes.hidden  # the head's (tied: the embedding) and final norm
    # (stream_io's head chunks cross in the compute dtype: the host's gather casts them)
    io_bytes = 2 * shapes.dtype_bytes * out_matrix + 4 * tokens // n_dev * shapes.hidden if io \
        else 4 * (shapes.embed + shapes.head)
    # (train.fetch=split: each GPU's link carries its 1/N share of each block; the rest comes over NVLink)
    per_link = n_dev if (FETCHES[train.fetch].split and n_dev > 1) else 1
    h2d_bytes = 2 * shapes.layers * shapes.block * stream_bytes / per_link + io_bytes
    h2d_bytes += shapes.layers * shapes.block * stream_bytes * again / per_link
    opt_rate = RATES["adamw_elems"]["optax" if optim.kernel == "optax" else optim.moments] * min(cpu_cores, 16) / 16
    copy_rate = max(HOST_COPY_RATE, HOST_COPY_PARALLEL_RATE * min(cpu_cores, 16) / 16)
    h2d_s = max(h2d_bytes / rates["h2d"], n_dev * h2d_bytes / rates["host_read"])
    grad_d2h = 4.0 * shapes.params
    extra_h2d = extra_d2h = copy_bytes = widen_bytes = 0.0
    if p is not None and p.activations.parked:  # the parked inputs (a split keeps the last ones on the GPU)
        act = shapes.tokens * shapes.hidden * shapes.dtype_bytes \
            * (-(-shapes.layers // k) - kept_on_gpu(shapes.layers, k, p.activations_gpu_blocks))
        extra_d2h += act
        extra_h2d += act * (1 + again)
    # stream_io with a device-side update: the embedding and head (gradients in host memory) update on the host
    io_params = (shapes.embed + shapes.head) if io else 0  # their gradients wait in host memory, outside any hold
    host_params = io_params if device_update else 0
    if hold.on_host:
        held = hold.host_bytes * (shapes.params - io_params - (p.grad_hold_gpu_params if p else 0))
        if device_update:  # out for the norm, back for the update (several GPUs: each its share)
            extra_d2h += held / shares
            extra_h2d += held / shares
        elif hold.bf16:  # the held part leaves in bf16
            grad_d2h -= held
        if hold.pageable:  # the copier moves each landed slab into the pageable hold
            copy_bytes += held * (2 if device_update else 1)
        if hold.bf16 and not device_update and optim.kernel == "optax":
            widen_bytes = 2 * held  # widened to fp32 for an optax host update, after the norm (the fused
            #                         kernels widen each value as they read it: HostOptimizer.bf16_grads)
    step = {"compute_s": compute_s, "h2d_s": h2d_s + extra_h2d / rates["h2d"],
            "d2h_s": grad_d2h / (rates["d2h"] * n_dev) + extra_d2h / rates["d2h"],
            "optimizer_s": shapes.params / opt_rate, "host_copy_s": (copy_bytes + widen_bytes) / copy_rate,
            "gpu_memory_s": memory_s}
    if device_update:  # the state crosses PCIe both ways instead of the gradient; the host kernel only
        dev_params = shapes.params - host_params  # for what stays in host memory (stream_io's embedding, head)
        # (several GPUs: each receives its 1/N share of the state over its link and sends its share back, and the
        # updated weights are gathered over NVLink: engine/shards.py)
        step["h2d_s"] = max((h2d_bytes + moment_bytes * dev_params / shares + extra_h2d) / rates["h2d"],
                            n_dev * (h2d_bytes + moment_bytes * dev_params / shares) / rates["host_read"])
        # (every GPU updating alike: each group's result goes back from one of them, the groups spread over the links)
        step["d2h_s"] = ((4 + moment_bytes) * dev_params / n_dev + 4.0 * host_params + extra_d2h) / rates["d2h"]
        step["optimizer_s"] = host_params / opt_rate
        if optim.kernel == "optax":  # its update runs on the compute stream (Muon: Newton-Schulz matmuls)
            cost = optax_update_cost(cfg) if optax_cost is None else optax_cost
            step["update_s"] = device_update_s(cost, rates["matmul_bf16" if cost.matmul_dtype == "bfloat16"
                                                         else "matmul_fp32"], memory_rate)
            step["compute_s"] += step["update_s"]
    compute_s = step["compute_s"]
    terms = ("compute_s", "h2d_s", "d2h_s", "optimizer_s", "host_copy_s")
    # updates wait for the step's norm (clipping, the NaN check): the next forward is the only compute they can
    # hide behind. A host update chain (widening a bf16 hold, the kernel) longer than the forward is exposed;
    # a device-side one runs inside the forward, except the embedding's host update (stream_io) at its start
    fwd_s = fwd_blocks / rate  # the forward sweep alone (a segment's recompute runs in the backward)
    if not device_update:
        chain = step["optimizer_s"] + widen_bytes / copy_rate
        step["updates_after_norm_s"] = compute_s - fwd_s + max(fwd_s, chain)
    else:
        state_s = _state_traffic_s((4 + moment_bytes) * (shapes.params - host_params), n_dev, shares, rates,
                                   early=(4 + moment_bytes) * early_params(shapes, n_early))
        embed_s = _embed_wait_s(shapes.embed / opt_rate if host_params else 0.0,  # (the second sweep: its rate)
                                3 * fwd_blocks * again / (rate * RECOMPUTE_BACKWARD_SPEEDUP))
        step["updates_after_norm_s"] = compute_s - fwd_s + max(fwd_s, state_s) + embed_s
        if hold.pageable:  # a pageable hold comes back through the copier on that path
            step["updates_after_norm_s"] += held / HOLD_RETURN_RATE
    step["work_s"] = sum(step[t] for t in terms)
    return _bound(step, terms + ("updates_after_norm_s",))


def _matmul_s(tokens: int, non_emb: int, attn: float, fwd_blocks: float, shapes: Shapes, n_keep: int, k: int,
              again: float, rate: float) -> float:
    """The step's matmuls: forward, backward and recompute of every block (the kept ones' forward not again), the
    head's, a boundary's segment recompute, a resweep's second sweep; the sweeps that recompute at their own rate."""
    hw_flops = tokens * (8 * non_emb - 2 * n_keep * shapes.block + 8 * shapes.vocab * shapes.hidden
                         + 4.0 / 6.0 * attn)
    hw_flops += (k - 1) / k * fwd_blocks + 3 * fwd_blocks * again
    recompute_flops = 3 * fwd_blocks * ((shapes.layers - min(n_keep, shapes.layers)) / shapes.layers + again)
    return (hw_flops - recompute_flops) / rate + recompute_flops / (rate * RECOMPUTE_BACKWARD_SPEEDUP)


def _embed_wait_s(update_s: float, second_sweep_s: float) -> float:
    """What the next forward waits for ``stream_io``'s embedding, updated on the host: all of its update, or with
    a resweep what its second sweep does not hide (the update starts at the norm, before that sweep: engine
    ``Updates.start_on_host``; 6.6 s exposed a step without it, bench_memory_plan.py --trace)."""
    return max(update_s - second_sweep_s, 0.0)


def _bound(step: dict[str, Any], terms: tuple[str, ...]) -> dict[str, Any]:
    """The predicted step is its largest term, which binds it."""
    step["predicted_step_s"] = max(step[t] for t in terms)
    step["binding"] = max(terms, key=lambda t: step[t])
    return step


def _state_traffic_s(state: float, n_dev: int, shares: int, rates: dict[str, float], early: float = 0.0) -> float:
    """The least time a device-side update's forward lasts: each group's state (``state`` bytes in all) comes in
    just before its block and goes back right after its update, so that traffic falls in the forward: each link's
    share, and the host memory read and written by all the GPUs at once (an optax update, on every GPU alike,
    reads the whole state once per GPU). ``early``: the bytes of it fetched in the backward instead (their
    write-back stays in the forward)."""
    inbound = max(state - early, 0.0)
    return max(state / shares / rates["h2d"], (inbound * n_dev / shares + state) / rates["host_traffic"])


def reference_pass_s(step: dict) -> float:
    """The preference objectives' reference pass per batch (reference_logps.py): the forward sweep's compute (2 of the
    step's 8 FLOPs per parameter and token) or the blocks' one transfer (half the step's host->GPU bytes)."""
    return max(step.get("compute_s", 0.0) / 4.0, step.get("h2d_s", 0.0) / 2.0)


def reference_pass_note(cfg: Config, step: dict) -> str:
    """The plan's note on the reference pass of dpo and ipo (once per data set and initial weights)."""
    return (f"reference pass ({cfg.train.objective}): forward only, about {reference_pass_s(step):.2f} s per batch of "
            f"{cfg.train.batch_size} rows, once per data set and initial weights (cached next to the data: "
            "reference_logps.py)")
