"""The plan searches (issue 27 item 1): every ``auto`` decision is chosen by enumerating candidates and
taking the fastest predicted step that fits the GPU budget and the host limit; a refusal names the
candidate that came closest and a fix that, applied, fits."""
import dataclasses
import os
import re

import pytest

from megatrain_jax.config import load_config
from megatrain_jax.config.schema import GRAD_HOLDS
from megatrain_jax.plan import GB, GiB, make_plan, target_machine
from megatrain_jax.plan.sizes import (GPU_MARGIN, PINNED_ACTS, PINNED_HOLD, PINNED_REUSED, grown_pool, pinned_limit,
                                     pinned_need, pinned_pool, usable)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTING = re.compile(r"\b((?:optim|train|data|model)\.\w+=[^\s,()]+)")


def _cfg(config, *sets):
    return load_config(os.path.join(REPO, config), ["train.final_checkpoint=false", *sets])


def _target(gpu=None, host=None, **kw):
    return target_machine(gpu_memory_gb=gpu, host_memory_gb=host, cpu_cores=16, **kw)


def test_unconstrained_defaults_keep_their_decisions():
    """configs/7b.yaml (16 x 4096) and configs/qwen2.5-7b.yaml (128 x 1024) on an 80 GB H100 with a
    128 GiB host: the decisions of the rule-ordered plan on the H100 (cuDNN attention), unchanged by the search."""
    m = _target(80, 137.4)
    want = {"configs/7b.yaml": dict(micro_batches=4, activations="device", grad_hold="gpu_fp32", stream_copy="host",
                                    update_on="host", keep_residuals=6, seq_tile=0, loss_chunk=4096),
            "configs/qwen2.5-7b.yaml": dict(micro_batches=4, activations="device", grad_hold="gpu_fp32",
                                            stream_copy="device", update_on="host", keep_residuals=1, seq_tile=0,
                                            loss_chunk=4096)}
    for config, decisions in want.items():
        p = make_plan(_cfg(config), m)
        assert p.verdict() is None, config
        o = p.options
        got = {k: getattr(o, k) for k in decisions}
        assert got == decisions, (config, got)
        assert (o.stream_io, o.boundary_every, o.grad_hold_gpu_groups) == (False, 1, 0)


# ---------------------------------------------------------------------------------------------- done-when (CPU)

def _cli_plan(*argv):
    import contextlib
    import io

    from megatrain_jax.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["plan", *argv])
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("argv", [
    ("configs/llama3.1-8b.yaml", "--gpu-memory-gb", "24", "--host-memory-gb", "128"),
    ("configs/llama3.1-8b.yaml", "--gpu-memory-gb", "10", "--host-memory-gb", "128"),
    ("configs/llama3.1-8b.yaml", "--gpu-memory-gb", "10"),  # this machine's host: its own verdict, same decisions line
    ("configs/llama2-70b.yaml", "--gpu-memory-gb", "141", "--host-memory-gb", "512"),
])
def test_plan_command_fits_the_issue_machines_and_prints_the_decisions(argv):
    """Issue 27's CPU checks: the 8B shape (16 x 4096) fits a 24 GB and a 10 GB GPU with a 128 GB host,
    Llama-2-70B fits a 141 GB GPU with a 512 GB host, clipping on; the plan prints every decision."""
    rc, out, err = _cli_plan(*argv, "--set", "train.final_checkpoint=false")
    assert "decisions: micro_batches=" in out and "grad_hold=" in out and "stream_io=" in out
    assert "boundary_every=" in out and "loss_chunk=" in out
    if "--host-memory-gb" in argv:
        assert rc == 0 and "verdict: fits" in out, out[-2000:] + err
    cfg = _cfg(argv[0])
    assert cfg.optim.clip_norm == 1.0


