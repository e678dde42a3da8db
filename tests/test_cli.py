"""Each loop as a process of its own: `python -m serve ...` serves and stops on SIGTERM; a bad
config is refused at start with the key named."""

import signal
import subprocess
import sys
import time

import openai
import pytest


def test_python_m_serve_serves_the_openai_api_and_stops_on_sigterm(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "serve", "--model", "tiny", "--port", "0", f"run_dir={tmp_path}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        url_file = tmp_path / "serve.url"
        deadline = time.monotonic() + 120
        while not url_file.exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "serve did not start"
            time.sleep(0.1)
        client = openai.OpenAI(base_url=url_file.read_text().strip() + "/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert reply.usage.completion_tokens <= 3 and reply.system_fingerprint == "flywheel-v0"
        assert (tmp_path / "bus.url").read_text().startswith("nats://127.0.0.1:")  # its own embedded bus
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("module", ["serve", "collect", "judge", "train"])
def test_bad_config_is_refused_naming_the_keys(module, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", module, f"run_dir={tmp_path}", "actor.use_decoupled_loss=true", "actor.recompute_logprobs=false"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "actor.use_decoupled_loss" in proc.stderr and "actor.recompute_logprobs" in proc.stderr


def test_deploy_up_refuses_a_bad_config():
    proc = subprocess.run([sys.executable, "-m", "deploy.up", "train.batch_size=0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "train.batch_size" in proc.stderr


def test_gateway_process_over_an_engine_process(tmp_path):
    """`python -m serve.engine` and `python -m serve --engine-url`: two processes, one protocol."""
    engine = subprocess.Popen([sys.executable, "-m", "serve.engine", "--model", "tiny", "--port", "0"],
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
            [sys.executable, "-m", "serve", "--model", "tiny", "--port", "0", "--engine-url", engine_url, f"run_dir={tmp_path}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        url_file = tmp_path / "serve.url"
        deadline = time.monotonic() + 120
        while not url_file.exists():
            assert gateway.poll() is None and time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.1)
        client = openai.OpenAI(base_url=url_file.read_text().strip() + "/v1", api_key="x", max_retries=0)
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
