"""``HeadStream``: the LM head's output matrix streamed through the loss in vocabulary chunks (``stream_io``).

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

import collections
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
from megatrain_jax.errors import UserError
from megatrain_jax.optim.host import alloc_aligned
from megatrain_jax.bounds import IO_HEAD_GRADS_IN_FLIGHT
from megatrain_jax.templates import Layout

HEAD_THREADS = max(1, min(8, os.cpu_count() or 1))  # the head's background gather and scatter


@functools.lru_cache(maxsize=None)
def _fills(sh: NamedSharding) -> tuple:
    """(``fill(x, v)``, ``zeros_like(x)``) in fp32, placed as ``sh``."""
    return (jax.jit(named("loss_stat_fill", lambda x, v: jnp.full(x.shape, v, F32)), static_argnums=1, out_shardings=sh),
            jax.jit(named("loss_dx_zeros", lambda x: jnp.zeros(x.shape, F32)), out_shardings=sh))


def only_leaf_shaped(layout: Layout, shape: tuple, group: str, what: str) -> int:
    """Index of the one leaf of ``layout`` shaped ``shape``; not exactly one is a UserError (stream_io
    then cannot tell the table). Public: engine/io.py finds the embedding table with it."""
    hits = [j for j, s in enumerate(layout.leaves) if s.shape == shape]
    if len(hits) != 1:
        raise UserError("train.stream_io", f"the {group} group has {len(hits)} weights shaped {shape} ({what}), "
                        "not exactly one", "set train.stream_io=false")
    return hits[0]


def with_shape(layout: Layout, j: int, shape: tuple) -> Layout:
    """``layout`` with leaf ``j`` reshaped: the device-side group of gathered rows, or of the small weights.
    Public: engine/io.py builds the embedding's device-side layout with it."""
    leaves = [jax.ShapeDtypeStruct(shape if i == j else s.shape, np.float32) for i, s in enumerate(layout.leaves)]
    return Layout(jax.tree_util.tree_unflatten(layout.treedef, leaves))