def test_the_plan_builds_the_new_engine_options():
    """A small GPU with a big host: the options carry the search's hold split, streaming and boundaries."""
    p = make_plan(_cfg("configs/llama3.1-8b.yaml"), _target(24, 128))
    o = p.options
    assert p.verdict() is None
    assert o.grad_hold in GRAD_HOLDS and o.grad_hold != "auto"
    assert (o.stream_io, o.boundary_every, o.grad_hold_gpu_groups) == (
        p.decisions["stream_io"], p.decisions["boundary_every"], p.decisions["grad_hold_gpu_groups"])
    assert p.gpu_need <= usable(p.gpu_budget, GPU_MARGIN)


def test_fixed_settings_restrict_the_search():
    p = make_plan(_cfg("configs/llama3.1-8b.yaml", "train.grad_hold=host_bf16", "train.stream_io=false",
                       "train.boundary_every=2", "train.activations=device"), _target(24, 128))
    o = p.options
    assert (o.grad_hold, o.stream_io, o.boundary_every, o.activations) == ("host_bf16", False, 2, "device")


def test_the_pinned_pool_is_counted_as_xla_grows_it(monkeypatch):
    """XLA's pinned-host allocator is a BFC allocator with growth: regions double from 2 MiB, every page
    locked, the last cut at XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB. The H100 run with 49.3 GB of pinned arrays
    (8B, 24 GB budget, pinned activations and hold, 16 micro-batches, loss chunk 1024; XLA's default limit,
    64 GiB) peaked at 121.4 GB RSS where the plan said 100.7: with that limit the plan is within 5% of it."""
    import megatrain_jax.plan.sizes as sizes

    args = ("configs/llama3.1-8b.yaml", "train.gpu_memory_gb=24", "train.activations=pinned_host", "train.activations_gpu_blocks=0",
            "train.grad_hold=pinned_host", "train.micro_batches=16", "train.loss_chunk=1024",
            "train.stream_io=false", "train.boundary_every=1")
    tight = make_plan(_cfg(*args), _target(85.5, 137.4))  # the limit the plan now gives XLA
    with monkeypatch.context() as m:
        m.setattr(sizes, "pinned_limit", lambda pinned, chunk=0.0: 64.0 * GiB)
        p = make_plan(_cfg(*args), _target(85.5, 137.4))
        assert p.verdict() is None
        assert abs(p.host_need / GB - 121.4) / 121.4 < 0.05
        pinned = pinned_need(p.rows)
        assert pinned_pool(pinned) == pytest.approx(grown_pool(pinned))  # under 64 GiB
    # the plan's own limit cuts the last region: the pool is the arrays and a little room, not a doubling
    assert pinned_pool(pinned) == pinned_limit(pinned) < grown_pool(pinned)
    assert pinned_limit(pinned) <= pinned * 1.02 + 3 * GiB
    assert tight.host_need < p.host_need - 10 * GB
    # and Llama-3.2-3B (8 x 4096, 24 GB, int8, pinned activations, bf16 hold): 30.3 GB RSS where the plan said 27.3
    # (its pool under any limit: 2 + 4 + ... MiB regions up to its arrays)
    q = make_plan(_cfg("configs/3b.yaml", "train.gpu_memory_gb=24", "optim.moments=int8", "train.stream_copy=device",
                       "train.activations=pinned_host", "train.activations_gpu_blocks=0", "train.grad_hold=gpu_bf16", "train.stream_io=false",
                       "train.boundary_every=1"), _target(85.5, 137.4))
    assert abs(q.host_need / GB - 30.3) / 30.3 < 0.05


