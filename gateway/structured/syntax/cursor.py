"""A position in constraint text, with what every grammar parser here shares: line/column errors, the nesting
limit, peeking, expecting a token, and skipping blanks and line comments."""

from __future__ import annotations

from typing import ClassVar, NoReturn

from .errors import ConstraintError, ConstraintTooDeep
from .grammar_ast import LineIndex


class Cursor:
    """``pos`` into ``text``; errors name ``label`` (the dialect) and the line and column."""

    comment_starts: ClassVar[tuple[str, ...]] = ("#",)  # each starts a comment running to the end of the line

    def __init__(self, text: str, label: str, max_nesting: int) -> None:
        self.text = text
        self.n = len(text)
        self.pos = 0
        self.label = label
        self.lines = LineIndex(text)
        self.max_nesting = max_nesting

    def line_col(self, pos: int) -> tuple[int, int]:
        return self.lines.line_col(pos)

    def fail(self, message: str, pos: int | None = None, error: type[ConstraintError] = ConstraintError) -> NoReturn:
        line, col = self.line_col(self.pos if pos is None else pos)
        raise error(f"{self.label} grammar error at line {line}, column {col}: {message}")

    def too_deep(self) -> NoReturn:
        self.fail(f"nested deeper than {self.max_nesting} levels", error=ConstraintTooDeep)

    def peek(self, offset: int = 0) -> str:
        at = self.pos + offset
        return self.text[at] if at < self.n else ""

    def skip(self, newlines: bool) -> None:
        comments = self.comment_starts
        while self.pos < self.n:
            ch = self.text[self.pos]
            if ch in " \t" or (newlines and ch in "\r\n"):
                self.pos += 1
            elif self.text.startswith(comments, self.pos):
                end = self.text.find("\n", self.pos)
                self.pos = self.n if end < 0 else end
            else:
                break

    def expect(self, token: str, what: str) -> None:
        if not self.text.startswith(token, self.pos):
            found = repr(self.peek()) if self.pos < self.n else "end of input"
            self.fail(f"expected {what}, found {found}")
        self.pos += len(token)