class HeadStream:
    """The LM head's output matrix in vocabulary chunks from the host; the loss in two passes."""

    def __init__(self, tr: Any, H: int, V: int, Vc: int, rows: Any):  # tr: io.IOParts
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
            self._stub = with_shape(rows.layout, rows.ti, (0, H))  # what head_fn reads of the embedding: nothing
        else:
            oi = only_leaf_shaped(g.layout, (H, V), "head", "the output matrix")
            leaf = g.layout.leaves[oi]
            self.out = g.master[leaf.offset:leaf.offset + leaf.size].reshape(H, V)
            self.dense_out = self.dense[leaf.offset:leaf.offset + leaf.size].reshape(H, V)
            self.small = with_shape(g.layout, oi, (H, 0))  # the final norm's weights (and any other small ones)
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
        # this step's chunk gradients on their way into ``dense``, not yet waited for: each its fetch and scatters
        self._outs: collections.deque[list[Future]] = collections.deque()
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
            wait_all((self._staged or []) + [f for jobs in self._outs for f in jobs])
            self._small_w, self._inflight, self._staged = None, {}, None
            self._outs.clear()

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

    def _pass1(self, ws: jax.Array, hs: list, mbs: list) -> list:
        """Pass 1 over the chunks: per micro-batch, each token's running max, sum of exponentials and label's
        logit; the last chunk stays in flight (pass 2 starts with it)."""
        n, Vc = self.n, self.Vc
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
        return st

    def forward_stats(self, ws: jax.Array, hs: list, mbs: list) -> list:
        """Forward only, pass 1 alone: per micro-batch, each token's (running max, sum of exponentials, label's
        logit) over the whole vocabulary (its log-sum-exp is max + log(sum)); no gradient, the chunks let go."""
        st = self._pass1(ws, hs, mbs)
        self._inflight.pop(self.n - 1, None)
        self._small_w, self._staged = None, None
        return st

    def seq_logps(self, ws: jax.Array, hs: list, mbs: list) -> list:
        """Forward only (the preference objectives' reference pass): each micro-batch's rows' summed
        log-probabilities of their masked-in labels; no gradient."""
        return self.k.objective.stream_logps(self.k, self.forward_stats(ws, hs, mbs), mbs)

    def loss(self, ws: jax.Array, hs: list, mbs: list, inv: jax.Array) -> tuple:
        """(M losses, M d hidden, [the head's squared gradient norm]); its gradient is on its way out."""
        k, n, Vc = self.k, self.n, self.Vc
        st = self._pass1(ws, hs, mbs)
        if k.objective is None:
            losses, lses = zip(*[self._loss(*s, mb.mask, inv) for s, mb in zip(st, mbs)])
            weights = [mb.mask for mb in mbs]
        else:  # a preference objective: pass 2's per-token weights from the rows' log-probabilities (objectives.py)
            losses, lses, weights = k.objective.stream_between(k, st, mbs, inv)
            inv = jnp.ones((), F32)
        dxs = [self._fill_h(h) for h in hs]
        sq = []
        for c in reversed(range(n)):  # pass 2: softmax - onehot, d normed, and each chunk's weight gradient
            w = self._take(c, c - 1 if c > 0 else None)
            v0, valid = c * Vc, min(Vc, self.V - c * Vc)
            gw = k.zeros(self.H * Vc)
            for m, (h, mb) in enumerate(zip(hs, mbs)):
                dxs[m], gw = self._grads(ws, w, h, mb.labels, weights[m], inv, lses[m], v0, valid, dxs[m], gw)
            sq.append(self._out(c, gw))
            self._users[c] = [sq[-1]]  # ready once every micro-batch's use of the chunk has run
        gs, dhs = k.zeros(self.small.size), []
        for h, dx in zip(hs, dxs):
            dh, gs = self._finish(ws, h, dx, gs)
            dhs.append(dh)
        sq.append(self._out(None, gs))
        self._small_w, self._staged = None, None
        # the updater reads ``dense`` (tied: the embedding's backward adds to it next): every scatter first
        self._settle(0)  # (the first error, on this thread)
        self.upd.gradient("head", self.dense)
        return list(losses), dhs, sq

    def _out(self, c: int | None, g: jax.Array) -> jax.Array:
        """Chunk ``c``'s gradient (None: the small weights') summed over the devices, its squared
        norm taken, its copy to the host issued and its scatter into ``dense`` queued on the pool."""
        k = self.k
        if k.reduce is not None:
            g = k.reduce(g)
        sq = k.sqnorm(g)
        if not self._outs:
            self.upd.wait("head")  # its last update read ``dense``, rewritten from here
        self._settle(IO_HEAD_GRADS_IN_FLIGHT - 1)  # each copy below takes a chunk of XLA's pinned pool
        fetch = self.pool.submit(self._fetch, self.xfer.to_host(local_shard(g, 0 if c is None else c)))
        if c is None:
            jobs = [self.pool.submit(self._scatter_small, fetch)]
        else:  # jobs submitted after ``fetch`` wait for it: it is running or done by the time they run
            valid = min(self.Vc, self.V - c * self.Vc)
            jobs = [self.pool.submit(self._scatter_rows, c, lo, hi, fetch)
                    for lo, hi in self._spans(valid if self.tied else self.H)]
        self._outs.append([fetch, *jobs])
        return sq

    def _settle(self, keep: int) -> None:
        """Wait for the oldest chunk gradients on their way until at most ``keep`` are, and let theirs go: a
        chunk's pinned copy lives as long as its fetch's result does (the plan counts IO_HEAD_GRADS_IN_FLIGHT)."""
        while len(self._outs) > keep:
            done = self._outs.popleft()
            for f in done:
                f.result()  # (a job's error, on this thread)

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
