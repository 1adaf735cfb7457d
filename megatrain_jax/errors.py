"""One error type for everything a user can get wrong.

The CLI turns a ``UserError`` into one line on stderr and exit code 2, so every message names the
field at fault and how to fix it, and nothing is written before validation has passed.
"""
from __future__ import annotations


class UserError(Exception):
    """Bad input from the user: a config field, a file, a data value."""

    def __init__(self, field: str, problem: str, fix: str):
        self.field, self.problem, self.fix = field, problem, fix
        super().__init__(f"{field}: {problem} (fix: {fix})")

    def __reduce__(self):  # crosses process boundaries intact (prepare's worker processes)
        return (type(self), (self.field, self.problem, self.fix))
