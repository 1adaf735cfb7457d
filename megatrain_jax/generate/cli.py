"""``megatrain-jax generate SOURCE``: sample from a run's checkpoint, an export, a Hugging Face directory or a Hub id.

    megatrain-jax generate runs/my-run --prompt "Once upon a time" --max-new-tokens 64
    megatrain-jax generate Qwen/Qwen2.5-0.5B-Instruct --chat --prompts questions.jsonl --out answers.jsonl \\
        --temperature 0.7 --top-p 0.9 --seed 1

Prompts: ``--prompt TEXT`` (repeatable) and/or ``--prompts FILE.jsonl`` (one object a line: ``prompt`` text,
``messages`` (a conversation, rendered with the chat template) or ``prompt_ids`` (token ids)). ``--chat`` renders
text prompts as one user turn with the model's chat template (``--chat-template DIR|chatml`` another). Greedy by
default; ``--temperature`` with ``--top-k`` / ``--top-p`` and ``--seed`` samples. Each row stops at an end-of-sequence
id, a ``--stop`` string or ``--max-new-tokens``. The output is printed, or written as JSONL to ``--out`` (atomically:
a temporary file renamed into place). ``--plan`` prints the generation plan (``generate/plan.py``) and exits.
Every user mistake is one line and exit 2, before anything is written.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from megatrain_jax.errors import UserError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2 through the CLI's UserError path
        raise UserError("generate", f"bad arguments ({message})", "see `megatrain-jax generate --help`")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="megatrain-jax generate", description=__doc__.splitlines()[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", metavar="SOURCE",
                   help="a training run (train.out_dir or a checkpoint), an export, a Hugging Face directory or a "
                        "Hub id")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                   help="one JSON object a line: prompt (text), messages (a conversation) or prompt_ids")
    p.add_argument("--chat", action="store_true", help="render text prompts with the model's chat template")
    p.add_argument("--chat-template", default=None, metavar="DIR|chatml", help="another chat template")
    p.add_argument("--system", default=None, help="with --chat: a system turn before each prompt")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of this probability mass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--out", default=None, metavar="FILE.jsonl", help="write the completions as JSONL here")
    p.add_argument("--overwrite", action="store_true", help="--out may replace an earlier output of generate (never "
                   "another file)")
    p.add_argument("--batch-size", default="auto", help="prompts decoded together (auto: all that fit)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="compute dtype (auto: bfloat16 on a GPU, float32 on the CPU)")
    p.add_argument("--weights", default="auto", choices=("auto", "resident", "streamed"),
                   help="weights on the GPU for the whole run, or streamed block by block (auto: resident where "
                        "they fit)")
    p.add_argument("--int8", action="store_true", help="stream the blocks as int8 (per output channel scales)")
    p.add_argument("--tokenizer", default=None, help="byte or a tokenizer.json (default: the source's)")
    p.add_argument("--gpu-memory-gb", type=float, default=None, help="plan for a GPU of this size")
    p.add_argument("--plan", action="store_true", help="print the generation plan and exit")
    return p


def _check_args(a: argparse.Namespace) -> None:
    if a.max_new_tokens < 1:
        raise UserError("--max-new-tokens", f"must be >= 1, got {a.max_new_tokens}", "pass e.g. --max-new-tokens 128")
    if not a.temperature >= 0:
        raise UserError("--temperature", f"must be >= 0, got {a.temperature}", "0 for greedy, e.g. 0.7 to sample")
    if a.top_k < 0:
        raise UserError("--top-k", f"must be >= 0, got {a.top_k}", "0 for no top-k, e.g. 50")
    if not 0 < a.top_p <= 1:
        raise UserError("--top-p", f"must be in (0, 1], got {a.top_p}", "1 for no top-p, e.g. 0.9")
    if a.batch_size != "auto" and (not str(a.batch_size).isdigit() or int(a.batch_size) < 1):
        raise UserError("--batch-size", f"must be auto or a positive integer, got {a.batch_size!r}", "e.g. 16")
    if a.int8 and a.weights == "resident":
        raise UserError("--int8", "streams the blocks as int8; --weights resident keeps them on the GPU",
                        "drop --int8, or use --weights streamed / auto")
    if any(not s for s in a.stop):
        raise UserError("--stop", "an empty stop string", "give a non-empty string")


def read_prompts(a: argparse.Namespace) -> list[dict]:
    """Each prompt as ``{"text"|"messages"|"ids": ..., "record": the JSONL object}``."""
    out = [{"text": t, "record": {"prompt": t}} for t in a.prompt]
    if a.prompts:
        if not os.path.isfile(a.prompts):
            raise UserError("--prompts", f"{a.prompts!r} does not exist", "give a JSONL file of prompts")
        with open(a.prompts, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError as e:
                    raise UserError("--prompts", f"{a.prompts}:{n} is not JSON ({e.msg})", "one JSON object a line") \
                        from None
                if not isinstance(rec, dict):
                    rec = {}
                if isinstance(rec.get("prompt"), str):
                    out.append({"text": rec["prompt"], "record": rec})
                elif isinstance(rec.get("messages"), list):
                    out.append({"messages": rec["messages"], "record": rec})
                elif isinstance(rec.get("prompt_ids"), list) and all(isinstance(i, int) for i in rec["prompt_ids"]):
                    out.append({"ids": [int(i) for i in rec["prompt_ids"]], "record": rec})
                else:
                    raise UserError("--prompts", f"{a.prompts}:{n} has no prompt (text), messages or prompt_ids",
                                    'write e.g. {"prompt": "Once upon a time"}')
    if not out:
        raise UserError("--prompt", "no prompt given", "pass --prompt TEXT or --prompts FILE.jsonl")
    return out


def encode_prompts(prompts: list[dict], src: Any, a: argparse.Namespace) -> tuple[list[list[int]], Any]:
    """Token ids of every prompt, and the tokenizer (None where every prompt came as ids)."""
    from megatrain_jax.data.chat import CHATML_TEMPLATE, ChatTemplate
    from megatrain_jax.data.tokenizer import load_tokenizer

    needs_text = any("ids" not in p for p in prompts)
    spec = a.tokenizer or src.tokenizer
    tok = None
    if spec is not None:
        tok = load_tokenizer(spec, "--tokenizer")
    elif needs_text:
        raise UserError("--tokenizer", f"{a.source} has no tokenizer (no tokenizer.json)",
                        "pass --tokenizer PATH/tokenizer.json (or byte), or give prompt_ids in --prompts")
    template = None
    if a.chat or any("messages" in p for p in prompts):
        if a.chat_template == "chatml":
            template = ChatTemplate(CHATML_TEMPLATE)
        else:
            folder = a.chat_template or src.folder
            template = ChatTemplate.from_folder(folder) if folder else None
        if template is None:
            raise UserError("--chat", f"{a.chat_template or a.source} has no chat template",
                            "pass --chat-template DIR (a model folder) or chatml, or plain prompts without --chat")
    bos = _bos(src)
    ids = []
    for p in prompts:
        if "ids" in p:
            ids.append(p["ids"])
            continue
        if "messages" in p or a.chat:
            msgs = p.get("messages") or ([{"role": "system", "content": a.system}] if a.system else []) + \
                [{"role": "user", "content": p["text"]}]
            text = template.render(msgs, add_generation_prompt=True, where="--prompts")
            ids.append([int(i) for i in tok.encode(text)])
        else:
            ids.append(([bos] if bos is not None else []) + [int(i) for i in tok.encode(p["text"])])
    return ids, tok


def _bos(src: Any) -> int | None:
    """The BOS id a plain prompt starts with, where the tokenizer's config asks for it (``add_bos_token``)."""
    if not src.folder:
        return None
    try:
        with open(os.path.join(src.folder, "tokenizer_config.json")) as f:
            tc = json.load(f)
        with open(os.path.join(src.folder, "config.json")) as f:
            bos = json.load(f).get("bos_token_id")
    except (OSError, ValueError):
        return None
    return int(bos) if tc.get("add_bos_token") and isinstance(bos, int) else None


