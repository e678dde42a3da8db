"""A vLLM server that Flywheel starts and stops itself (`serve.engine_kind: vllm` with no
`serve.engine_urls`): the serve loop's engine, as the embedded engine otherwise is.

vLLM lives in its own virtualenv, `.venv-vllm` (`make vllm-venv`: it pins its own transformers
and fastapi), and runs as `python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 and a free
port, in a session of its own (so stopping it ends its engine-core process too) and told to die
with the process that started it. It starts with what `flywheel.serve.backends.vllm` needs (the RL
endpoints, token-in/token-out generation, tempered log-probs, token ids in top log-probs) and
what makes it start fast and match the trainer on a CPU: float32 weights (the trainer's; vLLM's
log-probs then match its recomputation), eager mode (no compilation at start), one process for
the model (`--distributed-executor-backend uni`), vLLM's own sampling defaults (not the model's
`generation_config.json`), whole prompts in one step (chunked prefill off, the step's token
budget the model's context: the CPU build crashes when it splits the prompt of a request with a
seed, `CPU Generator does not use offset`), llguidance for response formats and forced tool calls (the grammar
engine the trainer replays them with), at most `serve.max_batch_size` sequences at once, and
Flywheel's worker extension (`vllm_ext/flywheel_worker.py`: weight reloads that also refresh
tied output layers, which the CPU build's own reload leaves stale).

Its model's worker is not pinned to cores (`VLLM_CPU_OMP_THREADS_BIND=nobind`). The CPU build
pins it to one core by default and keeps the rest for everything else; but its worker and its
engine core busy-wait between steps, and with the worker pinned the kernel left other runnable
processes (the gateway, its clients, vLLM's own HTTP server) without a core for seconds at a
time: on two cores a bystander that sleeps 10 ms at a time waited 15 s of 20 for one, up to
7.5 s at once. Unpinned: 3.1 s, at most 1.4 s at once, and vLLM served as many tokens per second
through the gateway, within the noise (`bench/vllm_first_event.py`, docs/experiments/odd-things.md). On a machine with cores to spare, where the CPU build's binding to a NUMA node's
physical cores may pay (not measured here), set `VLLM_CPU_OMP_THREADS_BIND` yourself (`auto`, or
a list of cores): the environment wins. It is a CPU-backend variable (vLLM's `envs.py`).

Environment: `FLYWHEEL_VLLM_PYTHON` names another interpreter with vLLM; `FLYWHEEL_VLLM_ARGS`
adds server flags (shell words, after ours, so they win: e.g. `--max-model-len 4096` or
`--dtype bfloat16`); `VLLM_CPU_KVCACHE_SPACE` (GiB of KV cache on a CPU, 2 unless set) and any
other `VLLM_*` variable pass through. Its log is `run_dir/vllm/server.log`.

LoRA adapters (`adapters.kind: lora`): the server also gets `--enable-lora --max-loras N
--max-lora-rank R` (`lora_flags`: N = `serve.max_loras`, at least 1, vLLM's adapters in one batch;
R the smallest rank vLLM allows (`vllm/config/lora.py`, `MaxLoRARanks`) that is at least
`adapters.rank`, its slots' rank) and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` (the
`/v1/load_lora_adapter` route the client loads each version with; without it vLLM does not
attach the route). vLLM's CPU build turns torch.compile off when LoRA is on (its
`CpuPlatform.check_and_update_config`); it runs eager here anyway.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from flywheel.bus.embedded import _die_with_parent
from flywheel.config import ConfigError, FlywheelConfig
from flywheel.models import resolve_model
from flywheel.ports import free_port
from flywheel.serve.backends.vllm import VLLMEngineClient

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[3]
EXTENSION_DIR = Path(__file__).resolve().parent / "vllm_ext"
"""`flywheel_worker.py`, Flywheel's worker extension (weight reloads right for tied weights)."""
VENV_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
START_TIMEOUT_S = 600.0
FLAGS = ["--dtype", "float32", "--enforce-eager", "--distributed-executor-backend", "uni", "--enable-scale-out",
         "--logprobs-mode", "processed_logprobs", "--return-tokens-as-token-ids", "--generation-config", "vllm",
         "--structured-outputs-config.backend", "guidance", "--disable-uvicorn-access-log", "--no-enable-chunked-prefill",
         "--worker-extension-cls", "flywheel_worker.FlywheelWorker"]
ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
       "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false"}
"""Set unless the environment sets them."""
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `--max-lora-rank` values vLLM accepts (`vllm.config.lora.MaxLoRARanks`)."""
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def lora_flags(max_loras: int, rank: int) -> list[str]:
    """vLLM's flags to serve up to `max_loras` adapters in one batch, of rank `rank` at most."""
    allowed = [r for r in LORA_RANKS if r >= rank]
    if not allowed:
        raise ConfigError(f"adapters.rank={rank}: vLLM serves LoRA ranks up to {LORA_RANKS[-1]}")
    return ["--enable-lora", "--max-loras", str(max(1, max_loras)), "--max-lora-rank", str(allowed[0])]


