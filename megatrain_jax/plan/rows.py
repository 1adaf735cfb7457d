"""The host side of a plan: the host rows a placement needs, XLA's pool, the disk, and what a candidate of the
placement search costs the host and the step (``PlacementCosts``: the same functions for every candidate the search
compares and for the plan it takes, so the figures it compares are the plan's).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megatrain_jax.bounds import GRAD_SLAB_ELEMS, IO_HEAD_GRADS_IN_FLIGHT, IO_VOCAB_CHUNK
from megatrain_jax.config import Config
import megatrain_jax.plan.decisions as choose
from megatrain_jax.placements import HOST_STATES, UpdatePlace
import megatrain_jax.plan.moe as plan_moe
from megatrain_jax.plan.machine import Machine, process_count
from megatrain_jax.plan.memo import PlanMemo
from megatrain_jax.plan.sizes import (BFC_TABLE_BYTES_PER_POOL_BYTE, GB, GRAD_SLABS_FEWEST, MICRO_TOKENS,
                                      MULTI_PROCESS_HOST_BYTES, PINNED_REUSED, RUNTIME_HOST_BYTES,
                                      XLA_FRACTION, GiB, Row, Shapes, grown_pool, kept_on_gpu, pinned_in_use,
                                      pinned_need, pinned_pool)
from megatrain_jax.plan.step_model import predicted_step

STORE_SLACK = 0.005  # host bytes per byte of the store the process holds beyond the rows (glibc, the driver's
#                      registration of the store): 0.3% measured at 70B; the row is 0.5% (one point measured)


def has_slabs(on_gpu: bool, update_on: UpdatePlace, p: choose.Placement) -> bool:
    """Whether the run has pinned gradient slabs: a host update's gradient, or a pageable hold's, lands there."""
    return on_gpu and (not update_on.on_device or p.hold.pageable)


@dataclass
class PlacementCosts:
    """What a candidate placement costs on the run's fixed facts (its shapes, machine, update and streaming): its
    host rows (``rows_of``), their sums the search compares (``host_of``) and its predicted step (``step_of``).
    The search evaluates thousands of candidates that differ only in what their host rows or step do not read
    (micro-batches, loss chunk, GPU bytes): each placement's are computed once."""

    cfg: Config
    shapes: Shapes  # the run's shapes (untiled, the usual pace: the search's own variants do not change the rows)
    machine: Machine
    n_dev: int
    gpu_budget: float | None
    update_on: UpdatePlace
    moment_bytes: float  # optimizer state bytes/param in host memory
    stream_bytes: int  # bytes per streamed block parameter
    host_copy: bool  # the host keeps a bf16 streaming copy of the blocks
    rates: dict[str, float]
    attention: bool
    optax_group: float = 0.0  # an optax host update's working set per parameter of its group (0: no optax update)
    optax_cost: Any = None  # the optax update's cost (step_model.optax_update_cost, looked up once: its cache's key is the
    #                         config's repr); None: the fused kernel
    memo: PlanMemo | None = field(default=None, repr=False, compare=False)  # the make_plan call's: its plans that
    #                                                                       cost placements alike share the tables
    on_gpu: bool = field(init=False)
    chunked: bool = field(init=False)  # the fused kernel takes the gradient in slabs of GRAD_SLAB_ELEMS values
    slab: int = field(init=False)  # bytes of one pinned gradient slab
    host_act_bytes: float = field(init=False)  # every block's boundary activation, this process's GPUs
    local_dev: int = field(init=False)  # this process's GPUs (n_dev over the processes of a multi-host run)
    non_emb: int = field(init=False)  # the model's non-embedding parameters (counted once for every step)
    _steps: dict[tuple, dict] = field(init=False, repr=False, default_factory=dict)
    _placed_sums: dict[tuple, float] = field(init=False, repr=False, default_factory=dict)
    _gpu_side_sums: dict[float, tuple[float, float]] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        s = self.shapes
        self.on_gpu = self.machine.backend == "gpu"
        self.chunked = self.cfg.optim.kernel == "fused"
        self.slab = (min(GRAD_SLAB_ELEMS, s.largest_group) if self.chunked else s.largest_group) * 4
        # host memory is per process: its own GPUs' parked activations, CUDA contexts and pool tables
        self.local_dev = max(self.n_dev // process_count(), 1)
        self.host_act_bytes = float(s.layers * s.batch * s.seq * s.hidden * s.dtype_bytes * self.local_dev)
        self.non_emb = plan_moe.step_matmul_params(self.cfg.model, min(s.tokens, MICRO_TOKENS))  # (MoE: plan/moe.py)
        if self.memo is not None:
            key = self.costs_key()
            self._steps, self._placed_sums, self._gpu_side_sums = (self.memo.table(name, key) for name in
                                                                   ("steps", "placed sums", "GPU-side sums"))

    def costs_key(self) -> tuple:
        """Everything the costs of a placement are computed from: the config (its host limit aside: that decides
        what fits, never what a placement costs), the shapes, machine and fixed choices, and the processes."""
        cfg = dataclasses.replace(self.cfg, train=dataclasses.replace(self.cfg.train, host_memory_gb=None))
        return (repr(cfg), repr(self.shapes), repr(self.machine), self.n_dev, self.gpu_budget, self.update_on,
                self.moment_bytes, self.stream_bytes, self.host_copy, repr(self.rates), self.attention,
                self.optax_group, repr(self.optax_cost), process_count())

    @property
    def hold_share(self) -> float:
        """The part of the held gradients in this process's host memory: where the GPUs split a device-side update
        each holds its share (engine/shards.py), so a process of several holds its GPUs' shares only."""
        split = self.update_on.on_device and self.n_dev > 1 and self.chunked
        return self.local_dev / self.n_dev if split else 1.0

    def has_slabs(self, p: choose.Placement) -> bool:
        return has_slabs(self.on_gpu, self.update_on, p)

    def rows_of(self, p: choose.Placement, slabs: int) -> list[Row]:
        """The host rows with placement ``p`` and ``slabs`` gradient slabs (where the path has them)."""
        return self.placement_rows(p, slabs) + self.gpu_side_rows(p)

    def placement_rows(self, p: choose.Placement, slabs: int) -> list[Row]:
        """The host rows that follow from where ``p`` puts things, not from its GPU bytes."""
        shapes, slab = self.shapes, self.slab
        slab_row = None
        if self.has_slabs(p):
            slab_row = Row("host", "gradient staging (pinned slabs)", float(slab * slabs),
                           f"{slabs} x {slab / GiB:.3f} GiB (train.grad_slabs)")
        rows = host_rows(self.cfg, shapes, self.moment_bytes, host_copy=self.host_copy, on_gpu=self.on_gpu,
                         n_dev=self.local_dev, placed=p, host_act_bytes=self.host_act_bytes, slab_row=slab_row,
                         update_on=self.update_on, optax_group_bytes=self.optax_group, store_share=store_share(self.cfg),
                         hold_share=self.hold_share)
        arrays = pinned_need(rows)
        in_use = pinned_in_use(rows, shapes, p.boundary_every, p.grad_hold_gpu_groups, arrays,
                               p.activations_gpu_blocks, p.hold.host_bytes) \
            if p.activations.parked and p.hold.pinned else arrays
        if in_use < arrays:
            rows.append(Row("host", PINNED_REUSED, in_use - arrays,
                            "held gradients land where the activations they follow were"))
        growth = pinned_pool(in_use, chunk=self.pinned_chunk(p)) - in_use if self.on_gpu else 0.0
        if growth > 0:
            rows.append(Row("host", "XLA host allocator: regions grown beyond its arrays", growth,
                            "its regions double from 2 MiB (all page-locked), cut at its limit"))
        return rows

    def pinned_chunk(self, p: choose.Placement) -> float:
        """The largest array XLA's pinned pool takes with placement ``p`` (sizes.bfc_capacity: a region holds only
        whole ones): a held block's gradient, a parked block input (one GPU's), a gradient slab."""
        shapes = self.shapes
        sizes = [self.slab if self.has_slabs(p) else 0.0]
        if p.hold.pinned:
            groups = [shapes.block] + ([] if p.stream_io else [shapes.embed, shapes.head])
            sizes.append(p.hold.host_bytes * max(groups))
        if p.activations.parked:
            sizes.append(self.host_act_bytes / max(shapes.layers * self.local_dev, 1))
        return max(sizes)

    def gpu_side_rows(self, p: choose.Placement) -> list[Row]:
        """The host rows that follow from ``p``'s GPU bytes: XLA's pool table (the CPU backend: the buffers)."""
        pool_row, _, _ = xla_pool(self.machine, self.gpu_budget, p.gpu_need, self.local_dev)
        rows = [] if pool_row is None else [pool_row]
        if not self.on_gpu:
            rows.append(Row("host", "device buffers (the CPU backend's device memory is host memory)", p.gpu_need))
        return rows

    def step_of(self, p: choose.Placement) -> dict[str, Any]:
        """The candidate's predicted step (the same for candidates that differ only in the loss chunk or GPU bytes)."""
        key = (p.hold, p.activations, p.boundary_every, p.stream_io, p.grad_hold_gpu_params, p.micro_batches,
               p.blocks_queued, p.activations_gpu_blocks)
        if key not in self._steps:
            self._steps[key] = self.predicted_step(p, n_keep=0)
        return dict(self._steps[key])

    def predicted_step(self, p: choose.Placement, n_keep: int, n_early: int = 0) -> dict[str, Any]:
        """The predicted step with placement ``p``, ``n_keep`` blocks' residuals kept and ``n_early`` groups'
        device-update state fetched in the backward (step_model)."""
        return predicted_step(self.cfg, self.shapes, self.rates, n_dev=self.n_dev, n_keep=n_keep, n_early=n_early,
                              stream_bytes=self.stream_bytes, moment_bytes=self.moment_bytes, update_on=self.update_on,
                              cpu_cores=self.machine.cpu_cores, attention=self.attention, placement=p,
                              non_emb=self.non_emb, optax_cost=self.optax_cost)

    def host_of(self, p: choose.Placement) -> tuple[float, float]:
        """The candidate's host need with the fewest slabs, and the same without XLA's GPU pool table (what the
        search's order compares): the rows of where it puts things summed once per placement."""
        key = (p.hold, p.activations, p.boundary_every, p.stream_io, p.grad_hold_gpu_groups,
               p.grad_hold_gpu_params, p.activations_gpu_blocks)
        fixed = self._placed_sums.get(key)
        if fixed is None:
            fixed = self._placed_sums[key] = sum(r.bytes for r in self.placement_rows(p, GRAD_SLABS_FEWEST))
        side = self._gpu_side_sums.get(p.gpu_need)  # (a function of the GPU need alone: candidates share it)
        if side is None:
            side = self._gpu_side_sums[p.gpu_need] = _host_sums(self.gpu_side_rows(p))
        need, placed = side
        return fixed + need, fixed + placed


def _host_sums(rows: list[Row]) -> tuple[float, float]:
    """(host need, the same without XLA's GPU pool table): the search compares the second."""
    need = sum(r.bytes for r in rows)
    return need, need - sum(r.bytes for r in rows if r.what.startswith("XLA's GPU allocator table"))


def store_share(cfg: Config) -> float:
    """The part of the store one process backs: 1/N of N processes with ``train.host_state=sharded``, else all."""
    return 1.0 / process_count() if HOST_STATES[cfg.train.host_state].sharded else 1.0


def host_rows(cfg: Config, shapes: Shapes, moment_bytes: float, *, host_copy: bool, on_gpu: bool, n_dev: int,
              placed: choose.Placement, host_act_bytes: float, slab_row: Row | None, update_on: UpdatePlace,
              optax_group_bytes: float = 0.0, store_share: float = 1.0, hold_share: float = 1.0) -> list[Row]:
    """Host memory by component: the store, the pinned buffers the placement asks for, the checkpoint
    writer, the data loader and the runtime (``slab_row``: the gradient slabs of a host update; ``store_share``:
    the part of the store this process backs, ``train.host_state=sharded``)."""
    train = cfg.train
    part = f"this process's 1/{round(1 / store_share)} (train.host_state=sharded)" if store_share < 1 else ""
    rows = [Row("host", "fp32 master weights", 4.0 * shapes.params * store_share, part),
            Row("host", f"optimizer state ({cfg.optim.moments} moments)", moment_bytes * shapes.params * store_share,
                part)]
    if host_copy:
        rows.append(Row("host", "bf16 streaming copy (blocks)", 2.0 * shapes.layers * shapes.block,
                        "train.stream_copy=device removes it"))
    if slab_row is not None:  # device-side updates bring no gradient to the host
        rows.append(slab_row)
    # stream_io: the embedding's and head's fp32 gradients are made in host memory and wait there (engine/holds.HostArray),
    # outside any hold (the H100's 524k slice ran 3.9 GB over the plan without this row, bench_memory_plan.py)
    io_grads = shapes.embed + shapes.head if placed.stream_io else 0
    if io_grads:
        rows.append(Row("host", "embedding + head gradients (train.stream_io)", 4.0 * io_grads,
                        "fp32, made in host memory"))
    if placed.stream_io:
        # the head's vocabulary chunks: the engine's staging buffers (one per chunk, the whole output matrix gathered
        # once a step in the background: engine/io.py; registered host memory) and two chunk gradients on their way
        # to the host (XLA's pinned pool); the 3B at 10 GB ran 2.9 GB over a plan without them and without the
        # parked segment inputs below (bench_memory_plan.py)
        vc = min(IO_VOCAB_CHUNK, shapes.vocab)
        chunk, chunks = 4.0 * shapes.hidden * vc, -(-shapes.vocab // vc)
        rows.append(Row("host", "head chunks' staging (train.stream_io)", chunks * chunk * shapes.dtype_bytes / 4,
                        f"{chunks} chunks: the output matrix, vocabulary-major, in the compute dtype"))
        rows.append(Row("host", "head chunks' gradients on their way (pinned)", IO_HEAD_GRADS_IN_FLIGHT * chunk,
                        "two chunks"))  # (IO_HEAD_GRADS_IN_FLIGHT)
    held = shapes.params - io_grads - placed.grad_hold_gpu_params
    if hold_share != 1.0:  # a split device update over several processes: this process's GPUs' shares
        held *= hold_share
    split = f"; the first {placed.grad_hold_gpu_groups} groups wait on the GPU" if placed.grad_hold_gpu_groups \
        else ""
    hold = placed.hold
    if hold.pinned:
        rows.append(Row("host", "gradients held for clipping (pinned)", hold.host_bytes * held, hold.dtype + split))
    elif hold.pageable:
        rows.append(Row("host", "gradients held for clipping (pageable)", hold.host_bytes * held,
                        hold.dtype + ", fed through the slabs" + split))
        # measured over the rows above with a pageable hold, never with the pinned one (H100, bench_gpu_budgets.py:
        # 8B +2.3 GB, 14B +2.7 GB at 24 GB): one group in fp32 beside the hold, the size of the largest that goes
        # through it (stream_io: a block; the embedding's and head's gradients are made in host memory, and
        # counting the 8B's head there put the plan 5.3% over its run at 24 GB: bench_memory_plan.py)
        rows.append(Row("host", "pageable hold's staging (one group in fp32)",
                        4.0 * (shapes.block if placed.stream_io else shapes.largest_group)))
    if placed.activations.parked:
        k = placed.boundary_every
        kept = -(-shapes.layers // k) - kept_on_gpu(shapes.layers, k, placed.activations_gpu_blocks)
        parked = max(k - 2, 0)  # a segment's recomputed inputs below its top two wait parked too (weights.Boundaries)
        rows.append(Row("host", "boundary activations (pinned)", host_act_bytes * (kept + parked) / shapes.layers,
                        ", ".join(x for x in (f"every {k}th block input" if k > 1 else "",
                                              f"{parked} recomputed parked" if parked else "",
                                              f"the last {placed.activations_gpu_blocks} blocks' on the GPU"
                                              if placed.activations_gpu_blocks else "") if x)))
    host_updated = shapes.largest_group if not update_on.on_device else \
        (max(shapes.embed, shapes.head) if placed.stream_io else 0)
    if optax_group_bytes and host_updated:
        # one group at a time (one host-optimizer thread): the 110B lean shape's head (1.25B parameters, Adafactor,
        # 16 bytes a parameter) is 20 GB; without this row its run was killed 20+ GB over its plan (issue 42)
        rows.append(Row("host", "host update's working set (optax on the CPU device, one group)",
                        optax_group_bytes * host_updated, "inputs, outputs and temporaries of its compiled step"))
    if train.final_checkpoint or train.ckpt_every:
        rows.append(Row("host", "checkpoint writer (one group in flight)",
                        shapes.largest_group * (4 + moment_bytes) * store_share))
    rows.append(Row("host", "data loader (one batch, index)",
                    float(train.batch_size * cfg.data.seq_len * 4 * 4 + 64e6)))
    if on_gpu:  # measured at 70B (H200 x4, bench_memory_plan.py): RSS 472.2 GB against 470.7 planned without this row
        rows.append(Row("host", "bookkeeping that grows with the store (allocator, registration)",
                        STORE_SLACK * (4.0 + moment_bytes) * shapes.params * store_share,
                        f"{STORE_SLACK:.1%} of master + state"))
    rows.append(Row("host", "runtime (Python, JAX" + (", CUDA context)" if on_gpu else ")"),
                    RUNTIME_HOST_BYTES["gpu" if on_gpu else "cpu"] * (n_dev if on_gpu else 1)))
    if on_gpu and process_count() > 1:
        rows.append(Row("host", "multi-process runtime (coordination client, collectives' host buffers)",
                        MULTI_PROCESS_HOST_BYTES, f"one of {process_count()} processes"))
    return rows


def xla_pool(machine: Machine, gpu_budget: float | None, gpu_need: float,
             n_dev: int) -> tuple[Row | None, float | None, bool | None]:
    """XLA's memory fraction, whether its pool is made whole at the start, and the host row of its
    allocator table (None on the CPU backend)."""
    if machine.backend != "gpu" or not machine.gpu_bytes:
        return None, None, None
    fraction = min(XLA_FRACTION, (gpu_budget or machine.gpu_bytes) / machine.gpu_bytes)
    budgeted = bool(gpu_budget and gpu_budget < XLA_FRACTION * machine.gpu_bytes * 0.999)
    preallocate = choose.preallocate_pool(gpu_budget, gpu_need, budgeted)
    pool = fraction * machine.gpu_bytes
    managed = pool if preallocate else min(pool, grown_pool(gpu_need))
    row = Row("host", "XLA's GPU allocator table (8 bytes per 256 of its pool)",
              managed * BFC_TABLE_BYTES_PER_POOL_BYTE * n_dev,
              "pool made at the start" if preallocate else "pool grown on demand")
    return row, round(fraction, 4), preallocate


def disk_rows(cfg: Config, params: int, mom: float) -> tuple[list[Row], float]:
    """The checkpoints and the export on disk, and their sum."""
    t = cfg.train
    rows = []
    ckpt_bytes = params * (4 + mom)
    keep = max(t.keep_last, 1) + 1  # the one being written while keep_last are kept
    n_ckpt = 0
    if t.ckpt_every:
        n_ckpt = min(keep, max(1, t.steps // t.ckpt_every) + (1 if t.final_checkpoint else 0))
        if t.keep_every:
            n_ckpt += t.steps // max(t.keep_every, 1)
    elif t.final_checkpoint:
        n_ckpt = 1
    if n_ckpt:
        shared = f"; every process's shards together ({process_count()} processes: the filesystem they share)" \
            if HOST_STATES[t.host_state].sharded and process_count() > 1 else ""
        rows.append(Row("disk", f"checkpoints ({n_ckpt} x {ckpt_bytes / GB:.1f} GB)", n_ckpt * ckpt_bytes,
                        f"in {t.out_dir}{shared}"))
    if t.export:
        rows.append(Row("disk", "Hugging Face export", params * (2 if t.export_dtype != "float32" else 4),
                        f"in {t.export}"))
    return rows, sum(r.bytes for r in rows)
