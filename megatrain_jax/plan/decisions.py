"""The plan's choices: every ``auto`` of the config decided from sizes (``sizes.py``) and the machine.

The streaming copy, where the update runs, the micro-batch counts the search may try, kept
residuals, gradient slabs, and XLA's pool. Each function decides one thing and says why; the step's
placement (micro-batches, activations, gradient hold, streaming, loss chunk) is searched
(``search.py``); ``build.py`` calls them in order and turns the result into ``EngineOptions``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from megatrain_jax.errors import UserError
from megatrain_jax.placements import (DEVICE_CAST, DEVICE_UPDATE, HOST_COPY, HOST_UPDATE, STREAM_COPIES, UPDATE_PLACES,
                                      ActivationPlace, GradHold, StreamCopy, UpdatePlace, asked)
from megatrain_jax.bounds import BLOCKS_QUEUED
from megatrain_jax.plan.sizes import (GB, GPU_MARGIN, GRAD_SLABS_FEWEST, GRAD_SLABS_MOST, MICRO_TOKENS,
                                      PREALLOCATE_ABOVE, RATES, XLA_FRACTION, Row, Shapes, residual_bytes_per_block,
                                      usable)

# the host-state modes, fullest first: (name, overrides)
MODES = {"full": {"moments": "float32"},
         "compact": {"moments": "bfloat16", "stream_copy": DEVICE_CAST.name},
         "leanest": {"moments": "int8", "stream_copy": DEVICE_CAST.name}}


def mode_settings(over: dict[str, str]) -> str:
    """A state mode's overrides as the settings a user types."""
    return " ".join(f"{'optim' if k == 'moments' else 'train'}.{k}={v}" for k, v in over.items())


STREAM_HIDDEN_RATIO = 0.25  # fp32 stream time / block forward compute below which the device cast is free


@dataclass(frozen=True)
class RuntimeSettings:
    """The plan's decisions that are not the engine's (``EngineOptions``): reported, or given to XLA
    before its backend starts (``apply_gpu_settings``)."""

    attention: str | None  # the attention implementation (None: the model has no attention)
    attention_summary: str | None  # one line for the log (None: no attention)
    moments: str  # optimizer moment dtype
    devices: int  # GPUs of the run, resolved (train.devices=all, processes)
    pinned_pool_bytes: float  # pinned host memory the plan puts in rows
    gpu_mem_fraction: float | None  # XLA_PYTHON_CLIENT_MEM_FRACTION (None: CPU backend)
    gpu_preallocate: bool | None  # XLA_PYTHON_CLIENT_PREALLOCATE (None: CPU backend)
    pinned_limit_bytes: float = 0.0  # XLA's pinned-pool limit (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB), sizes.pinned_limit


@dataclass(frozen=True)
class Candidate:
    """One point of the placement search (``search.py``): micro-batches, where activations and held gradients
    live (placement objects), how the step streams and the loss is chunked, and the split counts (the first groups
    held on the GPU, the last blocks' inputs kept there). What the GPU phases read of it is ``phase_key``."""

    micro_batches: int
    activations: ActivationPlace
    hold: GradHold
    boundary_every: int = 1  # keep every k-th block input
    stream_io: bool = False  # embedding and head not resident
    loss_chunk: int = 1024
    grad_hold_gpu_groups: int = 0  # a host hold's (or a resweep's) first groups held on the GPU in bf16
    activations_gpu_blocks: int = 0  # pinned activations: the last this-many blocks keep their inputs on the GPU
    #                                  (a split)

    def with_(self, **changes: Any) -> "Candidate":
        return replace(self, **changes)

    @property
    def phase_key(self) -> tuple:
        """Everything the GPU phases read of the candidate (``sizes.gpu_phases``): candidates equal in it (a host
        hold's kind, say, or its host side) share their phases."""
        return (self.micro_batches, self.activations.on_gpu, self.hold.gpu_bytes, self.loss_chunk,
                self.boundary_every, self.stream_io, self.grad_hold_gpu_groups, self.hold.is_resweep,
                self.activations_gpu_blocks)

    @property
    def splits_activations(self) -> bool:
        """Whether its activations may keep the last blocks' inputs on the GPU: parked, every input kept."""
        return self.activations.parked and self.boundary_every == 1


