"""The memory plan: sizes by component, decisions, and refusals (host, GPU, disk) before anything
is allocated; the `plan` command and the train command's one-line refusal."""
import json
import os
import re
import subprocess
import sys
import time

import pytest

from megatrain_jax.config import load_config
from megatrain_jax.errors import UserError
from megatrain_jax.plan import GB, GiB, Machine, make_plan, plan_json, plan_table

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100 = Machine("gpu", 128 * GiB, 125 * GiB, "MemTotal", 81559 * 2 ** 20, "test", 1, "H100", 16, {})


def _plan(config, *sets, machine=H100):
    return make_plan(load_config(os.path.join(REPO, config), ["train.final_checkpoint=false", *sets]), machine)


def test_store_rows_are_the_bytes_per_parameter_of_each_mode():
    for sets, want in [((), 4 + 8), (("optim.moments=bfloat16", "train.stream_copy=device"), 4 + 4),
                       (("optim.moments=int8", "train.stream_copy=device"), 4 + 2 + 8 / 2048)]:
        p = _plan("configs/qwen2.5-7b.yaml", *sets)
        store = sum(r.bytes for r in p.rows if r.what.startswith(("fp32 master", "optimizer state")))
        assert abs(store / p.params - want) < 1e-6
    full = _plan("configs/qwen2.5-7b.yaml", "train.stream_copy=host")
    copy = [r for r in full.rows if "bf16 streaming copy" in r.what][0]
    assert copy.bytes == 2 * (full.params - 2 * 152064 * 3584 - 3584)  # blocks only: embedding and head stream fp32


def test_slab_pool_is_deep_for_speed_and_shallow_in_the_leanest_mode():
    """auto slabs: 24 where the host has room (they keep the optimizer fed), 6 with int8 moments (the
    leanest state is chosen for memory; its kernel, not the pool, paces the updates); N when set."""
    assert _plan("configs/qwen2.5-7b.yaml").decisions["grad_slabs"] == 24
    lean = _plan("configs/qwen2.5-7b.yaml", "optim.moments=int8", "train.stream_copy=device", "train.update_on=host")
    assert lean.decisions["grad_slabs"] == 6
    row = [r for r in lean.rows if "pinned slabs" in r.what][0]
    assert row.bytes == 6 * 128 * 2 ** 20
    assert _plan("configs/qwen2.5-7b.yaml", "optim.moments=int8", "train.grad_slabs=12",
                 "train.update_on=host").decisions["grad_slabs"] == 12
    # a device-side update (auto with int8 moments on a GPU) brings no gradient to the host: no slabs
    dev = _plan("configs/qwen2.5-7b.yaml", "optim.moments=int8", "train.stream_copy=device")
    assert dev.decisions["update_on"] == "device" and not any("pinned slabs" in r.what for r in dev.rows)


def test_stream_copy_auto_casts_on_the_gpu_where_the_transfer_hides_behind_compute():
    """auto: Qwen2.5-7B at 128 x 1024 (fp32 stream / forward ~0.18) and Llama-2-7B at 32 x 4096 drop the
    host copy; Llama-2-7B at 16 x 4096 (~0.35, measured 4% slower when cast on the GPU) keeps it;
    a host too small for the copy drops it whatever the ratio; fp32 compute has no copy to drop."""
    def copy_rows(p):
        return [r for r in p.rows if "bf16 streaming copy" in r.what]

    for cfg, sets, want in [("configs/qwen2.5-7b.yaml", (), "device"), ("configs/7b.yaml", (), "host"),
                            ("configs/7b.yaml", ("train.batch_size=32",), "device"),
                            ("configs/7b.yaml", ("train.host_memory_gb=95",), "device"),
                            ("configs/7b.yaml", ("train.compute_dtype=float32",), "host")]:
        p = _plan(cfg, *sets)
        assert p.decisions["stream_copy"] == want, (cfg, sets)
        assert bool(copy_rows(p)) == (want == "host" and "train.compute_dtype=float32" not in sets)
    assert _plan("configs/qwen2.5-7b.yaml").host_bytes_per_param <= 14.0


