"""The machine a plan is made for: this one (``detect_machine``) or one described (``target_machine``).

This machine is read without starting a JAX backend (XLA's allocator settings must be chosen
first): host limits from the cgroup or /proc/meminfo, GPUs from nvidia-smi (those ``CUDA_VISIBLE_DEVICES`` leaves visible).
"""
from __future__ import annotations

import math
import os
import shutil
import subprocess
from dataclasses import dataclass, field

from megatrain_jax.errors import UserError
from megatrain_jax.plan.sizes import GB


@dataclass
class Machine:
    """What the run may use. ``host_bytes`` is the limit that decides (cgroup ``memory.max`` or
    MemTotal), ``host_available`` what is free now (MemAvailable, within the cgroup)."""

    backend: str  # gpu | cpu
    host_bytes: float
    host_available: float
    host_source: str
    gpu_bytes: float | None  # per device; None on the CPU backend
    gpu_source: str
    gpu_count: int
    gpu_name: str = ""
    cpu_cores: int = 1
    disk_free: dict = field(default_factory=dict)  # path -> free bytes
    pcie_bytes_s: float | None = None  # host<->GPU bytes/s each way (None: the H100 machine's measured rate)
    gpu_flops: float | None = None  # bf16 matmul FLOP/s (None: the H100's measured rate)
    target: bool = False  # described (target_machine), not this machine: no JAX devices read
    cpu_source: str = "this machine"  # where cpu_cores comes from: this machine, --cpu-cores, or assumed


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _meminfo() -> dict[str, int]:
    out = {}
    for line in (_read("/proc/meminfo") or "").splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if parts:
            out[key] = int(parts[0]) * 1024
    return out


def host_limit() -> tuple[float, float, str]:
    """(limit, available now, where the limit came from): the cgroup's ``memory.max`` where set
    (v2, else v1), else MemTotal. Available = min(MemAvailable, limit - cgroup usage)."""
    info = _meminfo()
    total = float(info.get("MemTotal", 0))
    avail = float(info.get("MemAvailable", info.get("MemTotal", 0)))
    limit, source = total, "MemTotal"
    for max_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                  "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        raw = _read(max_file)
        if raw and raw != "max" and raw.isdigit() and int(raw) < total:
            limit, source = float(raw), f"cgroup {max_file}"
            used = _read(usage_file)
            if used and used.isdigit():
                avail = min(avail, limit - int(used))
            break
    return limit, min(avail, limit), source