def check_lengths(ids: list[list[int]], src: Any, a: argparse.Namespace) -> None:
    vocab = src.cfg.vocab_size
    for i, x in enumerate(ids):
        if not x:
            raise UserError("--prompt", f"prompt {i + 1} is empty", "give every prompt at least one token")
        bad = [t for t in x if not 0 <= t < vocab]
        if bad:
            raise UserError("--prompts", f"prompt {i + 1} holds token id {bad[0]}, outside the vocabulary of {vocab}",
                            "use the model's tokenizer")
    ctx = src.context
    if ctx:
        longest = max(len(x) for x in ids)
        if longest >= ctx:
            raise UserError("--prompt", f"a prompt of {longest} tokens does not fit the model's context of {ctx} "
                            "tokens", f"shorten it below {ctx} tokens")
        if longest + a.max_new_tokens > ctx:
            raise UserError("--max-new-tokens", f"{a.max_new_tokens} new tokens after a prompt of {longest} pass the "
                            f"model's context of {ctx} tokens", f"pass --max-new-tokens {ctx - longest} or less")


def written_by_generate(path: str) -> bool:
    """Whether ``path`` holds completions as generate writes them: JSON objects with a prompt and a completion."""
    try:
        with open(path, encoding="utf-8") as f:
            recs = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return False
    return all(isinstance(r, dict) and "completion" in r and "completion_ids" in r for r in recs)


def check_replaceable(out: str, overwrite: bool) -> None:
    """``--out`` never replaces a file by surprise: an existing one only with ``--overwrite``, and only an earlier
    output of generate (the project's writer rule, README "Nothing is lost")."""
    if not os.path.exists(out):
        return
    if not overwrite:
        raise UserError("--out", f"{out} exists", "give a new file name, or --overwrite to replace an earlier "
                        "output of generate")
    if not written_by_generate(out):
        raise UserError("--out", f"{out} was not written by generate (--overwrite replaces only generate's outputs)",
                        "give a new file name")