@dataclass
class Placement:
    """A candidate (``Candidate``) evaluated: the GPU phases, host need and predicted step it makes on the run's
    shapes, and whether it fits."""

    candidate: Candidate
    phases: dict[str, float]
    gpu_rows: list[Row]
    gpu_need: float
    fits: bool
    notes: list[str] = field(default_factory=list)
    seq_tile: int = 0  # the blocks' sequence tile (0: untiled)
    grad_hold_gpu_params: int = 0  # the parameters of the groups held on the GPU (grad_hold_gpu_groups)
    blocks_queued: int = BLOCKS_QUEUED  # the engine's pace (EngineOptions.blocks_queued)
    host_need: float = 0.0  # the plan's host need with this candidate (fewest slabs)
    host_placed: float = 0.0  # the same without XLA's GPU pool table (what the search's order compares)
    step: dict[str, Any] = field(default_factory=dict)  # its predicted step (step_model.predicted_step)

    # the candidate's decisions, read through
    @property
    def micro_batches(self) -> int:
        return self.candidate.micro_batches

    @property
    def activations(self) -> ActivationPlace:
        return self.candidate.activations

    @property
    def hold(self) -> GradHold:
        return self.candidate.hold

    @property
    def boundary_every(self) -> int:
        return self.candidate.boundary_every

    @property
    def stream_io(self) -> bool:
        return self.candidate.stream_io

    @property
    def loss_chunk(self) -> int:
        return self.candidate.loss_chunk

    @property
    def grad_hold_gpu_groups(self) -> int:
        return self.candidate.grad_hold_gpu_groups

    @property
    def activations_gpu_blocks(self) -> int:
        return self.candidate.activations_gpu_blocks


def resolve_devices(train_devices: Any, gpu_count: int, processes: int, devices: int | None) -> int:
    """GPUs the run uses in all: ``devices`` when asked (scaling predictions), else the config's count
    (``all``: every GPU of the host) times the processes."""
    if devices is not None and (isinstance(devices, bool) or int(devices) < 1):
        raise UserError("devices", f"the plan is for 1 GPU or more, got {devices!r}",
                        "give the number of GPUs to plan for (--devices N with N >= 1)")
    return devices or ((gpu_count if train_devices == "all" else int(train_devices)) or 1) * processes


def choose_update_on(setting: str, *, on_gpu: bool, devices: int, kernel: str, moments: str, bf16: bool,
                     stream_copy: str) -> UpdatePlace:
    """``train.update_on=auto``: the GPU applies the update where the moments are compact (bf16 or
    int8), on one GPU, with the fused kernel; the host elsewhere (fp32 moments: 8 bytes/param more each
    way over PCIe, not measured to pay). RESULTS.md: Qwen2.5-14B int8 350 -> 391 model-TFLOPS."""
    if asked(UPDATE_PLACES, setting) is not None:
        return UPDATE_PLACES[setting]
    copy = asked(STREAM_COPIES, stream_copy)
    if on_gpu and devices == 1 and kernel == "fused" and moments in ("bfloat16", "int8") \
            and not (bf16 and copy is not None and copy.on_host):
        return DEVICE_UPDATE
    return HOST_UPDATE


