"""``megatrain-jax generate`` (``generate/``): greedy generation of tiny random Llama, Qwen3-MoE (sliding window) and
Gemma 2 (soft-caps, sliding window) models is token-identical to transformers' ``generate`` from the same weights,
prompts of different lengths decoded together in one batch, with resident and streamed weights and a chunked
prefill; a LoRA run generates
with its adapters; the plan refuses what does not fit with a fix; bad sources and prompts are one line, exit 2."""
from __future__ import annotations

import json

import numpy as np
import pytest

from cli_runner import check_user_error, run_in_process
from tests.torch_reference import run_reference, torch_python

NAMES = ("llama", "qwen3moe", "gemma2")


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """transformers' greedy generations (``tests/generate_reference.py``, one run for the module)."""
    out = tmp_path_factory.mktemp("genref")
    run_reference(torch_python(), str(out), script="generate_reference.py")
    return out


def _decode(src, prompts, new, streamed=False, int8=False, **kw):
    from megatrain_jax.generate.engine import Decoder, Sampling, Weights

    w = Weights(src, "float32", streamed=streamed, int8=int8)
    try:
        return Decoder(src, w).run_batch(prompts, new, kw.pop("sampling", Sampling()), eos_ids=tuple(src.eos_ids),
                                         **kw)
    finally:
        w.close()


@pytest.mark.parametrize("name", NAMES)
def test_greedy_equals_transformers(ref, name):
    from megatrain_jax.generate.source import open_source

    want = json.loads((ref / name / "generated.json").read_text())
    src = open_source(str(ref / name / "hf"), log=lambda _: None)
    # llama: the blocks streamed; gemma2: the prompts pass in chunks of 4 slots (the window of 7 spans chunks)
    got = _decode(src, want["prompts"], want["new"], streamed=name == "llama",
                  prefill_chunk=4 if name == "gemma2" else None)
    assert [c.ids for c in got] == want["generated"]


