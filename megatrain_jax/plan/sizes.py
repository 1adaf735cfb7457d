"""Sizes: the bytes each buffer of a step takes, from the model's shapes, and the stated constants.

Two terms are empirical and stated as such: the per-token working set of one block's recompute +
VJP, and the process's fixed runtime (Python, JAX, CUDA context); both were calibrated against
peaks measured on an H100 (experiments/RESULTS.md, "memory plan vs measured"). A safety margin
(``HOST_MARGIN``, ``GPU_MARGIN``) is part of every verdict.

Peak GPU memory is not the sum of its rows: the gradients held for clipping and the boundary
activations never coexist in full, so the peak is taken over the phases of a step (``gpu_phases``).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

from megatrain_jax.config import ModelConfig
import megatrain_jax.plan.moe as plan_moe
from megatrain_jax.bounds import (BLOCKS_QUEUED, DEVICE_UPDATE_CHUNK, HOLD_COPIES_IN_FLIGHT, IO_VOCAB_CHUNK,
                                  PINNED_ACT_LAYERS_ON_GPU, WRITEBACKS_IN_FLIGHT)

GB = 1e9
GiB = 1 << 30

HOST_MARGIN = (0.03, 1.0 * GiB)  # fraction of the limit + bytes kept free on the host
GPU_MARGIN = (0.05, 1.0 * GiB)  # fraction of the budget + bytes kept free on the GPU (XLA autotuning
#                                  workspaces: a Qwen2.5-14B plan at 97% of the budget ran out of memory there)
XLA_FRACTION = 0.95  # of the device's memory given to XLA's allocator (the rest: CUDA context, cuDNN workspaces)
MICRO_TOKENS = 16384  # tokens per micro-batch that keep the matmuls efficient (16 x 4096 in 4 micro-batches)
RUNTIME_HOST_BYTES = {"gpu": 1.45 * GiB, "cpu": 1.0 * GiB}  # Python + JAX + CUDA libraries and context
MULTI_PROCESS_HOST_BYTES = 0.45 * GiB  # each process of a multi-process run: JAX's coordination client and the
# collectives' host buffers. Measured: four sharded 70B processes on one H200 each peaked 0.04-0.30 GB over the rows
# without it (docs/design.md 7.4; experiments/bench_data_parallel.py)
BFC_TABLE_BYTES_PER_POOL_BYTE = 1.0 / 32  # XLA's BFC allocator: one 8-byte chunk handle per 256 bytes of the
# GPU pool, in host memory (experiments/probe_runtime_stages.py; RESULTS.md)
PREALLOCATE_ABOVE = 0.75  # of the GPU budget: below it XLA grows its pool on demand, so the allocator table
# covers only what is used; above it the pool is made whole at the start (RESULTS.md)
BFC_FIRST_REGION = 2 << 20
# pinned gradient slabs (of bounds.GRAD_SLAB_ELEMS values) the plan chooses between (decisions.choose_slabs): a deeper
GRAD_SLABS_FEWEST, GRAD_SLABS_MOST = 6, 24  # pool feeds the host optimizer (6 -> 24: Llama-2-7B 388 -> 397 on the H100)
# One block's recompute + VJP working set (the engine's block backward: XLA's temporaries beyond its arguments),
# per backend, in bytes per token and unit of width in bf16 compute (x4 in fp32 compute, as calibrated before)
# and bytes per block parameter. Untiled (WS_PER_TOKEN): what lives at the peak, in the MLP's backward: the
# normed inputs, the residual sum and dx (hidden), q/k/v and the attention output (qkv, q), gate, up, their
# product and gradients (mlp; moe_mlp: every expert's width in the dense formulation, the OLMoE total of
# probe_block_working_set.py; a grouped MoE: plan/moe.py). Sequence-tiled (SEQ_WS_PER_TOKEN, per token of the whole
# sequence): what spans it around attention's backward: q/k/v and their gradients (qkv), the output, its gradient
# and the fp32 dQ accumulator (q), a dx partial (hidden), softmax statistics (head: per head); with one tile's MLP
# terms and "tile" x its other untiled terms, and per parameter the tile loops' fp32 gradient sums (block).
# gpu: fit to the H100's compiled block VJP, Llama-3.1-8B shape, 32k and 131k tokens, untiled and in 8192-token
# tiles (RESULTS.md, issue 28); the split between terms (and "tile") follows XLA:CPU's, measured at three widths.
# Tiled, the per-token spans are fit to the slope beyond 65k tokens (sm_90, probe_block_working_set.py): 82.2 KB a token for
# Llama-3.1-8B (GQA, 131k-524k) and 90.3 for Llama-2-7B (MHA, 65k-262k); the earlier fit was 0.97 of the 524k VJP.
# cpu: XLA:CPU's, which keeps more per token (less fusion) and runs the blockwise attention inside these
# coefficients (tests/test_working_set.py: within 10%). experiments/probe_block_working_set.py: plan vs compiled.
WS_PER_TOKEN = {"hidden": 6.0, "qkv": 2.0, "q": 2.0, "mlp": 8.6, "moe_mlp": 13.75, "block": 0.0}
SEQ_WS_PER_TOKEN = {"hidden": 9.0, "qkv": 1.4, "q": 8.0, "head": 8.0, "tile": 0.44, "block": 4.08}
WS_BY_BACKEND = {"gpu": (WS_PER_TOKEN, SEQ_WS_PER_TOKEN),
                 "cpu": ({"hidden": 18.0, "qkv": 6.0, "q": 6.0, "mlp": 10.0, "moe_mlp": 16.0, "block": 3.45},
                         {"hidden": 2.0, "qkv": 4.8, "q": 12.4, "head": 8.0, "tile": 0.446, "block": 9.2})}
# gpu, an upper bound over the shapes measured: the fit above x WS_GPU_SCALE plus WS_GPU_PER_PARAM bytes per block
# parameter, checked against the H100's compiled block VJP of Llama-2-7B (4k, 16k, 65k tokens) and Llama-3.1-8B
# (32k, 131k), untiled and tiled: plan/compiled 1.00-1.13 untiled, 1.03-1.32 tiled (probe_block_working_set.py;
# the fit alone was 0.60-0.95 at short sequences: under, and an accepted plan must not run out of memory)
WS_GPU_SCALE, WS_GPU_PER_PARAM = 1.12, 1.7
# blocks_queued=1 (the dispatching thread waits for each block): the GPU idles while the next block is dispatched,
# about one jitted call's Python dispatch per micro-batch plus the block's own bookkeeping (an estimate, not measured)
DISPATCH_CALL_S, DISPATCH_BLOCK_S = 0.2e-3, 0.5e-3
AUTO_SEQ_TILE = 8192  # tokens per tile where the plan tiles by itself: matmuls of 8192 rows keep the H100 busy
TILE_ABOVE = 0.25  # model.seq_tile=auto tiles where one untiled block's working set is above this share of the GPU
#                   room (or nothing untiled fits): Llama-2-7B at 65k tokens (16 GB) stays untiled on an H100
LOSS_BYTES_PER_LOGIT = 10.0  # fp32 logits + fp32 softmax - onehot + bf16 copy of one chunk, fwd/bwd
# floor rates for the predicted step (H100 measurements, docs/design.md section 1 and RESULTS.md); host_read is
# all GPUs' host->GPU streams together (an assumption: DDR bandwidth is the cap beyond two links)
RATES = {"matmul_bf16": 600e12, "matmul_fp32": 350e12, "h2d": 52e9, "d2h": 52e9, "host_read": 200e9,
         # host memory read and written at once by every GPU's device-side update state (in over each link, back
         # over each link): Qwen2.5-7B on four H200s moved 91 GB each way in a 1.55 s forward (bench_data_parallel.py)
         "host_traffic": 117e9,
         # 16 threads of the H100 machine's host (experiments/bench_compact_adamw.py)
         "adamw_elems": {"float32": 3.9e9, "bfloat16": 3.5e9, "int8": 3.5e9, "optax": 1.0e9}}
MOMENT_BYTES = {"float32": 8.0, "bfloat16": 4.0, "int8": 2.0 + 2 * 4.0 / 2048}
IO_GATHER_RATE = 20e9  # bytes/s of the streamed head's host gather as the step sees it. Gathered twice a step on the
# dispatching thread, an 8B (128256 x 4096) head cost 1.13 s more per step than the resident one (3.7e9 then:
# experiments/probe_stream_io.py, H100 machine); now once, in the background (engine/io_head.py): with
# it the 8B at 24 GB predicts 8.24 s against 7.88 measured, as over as the whole GPU's prediction (bench_memory_plan.py)
PINNED_LIMIT_FACTOR = 1.02  # XLA's pinned-host pool limit over the plan's pinned bytes (+ PINNED_LIMIT_ROOM):
# the pool's arrays are few sizes (activation layers, slabs), so little is lost between them; every byte of the
# limit past the arrays is page-locked RSS once the last region is taken (1.5x cost the 8B at 10 GB 12 GB)
PINNED_LIMIT_ROOM = 2  # GiB over the factor: the small first regions no array fits in, and the tail of each region
MICRO_BATCH_BYTES_PER_PARAM = 24.0  # GPU memory traffic each micro-batch adds per block parameter and step: the
# fp32 master cast to bf16 inside each call (forward and backward, 6 bytes each) and the backward's fp32 accumulation
# of the weight gradient (12; alone where no cast runs: 12). Without this term the 8B's step was 3% under its prediction at 4 micro-batches, 1%
# over at 8 and 8% over at 16 (H100, bench_memory_plan.py). Casting once a pass for all micro-batches instead
# (one jitted cast per block) was slower on the H100 (probe_stream_io.py: 16 micro-batches 9.09 s against 8.44): reverted
HOST_COPY_RATE = 10e9  # bytes/s of one host thread's memcpy (a pageable hold's copier; a bf16 conversion)
HOLD_RETURN_RATE = 39e9  # bytes/s at which a pageable hold's return (copier -> slab -> GPU) delays a device-side
# update's next forward: each block waits for its update. 8B at 24 GB on the H100, 10.2 GB held in bf16: 8.11 s steps
# where the same run with the fp32 hold pinned took 7.85 (bench_gpu_budgets.py); the plan had both at 8.33
HOST_COPY_PARALLEL_RATE = 40e9  # the same split over 8 threads (holds.parallel) on the H100 machine's 16 cores:
#                                 its 8B host update widened 30 GB of held bf16 in ~0.65 s (bench_memory_plan.py)


@dataclass
class Row:
    where: str  # host | gpu | disk
    what: str
    bytes: float
    note: str = ""


def usable(limit: float, margin: tuple[float, float]) -> float:
    """What a limit leaves after its safety margin."""
    return limit * (1 - margin[0]) - margin[1]


@dataclass
class Shapes:
    """The sizes the plan needs, read once from the config (per device: ``batch`` is per GPU)."""

    params: int
    block: int  # parameters of one block
    embed: int
    head: int  # the head's parameters (final norm + output matrix where untied)
    layers: int
    hidden: int
    mlp_width: int  # the MLP width a token's working set holds (MoE: every expert's)
    vocab: int
    qkv_width: int
    batch: int
    seq: int
    tied: bool
    dtype_bytes: int  # compute dtype bytes
    mlp_ws: float = WS_PER_TOKEN["mlp"]  # working-set bytes per token and unit of mlp_width (a MoE: plan/moe.py)
    routed_pad: int = 0  # a grouped MoE's tile padding, as tokens of its mlp_width (plan/moe.py)
    head_dim: int = 0
    q_width: int = 0  # heads x head_dim
    seq_tile: int = 0  # tokens per sequence tile of a block (model.seq_tile; 0: untiled)
    tile_auto: bool = False  # model.seq_tile=auto on blocks that can tile: the plan may tile (choose_placement)
    update_temp: float = 16.0  # a device-side update's temporaries, bytes per value (optim/costs.py UpdateCost)
    update_chunked: bool = True  # ... per value of one DEVICE_UPDATE_CHUNK slice (else of the whole largest group)
    backend: str = "gpu"  # whose compiled block the working set counts (block_working_set's coefficients)
    blocks_queued: int = BLOCKS_QUEUED  # the engine's pace (EngineOptions.blocks_queued): 1 where 2 does not fit

    @classmethod
    def of(cls, m: ModelConfig, batch: int, seq: int, compute_dtype: str, seq_tile: int | None = None,
           backend: str = "gpu") -> "Shapes":
        """``seq_tile``: the block's sequence tile (None: the model's, ``auto`` counting as untiled)."""
        q, kv = m.num_heads * m.dim_per_head, m.kv_heads * m.dim_per_head
        emb = m.vocab_size * m.hidden_size
        head = m.hidden_size + (0 if m.tie_embeddings else emb)
        # a mixture of experts: its k routed rows a token on the grouped path, every expert in the dense one
        moe, routed = plan_moe.is_moe(m), plan_moe.routed(m)
        mlp = plan_moe.routed_mlp_width(m) if routed else plan_moe.expert_width(m) * m.num_experts if moe else \
            m.intermediate_size
        return cls(params=m.total_params(), block=m.block_params(), embed=emb, head=head, layers=m.num_layers,
                   hidden=m.hidden_size, mlp_width=mlp, vocab=m.vocab_size, qkv_width=q + 2 * kv, batch=batch,
                   seq=seq, tied=m.tie_embeddings, dtype_bytes=2 if compute_dtype == "bfloat16" else 4,
                   mlp_ws=plan_moe.ROUTED_BYTES if routed else WS_PER_TOKEN["moe_mlp" if moe else "mlp"],
                   routed_pad=plan_moe.padding_tokens(m) if routed else 0, head_dim=m.dim_per_head, q_width=q,
                   seq_tile=seq_tile if seq_tile is not None else m.seq_tile_tokens,
                   tile_auto=m.seq_tile == "auto" and getattr(m._family().block, "SEQ_TILING", False),
                   backend=backend)

    @property
    def largest_group(self) -> int:
        return max(self.block, self.embed, self.head)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def activation_layer(self) -> int:
        """Bytes of one layer's boundary activation for the whole (per-device) batch."""
        return self.tokens * self.hidden * self.dtype_bytes


