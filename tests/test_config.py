"""Config: YAML presets and ``base:`` inheritance, ``key=value`` overrides, validation errors.

Every bad input is a ``UserError`` whose ``.field`` names the config field at fault and whose
message is one line with the fix (the CLI prints it as ``error: ...`` and exits 2; see test_cli.py).
"""
from __future__ import annotations

import os

import pytest

from megatrain_jax.config import Config, load_config, validate
from megatrain_jax.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "configs")
TINY = os.path.join(CONFIGS, "tiny.yaml")


def _preset(name: str, overrides=()) -> Config:
    return load_config(os.path.join(CONFIGS, f"{name}.yaml"), list(overrides))


def _raises(field: str, path: str | None = TINY, overrides=()) -> UserError:
    with pytest.raises(UserError) as ei:
        load_config(path, list(overrides))
    e = ei.value
    assert e.field == field, f"field {e.field!r} != {field!r} ({e})"
    msg = str(e)
    assert "\n" not in msg, msg
    assert msg.startswith(f"{field}: ") and "(fix: " in msg and e.fix, msg
    return e


# ------------------------------------------------------------------------------------ presets


@pytest.mark.parametrize("name", ["tiny", "125m", "1b", "3b", "7b", "lean-110b", "lean-123b"])
def test_shipped_presets_load_and_validate(name):
    cfg = _preset(name)
    validate(cfg)
    assert cfg.model.total_params() > 0


@pytest.mark.parametrize("name, params", [
    ("7b", 6_738_415_616),  # Llama-2-7B
    ("1b", 1_235_814_400),  # Llama-3.2-1B
    ("3b", 3_212_749_824),  # Llama-3.2-3B
    ("lean-123b", 122_610_069_504),  # the Mistral-Large-123B shape (as the 512 GiB machine ran it, bench_memory_plan.py)
])
def test_preset_parameter_counts_match_the_real_models(name, params):
    assert _preset(name).model.total_params() == params


def test_1b_inherits_tiny_and_overrides_what_it_sets():
    tiny, one_b = _preset("tiny"), _preset("1b")
    # set by 1b.yaml
    assert (one_b.model.vocab_size, one_b.model.hidden_size, one_b.model.num_layers) == (128256, 2048, 16)
    assert (one_b.model.num_heads, one_b.model.num_kv_heads, one_b.model.intermediate_size) == (32, 8, 8192)
    assert one_b.model.rope_theta == 500000.0 and one_b.model.tie_embeddings is True
    assert one_b.optim.lr == 3.0e-4 and one_b.data.seq_len == 4096 and one_b.train.out_dir == "runs/1b"
    # inherited from tiny.yaml (not the dataclass defaults)
    assert one_b.optim.schedule.kind == tiny.optim.schedule.kind == "warmup_cosine"
    assert one_b.optim.schedule.warmup_steps == tiny.optim.schedule.warmup_steps == 20
    assert one_b.optim.weight_decay == tiny.optim.weight_decay == 0.01
    assert one_b.data.path == tiny.data.path and one_b.train.steps == tiny.train.steps == 300
    assert one_b.train.log_every == tiny.train.log_every == 25


def test_3b_inherits_1b_which_inherits_tiny():
    three_b = _preset("3b")
    assert (three_b.model.hidden_size, three_b.model.num_layers, three_b.model.num_heads) == (3072, 28, 24)
    assert three_b.model.vocab_size == 128256 and three_b.model.rope_theta == 500000.0  # from 1b.yaml
    assert three_b.optim.schedule.kind == "warmup_cosine" and three_b.train.steps == 300  # from tiny.yaml
    assert three_b.train.out_dir == "runs/3b"


def test_overrides_apply_after_base_inheritance():
    cfg = _preset("1b", ["model.num_layers=2", "optim.schedule.warmup_steps=0", "train.out_dir=/tmp/x"])
    assert cfg.model.num_layers == 2 and cfg.model.hidden_size == 2048
    assert cfg.optim.schedule.warmup_steps == 0 and cfg.optim.schedule.kind == "warmup_cosine"
    assert cfg.train.out_dir == "/tmp/x"


