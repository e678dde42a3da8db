"""`python -m serve.engine --model tiny --port 30000`: the embedded engine as a standalone server
speaking SGLang's native protocol, with flags named like `sglang.launch_server`'s."""

from __future__ import annotations

import argparse
import asyncio
import logging

import torch
import uvicorn

from models import load_model, load_weights, place
from serve.engine.core import Engine
from serve.engine.server import create_engine_app
from serve.engine.threads import torch_threads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve.engine", description=__doc__.splitlines()[0])
    parser.add_argument("--model", "--model-path", dest="model", default="tiny", help="tiny, smollm2-135m or a model directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="0 picks a free port (printed at start)")
    parser.add_argument("--served-model-name")
    parser.add_argument("--max-running-requests", "--max-batch-size", dest="max_batch_size", type=int, default=32)
    parser.add_argument("--context-length", type=int)
    parser.add_argument("--weight-version", default="0",
                        help='the starting weight version label, any string (SGLang\'s default is "default")')
    parser.add_argument("--admin-api-key", help="required (Bearer) on control routes")
    parser.add_argument("--incremental-streaming-output", action="store_true", help="stream deltas, not cumulative chunks")
    parser.add_argument("--no-version-spans", dest="version_spans", action="store_false",
                        help="report only the current weight version label per response or chunk, no per-token "
                             "spans (like a server that does not track them)")
    parser.add_argument("--torch-threads", type=int, help="default: every core this process may use")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and KV cache")
    parser.add_argument("--own-decoder", action=argparse.BooleanOptionalAction, default=True,
                        help="decode steps through the engine's own forward (serve.own_decoder)")
    parser.add_argument("--chunked-prefill-size", type=int, default=512, help="most prompt tokens prefilled between two decode steps")
    parser.add_argument("--schedule-policy", default="shortest-first", choices=["shortest-first", "fcfs"],
                        help="the order waiting requests are admitted in (serve.schedule_policy)")
    parser.add_argument("--max-stall-s", type=float, default=0.5,
                        help="while prompts wait, how old running streams' last tokens get before a decode step (serve.max_stall_s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(torch_threads(args.torch_threads))
    model, tokenizer = load_model(args.model, getattr(torch, args.dtype))
    try:
        model = place(model, args.device)
    except ValueError as exc:
        parser.error(f"--device: {exc}")
    engine = Engine(model, tokenizer, version=args.weight_version, max_batch_size=args.max_batch_size,
                    context_length=args.context_length, load_weights=load_weights,
                    chunked_prefill_size=args.chunked_prefill_size, schedule_policy=args.schedule_policy,
                    max_stall_s=args.max_stall_s, own_decoder=args.own_decoder).start()
    app = create_engine_app(engine, args.model, args.served_model_name or args.model, args.admin_api_key,
                            args.incremental_streaming_output, args.version_spans)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"))

    async def serve() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if server.started:
            port = server.servers[0].sockets[0].getsockname()[1]
            print(f"engine serving {args.model} at http://{args.host}:{port}", flush=True)
        await task

    try:
        asyncio.run(serve())
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
