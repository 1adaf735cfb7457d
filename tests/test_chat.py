"""Chat data: formats, the model's own template, assistant-only masks equal to transformers'
``apply_chat_template(..., return_assistant_tokens_mask=True)``, line-numbered errors, and the whole
path prepare -> train on a chat data set."""
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from megatrain_jax.data import chat
from megatrain_jax.cli import main as cli_main
from megatrain_jax.data import HFTokenizer, load_dataset, prepare
from megatrain_jax.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures" / "chat"
SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>",
            "<|im_end|>", "<|endoftext|>"]


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
    """A small byte-level BPE tokenizer the test builds (trained on the shipped text), in two model folders
    with a Llama-3-style and a ChatML/Qwen-style chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    text = (ROOT / "data" / "tinyshakespeare.txt").read_text()[:200_000]
    tk.train_from_iterator([text], trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    dirs = {}
    for style in ("llama3", "chatml"):
        d = tmp_path_factory.mktemp(style)
        tk.save(str(d / "tokenizer.json"))
        shutil.copy(FIX / f"{style}_tokenizer_config.json", d / "tokenizer_config.json")
        dirs[style] = d
    return dirs


def _convs():
    return [json.loads(x)["messages"] for x in (FIX / "conversations.jsonl").read_text().splitlines()]


def _ours(d, msgs):
    tpl = chat.ChatTemplate.from_folder(str(d))
    text, spans = tpl.render_with_spans(msgs)
    (ids, offs), = HFTokenizer(str(d)).encode_with_offsets([text])
    return text, ids, chat.token_mask(offs, spans)


@pytest.mark.parametrize("style", ["llama3", "chatml"])
def test_ids_and_masks_equal_transformers(tok_dirs, style, tmp_path):
    from torch_reference import child_env, torch_python

    torch_py = torch_python()
    env = child_env()
    out = tmp_path / "ref.json"
    r = subprocess.run([str(torch_py), str(ROOT / "tests" / "chat_reference.py"), str(tok_dirs[style]),
                        str(FIX / "conversations.jsonl"), str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    refs = json.loads(out.read_text())
    for msgs, ref in zip(_convs(), refs, strict=True):
        text, ids, mask = _ours(tok_dirs[style], msgs)
        assert text == ref["text"]
        assert ids.tolist() == ref["input_ids"]
        assert mask.tolist() == ref["assistant_masks"]
        assert 0 < mask.sum() < len(mask)  # assistant turns only


@pytest.mark.parametrize("style", ["llama3", "chatml"])
def test_prefix_rendering_finds_the_same_assistant_tokens_without_markers(tok_dirs, style, tmp_path):
    """Without {% generation %} markers the spans come from rendering prefixes: the same tokens, plus
    the text the template puts after an assistant turn's end-of-turn token (a newline in ChatML)."""
    cfg = json.loads((tok_dirs[style] / "tokenizer_config.json").read_text())
    cfg["chat_template"] = cfg["chat_template"].replace("{% generation %}", "").replace("{% endgeneration %}", "")
    d = tmp_path / "nomarkers"
    d.mkdir()
    shutil.copy(tok_dirs[style] / "tokenizer.json", d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    for msgs in _convs():
        t1, ids1, m1 = _ours(tok_dirs[style], msgs)
        t2, ids2, m2 = _ours(d, msgs)
        assert t1 == t2 and ids1.tolist() == ids2.tolist()
        assert np.all(m2 >= m1) and (m2 - m1).sum() <= sum(m["role"] == "assistant" for m in msgs)


def test_the_three_formats_become_the_same_conversation():
    m = chat.to_messages({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
                         "messages", "x:1")
    s = chat.to_messages({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
                         "sharegpt", "x:2")
    a = chat.to_messages({"instruction": "q", "input": "", "output": "a"}, "alpaca", "x:3")
    assert m == s == a
    assert chat.to_messages({"instruction": "q", "input": "ctx", "output": "a", "system": "S"}, "alpaca", "x")[0] == \
        {"role": "system", "content": "S"}
    assert chat.detect_format({"conversations": []}) == "sharegpt" and chat.detect_format({"text": "t"}) is None


def _write(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" if not isinstance(x, str) else x + "\n" for x in lines))


@pytest.mark.parametrize("bad,problem", [
    ({"messages": [{"content": "no role"}]}, "role"),
    ({"messages": [{"role": "user", "content": ""}]}, "empty"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "unknown"),
    ({"conversations": [{"from": "alien", "value": "x"}]}, "unknown"),
    ({"weird": 1}, "no known format"),
    ("{not json", "not valid JSON"),
])
def test_malformed_records_are_reported_by_line_number(tmp_path, capsys, bad, problem):
    f = tmp_path / "d.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    _write(f, [good, good, bad, good])
    out = tmp_path / "o" / "data"
    rc = cli_main(["prepare", str(f), "--out", str(out), "--chat-template", "chatml"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and f"{f}:3" in err and problem in err and err.count("\n") == 0, err
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())  # nothing half-written
    # skipping: the bad line is counted and reported, the others are written
    rc = cli_main(["prepare", str(f), "--out", str(out), "--chat-template", "chatml", "--on-error", "skip"])
    printed = capsys.readouterr().out
    assert rc == 0 and "bad lines skipped: 1" in printed and "4 examples read, 3 written" in printed
    index = json.loads((tmp_path / "o" / "data.json").read_text())
    assert index["report"]["bad_lines_skipped"] == 1 and f"{f}:3" in index["report"]["bad_lines_first"][0]


def test_conversation_without_a_template_is_refused(tmp_path, capsys):
    f = tmp_path / "d.jsonl"
    _write(f, [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}])
    assert cli_main(["prepare", str(f), "--out", str(tmp_path / "x")]) == 2  # byte tokenizer: no template
    assert "--chat-template" in capsys.readouterr().err


def test_chat_data_set_end_to_end(tok_dirs, tmp_path):
    """prepare with the model's template (all three formats in one file, a conversation with no assistant
    turn dropped and counted), then train a tiny model on it through the CLI."""
    f = tmp_path / "mixed.jsonl"
    recs = []
    for i in range(40):
        recs.append({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Count {i}"},
                                  {"role": "assistant", "content": f"{i} {i + 1} {i + 2}"}]})
        recs.append({"conversations": [{"from": "human", "value": f"Echo {i}"}, {"from": "gpt", "value": f"Echo {i}"}]})
        recs.append({"instruction": "Repeat", "input": f"word{i}", "output": f"word{i}"})
    recs.append({"messages": [{"role": "user", "content": "only a question"}]})
    _write(f, recs)
    d = tok_dirs["chatml"]
    index = prepare([str(f)], str(tmp_path / "chat"), tokenizer=str(d), quiet=True)
    assert index["report"]["examples_written"] == 120 and index["report"]["conversations"] == 120
    assert index["report"]["dropped"] == {"no assistant tokens (nothing to learn)": 1}
    ds = load_dataset_for(tmp_path / "chat", d)
    assert 0.05 < ds.mask.mean() < 0.5  # prompts, system text and role headers masked out, answers in
    out = tmp_path / "run"
    rc = cli_main(["train", str(ROOT / "configs" / "tiny.yaml"), "--set", f"data.path={tmp_path / 'chat'}",
                   "--set", f"data.tokenizer={d / 'tokenizer.json'}", "--set", "model.vocab_size=640",
                   "--set", "data.seq_len=64", "--set", "train.batch_size=4", "--set", "train.steps=25",
                   "--set", f"train.out_dir={out}", "--set", "model.num_layers=2", "--set", "train.log_every=5",
                   "--set", f"train.export={tmp_path / 'export'}"])
    assert rc == 0
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["vocab_size"] == 640 and any(p.suffix == ".safetensors" for p in (tmp_path / "export").iterdir())
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0]


def load_dataset_for(prefix, tok_dir):
    from megatrain_jax.config import DataConfig

    return load_dataset(DataConfig(path=str(prefix), tokenizer=str(tok_dir / "tokenizer.json"), seq_len=64), 640)


def test_worker_processes_write_the_same_data_set(tok_dirs, tmp_path):
    """JSONL chunks rendered and tokenized in 2 spawned worker processes give the same bytes as inline."""
    f = tmp_path / "many.jsonl"
    recs = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}
            for i in range(5000)] + [{"text": "plain text too"}, {"prompt": "p", "response": "r"}]
    _write(f, recs)
    d = str(tok_dirs["chatml"])
    a = prepare([str(f)], str(tmp_path / "a"), tokenizer=d, quiet=True, workers=1)
    b = prepare([str(f)], str(tmp_path / "b"), tokenizer=d, quiet=True, workers=2)
    assert a["report"] == b["report"] and a["report"]["examples_written"] == 5002
    for suffix in (".tokens.bin", ".mask.bin"):
        assert (tmp_path / f"a{suffix}").read_bytes() == (tmp_path / f"b{suffix}").read_bytes()


