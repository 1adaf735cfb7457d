"""docs/config.md, the configuration reference, generated from ``config/schema.py``: every field of every section,
its type, its default and its comment, in the order the schema declares them. The schema is the one place a field
is described; this renders it, and ``tests/test_config_docs.py`` fails when the page is stale.

    .venv/bin/python -m megatrain_jax.config.docs           # write docs/config.md
    .venv/bin/python -m megatrain_jax.config.docs --check   # exit 1 if docs/config.md is not current
"""
from __future__ import annotations

import ast
import dataclasses
import io
import sys
import tokenize
from pathlib import Path

import megatrain_jax.config.schema as schema

SCHEMA = Path(schema.__file__)
OUT = Path(__file__).resolve().parents[2] / "docs" / "config.md"
COMMAND = ".venv/bin/python -m megatrain_jax.config.docs"
SECTIONS = (("model", schema.ModelConfig), ("model.lora", schema.LoraConfig), ("optim", schema.OptimConfig),
            ("optim.schedule", schema.ScheduleConfig), ("data", schema.DataConfig), ("train", schema.TrainConfig))


def _comments(source: str) -> dict[int, str]:
    """Line number -> the text of the comment on that line (tokenize: a ``#`` inside a string is not one)."""
    return {tok.start[0]: tok.string[1:] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.COMMENT}


def _pure_comment(line: str) -> bool:
    return line.lstrip().startswith("#")


def _field_notes(cls_node: ast.ClassDef, lines: list[str], comments: dict[int, str]) -> dict[str, tuple[str, str]]:
    """field name -> (heading that precedes it, or "", its comment): the comment on the field's line plus the
    comment-only lines under it indented as its continuation (``#`` then two or more spaces); a comment-only line
    of another form before a field (``# ---- memory ...``) is a heading."""
    out, heading = {}, ""
    for node in cls_node.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above = node.lineno - 1
        while above >= 1 and _pure_comment(lines[above - 1]) and not comments[above].startswith("  "):
            heading = comments[above].strip().lstrip("-").strip()
            above -= 1
        text = [comments.get(node.lineno, "").strip()]
        nxt = node.end_lineno + 1
        while nxt <= len(lines) and _pure_comment(lines[nxt - 1]) and comments[nxt].startswith("  "):
            text.append(comments[nxt].strip())
            nxt += 1
        out[node.target.id] = (heading, " ".join(t for t in text if t))
        heading = ""
    return out


def _yaml(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value)


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return f"`{_yaml(f.default)}`"
    value = f.default_factory()
    if dataclasses.is_dataclass(value):
        return "(a section, below)"
    return f"`{_yaml(value)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _section(name: str, cls: type, notes: dict[str, tuple[str, str]]) -> list[str]:
    out = [f"## `{name}`", ""]
    doc = cls.__doc__ if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "(") else ""
    if doc:
        out += [" ".join(doc.split()), ""]
    table = ["| field | type | default | meaning |", "|---|---|---|---|"]
    out += table
    for f in dataclasses.fields(cls):
        heading, text = notes.get(f.name, ("", ""))
        if heading:
            out += ["", f"*{_cell(heading)}*", ""] + table
        out.append(f"| `{name}.{f.name}` | `{_cell(str(f.type))}` | {_cell(_default(f))} | {_cell(text)} |")
    return out + [""]


def _optimizer_fields() -> list[str]:
    out = ["Optimizer fields left null take the named optimizer's value (`OPTIMIZER_FIELDS`); a field given for an",
           "optimizer that does not use it is refused. `lr`, `weight_decay`, `clip_norm` and the schedule apply to",
           "every optimizer; `kernel: fused` and `moments` are AdamW's.", "",
           "| `optim.name` | its fields, with the value each takes when null |", "|---|---|"]
    for name, fields in schema.OPTIMIZER_FIELDS.items():
        out.append(f"| `{name}` | " + ", ".join(f"`{k}`: `{_yaml(v)}`" for k, v in fields.items()) + " |")
    return out + [""]


def render() -> str:
    source = SCHEMA.read_text()
    tree, lines, comments = ast.parse(source), source.splitlines(), _comments(source)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    out = ["# Configuration reference", "",
           f"Generated from `megatrain_jax/config/schema.py` by `{COMMAND}`; do not edit by hand:",
           "the schema's comments are the source, and `tests/test_config_docs.py` fails when this page is stale.", "",
           "A config is YAML with these sections; `base: other.yaml` starts from another file, and",
           "`--set section.field=value` overrides any field from the command line (`--set optim.lr=1e-4`).", ""]
    for name, cls in SECTIONS:
        out += _section(name, cls, _field_notes(classes[cls.__name__], lines, comments))
        if name == "optim":
            out += _optimizer_fields()
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = render()
    if "--check" in args:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(f"{OUT} is not current: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
