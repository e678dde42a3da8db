"""`python -m serve --model tiny --port 8000`: the serve loop as a process of its own."""

from bus.process import loop_main

FLAGS = {
    "--model": ("model", str),
    "--host": ("serve.host", str),
    "--port": ("serve.port", int),
    "--engine-url": ("serve.engine_urls", list),
}

if __name__ == "__main__":
    raise SystemExit(loop_main("serve.loop:ServeLoop", "python -m serve", "OpenAI-compatible gateway over the embedded engine", flags=FLAGS))
