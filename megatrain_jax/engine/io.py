"""The embedding and the LM head at both ends of the step: resident, or streamed (``stream_io``).

``ResidentIO`` (the default) takes both groups whole for the step: the fp32 master crosses PCIe
once, is cast on the device, and fp32 gradient accumulators of both sizes live there.

``StreamIO`` (``EngineOptions.stream_io``) keeps neither on the GPU, for a vocabulary too large for
a small card:

- ``EmbedRows``: the host gathers only the rows the step's tokens use (plus the group's other, small
  leaves) into one (U, H) block; the embedding runs on ids remapped into it. Its (U, H) gradient goes
  to the host and is scattered into the group's dense gradient there (AdamW decays every row).
- ``HeadStream``: the output matrix streams from the host store in vocabulary chunks, twice. Pass 1
  keeps, per token, a running max, sum of exponentials and the label's logit (online log-sum-exp);
  pass 2 (chunks in reverse: the last one is still on the device) forms softmax - onehot per (token
  chunk x vocab chunk) tile, accumulates d normed in fp32, and sends each vocabulary chunk's weight
  gradient to the host at once. The final norm's small weights stay resident; its VJP runs last.
- Tied embeddings (head = embedding^T): the chunks are rows of the embedding's table (contiguous),
  their gradient fills every row of the embedding's dense gradient, and the rows' gradient is added
  to it (the group's squared norm gains the cross term).

The head's (H, V) matrix is read in place from the store: a chunk is H strided runs of its width.
A vocabulary-major store would make each chunk one contiguous DMA, but would change the flat layout
that checkpoints, the resume check and the export read. Instead the whole matrix is gathered
chunk-major once per step, on background threads, while the forward runs: at the step's start if the
head's update is done by then, else the moment it completes (its future's callback), or at the
latest from ``start``. A strided gather of a chunk (~30-60 ms for an 8B's 268 MB) takes longer than its
pass-1 compute (~15 ms): done on the dispatching thread, twice per step, it left the GPU waiting (an 8B
step 1.13 s slower than with a resident head). Both passes transfer from the same staged chunks; pass
2's gradient chunks are scattered into the dense host gradient on the same threads, off the
dispatching thread too (it waits for them only before handing the gradient to the updater).

Host memory: the staging is one registered buffer per chunk, ``n`` x H x Vc (the whole head, padded to
whole chunks) in the compute dtype (bf16: cast by the gather as the device would), counted by the plan's host
row for the head chunks' staging.
"""
from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait as wait_all
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from megatrain_jax.engine.kernels import F32, local_shard, named
from megatrain_jax.engine.loss import capped
from megatrain_jax.engine.updaters import EMBED, HEAD
from megatrain_jax.errors import UserError
from megatrain_jax.optim.host import alloc_aligned
from megatrain_jax.templates import Layout

ROWS_BUCKET = 1024  # the gathered embedding rows are padded to a multiple of this: few shapes, few compiles
COPY_THREADS = 4  # host threads of the embedding rows' strided gather (numpy copies release the GIL)
HEAD_THREADS = max(1, min(8, os.cpu_count() or 1))  # the head's background gather and scatter


# shared by every trainer in the process (kernels.py says why)
_embed_zero_pad_row = jax.jit(
    named("embed_zero_pad_row", lambda g, lo, n: jax.lax.dynamic_update_slice(g, jnp.zeros((n,), F32), (lo,))),
    static_argnums=2, donate_argnums=0)


@functools.lru_cache(maxsize=None)
def _fills(sh: NamedSharding) -> tuple:
    """(``fill(x, v)``, ``zeros_like(x)``) in fp32, placed as ``sh``."""
    return (jax.jit(named("loss_stat_fill", lambda x, v: jnp.full(x.shape, v, F32)), static_argnums=1, out_shardings=sh),
            jax.jit(named("loss_dx_zeros", lambda x: jnp.zeros(x.shape, F32)), out_shardings=sh))


