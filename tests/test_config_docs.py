"""docs/config.md is generated from config/schema.py (megatrain_jax/config/docs.py) and kept current: a field added
to the schema, or a comment changed, shows here until the page is written again."""
import dataclasses

from megatrain_jax.config import docs, schema


def test_the_config_reference_is_current():
    assert docs.OUT.read_text() == docs.render(), f"docs/config.md is stale: run `{docs.COMMAND}` and commit it"


def test_the_reference_names_every_field_with_its_default_and_comment():
    text = docs.render()
    for section, cls in docs.SECTIONS:
        for f in dataclasses.fields(cls):
            assert f"| `{section}.{f.name}` |" in text, (section, f.name)
    row = next(line for line in text.splitlines() if line.startswith("| `train.grad_hold` |"))
    assert "`auto`" in row and "resweep" in row and "pinned_bf16" in row  # the comment's continuation lines too
    assert "| `adafactor` |" in text and "*memory" in text  # the optimizers' own fields; a heading in the schema


def test_a_comment_heading_and_continuations_are_read_from_the_source(tmp_path):
    src = ("class C:\n    a: int = 1  # first\n    #                second\n    # ---- group\n"
           "    b: str = 'x'  # b's\n")
    import ast

    notes = docs._field_notes(ast.parse(src).body[0], src.splitlines(), docs._comments(src))
    assert notes == {"a": ("", "first second"), "b": ("group", "b's")}
    assert schema.TrainConfig.__name__ in {cls.__name__ for _, cls in docs.SECTIONS}
