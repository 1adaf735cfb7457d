"""The streamed training step.

Read ``StreamedTrainer.step`` top to bottom: forward sweep, loss, backward sweep, updates. The
model's state lives in the host store; the accelerator sees, at any moment, the embedding and head
(resident for the step: small, needed at both ends), the block being computed and the next block
already in flight.

- **Forward**: layer by layer; every micro-batch passes a block while its weights are resident
  (layer-major), and each block's input activation is kept (the boundary checkpoints).
- **Loss**: final norm + LM head + cross-entropy in chunks of ``train.loss_chunk`` tokens under
  ``jax.checkpoint``, so the (tokens x vocab) logits never exist at once, forward or backward.
- **Backward**: blocks in reverse; each recomputes its forward from the saved input inside a
  per-layer VJP, accumulates its weight gradient over micro-batches in fp32, and hands it to the
  host, where that block is updated while the accelerator moves on.
- **Updates**: without clipping, a block is updated as soon as its gradient lands. With global-norm
  clipping every update must wait for the norm; they are then queued in forward order, and the next
  step's forward waits for each block's update only when it needs that block.
- **Auxiliary loss** (only for a stack with ``aux_loss``, e.g. MoE router load balancing; see
  ``templates.AuxLoss``): the emitting blocks' statistics are summed on the devices during the
  forward (one small accumulator per device, added to inside each block's forward), summed over
  the devices once, and ``fn(total)`` joins the step's loss; its gradient with respect to the
  total is the extra cotangent each emitting block's VJP receives in the backward.

Issue order decides overlap (DESIGN.md §2): a block's transfer is issued *before* the compute it
should hide behind is dispatched.
"""
from __future__ import annotations

import threading
import time
from functools import partial
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from megatrain_jax.hoststore import HostStore
from megatrain_jax.optim.host import HostOptimizer, global_norm_scale
from megatrain_jax.templates import StreamedModel, block_rng
from megatrain_jax.transfer import Transfers

F32 = jnp.float32


class Batch(NamedTuple):
    """One optimizer step's data, all (B, S) numpy arrays."""

    tokens: np.ndarray
    labels: np.ndarray
    loss_mask: np.ndarray | None = None
    segment_ids: np.ndarray | None = None
    positions: np.ndarray | None = None


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    tokens: int  # tokens that count in the loss
    skipped: bool = False
    aux_loss: float | None = None  # the auxiliary term included in ``loss`` (None: the stack has none)


def chunked_cross_entropy(normed: jax.Array, out_matrix: jax.Array, labels: jax.Array,
                          mask: jax.Array, chunk: int, softcap: float | None = None) -> jax.Array:
    """sum(mask * CE(normed @ out_matrix, labels)), computed ``chunk`` tokens at a time.

    normed: (B, S, H); out_matrix: (H, V); labels, mask: (B, S). Peak memory is one chunk of
    logits, forward and backward: the forward keeps only each token's log-sum-exp, and the backward
    recomputes a chunk's logits and forms softmax - onehot directly (a hand-written VJP: XLA's
    autodiff of the gather and logsumexp was 4x slower than the matmuls on an H200).
    ``softcap``: logits are ``softcap * tanh(logits / softcap)`` (Gemma 2's final soft-capping).
    """
    h = normed.shape[-1]
    x, y, m = normed.reshape(-1, h), labels.reshape(-1), mask.reshape(-1).astype(F32)
    n = x.shape[0]
    c = min(chunk, n)
    pad = (-n) % c
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
        y, m = jnp.pad(y, (0, pad)), jnp.pad(m, (0, pad))
    return _ce_sum(x.reshape(-1, c, h), out_matrix, y.reshape(-1, c), m.reshape(-1, c), softcap)


def _capped(logits: jax.Array, softcap: float | None) -> jax.Array:
    return logits if softcap is None else softcap * jnp.tanh(logits / softcap)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ce_sum(xs, w, ys, ms, softcap):
    """Forward only (no gradient asked for): one matmul per chunk."""
    def body(total, inp):
        xc, yc, mc = inp
        logits = _capped(jnp.dot(xc, w, preferred_element_type=F32), softcap)  # (c, V)
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, yc[:, None], axis=-1)[:, 0]
        return total + jnp.sum((lse - picked) * mc), None

    return jax.lax.scan(body, jnp.zeros((), F32), (xs, ys, ms))[0]


def _ce_forward(xs, w, ys, ms, softcap):
    """Value and gradient in one pass over the chunks: each chunk's logits are made once, and its
    share of d(sum)/dx and d(sum)/dw (for a cotangent of 1) is formed from them at once, instead of
    remaking the logits in the backward (three matmuls per chunk instead of four: the loss is always
    differentiated right away, inside the same jitted piece). The backward only scales them."""
    vocab = w.shape[1]

    def body(carry, inp):
        total, dw = carry
        xc, yc, mc = inp
        logits = _capped(jnp.dot(xc, w, preferred_element_type=F32), softcap)  # (c, V)
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, yc[:, None], axis=-1)[:, 0]
        p = jnp.exp(logits - lse[:, None]) - jax.nn.one_hot(yc, vocab, dtype=F32)
        if softcap is not None:  # through cap * tanh(raw / cap): times 1 - tanh^2
            p = p * (1.0 - jnp.square(logits / softcap))
        p = (p * mc[:, None]).astype(xc.dtype)  # d total / d logits
        dx = jnp.dot(p, w.T, preferred_element_type=F32)  # kept in fp32 until the cotangent scales it
        return (total + jnp.sum((lse - picked) * mc), dw + jnp.dot(xc.T, p, preferred_element_type=F32)), dx

    (total, dw), dxs = jax.lax.scan(body, (jnp.zeros((), F32), jnp.zeros(w.shape, F32)), (xs, ys, ms))
    dtypes = (jnp.zeros((), xs.dtype), jnp.zeros((), w.dtype))  # the input dtypes, for the backward's casts
    return total, (dxs, dw, dtypes)


def _ce_backward(softcap, res, g):
    dxs, dw, (x0, w0) = res
    return (dxs * g).astype(x0.dtype), (dw * g).astype(w0.dtype), None, None


_ce_sum.defvjp(_ce_forward, _ce_backward)