class ResidentIO:
    """Today's path: the embedding and head resident for the step, whole."""

    second_loss_reads_outputs = True  # a resweep's second sweep runs the loss again, from the last block's outputs

    def __init__(self, trainer: Any):
        self.k, self.weights, self.store = trainer.kernels, trainer.weights, trainer.store
        self.deliver = trainer._gradient  # reduce, squared norm, hand to the updater
        self._g_emb = None

    def take_embed(self, batch: Any, mbs: list) -> jax.Array:
        return self.weights.take(EMBED)  # (embed size,)

    def embed(self, emb: jax.Array, mbs: list) -> list:
        return [self.k.embed_fwd(emb, mb.inputs) for mb in mbs]

    def prefetch_head(self) -> None:
        self.weights.prefetch(HEAD, wait=False)

    def take_head(self) -> jax.Array:
        return self.weights.take(HEAD)  # (head size,)

    def loss(self, head: jax.Array, emb: jax.Array, hs: list, mbs: list, inv: jax.Array,
             scale: float | None = None) -> tuple:
        """(M losses, M d hidden, [the head's squared gradient norm]); the head's gradient is out
        (``scale``: a resweep's second sweep sends it clipped)."""
        k = self.k
        g_head, g_emb = k.zeros(self.store["head"].size), k.zeros(self.store["embed"].size)  # fp32 per device
        losses, dhs = [], []
        for h, mb in zip(hs, mbs):
            loss, dh, g_head, g_emb = k.head_loss(head, emb, h, mb.labels, mb.mask, inv, g_head, g_emb)
            losses.append(loss)
            dhs.append(dh)
        self._g_emb = g_emb
        return losses, dhs, [self.deliver(HEAD, g_head, scale)]

    def embed_backward(self, emb: jax.Array, mbs: list, dhs: list, scale: float | None = None) -> jax.Array:
        g, self._g_emb = self._g_emb, None
        for m, mb in enumerate(mbs):
            g = self.k.embed_bwd(emb, mb.inputs, dhs[m], g)
        return self.deliver(EMBED, g, scale)

    def resident(self, emb: jax.Array, head: jax.Array) -> dict:
        return {"embed": emb, "head": head}

    def close(self) -> None:
        """Nothing to end (``StreamIO`` ends its background threads)."""


class StreamIO:
    """``stream_io``: the embedding's rows and the head's vocabulary chunks, neither resident."""

    second_loss_reads_outputs = False  # a resweep's second sweep starts from the first's top cotangents

    def __init__(self, trainer: Any):
        parts, o = trainer.parts, trainer.options
        hs = jax.eval_shape(parts.embed_fn, parts.embed_weights, _probe_inputs(parts))
        H = int(hs.shape[-1])
        out = jax.eval_shape(lambda hw, h, ew: parts.head_fn(hw, h, ew)[1], parts.head_weights, hs,
                             parts.embed_weights if parts.tied else None)
        if tuple(out.shape) != (H, out.shape[-1]):
            raise UserError("train.stream_io", f"the head's output matrix is {tuple(out.shape)}, not (hidden, vocab)",
                            "set train.stream_io=false (a folded output bias is not streamed)")
        V = int(out.shape[-1])
        self.rows = EmbedRows(trainer, H, V)
        self.head = HeadStream(trainer, H, V, min(int(o.vocab_chunk), V), self.rows)
        self.tr = trainer
        self._again: tuple | None = None  # resweep: the first sweep's losses, top cotangents and head norms

    def take_embed(self, batch: Any, mbs: list) -> Any:
        self.head.reset()  # a step that raised may have left its head chunks behind
        self._again = None
        rows = self.rows.take(batch, mbs)
        self.head.stage_early()  # the head's gather overlaps the forward when its update is done already
        return rows

    def embed(self, emb: Any, mbs: list) -> list:
        return self.rows.forward(emb, mbs)

    def prefetch_head(self) -> None:
        self.head.start(wait=False)

    def take_head(self) -> jax.Array:
        return self.head.start(wait=True)

    def loss(self, head: jax.Array, emb: Any, hs: list, mbs: list, inv: jax.Array,
             scale: float | None = None) -> tuple:
        """The head's loss and backward; with ``grad_hold=resweep`` the first sweep also keeps the top
        cotangents (one layer of activations on the device: the plan counts it), and the second sweep,
        ``scale`` known, starts from them and sends the head's gradient, which waited in host memory
        where it was made: the head is neither streamed nor computed again."""
        if scale is not None:
            losses, dhs, sq = self._again
            self._again = None
            self.tr.updates.send("head", self.head.dense, scale)
            return losses, dhs, sq
        losses, dhs, sq = self.head.loss(head, hs, mbs, inv)
        if self.tr.updates.resweep:
            self._again = (losses, [d.copy() for d in dhs], sq)  # the blocks' VJPs donate the originals
        return losses, dhs, sq

    def embed_backward(self, emb: Any, mbs: list, dhs: list, scale: float | None = None) -> jax.Array:
        """The rows' gradient into the embedding's host gradient; in a resweep's second sweep that
        gradient, made by the first, is sent as it is (tied: it holds the head's part too)."""
        if scale is not None:
            self.tr.updates.send("embed", self.rows.dense, scale)
            return self.rows.last_sq
        return self.rows.backward(emb, dhs)

    def resident(self, emb: Any, head: jax.Array) -> dict:
        return {}

    def close(self) -> None:
        self.head.close()