def test_cli_jsonl_out_sampling_and_int8(ref, tmp_path, capsys):
    """The CLI end to end (prompt_ids in, JSONL out); sampling is reproducible from its seed; int8 streamed runs."""
    want = json.loads((ref / "gemma2" / "generated.json").read_text())
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt_ids": p}) + "\n" for i, p in enumerate(want["prompts"])))
    src = str(ref / "gemma2" / "hf")
    base = ["generate", src, "--prompts", str(prompts), "--max-new-tokens", str(want["new"])]
    res = run_in_process(base + ["--out", str(tmp_path / "g.jsonl")], capsys)
    assert res.rc == 0, str(res)
    recs = [json.loads(x) for x in (tmp_path / "g.jsonl").read_text().splitlines()]
    assert [r["completion_ids"] for r in recs] == want["generated"] and [r["id"] for r in recs] == [0, 1, 2]
    assert all(r["finish_reason"] == "length" for r in recs)
    samp = ["--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "3"]
    for out in ("s1", "s2"):
        assert run_in_process(base + samp + ["--out", str(tmp_path / out)], capsys).rc == 0
    s1, s2 = ((tmp_path / o).read_text() for o in ("s1", "s2"))
    assert s1 == s2 and s1 != (tmp_path / "g.jsonl").read_text()
    assert run_in_process(base + ["--int8", "--out", str(tmp_path / "q")], capsys).rc == 0
    q = [json.loads(x)["completion_ids"] for x in (tmp_path / "q").read_text().splitlines()]
    assert [len(x) for x in q] == [want["new"]] * 3


def test_plan_refuses_with_a_fix_that_fits(ref, capsys):
    from megatrain_jax.errors import UserError
    from megatrain_jax.generate.plan import plan_generation
    from megatrain_jax.generate.source import open_source

    src = open_source(str(ref / "llama" / "hf"), log=lambda _: None)
    kw = dict(prompt_len=100, max_new_tokens=100, dtype="bfloat16")
    p = plan_generation(src.cfg, src.layouts, batch=4, gpu_bytes=4e9, **kw)
    assert p.weights == "resident" and p.max_batch > 4
    # a budget the weights alone nearly fill: fewer sequences, or streamed blocks
    need1 = plan_generation(src.cfg, src.layouts, batch=1, gpu_bytes=None, **kw).need
    with pytest.raises(UserError) as e:
        plan_generation(src.cfg, src.layouts, batch=10 ** 6, gpu_bytes=(need1 + 1.2e9) / 0.95 * 1.0, **kw)
    assert e.value.field == "--batch-size" and "--batch-size" in e.value.fix
    fix_batch = int(e.value.fix.split("--batch-size ")[1].split()[0])
    assert plan_generation(src.cfg, src.layouts, batch=fix_batch, gpu_bytes=(need1 + 1.2e9) / 0.95, **kw)
    res = run_in_process(["generate", str(ref / "llama" / "hf"), "--prompt", "x", "--tokenizer", "byte", "--plan",
                          "--gpu-memory-gb", "80"], capsys)
    assert res.rc == 0 and "generation plan: weights resident" in res.stdout and "KV cache" in res.stdout


def test_lora_run_generates_with_its_adapters(tmp_path, capsys):
    """A LoRA run generates from its base with the adapters merged: the same tokens as its merged export."""
    from tests.test_lora import tiny
    from tests.test_lora_export import _lora_run

    cfg = tiny("llama", layers=2)
    run, _ = _lora_run(tmp_path, cfg, seed=5)
    assert run_in_process(["export", str(run), str(tmp_path / "m"), "--merge-lora", "--dtype", "float32"],
                          capsys).rc == 0
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": [3, 1, 4, 1, 5, 9, 2, 6]}) + "\n")
    outs = {}
    for name, src in (("run", run), ("merged", tmp_path / "m")):
        res = run_in_process(["generate", str(src), "--prompts", str(prompts), "--max-new-tokens", "6",
                              "--out", str(tmp_path / f"{name}.jsonl")], capsys)
        assert res.rc == 0, str(res)
        outs[name] = json.loads((tmp_path / f"{name}.jsonl").read_text())["completion_ids"]
    assert outs["run"] == outs["merged"] and len(outs["run"]) >= 1


@pytest.mark.parametrize("case", ["unknown_source", "prompt_longer_than_context", "past_the_context",
                                  "no_prompt", "bad_top_p"])
def test_bad_generate_inputs(ref, tmp_path, capsys, case):
    src = str(ref / "gemma2" / "hf")  # max_position_embeddings 256
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt_ids": [5] * 300}) + "\n" + json.dumps({"prompt_ids": [5] * 200}) + "\n")
    mid = tmp_path / "mid.jsonl"
    mid.write_text(json.dumps({"prompt_ids": [5] * 200}) + "\n")
    args, field = {
        "unknown_source": (["generate", str(tmp_path / "nowhere"), "--prompt", "hi"], "SOURCE"),
        "prompt_longer_than_context": (["generate", src, "--prompts", str(long)], "--prompt"),
        "past_the_context": (["generate", src, "--prompts", str(mid), "--max-new-tokens", "100"], "--max-new-tokens"),
        "no_prompt": (["generate", src], "--prompt"),
        "bad_top_p": (["generate", src, "--prompt", "x", "--top-p", "0"], "--top-p"),
    }[case]
    out = tmp_path / "out.jsonl"
    check_user_error(run_in_process(args + ["--out", str(out)], capsys), field)
    assert not out.exists()


def test_sampling_filters():
    """top-k keeps the k largest logits, top-p the smallest prefix reaching p; greedy is the argmax."""
    import jax
    import jax.numpy as jnp

    from megatrain_jax.generate.engine import sample_logits

    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 512, jnp.float32))
    key = jax.random.key(0)
    one = jnp.asarray(1.0)
    draw = lambda **kw: np.asarray(sample_logits(logits, key, one, jnp.asarray(kw.pop("p", 1.0)),  # noqa: E731
                                                 greedy=False, **kw))
    assert set(draw(top_k=2, use_top_p=False).tolist()) == {0, 1}
    assert set(draw(top_k=0, use_top_p=True, p=0.7).tolist()) == {0, 1}
    assert set(draw(top_k=0, use_top_p=True, p=0.5).tolist()) == {0}
    assert len(set(draw(top_k=0, use_top_p=False).tolist())) == 4
    assert np.all(np.asarray(sample_logits(logits, key, one, one, greedy=True, top_k=0, use_top_p=False)) == 0)