def test_base_is_resolved_relative_to_the_child_file(tmp_path, monkeypatch):
    sub = tmp_path / "presets"
    sub.mkdir()
    (sub / "parent.yaml").write_text("model:\n  hidden_size: 64\n  num_heads: 2\ntrain:\n  steps: 7\n")
    (sub / "child.yaml").write_text("base: parent.yaml\nmodel:\n  num_layers: 3\n")
    monkeypatch.chdir(tmp_path)  # not the folder holding the files
    cfg = load_config(str(sub / "child.yaml"))
    assert (cfg.model.hidden_size, cfg.model.num_heads, cfg.model.num_layers, cfg.train.steps) == (64, 2, 3, 7)


def test_no_config_file_gives_the_defaults():
    cfg = load_config(None, ["train.steps=5"])
    assert cfg.train.steps == 5 and cfg.model == Config().model


# ------------------------------------------------------------------------------ override coercion


@pytest.mark.parametrize("raw, want", [("true", True), ("True", True), ("yes", True), ("1", True),
                                       ("false", False), ("no", False), ("0", False)])
def test_bool_override(raw, want):
    assert load_config(TINY, [f"model.qkv_bias={raw}"]).model.qkv_bias is want


@pytest.mark.parametrize("raw", ["null", "none", "None", "~", ""])
def test_null_override_of_an_optional_field(raw):
    cfg = load_config(TINY, [f"optim.clip_norm={raw}"])
    assert cfg.optim.clip_norm is None
    assert load_config(TINY, [f"model.num_kv_heads={raw}"]).model.num_kv_heads is None


def test_numeric_overrides_are_coerced_to_the_field_type():
    cfg = load_config(TINY, ["train.steps=1e3", "optim.lr=3e-4", "optim.clip_norm=2", "train.out_dir=123",
                             "model.rope_theta=500000"])
    assert cfg.train.steps == 1000 and type(cfg.train.steps) is int
    assert cfg.optim.lr == 3e-4 and type(cfg.optim.lr) is float  # YAML reads "3e-4" as a string
    assert cfg.optim.clip_norm == 2.0 and type(cfg.optim.clip_norm) is float
    assert cfg.train.out_dir == "123"
    assert cfg.model.rope_theta == 500000.0 and type(cfg.model.rope_theta) is float


def test_override_whitespace_and_equals_in_the_value():
    cfg = load_config(TINY, [" train.out_dir = runs/a=b ", "model.rope_scaling={rope_type: llama3, factor: 8.0, "
                             "low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 8192}"])
    assert cfg.train.out_dir == "runs/a=b"
    assert cfg.model.rope_scaling["rope_type"] == "llama3" and cfg.model.rope_scaling["factor"] == 8.0


def test_override_that_is_not_yaml_is_taken_literally_for_a_string_field():
    assert load_config(TINY, ["data.path=[weird name.txt"]).data.path == "[weird name.txt"


def test_last_override_wins():
    # (tiny.yaml warms up for 20 steps: without warmup, 9 steps are a valid run)
    assert load_config(TINY, ["optim.schedule.warmup_steps=0", "train.steps=5", "train.steps=9"]).train.steps == 9


# ----------------------------------------------------------------------------------- bad input


def test_unknown_key_in_an_override():
    e = _raises("model.hiden_size", overrides=["model.hiden_size=64"])
    assert "hidden_size" in e.fix  # the fix lists the valid keys


@pytest.mark.parametrize("key, field", [("foo=1", "foo"), ("optim.schedule.bogus=1", "optim.schedule.bogus"),
                                        ("train.stpes=3", "train.stpes")])
def test_unknown_keys_anywhere(key, field):
    _raises(field, overrides=[key])