def make_io(trainer: Any) -> ResidentIO | StreamIO:
    return StreamIO(trainer) if trainer.options.stream_io else ResidentIO(trainer)


# ------------------------------------------------------------------------------------ helpers


def _probe_inputs(parts: Any) -> Any:
    tok = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return (tok, tok) if parts.embed_takes_positions else tok


def _leaf(layout: Layout, shape: tuple, group: str, what: str) -> int:
    hits = [j for j, s in enumerate(layout.leaves) if s.shape == shape]
    if len(hits) != 1:
        raise UserError("train.stream_io", f"the {group} group has {len(hits)} weights shaped {shape} ({what}), "
                        "not exactly one", "set train.stream_io=false")
    return hits[0]


def _with_shape(layout: Layout, j: int, shape: tuple) -> Layout:
    """``layout`` with leaf ``j`` reshaped: the device-side group of gathered rows, or of the small weights."""
    leaves = [jax.ShapeDtypeStruct(shape if i == j else s.shape, np.float32) for i, s in enumerate(layout.leaves)]
    return Layout(jax.tree_util.tree_unflatten(layout.treedef, leaves))


class _Copier:
    """Strided host copies split by rows over a few threads (the dispatching thread must not stall)."""

    def __init__(self):
        self.pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="io-copy")

    def run(self, fn, n: int) -> None:
        step = -(-n // COPY_THREADS)
        for f in [self.pool.submit(fn, lo, min(lo + step, n)) for lo in range(0, n, step)]:
            f.result()


# ------------------------------------------------------------------------------------ embedding rows


class EmbedRows:
    """The embedding's rows that the step's tokens use, gathered on the host; the rest stays there."""

    def __init__(self, tr: Any, H: int, V: int):
        self.tr, self.k, self.xfer, self.upd = tr, tr.kernels, tr.xfer, tr.updates
        g = tr.store["embed"]
        self.group, self.H, self.V = g, H, V
        self.layout = g.layout
        self.ti = _leaf(self.layout, (V, H), "embed", "the token table")
        leaf = self.layout.leaves[self.ti]
        self.table = g.master[leaf.offset:leaf.offset + leaf.size].reshape(V, H)
        self.pad_id = getattr(tr.parts, "pad_id", None)
        self.tied = tr.parts.tied  # the head's chunks write every row of the gradient first (HeadStream)
        self.dense = np.zeros(g.size, np.float32)  # the group's gradient, on the host (pageable)
        self.dense_table = self.dense[leaf.offset:leaf.offset + leaf.size].reshape(V, H)
        self._dirty: np.ndarray | None = None  # rows of ``dense_table`` written last step
        self.last_sq: Any = None  # the squared norm of the gradient made last (a resweep sends it again)
        self._bufs: list[np.ndarray] = []  # staging buffers (registered; kept alive until close)
        self._fns: dict[int, tuple] = {}  # per padded row count: (layout, forward, backward)
        self._zero_slot = _embed_zero_pad_row
        self.copy = _Copier()

    def _kernels(self, U: int) -> tuple:
        fns = self._fns.get(U)
        if fns is None:
            lay, dt, p, smap = _with_shape(self.layout, self.ti, (U, self.H)), self.k.dtype, self.tr.parts, self.k._smap
            rep, dat = P(), P("data")

            def fwd(w, inputs):
                return p.embed_fn(lay.unflatten(w.astype(dt)), inputs).astype(dt)

            def bwd(w, inputs, dh, g):
                _, vjp = jax.vjp(lambda w_: fwd(w_, inputs), w)
                return g + vjp(dh)[0].astype(F32)

            fns = (lay, jax.jit(smap(fwd, (rep, dat), dat)),
                   jax.jit(smap(bwd, (rep, dat, dat, dat), dat), donate_argnums=(3,)))
            self._fns[U] = fns
        return fns

    def _slots(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, int]:
        """(ids per slot, -1 for filler; each token's slot; padded slot count; a slot whose gradient
        must be zeroed, or -1). The padding id keeps its own id as its slot when that slot exists,
        so that an ``embed_fn`` comparing ids with it (no gradient for padding) still sees it."""
        uniq, inv = np.unique(tokens, return_inverse=True)
        U = min(-(-(len(uniq) + 1) // ROWS_BUCKET) * ROWS_BUCKET, self.V)
        ids = np.full(U, -1, np.int64)
        pad, zero = self.pad_id, -1
        if pad is not None and pad < U:
            rest = uniq[uniq != pad]
            where = np.arange(U)
            where = where[where != pad][:len(rest)]
            ids[where], ids[pad] = rest, pad
            slot_of = np.empty(len(uniq), np.int64)
            slot_of[uniq != pad] = where
            slot_of[uniq == pad] = pad
        else:
            ids[:len(uniq)] = uniq
            slot_of = np.arange(len(uniq))
            hit = np.nonzero(uniq == pad)[0] if pad is not None else []
            zero = int(hit[0]) if len(hit) else -1  # the padding token sits elsewhere: its gradient is dropped
        return ids, slot_of[inv].reshape(tokens.shape).astype(np.int32), U, zero

    def take(self, batch: Any, mbs: list) -> Any:
        """The step's rows on the device, and each micro-batch's remapped embedding input."""
        ids, remapped, U, zero = self._slots(np.asarray(batch.tokens))
        lay, fwd, bwd = self._kernels(U)
        self.upd.wait("embed")  # its update has written the master
        buf = self._staging(lay.size)
        real = ids >= 0
        src = np.where(real, ids, 0)
        for j, (s, d) in enumerate(zip(self.layout.leaves, lay.leaves)):
            if j == self.ti:
                rows = buf[d.offset:d.offset + d.size].reshape(U, self.H)
                self.copy.run(lambda lo, hi: np.take(self.table, src[lo:hi], axis=0, out=rows[lo:hi]), U)
            else:
                buf[d.offset:d.offset + d.size] = self.group.master[s.offset:s.offset + s.size]
        name = f"embed/rows{len(self._bufs) - 1}"
        self.xfer.host_written(name, buf)
        w = self.xfer.to_device(name, buf)
        m, b = len(mbs), remapped.shape[0]
        sharding = self.k.batch_sharding
        inputs = []
        for part, mb in enumerate(mbs):
            x = np.ascontiguousarray(remapped[part * b // m:(part + 1) * b // m])
            tok = jax.make_array_from_callback(x.shape, sharding, lambda idx, x=x: x[idx])
            inputs.append((tok, mb.inputs[1]) if self.tr.parts.embed_takes_positions else tok)
        return _Rows(w, inputs, ids, U, zero, lay)

    def _staging(self, n: int) -> np.ndarray:
        """A registered host buffer of at least ``n`` values (grown rarely: its size follows the
        batch's distinct tokens, bucketed). A view of exactly ``n`` values."""
        if not self._bufs or self._bufs[-1].size < n:
            buf = alloc_aligned(n, np.float32)
            self._bufs.append(buf)
            self.xfer.register(f"embed/rows{len(self._bufs) - 1}", buf)
        return self._bufs[-1][:n]

    def forward(self, rows: "_Rows", mbs: list) -> list:
        fwd = self._kernels(rows.U)[1]
        return [fwd(rows.w, x) for x in rows.inputs]

    def backward(self, rows: "_Rows", dhs: list) -> jax.Array:
        """The rows' gradient, summed over the devices, to the host and scattered into the dense
        gradient there; returns its squared norm (the dense one's: every other row is zero; tied, the
        head's part is counted by the head, and the cross term is added here)."""
        lay, _, bwd = self._kernels(rows.U)
        k = self.k
        g = k.zeros(lay.size)
        for x, dh in zip(rows.inputs, dhs):
            g = bwd(rows.w, x, dh, g)
        if k.reduce is not None:
            g = k.reduce(g)
        if rows.zero >= 0:
            off = lay.leaves[self.ti].offset
            g = self._zero_slot(g, off + rows.zero * self.H, self.H)
        sq = k.sqnorm(g)
        host = self.xfer.to_host(local_shard(g))
        self.upd.wait("embed")  # the last update read ``dense``: its rows are rewritten now
        flat = np.asarray(self.xfer.host_view(host))
        if self._dirty is not None and not self.tied:
            self.dense_table[self._dirty] = 0.0
        real = rows.ids >= 0
        for j, (s, d) in enumerate(zip(self.layout.leaves, lay.leaves)):
            src = flat[d.offset:d.offset + d.size]
            if j != self.ti:
                self.dense[s.offset:s.offset + s.size] = src
                continue
            add, ids = src.reshape(rows.U, self.H)[real], rows.ids[real]
            if self.tied:  # the head's gradient of every row is there already: add, and the norm's cross term
                cur = self.dense_table[ids]
                sq = sq + 2.0 * float(np.dot(cur.ravel().astype(np.float64), add.ravel().astype(np.float64)))
                add = cur + add
            self.dense_table[ids] = add
        self._dirty = rows.ids[real]
        self.upd.gradient("embed", self.dense)
        self.last_sq = sq
        return sq


class _Rows:
    """One step's gathered embedding: the device block, each micro-batch's input, the slots' ids."""

    def __init__(self, w, inputs, ids, U, zero, layout):
        self.w, self.inputs, self.ids, self.U, self.zero, self.layout = w, inputs, ids, U, zero, layout


# ------------------------------------------------------------------------------------ head stream


class HeadStream:
    """The LM head's output matrix in vocabulary chunks from the host; the loss in two passes."""

    def __init__(self, tr: Any, H: int, V: int, Vc: int, rows: EmbedRows):
        self.tr, self.k, self.xfer, self.upd = tr, tr.kernels, tr.xfer, tr.updates
        g = tr.store["head"]
        self.group, self.H, self.V, self.Vc = g, H, V, Vc
        self.n = -(-V // Vc)
        self.dense = np.zeros(g.size, np.float32)  # the group's gradient, on the host (pageable)
        self.tied, self._stub = tr.parts.tied, None
        if self.tied:  # the output matrix is the embedding's (V, H) table: a chunk is rows, its gradient is the
            #            embedding's
            self.out, self.dense_out = rows.table, rows.dense_table
            self.small, self._small_pairs = g.layout, [(s, s) for s in g.layout.leaves]
            self._stub = _with_shape(rows.layout, rows.ti, (0, H))  # what head_fn reads of the embedding: nothing
        else:
            oi = _leaf(g.layout, (H, V), "head", "the output matrix")
            leaf = g.layout.leaves[oi]
            self.out = g.master[leaf.offset:leaf.offset + leaf.size].reshape(H, V)
            self.dense_out = self.dense[leaf.offset:leaf.offset + leaf.size].reshape(H, V)
            self.small = _with_shape(g.layout, oi, (H, 0))  # the final norm's weights (and any other small ones)
            self._small_pairs = [(s, d) for j, (s, d) in enumerate(zip(g.layout.leaves, self.small.leaves)) if j != oi]
        self._small_buf = np.zeros(max(self.small.size, 1), np.float32)
        # one staging buffer per chunk (the whole head, chunk-major), page-aligned: DMA-registered. In bf16 compute
        # the gather casts (round to nearest even, as the device's cast: the same values), halving the staging's
        # host memory and the chunks' PCIe bytes
        self.stage_bf16 = self.k.dtype == jnp.bfloat16
        self._stages = [alloc_aligned(H * Vc, np.uint16).view(jnp.bfloat16) if self.stage_bf16
                        else alloc_aligned(H * Vc, np.float32) for _ in range(self.n)]
        for j, b in enumerate(self._stages):
            self.xfer.register(f"head/chunk{j}", b)
        # what read each chunk's buffer last (device arrays: the CPU backend even aliases the buffer); its
        # next step's gather waits for them, on the gathering thread
        self._users: list[list] = [[] for _ in range(self.n)]
        self._small_w: jax.Array | None = None
        self._inflight: dict[int, jax.Array] = {}
        self._staged: list[Future] | None = None  # this step's gather, one future per chunk (None: not started)
        self._scatters: list[Future] = []  # this step's gradient scatters into ``dense``, not yet waited for
        self._stage_lock = threading.Lock()  # ``_stage`` may run on the optimizer thread (``stage_early``)
        self.pool = ThreadPoolExecutor(HEAD_THREADS, thread_name_prefix="head-stage")
        self._build()

    # ---- the jitted pieces (one executable each: the last, narrower chunk is padded)

    def _build(self) -> None:
        k, p, dt, H, Vc = self.k, self.tr.parts, self.k.dtype, self.H, self.Vc
        lay, cap, chunk, multi = self.small, p.logit_softcap, self.tr.options.loss_chunk, k.num_devices > 1
        rep, dat, tied, stub = P(), P("data"), self.tied, self._stub

        def normed_of(ws, h):
            ew = None if stub is None else stub.unflatten(jnp.zeros((stub.size,), dt))
            return p.head_fn(lay.unflatten(ws.astype(dt)), h, ew)[0]

        def matrix(wc):  # (H, Vc) in the compute dtype
            return (wc.reshape(Vc, H).T if tied else wc.reshape(H, Vc)).astype(dt)

        def tiles(h, *per_token):
            """(tiles, tile, ...) views of the normed tokens and per-token arrays, padded."""
            n = h.shape[0] * h.shape[1]
            c = min(chunk, n)
            pad = (-n) % c
            out = [jnp.pad(a.reshape((n,) + a.shape[2:]), ((0, pad),) + ((0, 0),) * (a.ndim - 2))
                   .reshape((-1, c) + a.shape[2:]) for a in (h,) + per_token]
            return out, n

        def logits_of(xc, w, valid):
            lg = capped(jnp.dot(xc, w, preferred_element_type=F32), cap)  # (tile, Vc)
            return jnp.where(jnp.arange(Vc) < valid, lg, -jnp.inf)

        def stats(ws, wc, h, labels, v0, valid, mx, se, pk):
            w = matrix(wc)
            (xs, ys, ms, ss, ps), n = tiles(normed_of(ws, h), labels - v0, mx, se, pk)

            def body(_, inp):
                xc, yc, mc, sc, pc = inp
                lg = logits_of(xc, w, valid)
                mn = jnp.maximum(mc, jnp.max(lg, axis=-1))
                sc = sc * jnp.exp(mc - mn) + jnp.sum(jnp.exp(lg - mn[:, None]), axis=-1)
                hit = (yc >= 0) & (yc < valid)
                got = jnp.take_along_axis(lg, jnp.clip(yc, 0, Vc - 1)[:, None], axis=-1)[:, 0]
                return None, (mn, sc, pc + jnp.where(hit, got, 0.0))

            _, outs = jax.lax.scan(body, None, (xs, ys, ms, ss, ps))
            return tuple(o.reshape(-1)[:n].reshape(labels.shape) for o in outs)

        def grads(ws, wc, h, labels, mask, inv, lse, v0, valid, dx, gw):
            w = matrix(wc)
            (xs, ys, ms, ls), n = tiles(normed_of(ws, h), labels - v0, mask.astype(F32) * inv, lse)

            def body(gw, inp):
                xc, yc, mc, lc = inp
                lg = logits_of(xc, w, valid)
                pr = jnp.exp(lg - lc[:, None]) - jax.nn.one_hot(yc, Vc, dtype=F32)  # out of the chunk: no one
                if cap is not None:  # through cap * tanh(raw / cap): times 1 - tanh^2
                    pr = pr * (1.0 - jnp.square(jnp.where(jnp.isfinite(lg), lg, 0.0) / cap))
                pr = (jnp.where(jnp.isfinite(lg), pr, 0.0) * mc[:, None]).astype(xc.dtype)  # d loss / d logits
                dw = jnp.dot(pr.T, xc, preferred_element_type=F32) if tied else \
                    jnp.dot(xc.T, pr, preferred_element_type=F32)  # (Vc, H) rows of the table, or (H, Vc)
                return gw + dw.reshape(-1), jnp.dot(pr, w.T, preferred_element_type=F32)

            gw, dxs = jax.lax.scan(body, gw, (xs, ys, ms, ls))
            return dx + dxs.reshape(-1, H)[:n].reshape(dx.shape), gw

        def finish(ws, h, dx, gs):
            normed, vjp = jax.vjp(normed_of, ws, h)
            dws, dh = vjp(dx.astype(normed.dtype))
            return dh, gs + dws.astype(F32)

        def loss_of(mx, se, pk, mask, inv):
            lse = mx + jnp.log(se)
            loss = jnp.sum((lse - pk) * mask.astype(F32)) * inv
            return (jax.lax.psum(loss, "data") if multi else loss), lse

        smap = k._smap
        # not donated: a chunk's statistics are what its staging buffer waits for before reuse
        self._stats = jax.jit(smap(stats, (rep, rep, dat, dat, rep, rep, dat, dat, dat), (dat, dat, dat)))
        self._grads = jax.jit(smap(grads, (rep, rep, dat, dat, dat, rep, dat, rep, rep, dat, dat), (dat, dat)),
                              donate_argnums=(9, 10))
        self._finish = jax.jit(smap(finish, (rep, dat, dat, dat), (dat, dat)), donate_argnums=(2, 3))
        self._loss = jax.jit(smap(loss_of, (dat, dat, dat, dat, rep), (rep, dat)))
        self._fill, self._fill_h = _fills(NamedSharding(k.mesh, dat))

    # ---- the step

    def reset(self) -> None:
        """A new step. One that raised may have left chunks in flight and background jobs running: they
        settle first (their buffers are rewritten next; that step surfaced its own error)."""
        for w in self._inflight.values():
            w.block_until_ready()
        with self._stage_lock:
            wait_all((self._staged or []) + self._scatters)
            self._small_w, self._inflight, self._staged, self._scatters = None, {}, None, []

    def stage_early(self) -> None:
        """At the step's start: the head's gather begins as soon as the head's update has written its
        master (tied: the embedding's too, waited for by now): at once if it is done, else from the
        optimizer thread when it completes. Never waits (``start`` begins it otherwise)."""
        if self.tied and not self.upd.done("embed"):
            return
        fut = self.upd.pending.get("head")  # what ``done`` and ``wait`` read
        if fut is None:
            self._stage()
        else:
            fut.add_done_callback(self._stage_after)

    def _stage_after(self, fut: Future) -> None:
        """The head's update completed: stage unless it failed (``start`` then raises its error, on
        the dispatching thread; an error here would be logged only, so ``start`` retries ``_stage``)."""
        if not fut.cancelled() and fut.exception() is None:
            self._stage()

    def start(self, wait: bool) -> jax.Array | None:
        """The small weights in flight and the head's gather begun (once per step), and the first
        chunk in flight once gathered; without ``wait``, not while the head's update still runs nor
        before chunk 0 is gathered (the caller dispatches compute first)."""
        if self._small_w is None:
            if not wait and not self.upd.done("head"):
                return None
            self.upd.wait("head")
            if self.tied:
                self.upd.wait("embed")  # the chunks are rows of its master (waited for in ``take_embed`` already)
            self._stage()
            for s, d in self._small_pairs:
                self._small_buf[d.offset:d.offset + d.size] = self.group.master[s.offset:s.offset + s.size]
            self._small_w = jax.device_put(self._small_buf[:self.small.size].copy(), self.xfer.replicated
                                           if self.xfer.mesh is not None else self.xfer.device_sharding)
        if 0 not in self._inflight and (wait or self._staged[0].done()):
            self._inflight[0] = self._put(0)
        return self._small_w

    def _spans(self, rows: int) -> list[tuple[int, int]]:
        """``rows`` split into one range per background thread."""
        step = max(1, -(-rows // HEAD_THREADS))
        return [(lo, min(lo + step, rows)) for lo in range(0, rows, step)]

    def _stage(self) -> None:
        """Every chunk gathered into its own staging buffer on the pool, chunk 0 first, split by rows
        (once per step: both passes transfer from these buffers)."""
        with self._stage_lock:
            if self._staged is not None:
                return
            staged = []
            for c in range(self.n):
                readers = self._users[c]
                first, *rest = self._spans(self.Vc if self.tied else self.H)
                parts = [self.pool.submit(self._gather_rows, c, lo, hi, readers) for lo, hi in rest]
                staged.append(self.pool.submit(self._gather_chunk, c, first, readers, parts))
            self._staged = staged  # whole or not at all: a failed submit leaves it to the next call

    def _gather_chunk(self, c: int, first: tuple[int, int], readers: list, parts: list[Future]) -> None:
        """Chunk ``c``'s first rows gathered here, then its other row jobs waited for (submitted before
        this job: running or done, never queued behind it) and the buffer's pinned copy refreshed."""
        self._gather_rows(c, *first, readers)
        for f in parts:
            f.result()
        self.xfer.host_written(f"head/chunk{c}", self._stages[c])

    def _gather_rows(self, c: int, lo: int, hi: int, readers: list) -> None:
        """Rows ``lo .. hi`` of chunk ``c``'s staging buffer, once what read it last step has run; the
        last chunk's columns (tied: rows) beyond the vocabulary are zeros."""
        for a in readers:
            a.block_until_ready()
        v0 = c * self.Vc
        n = min(self.Vc, self.V - v0)
        if self.tied:  # rows v0 .. v0 + n of the table, contiguous
            buf = self._stages[c].reshape(self.Vc, self.H)
            buf[lo:min(hi, n)] = self.out[v0 + lo:v0 + min(hi, n)]
            buf[max(lo, n):hi] = 0.0
        else:  # columns v0 .. v0 + n: H strided runs
            buf = self._stages[c].reshape(self.H, self.Vc)
            buf[lo:hi, :n] = self.out[lo:hi, v0:v0 + n]
            buf[lo:hi, n:] = 0.0

    def _put(self, c: int) -> jax.Array:
        """Chunk ``c`` of the output matrix to the device from its staging buffer, once gathered (a
        background job's error is raised here)."""
        self._staged[c].result()
        return self.xfer.to_device(f"head/chunk{c}", self._stages[c])

    def _take(self, c: int, nxt: int | None) -> jax.Array:
        w = self._inflight.pop(c, None)
        if w is None:
            w = self._put(c)
        if nxt is not None and nxt not in self._inflight:
            self._inflight[nxt] = self._put(nxt)  # issued before chunk c's compute: it overlaps it
        return w

    def loss(self, ws: jax.Array, hs: list, mbs: list, inv: jax.Array) -> tuple:
        """(M losses, M d hidden, [the head's squared gradient norm]); its gradient is on its way out."""
        k, n, Vc = self.k, self.n, self.Vc
        st = [(self._fill(mb.labels, -np.inf), self._fill(mb.labels, 0.0), self._fill(mb.labels, 0.0)) for mb in mbs]
        readers: list = []  # pass 1's statistics chain through the chunks: the latest ran after every earlier one
        for c in range(n):  # pass 1: online log-sum-exp and the labels' logits
            w = self._take(c, c + 1 if c + 1 < n else None)
            v0, valid = c * Vc, min(Vc, self.V - c * Vc)
            st = [self._stats(ws, w, h, mb.labels, v0, valid, *s) for h, mb, s in zip(hs, mbs, st)]
            readers[:] = [x for s in st for x in s]
            self._users[c] = readers
            if c == n - 1:
                self._inflight[c] = w  # pass 2 starts with it
        losses, lses = zip(*[self._loss(*s, mb.mask, inv) for s, mb in zip(st, mbs)])
        dxs = [self._fill_h(h) for h in hs]
        sq = []
        for c in reversed(range(n)):  # pass 2: softmax - onehot, d normed, and each chunk's weight gradient
            w = self._take(c, c - 1 if c > 0 else None)
            v0, valid = c * Vc, min(Vc, self.V - c * Vc)
            gw = k.zeros(self.H * Vc)
            for m, (h, mb) in enumerate(zip(hs, mbs)):
                dxs[m], gw = self._grads(ws, w, h, mb.labels, mb.mask, inv, lses[m], v0, valid, dxs[m], gw)
            sq.append(self._out(c, gw))
            self._users[c] = [sq[-1]]  # ready once every micro-batch's use of the chunk has run
        gs, dhs = k.zeros(self.small.size), []
        for h, dx in zip(hs, dxs):
            dh, gs = self._finish(ws, h, dx, gs)
            dhs.append(dh)
        sq.append(self._out(None, gs))
        self._small_w, self._staged = None, None
        # the updater reads ``dense`` (tied: the embedding's backward adds to it next): every scatter first
        jobs, self._scatters = self._scatters, []
        wait_all(jobs)
        for f in jobs:
            f.result()
        self.upd.gradient("head", self.dense)
        return list(losses), dhs, sq

    def _out(self, c: int | None, g: jax.Array) -> jax.Array:
        """Chunk ``c``'s gradient (None: the small weights') summed over the devices, its squared
        norm taken, its copy to the host issued and its scatter into ``dense`` queued on the pool."""
        k = self.k
        if k.reduce is not None:
            g = k.reduce(g)
        sq = k.sqnorm(g)
        if not self._scatters:
            self.upd.wait("head")  # its last update read ``dense``, rewritten from here
        fetch = self.pool.submit(self._fetch, self.xfer.to_host(local_shard(g, 0 if c is None else c)))
        if c is None:
            jobs = [self.pool.submit(self._scatter_small, fetch)]
        else:  # jobs submitted after ``fetch`` wait for it: it is running or done by the time they run
            valid = min(self.Vc, self.V - c * self.Vc)
            jobs = [self.pool.submit(self._scatter_rows, c, lo, hi, fetch)
                    for lo, hi in self._spans(valid if self.tied else self.H)]
        self._scatters += [fetch, *jobs]
        return sq

    def _fetch(self, arr: jax.Array) -> np.ndarray:
        return np.asarray(self.xfer.host_view(arr))  # waits until the copy has landed

    def _scatter_small(self, fetch: Future) -> None:
        flat = fetch.result()
        for s, d in self._small_pairs:
            self.dense[s.offset:s.offset + s.size] = flat[d.offset:d.offset + d.size]

    def _scatter_rows(self, c: int, lo: int, hi: int, fetch: Future) -> None:
        """Rows ``lo .. hi`` of chunk ``c``'s gradient (tied: rows of the table, else of the (H, V) matrix)
        into the dense gradient."""
        flat, v0 = fetch.result(), c * self.Vc
        if self.tied:
            self.dense_out[v0 + lo:v0 + hi] = flat.reshape(self.Vc, self.H)[lo:hi]
            return
        n = min(self.Vc, self.V - v0)
        self.dense_out[lo:hi, v0:v0 + n] = flat.reshape(self.H, self.Vc)[lo:hi, :n]

    def close(self) -> None:
        """The background jobs settled and the pool's threads ended."""
        self.reset()
        self.pool.shutdown()