def test_int8_blocks_round_trip():
    """A block streamed as int8: each kernel within half a step (max |w| / 254) of its column, the rest exact."""
    import jax.numpy as jnp

    from megatrain_jax.config import ModelConfig
    from megatrain_jax.generate.engine import _dequantise, _quantise_group
    from megatrain_jax.generate.source import group_layouts

    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=48,
                      qkv_bias=True)
    lay = group_layouts(cfg)["block_0"]
    flat = np.random.default_rng(0).normal(size=lay.size).astype(np.float32)
    q, side = _quantise_group(lay, flat)
    back = _dequantise(lay, jnp.asarray(q), jnp.asarray(side), jnp.float32)
    want = lay.unflatten(flat)
    for lf in lay.leaves:
        got, ref = np.asarray(_leaf(back, lf.path)), np.asarray(_leaf(want, lf.path))
        if len(lf.shape) < 2:
            np.testing.assert_array_equal(got, ref)
        else:
            col = np.abs(ref.reshape(-1, lf.shape[-1])).max(axis=0)
            assert np.all(np.abs(got - ref).reshape(-1, lf.shape[-1]) <= col / 254 + 1e-7)


def _leaf(tree, path):
    for k in path.split("/"):
        tree = tree[k]
    return tree


def test_chat_prompts_text_and_stop_strings(ref, tmp_path, capsys):
    """``--chat`` renders a text prompt with the model folder's chat template and the tokenizer encodes it; the
    completion is decoded text, and a stop string ends a row where it appears (the text cut before it)."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers

    model = tmp_path / "model"
    shutil.copytree(ref / "gemma2" / "hf", model)
    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 128)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(model / "tokenizer.json"))
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}w{{ 10 if m['role'] == 'user' else 11 }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}w12 {% endif %}")
    args = ["generate", str(model), "--chat", "--prompt", "w5 w17 w99", "--max-new-tokens", "10"]
    res = run_in_process(args + ["--out", str(tmp_path / "a.jsonl")], capsys)
    assert res.rc == 0, str(res)
    rec = json.loads((tmp_path / "a.jsonl").read_text())
    assert rec["prompt_tokens"] == 5 and rec["prompt"] == "w5 w17 w99"  # w10 w5 w17 w99 w12
    words = rec["completion"].split()
    assert len(words) == len(rec["completion_ids"]) == 10
    stop = words[3]
    res = run_in_process(args + ["--stop", stop, "--out", str(tmp_path / "b.jsonl")], capsys)
    cut = json.loads((tmp_path / "b.jsonl").read_text())
    first = rec["completion"].find(stop)
    assert cut["finish_reason"] == "stop" and cut["completion"] == rec["completion"][:first]


def test_out_never_replaces_a_file_it_did_not_write(ref, tmp_path, capsys):
    """--out refuses an existing file, and --overwrite replaces only an earlier output of generate."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": [5, 6, 7]}) + "\n")
    base = ["generate", str(ref / "gemma2" / "hf"), "--prompts", str(prompts), "--max-new-tokens", "2"]
    mine = tmp_path / "notes.jsonl"
    mine.write_text('{"mine": 1}\n')
    check_user_error(run_in_process(base + ["--out", str(mine)], capsys), "--out")
    check_user_error(run_in_process(base + ["--out", str(mine), "--overwrite"], capsys), "--out")
    assert mine.read_text() == '{"mine": 1}\n'
    out = tmp_path / "g.jsonl"
    assert run_in_process(base + ["--out", str(out)], capsys).rc == 0
    first = out.read_text()
    check_user_error(run_in_process(base + ["--out", str(out)], capsys), "--out")
    assert out.read_text() == first
    assert run_in_process(base + ["--out", str(out), "--overwrite"], capsys).rc == 0