class _GradOut:
    """A group's gradient on its way to host memory, in slabs.

    The gradient leaves the device in chunks of at most ``slab`` values; each chunk lands in its own
    pinned buffer, and at most ``GRAD_SLABS`` such buffers exist at once (a semaphore that the
    optimizer releases as it finishes each chunk): the pinned pool stays at a fixed size however
    large the model, and a chunk's transfer overlaps the update of the one before it (MegaTrain's
    gradient slabs). XLA's pinned-host pool is a BFC allocator, so equal-sized chunks reuse the same
    memory step after step.

    GPU->host copies overlap compute only when issued *before* the compute they should hide behind
    (measured on an H200: a ``device_put`` to pinned memory issued before 33 ms of matmuls costs
    nothing extra; issued after them it waits), so the dispatching thread issues each copy at the
    right point of the step. The optimizer thread waits for that, and issues the copies itself if
    nobody has within a short time, so a waiting reader can never deadlock (copies are issued and
    updates applied in one FIFO order, so the slabs a copy waits for are always released next).
    """

    def __init__(self, grad: Any, chunks: list[tuple[int, int]], on_host: bool = False):
        self.grad = grad  # device array (fp32/bf16), or a pinned-host fp32 array when on_host
        self.chunks = chunks
        self.on_host = on_host
        self.host: list[Any] = [None] * len(chunks)
        self.issued = len(chunks) if on_host else 0  # chunks issued so far
        self.failed = False  # its update raised: no more slabs are taken for it, and its slabs are returned
        self._lock = threading.Lock()
        self._events = [threading.Event() for _ in chunks]
        if on_host:  # already in host memory: nothing to issue
            for e in self._events:
                e.set()

    def issue_next(self, engine: "StreamedTrainer", wait: bool = True) -> bool:
        """Issue the next chunk's copy; False (nothing issued) when no slab is free and not ``wait``."""
        j = self.issued
        lo, hi = self.chunks[j]
        if self.on_host or self.failed:
            self.host[j] = None  # read from the held pinned array itself (or nobody will read it)
        else:
            if not wait:
                if not engine._slabs.acquire(blocking=False):
                    return False
            else:
                # a slab frees when the optimizer thread finishes a chunk; if an update has failed, the
                # slabs it would have freed may never come back: surface its error instead of waiting
                while not engine._slabs.acquire(timeout=0.05):
                    if engine._update_error is not None:
                        raise engine._update_error
            g = engine._local_shard(self.grad, j)  # one device's copy of the (replicated) gradient
            piece = g if (len(self.chunks) == 1 and g.dtype == F32) else engine._chunk_fn(g, lo, hi - lo)
            arr = engine.xfer.to_host(piece)
            with self._lock:
                if self.failed:
                    engine._slabs.release()
                else:
                    self.host[j] = arr
        self.issued += 1
        if self.issued == len(self.chunks) and not self.on_host:
            self.grad = None  # the device copy is freed once its transfers are done
        self._events[j].set()
        return True

    def chunk(self, j: int, engine: "StreamedTrainer") -> np.ndarray:
        """Chunk ``j`` as a host numpy array; waits until it has landed."""
        while not self._events[j].wait(timeout=engine.issue_wait_s):
            engine._issue_through(self, j)
        if self.on_host:
            lo, hi = self.chunks[j]
            return engine.xfer.host_view(self.grad)[lo:hi]
        return engine.xfer.host_view(self.host[j])

    def release(self, j: int, engine: "StreamedTrainer") -> None:
        with self._lock:
            if not self.on_host and self.host[j] is not None:
                self.host[j] = None
                engine._slabs.release()

    def fail(self, engine: "StreamedTrainer") -> None:
        """The update raised: give every slab back, so the dispatching thread never waits for one
        that nobody will release (the error then surfaces where the update is waited for)."""
        with self._lock:
            self.failed = True
            for j, arr in enumerate(self.host):
                if arr is not None and not self.on_host:
                    self.host[j] = None
                    engine._slabs.release()


@dataclass
class _DeviceUpdate:
    """A group whose update runs on the device: its master and state in flight (``update_on=device``)."""

    name: str
    param: jax.Array
    grad: jax.Array
    state: dict
    host_state: dict  # the host arrays the new state is written back into
    scalars: tuple
    count: int