def block_working_set(shapes: Shapes, tokens_mb: int, backend: str | None = None) -> float:
    """One block's recompute + VJP working set for ``tokens_mb`` tokens: XLA's temporaries of the
    engine's block backward on ``backend`` (None: the shapes'; on the GPU the attention path's own
    extra beyond cuDNN is a row of its own). Sequence-tiled: what spans the whole sequence around
    attention, one tile's worth of the per-token terms, and the tile loops' gradient sums."""
    w, seq = WS_BY_BACKEND[backend or shapes.backend]
    mlp = shapes.mlp_width * (shapes.mlp_ws if shapes.routed_pad else w["moe_mlp" if shapes.mlp_ws == WS_PER_TOKEN["moe_mlp"] else "mlp"])
    other = w["hidden"] * shapes.hidden + w["qkv"] * shapes.qkv_width + w["q"] * shapes.q_width
    scale = shapes.dtype_bytes / 2 * (2 if shapes.dtype_bytes == 4 else 1)
    tile = shapes.seq_tile
    gpu = (backend or shapes.backend) == "gpu" and shapes.mlp_ws != WS_PER_TOKEN["moe_mlp"]  # (dense MoE: its own fit)
    bound = (lambda ws: WS_GPU_SCALE * ws + WS_GPU_PER_PARAM * shapes.block) if gpu else (lambda ws: ws)
    if not 0 < tile < shapes.seq:
        return bound(((tokens_mb + shapes.routed_pad) * mlp + tokens_mb * other) * scale + w["block"] * shapes.block)
    heads = shapes.q_width // max(shapes.head_dim, 1)
    spans = (seq["hidden"] * shapes.hidden + seq["qkv"] * shapes.qkv_width + seq["q"] * shapes.q_width) \
        * shapes.dtype_bytes / 2 + seq["head"] * heads
    tiles = tokens_mb // shapes.seq * tile  # one tile of each sequence
    return bound(tokens_mb * spans + ((tiles + shapes.routed_pad) * mlp + tiles * seq["tile"] * other) * scale + seq["block"] * shapes.block)


