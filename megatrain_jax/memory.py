"""The memory plan: every byte the run will need, where it lives, and whether it fits.

One module is the single source of truth for sizes. ``train`` asks it before allocating anything
and refuses (``UserError``: exit 2, one line) what cannot fit; ``megatrain-jax plan`` prints it.
The plan also *decides*: where boundary activations live (GPU or pinned host), where gradients
wait for the clipping norm (GPU fp32, GPU bf16, pinned host), how many micro-batches
``train.micro_batches: auto`` means, and the GPU memory budget XLA is given. Nothing is left to
XLA's defaults (75% preallocation) or to free memory read at run time.

Sizes follow from the model's shapes. Two terms are empirical and stated as such: the per-token
working set of one block's recompute + VJP, and the process's fixed runtime (Python, JAX, CUDA
context); both were calibrated against peaks measured on an H100 (experiments/RESULTS.md, "memory
plan vs measured"). A safety margin (``HOST_MARGIN``, ``GPU_MARGIN``) is part of every verdict.

Peak GPU memory is not the sum of its rows: the gradients held for clipping and the boundary
activations never coexist in full. At the end of the backward all gradients are held and only
layer 0's activation is left; during the next forward each block's gradient leaves as its
activation is made. The peak is therefore taken over the phases of a step (``_gpu_phases``).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from typing import Any

from megatrain_jax.config import Config, ModelConfig
from megatrain_jax.errors import UserError

GB = 1e9
GiB = 1 << 30

# ---- stated constants (see the module docstring)
HOST_MARGIN = (0.03, 1.0 * GiB)  # fraction of the limit + bytes kept free on the host
GPU_MARGIN = (0.05, 1.0 * GiB)  # fraction of the budget + bytes kept free on the GPU (XLA autotuning
#                                  workspaces: a Qwen2.5-14B plan at 97% of the budget ran out of memory there)
XLA_FRACTION = 0.95  # of the device's memory given to XLA's allocator (the rest: CUDA context, cuDNN workspaces)
MICRO_TOKENS = 16384  # tokens per micro-batch that keep the matmuls efficient (16 x 4096 in 4 micro-batches)
RUNTIME_HOST_BYTES = {"gpu": 1.45 * GiB, "cpu": 1.0 * GiB}  # Python + JAX + CUDA libraries and context:
#      a tiny model's whole process on the H100: 4.0 GB, of which 2.52 GB is the allocator's table below
BFC_TABLE_BYTES_PER_POOL_BYTE = 1.0 / 32  # XLA's BFC allocator keeps one 8-byte chunk handle per 256 bytes of
# the GPU memory it manages, in host memory, written when a region is made: preallocating 95% of an H100
# makes a 2.52 GB resident host mapping (experiments/probe_runtime_stages.py: 2.0 GB at a 75% pool, none
# without preallocation until memory is used)
PREALLOCATE_ABOVE = 0.75  # of the GPU budget: below it, XLA grows its pool on demand (regions doubling from
# 2 MiB), so the table covers only what is used (Qwen2.5-7B int8, H100: 49.6 -> 49.2 GB host, same
# tokens/s); above it the pool is made whole at the start, where one region cannot fragment
BFC_FIRST_REGION = 2 << 20
GRAD_SLAB_ELEMS = 32 << 20  # gradient slab: 32M fp32 values (128 MiB) per pinned buffer
GRAD_SLABS = (6, 24)  # pinned slabs in the pool (fewest, most): transfers of later slabs overlap updates of
# earlier ones, and the dispatching thread hands out free slabs only between compute dispatches, so a deeper
# pool keeps the host optimizer fed: measured on the H100 (RESULTS.md), 6 -> 24 slabs took Llama-2-7B at
# 16 x 4096 from 388 to 397 model-TFLOPS and Qwen2.5-7B at 128 x 1024 from 10,404 to 10,779 tokens/s
# block recompute + VJP working set per token, bytes = coefficients x widths x dtype bytes / 2
# (calibrated against XLA's memory analysis of the block VJP on an H100; see RESULTS.md)
# "moe_mlp" replaces "mlp" for a mixture of experts in its dense formulation (every expert's intermediates and
# their router-weighted combination): OLMoE shape on the H100, 16 x 4096 tokens, measured 48.3 GB peak at 4
# micro-batches (40.1 at 8) against 43.1 (38.2) planned with the dense coefficient (2026-11-24, RESULTS.md)
WS_PER_TOKEN = {"hidden": 26.0, "mlp": 8.0, "qkv": 4.0, "moe_mlp": 13.0}
LOSS_BYTES_PER_LOGIT = 10.0  # fp32 logits + fp32 softmax - onehot + bf16 copy of one chunk, fwd/bwd
# floor rates for the predicted step (H100 measurements, DESIGN.md §1 and RESULTS.md)
# host_read: all GPUs' host->GPU streams together (an assumption, not a measurement: the 2-H200 machine
# streamed 103.9 GB/s to both at once, so two links are not host-bound; beyond that DDR bandwidth is the cap)
RATES = {"matmul_bf16": 600e12, "matmul_fp32": 350e12, "h2d": 52e9, "d2h": 52e9, "host_read": 200e9,
         # 16 threads of the H100 machine's host (experiments/bench_compact_adamw.py; 2026-11-24: int8 3.50 after
         # the kernel rewrite, 1.65 for the previous kernel in the same run; 4.2 measured inside a 14B step)
         "adamw_elems": {"float32": 3.9e9, "bfloat16": 3.5e9, "int8": 3.5e9, "optax": 1.0e9}}
MOMENT_BYTES = {"float32": 8.0, "bfloat16": 4.0, "int8": 2.0 + 2 * 4.0 / 2048}


# ------------------------------------------------------------------------------------ machine


@dataclass
class Machine:
    """What the run may use. ``host_bytes`` is the limit, ``host_available`` what is free now."""

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


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _meminfo() -> dict[str, int]:
    out = {}
    for line in (_read("/proc/meminfo") or "").splitlines():
        k, _, v = line.partition(":")
        parts = v.split()
        if parts:
            out[k] = int(parts[0]) * 1024
    return out


def host_limit() -> tuple[float, float, str]:
    """(limit, available now, where the limit came from): the cgroup's ``memory.max`` where set
    (v2, else v1), else MemTotal. Available = min(MemAvailable, limit - cgroup usage)."""
    mi = _meminfo()
    total, avail = float(mi.get("MemTotal", 0)), float(mi.get("MemAvailable", mi.get("MemTotal", 0)))
    limit, source = total, "MemTotal"
    for mx, cur in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        raw = _read(mx)
        if raw and raw != "max" and raw.isdigit() and int(raw) < total:
            limit, source = float(raw), f"cgroup {mx}"
            used = _read(cur)
            if used and used.isdigit():
                avail = min(avail, limit - int(used))
            break
    return limit, min(avail, limit), source


def _gpu_from_nvidia_smi() -> tuple[list[float], str]:
    """Per-GPU total memory without initialising a JAX backend (whose allocator settings must be
    chosen first)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total,name", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return [], ""
    if out.returncode:
        return [], ""
    sizes, name = [], ""
    for line in out.stdout.strip().splitlines():
        mib, _, name = line.partition(",")
        try:
            sizes.append(float(mib) * (1 << 20))
        except ValueError:
            pass
    return sizes, name.strip()