class StreamedTrainer:
    """Trains a ``StreamedModel`` whose state lives in a ``HostStore``."""

    GRAD_LOOKAHEAD = 3  # deferred gradient copies run this many blocks ahead of the forward
    GRAD_SLABS = 8  # pinned gradient buffers in flight at once (see _GradOut)

    def __init__(self, parts: StreamedModel, host_opt: HostOptimizer, *, compute_dtype: str = "bfloat16",
                 micro_batches: int = 1, clip_norm: float | None = None, loss_chunk: int = 1024,
                 device: jax.Device | None = None, store: HostStore | None = None,
                 skip_nonfinite: bool = False, offload_activations: bool | None = None,
                 transfer_mode: str = "auto", tracer: Any = None, grad_hold: str = "gpu_fp32",
                 grad_slab_elems: int | None = 32 << 20, grad_slabs: int | None = None, rng_seed: int = 0,
                 devices: list[jax.Device] | None = None, update_on: str = "host", keep_residuals: int = 0):
        """``grad_hold``: where deferred gradients wait for the step's norm (``gpu_fp32``,
        ``gpu_bf16``: rounded to bf16 after the norm is taken, or ``pinned_host``). The streamed
        dtype follows the store: a store without a bf16 copy streams the fp32 master, which each
        jitted piece casts to ``compute_dtype`` on the device (``train.stream_copy=device``).
        ``offload_activations``: boundary activations in pinned host memory (None: decided per
        step from free device memory; the memory plan always decides it).

        ``devices`` (data parallel): every device of the run, in every process (``jax.devices()``
        order); this process drives those it can address. Each receives every block, computes its
        share of each micro-batch (the batch dimension is split over the devices), and each group's
        gradient is summed over all of them by a collective on the devices (``psum`` in a
        ``shard_map`` over a one-axis mesh) before one copy goes to the host, where every process
        applies the same deterministic update to its own replica of the host store.

        ``update_on="device"``: the accelerator applies each group's update (``optim/device_adamw.py``)
        when the next forward fetches the group: its fp32 master and optimizer state cross PCIe
        instead of its gradient, the update runs next to the compute, and the new state goes back
        straight into the host store while the block computes. The host CPU does no optimizer work
        and the host memory sees only DMA traffic. Needs a store without a bf16 copy
        (``train.stream_copy=device`` or fp32 compute), an optimizer with ``device_scalars``
        (the fused AdamW kernels) and one device; updates are always deferred (gradients held).

        ``keep_residuals``: the last N blocks keep their forward's VJP residuals on the device, so the
        backward applies them instead of recomputing those blocks' forward (the memory plan sizes N
        from the GPU room it leaves; one device; never the first block)."""
        if update_on not in ("host", "device"):
            raise ValueError(f"update_on must be host or device, got {update_on!r}")
        if grad_hold not in ("gpu_fp32", "gpu_bf16", "pinned_host"):
            raise ValueError(f"grad_hold must be gpu_fp32, gpu_bf16 or pinned_host, got {grad_hold!r}")
        self.parts, self.opt = parts, host_opt
        self.offload_activations = offload_activations
        self.grad_hold = grad_hold
        self.tracer = tracer  # optional timeline recorder (experiments/trace.py)
        self.skip_nonfinite = skip_nonfinite  # defer every update until the step's loss and norm are known finite
        # called on the host-optimizer thread as ``before_update(name, count)`` just before update ``count``
        # writes group ``name`` in place (a background checkpoint uses it to hold back writes it has not saved)
        self.before_update: Callable[[str, int], None] | None = None
        self.dtype = jnp.dtype(compute_dtype)
        self.micro_batches, self.clip_norm, self.loss_chunk = micro_batches, clip_norm, loss_chunk
        devices = list(devices) if devices else [device or jax.local_devices()[0]]
        self.local_devices = [d for d in devices if d.process_index == jax.process_index()]
        if not self.local_devices:
            raise ValueError("none of the given devices belongs to this process")
        self.device = self.local_devices[0]
        self.num_devices = len(devices)
        self.mesh = Mesh(np.array(devices), ("data",))
        self.rng_seed, self._rng_step = rng_seed, 0  # blocks that take a key (dropout): see templates.block_rng
        bf16 = self.dtype == jnp.bfloat16
        self.store = store or HostStore.from_trees(parts.host_trees(), bf16_stream=bf16)
        self.update_on = update_on
        if update_on == "device":
            if not hasattr(host_opt, "device_scalars"):
                raise ValueError("update_on=device needs the fused AdamW optimizer (optim.kernel=fused)")
            if any(g.stream_bits is not None for g in self.store):
                raise ValueError("update_on=device needs a store without a bf16 streaming copy "
                                 "(train.stream_copy=device, or float32 compute)")
            if len(devices) > 1:
                raise ValueError("update_on=device runs on one device; data parallel updates on the host")
        self.xfer = Transfers(self.local_devices, transfer_mode, mesh=self.mesh)
        # how long the optimizer thread waits for the dispatching thread to issue a gradient copy
        # before issuing it itself: on a GPU a copy issued late queues behind the compute already
        # dispatched, so the dispatcher should issue it; the CPU backend has no such queue
        self.issue_wait_s = 0.2 if self.xfer.on_gpu else 0.02
        for g in self.store:
            if g.opt_state is None:
                g.opt_state = host_opt.init_state(g.master, g.layout.unflatten)
            self.xfer.register(g.name, g.stream_view())
            if update_on == "device":  # the optimizer state crosses PCIe too, both ways
                for k, a in host_opt.state_to_arrays(g.opt_state).items():
                    self.xfer.register(f"{g.name}/{k}", a)
        self.last_step_info: dict[str, Any] = {}
        self.num_layers = self.store.num_blocks
        if keep_residuals and len(devices) > 1:
            raise ValueError("keep_residuals runs on one device")
        self.keep_residuals = max(0, min(int(keep_residuals), self.num_layers - 1))
        self.count = 0  # optimizer steps taken
        self._pending: dict[str, Future] = {}
        self._wait_s = 0.0  # time the dispatching thread spent waiting for host updates
        self._copy_queue: list[tuple[str, _GradOut]] = []  # deferred gradients not yet sent to the host
        self._order_index = {n: i for i, n in enumerate(self._forward_order())}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-optim")
        # update_on=device: (gradient, clip scale, count) per group until its next fetch, and the
        # thread that writes updated state back into the host store
        self._dev_updates: dict[str, tuple[Any, float, int]] = {}
        self._resident: dict[str, jax.Array] = {}  # current weights already on the device (see step)
        self._dev_done: dict[str, Future] = {}  # per group: its queued device-side update is in the store
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="d2h-writeback") \
            if update_on == "device" else None
        self._update_error: BaseException | None = None  # the first host update that raised
        # gradient slabs: chunk size (aligned as the optimizer's state needs) and the pool's size
        align = getattr(host_opt, "chunk_align", None)
        self._slab = None if (grad_slab_elems is None or align is None) else max(align, grad_slab_elems // align * align)
        self._slabs = threading.Semaphore(grad_slabs or self.GRAD_SLABS)
        self._copy_lock = threading.RLock()
        self._build_kernels()

    # ------------------------------------------------------------------------------ the step

    def step(self, batch: Batch) -> StepResult:
        L, M = self.num_layers, self.micro_batches
        self._rng_step = self.count  # dropout keys: (updates done before this step, layer, micro-batch)
        mbs = self._micro_batches(batch)
        n_tokens = int(sum(mb["mask_sum"] for mb in mbs))
        inv = jnp.asarray(1.0 / max(n_tokens, 1), F32)

        # ---- forward sweep: block i+1's weights are in flight before block i is dispatched
        # a device-side update is dispatched (``_ready``) before the next transfer is issued: measured
        # on an H100 (experiments/probe_device_update.py), an update dispatched after the next layer's
        # transfer waits for that transfer too (89 ms per 14B layer instead of 60)
        emb_w, head_w = self._ready(self._fetch("embed")), None  # the head is fetched once its update is done
        nxt = self._fetch("block_0")
        hs = [self._embed_fwd(emb_w, mb["tokens"]) for mb in mbs]
        offload = self._decide_offload(sum(h.nbytes for h in hs) * L)
        keep = (lambda hs: [self.xfer.offload(h) for h in hs]) if offload else (lambda hs: hs)
        bring = (lambda hs: [self.xfer.reload(h) for h in hs]) if offload else (lambda hs: hs)
        saved: list[list[jax.Array] | None] = []
        stack, stats = self.parts.blocks, None  # stats: the auxiliary loss's running sums (per device)
        # the last blocks whose forward keeps its VJP residuals (layers that emit statistics excepted)
        kept: dict[int, list] = {i: [] for i in range(L - self.keep_residuals, L) if not stack.emits_stats(i)}
        for i in range(L):
            w, nxt, name = nxt, None, f"block_{i + 1}"
            w = self._ready(w)  # a device-side update runs here: after block i-1, before block i
            if i + 1 < L and self._update_done(name):
                nxt = self._fetch(name)  # in flight before block i is dispatched
            # the head: in flight while the last blocks compute (device-side updates: during the last
            # only, so that block L-1's update does not wait for it)
            if head_w is None and i >= L - (1 if self.update_on == "device" else 2) and self._update_done("head"):
                head_w = self._fetch("head")
            saved.append(keep(hs))  # block i's input: the boundary checkpoint
            outs = []
            for m, (h, mb) in enumerate(zip(hs, mbs)):
                # before each micro-batch's compute: copies issued here overlap it, and the host
                # optimizer gets slabs back to work on several times per block
                self._issue_grad_copies(through=f"block_{i + self.GRAD_LOOKAHEAD}", wait=False)
                if i in kept:  # its residuals stay: the backward will not recompute this block
                    h, res = self._vjp_kernels(i, mb["aux"])[0](w, h, mb["aux"], self._rng(i, m))
                    kept[i].append(res)
                    outs.append(h)
                elif stack.emits_stats(i):
                    if stats is None:
                        stats = self._stats_zeros(i, w, h, mb["aux"], self._rng(i, m))
                    h, stats = self._block_fwd(i, w, h, mb["aux"], self._rng(i, m), stats)
                    outs.append(h)
                else:
                    outs.append(self._block_fwd(i, w, h, mb["aux"], self._rng(i, m)))
            hs = outs
            self._trace("compute", f"fwd {i}", hs[-1])
            if i + 1 < L and nxt is None:
                # its host update is still running: rather than hold block i back behind it,
                # dispatch block i first and fetch when the update is done
                nxt = self._fetch(name)
        last_w = w if isinstance(w, jax.Array) and self.update_on == "device" else None  # just updated: reused
        del w
        if head_w is None:
            head_w = self._fetch("head")
        head_w = self._ready(head_w)
        # the auxiliary loss of the whole step and its gradient w.r.t. the summed statistics
        aux_val, stats_ct = self._aux_total(stats) if stats is not None else (None, None)

        # ---- loss and head backward (the last block and its inputs are already in flight)
        nxt = last_w if last_w is not None else self._fetch(f"block_{L - 1}")
        acts_nxt, last_w = bring(saved[L - 1]), None
        g_head, g_emb = self._zeros("head"), self._zeros("embed")
        losses, dhs = [], []
        for h, mb in zip(hs, mbs):
            loss, dh, g_head, g_emb = self._head_loss(head_w, emb_w, h, mb["labels"], mb["mask"], inv,
                                                      g_head, g_emb)
            losses.append(loss)
            dhs.append(dh)
        self._trace("compute", "loss", losses[-1])
        if aux_val is not None:
            losses.append(aux_val)
        grads, sq = {}, {}
        self._grad_ready("head", g_head, grads, sq)

        # ---- backward sweep: recompute each block from its saved input, VJP, gradient out
        for i in reversed(range(L)):
            w, nxt = nxt, self._fetch(f"block_{i - 1}") if i > 0 else None
            acts, acts_nxt = acts_nxt, bring(saved[i - 1]) if i > 0 else None
            g = self._zeros(f"block_{i}")
            if i in kept:
                res, kept[i] = kept[i], []
                bwd_vjp = self._vjp_kernels(i, mbs[0]["aux"])[1]
                for m in range(M):
                    dhs[m], g = bwd_vjp(w, acts[m], res[m], dhs[m], g)
                    res[m] = None  # its residuals are freed as soon as they are used
            for m in range(M if i not in kept else 0):
                dhs[m], g = self._block_bwd(i, w, acts[m], mbs[m]["aux"], self._rng(i, m), dhs[m], g,
                                            stats_ct if stack.emits_stats(i) else None)
            saved[i] = acts = None  # free this block's boundary activations
            self._grad_ready(f"block_{i}", g, grads, sq)
            self._trace("compute", f"bwd {i}", sq[f"block_{i}"])  # (g itself may be donated later)
        for m in range(M):
            g_emb = self._embed_bwd(emb_w, mbs[m]["tokens"], dhs[m], g_emb)
        self._grad_ready("embed", g_emb, grads, sq)

        # ---- norm, clipping and the deferred updates (queued in the order the forward needs them)
        loss, sq_total = (float(np.asarray(self._local_shard(x))) for x in self._totals(losses, list(sq.values())))
        grad_norm = float(np.sqrt(sq_total))
        aux = None if aux_val is None else float(np.asarray(self._local_shard(aux_val)))
        self.last_step_info = {"offload_activations": offload, "transfer_mode": self.xfer.mode}
        if self._deferred:
            if not (np.isfinite(loss) and np.isfinite(grad_norm)):
                return StepResult(loss, grad_norm, n_tokens, skipped=True, aux_loss=aux)
            scale = global_norm_scale(grad_norm ** 2, self.clip_norm)
            self.count += 1
            if self.update_on == "device":  # applied on the device when the next forward fetches each group
                for name in self._forward_order():
                    self._dev_updates[name] = (grads.pop(name), scale, self.count)
                    self._dev_done[name] = Future()  # set once this update is back in the host store
                # the current weights of the groups needed first and last are on the device already:
                # their updates start from these instead of crossing PCIe again (the step's first
                # transfers are exposed: nothing computes before the embedding and block 0)
                self._resident = {"embed": emb_w, "head": head_w, "block_0": w}
                return StepResult(loss, grad_norm, n_tokens, aux_loss=aux)
            for name in self._forward_order():  # queued now; copies issued during the next forward
                out = self._grad_out(name, grads.pop(name))
                if not out.on_host:
                    self._copy_queue.append((name, out))
                self._submit_update(name, out, scale)
            self._issue_grad_copies(through=f"block_{self.GRAD_LOOKAHEAD - 1}", wait=False)
        return StepResult(loss, grad_norm, n_tokens, aux_loss=aux)

    # ------------------------------------------------------------------------------ machinery

    @property
    def _deferred(self) -> bool:
        """Updates wait for the whole gradient when it must be clipped or checked for NaN first.

        Deferred gradients stay in device memory until the norm is known, then go to the host in
        forward order, so their transfers and updates overlap the next step's forward.
        """
        return self.clip_norm is not None or self.skip_nonfinite or self.update_on == "device"

    def _forward_order(self) -> list[str]:
        """The order the next forward needs the groups in (deferred updates run in this order)."""
        return ["embed"] + [f"block_{i}" for i in range(self.num_layers)] + ["head"]

    def _fetch(self, name: str) -> jax.Array:
        """Start the transfer of a group's streaming copy, once its pending update is done.

        The host buffer must not be written while a transfer reads it, and must not be read
        before its update has written it: the wait here is the only synchronisation needed.
        """
        fut = self._pending.pop(name, None)
        if fut is not None:
            self._issue_grad_copies(through=name)
            t0 = time.perf_counter()
            fut.result()
            self._wait_s += time.perf_counter() - t0
        pend = self._dev_updates.pop(name, None)
        if pend is not None:
            return self._start_device_update(name, *pend)
        w = self.xfer.to_device(name, self.store[name].stream_view())
        self._trace("h2d", name, w)
        return w

    def _start_device_update(self, name: str, grad: Any, scale: float, count: int) -> "_DeviceUpdate":
        """Put the group's fp32 master and optimizer state in flight to the device; the update itself
        is dispatched by ``_ready`` when the weights are first used (dispatched now it would run
        before the block being computed, and hold it back until this transfer lands)."""
        g = self.store[name]
        host_state = self.opt.state_to_arrays(g.opt_state)
        p = self._resident.pop(name, None)
        if p is None:
            p = self.xfer.to_device(name, g.master)
            self._trace("h2d", name, p)
        state = {k: self.xfer.to_device(f"{name}/{k}", a) for k, a in host_state.items()}
        if self.grad_hold == "pinned_host":
            grad = jax.device_put(grad, self.xfer.device_sharding)
        return _DeviceUpdate(name, p, grad, state, host_state, self.opt.device_scalars(count, scale), count)

    def _ready(self, w: Any) -> jax.Array:
        """Fetched weights, usable by a jitted piece: a pending device-side update is dispatched
        (and its write-back into the host store queued) here."""
        if not isinstance(w, _DeviceUpdate):
            return w
        from megatrain_jax.optim.device_adamw import device_adamw_step

        p_new, state = device_adamw_step(self.opt.moments, w.param, w.grad, w.state, w.scalars)
        self._trace("compute", f"update {w.name}", p_new)  # runs on the compute stream
        g = self.store[w.name]
        targets = [(w.name, p_new, g.master)] + [(f"{w.name}/{k}", state[k], w.host_state[k]) for k in w.host_state]
        self._pending[w.name] = self._writer.submit(self._write_back, w.name, w.count, targets,
                                                    self._dev_done.pop(w.name, None))
        return p_new

    def pending_updates(self) -> dict[str, Future]:
        """Per group, a future that completes once the update queued last is in the host store (a
        background checkpoint waits for these): host updates in flight, and device-side updates not
        yet applied (they are applied when the next forward fetches the group)."""
        return {**self._pending, **self._dev_done}

    def _write_back(self, name: str, count: int, targets: list[tuple[str, jax.Array, np.ndarray]],
                    done: Future | None) -> None:
        """On the write-back thread: the updated master and state into the host store, in place;
        then ``done`` (the future a background checkpoint may wait on) completes."""
        try:
            self._write_targets(name, count, targets)
        except BaseException as e:
            if done is not None:
                done.set_exception(e)
            raise
        if done is not None:
            done.set_result(None)

    def _write_targets(self, name: str, count: int, targets: list[tuple[str, jax.Array, np.ndarray]]) -> None:
        if self.before_update is not None:
            self.before_update(name, count)
        t0 = time.perf_counter()
        for buf_name, x, dst in targets:
            self.xfer.copy_into(x, dst)
            self.xfer.host_written(buf_name, dst)
        if self.tracer is not None:
            self.tracer.interval("d2h", f"{name} state", t0, time.perf_counter())

    def _update_done(self, name: str) -> bool:
        fut = self._pending.get(name)
        return fut is None or fut.done()

    def _grad_ready(self, name: str, grad: jax.Array, grads: dict, sq: dict) -> None:
        """A group's gradient is complete on the device: summed over the devices, then kept
        (deferred) or sent to be applied."""
        if self._reduce is not None:
            grad = self._reduce(grad)  # one collective per group; every device holds the sum
        sq[name] = self._sqnorm(grad)
        if self._deferred:
            if self.grad_hold == "gpu_bf16":
                grad = self._to_bf16(grad)  # the norm above was taken in fp32
            elif self.grad_hold == "pinned_host":
                grad = self.xfer.to_host(self._local_shard(grad))  # issued before the next block's backward: they overlap
                self._trace("d2h", name, grad)
            grads[name] = grad
            return
        if name == "head":  # first gradient of the step: the step counts from here
            self.count += 1
        out = self._grad_out(name, grad)
        with self._copy_lock:
            self._copy_queue.append((name, out))
        self._submit_update(name, out, 1.0)  # first: its progress frees the slabs the copies below wait for
        self._issue_grad_copies(through=name, wait=False)  # before the next block's backward: they overlap

    def _grad_out(self, name: str, grad: Any) -> _GradOut:
        n = self.store[name].size
        step = self._slab or n
        chunks = [(lo, min(lo + step, n)) for lo in range(0, n, step)] or [(0, 0)]
        return _GradOut(grad, chunks, on_host=self._deferred and self.grad_hold == "pinned_host")

    def _issue_grad_copies(self, through: str, wait: bool = True) -> None:
        """Issue the queued gradient copies, chunk by chunk in forward order, up to group ``through``.

        ``wait=False`` (the sweeps, before dispatching compute): issue only as many chunks as there
        are free slabs and leave the rest queued, so the accelerator's queue never runs dry while
        the dispatching thread waits for the host optimizer; the next call, or the optimizer thread
        itself, issues the rest. ``wait=True`` (about to wait for an update anyway): all of them.
        """
        order = self._order_index
        limit = order.get(through, len(order))
        with self._copy_lock:
            while self._copy_queue and order[self._copy_queue[0][0]] <= limit:
                name, out = self._copy_queue[0]
                while out.issued < len(out.chunks):
                    if not out.issue_next(self, wait):
                        return
                    self._trace("d2h", name, out.host[out.issued - 1])
                self._copy_queue.pop(0)

    def _issue_through(self, out: _GradOut, j: int) -> None:
        """The optimizer thread needs chunk ``j`` of ``out`` and nobody has issued it: issue the
        queue in order up to it (FIFO order keeps the slab pool deadlock-free).

        Never blocks on the copy lock: whoever holds it is issuing the same queue in the same
        order, and may be waiting for a slab that only this thread can free (a chunk it already
        issued past ``j``); the caller waits for chunk ``j``'s event and tries again.
        """
        if not self._copy_lock.acquire(blocking=False):
            return
        try:
            while out.issued <= j and self._copy_queue:
                head = self._copy_queue[0][1]
                head.issue_next(self)
                if head.issued == len(head.chunks):
                    self._copy_queue.pop(0)
        finally:
            self._copy_lock.release()

    def _submit_update(self, name: str, out: _GradOut, scale: float) -> None:
        self._pending[name] = self._pool.submit(self._update, name, out, scale, self.count)

    def _update(self, name: str, out: _GradOut, scale: float, count: int) -> None:
        """Runs on the host optimizer thread: updates the group in place, slab by slab, each as
        soon as it has landed (zero-copy views of the pinned buffers)."""
        try:
            self._update_slabs(name, out, scale, count)
        except BaseException as e:
            out.fail(self)
            self._update_error = e
            raise

    def _update_slabs(self, name: str, out: _GradOut, scale: float, count: int) -> None:
        g = self.store[name]
        t0 = None
        whole = len(out.chunks) == 1
        for j, (lo, hi) in enumerate(out.chunks):
            host_grad = out.chunk(j, self)  # waits until it has landed
            if j == 0:
                if self.before_update is not None:
                    self.before_update(name, count)
                t0 = time.perf_counter()
            if whole:
                self.opt.update(g.master, host_grad, g.opt_state, count, scale, g.stream_bits, g.layout.unflatten)
            else:
                bits = None if g.stream_bits is None else g.stream_bits[lo:hi]
                self.opt.update(g.master[lo:hi], host_grad, self.opt.state_slice(g.opt_state, lo, hi), count, scale,
                                bits)
            out.release(j, self)
        self.xfer.host_written(name, g.stream_view())
        if self.tracer is not None and t0 is not None:
            self.tracer.interval("optimizer", name, t0, time.perf_counter())

    def _trace(self, lane: str, label: str, arr: Any) -> None:
        if self.tracer is not None:
            self.tracer.watch(lane, label, arr)

    def _decide_offload(self, activation_bytes: int) -> bool:
        """Boundary activations stay on the device unless they would crowd the working set."""
        if self.offload_activations is not None:
            return bool(self.offload_activations and self.xfer.host_sharding is not None)
        if not self.xfer.on_gpu:
            return False
        stats = self.device.memory_stats() or {}
        free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
        return activation_bytes > 0.5 * free  # the other half: recompute, VJP, logits chunks, grads

    def finish(self) -> None:
        """Wait for every queued update (before reading, saving or exporting the weights).

        Deferred gradient copies are issued a few groups ahead of the update being waited for,
        never all at once: pinned host memory for a whole model's gradients may not exist.
        """
        order = self._forward_order()
        for name in order:  # device-side updates not yet applied: apply them now (in forward order)
            if name in self._dev_updates:
                self._ready(self._fetch(name))
        for i, name in enumerate(order):
            self._issue_grad_copies(through=order[min(i + self.GRAD_LOOKAHEAD, len(order) - 1)])
            fut = self._pending.pop(name, None)
            if fut is not None:
                fut.result()
        for name in list(self._pending):
            self._pending.pop(name).result()

    def close(self) -> None:
        self.finish()
        self._pool.shutdown()
        if self._writer is not None:
            self._writer.shutdown()
        self.xfer.close()

    def _zeros(self, name: str) -> jax.Array:
        return self._zeros_fn(self.store[name].size)

    def _micro_batches(self, batch: Batch) -> list[dict[str, Any]]:
        """The step's micro-batches as device arrays, each split over the devices by sequence."""
        b, s = batch.tokens.shape
        m, n = self.micro_batches, self.num_devices
        if b % m:
            raise ValueError(f"batch of {b} sequences does not split into {m} micro-batches")
        if (b // m) % n:
            raise ValueError(f"micro-batches of {b // m} sequences do not split over {n} devices "
                             f"(batch_size must be a multiple of micro_batches x devices = {m * n})")
        mask = batch.loss_mask if batch.loss_mask is not None else np.ones((b, s), np.float32)
        pos = batch.positions if batch.positions is not None else np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
        sharding = self._batch_sharding

        def put(x, dtype):
            x = np.ascontiguousarray(x, dtype)
            return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

        out = []
        for part in range(m):
            sl = slice(part * b // m, (part + 1) * b // m)
            seg = None if batch.segment_ids is None else put(batch.segment_ids[sl], np.int32)
            tokens, positions = put(batch.tokens[sl], np.int32), put(pos[sl], np.int32)
            out.append({
                # the embedding's input: tokens, or (tokens, positions) for learned position embeddings
                "tokens": (tokens, positions) if self.parts.embed_takes_positions else tokens,
                "labels": put(batch.labels[sl], np.int32),
                "mask": put(mask[sl], np.float32),
                "mask_sum": float(np.asarray(mask[sl], np.float64).sum()),
                "aux": self._aux_of(positions, seg),
            })
        return out

    def _local_shard(self, x: jax.Array, j: int = 0) -> jax.Array:
        """One local device's copy of a replicated array (chunk ``j`` of a gradient leaves through
        local device ``j mod n``: each device's own link carries a share)."""
        shards = x.addressable_shards
        if len(shards) == 1:
            return shards[0].data
        return shards[j % len(shards)].data

    def _aux_of(self, positions: jax.Array, segment_ids: jax.Array | None) -> Any:
        """``aux_fn`` on each device's share of the micro-batch. Leaves that carry the batch
        dimension stay split over the devices; any other leaf is replicated."""
        key = (positions.shape, segment_ids is None)
        fn = self._aux_cache.get(key)
        if fn is None:
            local = jax.ShapeDtypeStruct((positions.shape[0] // self.num_devices,) + positions.shape[1:], jnp.int32)
            shapes = jax.eval_shape(self.parts.aux_fn, local, None if segment_ids is None else local)
            specs = jax.tree_util.tree_map(
                lambda a: P("data") if (a.ndim >= 1 and a.shape[0] == local.shape[0]) else P(), shapes)
            self._aux_specs[key[0][0]] = specs
            in_specs = (P("data"), None if segment_ids is None else P("data"))
            fn = jax.jit(self._smap(self.parts.aux_fn, in_specs, specs))
            self._aux_cache[key] = fn
        return fn(positions, segment_ids)

    def _smap(self, f: Callable, in_specs: Any, out_specs: Any) -> Callable:
        return jax.shard_map(f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def _build_kernels(self) -> None:
        """Jit the step's pieces. Every block of a kind shares one ``_block_fwd`` / ``_block_bwd``
        executable (one kind for a stack of identical blocks).

        Each piece is the single-device computation inside a ``shard_map`` over the devices'
        one-axis mesh: weights replicated, activations and data split by sequence, and the
        accumulated weight gradients per device (a ``(devices x size,)`` array, each device's
        share its own partial sum) until ``_reduce`` sums them with one collective per group. On
        one device the map is the identity and ``_reduce`` is skipped.
        """
        p, dt, chunk = self.parts, self.dtype, self.loss_chunk
        lay_e, lay_h = self.store["embed"].layout, self.store["head"].layout
        tied, cap = p.tied, p.logit_softcap
        stack = p.blocks
        aux_loss = stack.aux_loss
        rep, dat = P(), P("data")
        multi = self.num_devices > 1

        # weights arrive as the host streams them: bf16, or the fp32 master cast here, on the device
        def embed_fwd(w, tokens):
            return p.embed_fn(lay_e.unflatten(w.astype(dt)), tokens).astype(dt)

        def block_fns(template, lay, emits_stats):
            def block_fwd(w, h, aux, rng):
                if stack.takes_rng:
                    if multi:  # each device's sequences get their own masks
                        rng = jax.random.fold_in(rng, jax.lax.axis_index("data"))
                    return template(lay.unflatten(w.astype(dt)), h, aux, rng)
                return template(lay.unflatten(w.astype(dt)), h, aux)

            def block_bwd(w, h, aux, rng, dh, g):
                _, vjp = jax.vjp(lambda w_, h_: block_fwd(w_, h_, aux, rng), w, h)
                dw, dh_in = vjp(dh)
                return dh_in, g + dw.astype(F32)

            self._block_raw[template] = block_fwd
            if not emits_stats:
                return block_fwd, block_bwd

            # a block that also returns statistics: (hidden, stats), the stats in fp32
            def fwd_stats(w, h, aux, rng):
                out, stats = block_fwd(w, h, aux, rng)
                return out, jax.tree_util.tree_map(lambda x: x.astype(F32), stats)

            def block_fwd_acc(w, h, aux, rng, acc):  # acc: this device's running sums, leaves (1, ...)
                out, stats = fwd_stats(w, h, aux, rng)
                return out, jax.tree_util.tree_map(lambda a, x: a + x[None], acc, stats)

            def block_bwd_ct(w, h, aux, rng, dh, g, ct):  # ct: d aux_loss / d (summed stats)
                _, vjp = jax.vjp(lambda w_, h_: fwd_stats(w_, h_, aux, rng), w, h)
                dw, dh_in = vjp((dh, ct))
                return dh_in, g + dw.astype(F32)

            def stats_only(w, h, aux, rng):  # for the accumulator's shapes (eval_shape only)
                return jax.tree_util.tree_map(lambda x: x[None], fwd_stats(w, h, aux, rng)[1])

            return block_fwd_acc, block_bwd_ct, stats_only

        def head_loss(wh, we, h, labels, mask, inv, gh, ge):
            def f(wh, we, h):
                normed, out = p.head_fn(lay_h.unflatten(wh.astype(dt)), h,
                                        lay_e.unflatten(we.astype(dt)) if tied else None)
                return chunked_cross_entropy(normed, out, labels, mask, chunk, cap) * inv

            loss, (dwh, dwe, dh) = jax.value_and_grad(f, argnums=(0, 1, 2))(wh, we, h)
            if tied:
                ge = ge + dwe.astype(F32)
            if multi:
                loss = jax.lax.psum(loss, "data")
            return loss, dh, gh + dwh.astype(F32), ge

        def embed_bwd(we, tokens, dh, ge):
            _, vjp = jax.vjp(lambda w: embed_fwd(w, tokens), we)
            (dw,) = vjp(dh)
            return ge + dw.astype(F32)

        smap = self._smap
        self._block_raw: dict[Any, Callable] = {}  # per template: its plain forward (for the kept-residual path)
        self._vjp_jits: dict[Any, tuple] = {}
        self._embed_fwd = jax.jit(smap(embed_fwd, (rep, dat), dat))
        self._block_fns = {k: block_fns(stack.templates[k], self.store[f"block_{stack.kinds.index(k)}"].layout,
                                        aux_loss is not None and k in aux_loss.kinds)
                           for k in dict.fromkeys(stack.kinds)}
        self._block_jits: dict[Any, tuple] = {}  # (forward, backward[, statistics shapes]) per kind and aux layout
        self._aux_cache: dict[Any, Callable] = {}
        self._aux_specs: dict[Any, Any] = {}
        self._head_loss = jax.jit(smap(head_loss, (rep, rep, dat, dat, dat, rep, dat, dat), (rep, dat, dat, dat)),
                                  donate_argnums=(6, 7))
        self._embed_bwd = jax.jit(smap(embed_bwd, (rep, dat, dat, dat), dat), donate_argnums=(3,))
        self._reduce = jax.jit(smap(lambda g: jax.lax.psum(g, "data"), (dat,), rep)) if multi else None
        if aux_loss is not None:
            def aux_total(acc):  # the step's summed statistics -> (aux loss, its gradient w.r.t. them)
                total = jax.tree_util.tree_map(lambda a: a[0], acc)
                if multi:
                    total = jax.lax.psum(total, "data")
                return jax.value_and_grad(aux_loss.fn)(total)

            self._aux_total = jax.jit(smap(aux_total, (dat,), (rep, rep)))
            self._stats_zero_fn: Callable | None = None
        self._sqnorm = jax.jit(lambda g: jnp.sum(jnp.square(g)))
        self._to_bf16 = jax.jit(lambda g: g.astype(jnp.bfloat16))
        self._chunk_fn = jax.jit(lambda g, lo, n: jax.lax.dynamic_slice_in_dim(g, lo, n).astype(F32),
                                 static_argnums=2)
        self._totals = jax.jit(lambda losses, sqs: (sum(losses), sum(sqs)))  # one fetch per step
        # committed to the devices like every other operand, so the first micro-batch's call
        # (fresh zeros) and later ones (accumulated outputs) share one executable
        self._batch_sharding = NamedSharding(self.mesh, dat)
        n_dev = self.num_devices
        self._zeros_fn = jax.jit(lambda n: jnp.zeros((n * n_dev,), F32), static_argnums=0,
                                 out_shardings=self._batch_sharding)
        on_device = NamedSharding(self.mesh, rep)
        self._rng_fn = jax.jit(block_rng, out_shardings=on_device) if stack.takes_rng else None

    def _block_kernels(self, i: int, aux: Any) -> tuple[Callable, Callable]:
        """Layer ``i``'s (forward, backward) executables, for ``aux`` laid out as it is."""
        kind = self.parts.blocks.kinds[i]
        specs = jax.tree_util.tree_map(lambda a: a.sharding.spec, aux)
        key = (kind, jax.tree_util.tree_structure(aux), tuple(jax.tree_util.tree_leaves(
            specs, is_leaf=lambda x: isinstance(x, P))))
        fns = self._block_jits.get(key)
        if fns is None:
            rep, dat = P(), P("data")
            if len(self._block_fns[kind]) == 2:
                fwd, bwd = self._block_fns[kind]
                fns = (jax.jit(self._smap(fwd, (rep, dat, specs, rep), dat)),
                       jax.jit(self._smap(bwd, (rep, dat, specs, rep, dat, dat), (dat, dat)), donate_argnums=(4, 5)))
            else:  # emits statistics: the forward adds them to the accumulator, the backward takes their cotangent
                fwd, bwd, stats_only = self._block_fns[kind]
                fns = (jax.jit(self._smap(fwd, (rep, dat, specs, rep, dat), (dat, dat)), donate_argnums=(4,)),
                       jax.jit(self._smap(bwd, (rep, dat, specs, rep, dat, dat, rep), (dat, dat)),
                               donate_argnums=(4, 5)),
                       self._smap(stats_only, (rep, dat, specs, rep), dat))
            self._block_jits[key] = fns
        return fns

    def _vjp_kernels(self, i: int, aux: Any) -> tuple[Callable, Callable]:
        """Layer ``i``'s forward that also returns its VJP (the residuals, kept on the device) and
        the backward that applies it: no recompute. One device only (``keep_residuals``)."""
        stack = self.parts.blocks
        kind = stack.kinds[i]
        key = (kind, jax.tree_util.tree_structure(aux))
        fns = self._vjp_jits.get(key)
        if fns is None:
            fwd = self._block_raw[stack.templates[kind]]

            # matmul outputs are kept; the elementwise rest (norms, activations, rotary, casts) and the
            # attention's own computation are recomputed from them in the backward, a small part of the
            # block's forward, for residuals of a few activations per token
            keep = jax.checkpoint_policies.dots_with_no_batch_dims_saveable

            # the residuals leave out the block's weights and its input: the weights would be one copy per
            # micro-batch as the jit's outputs (Qwen3-8B on the H100: 4 x 0.77 GB of each kept block's
            # 8.2 GB), and the input is the boundary activation the step keeps anyway; the backward gets
            # both again as arguments and puts them back where the VJP expects them
            layout: dict[tuple, tuple] = {}  # per input shape: the VJP's tree and which leaves are w / h

            def fwd_vjp(w, h, aux, rng):
                out, f = jax.vjp(jax.checkpoint(lambda w_, h_: fwd(w_, h_, aux, rng), policy=keep), w, h)
                leaves, tree = jax.tree_util.tree_flatten(f)
                slots = tuple("w" if x is w else "h" if x is h else None for x in leaves)
                layout[h.shape, str(h.dtype)] = (tree, slots)
                return out, [x for x, s in zip(leaves, slots) if s is None]

            def bwd_vjp(w, h, res, dh, g):
                tree, slots = layout[h.shape, str(h.dtype)]
                rest = iter(res)
                f = jax.tree_util.tree_unflatten(tree, [w if s == "w" else h if s == "h" else next(rest)
                                                        for s in slots])
                dw, dh_in = f(dh)
                return dh_in, g + dw.astype(F32)

            out = self._batch_sharding
            fns = (jax.jit(fwd_vjp), jax.jit(bwd_vjp, donate_argnums=(3, 4), out_shardings=(out, None)))
            self._vjp_jits[key] = fns
        return fns

    def residual_bytes(self, h: Any, aux: Any) -> int:
        """Bytes of the VJP residuals the last block keeps for one micro-batch of hidden states
        shaped like ``h`` (abstract evaluation: nothing runs)."""
        L = self.num_layers
        v = self.store[f"block_{L - 1}"].stream_view()
        w = jax.ShapeDtypeStruct(v.shape, v.dtype)
        h = jax.ShapeDtypeStruct(h.shape, self.dtype)
        _, vjp = jax.eval_shape(self._vjp_kernels(L - 1, aux)[0], w, h, aux, self._rng(L - 1, 0))
        return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(vjp)))

    def _block_fwd(self, i: int, w, h, aux, rng, stats=None):
        """Layer ``i``'s output; ``(output, stats + its statistics)`` for a layer that emits them."""
        if stats is None:
            return self._block_kernels(i, aux)[0](w, h, aux, rng)
        return self._block_kernels(i, aux)[0](w, h, aux, rng, stats)

    def _block_bwd(self, i: int, w, h, aux, rng, dh, g, stats_ct=None):
        if stats_ct is None:
            return self._block_kernels(i, aux)[1](w, h, aux, rng, dh, g)
        return self._block_kernels(i, aux)[1](w, h, aux, rng, dh, g, stats_ct)

    def _stats_zeros(self, i: int, w, h, aux, rng) -> Any:
        """Zero accumulators for the auxiliary loss's statistics: one per device (leading axis)."""
        if self._stats_zero_fn is None:
            shapes = jax.eval_shape(self._block_kernels(i, aux)[2], w, h, aux, rng)
            self._stats_zero_fn = jax.jit(
                lambda: jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, F32), shapes),
                out_shardings=self._batch_sharding)
        return self._stats_zero_fn()

    def _rng(self, layer: int, micro: int) -> jax.Array | None:
        """The dropout key of (this step, layer, micro-batch); None for blocks without randomness."""
        if self._rng_fn is None:
            return None
        return self._rng_fn(self.rng_seed, self._rng_step, layer, micro)

    # ------------------------------------------------------------------------------ views

    def params_tree(self) -> dict[str, Any]:
        """fp32 master weights as the full model's pure-dict tree (views into the host store)."""
        self.finish()
        return {
            "embed": self.store["embed"].tree(),
            "layers": {i: self.store[f"block_{i}"].tree() for i in range(self.num_layers)},
            "head": self.store["head"].tree(),
        }