def test_defaults_fit_the_h100_machine_and_keep_everything_on_the_gpu():
    for cfg, sets in [("configs/7b.yaml", ()), ("configs/7b.yaml", ("train.batch_size=32",)),
                      ("configs/qwen2.5-7b.yaml", ())]:
        p = _plan(cfg, *sets)
        assert p.verdict() is None
        assert p.decisions["activations"] == "device" and p.decisions["grad_hold"] == "gpu_fp32"
        assert p.decisions["gpu_mem_fraction"] == 0.95 and p.gpu_need < p.gpu_budget


def test_a_24gb_budget_reshapes_the_plan_to_fit():
    free = _plan("configs/3b.yaml", "train.batch_size=16", "train.micro_batches=auto")
    small = _plan("configs/3b.yaml", "train.batch_size=16", "train.micro_batches=auto", "train.gpu_memory_gb=24")
    assert free.gpu_need > 24 * GB >= small.gpu_need and small.verdict() is None
    searched = ("micro_batches", "activations", "grad_hold", "stream_io", "boundary_every", "loss_chunk")
    assert [small.decisions[k] for k in searched] != [free.decisions[k] for k in searched]
    assert small.decisions["gpu_mem_fraction"] == pytest.approx(24 * GB / H100.gpu_bytes, rel=1e-3)


def test_auto_micro_batches_keep_micro_batches_near_16k_tokens():
    p = _plan("configs/7b.yaml", "train.micro_batches=auto")
    assert p.decisions["micro_batches"] == 4  # 16 x 4096 tokens


@pytest.mark.parametrize("what,sets,machine,field", [
    ("host", (), Machine("cpu", 24 * GiB, 22 * GiB, "MemTotal", None, "", 0, "", 2, {}), "host memory"),
    ("gpu", ("data.seq_len=65536", "train.batch_size=8", "train.micro_batches=1", "train.grad_hold=gpu_fp32",
             "train.activations=device"), H100, "GPU memory"),
    ("disk", ("train.final_checkpoint=true",), Machine("gpu", 128 * GiB, 125 * GiB, "MemTotal", 81559 * 2 ** 20, "",
                                                         1, "H100", 16, {"runs/7b": 60 * GB}), "disk"),
])
def test_refusals_name_the_component_the_bytes_and_the_fix(what, sets, machine, field):
    err = _plan("configs/7b.yaml", *sets, machine=machine).verdict()
    assert isinstance(err, UserError) and err.field == field
    text = str(err)
    assert "GB" in text and "fix:" in text and "\n" not in text


def test_host_refusal_names_no_mode_that_does_not_fit():
    """7B on a 24 GiB machine: even the leanest state mode needs far more than the host (issue 26 item 7:
    the fix named optim.moments=int8 while the modes line said it needs 81.5 GB). The fix says the machine
    cannot hold the model at the configured tokens and names, for each alternative, the least host limit at
    which that config fits (issue 43: planned at the configured batch and sequence, not at 1 x 64 tokens):
    applied, each fits, and 2 GB less does not; it still offers the override."""
    cpu24 = Machine("cpu", 24 * GiB, 22 * GiB, "MemTotal", None, "", 0, "", 2, {})
    for sets in (("train.stream_copy=host",), ()):
        p = _plan("configs/7b.yaml", *sets, machine=cpu24)
        err = p.verdict()
        assert not any(m["fits_host"] for m in p.modes.values())
        assert "cannot hold this model at 16 x 4096 tokens" in err.fix and "if this machine's limit is misread" in err.fix
        alternatives = err.fix.split(" fits:")[0].split(", or ")
        assert alternatives
        for alt in alternatives:
            settings = re.findall(r"\b((?:optim|train|data)\.\w+=[^\s,()]+)", alt.split(" with ")[0]) \
                if " with " in alt else []
            limit = int(re.search(r"a host limit of (\d+) GB", alt).group(1))
            assert _plan("configs/7b.yaml", *sets, *settings, f"train.host_memory_gb={limit}", machine=cpu24).verdict() \
                is None, alt
            assert not _plan("configs/7b.yaml", *sets, *settings, f"train.host_memory_gb={limit - 2}",
                             machine=cpu24).fits_host(), alt


def test_host_memory_override_is_used_and_named():
    p = _plan("configs/7b.yaml", "train.host_memory_gb=400",
              machine=Machine("gpu", 31 * GiB, 30 * GiB, "MemTotal", 150e9, "", 2, "H200", 32, {}))
    assert p.verdict() is None and p.host_source == "train.host_memory_gb"


