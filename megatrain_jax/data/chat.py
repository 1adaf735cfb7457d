"""Conversations as people have them, rendered with the model's own chat template.

Formats (detected per record, or named with ``prepare --chat-format``):

- ``messages``: OpenAI / Hugging Face ``{"messages": [{"role", "content"}, ...]}`` (system, user,
  assistant; multi-turn);
- ``sharegpt``: ``{"conversations": [{"from": "human"|"gpt"|"system", "value"}, ...]}``;
- ``alpaca``: ``{"instruction", "input" (optional), "output", "system" (optional)}``.

The template is the checkpoint's ``chat_template`` (``tokenizer_config.json``, or
``chat_template.jinja`` beside it), rendered as ``transformers``' ``apply_chat_template`` renders it:
jinja2's ``ImmutableSandboxedEnvironment`` with ``trim_blocks``/``lstrip_blocks``, ``raise_exception``,
``tojson``, ``strftime_now``, the special tokens as variables, and the ``{% generation %}`` block.

The loss covers assistant turns only. Where the template marks them (``{% generation %}`` ...
``{% endgeneration %}``), those character spans are the assistant's, as in transformers; where it does
not, each assistant turn's span is found by rendering prefixes: the conversation up to that turn with
``add_generation_prompt=True`` ends where the turn starts, and the conversation through that turn ends
where it (and its end-of-turn text) ends. Tokens overlapping a span get mask 1.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any

from megatrain_jax.errors import UserError

FORMATS = ("messages", "sharegpt", "alpaca")
ROLES = ("system", "user", "assistant")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}

# used when neither the tokenizer's folder nor --chat-template gives one (e.g. the byte tokenizer)
CHATML_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
                   "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
                   "{% endgeneration %}{{ '\\n' }}{% else %}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}"
                   "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def detect_format(obj: dict) -> str | None:
    """The chat format of one JSON record, or None when it is not a conversation."""
    if "messages" in obj:
        return "messages"
    if "conversations" in obj:
        return "sharegpt"
    if "instruction" in obj and "output" in obj:
        return "alpaca"
    return None


def to_messages(obj: dict, fmt: str, where: str) -> list[dict[str, str]]:
    """One record -> ``[{"role", "content"}]``, checked (a ``UserError`` naming ``where`` otherwise)."""
    if fmt == "alpaca":
        inst, inp, out = obj.get("instruction"), obj.get("input", ""), obj.get("output")
        for name, v in (("instruction", inst), ("output", out), ("input", inp)):
            if not isinstance(v, str):
                raise UserError(where, f"alpaca record: '{name}' is not a string", "give instruction and output strings")
        if not inst.strip() or not out.strip():
            raise UserError(where, "alpaca record: empty 'instruction' or 'output'", "drop or fill the record")
        msgs = [{"role": "system", "content": obj["system"]}] if isinstance(obj.get("system"), str) and obj["system"] else []
        msgs.append({"role": "user", "content": inst + ("\n\n" + inp if inp.strip() else "")})
        msgs.append({"role": "assistant", "content": out})
        return msgs
    key = "messages" if fmt == "messages" else "conversations"
    turns = obj.get(key)
    if not isinstance(turns, list) or not turns:
        raise UserError(where, f"'{key}' is not a non-empty list", f"give '{key}' as a list of turns")
    msgs = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise UserError(where, f"turn {i} is not an object", "write each turn as a JSON object")
        if fmt == "messages":
            role, content = t.get("role"), t.get("content")
            if role not in ROLES:
                raise UserError(where, f"turn {i}: role {role!r} is missing or unknown",
                                "use role system, user or assistant")
        else:
            src, content = t.get("from"), t.get("value")
            role = _SHAREGPT_ROLES.get(str(src).lower()) if src is not None else None
            if role is None:
                raise UserError(where, f"turn {i}: 'from' {src!r} is missing or unknown",
                                "use from: human, gpt or system")
        if not isinstance(content, str) or not content.strip():
            raise UserError(where, f"turn {i} ({role}): content is missing or empty", "give every turn some text")
        msgs.append({"role": role, "content": content})
    return msgs


# ------------------------------------------------------------------------------------ templates


def find_template(folder: str | None) -> str | None:
    """The chat template of a checkpoint/tokenizer folder: ``chat_template.jinja``, else the
    ``chat_template`` of ``tokenizer_config.json`` (a string, or the ``default`` of a list)."""
    if not folder:
        return None
    if os.path.isfile(folder):
        folder = os.path.dirname(folder)
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja) as f:
            return f.read()
    cfg = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(cfg):
        with open(cfg) as f:
            tpl = json.load(f).get("chat_template")
        if isinstance(tpl, list):
            tpl = {t.get("name"): t.get("template") for t in tpl}.get("default")
        if isinstance(tpl, str):
            return tpl
    return None


def _special_tokens(folder: str | None) -> dict[str, str]:
    out = {}
    cfg = os.path.join(folder, "tokenizer_config.json") if folder else None
    if cfg and os.path.isfile(cfg):
        with open(cfg) as f:
            d = json.load(f)
        for k in ("bos_token", "eos_token", "unk_token", "pad_token"):
            v = d.get(k)
            if isinstance(v, dict):
                v = v.get("content")
            if isinstance(v, str):
                out[k] = v
    return out


class ChatTemplate:
    """A compiled chat template that renders conversations and their assistant character spans."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, where: str = "--chat-template"):
        import jinja2
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        track: dict[str, Any] = {"blocks": None, "indices": []}
        self._track = track

        class Generation(Extension):  # transformers' AssistantTracker: records the rendered span
            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_track", []), [], [], body).set_lineno(lineno)

            @jinja2.pass_eval_context
            def _track(self, context, caller):
                rv = caller()
                if track["blocks"] is not None:  # start: everything generated before this block
                    start = sum(len(b) for b in track["blocks"])
                    track["indices"].append((start, start + len(rv)))
                return rv

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation,
                                                                                              jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise UserError(where, f"the chat template does not compile ({e})", "fix or replace the template") from None
        self.source = source
        self.has_generation = "{% generation" in source or "{%- generation" in source
        self.special = dict(special_tokens or {})
        self.where = where

    @classmethod
    def from_folder(cls, folder: str | None, where: str = "--chat-template") -> "ChatTemplate | None":
        src = find_template(folder)
        return None if src is None else cls(src, _special_tokens(folder), where)

    def render(self, messages: list[dict], add_generation_prompt: bool = False, track: bool = False,
               where: str | None = None) -> str:
        """The template's output; with ``track``, generation spans are recorded (streamed rendering, as
        transformers does it, so each block knows where it starts). A template that raises (its own
        ``raise_exception``, e.g. for a system message it takes none of) is a ``UserError`` naming ``where``."""
        try:
            if not track:
                return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            **self.special)
            blocks: list[str] = []
            self._track["blocks"], self._track["indices"] = blocks, []
            try:
                for block in self.template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                    **self.special):
                    blocks.append(block)
            finally:
                self._track["blocks"] = None
            return "".join(blocks)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - a template's raise_exception or a bad variable
            msg = " ".join(str(e).split()) or "no message"  # one line, whatever the template raised
            raise UserError(where or self.where, f"the chat template fails on this conversation "
                            f"({type(e).__name__}: {msg})", "make the record what the template expects (e.g. no "
                            "system turn, user/assistant turns alternating), or pass --on-error skip to skip such "
                            "records") from None

    def render_with_spans(self, messages: list[dict], where: str | None = None) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of its assistant turns (``where``, e.g.
        file:line, names the record in errors)."""
        if self.has_generation:
            text = self.render(messages, track=True, where=where)
            return text, [sp for sp in self._track["indices"] if sp[1] > sp[0]]
        text = self.render(messages, where=where)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = len(self.render(messages[:i], add_generation_prompt=True, where=where))
            end = len(self.render(messages[:i + 1], where=where))
            if text[:end] != self.render(messages[:i + 1], where=where) or start > end:
                at = f" ({where})" if where else ""
                raise UserError(self.where, f"the template does not render conversations as prefixes of each "
                                f"other{at}", "use a template with {% generation %} markers around assistant turns")
            spans.append((start, end))
        return text, spans


def token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]):
    """1 for each token whose characters overlap an assistant span, else 0."""
    import numpy as np

    mask = np.zeros(len(offsets), np.uint8)
    if not spans or not len(offsets):
        return mask
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    starts, ends = off[:, 0], off[:, 1]
    for a, b in spans:
        mask |= ((starts < b) & (ends > a)).astype(np.uint8)
    return mask
