"""The placement search: every ``auto`` of the step's placement enumerated, the fastest predicted
candidate that fits the GPU budget and the host limit taken.

Axes (a setting fixed in the config is the only value of its axis): micro-batches, where boundary
activations live (device | pinned_host), ``boundary_every`` (1, 2, 4), where gradients wait for the
clipping norm (gpu_fp32, gpu_bf16, pinned_host, pinned_bf16, host_fp32, host_bf16, resweep) with, for a host
hold or a resweep, the first groups held on the GPU in bf16 where its free room allows (``grad_hold_gpu_groups``;
a resweep's second sweep then stops above them),
``stream_io`` (embedding and head not resident), the loss chunk (the configured one and halvings of
it), and the blocks' sequence tile (``model.seq_tile=auto``). Each candidate's GPU phases come from
``sizes.gpu_phases``, its host bytes and predicted step from the callbacks ``build.py`` gives
(the same functions the final plan uses, so the figures the search compares are the plan's).

Order among fitting candidates (``choose``): the shortest predicted step, steps within STEP_TOL
taken as equal; among those, the least host memory (shared with everything else on the machine; the
GPU budget is the run's alone) within HOST_TOL, XLA's GPU pool table left out (it only mirrors the
GPU bytes); then the exact step, the least total work (the sum of the step's terms: transfers and
host copies hidden behind compute still contend), fewer micro-batches and the configured loss chunk
(larger matmuls), less GPU memory.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from megatrain_jax.placements import (ACTIVATION_PLACES, DEVICE_ACTIVATIONS, GPU_FP32, GRAD_HOLD, GRAD_HOLD_LIST,
                                      ActivationPlace, GradHold, UpdatePlace, asked)
from megatrain_jax.plan.decisions import Candidate, Placement
from megatrain_jax.plan.memo import PlanMemo
from megatrain_jax.plan.sizes import (AUTO_SEQ_TILE, TILE_ABOVE, AttentionExtra, PhaseInputs, Shapes,
                                      block_working_set, gpu_phases)

BOUNDARY_EVERY = (1, 2, 4)
FRONTIER_EIGHTHS = (1, 2, 3, 4, 5, 6, 7)  # the split counts in between: these eighths of a candidate's activation blocks
FRONTIER_BEST = 3  # how many of the fastest split candidates the frontier refines
MIN_LOSS_CHUNK = 256  # the smallest loss chunk the search tries (below it the head's matmuls are too thin)


@dataclass(frozen=True)
class Axes:
    """The values each decision may take."""

    micro: tuple[int, ...]
    activations: tuple[ActivationPlace, ...]
    holds: tuple[GradHold, ...]
    boundary: tuple[int, ...]
    stream_io: tuple[bool, ...]
    loss_chunks: tuple[int, ...]
    split: bool  # a host hold may keep its first groups on the GPU (grad_hold_gpu_groups)
    activations_gpu_blocks: int | None = None  # pinned activations: the last blocks whose inputs stay on the GPU
    #                                            (None: searched)

    @property
    def size(self) -> int:
        return len(self.micro) * len(self.activations) * len(self.holds) * len(self.boundary) \
            * len(self.stream_io) * len(self.loss_chunks)


def axes_of(train: Any, micro: list[int], *, on_gpu: bool, cpu_only: bool, update_on: UpdatePlace,
            devices: int = 1, shares: bool = False) -> Axes:
    """The search's axes from the config's settings. On the CPU backend the device memory is host
    memory: without a budget nothing is placed elsewhere; with one, only the placements of a GPU run
    that need no pinned slabs or streamed embedding (those are GPU mechanisms) are tried. Every hold is a
    candidate whatever runs the update (a device-side update's resweep applies each group in the second
    sweep) and whatever the number of GPUs (data parallel runs every hold, boundary_every and stream_io:
    tests/test_data_parallel.py); a split of the activations (their last blocks on the GPU) is one GPU's."""
    asked_hold, asked_acts = asked(GRAD_HOLD, train.grad_hold), asked(ACTIVATION_PLACES, train.activations)
    holds = GRAD_HOLD_LIST if asked_hold is None else (asked_hold,)
    if update_on.on_device and devices > 1 and shares:  # each GPU updates its share: no whole gradient in pageable
        holds = tuple(h for h in holds if not h.pageable) or holds  # memory
    acts = tuple(ACTIVATION_PLACES.values()) if asked_acts is None else (asked_acts,)
    boundary = BOUNDARY_EVERY if train.boundary_every == "auto" else (int(train.boundary_every),)
    io = (False, True) if train.stream_io == "auto" else (bool(train.stream_io),)
    if not on_gpu:  # GPU mechanisms: a CPU run takes them only when asked for
        holds = tuple(h for h in holds if h.cpu_backend) or holds
        boundary = (1,) if train.boundary_every == "auto" else boundary
        io = (False,) if train.stream_io == "auto" else io
    if cpu_only:
        holds = (GPU_FP32,) if asked_hold is None else holds
        acts = (DEVICE_ACTIVATIONS,) if asked_acts is None else acts
    chunks = [int(train.loss_chunk)]
    while chunks[-1] // 2 >= MIN_LOSS_CHUNK:
        chunks.append(chunks[-1] // 2)
    if cpu_only:
        chunks = chunks[:1]
    act_gpu = None if train.activations_gpu_blocks == "auto" else int(train.activations_gpu_blocks)
    if act_gpu is None and (not on_gpu or devices > 1 or cpu_only):  # a GPU's free room, one GPU
        act_gpu = 0
    return Axes(tuple(micro), tuple(acts), tuple(holds), tuple(boundary), tuple(io), tuple(chunks),
                split=on_gpu and not cpu_only, activations_gpu_blocks=act_gpu)


@dataclass
class Context:
    """What every candidate's evaluation needs: the step's fixed shape and the plan's callbacks."""

    stream_bytes: int
    device_cast: bool
    attn: AttentionExtra | None
    update_state_bytes: float | None
    gpu_usable: float | None
    host_usable: float
    host_of: Callable[[Placement], tuple[float, float]]  # the candidate's host need (build.py: the plan's host
    #                                      rows) and the part of it the order compares (without XLA's GPU pool table)
    step_of: Callable[[Placement], dict]  # the candidate's predicted step (step_model.predicted_step)
    update_shards: int = 1  # GPUs sharing each group's device-side update (sizes.PhaseInputs.update_shards)
    hold_shards: int = 1  # GPUs sharing each gradient held on them (sizes.PhaseInputs.hold_shards)
    memo: PlanMemo | None = field(default=None, repr=False, compare=False)  # the make_plan call's: its searches
    #                      of the same shapes with the same fixed inputs (``attn`` the same function) share tables
    # per Shapes object (``_tables``): each candidate's GPU phases by what they depend on (``_phases``: candidates
    # differing only in what the phases do not read, a host hold's kind or its host side, share them), and the
    # split searches' counts by the phases of their base (``_once``)
    _tables: dict[int, tuple[Shapes, dict, dict]] = field(default_factory=dict, init=False, repr=False,
                                                          compare=False)


@dataclass
class Result:
    best: Placement  # the chosen candidate (the closest one where none fits: ``best.fits`` is False)
    tried: int  # candidates evaluated
    fitting: int  # of them, those that fit
    candidates: list[Placement]  # every candidate evaluated (tests check none fits when refused)
    shapes: Shapes | None = None
    axes: Axes | None = None
    ctx: Context | None = None


STEP_TOL = 0.02  # predicted steps within 2% of the fastest are taken as equal (the prediction is no finer)
HOST_TOL = 0.01  # host needs within 1% of the least among those are taken as equal (compared without XLA's
#                  GPU pool table: it follows the GPU bytes, no reason to give up exact fp32 gradients)


def rank(p: Placement) -> tuple:
    """The order among candidates already equal in step and host memory (``choose``)."""
    return (p.step["predicted_step_s"], p.step["work_s"], p.micro_batches, -p.loss_chunk, p.gpu_need, p.host_need)


def choose(fitting: list[Placement]) -> Placement | None:
    """The fastest fitting candidate: among those within STEP_TOL of the fastest predicted step, those
    within HOST_TOL of the least host memory, then by ``rank`` (exact step, total work, fewer
    micro-batches, the larger loss chunk, less GPU memory)."""
    if not fitting:
        return None
    fastest = min(p.step["predicted_step_s"] for p in fitting)
    near = [p for p in fitting if p.step["predicted_step_s"] <= fastest * (1 + STEP_TOL)]
    least = min(p.host_placed for p in near)
    lean = [p for p in near if p.host_placed <= least * (1 + HOST_TOL)]
    return min(lean, key=rank)


def shortfall(p: Placement, ctx: Context) -> float:
    """How far a candidate is from fitting, as a share of each limit (0: it fits)."""
    gpu = max(p.gpu_need - ctx.gpu_usable, 0.0) / ctx.gpu_usable if ctx.gpu_usable else 0.0
    host = max(p.host_need - ctx.host_usable, 0.0) / max(ctx.host_usable, 1.0)
    return gpu + host


def group_bytes(shapes: Shapes, n: int, io: bool = False) -> float:
    """bf16 bytes of the first ``n`` groups in forward order (embedding, block 0, 1, ...)."""
    return 2.0 * group_params(shapes, n, io)


def group_params(shapes: Shapes, n: int, io: bool = False) -> int:
    """Parameters of the first ``n`` groups held on the GPU; with ``stream_io`` (``io``) the embedding's
    gradient is made in host memory and waits there (engine/holds.HostArray), so its place holds nothing."""
    return 0 if n <= 0 else (0 if io else shapes.embed) + (min(n, shapes.layers + 1) - 1) * shapes.block


def evaluate(shapes: Shapes, ctx: Context, c: Candidate, want_rows: bool = False) -> Placement:
    """Candidate ``c`` evaluated: its GPU phases, host need, predicted step, and whether it fits both (its GPU rows
    only with ``want_rows``: ``gpu_rows`` makes them for the one taken)."""
    return _costed(ctx, _placed(shapes, ctx, c, want_rows=want_rows))


def _placed(shapes: Shapes, ctx: Context, c: Candidate, want_rows: bool = False) -> Placement:
    """Candidate ``c`` with its GPU phases only (``fits`` False, no host need or step: ``_costed`` adds them). The
    split searches (``_most``, ``_split``) try several counts by their GPU need alone and keep one."""
    if want_rows:
        phases, rows = gpu_phases(shapes, _phase_inputs(shapes, ctx, c), want=True)
        need = max(phases.values())
    else:
        phases, need = _phases(shapes, ctx, c)
        phases, rows = dict(phases), []  # (a copy: the plan adds phases to the one it takes)
    return Placement(c, phases, rows, need, False, seq_tile=shapes.seq_tile,
                     grad_hold_gpu_params=group_params(shapes, c.grad_hold_gpu_groups, c.stream_io),
                     blocks_queued=shapes.blocks_queued)


def _phase_inputs(shapes: Shapes, ctx: Context, c: Candidate) -> PhaseInputs:
    return PhaseInputs(
        micro_batches=c.micro_batches, stream_bytes=ctx.stream_bytes, device_cast=ctx.device_cast,
        act_on_gpu=c.activations.on_gpu, hold_bytes=c.hold.gpu_bytes, loss_chunk=c.loss_chunk, deferred=True,
        attn=ctx.attn, update_state_bytes=ctx.update_state_bytes, boundary_every=c.boundary_every,
        stream_io=c.stream_io, grad_hold_gpu_bytes=group_bytes(shapes, c.grad_hold_gpu_groups, c.stream_io),
        resweep=c.hold.is_resweep, activations_gpu_blocks=c.activations_gpu_blocks, update_shards=ctx.update_shards,
        hold_shards=ctx.hold_shards)


def _tables(shapes: Shapes, ctx: Context) -> tuple[Shapes, dict, dict]:
    """(``shapes``, its GPU phases table, its split counts table) for this search. Keyed per ``Shapes`` object,
    which the entry keeps alive (so its ``id`` is not reused); with the plan's memo, shared by every search of
    equal shapes and context inputs in the ``make_plan`` call (the counts also read the GPU room)."""
    got = ctx._tables.get(id(shapes))
    if got is None:
        if ctx.memo is None:
            got = (shapes, {}, {})
        else:
            key = (repr(shapes), ctx.stream_bytes, ctx.device_cast, ctx.attn, ctx.update_state_bytes,
                   ctx.update_shards, ctx.hold_shards)
            got = (shapes, ctx.memo.table("phases", *key), ctx.memo.table("split counts", *key, ctx.gpu_usable))
        ctx._tables[id(shapes)] = got
    return got


def _phases(shapes: Shapes, ctx: Context, c: Candidate) -> tuple[dict[str, float], float]:
    """(GPU phases, their peak) of candidate ``c``, computed once per search (or plan memo: ``_tables``) for each
    distinct ``Candidate.phase_key`` (``gpu_phases`` is a pure function of the shapes and the ``PhaseInputs``, whose
    rest is the context's)."""
    memo, key = _tables(shapes, ctx)[1], c.phase_key
    got = memo.get(key)
    if got is None:
        phases, _ = gpu_phases(shapes, _phase_inputs(shapes, ctx, c), want=False)
        got = memo[key] = (phases, max(phases.values()))
    return got


def _costed(ctx: Context, p: Placement) -> Placement:
    """``p`` with its host need, predicted step and whether it fits both."""
    p.host_need, p.host_placed = ctx.host_of(p)
    p.step = ctx.step_of(p)
    p.fits = (ctx.gpu_usable is None or p.gpu_need <= ctx.gpu_usable) and p.host_need <= ctx.host_usable
    return p


def gpu_rows(shapes: Shapes, ctx: Context, p: Placement) -> list:
    """The GPU rows of candidate ``p`` (evaluated again, with them)."""
    return _placed(shapes, ctx, p.candidate, want_rows=True).gpu_rows


def _counted(shapes: Shapes, ctx: Context, base: Placement, **change: int) -> tuple[dict[str, float], float]:
    """(GPU phases, peak) of ``base`` with its split counts changed, without making the candidate (the split
    searches try several counts and keep one). The phases are the memo's: read them, do not change them."""
    return _phases(shapes, ctx, base.candidate.with_(**change))


def _again(shapes: Shapes, ctx: Context, base: Placement, **change: int) -> Placement:
    """``base`` with its split counts changed (``grad_hold_gpu_groups``, ``activations_gpu_blocks``), its GPU
    phases only (``_placed``)."""
    return _placed(shapes, ctx, base.candidate.with_(**change))


def _once(shapes: Shapes, ctx: Context, base: Placement, what: Any, count: Callable[[], int | None]) -> int | None:
    """``count()``, a split search's count ``what`` for ``base``, once for bases of equal GPU phases: the split
    searches read only those (by ``base``'s decisions, as ``_phases`` keys them), its peak and the GPU room."""
    counts = _tables(shapes, ctx)[2]
    key = (what, base.candidate.phase_key, base.gpu_need)
    if key not in counts:
        counts[key] = count()
    return counts[key]


def _most(shapes: Shapes, ctx: Context, base: Placement, what: str, top: int) -> Placement | None:
    """``base`` with the largest count ``what`` (1..``top``) whose GPU phases fit (``_most_count``)."""
    n = _once(shapes, ctx, base, (what, top), lambda: _most_count(shapes, ctx, base, what, top))
    return None if n is None else _again(shapes, ctx, base, **{what: n})


def _most_count(shapes: Shapes, ctx: Context, base: Placement, what: str, top: int) -> int | None:
    """The largest count ``what`` (1..``top``) whose GPU phases fit on ``base``: each phase grows by
    a fixed number of bytes per unit of it (a layer of activations, a group's bf16 gradient), read off
    the counts 1 and 2, so the largest that fits is computed, then checked."""
    if ctx.gpu_usable is None or top < 1:
        return None
    one, need_one = _counted(shapes, ctx, base, **{what: 1})
    if need_one > ctx.gpu_usable:
        return None
    if top == 1:
        return 1
    two, need_two = _counted(shapes, ctx, base, **{what: 2})
    n = top
    for name, at_one in one.items():
        per = two[name] - at_one
        if per > 0:
            n = min(n, 1 + int((ctx.gpu_usable - at_one) // per))
    for _ in range(4):  # (the counts are whole blocks: a phase's growth may not be exactly linear)
        if n <= 1:
            break
        if (need_two if n == 2 else _counted(shapes, ctx, base, **{what: n})[1]) <= ctx.gpu_usable:
            return n
        n -= max(1, n // 8)
    return 1


def _split(shapes: Shapes, ctx: Context, base: Placement) -> Placement | None:
    """A host hold with as many of its first groups on the GPU (bf16) as the room its peak leaves; on a split
    placement of the activations (whose phases fill the room), as many as the held gradients' own phases
    leave (``_most``)."""
    if ctx.gpu_usable is None:
        return None
    if base.activations_gpu_blocks:
        return _most(shapes, ctx, base, "grad_hold_gpu_groups", shapes.layers + 1)
    n = _once(shapes, ctx, base, "groups in the room", lambda: _split_count(shapes, ctx, base))
    return None if n is None else _again(shapes, ctx, base, grad_hold_gpu_groups=n)


def _split_count(shapes: Shapes, ctx: Context, base: Placement) -> int | None:
    """The groups ``_split`` holds on the GPU beside ``base`` (not a split of the activations), None for none."""
    n = _groups_within(shapes, (ctx.gpu_usable - base.gpu_need) * max(ctx.update_shards, ctx.hold_shards),
                       base.stream_io)  # (each GPU holds its share)
    for _ in range(4):  # the room is the peak's; another phase may be where the groups do not fit
        if n <= 0:
            break
        if _counted(shapes, ctx, base, grad_hold_gpu_groups=n)[1] <= ctx.gpu_usable:
            return n
        n -= max(1, n // 4)
    return None


def _groups_within(shapes: Shapes, room: float, io: bool) -> int:
    """The most first groups (0..layers + 1) whose bf16 bytes fit ``room``: ``group_bytes`` grows with the count,
    so a bisection finds the count that adding one group at a time up to the first that does not fit would."""
    lo, hi, first = 0, shapes.layers + 1, 0 if io else shapes.embed
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if 2.0 * (first + (mid - 1) * shapes.block) <= room:  # group_bytes(shapes, mid, io), 1 <= mid <= layers + 1
            lo = mid
        else:
            hi = mid - 1
    return lo


def _split_acts(shapes: Shapes, ctx: Context, base: Placement) -> Placement | None:
    """Pinned activations with as many of the last blocks' inputs on the GPU as its room allows (the
    held gradients' phases are not the activations': both take the same free room, at other times)."""
    return _most(shapes, ctx, base, "activations_gpu_blocks", shapes.layers - 1)


def variants(shapes: Shapes, ctx: Context, axes: Axes, p: Placement) -> list[Placement]:
    """The split placements tried beside candidate ``p``: pinned activations (every input kept) with the last
    blocks' inputs on the GPU, where that count is searched; and a host hold with its first groups on the GPU,
    on ``p`` and on that split."""
    bases, out = [p], []
    if axes.activations_gpu_blocks is None and p.candidate.splits_activations:
        acts = _split_acts(shapes, ctx, p)
        if acts is not None:
            bases.append(acts)
            out.append(acts)
    if axes.split and p.hold.splits:
        out += [q for q in (_split(shapes, ctx, b) for b in bases) if q is not None]
    return [_costed(ctx, q) for q in out]  # (the split searches compared GPU needs only)


def _search(shapes: Shapes, axes: Axes, ctx: Context) -> Result:
    """Every combination of the axes, except smaller loss chunks once one fits (with the other decisions
    equal, a smaller chunk changes only the loss's GPU bytes and ranks lower)."""
    closest, closest_key, every = None, None, []

    def consider(p: Placement) -> None:
        nonlocal closest, closest_key
        every.append(p)
        if not p.fits:  # the least (shortfall, rank): the rank only where the shortfall does not decide
            short = shortfall(p, ctx)  # (the closest one's key kept: it does not change)
            if closest is None or short < closest_key[0] or (short == closest_key[0] and rank(p) < closest_key[1]):
                closest, closest_key = p, (short, rank(p))

    for micro in axes.micro:
        for act in axes.activations:
            for hold in axes.holds:
                for io in axes.stream_io:
                    for k in axes.boundary:
                        if k > 1 and k >= shapes.layers:
                            continue
                        found = False  # a smaller chunk changes only the loss's GPU bytes: the first that fits
                        fixed = (min(axes.activations_gpu_blocks or 0, shapes.layers - 1)
                                 if act.parked else 0)  # a fixed split of the activations
                        for chunk in axes.loss_chunks:
                            p = evaluate(shapes, ctx, Candidate(micro, act, hold, boundary_every=k, stream_io=io,
                                                                loss_chunk=chunk, activations_gpu_blocks=fixed))
                            consider(p)
                            for q in variants(shapes, ctx, axes, p):
                                consider(q)
                                found = found or q.fits
                            if p.fits or found:
                                break
    fitting = [p for p in every if p.fits]
    between = _frontier(shapes, ctx, axes, fitting)
    every, fitting = every + between, fitting + between
    return Result(choose(fitting) or closest, len(every), len(fitting), every, shapes=shapes, axes=axes, ctx=ctx)


def _frontier(shapes: Shapes, ctx: Context, axes: Axes, fitting: list[Placement]) -> list[Placement]:
    """Between the two splits ``variants`` tries (the most activation blocks on the GPU, then the groups that room
    leaves; or no blocks and the most groups), the counts in between, for the FRONTIER_BEST fastest fitting
    candidates that split both: a held group is a block the resweep does not sweep again (compute) where an
    activation block on the GPU saves PCIe only, so the fastest split may lie between. Only the best few are
    refined (every candidate's would cost the search a third more time for the same choice)."""
    if not axes.split or axes.activations_gpu_blocks is not None:
        return []
    split = sorted((p for p in fitting if p.activations_gpu_blocks and p.boundary_every == 1
                    and p.hold.splits), key=rank)
    out = []
    for p in split[:FRONTIER_BEST]:
        for n in sorted({p.activations_gpu_blocks * f // 8 for f in FRONTIER_EIGHTHS} - {0}):
            q = _split(shapes, ctx, _again(shapes, ctx, p, activations_gpu_blocks=n, grad_hold_gpu_groups=0))
            if q is not None and q.grad_hold_gpu_groups > p.grad_hold_gpu_groups:
                q = _costed(ctx, q)
                if q.fits:
                    out.append(q)
    return out


def search(shapes: Shapes, axes: Axes, ctx: Context) -> Result:
    """The fastest fitting candidate over ``axes`` (the closest one where none fits). With
    ``model.seq_tile=auto`` (``shapes.tile_auto``), where nothing untiled fits or one block's untiled
    working set is over ``TILE_ABOVE`` of the GPU room, the same search with the blocks tiled
    (``AUTO_SEQ_TILE`` tokens): XLA takes a block VJP's temporaries as one allocation, and at 131k
    tokens that one allocation (23.31 GiB) is what ran out of memory (docs/design.md section 6)."""
    res = _tiled_search(shapes, axes, ctx)
    if res.best.fits or res.shapes is None or res.shapes.blocks_queued <= 1:
        return res
    # nothing fits with one block queued behind the running one: the dispatching thread waits for each block
    # instead (a block's weights and accumulator less on the GPU; the bubble is in the predicted step)
    tight = _tiled_search(replace(shapes, blocks_queued=1), axes, ctx)
    if not tight.best.fits:  # the refusal names the closest candidate of the usual pace
        return replace(res, tried=res.tried + tight.tried, candidates=res.candidates + tight.candidates)
    tight.best.notes.append("the engine waits for each block before dispatching the next (blocks_queued=1): "
                            "nothing fits the GPU with one block queued behind the running one")
    tight.tried += res.tried
    tight.candidates = res.candidates + tight.candidates
    return tight


def _tiled_search(shapes: Shapes, axes: Axes, ctx: Context) -> Result:
    res = _search(shapes, axes, ctx)
    if not shapes.tile_auto or shapes.seq <= AUTO_SEQ_TILE:
        return res
    ws = block_working_set(shapes, shapes.tokens // res.best.micro_batches)
    if res.best.fits and (ctx.gpu_usable is None or ws <= TILE_ABOVE * ctx.gpu_usable):
        return res
    tiled = _search(replace(shapes, seq_tile=AUTO_SEQ_TILE), axes, ctx)
    if res.best.fits and not tiled.best.fits:
        return res
    tiled.best.notes.append(f"model.seq_tile=auto: blocks run over {AUTO_SEQ_TILE}-token sequence tiles (untiled, "
                            f"one block's working set would be {ws / 1e9:.1f} GB)")
    tiled.tried += res.tried
    tiled.candidates = res.candidates + tiled.candidates
    return tiled


def describe(p: Placement) -> str:
    """A candidate's decisions as the settings a user types."""
    parts = [f"train.micro_batches={p.micro_batches}", f"train.activations={p.activations.name}",
             f"train.grad_hold={p.hold.name}", f"train.boundary_every={p.boundary_every}",
             f"train.stream_io={'true' if p.stream_io else 'false'}", f"train.loss_chunk={p.loss_chunk}"]
    # (grad_hold_gpu_groups is no setting: the plan decides it, so it is not named)
    if p.activations_gpu_blocks:
        parts.append(f"train.activations_gpu_blocks={p.activations_gpu_blocks}")
    if p.seq_tile:
        parts.append(f"model.seq_tile={p.seq_tile}")
    return " ".join(parts)