def test_table_and_json():
    p = _plan("configs/qwen2.5-7b.yaml")
    table = plan_table(p)
    for words in ("fp32 master weights", "gradients held for clipping", "predicted step", "bytes/param", "verdict: fits"):
        assert words in table
    d = json.loads(plan_json(p))
    assert d["fits"] and d["decisions"]["micro_batches"] == 4 and d["step"]["binding"] == "compute_s"


def _cli(*args, env=None):
    e = dict(os.environ, JAX_PLATFORMS="cpu", **(env or {}))
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "megatrain_jax", *args], cwd=REPO, env=e, capture_output=True, text=True,
                       timeout=120)
    return r, time.time() - t0


def test_train_7b_is_refused_on_this_machine_before_anything_is_allocated(tmp_path):
    """Refused from the plan, not by the OOM killer: the process never holds the 7B store (about 100 GB;
    the largest child of this test process stays under 8 GB). No wall-clock assertion."""
    import resource

    out = tmp_path / "run"
    r, _ = _cli("train", "configs/7b.yaml", "--set", f"train.out_dir={out}", "--set", "train.host_memory_gb=24")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 < 8e9
    assert r.stderr.startswith("error: host memory:") and r.stderr.strip().count("\n") == 0
    assert not out.exists()


def _in_process(capsys, *args):
    """``cli.main(ARGS)`` here (the refusals and the plan command need no process of their own)."""
    from cli_runner import run_in_process

    return run_in_process([args[0], os.path.join(REPO, args[1]), *args[2:]], capsys)