def test_held_gradients_reuse_the_pinned_space_of_the_activations_they_follow():
    """With pinned activations and a pinned hold, block i's gradient lands while only the inputs of blocks <= i
    still wait: the pool holds the larger of those sums (+ PINNED_REUSE_ROOM), not activations + hold. H100,
    Llama-3.1-8B shape 16 x 4096, int8, clipping 1.0 (bench_gpu_budgets.py): at 10 GB (16 micro-batches, host update)
    88.5 GB RSS where the plan now says 88.7 (it said 103.7 counting both), and with XLA's limit at 30 GiB (the
    exchange without the room) it ran out of pinned memory; at 24 GB (8 micro-batches, 17 groups on the GPU,
    device update) 83.1 GB against 83.8."""
    base = ("configs/llama3.1-8b.yaml", "optim.moments=int8", "train.stream_copy=device", "optim.clip_norm=1.0",
            "train.activations=pinned_host", "train.activations_gpu_blocks=0", "train.grad_hold=pinned_host", "train.stream_io=true",
            "train.boundary_every=1")
    for budget, micro, measured in [(10, 16, 88.5), (24, 8, 83.1)]:
        p = make_plan(_cfg(*base, f"train.gpu_memory_gb={budget}", f"train.micro_batches={micro}"),
                      _target(85.52, 135.1))
        assert p.verdict() is None
        rows = {r.what: r.bytes for r in p.rows}
        acts, held, in_use = rows[PINNED_ACTS], rows[PINNED_HOLD], p.settings.pinned_pool_bytes
        assert max(acts, held) < in_use < pinned_need(p.rows) and rows[PINNED_REUSED] < 0
        assert abs(p.host_need / GB - measured) / measured < 0.05, (budget, p.host_need / GB)
        if budget == 10:
            assert p.options.grad_hold_gpu_groups == 0 and pinned_limit(in_use) > 30 * GiB
    # the bf16 hold: half the hold's pool, and XLA's limit follows the pool the host rows count (when the limit
    # was taken with 4-byte gradients, and the 8B at 10 GB ran 88.7 GB against a plan of 80.1)
    held = {}
    for hold in ("pinned_host", "pinned_bf16"):
        sets = [s for s in base if "grad_hold" not in s and "gpu_blocks" not in s]
        p = make_plan(_cfg(*sets, f"train.grad_hold={hold}", "train.gpu_memory_gb=10", "train.micro_batches=8"),
                      _target(85.52, 135.1))
        assert p.verdict() is None
        in_rows = sum(r.bytes for r in p.rows if "pinned" in r.what)
        assert p.settings.pinned_pool_bytes == pytest.approx(in_rows), hold
        held[hold] = ({r.what: r.bytes for r in p.rows}[PINNED_HOLD], p.host_need)
    assert held["pinned_bf16"][0] == pytest.approx(held["pinned_host"][0] / 2)
    assert held["pinned_bf16"][1] < held["pinned_host"][1] - 8 * GB
    # nothing is reused unless both are pinned: activations on the GPU leave the hold's arrays as they are
    q = make_plan(_cfg(*base[:4], "train.gpu_memory_gb=24", "train.activations=device", "train.grad_hold=pinned_host"),
                  _target(85.52, 135.1))
    assert q.settings.pinned_pool_bytes == pinned_need(q.rows)
    assert PINNED_REUSED not in {r.what for r in q.rows}


# ---------------------------------------------------------------------------------------------- properties

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

PROPS = dict(deadline=None, derandomize=True, database=None, max_examples=15, phases=(Phase.explicit, Phase.generate),
             suppress_health_check=[HealthCheck.too_slow])  # no shrinking: the failing example is printed
CASES = [("configs/llama3.1-8b.yaml", ()), ("configs/3b.yaml", ("train.batch_size=16", "train.micro_batches=auto")),
         ("configs/qwen2.5-7b.yaml", ("optim.moments=int8", "train.stream_copy=device", "train.micro_batches=auto")),
         ("configs/7b.yaml", ("train.micro_batches=auto", "train.activations=pinned_host"))]


def _every_candidate(found):
    """The whole product of the search's axes, each candidate evaluated afresh (and
    the split placements the search tries beside each, search.variants)."""
    from megatrain_jax.plan import Candidate, search

    ax, out = found.axes, []
    for micro in ax.micro:
        for act in ax.activations:
            for hold in ax.holds:
                for k in ax.boundary:
                    if k > 1 and k >= found.shapes.layers:
                        continue
                    for io in ax.stream_io:
                        for chunk in ax.loss_chunks:
                            c = Candidate(micro, act, hold, boundary_every=k, stream_io=io, loss_chunk=chunk)
                            p = search.evaluate(found.shapes, found.ctx, c)
                            out += [p] + search.variants(found.shapes, found.ctx, ax, p)
    return out


