"""The engine's buffer sizes and in-flight bounds: the engine keeps to them and the memory plan counts them.

Both sides read each figure from here, so the plan's GPU phases and host rows cannot drift from what the engine
lets wait at once. A leaf module (it imports nothing of the package), beside ``placements``, so that ``engine``
and ``plan`` import it without a cycle.
"""
from __future__ import annotations

GRAD_SLAB_ELEMS = 32 << 20  # a pinned gradient slab: 32M fp32 values (128 MiB)
DEFAULT_GRAD_SLABS = 8  # pinned gradient slabs of an engine built without a plan (the plan chooses its own count
#                         between sizes.GRAD_SLABS_FEWEST and GRAD_SLABS_MOST)
DEVICE_UPDATE_CHUNK = 8192 * 2048  # values per slice of a device-side update (bounded temporaries)
# What the engine lets wait on the GPU at once, and the plan counts (sizes.gpu_phases). Unbounded, the dispatching
# thread ran ahead of the GPU and the host copies fell behind it: the H100 held 23 block gradients waiting for a
# pageable hold and 28 updated blocks waiting for their write-back, 3.4x and 2.3x the plan
# (experiments/probe_gpu_peak.py)
BLOCKS_QUEUED = 2  # blocks dispatched and not yet computed (one computing, the next queued behind it)
WRITEBACKS_IN_FLIGHT = 3  # device-side updates whose new master and state wait for their copy to the host
HOLD_COPIES_IN_FLIGHT = 1  # gradients on the GPU waiting for their copy into a pageable host hold
PINNED_ACT_LAYERS_ON_GPU = 3  # layers of parked activations on the GPU at once while their copies run (the engine
#                               waits for the oldest beyond it: weights.Boundaries)
IO_VOCAB_CHUNK = 16384  # vocabulary rows of the head on the GPU at once with train.stream_io (the engine's chunk)
IO_HEAD_GRADS_IN_FLIGHT = 2  # stream_io: the head chunks' gradients on their way to the host at once (XLA's pinned
#                             pool; engine/io_head.py waits for the oldest before the next): unbounded, all ten of
#                             the 110B's 0.54 GB chunks were, and the pool ran out in step 1 (bench_memory_plan.py)