def test_train_refuses_a_gpu_plan_that_cannot_fit(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setenv("MEGATRAIN_GPU_MEMORY_GB", "24")
    r = _in_process(capsys, "train", "configs/7b.yaml", "--set", f"train.out_dir={out}", "--set",
                    "train.host_memory_gb=2000", "--set", "train.final_checkpoint=false", "--set",
                    "train.micro_batches=1", "--set", "data.seq_len=65536")
    assert r.rc == 2 and r.stderr.startswith("error: GPU memory:"), r.stderr
    assert not out.exists()


def test_plan_command_prints_the_table_and_json(capsys):
    r = _in_process(capsys, "plan", "configs/7b.yaml", "--set", "train.host_memory_gb=2000", "--set",
                    "train.final_checkpoint=false")
    assert r.rc == 0 and "memory plan" in r.stdout and "verdict: fits" in r.stdout
    r = _in_process(capsys, "plan", "configs/7b.yaml", "--json", "--set", "train.host_memory_gb=10")
    assert r.rc == 2 and json.loads(r.stdout)["fits"] is False and "host memory" in r.stderr


def test_plan_shows_each_state_mode_and_suggests_the_fullest_that_fits():
    """Qwen2.5-14B on the H100 machine: full state does not fit its 128 GiB; the plan lists bytes/param per
    mode and the refusal names the compact mode, which fits, rather than a generic list."""
    p = _plan("configs/qwen2.5-14b.yaml", "optim.moments=float32", "train.stream_copy=auto")
    assert set(p.modes) == {"full", "compact", "leanest"}
    assert p.modes["full"]["bytes_per_param"] > p.modes["compact"]["bytes_per_param"] > p.modes["leanest"]["bytes_per_param"]
    assert not p.modes["full"]["fits_host"] and p.modes["leanest"]["fits_host"]
    err = p.verdict()
    assert err is not None and err.field == "host memory"
    fitting = "compact" if p.modes["compact"]["fits_host"] else "leanest"
    assert f"({fitting}:" in err.fix and "fits" in err.fix
    assert "host state modes: full" in plan_table(p)
    # a mode that fits suggests nothing
    assert _plan("configs/qwen2.5-14b.yaml").fix is None


def test_moe_working_set_counts_every_expert_of_the_dense_formulation():
    """OLMoE shape on the H100 with moe_impl=dense (measured peaks 40.1 GB at 8 micro-batches and 48.3 GB at 4,
    bench_memory_plan.py): the plan counts the (tokens x experts x expert width) intermediates with the dense
    MoE coefficient, so it lands at or above each measurement and within 10% (33.9 GB without them)."""
    for m, measured in [(8, 40.1), (4, 48.3)]:
        p = _plan("configs/olmoe-1b-7b-shape-qwen3moe.yaml", f"train.micro_batches={m}", "model.moe_impl=dense")
        assert 1.0 <= p.gpu_need / GB / measured < 1.10, (m, p.gpu_need / GB)
    p = _plan("configs/olmoe-1b-7b-shape-qwen3moe.yaml", "train.micro_batches=8", "model.moe_impl=dense")
    dense = _plan("configs/olmoe-1b-7b-shape-qwen3moe.yaml", "train.micro_batches=8", "model.num_experts=8",
                  "model.moe_impl=dense")
    assert dense.gpu_need < p.gpu_need


def test_grouped_moe_working_set_counts_the_routed_rows():
    """On the grouped path (moe_impl auto) a token holds its k routed rows, not every expert: the block's
    working set is k x (H + F) x ROUTED_BYTES a token plus each expert's tile padding (plan/moe.py), and the
    step counts the routed experts' FLOPs at the grouped rate, not every expert's."""
    from megatrain_jax.config import load_config
    from megatrain_jax.plan import moe as plan_moe
    from megatrain_jax.plan.sizes import Shapes, block_working_set

    cfg = load_config("configs/olmoe-1b-7b-shape-qwen3moe.yaml", [])
    m = cfg.model
    routed = Shapes.of(m, 4, 4096, "bfloat16")
    dense = Shapes.of(load_config("configs/olmoe-1b-7b-shape-qwen3moe.yaml", ["model.moe_impl=dense"]).model, 4, 4096,
                      "bfloat16")
    assert routed.mlp_width == 8 * (2048 + 1024) and dense.mlp_width == 64 * 1024
    assert routed.routed_pad == 64 * plan_moe.GROUPED_TILE // 8 and dense.routed_pad == 0
    tokens = 16384
    with_pad = block_working_set(routed, tokens)
    assert with_pad < 0.6 * block_working_set(dense, tokens)
    grown = block_working_set(routed, 2 * tokens) - with_pad  # linear in tokens: the routed rows' bytes
    assert abs(grown - 1.12 * tokens * (routed.mlp_width * plan_moe.ROUTED_BYTES + 6.0 * 2048 + 2.0 * 6144
                                        + 2.0 * 2048)) < 1e-6 * grown
    assert m.active_non_embedding_params() < plan_moe.step_matmul_params(m, tokens) < m.non_embedding_params()
    # the grouped rate grows with the rows each expert gets, through the measured points and flat beyond them
    shares = [plan_moe.grouped_rate_share(r) for r in (64, 512, 1024, 1500, 2048, 4096, 65536)]
    points = dict(plan_moe.GROUPED_RATE_POINTS)
    assert shares[0] == shares[1] == points[512] and shares[-1] == shares[-2] == points[4096]
    assert points[1024] < shares[3] < points[2048] and shares[4] == points[2048]
    assert plan_moe.step_matmul_params(m, 2 * tokens) < plan_moe.step_matmul_params(m, tokens)
    p = _plan("configs/olmoe-1b-7b-shape-qwen3moe.yaml")
    assert p.step["binding"] and p.gpu_need < _plan("configs/olmoe-1b-7b-shape-qwen3moe.yaml",
                                                   "model.moe_impl=dense").gpu_need


# ------------------------------------------------------------------ kept residuals (train.keep_residuals)


def test_kept_residuals_auto_fill_the_gpu_room_and_int8_keeps_the_pool_growing_on_demand():
    """auto keeps as many blocks' residuals as the room above the step's peak holds, and says so in the
    rows; with int8 moments (chosen for host memory) only below the line where XLA would preallocate its
    pool (whose allocator table is host memory), so the leanest mode stays lean."""
    from megatrain_jax.plan.sizes import PREALLOCATE_ABOVE

    full = _plan("configs/7b.yaml")
    k = full.decisions["keep_residuals"]
    assert 0 < k < 32 and full.gpu_need <= full.gpu_budget
    assert any(f"last {k} blocks" in r.what for r in full.rows)
    assert "loss, residuals kept" in full.gpu_phases
    none = _plan("configs/7b.yaml", "train.keep_residuals=0")
    assert none.decisions["keep_residuals"] == 0 and none.gpu_need < full.gpu_need
    assert full.step["compute_s"] < none.step["compute_s"]  # k blocks' recompute is saved

    # Qwen3-8B on the H100: bf16 moments take the whole room (and a preallocated pool); int8 moments stop
    # below the preallocation line, with fewer blocks
    lean = _plan("configs/qwen3-8b.yaml", "optim.moments=int8")
    roomy = _plan("configs/qwen3-8b.yaml", "optim.moments=bfloat16")
    assert 0 < lean.decisions["keep_residuals"] < roomy.decisions["keep_residuals"]
    assert lean.gpu_need <= PREALLOCATE_ABOVE * lean.gpu_budget and lean.decisions["gpu_preallocate"] is False
    assert roomy.gpu_need > PREALLOCATE_ABOVE * roomy.gpu_budget and roomy.decisions["gpu_preallocate"] is True


def test_kept_residuals_asked_for_beyond_the_room_are_refused_naming_the_field():
    with pytest.raises(UserError) as e:
        _plan("configs/qwen3-8b.yaml", "optim.moments=int8", "train.keep_residuals=30")
    assert e.value.field == "train.keep_residuals" and "GB" in str(e.value) and "or auto" in str(e.value)
    two = Machine("gpu", 256 * GiB, 250 * GiB, "MemTotal", 141 * 10 ** 9, "sim", 2, "H200", 32, {})
    with pytest.raises(UserError) as e:  # on two GPUs as on one: each GPU's room
        _plan("configs/qwen3-8b.yaml", "optim.moments=int8", "train.keep_residuals=30", "train.batch_size=32",
              machine=two)
    assert e.value.field == "train.keep_residuals" and "or auto" in str(e.value)
    # what fits is taken as asked, and a CPU run keeps none by itself
    assert _plan("configs/qwen3-8b.yaml", "optim.moments=int8", "train.keep_residuals=2").decisions["keep_residuals"] == 2
    cpu = Machine("cpu", 24 * GiB, 22 * GiB, "MemTotal", None, "", 0, "", 2, {})
    assert _plan("configs/tiny.yaml", machine=cpu).decisions["keep_residuals"] == 0


@pytest.mark.parametrize("value", ["-1", "many", "true", "2.5"])
def test_a_bad_keep_residuals_value_is_refused_by_the_config(value):
    with pytest.raises(UserError) as e:
        load_config(os.path.join(REPO, "configs/tiny.yaml"), [f"train.keep_residuals={value}"])
    assert e.value.field == "train.keep_residuals"


def test_the_plans_residual_estimate_covers_the_engines_abstract_residuals():
    """The plan's bytes per kept block are at least what jax.eval_shape of the engine's kernel keeps
    (and not far above it), for a Llama-like and a Qwen3-like block."""
    import jax
    import jax.numpy as jnp

    from megatrain_jax.config import ModelConfig, OptimConfig
    from megatrain_jax.engine import StreamedTrainer
    from megatrain_jax.plan.sizes import Shapes, residual_bytes_per_block
    from megatrain_jax.models.llama import init_host_store
    from megatrain_jax.optim import build_host_optimizer

    for over in (dict(), dict(family="qwen3", head_dim=32)):
        cfg = ModelConfig(vocab_size=256, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                          intermediate_size=320, **over)
        parts, store = init_host_store(cfg, 0, bf16_stream=False)
        st = StreamedTrainer(parts, build_host_optimizer(OptimConfig(), 2), compute_dtype="bfloat16", store=store,
                             keep_residuals=1)
        b, s, micro = 4, 64, 2
        h = jax.ShapeDtypeStruct((b // micro, s, cfg.hidden_size), jnp.bfloat16)
        aux = st.kernels.aux_of(jnp.zeros((b // micro, s), jnp.int32), None)
        engine = micro * st.residual_bytes(h, aux)
        plan = residual_bytes_per_block(Shapes.of(cfg, b, s, "bfloat16"), cfg.dim_per_head)
        assert engine <= plan <= 1.35 * engine, (over, engine, plan)
        st.close()


def test_the_pool_decision_reaches_xla_and_a_users_own_setting_wins(monkeypatch):
    """apply_gpu_settings turns the plan's gpu_preallocate=False into XLA_PYTHON_CLIENT_PREALLOCATE=false
    (set before JAX's backend starts); a preallocating plan sets nothing; a variable the user set stays."""
    from megatrain_jax.plan import apply_gpu_settings

    for var in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"):
        monkeypatch.delenv(var, raising=False)
    lean = _plan("configs/qwen3-8b.yaml", "optim.moments=int8")
    assert lean.decisions["gpu_preallocate"] is False
    apply_gpu_settings(lean)
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == str(lean.decisions["gpu_mem_fraction"])

    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE")
    roomy = _plan("configs/qwen3-8b.yaml", "optim.moments=bfloat16")
    assert roomy.decisions["gpu_preallocate"] is True
    apply_gpu_settings(roomy)
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ

    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    apply_gpu_settings(lean)
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"


@pytest.mark.parametrize("hold", ["gpu_fp32", "pinned_host", "host_bf16"])
def test_stream_io_gradients_are_counted_in_host_memory_and_in_no_hold(hold):
    """With train.stream_io the embedding's and head's fp32 gradients are made in host memory and wait there
    (engine/holds.HostArray), outside any hold: the H100's 524k slice ran 3.9 GB over a plan that counted them
    in the GPU hold instead (bench_memory_plan.py)."""
    vocab, hidden = 128256, 4096  # Llama-3.1-8B, untied: embedding, and head = final norm + output matrix
    io_params = vocab * hidden + (hidden + vocab * hidden)
    sets = ("optim.clip_norm=1.0", "optim.moments=int8", "train.stream_copy=device", "train.stream_io=true",
            f"train.grad_hold={hold}", "train.micro_batches=16", "train.activations=pinned_host",
            "train.activations_gpu_blocks=0")
    p = _plan("configs/llama3.1-8b.yaml", *sets)
    rows = {r.what: r for r in p.rows}
    assert rows["embedding + head gradients (train.stream_io)"].bytes == 4 * io_params
    held_bytes = {"gpu_fp32": 4, "pinned_host": 4, "host_bf16": 2}[hold]
    name = {"gpu_fp32": "gradients held for clipping", "pinned_host": "gradients held for clipping (pinned)",
            "host_bf16": "gradients held for clipping (pageable)"}[hold]
    # a host hold's first groups (forward order) may wait on the GPU in bf16; the embedding's place holds nothing
    n = p.options.grad_hold_gpu_groups if hold != "gpu_fp32" else 0
    m = load_config(os.path.join(REPO, "configs/llama3.1-8b.yaml"), []).model
    on_gpu = max(min(n, m.num_layers + 1) - 1, 0) * m.block_params()
    assert rows[name].bytes == held_bytes * (p.params - io_params - on_gpu)
    # the head's vocabulary chunks: one staging buffer each (the whole head, gathered once a step in the background),
    # two chunk gradients in XLA's pinned pool (bench_memory_plan.py)
    chunk = 4 * hidden * 16384
    assert rows["head chunks' staging (train.stream_io)"].bytes == -(-vocab // 16384) * chunk / 2  # in bf16
    assert rows["head chunks' gradients on their way (pinned)"].bytes == 2 * chunk
    resident = _plan("configs/llama3.1-8b.yaml", *sets[:-3], f"train.grad_hold={hold}", "train.stream_io=false",
                     "train.micro_batches=16", "train.activations=pinned_host", "train.activations_gpu_blocks=0")
    assert not {"embedding + head gradients (train.stream_io)", "head chunks' staging (train.stream_io)"} \
        & {r.what for r in resident.rows}


def test_pinned_activations_count_a_segments_parked_recomputed_inputs():
    """boundary_every k > 2 with pinned activations: the backward's recompute of a segment parks the inputs below
    its top two in pinned memory as the forward would (weights.Boundaries), k - 2 layers beside the kept ones."""
    sets = ("optim.clip_norm=1.0", "optim.moments=int8", "train.stream_copy=device", "train.micro_batches=16",
            "train.activations=pinned_host", "train.activations_gpu_blocks=0", "train.grad_hold=host_bf16", "train.stream_io=true")
    layer = 16 * 4096 * 4096 * 2  # one block input of the 8B shape, bf16, 16 x 4096 tokens
    for k, layers in ((1, 32), (2, 16), (4, 8 + 2)):
        p = _plan("configs/llama3.1-8b.yaml", *sets, f"train.boundary_every={k}")
        rows = {r.what: r for r in p.rows}
        assert rows["boundary activations (pinned)"].bytes == layers * layer, k