def test_unknown_key_in_a_yaml_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("base: " + TINY + "\nmodel:\n  hidden: 64\n")
    e = _raises("model.hidden", str(p))
    assert "hidden_size" in e.fix


def test_heads_not_dividing_hidden_size():
    e = _raises("model.num_heads", overrides=["model.num_heads=3", "model.num_kv_heads=null"])
    assert "hidden_size" in e.problem and "num_heads" in e.fix


def test_heads_not_dividing_hidden_size_is_fine_with_an_explicit_head_dim():
    cfg = load_config(TINY, ["model.num_heads=3", "model.num_kv_heads=1", "model.head_dim=32"])
    assert cfg.model.dim_per_head == 32


@pytest.mark.parametrize("kv", ["3", "0", "-2"])
def test_kv_heads_not_dividing_heads(kv):
    e = _raises("model.num_kv_heads", overrides=[f"model.num_kv_heads={kv}"])  # tiny: 4 heads
    assert "num_kv_heads" in e.fix


def test_micro_batches_not_dividing_the_batch():
    e = _raises("train.micro_batches", overrides=["train.batch_size=16", "train.micro_batches=3"])
    assert "16" in e.problem and "multiple" in e.fix
    assert load_config(TINY, ["train.batch_size=16", "train.micro_batches=4"]).train.micro_batches == 4


@pytest.mark.parametrize("field", ["train.micro_batches", "train.batch_size", "train.steps", "data.seq_len",
                                   "model.vocab_size", "model.num_layers", "model.hidden_size"])
def test_non_positive_sizes(field):
    _raises(field, overrides=[f"{field}=0"])


def test_byte_tokenizer_needs_256_ids():
    e = _raises("model.vocab_size", overrides=["model.vocab_size=200"])
    assert "256" in e.fix
    # with a tokenizer.json the vocabulary is checked against the data's token ids at load time instead
    assert load_config(TINY, ["model.vocab_size=200", "data.tokenizer=tok.json"]).model.vocab_size == 200


def test_unknown_compute_dtype():
    e = _raises("train.compute_dtype", overrides=["train.compute_dtype=fp8"])
    assert "bfloat16" in e.fix


def test_unknown_optimizer_kernel():
    e = _raises("optim.kernel", overrides=["optim.kernel=cuda"])
    assert "fused" in e.fix and "optax" in e.fix


def test_fused_kernel_is_adamw_only():
    _raises("optim.kernel", overrides=["optim.name=sgd", "optim.kernel=fused"])
    assert load_config(TINY, ["optim.name=sgd", "optim.kernel=optax"]).optim.name == "sgd"
    # optim.kernel=auto (the default) follows the optimizer, also through a base: chain and --set (issue 43)
    assert load_config(TINY, ["optim.name=sgd"]).optim.kernel == "optax"
    assert load_config(TINY, []).optim.kernel == "fused"
    assert load_config(os.path.join(os.path.dirname(TINY), "7b.yaml"), ["optim.name=lion"]).optim.kernel == "optax"


@pytest.mark.parametrize("override, field", [
    ("optim.name=adam", "optim.name"), ("train.engine=fast", "train.engine"),
    ("optim.schedule.kind=step", "optim.schedule.kind"), ("optim.clip_norm=0", "optim.clip_norm"),
    ("model.rope_scaling={rope_type: yarn}", "model.rope_scaling"), ("model.head_dim=33", "model.head_dim"),
    ("train.fetch=half", "train.fetch"), ("train.early_state_groups=-1", "train.early_state_groups"),
    ("train.early_state_groups=some", "train.early_state_groups"),
])
def test_other_invalid_values(override, field):
    _raises(field, overrides=[override])


@pytest.mark.parametrize("override, field", [
    ("train.steps=abc", "train.steps"), ("train.steps=1.5", "train.steps"), ("train.steps=true", "train.steps"),
    ("train.steps=[1, 2]", "train.steps"), ("train.steps=[1", "train.steps"), ("optim.lr=fast", "optim.lr"),
    ("model.qkv_bias=maybe", "model.qkv_bias"), ("model.vocab_size={a: 1}", "model.vocab_size"),
])
def test_bad_value_type(override, field):
    e = _raises(field, overrides=[override])
    assert "is not a valid" in e.problem


