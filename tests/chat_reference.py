"""transformers' apply_chat_template as the reference for the chat masks (runs in .venv-torch).

    python tests/chat_reference.py TOKENIZER_DIR CONVERSATIONS.jsonl OUT.json
Writes, per conversation, the token ids and the assistant mask that
``apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)`` gives.
"""
import json
import sys

from transformers import AutoTokenizer

tok = AutoTokenizer.from_pretrained(sys.argv[1])
out = []
with open(sys.argv[2]) as f:
    for line in f:
        msgs = json.loads(line)["messages"]
        r = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        out.append({"input_ids": list(r["input_ids"]), "assistant_masks": list(r["assistant_masks"]),
                    "text": tok.apply_chat_template(msgs, tokenize=False)})
with open(sys.argv[3], "w") as f:
    json.dump(out, f)
