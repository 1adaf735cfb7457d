"""`megatrain-jax prepare` on a large chat data set: throughput and peak memory.

Generates a JSONL of OpenAI-style `messages` conversations (system + 1-3 user/assistant turns of
text drawn from the shipped tinyshakespeare) of --gb gigabytes in a temporary folder, builds a small
byte-level BPE tokenizer with a ChatML template (the test suite's), runs `megatrain-jax prepare` on
it in a child process while sampling the child's RSS, and writes the figures as JSON.

    PYTHONPATH=. python experiments/bench_prepare_chat.py --gb 1 --out experiments/results
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def make_jsonl(path: str, gb: float, seed: int = 0) -> int:
    words = open(os.path.join(ROOT, "data", "tinyshakespeare.txt")).read().split()
    rnd = random.Random(seed)
    target, n, written = int(gb * 1e9), 0, 0

    def text(k):
        i = rnd.randrange(len(words) - k)
        return " ".join(words[i:i + k])

    with open(path, "w") as f:
        while written < target:
            msgs = [{"role": "system", "content": text(8)}]
            for _ in range(rnd.randint(1, 3)):
                msgs += [{"role": "user", "content": text(rnd.randint(10, 40))},
                         {"role": "assistant", "content": text(rnd.randint(20, 80))}]
            line = json.dumps({"messages": msgs}) + "\n"
            f.write(line)
            written += len(line)
            n += 1
    return n


def make_tokenizer(folder: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    text = open(os.path.join(ROOT, "data", "tinyshakespeare.txt")).read()[:300_000]
    tk.train_from_iterator([text], trainers.BpeTrainer(vocab_size=2000, special_tokens=["<|im_start|>", "<|im_end|>",
                                                                                       "<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.save(os.path.join(folder, "tokenizer.json"))
    shutil.copy(os.path.join(ROOT, "tests", "fixtures", "chat", "chatml_tokenizer_config.json"),
                os.path.join(folder, "tokenizer_config.json"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--name", default="prepare_chat_cpu", help="result file name (without .json)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench_chat_")
    try:
        src = os.path.join(tmp, "chat.jsonl")
        t0 = time.time()
        n_conv = make_jsonl(src, args.gb)
        gen_s = time.time() - t0
        make_tokenizer(tmp)
        cmd = [sys.executable, "-m", "megatrain_jax", "prepare", src, "--out", os.path.join(tmp, "prepared", "chat"),
               "--tokenizer", tmp]
        t0 = time.time()
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        peak = [0]

        def tree(pid):  # the prepare process and its worker processes
            out = [pid]
            try:
                for t in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{t}/children") as f:
                        out += [x for c in f.read().split() for x in tree(int(c))]
            except OSError:
                pass
            return out

        def rss_kb(pid):
            try:
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            return int(line.split()[1])
            except OSError:
                pass
            return 0

        def sample():
            while p.poll() is None:
                peak[0] = max(peak[0], sum(rss_kb(x) for x in tree(p.pid)))  # summed over the workers too
                time.sleep(0.2)

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        out, err = p.communicate()
        th.join()
        secs = time.time() - t0
        index = json.load(open(os.path.join(tmp, "prepared", "chat.json"))) if p.returncode == 0 else {}
        res = {"date": datetime.date.today().isoformat(), "machine": f"CPU ({os.cpu_count()} cores), no GPU",
               "command": " ".join(sys.argv), "input_bytes": os.path.getsize(src), "conversations": n_conv,
               "generate_s": gen_s, "rc": p.returncode, "prepare_s": secs, "peak_rss_gb_all_processes": peak[0] * 1024 / 1e9,
               "tokens": index.get("n_tokens"), "tokens_per_s": (index.get("n_tokens") or 0) / secs,
               "mb_per_s": os.path.getsize(src) / secs / 1e6, "masked_tokens": (index.get("mask") or {}).get("n_masked"),
               "report": index.get("report"), "stdout_tail": out[-1500:], "stderr_tail": err[-1500:]}
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, args.name + ".json"), "w") as f:
            json.dump(res, f, indent=1)
        print(json.dumps({k: v for k, v in res.items() if k not in ("stdout_tail", "stderr_tail", "report")}, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
