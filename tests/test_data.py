"""Data pipeline: tokenizers, prepare (text / JSONL -> packed files), checks at load, batches, resume."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import pytest

from megatrain_jax import data as D
from megatrain_jax.data import packed as packed_mod
from megatrain_jax.data import pipeline
from megatrain_jax.errors import UserError


@dataclass
class Cfg:  # stands in for config.DataConfig (same fields)
    path: str
    tokenizer: str = "byte"
    seq_len: int = 8
    seed: int = 0
    doc_masking: bool = False


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def _outputs(tmp_path, prefix="ds"):
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(prefix))


def _wordlevel(tmp_path, big=True):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 70000 if big else 2, "</s>": 70001 if big else 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = str(tmp_path / "tokenizer.json")
    tok.save(path)
    return path


# ---------------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip():
    tok = D.load_tokenizer("byte")
    text = "Héllo, wörld! ☃ \n\t end"
    ids = tok.encode(text)
    assert ids.dtype == np.uint8 and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.vocab_size == 256 and tok.eos_id is None


def test_dtype_for_vocab():
    assert D.dtype_for_vocab(256) == np.uint16
    assert D.dtype_for_vocab(65536) == np.uint16
    assert D.dtype_for_vocab(65537) == np.uint32
    assert D.dtype_for_vocab(151936) == np.uint32


def test_missing_tokenizer_is_user_error(tmp_path):
    with pytest.raises(UserError) as e:
        D.load_tokenizer(str(tmp_path / "nope.json"), "data.tokenizer")
    assert e.value.field == "data.tokenizer"


# ---------------------------------------------------------------------------------- prepare + load


def test_prepare_text_and_load(tmp_path):
    a = _write(tmp_path / "a.txt", "first document " * 20)
    b = _write(tmp_path / "b.txt", "second one " * 30)
    out = str(tmp_path / "ds")
    assert D.prepare_main([a, b, "--out", out, "--quiet"]) == 0
    assert _outputs(tmp_path) == ["ds.docs.npy", "ds.json", "ds.tokens.bin"]  # no mask: nothing masked
    index = json.loads((tmp_path / "ds.json").read_text())
    assert index["dtype"] == "uint16" and index["vocab_size"] == 256 and index["tokenizer"]["kind"] == "byte"
    assert index["n_tokens"] == 300 + 330 and index["n_docs"] == 2 and index["mask"] is None
    assert index["tokens"]["bytes"] == os.path.getsize(out + ".tokens.bin") == 2 * index["n_tokens"]
    np.testing.assert_array_equal(np.load(out + ".docs.npy"), [0, 300])
    raw = np.fromfile(out + ".tokens.bin", dtype=np.uint16)
    assert bytes(raw.astype(np.uint8)).decode() == "first document " * 20 + "second one " * 30

    ds = D.load_dataset(Cfg(out, seq_len=16), vocab_size=256)
    assert ds.n_tokens == 630 and ds.n_docs == 2 and ds.mask is None
    assert ds.n_samples(16) == (630 - 1) // 16
    b0 = ds.batch(0, 4, 16)
    assert isinstance(b0, D.Batch)
    for name, dt in [("tokens", np.int32), ("labels", np.int32), ("loss_mask", np.float32),
                     ("segment_ids", np.int32), ("positions", np.int32)]:
        arr = getattr(b0, name)
        assert arr.shape == (4, 16) and arr.dtype == dt, name
    # labels are the tokens shifted by one, taken from the stream itself
    starts = ds.sample_indices(0, 4, 16) * 16
    for r, s in enumerate(starts):
        np.testing.assert_array_equal(b0.tokens[r], raw[s:s + 16])
        np.testing.assert_array_equal(b0.labels[r], raw[s + 1:s + 17])
    np.testing.assert_array_equal(b0.labels[:, :-1], b0.tokens[:, 1:])
    assert (b0.loss_mask == 1).all()


def test_prepare_jsonl_text_and_prompt_response_masking(tmp_path):
    f = _jsonl(tmp_path / "d.jsonl", [
        {"text": "plain doc"},
        {"prompt": "Q: 2+2?", "response": " A: 4"},
        {"text": ""},  # empty documents are skipped
        {"text": "tail"},
    ])
    (tmp_path / "d.jsonl").write_text((tmp_path / "d.jsonl").read_text() + "\n\n")  # blank lines are fine
    out = str(tmp_path / "ds")
    D.prepare([f], out, quiet=True)
    assert _outputs(tmp_path) == ["ds.docs.npy", "ds.json", "ds.mask.bin", "ds.tokens.bin"]
    index = json.loads((tmp_path / "ds.json").read_text())
    stream = "plain doc" + "Q: 2+2?" + " A: 4" + "tail"
    assert index["n_tokens"] == len(stream) and index["n_docs"] == 3
    assert index["mask"]["n_masked"] == len("Q: 2+2?")
    np.testing.assert_array_equal(np.load(out + ".docs.npy"), [0, 9, 9 + 7 + 5])
    mask = np.fromfile(out + ".mask.bin", dtype=np.uint8)
    expect = np.ones(len(stream), np.uint8)
    expect[9:16] = 0
    np.testing.assert_array_equal(mask, expect)

    # the batch's loss_mask is the mask of the label token
    ds = D.load_dataset(Cfg(out, seq_len=4), vocab_size=256)
    n = ds.n_samples(4)
    seen = 0
    for step in range(n):
        b = ds.batch(step, 1, 4)
        s = int(ds.sample_indices(step, 1, 4)[0]) * 4
        np.testing.assert_array_equal(b.loss_mask[0], expect[s + 1:s + 5].astype(np.float32))
        seen += int((b.loss_mask == 0).sum())
    assert seen > 0


def test_jsonl_bad_line_leaves_nothing_behind(tmp_path):
    good = _write(tmp_path / "a.txt", "some text " * 100)
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "broken\n')
    with pytest.raises(UserError) as e:
        D.prepare_main([good, str(bad), "--out", str(tmp_path / "ds"), "--quiet"])
    assert e.value.field.endswith("b.jsonl:2")
    assert _outputs(tmp_path) == []  # no half-written output, no temporary files
    bad.write_text('{"prompt": "only a prompt"}\n')
    with pytest.raises(UserError, match="prompt"):
        D.prepare([str(bad)], str(tmp_path / "ds"), quiet=True)
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(UserError, match="text"):
        D.prepare([str(bad)], str(tmp_path / "ds"), quiet=True)
    assert _outputs(tmp_path) == []


def test_prepare_main_user_errors(tmp_path):
    with pytest.raises(UserError) as e:
        D.prepare_main([str(tmp_path / "missing.txt"), "--out", str(tmp_path / "ds")])
    assert e.value.field == "INPUTS"
    with pytest.raises(UserError) as e:
        D.prepare_main([_write(tmp_path / "a.txt", "x" * 10), "--out", str(tmp_path / "ds"),
                        "--tokenizer", str(tmp_path / "nope.json")])
    assert e.value.field == "--tokenizer"
    with pytest.raises(SystemExit) as e:  # command-line syntax: argparse exits 2
        D.prepare_main([str(tmp_path / "a.txt")])
    assert e.value.code == 2
    assert _outputs(tmp_path) == []


def test_uint32_for_large_vocab_and_eos(tmp_path):
    tok = _wordlevel(tmp_path)
    a = _write(tmp_path / "a.txt", "hello world hello")
    b = _write(tmp_path / "b.txt", "world world")
    out = str(tmp_path / "ds")
    D.prepare_main([a, b, "--out", out, "--tokenizer", tok, "--quiet"])
    index = json.loads((tmp_path / "ds.json").read_text())
    assert index["dtype"] == "uint32" and index["vocab_size"] == 70002
    assert index["tokenizer"]["eos_id"] == 70001
    raw = np.fromfile(out + ".tokens.bin", dtype=np.uint32)
    np.testing.assert_array_equal(raw, [1, 70000, 1, 70001, 70000, 70000, 70001])  # EOS after each document
    np.testing.assert_array_equal(np.load(out + ".docs.npy"), [0, 4])
    ds = D.load_dataset(Cfg(out, seq_len=3), vocab_size=70002)
    assert ds.tokens.dtype == np.uint32
    b = ds.batch(0, 2, 3)
    assert set(np.unique(np.concatenate([b.tokens.ravel(), b.labels.ravel()]))) <= {1, 70000, 70001}
    # explicit data.tokenizer must be the one the data was prepared with
    D.load_dataset(Cfg(out, tokenizer=tok, seq_len=3), vocab_size=70002)
    with pytest.raises(UserError) as e:
        other = tmp_path / "other"
        other.mkdir()
        D.load_dataset(Cfg(out, tokenizer=_wordlevel(other, big=False), seq_len=3), vocab_size=70002)
    assert e.value.field == "data.tokenizer"


def test_streaming_in_small_pieces_matches_whole(tmp_path, monkeypatch):
    import gzip

    monkeypatch.setattr(packed_mod, "_FLUSH_TOKENS", 7)
    monkeypatch.setattr(packed_mod, "_CHUNK_BYTES", 5)
    monkeypatch.setattr(pipeline, "_CHUNK_BYTES", 5)
    monkeypatch.setattr(pipeline, "_TEXT_PIECE_CHARS", 6)
    tok = _wordlevel(tmp_path)
    words = " ".join(["hello", "world"] * 40)
    text = _write(tmp_path / "a.txt", words.replace(" world hello", "\nworld  hello", 5))
    D.prepare([text], str(tmp_path / "w"), tokenizer=tok, quiet=True)
    raw = np.fromfile(tmp_path / "w.tokens.bin", dtype=np.uint32)
    whole = D.load_tokenizer(tok).encode((tmp_path / "a.txt").read_text())
    np.testing.assert_array_equal(raw, np.append(whole, 70001))

    # byte text read in 5-byte chunks, then a masked JSONL record after several flushes (gzip-compressed)
    recs = [{"text": "a" * 23}, {"prompt": "PPP", "response": "rr"}, {"text": "b" * 4}]
    gz = tmp_path / "d.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))
    D.prepare([text, str(gz)], str(tmp_path / "m"), quiet=True)
    n_text = os.path.getsize(text)
    toks = np.fromfile(tmp_path / "m.tokens.bin", dtype=np.uint16)
    mask = np.fromfile(tmp_path / "m.mask.bin", dtype=np.uint8)
    assert bytes(toks.astype(np.uint8)).decode() == (tmp_path / "a.txt").read_text() + "a" * 23 + "PPPrr" + "b" * 4
    expect = np.ones(len(toks), np.uint8)
    expect[n_text + 23:n_text + 26] = 0
    np.testing.assert_array_equal(mask, expect)
    np.testing.assert_array_equal(np.load(tmp_path / "m.docs.npy"), [0, n_text, n_text + 23, n_text + 28])
    ds = D.load_dataset(Cfg(str(tmp_path / "m")), vocab_size=256)  # checksums of chunked writes verify
    assert ds.n_docs == 4


def test_txt_path_loads_in_memory_with_byte_tokenizer(tmp_path):
    text = "To be, or not to be, that is the question. " * 10
    path = _write(tmp_path / "t.txt", text)
    ds = D.load_dataset(Cfg(path, seq_len=16), vocab_size=256)
    assert ds.n_tokens == len(text) and ds.n_docs == 1
    b = ds.batch(3, 4, 16)
    s = int(ds.sample_indices(3, 4, 16)[0]) * 16
    assert bytes(b.tokens[0].astype(np.uint8)).decode() == text[s:s + 16]
    assert (b.segment_ids == 0).all()
    np.testing.assert_array_equal(b.positions, np.broadcast_to(np.arange(16), (4, 16)))


def test_shipped_tinyshakespeare_with_default_config():
    from megatrain_jax.config import DataConfig

    cfg = DataConfig()
    ds = D.load_dataset(cfg, vocab_size=256)
    assert ds.n_tokens > 1_000_000
    b = ds.batch(0, 16, cfg.seq_len)
    assert b.tokens.shape == (16, cfg.seq_len)


# ---------------------------------------------------------------------------------- batches


@pytest.fixture
def multi_doc(tmp_path):
    rng = np.random.default_rng(0)
    files = []
    for i, n in enumerate([37, 5, 64, 11, 120, 3, 90]):
        files.append(_write(tmp_path / f"doc{i}.txt", "".join(chr(c) for c in rng.integers(97, 123, n))))
    out = str(tmp_path / "ds")
    D.prepare(files, out, quiet=True)
    return out


def test_determinism_and_resume(multi_doc):
    a = D.load_dataset(Cfg(multi_doc, seed=7), vocab_size=256)
    b = D.load_dataset(Cfg(multi_doc, seed=7), vocab_size=256)
    for step in [0, 1, 5, 17, 40]:  # any order: batch(step) is a pure function of step
        x, y = a.batch(step, 4, 8), b.batch(step, 4, 8)
        for f in D.Batch._fields:
            np.testing.assert_array_equal(getattr(x, f), getattr(y, f))
    # resuming at step k reproduces the uninterrupted run from a fresh loader
    np.testing.assert_array_equal(D.load_dataset(Cfg(multi_doc, seed=7), 256).batch(17, 4, 8).tokens,
                                  a.batch(17, 4, 8).tokens)
    assert not np.array_equal(a.batch(0, 4, 8).tokens, a.batch(1, 4, 8).tokens)
    c = D.load_dataset(Cfg(multi_doc, seed=8), vocab_size=256)
    assert not np.array_equal(a.sample_indices(0, 8, 8), c.sample_indices(0, 8, 8))


def test_epoch_covers_every_sample_once(multi_doc):
    ds = D.load_dataset(Cfg(multi_doc), vocab_size=256)
    n = ds.n_samples(8)
    B = 5
    assert n % B  # batches straddle epoch boundaries in this setup
    steps = 3 * n // B + 1
    idx = np.concatenate([ds.sample_indices(s, B, 8) for s in range(steps)])
    for e in range(3):
        np.testing.assert_array_equal(np.sort(idx[e * n:(e + 1) * n]), np.arange(n))
    assert not np.array_equal(idx[:n], idx[n:2 * n])  # reshuffled per epoch
    pos = ds.position(n // B + 1, B)
    assert pos["epoch"] == 1 and pos["sample_index"] == (n // B + 1) * B - n and pos["samples_per_epoch"] == n


def test_segment_ids_and_positions_reset_at_document_starts(multi_doc):
    ds = D.load_dataset(Cfg(multi_doc, seq_len=32), vocab_size=256)
    docs = np.load(multi_doc + ".docs.npy")
    checked_boundary = False
    for step in range(ds.n_samples(32)):
        b = ds.batch(step, 1, 32)
        s = int(ds.sample_indices(step, 1, 32)[0]) * 32
        seg, pos = b.segment_ids[0], b.positions[0]
        assert seg[0] == 0 and pos[0] == 0
        for t in range(1, 32):
            if s + t in docs:
                assert seg[t] == seg[t - 1] + 1 and pos[t] == 0
                checked_boundary = True
            else:
                assert seg[t] == seg[t - 1] and pos[t] == pos[t - 1] + 1
    assert checked_boundary


def test_too_few_samples_for_batch(multi_doc):
    ds = D.load_dataset(Cfg(multi_doc, seq_len=64), vocab_size=256)
    with pytest.raises(UserError) as e:
        ds.batch(0, ds.n_samples(64) + 1, 64)
    assert e.value.field == "train.batch_size" and "data.seq_len" in e.value.fix


# ---------------------------------------------------------------------------------- errors at load


def test_missing_path(tmp_path):
    with pytest.raises(UserError) as e:
        D.load_dataset(Cfg(str(tmp_path / "nothing")), vocab_size=256)
    assert e.value.field == "data.path"
    with pytest.raises(UserError) as e:
        D.load_dataset(Cfg(str(tmp_path / "nothing.txt")), vocab_size=256)
    assert e.value.field == "data.path"


def test_jsonl_path_is_not_loadable_directly(tmp_path):
    f = _jsonl(tmp_path / "d.jsonl", [{"text": "x" * 50}])
    with pytest.raises(UserError, match="prepare"):
        D.load_dataset(Cfg(f), vocab_size=256)


def test_token_id_beyond_vocab(multi_doc, tmp_path):
    with pytest.raises(UserError) as e:
        D.load_dataset(Cfg(multi_doc), vocab_size=100)  # letters are 97..122
    assert e.value.field == "model.vocab_size" and "122" in e.value.problem
    txt = _write(tmp_path / "t.txt", "zzzz" * 10)
    with pytest.raises(UserError) as e:
        D.load_dataset(Cfg(txt), vocab_size=100)
    assert e.value.field == "model.vocab_size"


def test_corrupt_token_file(multi_doc):
    path = multi_doc + ".tokens.bin"
    raw = bytearray(open(path, "rb").read())
    raw[10] ^= 0x01
    open(path, "wb").write(raw)
    with pytest.raises(UserError, match="checksum") as e:
        D.load_dataset(Cfg(multi_doc), vocab_size=256)
    assert e.value.field == "data.path" and "prepare" in e.value.fix
    D.load_dataset(Cfg(multi_doc), vocab_size=256, verify="size")  # size-only check does not hash


def test_truncated_token_file(multi_doc):
    path = multi_doc + ".tokens.bin"
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 2)
    for verify in ("full", "size"):
        with pytest.raises(UserError, match="bytes") as e:
            D.load_dataset(Cfg(multi_doc), vocab_size=256, verify=verify)
        assert e.value.field == "data.path"


def test_corrupt_mask_and_index(tmp_path):
    f = _jsonl(tmp_path / "d.jsonl", [{"prompt": "abc" * 10, "response": "def" * 10}] * 3)
    out = str(tmp_path / "ds")
    D.prepare([f], out, quiet=True)
    with open(out + ".mask.bin", "r+b") as fh:
        fh.write(b"\x01")  # first token is a prompt token (0): flip it
    with pytest.raises(UserError, match="checksum"):
        D.load_dataset(Cfg(out), vocab_size=256)
    (tmp_path / "ds.json").write_text("{not json")
    with pytest.raises(UserError) as e:
        D.load_dataset(Cfg(out), vocab_size=256)
    assert e.value.field == "data.path"


def test_reprepare_replaces_and_removes_stale_mask(tmp_path):
    out = str(tmp_path / "ds")
    D.prepare([_jsonl(tmp_path / "d.jsonl", [{"prompt": "p" * 20, "response": "r" * 20}])], out, quiet=True)
    assert os.path.exists(out + ".mask.bin")
    D.prepare([_write(tmp_path / "t.txt", "plain " * 20)], out + ".json", quiet=True,  # suffix is stripped
              overwrite=True)
    assert _outputs(tmp_path) == ["ds.docs.npy", "ds.json", "ds.tokens.bin"]
    ds = D.load_dataset(Cfg(out), vocab_size=256)
    assert ds.mask is None and ds.n_tokens == 120


# ---------------------------------------------------------------------------------- prepare never loses data


def _snapshot(root):
    """Every path under ``root`` with its bytes and mtime: equal snapshots mean nothing was created or changed."""
    snap = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames:
            snap[os.path.relpath(os.path.join(dirpath, n), root) + "/"] = None
        for n in filenames:
            p = os.path.join(dirpath, n)
            with open(p, "rb") as f:
                snap[os.path.relpath(p, root)] = (f.read(), os.stat(p).st_mtime_ns)
    return snap


def _refused(capsys, argv, *names):
    """``megatrain-jax prepare ...`` in-process: exit 2, one stderr line naming ``names``."""
    from megatrain_jax.cli import main

    capsys.readouterr()
    assert main(["prepare", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    for n in names:
        assert n in err, (n, err)
    return err


def test_prepare_refuses_an_existing_prefix_without_overwrite(tmp_path, capsys):
    from megatrain_jax.cli import main

    out = str(tmp_path / "ds")
    big = _write(tmp_path / "big.txt", "the original corpus " * 50)
    small = _write(tmp_path / "small.txt", "tiny " * 20)
    assert main(["prepare", big, "--out", out, "--quiet"]) == 0
    before = _snapshot(tmp_path)
    for spelling in (out, out + ".json", out + ".tokens.bin"):
        _refused(capsys, [small, "--out", spelling, "--quiet"], "--out", out, "--overwrite")
        assert _snapshot(tmp_path) == before
    # any one file of a data set counts (a data set whose index was lost is still someone's data)
    os.remove(out + ".json")
    before = _snapshot(tmp_path)
    _refused(capsys, [small, "--out", out, "--quiet"], "--out", "ds.tokens.bin")
    assert _snapshot(tmp_path) == before
    # --overwrite replaces it; files beside it that prepare did not write stay as they are
    (tmp_path / "ds.notes.txt").write_text("mine")
    assert main(["prepare", small, "--out", out, "--quiet", "--overwrite"]) == 0
    assert D.load_dataset(Cfg(out), vocab_size=256).n_tokens == 100
    assert (tmp_path / "ds.notes.txt").read_text() == "mine"


def test_prepare_refuses_a_directory_or_a_run_directory_whatever_the_flags(tmp_path, capsys):
    text = _write(tmp_path / "a.txt", "some text " * 30)
    (tmp_path / "adir").mkdir()
    (tmp_path / "adir" / "keep.txt").write_text("x")
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000010").mkdir(parents=True)
    (run / "checkpoints" / "step_00000010" / "manifest.json").write_text("{}")
    (tmp_path / "ds.tokens.bin").mkdir()  # a directory where prepare would write a file
    before = _snapshot(tmp_path)
    for flags in ([], ["--overwrite"]):
        _refused(capsys, [text, "--out", str(tmp_path / "adir"), *flags], "--out", "adir", "directory")
        _refused(capsys, [text, "--out", str(tmp_path / "adir") + os.sep, *flags], "--out", "directory")
        _refused(capsys, [text, "--out", str(run / "data"), *flags], "--out", str(run), "checkpoints")
        _refused(capsys, [text, "--out", str(run / "checkpoints" / "data"), *flags], str(run), "checkpoints")
        _refused(capsys, [text, "--out", str(run / "checkpoints" / "step_00000010" / "new" / "data"), *flags],
                 str(run), "checkpoints")
        _refused(capsys, [text, "--out", str(tmp_path / "ds"), *flags], "ds.tokens.bin")
        assert _snapshot(tmp_path) == before  # nothing created, nothing changed, no directory made


def test_a_failed_or_interrupted_overwrite_leaves_the_old_data_set(tmp_path, monkeypatch):
    out = str(tmp_path / "ds")
    D.prepare([_write(tmp_path / "a.txt", "the good data set " * 30)], out, quiet=True)
    before = _snapshot(tmp_path)
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"text": "new data"}\n' * 100 + "{broken\n")
    with pytest.raises(UserError):  # a bad line after many good ones
        D.prepare([str(bad)], out, quiet=True, overwrite=True)
    after = _snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k != "b.jsonl"} == {k: v for k, v in before.items() if k != "b.jsonl"}

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "_prepare_text", interrupt)  # Ctrl-C while tokenizing
    with pytest.raises(KeyboardInterrupt):
        D.prepare([str(tmp_path / "a.txt")], out, quiet=True, overwrite=True)
    assert _snapshot(tmp_path) == after
    monkeypatch.undo()

    # killed between renames: the old index goes first, so what is left is no data set, never a mix
    replace, calls = os.replace, []

    def dies_on_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt
        replace(src, dst)

    monkeypatch.setattr(packed_mod.os, "replace", dies_on_second)
    with pytest.raises(KeyboardInterrupt):
        D.prepare([_write(tmp_path / "c.txt", "other " * 40)], out, quiet=True, overwrite=True)
    monkeypatch.undo()
    assert not os.path.exists(out + ".json")
    with pytest.raises(UserError, match="does not exist"):
        D.load_dataset(Cfg(out), vocab_size=256)
    assert not [n for n in os.listdir(tmp_path) if ".tmp" in n]  # temporary files removed


def test_a_worker_process_reports_a_bad_line_by_file_and_line(tmp_path):
    """With worker processes a bad line is the same one-line error (it used to hang the run: a
    UserError does not survive pickling back to the parent)."""
    f = _jsonl(tmp_path / "d.jsonl", [{"text": f"line {i}"} for i in range(10)])
    with open(f, "a") as fh:
        fh.write("{broken\n")
    with pytest.raises(UserError) as e:
        D.prepare([f], str(tmp_path / "ds"), quiet=True, workers=2)
    assert e.value.field == f"{f}:11" and "JSON" in e.value.problem
    assert _outputs(tmp_path) == []
    index = D.prepare([f], str(tmp_path / "ds"), quiet=True, workers=2, on_error="skip")
    assert index["report"]["bad_lines_skipped"] == 1 and index["report"]["examples_written"] == 10


def test_load_dataset_with_a_batch_size_refuses_too_little_data(tmp_path):
    """``load_dataset(..., batch_size=)`` checks that one batch fits, so train can refuse before it writes."""
    path = _write(tmp_path / "small.txt", "x" * 300)
    with pytest.raises(UserError) as e:
        D.load_dataset(Cfg(path, seq_len=512), vocab_size=256, batch_size=1)
    assert e.value.field == "data.seq_len" and "300 tokens" in e.value.problem and "299" in e.value.fix
    with pytest.raises(UserError) as e:
        D.load_dataset(Cfg(path, seq_len=64), vocab_size=256, batch_size=8)  # 4 samples
    assert e.value.field == "train.batch_size" and "4 samples" in e.value.problem
    assert D.load_dataset(Cfg(path, seq_len=64), vocab_size=256, batch_size=4).n_samples() == 4
    assert D.load_dataset(Cfg(path, seq_len=512), vocab_size=256).n_tokens == 300  # no batch size: no batch check


def test_prepare_never_writes_over_its_own_input_whatever_the_flags(tmp_path, capsys):
    """Issue 47 item 1: a chat file ``y.json`` (read as JSONL) and ``prepare y.json --out y``: refused as if
    y.json were an earlier output, and with the suggested --overwrite the input was replaced by the data
    index. An output file that is an input, or lies in an input directory, is refused whatever the flags;
    a ``PREFIX.json`` that prepare did not write is never replaced either."""
    from megatrain_jax.cli import main

    chat = [{"messages": [{"role": "user", "content": f"question {i}"},
                          {"role": "assistant", "content": f"answer {i} " * 8}]} for i in range(20)]
    y = _jsonl(tmp_path / "y.json", chat)
    text = _write(tmp_path / "corpus.txt", "some text " * 50)
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")  # refused before it is read: its content does not matter
    before = _snapshot(tmp_path)
    for flags in ([], ["--overwrite"]):
        for argv, names in [
            ([y, "--out", str(tmp_path / "y"), "--chat-template", "chatml"], ["--out", "y.json", "input"]),
            ([y, "--out", str(tmp_path / "y.json"), "--chat-template", "chatml"], ["--out", "y.json", "input"]),
            ([str(tmp_path), "--out", str(tmp_path / "new")], ["--out", "lies inside the input"]),
            ([text, "--out", str(tok / "tokenizer"), "--tokenizer", str(tok / "tokenizer.json")],
             ["--out", "tokenizer.json", "input"]),
            ([text, "--out", str(tmp_path / "y")], ["--out", "y.json", "not a file prepare wrote"]),
        ]:
            _refused(capsys, [*argv, "--quiet", *flags], *names)
            assert _snapshot(tmp_path) == before  # the input is untouched, nothing created
    assert main(["prepare", y, "--out", str(tmp_path / "ds"), "--chat-template", "chatml", "--quiet"]) == 0
    assert _snapshot(tmp_path)["y.json"] == before["y.json"]
    assert D.load_dataset(Cfg(str(tmp_path / "ds")), vocab_size=256).n_tokens > 0