def loss_working_set(shapes: Shapes, tokens_mb: int, loss_chunk: int) -> float:
    chunk = min(loss_chunk, tokens_mb)
    return chunk * shapes.vocab * LOSS_BYTES_PER_LOGIT + 3 * tokens_mb * shapes.hidden * 4


AttentionExtra = Callable[[int], "tuple[float, str]"]  # sequences per micro-batch -> (bytes, implementation)


@dataclass
class PhaseInputs:
    """What a step's GPU phases depend on besides the model's shapes: one candidate of the placement search
    (``search.evaluate``) with the plan's fixed choices (how blocks stream, where the update runs). Read only
    (not frozen: the search makes one per distinct candidate, and a frozen dataclass's ``__init__`` is slower)."""

    micro_batches: int
    stream_bytes: int  # bytes per streamed block parameter (2: the host's bf16 copy; 4: the fp32 master)
    device_cast: bool  # the fp32 master is cast on the GPU (the block's compute-dtype copy beside it)
    act_on_gpu: bool  # every kept boundary activation waits on the GPU (train.activations=device)
    hold_bytes: int | None  # GPU bytes/param of the gradient hold (None: a host hold, or a resweep)
    loss_chunk: int
    deferred: bool  # gradients wait for the clipping norm
    attn: AttentionExtra | None = None
    update_state_bytes: float | None = None  # optimizer state bytes/param of a device-side update, None: host
    boundary_every: int = 1  # k: every k-th block input kept (L/k), the backward holds the k-1 it recomputes
    stream_io: bool = False  # neither embedding nor head is resident; one vocabulary chunk of the head (fp32 +
    #                          cast + its fp32 gradient), one logits tile and the fp32 dx are
    grad_hold_gpu_bytes: float = 0.0  # the bf16 share of a split hold (``grad_hold_gpu_groups``)
    resweep: bool = False  # no hold; the activations stay for a second backward sweep
    activations_gpu_blocks: int = 0  # pinned activations split: the last this-many blocks keep their inputs on the GPU
    update_shards: int = 1  # GPUs sharing each group's device-side update (engine/shards.py): each holds and updates
    #                         its 1/N share of the held gradients, the state in flight and the write-back
    hold_shards: int = 1  # GPUs sharing each held gradient (an optax update, whole on each GPU, gathers it first)

    @property
    def held_split(self) -> int:  # GPUs sharing each held gradient: each holds its share
        return max(self.update_shards, self.hold_shards)


