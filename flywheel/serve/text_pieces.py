"""A string built by appending, at a cost per piece rather than per character so far: the
pieces are joined only when the whole is read (and kept joined until the next append)."""

from __future__ import annotations


class TextPieces:
    def __init__(self) -> None:
        self._pieces: list[str] = []
        self.length = 0
        """Characters so far."""

    def append(self, text: str) -> None:
        if text:
            self._pieces.append(text)
            self.length += len(text)

    @property
    def text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def __bool__(self) -> bool:
        return self.length > 0
