"""What the configured optimizer costs in memory, for the plan: host bytes of state per parameter, and
the device-side update's working set (``train.update_on=device``), from the optimizer itself.

- Host state: ``jax.eval_shape`` of the transformation's ``init`` on each group (nothing allocated;
  ``named.model_state_bytes``), or the fused kernels' own formats.
- Device working set: XLA's buffer assignment of the compiled device step of the group whose step
  needs the most (``memory_analysis()`` of the step lowered for the CPU backend from abstract shapes:
  no GPU is touched and nothing is allocated; the GPU's assignment may differ a little, so the plan
  keeps its margin). The fused AdamW updates a group in chunks: its temporaries are per chunk value.

Asking JAX for its CPU device starts every backend JAX has, the GPU's too, with XLA's default budgets:
the plan's (its GPU pool fraction, whether the pool is made at the start, the pinned-pool limit) are
environment variables read once, when the backends start, and the plan sets them after planning. So
where a GPU may be there and JAX has not started yet, the compile runs in a child process that sees
the CPU only (``JAX_PLATFORMS=cpu``). Measured (one H200, experiments/bench_memory_plan.py): planned in-process, a 110B-shape run got
XLA's default pool (0.75 of the GPU, 112.6 GB) under a plan of 124.9 of 143.2 GB, and the full 110B
run ran out of GPU memory there.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from megatrain_jax.config import OptimConfig


@dataclass(frozen=True)
class UpdateCost:
    """Bytes per parameter.

    - ``host_state``: optimizer state in host memory, whole model (the fp32 master's 4 not included);
      with ``update_on=device`` this state also crosses PCIe each way per step.
    - ``device_temp``: the update's temporaries on the device beyond its inputs and outputs, per
      parameter of the group updated (``chunked``: per value of one chunk of ``device_update_chunk``,
      else per parameter of the whole group: count it for the largest group).
    - ``device_group``: everything one group's update holds on the device at once, per parameter of
      that group: param, gradient, state in, new param and state (where not written in place), temporaries.
    - ``runs_on_device``: the optimizer can run with ``update_on=device``.
    - ``host_fast``: its host update is a parallel numba kernel (fused AdamW); otherwise the host update
      runs through XLA on the jax CPU device and is far slower than the device one (prefer the device).
    - ``device_flops`` / ``device_bytes``: the whole model's update per step on the device (every group's
      compiled step, XLA's cost analysis): time on the compute stream, which the step's compute waits
      for (Muon's Newton-Schulz matmuls, in ``matmul_dtype``; the elementwise updates' memory passes).
    """

    host_state: float
    device_temp: float
    device_group: float
    runs_on_device: bool
    chunked: bool
    host_fast: bool
    device_flops: float = 0.0
    device_bytes: float = 0.0
    matmul_dtype: str = "bfloat16"


def update_cost(optim_cfg: OptimConfig, group_trees: dict[str, Any], total_steps: int | None = None) -> UpdateCost:
    """The configured optimizer's ``UpdateCost`` for a model's groups (``streamed_parts(abstract_model(
    cfg.model)).host_trees()``: pytrees of arrays or ``ShapeDtypeStruct``s)."""
    from megatrain_jax.optim.build import build_host_optimizer, model_state_bytes
    from megatrain_jax.optim.optax_flat import OptaxHostOptimizer

    steps = total_steps or optim_cfg.schedule.warmup_steps + 2  # any horizon: the shapes are the same
    opt = build_host_optimizer(optim_cfg, steps)
    n_total = sum(_size(t) for t in group_trees.values())
    if not isinstance(opt, OptaxHostOptimizer):  # the fused kernels (optim/device_adamw.py: up to 16 B a value)
        s = float(opt.bytes_per_param())
        return UpdateCost(host_state=s, device_temp=16.0, device_group=4 + 4 + s + 16.0, runs_on_device=True,
                          chunked=True, host_fast=True)
    host_state = model_state_bytes(optim_cfg, group_trees, steps) / max(n_total, 1)
    temp, group, flops, nbytes = 0.0, 0.0, 0.0, 0.0
    distinct = _distinct(group_trees)
    if compile_in_child():
        _measure_in_child(optim_cfg, steps, [tree for tree, _ in distinct])
    for tree, count in distinct:
        t, g, f, b = _compiled_bytes(opt, tree, repr(optim_cfg))
        temp, group, flops, nbytes = max(temp, t), max(group, g), flops + count * f, nbytes + count * b
    _trim()
    matmul = "float32" if optim_cfg.name == "muon" and optim_cfg.ns_dtype == "float32" else "bfloat16"
    return UpdateCost(host_state=host_state, device_temp=temp, device_group=group,
                      runs_on_device=bool(opt.runs_on_device), chunked=False, host_fast=False,
                      device_flops=flops, device_bytes=nbytes, matmul_dtype=matmul)


def device_update_s(cost: UpdateCost, matmul_flops_s: float, memory_bytes_s: float) -> float:
    """Seconds of the device-side update per step at these rates (the plan's ``compute_s`` adds them): the
    larger of its matmuls' and its memory passes' floors (the CPU compile's byte count, where bf16 matmuls
    are widened, overstates the GPU's memory traffic of matmuls; an elementwise update has no matmuls)."""
    return max(cost.device_flops / matmul_flops_s, cost.device_bytes / memory_bytes_s)


def _trim() -> None:
    """Give the heap that the compilations above freed back to the system (glibc keeps it otherwise: 0.1 GB
    of the training process's RSS that the plan does not count, measured on the CPU)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _size(tree) -> int:
    return sum(int(np.prod(x.shape, dtype=np.int64)) for x in jax.tree.leaves(tree))


def _distinct(group_trees: dict[str, Any]) -> list[tuple[Any, int]]:
    """One tree per distinct group structure, with how many groups have it."""
    seen: dict[Any, list] = {}
    for tree in group_trees.values():
        leaves, treedef = jax.tree.flatten(tree)
        seen.setdefault((treedef, tuple(tuple(x.shape) for x in leaves)), [tree, 0])[1] += 1
    return [(t, c) for t, c in seen.values()]


_CACHE: dict[Any, tuple[float, float, float, float]] = {}  # (optimizer config, group structure) -> costs
_LOCK = threading.Lock()


def compile_in_child() -> bool:
    """Whether the device step is compiled in a CPU-only child process: JAX has not started its backends
    yet and a GPU may be there (the module docstring says why). ``MEGATRAIN_COST_IN_CHILD=1`` / ``0`` forces it
    (tests)."""
    forced = os.environ.get("MEGATRAIN_COST_IN_CHILD")
    if forced is not None:
        return forced == "1"
    from jax._src import xla_bridge

    if xla_bridge._backends:  # noqa: SLF001 - started already: asking for the CPU device starts nothing
        return False
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return False
    return shutil.which("nvidia-smi") is not None or os.path.exists("/dev/nvidiactl")


def _layout_of(tree):
    from megatrain_jax.templates import Layout

    return Layout(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, np.float32), tree))


def _key(config_key: str, layout) -> tuple:
    return (config_key, layout.treedef, tuple(s.shape for s in layout.leaves))


def _measure_in_child(optim_cfg: OptimConfig, steps: int, trees: list) -> None:
    """``_measure`` of each tree not cached yet, in a child process on the CPU backend alone; the results
    fill the cache."""
    config_key = repr(optim_cfg)
    todo = [t for t in trees if _key(config_key, _layout_of(t)) not in _CACHE]
    if not todo:
        return
    shapes = [jax.tree.map(lambda x: tuple(int(d) for d in x.shape), t, is_leaf=_is_array_like) for t in todo]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "MEGATRAIN_COST_IN_CHILD": "0",
           "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, "-m", "megatrain_jax.optim.costs"], input=pickle.dumps(
        (optim_cfg, steps, shapes)), capture_output=True, env=env, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"the optimizer's cost (a CPU-only compile in a child process) failed: "
                           f"{out.stderr.decode(errors='replace')[-2000:]}")
    for tree, costs in zip(todo, json.loads(out.stdout.decode().strip().splitlines()[-1])):
        with _LOCK:
            _CACHE[_key(config_key, _layout_of(tree))] = tuple(costs)


def _is_array_like(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _child_main() -> None:
    """The child of ``_measure_in_child``: (optimizer config, steps, trees of shapes) on stdin, the costs of
    each tree as one JSON line on stdout."""
    from megatrain_jax.optim.build import build_host_optimizer

    optim_cfg, steps, shapes = pickle.loads(sys.stdin.buffer.read())
    opt = build_host_optimizer(optim_cfg, steps)
    leaf = lambda x: isinstance(x, tuple) and all(isinstance(d, int) for d in x)  # noqa: E731
    trees = [jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, np.float32), t, is_leaf=leaf) for t in shapes]
    print(json.dumps([_measure(opt, _layout_of(t)) for t in trees]), flush=True)


def _compiled_bytes(opt, tree, config_key: str) -> tuple[float, float, float, float]:
    """(temporaries, everything) per parameter of the device step of a group shaped like ``tree``, and the
    step's flops and bytes accessed (whole group)."""
    layout = _layout_of(tree)
    key = _key(config_key, layout)
    with _LOCK:
        hit = _CACHE.get(key)
    if hit is None:
        hit = _measure(opt, layout)
        with _LOCK:
            _CACHE[key] = hit
    return hit


def _measure(opt, layout) -> tuple[float, float, float, float]:
    n = layout.size
    spec = opt._spec(n, layout.unflatten)
    _, device = opt._step_fn(spec)
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    f32 = jax.ShapeDtypeStruct((n,), np.float32, sharding=cpu)
    state = {opt.key_prefix + dt: jax.ShapeDtypeStruct((k,), np.dtype(dt), sharding=cpu) for dt, k in spec.sizes}
    compiled = device.lower(f32, f32, state, jax.ShapeDtypeStruct((), np.float32, sharding=cpu)).compile()
    m = compiled.memory_analysis()
    temp = float(m.temp_size_in_bytes)
    everything = float(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes) + temp
    ca = compiled.cost_analysis()
    ca = (ca[0] if ca else {}) if isinstance(ca, (list, tuple)) else (ca or {})
    return temp / max(n, 1), everything / max(n, 1), float(ca.get("flops", 0.0)), float(ca.get("bytes accessed", 0.0))


def auto_update_on(cost: UpdateCost, *, on_gpu: bool, devices: int, moments: str, bf16_host_copy: bool) -> str:
    """``train.update_on=auto`` before the fit check: the device where the update can run there, on one
    GPU, with no host bf16 copy streaming, and where it pays: any optax transformation (its host update
    is XLA on the CPU device, far slower than the GPU's), the fused AdamW with compact moments
    (RESULTS.md: fp32 moments, 8 bytes/param more each way over PCIe, were not measured to pay). The
    plan then falls back to ``host`` where the device-side working set does not fit the GPU."""
    if not (on_gpu and devices == 1 and cost.runs_on_device) or bf16_host_copy:
        return "host"
    if not cost.host_fast:
        return "device"
    return "device" if moments in ("bfloat16", "int8") else "host"


if __name__ == "__main__":
    _child_main()