def _apply_fix(config, sets, machine, fix):
    """Plan each alternative a refusal's fix names (settings, or a GPU of N GB) and return the plans."""
    alts = [a for a in fix.split(" fits")[0].split(", or ") if a.strip()]
    plans = []
    for alt in alts:
        m = re.search(r"a GPU with (\d+) GB", alt)
        if m:
            plans.append(make_plan(_cfg(config, *sets), dataclasses.replace(machine, gpu_bytes=int(m.group(1)) * GB),
                                   _mode_table=False))
            continue
        extra = [s for s in SETTING.findall(alt)]
        assert extra, alt
        plans.append(make_plan(_cfg(config, *sets, *extra), machine, _mode_table=False))
    return plans


@pytest.mark.slow
@settings(**PROPS)
@given(case=st.sampled_from(range(len(CASES))), gpu=st.sampled_from([4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 80]),
       host=st.sampled_from([24, 32, 48, 64, 96, 128, 192, 256]))
def test_the_search_fits_whenever_a_candidate_fits(case, gpu, host):
    """A fitting plan fits; a refused one (the GPU, or no candidate at all) has no candidate that fits.
    ``_modes=False``: the same plan and verdict field without the refusal's fix, which this property does not
    read (the fix's search was ~90% of this test's CPU; the fixes are checked below and in test_plan_fixes.py,
    test_plan_properties.py)."""
    config, sets = CASES[case]
    p = make_plan(_cfg(config, *sets), _target(gpu, host), _modes=False)
    r = p.found  # the plan's own search
    err = p.verdict()
    if err is None:
        assert p.fits_host() and p.gpu_need <= usable(p.gpu_budget, GPU_MARGIN)
        return
    if err.field == "GPU memory" or not r.best.fits:
        assert not any(c.fits for c in _every_candidate(r)), err


# the refusals of CASES whose fix names a change that can be applied (not "this machine cannot hold this model"):
# the two such cases among the 15 examples the property test above drew when it also read the fix (a GPU refusal
# fixed by fewer tokens per step, a host refusal fixed by int8 moments); the other refusals it drew named a bigger
# machine only, and nothing was applied
@pytest.mark.parametrize("case,gpu,host", [(3, 6, 192), (3, 80, 48)])
def test_a_refusals_fix_fits_when_applied(case, gpu, host):
    config, sets = CASES[case]
    machine = _target(gpu, host)
    # _mode_table=False: the state modes' table, which nothing here reads, is not planned (same verdict and fix)
    err = make_plan(_cfg(config, *sets), machine, _mode_table=False).verdict()
    assert err is not None and err.field in ("GPU memory", "host memory"), err
    assert " fits" in err.fix and "cannot hold" not in err.fix, err.fix
    plans = _apply_fix(config, sets, machine, err.fix)
    assert plans
    for q in plans:
        assert q.verdict() is None, (err.fix, q.verdict())


def test_budget_benchmark_dry_mode_plans_every_case_and_writes_the_result_fields(tmp_path):
    import json

    import megatrain_jax.bench.budgets as bench

    rows = bench.main(["--dry", "--gpu-gb", "80", "--host-gb", "128", "--shapes", "8b", "--budgets", "10,24,whole",
                       "--out", str(tmp_path)])
    assert [r["case"] for r in rows] == ["8b_10", "8b_24", "8b_whole"]
    for r in rows:
        d = json.load(open(tmp_path / f"budget_{r['case']}.json"))
        for key in ("params", "gpu_budget_gb", "peak_gpu_gb", "plan_gpu_gb", "peak_host_rss_gb", "plan_host_gb",
                    "tokens_per_s", "model_tflops", "clip_norm", "device", "date", "decisions"):
            assert key in d, key
        assert d["fits"] and d["clip_norm"] == 1.0 and d["plan_gpu_gb"] <= (d["gpu_budget_gb"] or 80)