def _jax_backend_ready() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge._backends)  # noqa: SLF001 - only to avoid initialising it early
    except Exception:  # noqa: BLE001
        return False


def detect_machine(paths: tuple[str, ...] = ()) -> Machine:
    """This machine's limits. GPUs are counted with nvidia-smi unless JAX is already initialised
    (then its devices say it); ``MEGATRAIN_GPU_MEMORY_GB`` simulates a GPU's capacity (tests)."""
    limit, avail, source = host_limit()
    sizes, name, gsrc = [], "", ""
    if _jax_backend_ready():
        import jax

        devs = [d for d in jax.local_devices() if d.platform == "gpu"]
        for d in devs:
            lim = (d.memory_stats() or {}).get("bytes_limit")
            if lim:
                sizes.append(float(lim) / 0.95 if os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION") else float(lim))
        name, gsrc = (devs[0].device_kind if devs else ""), "jax"
    elif os.environ.get("JAX_PLATFORMS", "") != "cpu":
        sizes, name = _gpu_from_nvidia_smi()
        gsrc = "nvidia-smi"
    sim = os.environ.get("MEGATRAIN_GPU_MEMORY_GB")
    if sim:
        sizes, name, gsrc = [float(sim) * GB], "simulated", "MEGATRAIN_GPU_MEMORY_GB"
    disk = {}
    for p in paths:
        probe = os.path.abspath(p)
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        disk[p] = float(shutil.disk_usage(probe).free)
    return Machine(backend="gpu" if sizes else "cpu", host_bytes=limit, host_available=avail, host_source=source,
                   gpu_bytes=min(sizes) if sizes else None, gpu_source=gsrc, gpu_count=len(sizes), gpu_name=name,
                   cpu_cores=os.cpu_count() or 1, disk_free=disk)


# ------------------------------------------------------------------------------------ the plan


@dataclass
class Row:
    where: str  # host | gpu | disk
    what: str
    bytes: float
    note: str = ""


@dataclass
class Plan:
    rows: list[Row]
    decisions: dict[str, Any]
    host_need: float
    host_limit: float
    host_source: str
    gpu_need: float | None
    gpu_budget: float | None
    gpu_phases: dict[str, float]
    disk_need: float
    disk_free: float | None
    step: dict[str, float]
    params: int
    machine: Machine
    notes: list[str] = field(default_factory=list)
    modes: dict[str, dict[str, Any]] = field(default_factory=dict)  # host need of each state mode (MODES)
    suggestion: str | None = None  # the leanest-first mode that fits when the configured one does not
    options: Any = None  # plan.options.EngineOptions: the decisions, typed, as the engine takes them

    @property
    def host_bytes_per_param(self) -> float:
        return self.host_need / max(self.params, 1)

    def verdict(self) -> UserError | None:
        """The first thing that does not fit, as the one-line error the CLI prints; None if it fits."""
        return _verdict(self)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["host_bytes_per_param"] = self.host_bytes_per_param
        d["fits"] = self.verdict() is None
        v = self.verdict()
        d["refusal"] = None if v is None else str(v)
        return d


def _usable(limit: float, margin: tuple[float, float]) -> float:
    return limit * (1 - margin[0]) - margin[1]


@dataclass
class _Shapes:
    """The sizes the plan needs, read once from the config."""

    P: int
    block: int
    embed: int
    head: int
    L: int
    H: int
    F: int
    V: int
    qkv: int
    B: int
    S: int
    tied: bool
    dt: int  # compute dtype bytes
    mlp_ws: float = WS_PER_TOKEN["mlp"]  # working-set bytes per token and unit of F (MoE: "moe_mlp")
    head_dim: int = 0

    @classmethod
    def of(cls, m: ModelConfig, batch: int, seq: int, compute_dtype: str) -> "_Shapes":
        q, kv = m.num_heads * m.dim_per_head, m.kv_heads * m.dim_per_head
        emb = m.vocab_size * m.hidden_size
        head = m.hidden_size + (0 if m.tie_embeddings else emb)
        # the MLP width a token's working set holds: a mixture of experts computes every expert on
        # every token in its dense formulation (and ragged_dot lowers to the same masked product)
        mlp = m.intermediate_size if not getattr(m, "num_experts", None) else \
            (m.moe_intermediate_size or m.intermediate_size) * m.num_experts
        return cls(P=m.total_params(), block=m.block_params(), embed=emb, head=head, L=m.num_layers,
                   H=m.hidden_size, F=mlp, V=m.vocab_size, qkv=q + 2 * kv, B=batch, S=seq,
                   tied=m.tie_embeddings, dt=2 if compute_dtype == "bfloat16" else 4,
                   mlp_ws=WS_PER_TOKEN["moe_mlp" if getattr(m, "num_experts", None) else "mlp"],
                   head_dim=m.dim_per_head)

    @property
    def largest_group(self) -> int:
        return max(self.block, self.embed, self.head)


def _block_ws(s: _Shapes, tokens_mb: int) -> float:
    w = WS_PER_TOKEN
    return tokens_mb * (w["hidden"] * s.H + s.mlp_ws * s.F + w["qkv"] * s.qkv) * s.dt / 2 * (2 if s.dt == 4 else 1)


def _loss_ws(s: _Shapes, tokens_mb: int, loss_chunk: int) -> float:
    c = min(loss_chunk, tokens_mb)
    return c * s.V * LOSS_BYTES_PER_LOGIT + 3 * tokens_mb * s.H * 4


def _gpu_phases(s: _Shapes, *, M: int, stream_bytes: int, device_cast: bool, act_on_gpu: bool,
                hold_bytes: int | None, loss_chunk: int, deferred: bool,
                attn: Any = None, update_state_bytes: float | None = None) -> tuple[dict[str, float], list[Row]]:
    """Bytes on the GPU at each phase of a step, and the rows that explain them.
    ``update_state_bytes``: optimizer state bytes/param of a device-side update (``train.update_on=device``),
    None for host updates."""
    tok_mb = s.B * s.S // M
    rows = []
    # the embedding and head always stream their fp32 master (hoststore.py) and are cast in each jit
    resident = (s.embed + s.head) * 4 + (s.embed + s.head) * (s.dt if s.dt == 2 else 0)
    rows.append(Row("gpu", "embedding + head weights (resident for the step)", resident,
                    "fp32 + compute-dtype cast" if s.dt == 2 else "fp32"))
    inflight = 2 * s.block * stream_bytes + (s.block * s.dt if device_cast else 0)
    rows.append(Row("gpu", "two blocks in flight", inflight, "fp32 master, cast on the GPU" if device_cast else ""))
    act_layer = s.B * s.S * s.H * s.dt
    acts = s.L * act_layer if act_on_gpu else 2 * act_layer
    rows.append(Row("gpu", "boundary activations", acts,
                    f"{s.L} layers x {s.B * s.S} tokens" if act_on_gpu else "in pinned host memory; 2 layers reloaded"))
    ws = _block_ws(s, tok_mb)
    rows.append(Row("gpu", "block recompute + VJP working set", ws, f"{tok_mb} tokens per micro-batch"))
    if attn is not None:  # what the chosen attention path needs beyond the calibrated (cuDNN) coefficients
        extra = attn(max(s.B // M, 1))
        rows.append(Row("gpu", "attention working set beyond cuDNN's", extra[0], extra[1]))
        ws += extra[0]
    accum = s.block * 4 + (s.embed * 4)  # current block's fp32 accumulator + the embedding's
    rows.append(Row("gpu", "gradient accumulators (fp32)", accum + s.head * 4, "current block, embedding, head"))
    lws = _loss_ws(s, tok_mb, loss_chunk)
    rows.append(Row("gpu", "loss chunk (logits never exist whole)", lws, f"chunk {min(loss_chunk, tok_mb)} tokens"))
    held = (s.P * hold_bytes) if (deferred and hold_bytes) else 0
    if deferred:
        rows.append(Row("gpu", "gradients held for clipping", held,
                        {4: "fp32", 2: "bf16"}.get(hold_bytes or 0, "in pinned host memory")))
    fixed = resident + inflight
    upd = upd_loss = 0.0
    if update_state_bytes is not None:
        # the state of the two blocks in flight and of the embedding or head being updated, three updated
        # blocks (master + state) still being written back to the host (two fell 0.8 GB short of the
        # 18.1B model's measured peak on the H100), and the step's temporaries (one slice of
        # device_adamw.CHUNK values, up to 16 bytes each for int8 moments)
        upd = update_state_bytes * (2 * s.block + max(s.embed, s.head)) + (4 + update_state_bytes) * 3 * s.block \
            + 16.0 * min(DEVICE_UPDATE_CHUNK, max(s.embed, s.head, s.block))
        # at the loss too: measured on the H100, a device-side update run peaks 5-6 GB above the same
        # run updating on the host (Qwen2.5-14B 65.8-66.5 GB against 60.5-60.9), more than the head's
        # update alone explains
        upd_loss = upd
        rows.append(Row("gpu", "device-side update (state in flight, write-back, temporaries)", upd, "train.update_on=device"))
    phases = {
        "forward start (all held gradients, no activations)": fixed + held + act_layer + ws / 2 + upd,
        # gradient accumulators of head and embedding, the output matrix's fp32 gradient and its cast
        "loss (all activations, loss chunk)": fixed + acts + lws + s.head * 4 + s.embed * 4
        + s.V * s.H * (4 + s.dt) + act_layer + upd_loss,
        "backward start (activations, accumulators)": fixed + acts + accum + s.head * 4 + ws
        + (s.head * (hold_bytes or 0) if deferred else 0),
        "backward end (held gradients, accumulators)": fixed + held + accum + ws + (act_layer if act_on_gpu else 0)
        + act_layer,
    }
    return phases, rows


def _process_count() -> int:
    """Processes of a multi-host run (distributed.py's MEGATRAIN_NUM_PROCESSES), read without
    starting a JAX backend (the plan must run before XLA is configured)."""
    try:
        return max(int(os.environ.get("MEGATRAIN_NUM_PROCESSES", "1")), 1)
    except ValueError:
        return 1


STREAM_HIDDEN_RATIO = 0.25  # fp32 stream time / block forward compute below which the device cast is free


def _choose_stream_copy(s: "_Shapes", seq_len: int, m, on_gpu: bool, bf16: bool, room: float) -> str:
    """``train.stream_copy=auto``: stream the fp32 master and cast it on the GPU (saving the host's
    2-byte copy of every block) where that doubled transfer stays hidden behind a block's forward
    compute, or where the copy does not fit the host; otherwise keep the bf16 host copy.

    Measured on the H100 (2026-11-23): at a fp32-stream/forward ratio of 0.18 (Qwen2.5-7B,
    128 x 1024 tokens) the cast cost 1% of tokens/s; at 0.35 (Llama-2-7B, 16 x 4096) it cost 4%.
    """
    if not bf16:
        return "host"  # fp32 compute streams the master itself: there is no copy to save
    copy_bytes = 2.0 * s.L * s.block
    if not on_gpu:
        return "host" if copy_bytes <= room else "device"
    tokens = s.B * s.S
    fwd_flops = tokens * (2.0 * s.block + 2.0 * seq_len * m.num_heads * m.dim_per_head)
    ratio = (4.0 * s.block / RATES["h2d"]) / (fwd_flops / RATES["matmul_bf16"])
    return "device" if (ratio <= STREAM_HIDDEN_RATIO or copy_bytes > room) else "host"


DEVICE_UPDATE_CHUNK = 8192 * 2048  # optim/device_adamw.CHUNK (not imported: the plan runs before JAX starts)


def _choose_update_on(setting: str, *, on_gpu: bool, n_dev: int, kernel: str, moments: str, bf16: bool,
                      stream_copy: str) -> str:
    """``train.update_on=auto``: the GPU applies the update (``engine.py``, ``optim/device_adamw.py``)
    where the moments are compact (bf16 or int8: 4 or 2 bytes/param more each way over PCIe than a
    host update moves), on one GPU, with the fused kernel; the host elsewhere. Measured on the H100
    (RESULTS.md, 2026-11-24): Qwen2.5-14B int8 350 -> 391 model-TFLOPS, Qwen3-8B bf16 moments 361 -> 373.
    fp32 moments (8 bytes/param each way more) stay on the host: not measured to pay."""
    if setting != "auto":
        return setting
    if on_gpu and n_dev == 1 and kernel == "fused" and moments in ("bfloat16", "int8") \
            and not (bf16 and stream_copy == "host"):
        return "device"
    return "host"


# the host-state modes, fullest first: (name, overrides)
MODES = {"full": {"moments": "float32"},
         "compact": {"moments": "bfloat16", "stream_copy": "device"},
         "leanest": {"moments": "int8", "stream_copy": "device"}}


def make_plan(cfg: Config, machine: Machine | None = None, *, devices: int | None = None,
              _modes: bool = True) -> Plan:
    """The plan for ``cfg`` on ``machine`` (this one by default), with every 'auto' decided; with the
    host need of each state mode beside it, and, when the configured mode does not fit the host, the
    fullest mode that does (``suggestion``)."""
    plan = _make_plan(cfg, machine, devices)
    if not _modes or cfg.optim.kernel != "fused":
        return plan
    import dataclasses

    fits_host = lambda q: q.host_need <= _usable(q.host_limit, HOST_MARGIN)  # noqa: E731
    for name, over in MODES.items():
        t = dataclasses.replace(cfg.train, stream_copy=over.get("stream_copy", cfg.train.stream_copy),
                                keep_residuals="auto")  # each mode with the residuals its GPU room holds
        o = dataclasses.replace(cfg.optim, moments=over["moments"])
        q = _make_plan(dataclasses.replace(cfg, train=t, optim=o), plan.machine, devices)
        plan.modes[name] = {"host_gb": q.host_need / GB, "bytes_per_param": q.host_bytes_per_param,
                            "fits_host": fits_host(q),
                            "settings": " ".join(f"{'optim' if k == 'moments' else 'train'}.{k}={v}"
                                                 for k, v in over.items())}
    if not fits_host(plan):
        order = list(MODES)  # fullest first; suggest only modes leaner than the configured one
        current = {"float32": 0, "bfloat16": 1}.get(cfg.optim.moments, len(order))
        for name in order[current + 1:]:
            if plan.modes[name]["fits_host"]:
                m = plan.modes[name]
                plan.suggestion = f"{m['settings']} ({name}: {m['bytes_per_param']:.1f} bytes/param, {m['host_gb']:.1f} GB)"
                break
    return plan


def _make_plan(cfg: Config, machine: Machine | None, devices: int | None) -> Plan:
    t, o, m = cfg.train, cfg.optim, cfg.model
    out_dir = t.out_dir
    machine = machine or detect_machine((out_dir,) + ((t.export,) if t.export else ()))
    n_dev = devices or ((machine.gpu_count if t.devices == "all" else int(t.devices)) or 1) * _process_count()
    host_limit = t.host_memory_gb * GB if t.host_memory_gb else machine.host_bytes
    host_source = "train.host_memory_gb" if t.host_memory_gb else machine.host_source
    host_avail = host_limit if t.host_memory_gb else machine.host_available
    on_gpu = machine.backend == "gpu"
    gpu_budget = None
    if on_gpu:
        gpu_budget = machine.gpu_bytes * XLA_FRACTION  # what XLA's allocator is given (apply_gpu_settings)
        if t.gpu_memory_gb:
            gpu_budget = min(gpu_budget, t.gpu_memory_gb * GB)
    elif t.gpu_memory_gb:
        gpu_budget = t.gpu_memory_gb * GB  # a CPU run honours the budget too (its "device" is host RAM)

    bf16 = t.compute_dtype == "bfloat16"
    deferred = True  # train always defers updates (NaN skipping; clipping when set)
    notes: list[str] = []
    per_dev_batch = t.batch_size // n_dev if t.batch_size % n_dev == 0 else t.batch_size
    s = _Shapes.of(m, per_dev_batch, cfg.data.seq_len, t.compute_dtype)
    mom = 8.0 if o.kernel == "optax" else MOMENT_BYTES[o.moments]
    update_on = _choose_update_on(t.update_on, on_gpu=on_gpu, n_dev=n_dev, kernel=o.kernel, moments=o.moments,
                                  bf16=bf16, stream_copy=t.stream_copy)
    if update_on == "device" and n_dev > 1:
        from megatrain_jax.errors import UserError

        raise UserError("train.update_on", f"device runs on one GPU, and this run uses {n_dev}",
                        "set train.update_on=host (or auto) for data parallel, or train.devices=1")
    stream_copy = "device" if (update_on == "device" and bf16) else t.stream_copy
    # the runtime at its largest (a preallocated pool's allocator table) while choosing the options
    runtime_max = RUNTIME_HOST_BYTES["gpu" if on_gpu else "cpu"] \
        + (XLA_FRACTION * machine.gpu_bytes * BFC_TABLE_BYTES_PER_POOL_BYTE if on_gpu and machine.gpu_bytes else 0.0)
    if stream_copy == "auto":
        room = _usable(host_avail, HOST_MARGIN) - s.P * (4.0 + mom) - runtime_max \
            - GRAD_SLABS[0] * GRAD_SLAB_ELEMS * 4
        stream_copy = _choose_stream_copy(s, cfg.data.seq_len, m, on_gpu, bf16, room)
    device_cast = bf16 and stream_copy == "device"
    stream_bytes = 2 if (bf16 and not device_cast) else 4

    # ---- decisions: micro-batches, activation placement, gradient holding
    if t.micro_batches == "auto":
        # from the fewest micro-batches of at most MICRO_TOKENS tokens upward (fewer only costs memory)
        divs = [k for k in range(1, s.B + 1) if s.B % k == 0]
        cands = [k for k in divs if s.B * s.S // k <= MICRO_TOKENS] or divs[-1:]
    else:
        cands = [int(t.micro_batches) // n_dev if n_dev > 1 and int(t.micro_batches) % n_dev == 0
                 else int(t.micro_batches)]
    holds = {"gpu_fp32": 4, "gpu_bf16": 2, "pinned_host": None}
    hold_order = ["gpu_fp32", "gpu_bf16", "pinned_host"] if t.grad_hold == "auto" else [t.grad_hold]
    act_order = (["device", "pinned_host"] if t.activations == "auto" else [t.activations])
    if not on_gpu and gpu_budget is None:  # CPU backend: all "device" memory is host memory, no pinned pool
        hold_order = ["gpu_fp32"] if t.grad_hold == "auto" else hold_order
        act_order = ["device"] if t.activations == "auto" else act_order
    budget_gpu = _usable(gpu_budget, GPU_MARGIN) if gpu_budget else None
    # the attention path (attention.py) and its working set beyond what the coefficients include
    from megatrain_jax import attention as attn_mod

    backend = "gpu" if on_gpu else "cpu"
    attn_info = attn_mod.describe(m, cfg.data.seq_len, t.compute_dtype, backend, batch=max(s.B // cands[0], 1),
                                  doc_masking=cfg.data.doc_masking)

    def attn_extra(batch: int) -> tuple[float, str]:
        d = attn_mod.describe(m, cfg.data.seq_len, t.compute_dtype, backend, batch=batch,
                              doc_masking=cfg.data.doc_masking)
        return float(max(d["extra_over_cudnn_bytes"], 0)), d["impl"]

    # host bytes every option needs (the options add pinned activations or pinned gradients)
    host_base = s.P * (4.0 + mom) + (2.0 * s.L * s.block if (bf16 and not device_cast) else 0.0) \
        + runtime_max + GRAD_SLABS[0] * GRAD_SLAB_ELEMS * 4
    host_extra = {"act": float(s.L * s.B * s.S * s.H * s.dt * n_dev), "hold": 4.0 * s.P}
    host_room = _usable(host_avail, HOST_MARGIN) - host_base
    # preference: what costs nothing first (activations on the GPU, exact fp32 gradients), then bf16
    # holding, then pinned host memory for activations, then for gradients; within each, the
    # micro-batch count from the candidates above; an option must fit the GPU and the host
    prefs = [(a, h) for h in hold_order for a in act_order]
    prefs.sort(key=lambda ah: (ah[1] == "pinned_host", ah[0] == "pinned_host", ah[1] == "gpu_bf16"))
    chosen = None
    for act, hold in prefs:
        extra = (host_extra["act"] if act == "pinned_host" else 0) + (host_extra["hold"] if hold == "pinned_host" else 0)
        for k in cands:
            phases, rows = _gpu_phases(s, M=k, stream_bytes=stream_bytes, device_cast=device_cast,
                                       act_on_gpu=act == "device", hold_bytes=holds[hold],
                                       loss_chunk=t.loss_chunk, deferred=deferred, attn=attn_extra,
                                       update_state_bytes=mom if update_on == "device" else None)
            need = max(phases.values())
            fits = (budget_gpu is None or need <= budget_gpu) and (extra == 0 or extra <= host_room)
            if chosen is None:
                chosen = (k, act, hold, phases, rows, need, False)  # reported if nothing fits
            if fits:
                chosen = (k, act, hold, phases, rows, need, True)
                break
        if chosen[6]:
            break
    M, act, hold, phases, gpu_rows, gpu_need, fits_gpu = chosen
    if not fits_gpu and t.update_on == "auto" and update_on == "device":
        # the device-side update's own GPU memory (and the gradients it must hold there) does not fit:
        # the host updates instead (e.g. 18.1B parameters on an 80 GB GPU)
        import dataclasses

        return _make_plan(dataclasses.replace(cfg, train=dataclasses.replace(t, update_on="host")), machine, devices)
    n_keep, per_block = _choose_keep_residuals(t.keep_residuals, s, n_dev=n_dev, on_gpu=on_gpu,
                                             act_on_gpu=act == "device", moments=o.moments, need=gpu_need,
                                             budget=gpu_budget, usable=budget_gpu, moe=bool(getattr(m, "num_experts", None)))
    if n_keep:
        gpu_rows.append(Row("gpu", f"forward residuals of the last {n_keep} blocks", n_keep * per_block,
                            "their backward does not recompute them (train.keep_residuals)"))
        # on top of the step's peak, wherever the plan puts it (the residuals live from the last blocks'
        # forward to their backward, next to the loss phase): conservative, measured on the H100 below it
        # (Llama-2-7B, 7 blocks: 62.1 GB against 75.0; Qwen3-8B int8, 4 blocks: 66.8 against 71.3)
        phases["loss, residuals kept"] = max(phases.values()) + n_keep * per_block
        gpu_need = max(phases.values())

    # ---- host rows
    rows: list[Row] = []
    rows.append(Row("host", "fp32 master weights", 4.0 * s.P))
    if o.kernel == "optax":
        notes.append("optim.kernel=optax: optimizer state estimated as Adam's 8 bytes/param")
    rows.append(Row("host", f"optimizer state ({o.moments} moments)", mom * s.P))
    if bf16 and not device_cast:
        rows.append(Row("host", "bf16 streaming copy (blocks)", 2.0 * s.L * s.block,
                        "train.stream_copy=device removes it"))
    chunked = o.kernel == "fused"
    slab = (min(GRAD_SLAB_ELEMS, s.largest_group) if chunked else s.largest_group) * 4
    slab_row = Row("host", "gradient staging (pinned slabs)", 0.0)
    if on_gpu and update_on == "host":  # device-side updates bring no gradient to the host
        rows.append(slab_row)  # sized below, once the rest of the host plan is known
    if hold == "pinned_host":
        rows.append(Row("host", "gradients held for clipping (pinned)", 4.0 * s.P))
    if act == "pinned_host":
        rows.append(Row("host", "boundary activations (pinned)", float(s.L * s.B * s.S * s.H * s.dt * n_dev)))
    ckpt_on = t.final_checkpoint or t.ckpt_every
    if ckpt_on:
        rows.append(Row("host", "checkpoint writer (one group in flight)", s.largest_group * (4 + mom)))
    rows.append(Row("host", "data loader (one batch, index)", float(t.batch_size * cfg.data.seq_len * 4 * 4 + 64e6)))
    rows.append(Row("host", "runtime (Python, JAX" + (", CUDA context)" if on_gpu else ")"),
                    RUNTIME_HOST_BYTES["gpu" if on_gpu else "cpu"] * (n_dev if on_gpu else 1)))
    preallocate = None
    if on_gpu and machine.gpu_bytes:
        pool = min(XLA_FRACTION, (gpu_budget or machine.gpu_bytes) / machine.gpu_bytes) * machine.gpu_bytes
        preallocate = not (gpu_budget and gpu_need <= PREALLOCATE_ABOVE * gpu_budget)
        managed = pool if preallocate else min(pool, _grown_pool(gpu_need))
        rows.append(Row("host", "XLA's GPU allocator table (8 bytes per 256 of its pool)",
                        managed * BFC_TABLE_BYTES_PER_POOL_BYTE * n_dev,
                        "pool made at the start" if preallocate else "pool grown on demand"))
    if not on_gpu:
        rows.append(Row("host", "device buffers (the CPU backend's device memory is host memory)", gpu_need))
    # slabs: as many as the host has room for (up to GRAD_SLABS[1]), never fewer than GRAD_SLABS[0]
    if not chunked:
        slabs = 3
    elif t.grad_slabs != "auto":
        slabs = int(t.grad_slabs)
    else:
        room = _usable(host_avail, HOST_MARGIN) - sum(r.bytes for r in rows)
        # int8 moments are the leanest state, chosen for memory: the fewest slabs (the int8 kernel, not the
        # slab pool, paces those updates; 24 -> 6 slabs: Qwen2.5-7B 54.2 -> 50.7 GB, H100, RESULTS.md)
        most = GRAD_SLABS[0] if o.moments == "int8" else GRAD_SLABS[1]
        slabs = int(max(GRAD_SLABS[0], min(most, room // slab))) if on_gpu else GRAD_SLABS[0]
    slab_row.bytes, slab_row.note = float(slab * slabs), f"{slabs} x {slab / GiB:.3f} GiB (train.grad_slabs)"
    host_need = sum(r.bytes for r in rows)

    # ---- disk
    disk_rows = []
    ckpt_bytes = s.P * (4 + mom)
    keep = max(t.keep_last, 1) + 1  # the one being written while keep_last are kept
    n_ckpt = 0
    if t.ckpt_every:
        n_ckpt = min(keep, max(1, t.steps // t.ckpt_every) + (1 if t.final_checkpoint else 0))
        if t.keep_every:
            n_ckpt += t.steps // max(t.keep_every, 1)
    elif t.final_checkpoint:
        n_ckpt = 1
    if n_ckpt:
        disk_rows.append(Row("disk", f"checkpoints ({n_ckpt} x {ckpt_bytes / GB:.1f} GB)", n_ckpt * ckpt_bytes,
                             f"in {out_dir}"))
    if t.export:
        disk_rows.append(Row("disk", "Hugging Face export", s.P * (2 if t.export_dtype != "float32" else 4),
                             f"in {t.export}"))
    disk_need = sum(r.bytes for r in disk_rows)
    disk_free = machine.disk_free.get(out_dir) if machine.disk_free else None

    # ---- predicted step from its floor terms
    tokens = t.batch_size * cfg.data.seq_len
    attn = 12.0 * m.num_layers * m.num_heads * m.dim_per_head * cfg.data.seq_len
    hw_flops = tokens * (8 * m.non_embedding_params() - 2 * n_keep * s.block + 8 * s.V * s.H + 4.0 / 6.0 * attn)
    rate = RATES["matmul_bf16" if bf16 else "matmul_fp32"] * n_dev
    h2d_bytes = 2 * s.L * s.block * stream_bytes + 4 * (s.embed + s.head)  # blocks twice, embedding/head once
    opt_rate = RATES["adamw_elems"]["optax" if o.kernel == "optax" else o.moments] * min(machine.cpu_cores, 16) / 16
    # N GPUs: each receives every block over its own link, but all of them read the one host
    # memory at once; the summed gradient leaves once, its chunks spread over the N links
    h2d_s = max(h2d_bytes / RATES["h2d"], n_dev * h2d_bytes / RATES["host_read"])
    step = {"compute_s": hw_flops / rate, "h2d_s": h2d_s, "d2h_s": 4 * s.P / (RATES["d2h"] * n_dev),
            "optimizer_s": s.P / opt_rate}
    if update_on == "device":  # the state crosses PCIe both ways instead of the gradient; no host kernel
        step["h2d_s"] = (h2d_bytes + mom * s.P) / RATES["h2d"]
        step["d2h_s"] = (4 + mom) * s.P / RATES["d2h"]
        step["optimizer_s"] = 0.0
    step["predicted_step_s"] = max(step.values())
    step["binding"] = max(("compute_s", "h2d_s", "d2h_s", "optimizer_s"), key=lambda k: step[k])

    decisions = {"micro_batches": M, "activations": act, "grad_hold": hold, "stream_copy": stream_copy,
                 "update_on": update_on,
                 "attention": attn_info["impl"], "attention_summary": attn_info["summary"],
                 "moments": o.moments, "devices": n_dev, "grad_slab_elems": GRAD_SLAB_ELEMS if chunked else None,
                 "grad_slabs": slabs, "pinned_pool_bytes": _pinned_need(rows),
                 "gpu_mem_fraction": None, "gpu_preallocate": preallocate, "keep_residuals": n_keep}
    if on_gpu and machine.gpu_bytes:
        decisions["gpu_mem_fraction"] = round(min(XLA_FRACTION, (gpu_budget or machine.gpu_bytes) / machine.gpu_bytes), 4)
    from megatrain_jax.plan.options import EngineOptions

    options = EngineOptions(compute_dtype=t.compute_dtype, micro_batches=M, loss_chunk=t.loss_chunk,
                            clip_norm=o.clip_norm, skip_nonfinite=True, activations=act, grad_hold=hold,
                            grad_slabs=slabs, grad_slab_elems=GRAD_SLAB_ELEMS if chunked else None,
                            stream_copy=stream_copy, update_on=update_on, keep_residuals=n_keep,
                            devices=t.devices, device_update_chunk=DEVICE_UPDATE_CHUNK)
    return Plan(rows=rows + gpu_rows + disk_rows, decisions=decisions, options=options, host_need=host_need, host_limit=host_avail,
                host_source=host_source, gpu_need=gpu_need if gpu_budget else None, gpu_budget=gpu_budget,
                gpu_phases=phases, disk_need=disk_need, disk_free=disk_free, step=step, params=s.P,
                machine=machine, notes=notes)


def residual_bytes_per_block(s: "_Shapes", head_dim: int) -> float:
    """GPU bytes one block's kept forward residuals take for the whole step: the matmul outputs a
    token keeps (q, k, v, the attention's output projection, gate and up; engine.py's checkpoint
    policy) and the rotary tables in fp32 (jax.eval_shape of the engine's kernel: tests). The block's
    weights and its input are not among them (the backward gets them again)."""
    # + dt x H: a margin for what the GPU may keep beyond the abstract count (cuDNN attention's inputs
    # after rotary and norms are recomputed, not kept, by the count)
    per_token = s.dt * (2 * s.H + s.qkv + 2 * s.F) + 4 * head_dim
    return float(s.B * s.S * per_token)


def _choose_keep_residuals(asked: Any, s: "_Shapes", *, n_dev: int, on_gpu: bool, act_on_gpu: bool, moments: str,
                           need: float, budget: float | None, usable: float | None, moe: bool) -> tuple[int, float]:
    """How many of the last blocks keep their forward residuals (no recompute in the backward), and
    the bytes of one. ``auto``: as many as the GPU room the plan leaves holds, on one GPU with the
    activations there; with int8 moments (the state chosen for host memory) only within the room
    that keeps XLA's pool growing on demand, whose allocator table is host memory."""
    from megatrain_jax.errors import UserError

    per_block = residual_bytes_per_block(s, s.head_dim)
    if asked != "auto":
        n = min(int(asked), s.L - 1)
        if n and n_dev > 1:
            raise UserError("train.keep_residuals", f"kept residuals run on one GPU, and this run uses {n_dev}",
                            "set train.keep_residuals=auto (or 0) for data parallel")
        if n and usable is not None and need + n * per_block > usable:
            raise UserError("train.keep_residuals",
                            f"{n} blocks' residuals need {n * per_block / GB:.1f} GB and the GPU room left by the "
                            f"plan is {max(usable - need, 0) / GB:.1f} GB",
                            f"set it to {max(int((usable - need) // per_block), 0)} or auto")
        return n, per_block
    if not on_gpu or n_dev > 1 or not act_on_gpu or usable is None or moe:
        return 0, per_block
    room = usable - need  # the residuals sit on top of the step's peak (see _make_plan)
    if moments == "int8" and budget and need <= PREALLOCATE_ABOVE * budget:
        room = min(room, PREALLOCATE_ABOVE * budget - need)
    return int(max(0, min(s.L - 1, room // per_block))), per_block


def _grown_pool(need: float) -> float:
    """GPU bytes XLA's allocator holds once ``need`` is in use, growing on demand: each new region is
    twice the last (tsl's BFC allocator with allow_growth), so the pool is the first doubling sum
    that covers the need."""
    pool, region = 0.0, float(BFC_FIRST_REGION)
    while pool < need:
        pool, region = pool + region, region * 2
    return pool


def _pinned_need(rows: list[Row]) -> float:
    return sum(r.bytes for r in rows if "pinned" in r.what)


def _verdict(p: Plan) -> UserError | None:
    host_ok = p.host_need <= _usable(p.host_limit, HOST_MARGIN)
    if not host_ok:
        over = p.host_need - _usable(p.host_limit, HOST_MARGIN)
        fixes = []
        if p.suggestion:
            fixes.append(f"{p.suggestion} fits")
        else:
            if p.decisions["moments"] == "float32":
                fixes.append("optim.moments=int8 (or bfloat16)")
            if p.decisions["stream_copy"] == "host" and any("streaming copy" in r.what for r in p.rows):
                fixes.append("train.stream_copy=device")
        if p.decisions["activations"] == "pinned_host" or p.decisions["grad_hold"] == "pinned_host":
            fixes.append("fewer tokens per step")
        fixes.append("a machine with more memory")
        if p.host_source != "train.host_memory_gb":
            fixes.append("or train.host_memory_gb=N if this machine's limit is misread")
        return UserError("host memory", f"the plan needs {p.host_need / GB:.1f} GB ({p.host_bytes_per_param:.1f} "
                         f"bytes/param for {p.params / 1e9:.2f}B parameters) but {p.host_limit / GB:.1f} GB is "
                         f"available ({p.host_source}; {over / GB:.1f} GB short after a "
                         f"{HOST_MARGIN[0]:.0%} + {HOST_MARGIN[1] / GiB:.0f} GiB safety margin)",
                         ", ".join(fixes))
    if p.gpu_budget is not None and p.gpu_need is not None and p.gpu_need > _usable(p.gpu_budget, GPU_MARGIN):
        phase = max(p.gpu_phases, key=p.gpu_phases.get)
        return UserError("GPU memory", f"the plan needs {p.gpu_need / GB:.1f} GB at its peak ({phase}) but the "
                         f"budget is {p.gpu_budget / GB:.1f} GB", "fewer tokens per micro-batch "
                         "(raise train.micro_batches or set it to auto, or lower data.seq_len / train.batch_size), "
                         "a smaller train.loss_chunk, or a GPU with more memory")
    if p.disk_free is not None and p.disk_need > p.disk_free:
        return UserError("disk", f"checkpoints/export need {p.disk_need / GB:.1f} GB but {p.disk_free / GB:.1f} GB "
                         f"is free where they go", "train.ckpt_every=0 and train.final_checkpoint=false, a lower "
                         "train.keep_last, or another train.out_dir")
    return None


# ------------------------------------------------------------------------------------ output


def plan_table(p: Plan) -> str:
    """The plan as a readable table (rich), one line per component."""
    import io

    from rich.console import Console
    from rich.table import Table

    tab = Table(title=f"memory plan: {p.params / 1e9:.3f}B parameters", show_lines=False)
    for col in ("where", "component", "GB", "note"):
        tab.add_column(col, justify="right" if col == "GB" else "left")
    for r in p.rows:
        tab.add_row(r.where, r.what, f"{r.bytes / GB:.2f}", r.note)
    buf = io.StringIO()
    con = Console(file=buf, width=130, force_terminal=False, color_system=None)
    con.print(tab)
    lines = [buf.getvalue().rstrip()]
    lines.append(f"host: need {p.host_need / GB:.1f} GB ({p.host_bytes_per_param:.2f} bytes/param), limit "
                 f"{p.host_limit / GB:.1f} GB ({p.host_source}), margin {HOST_MARGIN[0]:.0%} + "
                 f"{HOST_MARGIN[1] / GiB:.0f} GiB")
    if p.gpu_budget is not None:
        lines.append(f"GPU: peak {p.gpu_need / GB:.1f} GB of a {p.gpu_budget / GB:.1f} GB budget "
                     f"({p.machine.gpu_name or 'device'}; margin {GPU_MARGIN[0]:.0%} + {GPU_MARGIN[1] / GiB:.1f} GiB)")
        for k, v in p.gpu_phases.items():
            lines.append(f"     {k}: {v / GB:.1f} GB")
    else:
        lines.append("GPU: none (CPU backend: device buffers are counted in host memory)")
    if p.disk_need:
        lines.append(f"disk: need {p.disk_need / GB:.1f} GB, free "
                     + (f"{p.disk_free / GB:.1f} GB" if p.disk_free is not None else "unknown"))
    if p.modes:
        lines.append("host state modes: " + "; ".join(
            f"{n} {m['bytes_per_param']:.1f} B/param = {m['host_gb']:.1f} GB ({'fits' if m['fits_host'] else 'does not fit'})"
            for n, m in p.modes.items()))
    d = p.decisions
    lines.append(d.get("attention_summary", ""))
    lines.append(f"decisions: micro_batches={d['micro_batches']}, activations={d['activations']}, "
                 f"grad_hold={d['grad_hold']}, stream_copy={d['stream_copy']}, moments={d['moments']}, update_on={d.get('update_on', 'host')}, "
                 f"devices={d['devices']}")
    st = p.step
    lines.append(f"predicted step: {st['predicted_step_s']:.2f} s, bound by {st['binding'][:-2]} (compute "
                 f"{st['compute_s']:.2f} s, host->GPU {st['h2d_s']:.2f} s, GPU->host {st['d2h_s']:.2f} s, "
                 f"optimizer {st['optimizer_s']:.2f} s)")
    lines.extend(f"note: {n}" for n in p.notes)
    v = p.verdict()
    lines.append("verdict: fits" if v is None else f"verdict: does not fit: {v}")
    return "\n".join(lines)


def scaling_table(cfg: Config, machine: Machine | None = None, counts=(1, 2, 4, 8)) -> str:
    """Predictions for the same config on N GPUs (data parallel, the global batch split over them):
    per-GPU peak, the host's total, and the step's floor terms. Predictions, until measured."""
    machine = machine or detect_machine((cfg.train.out_dir,))
    lines = ["data parallel (predictions from the plan's rates, not measurements):",
             f"{'GPUs':>4} | {'per-GPU peak GB':>15} | {'host GB':>7} | {'step s':>6} | {'bound by':>9} | "
             f"{'tokens/s':>9} | {'optimizer s':>11} | {'GPU->host s':>11}"]
    tokens = cfg.train.batch_size * cfg.data.seq_len
    for n in counts:
        if cfg.train.batch_size % n:
            lines.append(f"{n:>4} | batch_size {cfg.train.batch_size} does not split over {n} GPUs")
            continue
        p = make_plan(cfg, machine, devices=n)
        st = p.step
        gpu = f"{p.gpu_need / GB:.1f}" if p.gpu_need else "-"
        lines.append(f"{n:>4} | {gpu:>15} | {p.host_need / GB:>7.1f} | {st['predicted_step_s']:>6.2f} | "
                     f"{st['binding'][:-2]:>9} | {tokens / st['predicted_step_s']:>9,.0f} | "
                     f"{st['optimizer_s']:>11.2f} | {st['d2h_s']:>11.2f}")
    return "\n".join(lines)


def plan_json(p: Plan) -> str:
    return json.dumps(p.to_dict(), indent=1, default=str)


def apply_gpu_settings(p: Plan) -> None:
    """Give XLA the plan's budgets before its backend starts (no hand-set variable is needed; one
    that the user did set is respected)."""
    d = p.decisions
    if d.get("gpu_mem_fraction"):
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(d["gpu_mem_fraction"]))
    if d.get("gpu_preallocate") is False:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    pinned = d.get("pinned_pool_bytes") or 0
    if p.machine.backend == "gpu":
        os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", str(max(4, math.ceil(pinned * 1.5 / GiB) + 2)))


# ------------------------------------------------------------------------------------ measured


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
