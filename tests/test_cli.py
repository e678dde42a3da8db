"""The `flywheel` command: every subcommand answers `--help`; a bad configuration is refused at
start naming its key, by every subcommand that takes one; `flywheel serve` serves and stops on
SIGTERM; a gateway process serves over an engine process; `flywheel config` prints what a
command would run with, and its reference is docs/configuration.md."""

import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import yaml

from flywheel.cli import command
from flywheel.cli.arguments import split_overrides
from flywheel.cli.main import COMMANDS

from waiting import until_sync

ROOT = Path(__file__).resolve().parent.parent


def flywheel(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(command(*args), capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)


def test_the_help_lists_every_subcommand():
    listed = flywheel("--help")
    assert listed.returncode == 0
    assert all(f"    {name} " in listed.stdout or f"    {name}\n" in listed.stdout for name in COMMANDS)


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_subcommand_answers_help(name):
    helped = flywheel(name, "--help")
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith(f"usage: flywheel {name}")


@pytest.mark.parametrize("words", [["serve"], ["loop", "collect"], ["loop", "judge"], ["loop", "train"], ["up"],
                                   ["train"], ["engine"], ["config"]])
def test_a_bad_config_is_refused_naming_the_keys(words, tmp_path):
    """... at once: before torch or Ray load (`flywheel engine` took 6 s of CPU to refuse one)."""
    refused = subprocess.run([sys.executable, "-c", REFUSED, *words, f"run_dir={tmp_path}", "actor.use_decoupled_loss=true",
                              "actor.recompute_logprobs=false"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert refused.returncode == 2
    assert "actor.use_decoupled_loss" in refused.stderr and "actor.recompute_logprobs" in refused.stderr
    assert refused.stdout == "loaded: []\n"


REFUSED = """import sys
from flywheel.cli.main import main
code = main(sys.argv[1:])
print("loaded:", sorted(name for name in sys.modules if name in ("torch", "ray", "transformers")))
sys.exit(code)"""
"""`flywheel ARGS...` (the console script's main), saying which heavy libraries it loaded."""


def test_a_subcommand_without_a_configuration_refuses_settings():
    refused = flywheel("sft", "--data", "x", "--model", "tiny", "--out", "y", "train.batch_size=3")
    assert refused.returncode == 2 and "sft takes no key=value settings" in refused.stderr


def test_settings_are_read_anywhere_before_a_double_dash():
    words, overrides = split_overrides(["versions", "show", "a.b=1", "3", "--config", "f.yaml", "--", "x=y"])
    assert words == ["versions", "show", "3", "--config", "f.yaml", "--", "x=y"]
    assert overrides == ["a.b=1"]


def test_config_prints_the_resolved_configuration(tmp_path):
    given = tmp_path / "given.yaml"
    given.write_text("train:\n  batch_size: 8\n")
    shown = flywheel("config", "--config", str(given), "serve.port=0", "model=smollm2-135m")
    assert shown.returncode == 0, shown.stderr
    resolved = yaml.safe_load(shown.stdout)
    assert (resolved["train"]["batch_size"], resolved["serve"]["port"], resolved["model"]) == (8, 0, "smollm2-135m")
    assert resolved["collect"]["idle_timeout_s"] == 600.0  # a default, filled in


def test_the_configuration_reference_is_the_page_in_docs():
    """docs/configuration.md is what `flywheel config --reference` prints: regenerate it with
    `flywheel config --reference > docs/configuration.md` after changing the schema."""
    printed = flywheel("config", "--reference")
    assert printed.returncode == 0
    assert "| `train.batch_size` | int | `32` |" in printed.stdout
    assert (ROOT / "docs" / "configuration.md").read_text() == printed.stdout


def serve_url(proc: subprocess.Popen, run_dir: Path) -> str:
    """The gateway's URL, once the process has written it (failing if the process ended)."""
    url_file = run_dir / "serve.url"

    def written() -> bool:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else "the process ended"
        return url_file.exists()

    until_sync(written)
    return url_file.read_text().strip()


def test_serve_serves_the_openai_api_and_stops_on_sigterm(tmp_path):
    proc = subprocess.Popen(command("serve", "--model", "tiny", "--port", "0", f"run_dir={tmp_path}"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = openai.OpenAI(base_url=serve_url(proc, tmp_path) + "/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert reply.usage.completion_tokens <= 3 and reply.system_fingerprint == "flywheel-v0"
        assert (tmp_path / "bus.url").read_text().startswith("nats://127.0.0.1:")  # its own embedded bus
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_gateway_process_over_an_engine_process(tmp_path):
    """`flywheel engine` and `flywheel serve --engine-url`: two processes, one protocol."""
    engine = subprocess.Popen(command("engine", "--model", "tiny", "--port", "0"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    gateway = None
    try:
        for line in engine.stdout:
            if line.startswith("engine serving"):
                engine_url = line.split()[-1]
                break
        else:
            raise AssertionError("the engine did not start")
        gateway = subprocess.Popen(
            command("serve", "--model", "tiny", "--port", "0", "--engine-url", engine_url, f"run_dir={tmp_path}"),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = openai.OpenAI(base_url=serve_url(gateway, tmp_path) + "/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        streamed = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=4, stream=True))
        assert reply.usage.completion_tokens <= 4 and reply.system_fingerprint == "flywheel-v0"
        assert streamed[-1].choices[0].finish_reason in ("stop", "length")
    finally:
        for proc in (gateway, engine):
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