def test_the_machine_table_names_the_largest_model_that_fits():
    from megatrain_jax.plan.machines import largest, table

    text = table(gpus=(24,), hosts=(128,))
    assert text.splitlines()[2].startswith("| 24 GB | ") and "tok/s" in text
    label, p = largest(24, 128, batch=16, seq=4096, cores=16, root=REPO)
    assert p.verdict() is None and p.options.clip_norm == 1.0 and label in text


def test_each_placement_pays_its_cost_in_the_predicted_step():
    """boundary_every k recomputes (k-1)/k of the blocks' forward; resweep runs the backward with its
    recompute again (~+75% of the compute) and streams the blocks again; a pageable hold is copied by
    one host thread; stream_io sends the head twice instead of embedding and head once."""
    from megatrain_jax.placements import ACTIVATION_PLACES, GRAD_HOLD
    from megatrain_jax.plan import Candidate, search

    p = make_plan(_cfg("configs/llama3.1-8b.yaml", "train.update_on=host"), _target(80, 128))
    r = p.found

    def step(micro=4, act="device", hold="gpu_fp32", k=1, io=False, chunk=4096):
        c = Candidate(micro, ACTIVATION_PLACES[act], GRAD_HOLD[hold], boundary_every=k, stream_io=io, loss_chunk=chunk)
        return search.evaluate(r.shapes, r.ctx, c).step

    s1, s2, s4 = step(), step(k=2), step(k=4)
    assert s1["compute_s"] < s2["compute_s"] < s4["compute_s"] < 1.25 * s1["compute_s"]
    rs = step(hold="resweep")
    assert 1.6 < rs["compute_s"] / s1["compute_s"] < 1.8 and rs["h2d_s"] > s1["h2d_s"]
    assert step(hold="host_fp32")["host_copy_s"] > 0 and step(hold="host_bf16")["host_copy_s"] > 0  # bf16: + widening
    assert step(hold="pinned_host")["host_copy_s"] == 0
    # stream_io: the head's chunks twice in bf16 (the host's gather casts them) against both groups once in fp32,
    # and the gather's time on the step's path
    io = step(io=True)
    assert io["compute_s"] > s1["compute_s"] and io["h2d_s"] != s1["h2d_s"]
    assert step(act="pinned_host")["d2h_s"] > s1["d2h_s"]


def test_a_split_placement_keeps_the_last_blocks_inputs_in_the_gpus_free_room():
    """Llama-3.1-8B 16 x 4096 at a 24 GB budget with a 72 GB host limit: parking every input does not fit the host,
    keeping every input does not fit the GPU; the plan keeps the last blocks' inputs on the GPU and parks the others
    (H100, bench_memory_plan.py: 67.1 GB RSS against 68.7, 19.1 GB GPU against 21.7). Each row counts only its share,
    and the activations' PCIe traffic is the parked share's."""
    sets = ("configs/llama3.1-8b.yaml", "optim.moments=int8", "train.stream_copy=device", "optim.clip_norm=1.0",
            "train.gpu_memory_gb=24", "train.host_memory_gb=72")
    p = make_plan(_cfg(*sets), _target(85.52, 135.1), _mode_table=False)  # (no state-mode table: not read here)
    o = p.options
    assert p.verdict() is None and o.activations == "pinned_host" and 0 < o.activations_gpu_blocks < 32
    layer = 16 * 4096 * 4096 * 2  # one block input, bf16
    rows = {r.what: r for r in p.rows}
    assert rows[PINNED_ACTS].bytes == (32 - o.activations_gpu_blocks) * layer
    gpu_acts = next(r for r in p.rows if r.where == "gpu" and r.what == "boundary activations")
    assert gpu_acts.bytes == (o.activations_gpu_blocks + 1) * layer  # one parked layer in flight beside them
    # fixed at 0: every input parked, and the host does not hold that
    none = make_plan(_cfg(*sets, "train.activations=pinned_host", "train.activations_gpu_blocks=0",
                          f"train.micro_batches={o.micro_batches}", f"train.grad_hold={o.grad_hold}",
                          "train.stream_io=true", "train.boundary_every=1"), _target(85.52, 135.1), _mode_table=False)
    assert none.options.activations_gpu_blocks == 0 and none.verdict() is not None
    assert none.host_need > p.host_need + 5 * layer
    assert none.step["d2h_s"] > p.step["d2h_s"]  # every input crosses, not only the parked ones
    # a fixed count is taken as given
    fixed = make_plan(_cfg(*sets, "train.activations=pinned_host", "train.activations_gpu_blocks=3",
                           "train.host_memory_gb=200"), _target(85.52, 135.1), _mode_table=False)
    assert fixed.options.activations_gpu_blocks in (0, 3)  # 3 where the pinned candidate is the one taken
    assert all(c.activations_gpu_blocks == 3 for c in fixed.found.candidates if c.activations.parked)


