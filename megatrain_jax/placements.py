"""The placement vocabulary: where held gradients, boundary activations and the update go, each name defined once.

The config (``train.grad_hold``, ``train.activations``, ``train.update_on``), the plan (its search's axes, its rows
and phases) and the engine (which hold, which update) read these names from here. A gradient hold is one small
frozen object with the bytes it takes per parameter on the GPU and in host memory and the pool it lives in.

A leaf module (it imports nothing of the package), so that ``config``, ``plan`` and ``engine`` can all import it
without a cycle: it is not under ``plan/``, whose ``__init__`` imports the config.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GradHold:
    """Where deferred gradients wait for the clipping norm (``train.grad_hold``). The engine's part of each
    (what puts a gradient there) is ``engine.holds.HOLD_PARTS``, keyed by these objects."""

    name: str
    gpu_bytes: int | None  # bytes per parameter held on the GPU (None: none there)
    host_bytes: int | None  # bytes per parameter held in host memory (None: none there)
    pinned: bool = False  # in XLA's pinned host pool, beside the parked activations (else pageable host memory)
    bf16: bool = False  # held in bf16 (cast on the GPU; widened again for the update)

    @property
    def on_host(self) -> bool:
        """A host hold: the gradients wait in host memory (pinned or pageable)."""
        return self.host_bytes is not None


GPU_FP32 = GradHold("gpu_fp32", gpu_bytes=4, host_bytes=None)
GPU_BF16 = GradHold("gpu_bf16", gpu_bytes=2, host_bytes=None, bf16=True)
PINNED_HOST = GradHold("pinned_host", gpu_bytes=None, host_bytes=4, pinned=True)
PINNED_BF16 = GradHold("pinned_bf16", gpu_bytes=None, host_bytes=2, pinned=True, bf16=True)
HOST_FP32 = GradHold("host_fp32", gpu_bytes=None, host_bytes=4)  # ordinary (pageable) host memory, fed to the
HOST_BF16 = GradHold("host_bf16", gpu_bytes=None, host_bytes=2, bf16=True)  # updater through the pinned slabs
RESWEEP = GradHold("resweep", gpu_bytes=None, host_bytes=None)  # no hold: a second backward sweep once the norm
#                                                                 is known

GRAD_HOLD_LIST = (GPU_FP32, GPU_BF16, PINNED_HOST, PINNED_BF16, HOST_FP32, HOST_BF16, RESWEEP)  # the search's order
GRAD_HOLD = {h.name: h for h in GRAD_HOLD_LIST}  # name -> hold
GRAD_HOLDS = tuple(h.name for h in GRAD_HOLD_LIST)  # train.grad_hold's values (besides auto)
HOST_HOLDS = tuple(h.name for h in GRAD_HOLD_LIST if h.on_host)  # pinned_host, pinned_bf16, host_fp32, host_bf16
PINNED_HOLDS = tuple(h.name for h in GRAD_HOLD_LIST if h.pinned)  # pinned_host, pinned_bf16
PAGEABLE_HOLDS = tuple(h.name for h in GRAD_HOLD_LIST if h.on_host and not h.pinned)  # host_fp32, host_bf16
BF16_HOLDS = tuple(h.name for h in GRAD_HOLD_LIST if h.bf16)  # gpu_bf16, pinned_bf16, host_bf16

# where boundary activations wait for the backward (train.activations)
ACT_DEVICE, ACT_PINNED_HOST = "device", "pinned_host"
ACTIVATIONS = (ACT_DEVICE, ACT_PINNED_HOST)

# where each group's optimizer step runs (train.update_on)
UPDATE_HOST, UPDATE_DEVICE = "host", "device"
UPDATE_ON = (UPDATE_HOST, UPDATE_DEVICE)

# what streams to the GPU with bf16 compute (train.stream_copy): a bf16 copy kept on the host, or the fp32 master
STREAM_COPY_HOST, STREAM_COPY_DEVICE = "host", "device"
STREAM_COPY = (STREAM_COPY_HOST, STREAM_COPY_DEVICE)
# how each GPU of several gets a streamed block: the whole block over its own link, or its 1/N share over its link
# and the rest from the others over NVLink (engine/shards.py; the choice is the user's until both are measured)
FETCH_FULL, FETCH_SPLIT = "full", "split"
FETCH = (FETCH_FULL, FETCH_SPLIT)
# where the host state lives with several processes (train.host_state): a whole replica in each, or each process
# backing only its GPUs' shares of every group (hoststore.HostStore.own; its GPUs update and fetch only those)
HOST_STATE_REPLICATED, HOST_STATE_SHARDED = "replicated", "sharded"
HOST_STATE = (HOST_STATE_REPLICATED, HOST_STATE_SHARDED)