def gpu_phases(shapes: Shapes, x: PhaseInputs, want: bool = True) -> tuple[dict[str, float], list[Row]]:
    """Bytes on the GPU at each phase of a step with placement ``x``, and the rows that explain them.
    ``want=False``: the phases only (the search evaluates thousands of candidates; the rows of the one it
    takes are made again)."""
    rows: list[Row] = []
    out = rows if want else None
    tok_mb = shapes.batch * shapes.seq // x.micro_batches
    resident = _resident_weights(shapes, x, out)
    queued, inflight = _blocks_in_flight(shapes, x, out)
    act = _boundary_activations(shapes, x, out)
    ws = _working_set(shapes, x, tok_mb, out)
    emb_acc, head_acc, accum = _accumulators(shapes, x, queued, out)
    loss_ws, out_grad = _loss(shapes, x, tok_mb, out)
    held = _held_gradients(shapes, x, out)
    # the step's inputs (tokens, labels, loss mask, positions: 4 bytes each) and every micro-batch's aux, made once
    # for the step and read by each block: the rotary tables, cos and sin in fp32 (models/common.rope_tables)
    inputs = shapes.tokens * (16 + 4 * shapes.head_dim)
    if out is not None:
        out.append(Row("gpu", "step inputs and the blocks' aux (rotary tables)", inputs, "for the whole step"))
    fixed = resident + inflight + inputs
    update = _device_update(shapes, x, out)
    head_hold = shapes.head * (x.hold_bytes or 0) / x.held_split if (x.deferred and not x.stream_io) else 0
    # resweep with stream_io: the first sweep keeps the top cotangents for the second (the streamed head is not
    # run again), a layer of activations on the GPU from the loss to the second sweep's start
    top = act.layer if (x.resweep and x.stream_io) else 0
    if top and out is not None:
        out.append(Row("gpu", "top cotangents kept for the second sweep", top, "resweep with train.stream_io"))
    phases = {
        "forward start (all held gradients, no activations)": fixed + held + act.layer + ws / 2 + update,
        # gradient accumulators of head and embedding, the output matrix's fp32 gradient and its cast
        "loss (all activations, loss chunk)": fixed + act.acts - act.segment + loss_ws + head_acc + emb_acc + out_grad
        + act.layer + update,
        # + the cotangents flowing down the blocks (one layer's worth; the VJP's new one is in its working set)
        "backward start (activations, accumulators)": fixed + act.acts + accum + head_acc + ws + head_hold + act.layer
        + top,
        # (a split: the last pinned input comes back while the one before it is on its way: an H100 run peaked
        # 0.5 GB over a plan without it)
        "backward end (held gradients, accumulators)": fixed + held + accum + ws + (act.layer if x.act_on_gpu
                                                                                 or act.split else 0)
        + act.layer + act.segment + top,
        **({"embedding backward (held gradients, the rows' gradient)": fixed + held + emb_acc + 2 * act.layer + top}
           if x.stream_io else {}),
    }
    if x.resweep:  # the first sweep takes only the norm: every activation stays for the second, and dx of the top
        # (and the first groups it holds on the GPU in bf16, where it holds some: grad_hold_gpu_groups)
        phases["second backward (activations kept, top dx)"] = fixed + act.acts + accum + head_acc + ws + act.layer \
            + top + held
    return phases, rows