def test_on_a_gpu_budget_the_host_update_is_planned_beside_the_device_side_one():
    """The device-side update's GPU memory (state in flight, write-back) can cost more than the host update's
    wait after the norm: on a budget both are planned and the faster predicted step taken, with a note."""
    sets = ("configs/llama3.1-8b.yaml", "optim.moments=int8", "train.stream_copy=device", "optim.clip_norm=1.0",
            "train.gpu_memory_gb=24", "train.host_memory_gb=72")
    # _mode_table=False: the state modes' table, which nothing here reads, is not planned (same options and notes)
    auto = make_plan(_cfg(*sets), _target(85.52, 135.1), _mode_table=False)
    device = make_plan(_cfg(*sets, "train.update_on=device"), _target(85.52, 135.1), _mode_table=False)
    assert auto.options.update_on == "host" and device.options.update_on == "device"
    assert auto.step["predicted_step_s"] < device.step["predicted_step_s"]
    assert any("train.update_on=auto: host" in n for n in auto.notes)
    whole = make_plan(_cfg("configs/llama3.1-8b.yaml", "optim.moments=int8", "train.stream_copy=device"),
                      _target(85.52, 135.1), _mode_table=False)
    assert whole.options.update_on == "device"  # no budget: the rule's choice, planned once


def test_an_optax_update_on_the_gpu_keeps_no_residuals():
    """H100, Llama-3.2-3B shape: with the room filled by kept residuals the optax updates on the GPU ran out
    of memory, and without them they ran as fast (bench_memory_plan.py): ``auto`` keeps none there,
    and the fused AdamW keeps its own."""
    import dataclasses

    from megatrain_jax.config import load_config
    from megatrain_jax.plan import make_plan, target_machine

    m = target_machine(gpu_memory_gb=80, host_memory_gb=137)
    fused = make_plan(load_config("configs/3b.yaml", []), m, _modes=False)
    lion = make_plan(load_config("configs/3b.yaml", ["optim.kernel=optax", "optim.name=lion"]), m, _modes=False)
    assert lion.options.update_on == "device" and lion.options.keep_residuals == 0
    assert any("keep_residuals=auto: 0" in n for n in lion.notes)
    assert fused.options.keep_residuals > 0
    asked = make_plan(load_config("configs/3b.yaml", ["optim.kernel=optax", "optim.name=lion",
                                                      "train.keep_residuals=2"]), m, _modes=False)
    assert asked.options.keep_residuals == 2  # a number the user set is kept


def test_a_resweep_splits_the_gpus_room_between_activation_blocks_and_held_groups_where_that_is_fastest():
    """Llama-3.1-8B, resweep, a 24 GB GPU: a held group is a block the second sweep does not run again, an
    activation block on the GPU saves only PCIe, so the fastest split lies between the most blocks and none.
    Before the frontier (search._frontier) the search tried only those two ends: 13 groups and no blocks, 10.88 s
    predicted; now 1 block and 23 groups, 9.57 s. The auto plan is no slower than any count set by hand."""
    m = target_machine(gpu_memory_gb=24, host_memory_gb=128, cpu_cores=8)  # (as the regression set's g24)
    auto = make_plan(_cfg("configs/llama3.1-8b.yaml", "train.grad_hold=resweep"), m)
    assert auto.verdict() is None
    o = auto.options
    assert o.activations == "pinned_host" and o.activations_gpu_blocks >= 1 and o.grad_hold_gpu_groups >= 1
    for n in (0, 4, 8):
        fixed = make_plan(_cfg("configs/llama3.1-8b.yaml", "train.grad_hold=resweep",
                               f"train.activations_gpu_blocks={n}"), m)
        assert fixed.verdict() is None, n
        assert auto.step["predicted_step_s"] <= fixed.step["predicted_step_s"] * 1.0001, n
        if n == 0:  # the end the search found before: fewer held groups, slower
            assert fixed.options.grad_hold_gpu_groups < o.grad_hold_gpu_groups
            assert auto.step["predicted_step_s"] < 0.95 * fixed.step["predicted_step_s"]