@pytest.mark.parametrize("override, field", [("train.steps=null", "train.steps"),
                                             ("optim.lr=", "optim.lr")])
def test_null_for_a_required_field(override, field):
    _raises(field, overrides=[override])


def test_override_without_equals():
    e = _raises("train.steps", overrides=["train.steps"])
    assert "key=value" in e.problem and "--set" in e.fix


@pytest.mark.parametrize("item", ["=5", "train.=5", ".steps=5", "train..steps=5"])
def test_override_with_an_empty_key(item):
    _raises(item, overrides=[item])


@pytest.mark.parametrize("item, field", [("train.steps.x=1", "train.steps.x"), ("model=5", "model"),
                                         ("optim.schedule=warmup", "optim.schedule")])
def test_override_into_a_leaf_or_of_a_section(item, field):
    _raises(field, overrides=[item])


def test_missing_config_file(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    e = _raises("CONFIG", missing)
    assert missing in e.problem and "configs/tiny.yaml" in e.fix


def test_missing_base_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("base: nothere.yaml\n")
    e = _raises("CONFIG", str(p))
    assert "nothere.yaml" in e.problem
    assert f"named by base: in {p}" in e.problem  # which config named it


def test_invalid_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  hidden_size: 64\n  num_layers: [1\n")
    e = _raises("CONFIG", str(p))
    assert f"{p}:4:1: not valid YAML" in e.problem, e  # file:line:column


def test_a_top_level_list_or_scalar(tmp_path):
    for text, kind in (("- model\n- train\n", "list"), ("5\n", "int")):
        p = tmp_path / "c.yaml"
        p.write_text(text)
        assert f"a YAML {kind} at the top level" in _raises("CONFIG", str(p)).problem


def test_base_that_is_not_one_file_name(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("base: [tiny.yaml]\n")
    assert "one file name" in _raises("base", str(p)).problem


def test_a_cycle_of_bases_is_one_error_not_a_recursion(tmp_path):
    (tmp_path / "self.yaml").write_text("base: self.yaml\n")
    assert "already in the chain of bases" in _raises("CONFIG", str(tmp_path / "self.yaml")).problem
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: sub/../a.yaml\n")
    (tmp_path / "sub").mkdir()
    e = _raises("CONFIG", str(tmp_path / "a.yaml"))
    assert "a.yaml -> " in e.problem and "b.yaml" in e.problem


def test_article_of_the_type_in_the_fix():
    assert _raises("train.steps", overrides=["train.steps=1.5"]).fix == "give an int"
    assert _raises("optim.lr", overrides=["optim.lr=abc"]).fix == "give a float"


@pytest.mark.parametrize("overrides, fix_names", [
    (["train.steps=10"], "train.steps"),  # tiny.yaml: warmup_cosine with 20 warmup steps
    (["train.steps=100", "optim.schedule.decay_steps=20"], "optim.schedule.decay_steps"),
])
def test_warmup_that_leaves_no_decay(overrides, fix_names):
    e = _raises("optim.schedule.warmup_steps", overrides=overrides)
    assert e.fix.startswith("set optim.schedule.warmup_steps below") and fix_names in e.fix, e
    load_config(TINY, overrides + ["optim.schedule.kind=constant"])  # a constant schedule has no decay to fit


@pytest.mark.parametrize("override", ["train.trace_step=2", "train.export=out"])
def test_reference_engine_refuses_what_it_cannot_do(override):
    _raises(override.split("=")[0], overrides=["train.engine=reference", override])


def test_a_section_that_is_not_a_mapping(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model: 5\n")
    _raises("model", str(p))


# ------------------------------------------------------------------------------ validate() directly


def test_validate_on_a_config_object():
    validate(Config())
    cfg = Config()
    cfg.model.num_heads = 5
    with pytest.raises(UserError) as ei:
        validate(cfg)
    assert ei.value.field == "model.num_heads"
    cfg = Config()
    cfg.train.batch_size, cfg.train.micro_batches = 6, 4
    with pytest.raises(UserError) as ei:
        validate(cfg)
    assert ei.value.field == "train.micro_batches"


def test_loading_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    load_config(TINY, [f"train.out_dir={tmp_path}/run"])
    with pytest.raises(UserError):
        load_config(TINY, [f"train.out_dir={tmp_path}/run2", "model.num_heads=3"])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("override,field", [
    ("optim.lr=-1", "optim.lr"), ("optim.lr=0", "optim.lr"), ("optim.lr=.nan", "optim.lr"),
    ("optim.b1=1.0", "optim.b1"), ("optim.b2=-0.1", "optim.b2"), ("optim.eps=0", "optim.eps"),
    ("optim.weight_decay=-0.01", "optim.weight_decay"), ("optim.clip_norm=.inf", "optim.clip_norm"),
    ("optim.schedule.end_lr_ratio=2", "optim.schedule.end_lr_ratio"), ("model.rms_norm_eps=0", "model.rms_norm_eps"),
    ("train.log_every=0", "train.log_every"), ("train.grad_slabs=1", "train.grad_slabs"),
    ("train.gpu_memory_gb=-4", "train.gpu_memory_gb"), ("train.micro_batches=zero", "train.micro_batches"),
    ("train.boundary_every=0", "train.boundary_every"), ("train.boundary_every=two", "train.boundary_every"),
    ("train.stream_io=sometimes", "train.stream_io"), ("train.grad_hold=disk", "train.grad_hold"),
    ("train.activations_gpu_blocks=-1", "train.activations_gpu_blocks"),
    ("train.activations_gpu_blocks=half", "train.activations_gpu_blocks"),
])
def test_numeric_fields_are_validated(override, field):
    from megatrain_jax.errors import UserError

    with pytest.raises(UserError) as e:
        load_config(TINY, [override])
    assert e.value.field == field and "\n" not in str(e.value)


# every numeric field: (override, field) that must be refused; NaN and infinities (YAML's .nan / .inf) included
_BAD_NUMBERS = [
    *[(f"optim.lr={v}", "optim.lr") for v in ("-1", "0", ".nan", ".inf", "-.inf")],
    *[(f"optim.b1={v}", "optim.b1") for v in ("-0.1", "1", "1.5", ".nan")],
    *[(f"optim.b2={v}", "optim.b2") for v in ("-0.1", "1.0", ".inf", ".nan")],
    *[(f"optim.eps={v}", "optim.eps") for v in ("0", "-1e-8", ".nan", ".inf")],
    *[(f"optim.weight_decay={v}", "optim.weight_decay") for v in ("-0.01", ".nan", ".inf")],
    *[(f"optim.clip_norm={v}", "optim.clip_norm") for v in ("0", "-1", ".nan", ".inf")],
    ("optim.schedule.warmup_steps=-1", "optim.schedule.warmup_steps"),
    ("optim.schedule.decay_steps=-5", "optim.schedule.decay_steps"),
    *[(f"optim.schedule.end_lr_ratio={v}", "optim.schedule.end_lr_ratio") for v in ("-0.1", "1.01", "2", ".nan", ".inf")],
    *[(f"model.init_std={v}", "model.init_std") for v in ("0", "-0.02", ".nan", ".inf")],
    *[(f"model.rope_theta={v}", "model.rope_theta") for v in ("0", "-10000", ".nan", ".inf")],
    *[(f"model.rms_norm_eps={v}", "model.rms_norm_eps") for v in ("0", "-1e-5", ".nan", ".inf")],
    ("model.head_dim=0", "model.head_dim"), ("model.head_dim=-32", "model.head_dim"),
    ("model.vocab_size=0", "model.vocab_size"), ("model.hidden_size=-128", "model.hidden_size"),
    ("model.num_layers=0", "model.num_layers"), ("model.intermediate_size=0", "model.intermediate_size"),
    ("data.seq_len=0", "data.seq_len"), ("data.seq_len=-128", "data.seq_len"),
    ("train.steps=0", "train.steps"), ("train.batch_size=0", "train.batch_size"),
    ("train.log_every=0", "train.log_every"), ("train.log_every=-1", "train.log_every"),
    ("train.loss_chunk=0", "train.loss_chunk"), ("train.loss_chunk=-1024", "train.loss_chunk"),
    ("train.ckpt_every=-1", "train.ckpt_every"), ("train.keep_last=-1", "train.keep_last"),
    ("train.keep_every=-1", "train.keep_every"), ("train.trace_step=-1", "train.trace_step"),
    ("train.max_bad_steps=0", "train.max_bad_steps"), ("train.max_bad_steps=-3", "train.max_bad_steps"),
    *[(f"train.host_memory_gb={v}", "train.host_memory_gb") for v in ("0", "-8", ".nan", ".inf")],
    *[(f"train.gpu_memory_gb={v}", "train.gpu_memory_gb") for v in ("0", "-4", ".nan", ".inf")],
    ("train.micro_batches=0", "train.micro_batches"), ("train.grad_slabs=0", "train.grad_slabs"),
    ("train.devices=0", "train.devices"), ("train.export_dtype=int8", "train.export_dtype"),
]
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("override, field", _BAD_NUMBERS, ids=[o for o, _ in _BAD_NUMBERS])
def test_every_numeric_field_is_range_checked(override, field):
    e = _raises(field, overrides=[override])
    assert field in str(e) and e.fix


@pytest.mark.parametrize("key, value", [("factor", 0), ("factor", ".nan"), ("low_freq_factor", -1),
                                        ("high_freq_factor", ".inf"), ("original_max_position_embeddings", 0),
                                        ("factor", "missing"), ("high_freq_factor", 0.5)])
def test_llama3_rope_scaling_values(key, value):
    scaling = dict(_LLAMA3)
    if value == "missing":
        del scaling[key]
    else:
        scaling[key] = value
    text = "{" + ", ".join(f"{k}: {v}" for k, v in scaling.items()) + "}"
    _raises(f"model.rope_scaling.{key}", overrides=[f"model.rope_scaling={text}"])


@pytest.mark.parametrize("overrides", [
    ["optim.b1=0", "optim.b2=0", "optim.weight_decay=0", "optim.schedule.end_lr_ratio=0"],
    ["optim.b1=0.999999", "optim.b2=0.999999", "optim.schedule.end_lr_ratio=1", "optim.clip_norm=null"],
    ["optim.lr=1e-12", "optim.eps=1e-30", "model.init_std=1e-6", "model.rms_norm_eps=1e-12"],
    ["train.ckpt_every=0", "train.keep_last=0", "train.keep_every=0", "train.max_bad_steps=1", "train.log_every=1",
     "optim.schedule.warmup_steps=0", "optim.schedule.decay_steps=0"],
    ["train.host_memory_gb=0.5", "train.gpu_memory_gb=80", "train.loss_chunk=1", "model.head_dim=null"],
])
def test_numeric_boundaries_that_are_allowed(overrides):
    load_config(TINY, overrides)


def test_nan_in_a_yaml_file_is_refused(tmp_path):
    p = tmp_path / "nan.yaml"
    p.write_text(f"base: {TINY}\noptim:\n  lr: .nan\n")
    _raises("optim.lr", path=str(p))


def test_validate_refuses_numbers_set_on_a_config_object():
    cfg = load_config(TINY)
    cfg.optim.lr = float("inf")
    with pytest.raises(UserError) as e:
        validate(cfg)
    assert e.value.field == "optim.lr"
