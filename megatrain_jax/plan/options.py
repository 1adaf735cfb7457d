"""``EngineOptions``: every decision the memory plan makes for the engine, as one frozen object.

The plan (``megatrain_jax.plan``) builds it; ``Trainer`` and the engine take it and nothing else:
no string keys, no ``.get`` fallbacks, no constant or heuristic of the engine's own that the plan
decides. Every rule about combinations of options is checked here, once (``__post_init__``), so a
bad combination fails at construction with a one-line ``UserError`` naming the field.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from megatrain_jax.bounds import BLOCKS_QUEUED, DEFAULT_GRAD_SLABS, DEVICE_UPDATE_CHUNK, GRAD_SLAB_ELEMS
from megatrain_jax.errors import UserError
from megatrain_jax.placements import (ACT_DEVICE, ACTIVATION_PLACES, ACTIVATIONS, FETCH, FETCH_FULL, FETCHES, GPU_FP32,
                                      GRAD_HOLD, GRAD_HOLDS, HOST_STATE, HOST_STATE_REPLICATED, HOST_STATES,
                                      STREAM_COPIES, STREAM_COPY, STREAM_COPY_HOST, UPDATE_HOST, UPDATE_ON,
                                      UPDATE_PLACES, ActivationPlace, Fetch, GradHold, HostState, StreamCopy,
                                      UpdatePlace)


@dataclass(frozen=True)
class EngineOptions:
    """How the streamed step runs. Defaults are the plain one-device, host-update path (what a
    ``Trainer`` built from Python without a plan runs)."""

    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    micro_batches: int = 1  # micro-batches per step (layer-major: each block sees all of them)
    loss_chunk: int = 1024  # tokens per chunk of the fused head + cross-entropy
    clip_norm: float | None = None  # global-norm clipping (None: off)
    skip_nonfinite: bool = False  # a step with a non-finite loss or norm changes nothing
    activations: str = ACT_DEVICE  # where boundary activations wait for the backward (placements.ACTIVATIONS)
    grad_hold: str = GPU_FP32.name  # where deferred gradients wait for the clipping norm (placements.GRAD_HOLDS:
    #                                 gpu_* on the GPU; pinned_*: pinned host arrays; host_*: ordinary (pageable) host
    #                                 memory, fed to the updater through the pinned slabs; resweep: no hold, a second
    #                                 backward sweep once the norm is known). The engine reads the placement object
    #                                 (``grad_hold_placement``), the name is what serialises
    grad_slabs: int = DEFAULT_GRAD_SLABS  # pinned gradient slabs feeding the host optimizer
    grad_slab_elems: int | None = GRAD_SLAB_ELEMS  # values per slab (None: whole groups)
    stream_copy: str = STREAM_COPY_HOST  # the bf16 streaming copy lives on the host, or the GPU casts fp32
    #                            (placements.STREAM_COPY)
    update_on: str = UPDATE_HOST  # where each group's optimizer step runs (placements.UPDATE_ON)
    fetch: str = FETCH_FULL  # several GPUs: each fetches whole blocks, or its share of each (placements.FETCH)
    host_state: str = HOST_STATE_REPLICATED  # each process's host store: whole, or its GPUs' shares (HOST_STATE)
    keep_residuals: int = 0  # the last N blocks keep their VJP residuals (no recompute)
    early_state_groups: int = 0  # update_on=device: the first N groups of the forward have their master and state
    #                              fetched during the backward, so that their traffic leaves the forward
    devices: int | Literal["all"] = 1  # data parallel: devices per process (distributed.run_devices)
    device_update_chunk: int = DEVICE_UPDATE_CHUNK
    rng_seed: int = 0  # dropout keys (templates.block_rng)
    transfer_mode: str = "auto"  # transfer.Transfers: dma-mapped numpy or pinned_host arrays
    grad_hold_gpu_groups: int = 0  # with a host hold (host_*, pinned_host): this many groups, those the next
    #                                forward needs first (embedding, block 0, 1, ...), wait on the GPU in bf16
    #                                instead: a hold split between the GPU's free room and the host
    stream_io: bool = False  # the embedding gathers only the rows a batch uses and the head streams through the
    #                          loss in vocabulary chunks: neither is resident on the GPU for the step
    vocab_chunk: int = 8192  # with stream_io: vocabulary entries per chunk of the streamed head (H x chunk fp32
    #                          per chunk in flight)
    activations_gpu_blocks: int = 0  # with activations=pinned_host: the last this-many blocks keep their inputs on
    #                                  the GPU (its free room), the others park theirs in pinned host memory
    boundary_every: int = 1  # keep every k-th block's input; the backward recomputes the blocks between from
    #                          the nearest kept one (1: keep every input)
    blocks_queued: int = BLOCKS_QUEUED  # blocks dispatched ahead of the device (weights.Pace): 1 on the smallest
    #                                     budgets, where a block's weights and accumulator less decide the fit
    seq_tile: int = 0  # tokens per sequence tile of each block (model.seq_tile resolved; 0: untiled). The model
    #                    is built with it (the blocks read it from their ModelConfig), not the engine

    def __post_init__(self) -> None:
        def bad(field: str, problem: str, fix: str) -> None:
            raise UserError(field, problem, fix)

        if self.compute_dtype not in ("float32", "bfloat16"):
            bad("train.compute_dtype", f"{self.compute_dtype!r}", "use float32 or bfloat16")
        if int(self.micro_batches) < 1:
            bad("train.micro_batches", f"must be >= 1, got {self.micro_batches}", "set a positive integer")
        if int(self.loss_chunk) < 1:
            bad("train.loss_chunk", f"must be >= 1, got {self.loss_chunk}", "set a positive integer")
        if self.activations not in ACTIVATIONS:
            bad("train.activations", f"{self.activations!r}", "use " + " or ".join(ACTIVATIONS))
        if self.grad_hold not in GRAD_HOLDS:
            bad("train.grad_hold", f"{self.grad_hold!r}", f"use one of {', '.join(GRAD_HOLDS)}")
        if int(self.grad_hold_gpu_groups) < 0:
            bad("train.grad_hold_gpu_groups", f"must be >= 0, got {self.grad_hold_gpu_groups}", "set 0 or more")
        if int(self.activations_gpu_blocks) < 0:
            bad("activations_gpu_blocks", f"must be >= 0, got {self.activations_gpu_blocks}", "set 0 or more")
        if int(self.vocab_chunk) < 1:
            bad("train.vocab_chunk", f"must be >= 1, got {self.vocab_chunk}", "set a positive integer")
        if int(self.blocks_queued) < 1:
            bad("blocks_queued", f"must be >= 1, got {self.blocks_queued}", "set 1 or 2")
        if int(self.boundary_every) < 1:
            bad("train.boundary_every", f"must be >= 1, got {self.boundary_every}", "set 1 (keep every input) or more")
        if self.stream_copy not in STREAM_COPY:
            bad("train.stream_copy", f"{self.stream_copy!r}", "use " + " or ".join(STREAM_COPY))
        if self.fetch not in FETCH:
            bad("train.fetch", f"{self.fetch!r}", "use " + " or ".join(FETCH))
        if self.host_state not in HOST_STATE:
            bad("train.host_state", f"{self.host_state!r}", "use " + " or ".join(HOST_STATE))
        if self.update_on not in UPDATE_ON:
            bad("train.update_on", f"{self.update_on!r}", "use " + " or ".join(UPDATE_ON))
        if self.host_state_place.sharded and (not self.update_place.on_device or not self.fetch_place.split
                                              or self.stream_io):
            bad("train.host_state", "sharded needs each GPU to update and fetch its own shares (update_on=device, "
                f"fetch=split, no stream_io), got update_on={self.update_on}, fetch={self.fetch}, "
                f"stream_io={self.stream_io}", "set train.host_state=replicated, or leave those auto")
        if int(self.grad_slabs) < 1:
            bad("train.grad_slabs", f"must be >= 1, got {self.grad_slabs}", "set a positive integer")
        if isinstance(self.seq_tile, bool) or not isinstance(self.seq_tile, int) or self.seq_tile < 0:
            bad("model.seq_tile", f"must be an integer >= 0, got {self.seq_tile!r}",
                "set 0 (untiled) or tokens per tile")
        if int(self.early_state_groups) < 0:
            bad("train.early_state_groups", f"must be >= 0, got {self.early_state_groups}", "set 0 or more")
        if int(self.early_state_groups) and not self.update_place.on_device:
            bad("train.early_state_groups", f"fetches a device-side update's state, and update_on={self.update_on}",
                "set train.early_state_groups=0 (or auto), or train.update_on=device")
        if int(self.keep_residuals) < 0:
            bad("train.keep_residuals", f"must be >= 0, got {self.keep_residuals}", "set 0 or more")
        if self.update_place.on_device and self.stream_copy_place.on_host \
                and self.compute_dtype == "bfloat16":
            bad("train.update_on", "device needs a store without a bf16 streaming copy",
                "set train.stream_copy=device (or train.update_on=host)")

    @property
    def host_bf16_copy(self) -> bool:
        """Whether the host store keeps a bf16 streaming copy of the blocks."""
        return self.compute_dtype == "bfloat16" and self.stream_copy_place.on_host

    @property
    def grad_hold_placement(self) -> GradHold:
        """The gradient hold ``grad_hold`` names: the object the engine builds its hold from."""
        return GRAD_HOLD[self.grad_hold]

    # the other placements as objects (the fields hold their names, which serialise)
    @property
    def activation_place(self) -> ActivationPlace:
        return ACTIVATION_PLACES[self.activations]

    @property
    def update_place(self) -> UpdatePlace:
        return UPDATE_PLACES[self.update_on]

    @property
    def stream_copy_place(self) -> StreamCopy:
        return STREAM_COPIES[self.stream_copy]

    @property
    def fetch_place(self) -> Fetch:
        return FETCHES[self.fetch]

    @property
    def host_state_place(self) -> HostState:
        return HOST_STATES[self.host_state]

    @property
    def device_count(self) -> int | None:
        """Devices per process as a number, None for ``all`` (the run's devices decide)."""
        return None if self.devices == "all" else int(self.devices)

    def with_(self, **changes: Any) -> "EngineOptions":
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