def vllm_python() -> str:
    """The interpreter that has vLLM: `FLYWHEEL_VLLM_PYTHON`, else `.venv-vllm`'s."""
    python = os.environ.get("FLYWHEEL_VLLM_PYTHON") or str(VENV_PYTHON)
    if not Path(python).exists():
        raise ConfigError(f"serve.engine_kind=vllm: no vLLM interpreter at {python} (run `make vllm-venv`)")
    return python


class VLLMServer:
    """One vLLM server process for `model` (a spec or directory), started by `start`, ended by
    `stop` (or with this process); with `lora` (max_loras, rank) it serves LoRA adapters too."""

    def __init__(self, model: str, served_name: str, log_dir: Path, max_num_seqs: int = 32, extra_args: list[str] = (),
                 lora: tuple[int, int] | None = None):
        self.model_dir = resolve_model(model)
        self.served_name = served_name
        self.log_path = Path(log_dir) / "server.log"
        self.max_num_seqs = max_num_seqs
        self.lora_args = lora_flags(*lora) if lora else []
        self.extra_args = [*shlex.split(os.environ.get("FLYWHEEL_VLLM_ARGS", "")), *extra_args]
        self.url: str | None = None
        self._proc: subprocess.Popen | None = None
        self._log_start = 0

    def command(self, port: int) -> list[str]:
        positions = json.loads((self.model_dir / "config.json").read_text()).get("max_position_embeddings", 8192)
        return [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                "--served-model-name", self.served_name, "--host", "127.0.0.1", "--port", str(port),
                "--max-num-seqs", str(self.max_num_seqs), "--max-num-batched-tokens", str(positions), *FLAGS, *self.lora_args, *self.extra_args]

    def start(self, timeout_s: float = START_TIMEOUT_S) -> str:
        """Start the server and return its URL once it answers `/health`; the log's tail is in
        the error if it exits first or does not answer within `timeout_s`."""
        for attempt in range(3):  # another process may take the free port before vLLM binds it
            try:
                return self._start(free_port(), timeout_s)
            except _PortTaken:
                log.warning("vLLM's port was taken before it bound it (attempt %d)", attempt + 1)
        raise RuntimeError("vLLM could not bind a free port in 3 attempts")

    def _start(self, port: int, timeout_s: float) -> str:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        env = {**ENV, **(LORA_ENV if self.lora_args else {}), **os.environ}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(EXTENSION_DIR), os.environ.get("PYTHONPATH")]))
        with open(self.log_path, "ab") as out:
            self._proc = subprocess.Popen(
                self.command(port), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None, start_new_session=True,
            )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        with httpx.Client(base_url=url, timeout=5) as http:
            while True:
                if (code := self._proc.poll()) is not None:
                    tail, self._proc = self.tail(), None
                    if "address already in use" in tail.lower():
                        raise _PortTaken
                    raise RuntimeError(f"vLLM exited with status {code} before serving; {self.log_path}:\n{tail}")
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"vLLM did not answer within {timeout_s:.0f}s; {self.log_path}:\n{self.tail()}")
                time.sleep(0.25)
        self.url = url
        log.info("vLLM serving %s at %s (pid %d)", self.model_dir, url, self._proc.pid)
        return url

    def tail(self, n_bytes: int = 4000) -> str:
        """The end of what this start wrote to the log."""
        try:
            written = self.log_path.read_bytes()[self._log_start:]
            return written[-n_bytes:].decode(errors="replace")
        except OSError:
            return ""

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the server's process group (its engine core with it), SIGKILL what is left
        after `timeout_s`."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)  # the group this server leads: only its own processes
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait_s)
                _wait_group_gone(proc.pid, wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        self.url = None


class _PortTaken(Exception):
    pass


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    """Wait until no process of group `pgid` is left (vLLM's engine core ends after its server)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise subprocess.TimeoutExpired(f"process group {pgid}", timeout_s)


def uses_vllm(config: FlywheelConfig) -> bool:
    """Whether this serve loop's engines are vLLM: `serve.engine_kind: vllm` for the policy's
    server, or for any server given vLLM `engine_urls`. A judge's or eval server that `deploy`
    starts beside the policy's (no `engine_urls`) keeps the embedded engine: it scores prompts
    (prefill-only requests), which vLLM's token-in/token-out route does not do."""
    serve = config.serve
    return serve.engine_kind == "vllm" and (bool(serve.engine_urls) or serve.role == "policy")


async def vllm_engines(config: FlywheelConfig) -> tuple[list[VLLMEngineClient], int, VLLMServer | None]:
    """The serve loop's vLLM engines: clients of `serve.engine_urls`, or of a server started here
    (returned, for the loop to stop); and the context length they all take."""
    serve = config.serve
    server = None
    urls = serve.engine_urls
    if not urls:
        lora = (serve.max_loras, config.adapters.rank) if config.adapters.kind == "lora" else None
        server = VLLMServer(config.model, config.served_model, Path(config.run_dir) / "vllm", serve.max_batch_size, lora=lora)
        urls = [await asyncio.to_thread(server.start)]
    engines: list[VLLMEngineClient] = []
    try:
        for url in urls:
            engines.append(await VLLMEngineClient(url, admin_key=serve.admin_key).connect())
    except BaseException:
        for engine in engines:
            await engine.close()
        if server is not None:
            await asyncio.to_thread(server.stop)
        raise
    return engines, min(engine.context_length for engine in engines), server