def choose_stream_copy(shapes: Shapes, seq_len: int, model, on_gpu: bool, bf16: bool, room: float,
                       h2d_rate: float = RATES["h2d"], matmul_rate: float = RATES["matmul_bf16"]) -> StreamCopy:
    """``train.stream_copy=auto``: stream the fp32 master and cast it on the GPU (saving the host's
    2-byte copy of every block) where that doubled transfer stays hidden behind a block's forward
    compute, or where the copy does not fit the host; otherwise keep the bf16 host copy (RESULTS.md:
    ratio 0.18 cost 1% of tokens/s, 0.35 cost 4%)."""
    if not bf16:
        return HOST_COPY  # fp32 compute streams the master itself: there is no copy to save
    copy_bytes = 2.0 * shapes.layers * shapes.block
    if not on_gpu:
        return HOST_COPY if copy_bytes <= room else DEVICE_CAST
    # (a MoE counts every expert here, as if the forward ran them all: its host update, not the link, binds its step,
    # and the bf16 copy on the host costs that update more than the link saves: the Qwen3-30B-A3B 12-layer shape at
    # 32 x 4096 ran 6.17 s a step with the host copy against 5.22 s casting on the GPU, bench_memory_plan.py, one H100)
    fwd_flops = shapes.tokens * (2.0 * shapes.block + 2.0 * seq_len * model.num_heads * model.dim_per_head)
    ratio = (4.0 * shapes.block / h2d_rate) / (fwd_flops / matmul_rate)
    return DEVICE_CAST if (ratio <= STREAM_HIDDEN_RATIO or copy_bytes > room) else HOST_COPY


