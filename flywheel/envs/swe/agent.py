"""The built-in coding agent's side of the conversation: what it is told, how its replies become
shell commands, and how command results are shown to it.

In the spirit of mini-swe-agent: every reply is a short thought and exactly one ```bash block;
each command runs in a fresh shell at the repository root (`cd` and `export` do not persist);
the agent ends the episode by running `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` (mini-swe-agent's
submit marker, so prompts written for it carry over). A reply without exactly one bash block
gets a format reminder as its observation, which costs a turn like any other.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
_BASH_BLOCK = re.compile(r"```(?:bash|sh)\s*\n(.*?)\n?```", re.DOTALL)

SYSTEM = f"""You are a software engineer fixing a bug in a Python repository.
Every reply: a short THOUGHT, then exactly one command in a ```bash block, like this:

THOUGHT: the failing test is about parsing; look at the parser.
```bash
grep -n "def parse" -r .
```

Each command runs in a fresh shell in the repository root: `cd` and `export` do not persist.
There is no network. Edit files with sed, python or a heredoc (cat <<'EOF' > file). Do not edit the tests.
When the fix is done, reply with exactly this command:
```bash
echo {SUBMIT_MARKER}
```"""

INSTANCE = """Fix this issue in the repository (your working directory):

{problem_statement}"""

FORMAT_REMINDER = (
    "Your reply must contain exactly one ```bash block with one command (found {found}). "
    f"To finish, run `echo {SUBMIT_MARKER}`."
)


@dataclass(frozen=True)
class Action:
    command: str | None
    """The command to run; None when the reply was not well formed."""
    error: str = ""


def parse_action(reply: str) -> Action:
    blocks = _BASH_BLOCK.findall(reply)
    if len(blocks) != 1 or not blocks[0].strip():
        return Action(None, FORMAT_REMINDER.format(found=len(blocks)))
    return Action(blocks[0].strip())


def submission(output: str, returncode: int) -> str | None:
    """What a command's result submits (the output after its first line), when that first line
    is the marker and the command succeeded; else None."""
    lines = output.lstrip().splitlines(keepends=True)
    if returncode == 0 and lines and lines[0].strip() == SUBMIT_MARKER:
        return "".join(lines[1:])
    return None


def observation(output: str, returncode: int, exception_info: str = "", limit: int = 4000) -> str:
    """A command's result as the agent sees it; long outputs keep their head and tail."""
    if len(output) > limit:
        half = limit // 2
        output = f"{output[:half]}\n... [{len(output) - limit} characters elided] ...\n{output[-half:]}"
    note = f"<note>{exception_info}</note>\n" if exception_info else ""
    return f"{note}<returncode>{returncode}</returncode>\n<output>\n{output}</output>"