def test_an_optax_update_over_several_gpus_holds_each_gradient_split_between_them():
    """A device-side optax update (Adafactor) runs whole on every GPU, and each GPU holds only its share of a held
    gradient (engine/device_updates: gathered when the update starts). The 110B lean on 4 H200s held 11 groups for
    its resweep where one GPU holds 17, and swept the other 69 twice (bench_memory_plan.py); held split, all 82 groups fit
    and no second sweep runs. The held row is a quarter of the one-GPU hold's bytes, and the gathered gradients are
    counted in the update's row."""
    m4 = target_machine(gpu_memory_gb=150.75, host_memory_gb=540.9, cpu_cores=64, gpu_count=4)
    four = make_plan(_cfg("configs/lean-110b.yaml", "train.batch_size=32", "train.devices=4"), m4)
    assert four.verdict() is None and four.options.update_on == "device"
    assert four.options.grad_hold == "gpu_bf16"  # (every group held: no resweep)
    held = next(r for r in four.rows if r.what == "gradients held for clipping")
    assert "each GPU its 1/4" in held.note
    # bf16, a quarter of every block parameter (stream_io: the embedding's and head's wait in host memory)
    assert 0.95 * 2 * four.params / 4 < held.bytes <= 2 * four.params / 4
    forced = make_plan(_cfg("configs/lean-110b.yaml", "train.batch_size=32", "train.devices=4",
                            "train.grad_hold=resweep"), m4)
    assert forced.verdict() is None and forced.options.grad_hold_gpu_groups > 40  # (17 on one GPU)
    assert four.step["predicted_step_s"] < forced.step["predicted_step_s"]


def test_the_110b_on_one_h200_hides_the_embeddings_host_update_in_the_second_sweep():
    """The 110B lean on one H200 of the 512 GiB machine, as its measured run planned it (resweep, 24 groups held,
    stream_io, a device-side update): the embedding's host update starts at the norm and runs under the second
    sweep (engine: Updates.start_on_host), so the step waits for no update the forward does not hide; an H200's
    memory passes are counted at its 4.3 TB/s (an H100's 3.0), and the backward sweeps that recompute at their own
    rate (RECOMPUTE_BACKWARD_SPEEDUP): the prediction within 10% of each step measured (bench_memory_plan.py)."""
    import dataclasses as dc

    from megatrain_jax.plan.step_model import step_rates

    h100 = target_machine(gpu_memory_gb=150.754820096, host_memory_gb=540.908769280, cpu_cores=64)
    h200 = dc.replace(h100, gpu_name="NVIDIA H200")
    assert step_rates(h100)["gpu_memory"] == 3.0e12 and step_rates(h200)["gpu_memory"] == 4.3e12
    p = make_plan(_cfg("configs/lean-110b.yaml", "train.steps=4", "optim.schedule.kind=constant"), h200, devices=1)
    o, s = p.options, p.step
    assert (o.grad_hold, o.grad_hold_gpu_groups, o.stream_io, o.update_on) == ("resweep", 24, True, "device")
    assert s["updates_after_norm_s"] == pytest.approx(s["compute_s"]) and "H200's memory" in p.step_basis
    measured = (70.90, 68.76, 72.82)  # steps 2-4, bench_memory_plan.py, one H200
    assert all(abs(s["predicted_step_s"] / m - 1) < 0.10 for m in measured), s["predicted_step_s"]