def _resident_weights(shapes: Shapes, x: PhaseInputs, rows: list[Row] | None) -> float:
    """The embedding and head weights on the GPU for the whole step (stream_io: one vocabulary chunk of the head)."""
    dt = shapes.dtype_bytes
    if x.stream_io:
        vc = min(IO_VOCAB_CHUNK, shapes.vocab)
        resident = vc * shapes.hidden * (4 + dt + 4)
        if rows is not None:
            rows.append(Row("gpu", "head: one vocabulary chunk (train.stream_io)", resident,
                            f"{vc} rows fp32 + cast + fp32 gradient; embedding rows gathered per batch"))
        return resident
    # the embedding and head always stream their fp32 master (hoststore.py) and are cast in each jit
    resident = (shapes.embed + shapes.head) * 4 + (shapes.embed + shapes.head) * (dt if dt == 2 else 0)
    if rows is not None:
        rows.append(Row("gpu", "embedding + head weights (resident for the step)", resident,
                        "fp32 + compute-dtype cast" if dt == 2 else "fp32"))
    return resident


def _blocks_in_flight(shapes: Shapes, x: PhaseInputs, rows: list[Row] | None) -> tuple[int, float]:
    """(blocks queued, bytes of the blocks' weights on the GPU): the engine's pace (weights.Pace), one block
    computing, BLOCKS_QUEUED - 1 queued behind it, the next in flight."""
    queued = shapes.blocks_queued
    blocks = queued + 1
    inflight = blocks * shapes.block * x.stream_bytes + (shapes.block * shapes.dtype_bytes if x.device_cast else 0)
    if rows is not None:
        rows.append(Row("gpu", f"{blocks} blocks' weights (" + ("computing, queued, in flight)" if queued > 1 else
                                                               "computing, in flight)"), inflight,
                        "fp32 master, cast on the GPU" if x.device_cast else ""))
    return queued, inflight


class _Activations(NamedTuple):  # (a tuple: made for every distinct candidate; a frozen dataclass is slower)
    layer: float  # one layer's boundary activation (the whole per-device batch)
    acts: float  # the kept boundary activations on the GPU
    segment: float  # the inputs of one segment, recomputed in the backward
    split: int  # kept inputs among the last blocks a split placement keeps on the GPU