def _gpu_from_nvidia_smi() -> tuple[list[float], str]:
    """Per-GPU total memory of the GPUs this process can see, without initialising a JAX backend:
    nvidia-smi lists every GPU of the host, so ``CUDA_VISIBLE_DEVICES`` (``visible_gpus``) picks among them."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,memory.total,name",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return [], ""
    if out.returncode:
        return [], ""
    gpus = []
    for line in out.stdout.strip().splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) < 4:
            continue
        try:
            gpus.append((parts[0], parts[1], float(parts[2]) * (1 << 20), ",".join(parts[3:])))
        except ValueError:
            pass
    gpus = visible_gpus(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    return [g[2] for g in gpus], (gpus[0][3] if gpus else "")


def visible_gpus(gpus: list[tuple], spec: str | None) -> list[tuple]:
    """The GPUs (index, uuid, ...) that ``CUDA_VISIBLE_DEVICES`` leaves visible, in its order, as CUDA reads it:
    unset, all; empty, none; a comma list of indices or UUIDs (a unique prefix such as ``GPU-5f3a``), read up
    to the first entry that names no GPU (CUDA ignores the rest)."""
    if spec is None:
        return list(gpus)
    out = []
    for item in (x.strip() for x in spec.split(",")):
        match = [g for g in gpus if item and (g[0] == item or (item.startswith(("GPU-", "MIG-")) and
                                                              str(g[1]).startswith(item)))]
        if len(match) != 1 or match[0] in out:
            break
        out.append(match[0])
    return out


def jax_backend_ready() -> bool:
    """Whether a JAX backend has started (read without starting one)."""
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge._backends)  # noqa: SLF001 - only to avoid initialising it early
    except Exception:  # noqa: BLE001
        return False



def detect_machine(paths: tuple[str, ...] = ()) -> Machine:
    """This machine's limits. GPUs are counted with nvidia-smi unless JAX is already initialised
    (then its devices say it); ``MEGATRAIN_GPU_MEMORY_GB`` simulates a GPU's capacity (tests)."""
    limit, avail, source = host_limit()
    sizes, name, gpu_source = [], "", ""
    if jax_backend_ready():
        import jax

        devices = [d for d in jax.local_devices() if d.platform == "gpu"]
        for d in devices:
            lim = (d.memory_stats() or {}).get("bytes_limit")
            if lim:
                sizes.append(float(lim) / 0.95 if os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION") else float(lim))
        name, gpu_source = (devices[0].device_kind if devices else ""), "jax"
    elif os.environ.get("JAX_PLATFORMS", "") != "cpu":
        sizes, name = _gpu_from_nvidia_smi()
        gpu_source = "nvidia-smi"
    simulated = os.environ.get("MEGATRAIN_GPU_MEMORY_GB")
    if simulated:
        sizes, name, gpu_source = [float(simulated) * GB], "simulated", "MEGATRAIN_GPU_MEMORY_GB"
    return Machine(backend="gpu" if sizes else "cpu", host_bytes=limit, host_available=avail, host_source=source,
                   gpu_bytes=min(sizes) if sizes else None, gpu_source=gpu_source, gpu_count=len(sizes),
                   gpu_name=name, cpu_cores=os.cpu_count() or 1, disk_free=disk_free(paths))


def disk_free(paths: tuple[str, ...]) -> dict[str, float]:
    """Free bytes where each path is (or would be made)."""
    out = {}
    for p in paths:
        probe = os.path.abspath(p)
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        out[p] = float(shutil.disk_usage(probe).free)
    return out


TARGET_CPU_CORES = 16  # a described machine's host cores when --cpu-cores is not given (a one-GPU server's share)


def target_machine(*, gpu_memory_gb: float | None = None, host_memory_gb: float | None = None,
                   pcie_gbps: float | None = None, gpu_tflops: float | None = None, gpu_count: int = 1,
                   cpu_cores: int | None = None, paths: tuple[str, ...] = ()) -> Machine:
    """A machine described rather than detected, to plan for from any machine (the CPU included):
    ``megatrain-jax plan CONFIG --gpu-memory-gb 24 --host-memory-gb 64 [--pcie-gbps 25 --gpu-tflops 165]``.
    What is not given is this machine's (host memory, cores) or the H100's rates (PCIe, TFLOPS);
    no GPU memory given plans for this machine's GPUs, or for none."""
    for name, value in (("--gpu-memory-gb", gpu_memory_gb), ("--host-memory-gb", host_memory_gb),
                        ("--pcie-gbps", pcie_gbps), ("--gpu-tflops", gpu_tflops)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise UserError(name, f"must be a positive finite number, got {value}", f"give {name} N with N > 0")
    if gpu_count < 1:
        raise UserError("--devices", f"must be >= 1, got {gpu_count}", "give the number of GPUs of the target")
    if cpu_cores is not None and cpu_cores < 1:
        raise UserError("--cpu-cores", f"must be >= 1, got {cpu_cores}", "give the target host's number of CPU cores")
    here = None
    if gpu_memory_gb is None or host_memory_gb is None:
        here = detect_machine(paths)
    if gpu_memory_gb is None and (here.backend == "cpu") and (pcie_gbps or gpu_tflops):
        raise UserError("--gpu-memory-gb", "a GPU's speed was given without its memory",
                        "give --gpu-memory-gb N for the target GPU")
    if host_memory_gb is not None:
        host, avail, source = host_memory_gb * GB, host_memory_gb * GB, "--host-memory-gb"
    else:
        host, avail, source = here.host_bytes, here.host_available, here.host_source
    if gpu_memory_gb is not None:
        backend, gpu, count, gsrc, gname = "gpu", gpu_memory_gb * GB, gpu_count, "--gpu-memory-gb", \
            f"target GPU ({gpu_memory_gb:g} GB)"
    else:
        backend, gpu, count, gsrc, gname = here.backend, here.gpu_bytes, here.gpu_count, here.gpu_source, here.gpu_name
    if cpu_cores is not None:
        cores, csrc = cpu_cores, "--cpu-cores"
    elif gpu_memory_gb is not None:  # another machine: never this one's cores
        cores, csrc = TARGET_CPU_CORES, "assumed; --cpu-cores N gives the target's"
    else:  # this machine's GPU: its host too
        cores, csrc = (here.cpu_cores if here else os.cpu_count() or 1), "this machine"
    return Machine(backend=backend, host_bytes=host, host_available=avail, host_source=source, gpu_bytes=gpu,
                   gpu_source=gsrc, gpu_count=count, gpu_name=gname, cpu_source=csrc,
                   cpu_cores=cores,
                   disk_free=here.disk_free if here else disk_free(paths),
                   pcie_bytes_s=pcie_gbps * GB if pcie_gbps else None,
                   gpu_flops=gpu_tflops * 1e12 if gpu_tflops else None, target=True)


def process_count() -> int:
    """Processes of a multi-host run (distributed.py's MEGATRAIN_NUM_PROCESSES), read without
    starting a JAX backend."""
    try:
        return max(int(os.environ.get("MEGATRAIN_NUM_PROCESSES", "1")), 1)
    except ValueError:
        return 1


def memory_snapshot(device=None) -> dict[str, float]:
    """What the process uses now: host RSS and its peak (VmHWM), and the device's peak bytes in
    use (XLA's allocator statistics; absent on the CPU backend). GB."""
    out = {}
    for line in (_read("/proc/self/status") or "").splitlines():
        if line.startswith("VmRSS:"):
            out["host_rss_gb"] = int(line.split()[1]) * 1024 / GB
        elif line.startswith("VmHWM:"):
            out["host_peak_rss_gb"] = int(line.split()[1]) * 1024 / GB
    if device is not None:
        stats = device.memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            out["gpu_peak_gb"] = stats["peak_bytes_in_use"] / GB
            out["gpu_in_use_gb"] = stats.get("bytes_in_use", 0) / GB
    return out