def generate_main(argv: list[str]) -> int:
    a = parser().parse_args(list(argv))
    _check_args(a)
    prompts = read_prompts(a)
    if a.out:
        from megatrain_jax.atomic import check_place

        check_place(a.out, inputs=[a.source, a.prompts], field="--out", files=[a.out])
        if os.path.isdir(a.out):
            raise UserError("--out", f"{a.out} is a directory", "give a file name, e.g. completions.jsonl")
        check_replaceable(a.out, a.overwrite)
    from megatrain_jax.plan.machine import detect_machine, jax_backend_ready

    if os.environ.get("JAX_PLATFORMS", "") != "cpu" and not jax_backend_ready():
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # the plan's budget, not XLA's 0.75 (set
        #                                                                   before anything can start JAX's backend)
    from megatrain_jax.generate.source import open_source

    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731 - stdout carries the completions
    src = open_source(a.source, log)
    try:
        ids, tok = encode_prompts(prompts, src, a)
        check_lengths(ids, src, a)
        machine = detect_machine()
        gpu = a.gpu_memory_gb * 1e9 if a.gpu_memory_gb else machine.gpu_bytes
        dtype = a.dtype if a.dtype != "auto" else ("bfloat16" if machine.backend == "gpu" else "float32")
        from megatrain_jax.generate.engine import cache_bucket, padded_prompt
        from megatrain_jax.generate.plan import plan_generation

        want = len(ids) if a.batch_size == "auto" else min(int(a.batch_size), len(ids))
        cache = cache_bucket(padded_prompt(max(len(x) for x in ids)) + a.max_new_tokens)
        kw = dict(prompt_len=max(len(x) for x in ids), max_new_tokens=a.max_new_tokens, dtype=dtype,
                  weights=a.weights, int8=a.int8, gpu_bytes=None if gpu is None else gpu * 0.95, cache_len=cache)
        if a.batch_size == "auto":
            probe = plan_generation(src.cfg, src.layouts, batch=1, **kw)
            want = max(1, min(want, probe.max_batch))
        plan = plan_generation(src.cfg, src.layouts, batch=want, **kw)
        if a.plan:
            print(plan.table())
            return 0
        results = _run(src, ids, tok, plan, dtype, a, log)
    finally:
        src.close()
    _write(results, prompts, a)
    return 0


def _run(src: Any, ids: list[list[int]], tok: Any, plan: Any, dtype: str, a: argparse.Namespace, log) -> list:
    from megatrain_jax.generate.engine import Decoder, Sampling, Timing, Weights

    log(f"generate: {src.describe}; {len(ids)} prompt(s), batch {plan.batch}, weights {plan.weights}, {dtype}")
    weights = Weights(src, dtype, streamed=plan.weights == "streamed", int8=a.int8, log=log)
    dec = Decoder(src, weights)
    sampling = Sampling(a.temperature, a.top_k, a.top_p, a.seed)
    eos = set(src.eos_ids) | ({tok.eos_id} if tok is not None and getattr(tok, "eos_id", None) is not None else set())

    def stopper(rows):
        if not a.stop or tok is None:
            return None

        def stop(r, gen):
            text = tok.decode(gen)
            return len(gen) if any(s in text for s in a.stop) else None
        return stop

    timing = Timing()
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # batches of similar lengths: little padding
    done: dict[int, Any] = {}
    t0 = time.perf_counter()
    try:
        for lo in range(0, len(ids), plan.batch):
            rows = order[lo:lo + plan.batch]
            batch = [ids[i] for i in rows]
            got = dec.run_batch(batch, a.max_new_tokens, sampling, eos_ids=tuple(sorted(eos)), stop=stopper(batch),
                                timing=timing, cache_len=plan.cache_len)
            done.update(zip(rows, got))
    finally:
        weights.close()
    out = [done[i] for i in range(len(ids))]
    n_new = sum(len(c.ids) for c in out)
    log(f"generate: {n_new} tokens in {time.perf_counter() - t0:.1f}s (prefill {timing.prefill_s:.2f}s, "
        f"decode {timing.decode_s:.2f}s)")
    for c in out:
        gen = [t for t in c.ids if t not in eos] if c.finish_reason == "eos" else c.ids
        if tok is not None:
            text = tok.decode(gen)
            if c.finish_reason == "stop":
                cut = min((text.find(s) for s in a.stop if s in text), default=len(text))
                text = text[:cut]
            c.text = text
    return out


def _write(results: list, prompts: list[dict], a: argparse.Namespace) -> None:
    recs = []
    for p, c in zip(prompts, results):
        rec = {k: v for k, v in p["record"].items()}
        rec.update({"completion": c.text, "completion_ids": c.ids, "prompt_tokens": len(c.prompt_ids),
                    "finish_reason": c.finish_reason})
        recs.append(rec)
    if a.out:
        tmp = f"{a.out}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            for r in recs:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        os.replace(tmp, a.out)
        print(f"generate: {len(recs)} completion(s) written to {a.out}", file=sys.stderr)
        return
    for i, r in enumerate(recs):
        if len(recs) > 1:
            print(f"--- {i + 1}")
        print(r["completion"] if r["completion"] is not None else " ".join(map(str, r["completion_ids"])))