def micro_batch_candidates(setting: Any, batch: int, seq: int, devices: int) -> list[int]:
    """``auto``: the divisors of the per-GPU batch from the fewest micro-batches of at most
    MICRO_TOKENS tokens upward (fewer only costs memory); a number: that one (split over the GPUs).
    A mixture of experts keeps the same cap, though its grouped matmuls run faster on more rows per expert: the
    Qwen3-30B-A3B 12-layer shape at 32 x 4096 with micro-batches of 65,536 tokens (where the plan then resweeps) ran
    5.40 s a step against 5.22 at 16,384 (experiments/bench_memory_plan.py, one H100)."""
    if setting == "auto":
        divisors = [k for k in range(1, batch + 1) if batch % k == 0]
        return [k for k in divisors if batch * seq // k <= MICRO_TOKENS] or divisors[-1:]
    asked = int(setting)
    return [asked // devices if devices > 1 and asked % devices == 0 else asked]


def choose_keep_residuals(asked: Any, shapes: Shapes, *, on_gpu: bool, devices: int, act_on_gpu: bool, moments: str,
                          need: float, budget: float | None, gpu_usable: float | None, moe: bool) -> tuple[int, float]:
    """How many of the last blocks keep their forward residuals (no recompute in the backward), and
    the bytes of one (on each GPU: each keeps its own micro-batches'). ``auto``: as many as the GPU room the plan
    leaves holds, with the activations on the GPU (with several GPUs, each keeps its own micro-batches' residuals
    in its own room: Qwen2.5-7B on four H200s kept 3 with 101.0 GB of a planned 115.4, bench_data_parallel.py); with int8
    moments (the state chosen for host memory) only within the room that keeps XLA's pool growing on demand, whose
    allocator table is host memory (``gpu_room``)."""
    per_block = residual_bytes_per_block(shapes, shapes.head_dim)
    if asked != "auto":
        kept = min(int(asked), shapes.layers - 1)
        if kept and gpu_usable is not None and need + kept * per_block > gpu_usable:
            raise UserError("train.keep_residuals",
                            f"{kept} blocks' residuals need {kept * per_block / GB:.1f} GB and the GPU room left by "
                            f"the plan is {max(gpu_usable - need, 0) / GB:.1f} GB",
                            f"set it to {max(int((gpu_usable - need) // per_block), 0)} or auto")
        return kept, per_block
    if not on_gpu or not act_on_gpu or gpu_usable is None or moe:
        return 0, per_block
    room = gpu_room(need, budget, gpu_usable, moments)
    return int(max(0, min(shapes.layers - 1, room // per_block))), per_block


def gpu_room(need: float, budget: float | None, gpu_usable: float, moments: str) -> float:
    """The GPU room on top of the step's peak that kept residuals and early-fetched update state may take; with int8
    moments only what keeps XLA's pool growing on demand (its allocator table is host memory)."""
    room = gpu_usable - need
    if moments == "int8" and budget and need <= PREALLOCATE_ABOVE * budget:
        room = min(room, PREALLOCATE_ABOVE * budget - need)
    return room


def choose_early_state(asked: Any, *, groups: int, n_keep: int, keep_auto: bool, per_block: float, room: float,
                       group_bytes: Callable[[int], float], step_of: Callable[[int, int], float]) -> tuple[int, int]:
    """How many of the forward's first groups a device-side update fetches during the backward, and the kept
    residuals beside them (``train.early_state_groups``; the caller offers it only where it applies). ``auto``: the
    pair with the least predicted step (``step_of(kept, early)``) whose bytes fit the room, kept residuals given up
    for early groups where that is faster (their state traffic bounded the forward of a split update: docs/design.md
    7.6), kept as many as before where not; an early set is taken only where it is 1% faster."""
    if asked != "auto":
        k = min(int(asked), groups)
        kept = min(n_keep, max(int((room - group_bytes(k)) // per_block), 0)) if keep_auto else n_keep
        if group_bytes(k) + kept * per_block > room:  # (kept residuals left auto give way to what is asked)
            fit = max(j for j in range(groups + 1) if group_bytes(j) + kept * per_block <= room) \
                if group_bytes(0) + kept * per_block <= room else 0
            raise UserError("train.early_state_groups", f"{k} groups' state needs {group_bytes(k) / 1e9:.1f} GB and "
                            f"the GPU room beside the kept residuals is "
                            f"{max(room - kept * per_block, 0) / 1e9:.1f} GB", f"set it to {fit} or auto")
        return k, kept
    best = (step_of(n_keep, 0), 0, n_keep)
    for k in range(1, groups + 1):
        left = room - group_bytes(k)
        if left < (0 if keep_auto else n_keep * per_block):
            break
        kept = min(n_keep, int(left // per_block)) if keep_auto else n_keep
        t = step_of(kept, k)
        if t < best[0] * 0.99 or (t < best[0] and best[1]):
            best = (t, k, kept)
    return best[1], best[2]


def choose_slabs(setting: Any, *, chunked: bool, on_gpu: bool, moments: str, host_room: float,
                 slab_bytes: float) -> int:
    """Pinned gradient slabs: as many as the host has room for (up to GRAD_SLABS_MOST), never fewer than
    GRAD_SLABS_FEWEST; int8 moments (the leanest state, chosen for memory) take the fewest: the int8 kernel,
    not the pool, paces those updates (RESULTS.md: Qwen2.5-7B 54.2 -> 50.7 GB host)."""
    if not chunked:
        return 3
    if setting != "auto":
        return int(setting)
    most = GRAD_SLABS_FEWEST if moments == "int8" else GRAD_SLABS_MOST
    return int(max(GRAD_SLABS_FEWEST, min(most, host_room // slab_bytes))) if on_gpu else GRAD_SLABS_FEWEST


def gpu_budget_of(gpu_bytes: float | None, on_gpu: bool, gpu_memory_gb: float | None) -> float | None:
    """What XLA's allocator is given (``apply_gpu_settings``), capped by ``train.gpu_memory_gb``; a CPU
    run honours that budget too (its "device" is host RAM)."""
    if on_gpu:
        budget = gpu_bytes * XLA_FRACTION
        return min(budget, gpu_memory_gb * GB) if gpu_memory_gb else budget
    return gpu_memory_gb * GB if gpu_memory_gb else None


def gpu_usable_of(budget: float | None) -> float | None:
    return usable(budget, GPU_MARGIN) if budget else None


def preallocate_pool(budget: float | None, need: float, budgeted: bool = False) -> bool:
    """Whether XLA makes its pool whole at the start: not where the step stays below
    PREALLOCATE_ABOVE of the budget (the pool grows on demand and its host-side table stays small),
    except under a budget smaller than the GPU (``budgeted``, train.gpu_memory_gb): grown on demand, the
    pool is regions doubling from 2 MiB with the last one cut at the budget (24 GB: ..., 4 and 8 GiB, then
    6.35 GiB), and one large allocation must fit a single region's free run: Llama-3.2-3B at 24 GB ran out
    of memory on a 6.27 GiB allocation with most of the pool free (RESULTS.md). One region holds any
    allocation that fits, and its table costs at most budget/32 of host memory."""
    return budgeted or not (budget and need <= PREALLOCATE_ABOVE * budget)
