"""The placement vocabulary: where held gradients, boundary activations and the update go, each name defined once.

The config (``train.grad_hold``, ``train.activations``, ``train.update_on``, ...), the plan (its search's axes, its
rows and phases) and the engine (which hold, which update) read these names from here. Each value is one small
frozen object carrying what its users ask of it (a gradient hold: the bytes it takes per parameter on the GPU and in
host memory and the pool it lives in); the plan asks those questions of the objects, never compares names. The name
is what the config and ``EngineOptions`` hold and serialise.

A leaf module (it imports nothing of the package), so that ``config``, ``plan`` and ``engine`` can all import it
without a cycle: it is not under ``plan/``, whose ``__init__`` imports the config.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

AUTO = "auto"  # a setting the plan decides


@dataclass(frozen=True)
class GradHold:
    """Where deferred gradients wait for the clipping norm (``train.grad_hold``). The engine's part of each
    (what puts a gradient there) is ``engine.holds.HOLD_PARTS``, keyed by these objects."""

    name: str
    gpu_bytes: int | None  # bytes per parameter held on the GPU (None: none there)
    host_bytes: int | None  # bytes per parameter held in host memory (None: none there)
    pinned: bool = False  # in XLA's pinned host pool, beside the parked activations (else pageable host memory)
    bf16: bool = False  # held in bf16 (cast on the GPU; widened again for the update)
    cpu_backend: bool = False  # tried by the plan on the CPU backend unasked (the others rest on GPU mechanisms:
    #                            the pinned slabs, a bf16 pinned pool, a second sweep)

    @property
    def on_host(self) -> bool:
        """A host hold: the gradients wait in host memory (pinned or pageable)."""
        return self.host_bytes is not None

    @property
    def on_gpu(self) -> bool:
        """A GPU hold: every gradient waits on the GPU."""
        return self.gpu_bytes is not None

    @property
    def pageable(self) -> bool:
        """A host hold in ordinary host memory, fed to the updater through the pinned slabs."""
        return self.on_host and not self.pinned

    @property
    def is_resweep(self) -> bool:
        """No hold: a second backward sweep once the norm is known."""
        return not self.on_host and not self.on_gpu

    @property
    def splits(self) -> bool:
        """Whether its first groups may wait on the GPU in bf16 instead (``grad_hold_gpu_groups``): a host hold's,
        or a resweep's (its second sweep then stops above them)."""
        return self.on_host or self.is_resweep

    @property
    def dtype(self) -> str:
        """The held values' dtype, as a row names it."""
        return "bf16" if self.bf16 else "fp32"


GPU_FP32 = GradHold("gpu_fp32", gpu_bytes=4, host_bytes=None, cpu_backend=True)
GPU_BF16 = GradHold("gpu_bf16", gpu_bytes=2, host_bytes=None, bf16=True, cpu_backend=True)
PINNED_HOST = GradHold("pinned_host", gpu_bytes=None, host_bytes=4, pinned=True, cpu_backend=True)
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
PAGEABLE_HOLDS = tuple(h.name for h in GRAD_HOLD_LIST if h.pageable)  # host_fp32, host_bf16
BF16_HOLDS = tuple(h.name for h in GRAD_HOLD_LIST if h.bf16)  # gpu_bf16, pinned_bf16, host_bf16


@dataclass(frozen=True)
class ActivationPlace:
    """Where boundary activations wait for the backward (``train.activations``)."""

    name: str
    on_gpu: bool  # every kept input waits on the GPU (else parked in pinned host memory, a split's last on the GPU)

    @property
    def parked(self) -> bool:
        """Parked in pinned host memory (a split placement keeps the last blocks' inputs on the GPU)."""
        return not self.on_gpu


DEVICE_ACTIVATIONS = ActivationPlace("device", on_gpu=True)
PINNED_ACTIVATIONS = ActivationPlace("pinned_host", on_gpu=False)
ACTIVATION_PLACES = {p.name: p for p in (DEVICE_ACTIVATIONS, PINNED_ACTIVATIONS)}  # name -> place, the search's order
ACT_DEVICE, ACT_PINNED_HOST = DEVICE_ACTIVATIONS.name, PINNED_ACTIVATIONS.name
ACTIVATIONS = tuple(ACTIVATION_PLACES)  # train.activations's values (besides auto)


@dataclass(frozen=True)
class UpdatePlace:
    """Where each group's optimizer step runs (``train.update_on``)."""

    name: str
    on_device: bool  # on the GPU (its state crosses PCIe instead of the gradient), else on the host


HOST_UPDATE = UpdatePlace("host", on_device=False)
DEVICE_UPDATE = UpdatePlace("device", on_device=True)
UPDATE_PLACES = {p.name: p for p in (HOST_UPDATE, DEVICE_UPDATE)}
UPDATE_HOST, UPDATE_DEVICE = HOST_UPDATE.name, DEVICE_UPDATE.name
UPDATE_ON = tuple(UPDATE_PLACES)


@dataclass(frozen=True)
class StreamCopy:
    """What streams to the GPU with bf16 compute (``train.stream_copy``)."""

    name: str
    on_host: bool  # a bf16 copy of the blocks kept on the host streams (else the fp32 master, cast on the GPU)


HOST_COPY = StreamCopy("host", on_host=True)
DEVICE_CAST = StreamCopy("device", on_host=False)
STREAM_COPIES = {c.name: c for c in (HOST_COPY, DEVICE_CAST)}
STREAM_COPY_HOST, STREAM_COPY_DEVICE = HOST_COPY.name, DEVICE_CAST.name
STREAM_COPY = tuple(STREAM_COPIES)


@dataclass(frozen=True)
class Fetch:
    """How each GPU of several gets a streamed block (``train.fetch``): the whole block over its own link, or its
    1/N share over its link and the rest from the others over NVLink (engine/shards.py; the choice is the user's
    until both are measured)."""

    name: str
    split: bool  # each link carries its share of each block


FULL_FETCH = Fetch("full", split=False)
SPLIT_FETCH = Fetch("split", split=True)
FETCHES = {f.name: f for f in (FULL_FETCH, SPLIT_FETCH)}
FETCH_FULL, FETCH_SPLIT = FULL_FETCH.name, SPLIT_FETCH.name
FETCH = tuple(FETCHES)


@dataclass(frozen=True)
class HostState:
    """Where the host state lives with several processes (``train.host_state``): a whole replica in each, or each
    process backing only its GPUs' shares of every group (hoststore.HostStore.own; its GPUs update and fetch only
    those)."""

    name: str
    sharded: bool


REPLICATED_STATE = HostState("replicated", sharded=False)
SHARDED_STATE = HostState("sharded", sharded=True)
HOST_STATES = {s.name: s for s in (REPLICATED_STATE, SHARDED_STATE)}
HOST_STATE_REPLICATED, HOST_STATE_SHARDED = REPLICATED_STATE.name, SHARDED_STATE.name
HOST_STATE = tuple(HOST_STATES)

P = TypeVar("P")


def asked(places: dict[str, P], setting: str) -> P | None:
    """The placement a setting names (``places``: one of the name tables above), None where it is ``auto``."""
    return None if setting == AUTO else places[setting]
