"""mini-swe-agent's `Environment` protocol over a Flywheel sandbox, so that mini-swe-agent (pinned:
`mini-swe-agent==2.4.6`) and agents built the same way drive a Flywheel sandbox unchanged.

In 2.4.6 an environment is duck-typed (`minisweagent.Environment` is a `typing.Protocol`):

- `execute(action, cwd="", *, timeout=None) -> {"output", "returncode", "exception_info"}`, the
  command in `action["command"]`. Each command is a fresh `bash -c` (`cd`/`export` do not
  persist), exactly like mini-swe-agent's own environments.
- Submission: when the output's first line is `COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` and the
  return code is 0, `execute` raises `minisweagent.exceptions.Submitted` with an `exit` message
  whose `submission` is the rest of the output (what `LocalEnvironment._check_finished` does).
- `get_template_vars(**kwargs)`: the variables its prompt templates use (`mini.yaml` renders
  `{{system}} {{release}} {{version}} {{machine}}` with jinja2's StrictUndefined).
- `serialize()`: `{"info": {"config": {"environment", "environment_type"}}}`, merged into the
  agent's trajectory file.

Two ways to build one:

    env = MiniSweAgentEnvironment(sandbox)            # a sandbox you opened (and will close)
    mini ... --environment-class envs.swe.mini_swe_agent.MiniSweAgentEnvironment \\
         -c environment.workdir=/path/to/repo -c environment.backend=bubblewrap
                                                      # the `mini` CLI opens one from its config

mini-swe-agent is not a dependency of Flywheel (it pins `openai<3` through litellm; it lives in
its own virtualenv, `make msa-venv`): nothing here imports it until a submission is raised, and
without it a local `Submitted` of the same shape is raised instead.
"""

from __future__ import annotations

import platform
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flywheel.envs.sandbox.base import Sandbox
from flywheel.envs.swe.agent import submission


class _LocalSubmitted(Exception):
    """Stand-in for `minisweagent.exceptions.Submitted` when mini-swe-agent is not installed."""

    def __init__(self, *messages: dict):
        self.messages = messages
        super().__init__()


def submitted_class() -> type[Exception]:
    """mini-swe-agent's `Submitted` (what its agents catch), or a stand-in of the same shape."""
    try:
        from minisweagent.exceptions import Submitted
    except ImportError:
        return _LocalSubmitted
    return Submitted


@dataclass
class MiniSweAgentEnvironmentConfig:
    cwd: str = ""
    """Where commands start ("" = the sandbox's working directory, the task's repository)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables of every command (mini.yaml sets PAGER, TQDM_DISABLE, ...)."""
    timeout: float | None = None
    """Per-command wall-clock limit in seconds (None: the sandbox's `Limits.timeout_s`)."""
    workdir: str | None = None
    """Only when this environment opens its own sandbox: the repository copy to work in."""
    backend: str = "bubblewrap"
    slot: int = 0
    readonly: list[str] = field(default_factory=list)


class MiniSweAgentEnvironment:
    """A mini-swe-agent 2.4.6 `Environment` whose commands run in a Flywheel `Sandbox`."""

    def __init__(self, sandbox: Sandbox | None = None, **kwargs: Any):
        self.config = MiniSweAgentEnvironmentConfig(**kwargs)
        self._owns_sandbox = sandbox is None
        self.sandbox = sandbox if sandbox is not None else self._open()

    def _open(self) -> Sandbox:
        """Open a sandbox from the config, as mini-swe-agent's CLI builds environments from kwargs."""
        from flywheel.envs.sandbox import make_backend
        from flywheel.envs.sandbox.base import Limits, SandboxSpec

        if not self.config.workdir:
            raise ValueError("MiniSweAgentEnvironment needs a sandbox or environment.workdir "
                             "(the repository to work in)")
        limits = Limits(timeout_s=self.config.timeout) if self.config.timeout else Limits()
        spec = SandboxSpec(workdir=Path(self.config.workdir).resolve(),
                           readonly=tuple(Path(p) for p in self.config.readonly), env=dict(self.config.env),
                           limits=limits)
        return make_backend(self.config.backend).open(spec, self.config.slot)

    def execute(self, action: dict | str, cwd: str = "", *, timeout: float | None = None) -> dict[str, Any]:
        """Run `action["command"]` in the sandbox; raise `Submitted` on the submit marker."""
        command = action if isinstance(action, str) else action.get("command", "")
        if self.config.env and not self._owns_sandbox:  # a sandbox we opened has them in its spec
            command = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in self.config.env.items()) + command
        try:
            result = self.sandbox.execute(command, cwd=cwd or self.config.cwd,
                                          timeout=timeout or self.config.timeout)
            output: dict[str, Any] = {"output": result.get("output", ""), "returncode": result.get("returncode", -1),
                                      "exception_info": result.get("exception_info", "")}
        except Exception as e:  # the sandbox itself failed: report it to the agent like LocalEnvironment does
            output = {"output": "", "returncode": -1, "exception_info": f"An error occurred while executing the command: {e}",
                      "extra": {"exception_type": type(e).__name__, "exception": str(e)}}
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict[str, Any]) -> None:
        submitted = submission(output.get("output", ""), output["returncode"])
        if submitted is not None:
            raise submitted_class()(
                {"role": "exit", "content": submitted, "extra": {"exit_status": "Submitted", "submission": submitted}}
            )

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        """The config, the kernel's uname (`system`, `release`, `version`, `machine`: the sandbox
        shares the host kernel) and the sandbox's environment variables; never the host's
        environment (mini-swe-agent's LocalEnvironment merges `os.environ` into prompts)."""
        spec_env = dict(getattr(getattr(self.sandbox, "spec", None), "env", {}) or {})
        return {**asdict(self.config), **platform.uname()._asdict(), **spec_env, **self.config.env, **kwargs}

    def serialize(self) -> dict[str, Any]:
        config = {k: v for k, v in asdict(self.config).items()}
        spec = getattr(self.sandbox, "spec", None)
        if spec is not None:
            config["sandbox_workdir"] = str(spec.workdir)
            config["sandbox_type"] = f"{type(self.sandbox).__module__}.{type(self.sandbox).__name__}"
        return {"info": {"config": {"environment": config,
                                    "environment_type": f"{type(self).__module__}.{type(self).__name__}"}}}

    def close(self) -> None:
        """Close the sandbox if this environment opened it (which also removes its working
        directory; a sandbox passed in is the caller's to close)."""
        if self._owns_sandbox:
            self.sandbox.close()
