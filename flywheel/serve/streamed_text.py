"""What of a streamed choice's text the client sees, chunk by chunk, at a cost bounded by the
new text rather than by the answer so far.

Without tools every piece is shown as it comes, the first after the served memory's opening
(`memory.opening`), which the prompt ends with. With tools, text that may be (the start of) a
tool call is held back (`ToolFormat.release`): only the unreleased tail is examined at each
chunk, and once a call has begun nothing more is shown or examined (the calls go out when the
choice ends). A forced call's prefix counts as the answer's start, so it holds everything.
"""

from __future__ import annotations

from flywheel.formats.tool_calls import ToolFormat
from flywheel.serve.text_pieces import TextPieces


class StreamedText:
    def __init__(self, tool_format: ToolFormat | None, forced: str = ""):
        self.tool_format = tool_format
        self._shown = TextPieces()
        self._pending = forced
        self._call_begun = False

    def add(self, text: str) -> str:
        """Take a chunk's text; returns what the client may see of it now."""
        if self.tool_format is None:
            visible, self._pending = self._pending + text, ""
        elif self._call_begun:
            return ""
        else:
            self._pending += text
            count, self._call_begun = self.tool_format.release(self._pending, bool(self._shown))
            visible, self._pending = self._pending[:count], self._pending[count:]
        self._shown.append(visible)
        return visible

    @property
    def shown(self) -> str:
        """All the text shown so far."""
        return self._shown.text

    @property
    def length(self) -> int:
        """Characters shown so far."""
        return self._shown.length