def _boundary_activations(shapes: Shapes, x: PhaseInputs, rows: list[Row] | None) -> _Activations:
    """The boundary activations the GPU keeps: every kept input (activations=device), or the layers of parked
    inputs in flight (pinned_host), or a split's last blocks' inputs and one parked layer beside them."""
    k = max(int(x.boundary_every), 1)
    act_layer = shapes.batch * shapes.seq * shapes.hidden * shapes.dtype_bytes
    kept_layers = -(-shapes.layers // k)
    segment = (k - 1) * act_layer  # the inputs of one segment, recomputed in the backward
    # parked in pinned host memory: the copies of the last layers out are still in flight (the engine bounds them;
    # unbounded, the H100 held 31 micro-batch inputs of 64 MiB at once at 8 x 8192 tokens, ~4 layers: bench_memory_plan.py)
    split = 0 if x.act_on_gpu else kept_on_gpu(shapes.layers, k, x.activations_gpu_blocks)
    # a split: the engine lets the parked layers land before the first the GPU keeps (weights.Boundaries), and in
    # the backward one parked layer comes back while the GPU's last one is used
    acts = (kept_layers * act_layer if x.act_on_gpu else
            ((split + 1) if split else PINNED_ACT_LAYERS_ON_GPU) * act_layer) + segment
    if rows is not None:
        rows.append(Row("gpu", "boundary activations", acts,
                        (f"{kept_layers} layers x {shapes.tokens} tokens" if x.act_on_gpu
                         else f"the last {x.activations_gpu_blocks} blocks' inputs here ({split} layers), the "
                              "others in pinned host memory, one in flight" if split
                         else f"in pinned host memory; {PINNED_ACT_LAYERS_ON_GPU} layers in flight")
                        + (f"; every {k}th block input, {k - 1} recomputed per segment" if k > 1 else "")))
    return _Activations(act_layer, acts, segment, split)


def _working_set(shapes: Shapes, x: PhaseInputs, tok_mb: int, rows: list[Row] | None) -> float:
    """One block's recompute + VJP working set, with the attention path's own beyond the calibrated (cuDNN) one."""
    ws = block_working_set(shapes, tok_mb)
    if rows is not None:
        rows.append(Row("gpu", "block recompute + VJP working set", ws, f"{tok_mb} tokens per micro-batch"
                        + (f", sequence tiles of {shapes.seq_tile}" if 0 < shapes.seq_tile < shapes.seq else "")))
    if x.attn is not None:  # what the chosen attention path needs beyond the calibrated (cuDNN) coefficients
        extra, impl = x.attn(max(shapes.batch // x.micro_batches, 1))
        if rows is not None:
            rows.append(Row("gpu", "attention working set beyond cuDNN's", extra, impl))
        ws += extra
    return ws


def _accumulators(shapes: Shapes, x: PhaseInputs, queued: int, rows: list[Row] | None) -> tuple[float, float, float]:
    """(the embedding's, the head's, the blocks' and (not stream_io) the embedding's) fp32 gradient accumulators."""
    # current block's fp32 accumulator + the embedding's (stream_io: the gathered rows' gradient)
    emb_acc = shapes.tokens * shapes.hidden * 4 if x.stream_io else shapes.embed * 4
    head_acc = 0 if x.stream_io else shapes.head * 4  # stream_io: counted with the vocabulary chunk
    # the blocks computing and queued each have one; a gradient copied to a host hold (pinned or pageable) waits on
    # the GPU until its copies are issued (HOLD_COPIES_IN_FLIGHT, the engine's bound: holds.PageableHold)
    # (a resweep's second sweep sends each gradient to the host as it completes: the same bound, updaters._bound_waiting)
    host_hold = x.deferred and not x.hold_bytes
    # (stream_io: the embedding rows' gradient exists only in the embedding's backward, after the last block)
    accum = (queued + (HOLD_COPIES_IN_FLIGHT if host_hold else 0)) * shapes.block * 4 \
        + (0 if x.stream_io else emb_acc)
    if rows is not None:
        rows.append(Row("gpu", "gradient accumulators (fp32)", accum + head_acc + (emb_acc if x.stream_io else 0),
                        f"{queued} blocks" + (f" + {HOLD_COPIES_IN_FLIGHT} on its way to the host hold" if host_hold
                                              else "")
                        + (", embedding rows" if x.stream_io else ", embedding, head")))
    return emb_acc, head_acc, accum


def _loss(shapes: Shapes, x: PhaseInputs, tok_mb: int, rows: list[Row] | None) -> tuple[float, float]:
    """(the loss's working set, the output matrix's gradient at the loss): logits never exist whole."""
    if x.stream_io:
        vc = min(IO_VOCAB_CHUNK, shapes.vocab)
        loss_ws = min(x.loss_chunk, tok_mb) * vc * LOSS_BYTES_PER_LOGIT + shapes.tokens * shapes.hidden * 4 \
            + 3 * tok_mb * shapes.hidden * 4
        if rows is not None:
            rows.append(Row("gpu", "loss tile and dx (logits never exist whole)", loss_ws,
                            f"{min(x.loss_chunk, tok_mb)} tokens x {vc} vocabulary, fp32 dx of the step"))
        return loss_ws, 0.0  # the head's gradient leaves one vocabulary chunk at a time
    loss_ws = loss_working_set(shapes, tok_mb, x.loss_chunk)
    if rows is not None:
        rows.append(Row("gpu", "loss chunk (logits never exist whole)", loss_ws,
                        f"chunk {min(x.loss_chunk, tok_mb)} tokens"))
    return loss_ws, shapes.vocab * shapes.hidden * (4 + shapes.dtype_bytes)  # its fp32 gradient and its cast


def _held_gradients(shapes: Shapes, x: PhaseInputs, rows: list[Row] | None) -> float:
    """The gradients held on the GPU for the clipping norm: a GPU hold's, a split hold's first groups in bf16."""
    # (stream_io: the embedding's and head's gradients are made in host memory and wait there)
    on_gpu_params = shapes.params - (shapes.embed + shapes.head if x.stream_io else 0)
    held = (on_gpu_params * x.hold_bytes) if (x.deferred and x.hold_bytes) else 0
    held += x.grad_hold_gpu_bytes if x.deferred else 0.0
    held /= x.held_split  # (several GPUs updating on the device: each holds its share)
    if x.deferred and rows is not None:
        rows.append(Row("gpu", "gradients held for clipping", held,
                        ("none: a second backward sweep (resweep)" if x.resweep else
                         {4: "fp32", 2: "bf16"}.get(x.hold_bytes or 0, "in host memory")
                         + (", the first groups in bf16 on the GPU" if x.grad_hold_gpu_bytes else ""))
                        + (f"; each GPU its 1/{x.held_split}" if x.held_split > 1 and held else "")))
    return held


def _device_update(shapes: Shapes, x: PhaseInputs, rows: list[Row] | None) -> float:
    """A device-side update's GPU bytes: the state of the two blocks in flight and of the embedding or head being
    updated, three updated blocks (master + state) being written back, and one slice of the update's temporaries
    (up to 16 bytes a value); counted at the loss too, where the H100 measured it (RESULTS.md). 0 for host updates."""
    if x.update_state_bytes is None:
        return 0.0
    s = x.update_state_bytes
    # (stream_io: the embedding and head update on the host: blocks only)
    big = shapes.block if x.stream_io else max(shapes.embed, shapes.head)
    largest = shapes.block if x.stream_io else max(shapes.embed, shapes.head, shapes.block)
    n = x.update_shards  # several GPUs: each its share of every group (engine/shards.py)
    update = (s * (2 * shapes.block + big) + (4 + s) * WRITEBACKS_IN_FLIGHT * shapes.block) / n \
        + shapes.update_temp * (min(DEVICE_UPDATE_CHUNK, largest / n) if shapes.update_chunked else largest / n)
    if x.deferred and x.hold_shards > n:  # an update run whole on each GPU gathers the gradient held split
        update += (x.hold_bytes or 2) * (2 * shapes.block + big)
    if rows is not None:
        rows.append(Row("gpu", "device-side update (state in flight, write-back, temporaries)", update,
                        "train.update_on=device" + (f"; each GPU updates its 1/{n} of every group" if n > 1 else "")))
    return update


@functools.lru_cache(maxsize=4096)
def kept_on_gpu(layers: int, every: int, activations_gpu_blocks: int) -> int:
    """Kept block inputs among the last ``activations_gpu_blocks`` blocks (a split placement keeps those on the
    GPU). Cached: every candidate of the search asks, with a few values."""
    return sum(1 for i in range(max(layers - activations_gpu_blocks, 0), layers) if i % max(every, 1) == 0)


def pinned_pool(pinned: float, limit: float | None = None, chunk: float = 0.0) -> float:
    """Host bytes XLA's pinned-host allocator holds resident once ``pinned`` bytes are in use: a BFC
    allocator with growth (xla GetGpuHostAllocator: allow_growth, cudaHostAlloc regions, every page
    locked) whose regions double from 2 MiB, the last one cut at its limit
    (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, ``pinned_limit``). Peak RSS carries the whole pool: 49.3 GB of
    pinned arrays became a 68.7 GB pool (Llama-3.1-8B at 24 GB, RESULTS.md: 121.4 GB RSS, plan 100.7).
    With arrays of ``chunk`` bytes that a region holds only whole (``bfc_capacity``), the pool is its limit."""
    if pinned <= 0:
        return 0.0
    cap = pinned_limit(pinned, chunk) if limit is None else limit
    if chunk > PINNED_CHUNKED_ABOVE:
        return max(min(bfc_regions(math.ceil(pinned / chunk), chunk, cap), cap), pinned)
    return min(grown_pool(pinned), max(cap, pinned))


PINNED_CHUNKED_ABOVE = 1 << 30  # pools whose largest array is above this are planned as whole chunks in regions
# (bfc_capacity): the 70B's 1.59 GiB bf16 block gradients ran out of a byte-counted limit after step 2 (4 x H200),
# while the 8B's 0.81 GiB fp32 ones ran within one (H100: smaller arrays fill the regions' tails)
PINNED_SPARE_CHUNKS = 2  # chunks of room over the arrays: smaller arrays in a region's tail and the order of frees
#                          leave holes no large array fits (the 70B's pinned pool ran out after its second step)


def bfc_regions(n: int, chunk: float, limit: float) -> float:
    """The bytes of the regions XLA's BFC allocator holds once ``n`` arrays of ``chunk`` bytes are in it (as
    ``bfc_capacity`` places them; the limit where they do not all fit)."""
    return _bfc(limit, chunk, n)[1]


def bfc_capacity(limit: float, chunk: float) -> int:
    """How many arrays of ``chunk`` bytes XLA's growing BFC allocator can hold under ``limit`` (``_bfc``)."""
    return _bfc(limit, chunk)[0]


@functools.lru_cache(maxsize=8192, typed=True)  # (pure; the search asks again with the same bytes)
def _bfc(limit: float, chunk: float, stop: int | None = None) -> tuple[int, float]:
    """(arrays held, region bytes): how many arrays of ``chunk`` bytes XLA's growing BFC allocator holds under
    ``limit`` (up to ``stop`` of them), each request a new
    region when none has room (tsl BFCAllocator::Extend: the region size doubles from 2 MiB until it holds the
    request, and doubles again after each region that did not need to grow; the last region is cut at the limit).
    A chunk never spans two regions, so a region holds only whole chunks: 29 chunks of 1.59 GiB under a 49 GiB
    limit, where 30.8 fit by bytes."""
    chunk = math.ceil(chunk / 256) * 256
    size = float(2 << 20)
    while chunk > size:  # the first request grows the region size until it holds one
        size *= 2
    total, held, first = 0.0, 0, True
    while stop is None or held < stop:
        region = min(size, limit - total)
        if region < chunk:
            break
        fit = int(region // chunk)  # every request is one chunk: a region is filled before the next is made
        if stop is not None and held + fit >= stop:
            return stop, total + region
        total, held = total + region, held + fit
        if not first:
            size *= 2  # (the first region needed its size grown: the next is the same size)
        first = False
    return held, total


@functools.lru_cache(maxsize=8192, typed=True)  # (pure; the search asks again with the same bytes)
def pinned_limit(pinned: float, chunk: float = 0.0) -> float:
    """The pinned-host pool's limit the plan gives XLA (``apply_gpu_settings``), bytes, in whole GiB: room for
    fragmentation over what the plan puts there; where its arrays are large (``chunk``: the largest, more than
    PINNED_CHUNKED_ABOVE), at least the limit under which the regions hold every array as a whole chunk and
    PINNED_SPARE_CHUNKS more (``bfc_capacity``)."""
    limit = float(max(4, math.ceil(pinned * PINNED_LIMIT_FACTOR / GiB) + PINNED_LIMIT_ROOM) * GiB)
    if chunk > PINNED_CHUNKED_ABOVE and pinned > 0:
        need = math.ceil(pinned / chunk) + PINNED_SPARE_CHUNKS
        while bfc_capacity(limit, chunk) < need:
            limit += GiB
    return limit


def early_params(shapes: Shapes, groups: int) -> int:
    """Parameters of the forward's first ``groups`` groups (the embedding, blocks 0, 1, ..., the head): those whose
    device-side update state crosses in the backward (train.early_state_groups)."""
    k = max(int(groups), 0)
    return min(k, 1) * shapes.embed + min(max(k - 1, 0), shapes.layers) * shapes.block \
        + (shapes.head if k > shapes.layers + 1 else 0)


def residual_bytes_per_block(shapes: Shapes, head_dim: int) -> float:
    """GPU bytes one block's kept forward residuals take for the whole step: the matmul outputs a
    token keeps (q, k, v, the attention's output projection, gate and up; engine/kernels.py's checkpoint
    policy) and the rotary tables in fp32 (jax.eval_shape of the engine's kernel: tests). The block's
    weights and its input are not among them (the backward gets them again)."""
    # + dt x H: a margin for what the GPU may keep beyond the abstract count
    per_token = shapes.dtype_bytes * (2 * shapes.hidden + shapes.qkv_width + 2 * shapes.mlp_width) + 4 * head_dim
    return float(shapes.batch * shapes.seq * per_token)


@functools.lru_cache(maxsize=8192, typed=True)  # (pure; the search asks again with the same bytes)
def grown_pool(need: float) -> float:
    """GPU bytes XLA's allocator holds once ``need`` is in use, growing on demand: each new region is
    twice the last (tsl's BFC allocator with allow_growth)."""
    pool, region = 0.0, float(BFC_FIRST_REGION)
    while pool < need:
        pool, region = pool + region, region * 2
    return pool


# over pinned_in_use's exchange, bytes: holes too small for a block's gradient, and the next forward's inputs
# arriving before the last updates let their gradients go. The 8B at 10 GB (16 micro-batches, host update) ran
# out of XLA's pinned pool with its limit at 30 GiB against 27.3 modelled without this room, and its pool had grown
# to 32 GiB under a looser limit (bench_gpu_budgets.py); at 24 GB (device update) 21.5 modelled ran within 24.
PINNED_REUSE_ROOM = 3 * GiB
PINNED_ACTS, PINNED_HOLD = "boundary activations (pinned)", "gradients held for clipping (pinned)"
PINNED_REUSED = "pinned space the backward reuses"  # a negative row: pinned_in_use's saving (build.py)


def pinned_need(rows: list[Row]) -> float:
    """The pinned arrays of the host rows, summed (each at its largest)."""
    return sum(r.bytes for r in rows if "pinned" in r.what and r.what != PINNED_REUSED)


def pinned_in_rows(rows: list[Row]) -> float:
    """The pinned bytes in use at the peak as the host rows count them: the arrays, less the space the backward
    reuses (the negative PINNED_REUSED row, where ``pinned_in_use`` found an exchange). XLA's pool limit is taken
    from this, so it cannot drift from the rows (computed apart, it once took a bf16 hold at 4 bytes)."""
    return pinned_need(rows) + sum(r.bytes for r in rows if r.what == PINNED_REUSED)


def pinned_in_use(rows: list[Row], shapes: Shapes, boundary_every: int = 1, grad_hold_gpu_groups: int = 0,
                  total: float | None = None, activations_gpu_blocks: int = 0, hold_bytes: float = 4.0) -> float:
    """Pinned bytes in use at the step's peak, what XLA's pinned pool must hold. With pinned activations and
    a pinned hold both, the backward trades one for the other: block i's gradient lands (block L-1's first)
    while the inputs of blocks <= i still wait, so the peak is the largest of those sums, not activations +
    hold (the 8B at 10 GB measured a 34.4 GB pool where the sum said 48 GB, bench_gpu_budgets.py). Counted
    conservatively: block i's own input is still there when its gradient lands, and the hold's groups
    that are not blocks (the head lands first, the embedding last) are there throughout. The first
    ``grad_hold_gpu_groups`` groups of the forward (embedding, block 0, ...) wait on the GPU, not here;
    PINNED_REUSE_ROOM over it, never more than the arrays' sum. A split placement (``activations_gpu_blocks``) parks
    only the inputs of blocks below the last ``activations_gpu_blocks``. ``hold_bytes``: 4 (pinned_host) or 2 (pinned_bf16) a value."""
    total = pinned_need(rows) if total is None else total
    acts = sum(r.bytes for r in rows if r.what == PINNED_ACTS)
    held = sum(r.bytes for r in rows if r.what == PINNED_HOLD)
    if not acts or not held:
        return total
    n, k = shapes.layers, max(1, boundary_every)
    first_host = max(grad_hold_gpu_groups - 1, 0)  # the first block whose gradient waits here
    block = hold_bytes * shapes.block
    parked_below = n - activations_gpu_blocks  # blocks below it park their kept inputs
    per_input = acts / max(len(range(0, parked_below, k)), 1)
    rest = max(held - (n - first_host) * block, 0.0)
    peak = max(per_input * len(range(0, min(i, parked_below - 1) + 1, k)) + block * (n - max(i, first_host))
               for i in range(n))
    return min(total, total - acts - held + rest + peak + PINNED_REUSE_ROOM)