def _tree(root):
    """Every path under ``root`` with bytes and mtime (equal: nothing created or changed)."""
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else None
            for p in sorted(root.rglob("*"))}


def test_conversations_without_any_assistant_turn_say_so(tmp_path, capsys):
    f = tmp_path / "d.jsonl"
    _write(f, [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(3)])
    before = _tree(tmp_path)
    rc = cli_main(["prepare", str(f), "--out", str(tmp_path / "o" / "data"), "--chat-template", "chatml"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "no assistant tokens" in err and str(f) in err, err
    assert "assistant" in err.split("fix:")[1] and "0 tokens" not in err
    assert _tree(tmp_path) == before  # not even the output directory


GEMMA_LIKE = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
              "supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != "
              "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
              "user/assistant/user/assistant/...') }}{% endif %}{{ '<start_of_turn>' + (message['role'] | "
              "replace('assistant', 'model')) + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")


def test_a_template_that_refuses_a_record_names_its_line_and_skip_skips_it(tmp_path, capsys):
    tpl = tmp_path / "gemma"
    tpl.mkdir()
    (tpl / "tokenizer_config.json").write_text(json.dumps({"chat_template": GEMMA_LIKE, "bos_token": "<bos>"}))
    f = tmp_path / "d.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    _write(f, [good,
               {"messages": [{"role": "system", "content": "S"}, *good["messages"]]},
               {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                             {"role": "assistant", "content": "c"}]},
               good])
    out = tmp_path / "o" / "data"
    before = _tree(tmp_path)
    rc = cli_main(["prepare", str(f), "--out", str(out), "--chat-template", str(tpl)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and f"{f}:2" in err and "System role not supported" in err, err
    assert _tree(tmp_path) == before
    for workers in ("1", "2"):
        rc = cli_main(["prepare", str(f), "--out", str(out), "--chat-template", str(tpl), "--on-error", "skip",
                       "--workers", workers, "--overwrite"])
        printed = capsys.readouterr().out
        assert rc == 0 and "bad lines skipped: 2" in printed and "4 examples read, 2 written" in printed, printed
        report = json.loads((tmp_path / "o" / "data.json").read_text())["report"]
        assert report["bad_lines_skipped"] == 2
        assert f"{f}:2" in report["bad_lines_first"][0] and "System role" in report["bad_lines_first"][0]
        assert f"{f}:3" in report["bad_lines_first"][1] and "must alternate" in report["bad_lines_first"][1]
