"""`flywheel engine --model tiny --port 30000`: the embedded engine as a standalone server
speaking SGLang's native protocol, with flags named like `sglang.launch_server`'s.

The engine's settings are the `serve.*` keys the gateway's embedded engine reads (`--config FILE`
and `key=value` as everywhere); the flags below that name a key are shortcuts for it. A gateway
reaches such engines with `flywheel serve --engine-url http://HOST:PORT`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from flywheel.cli.arguments import ConfigArgumentError, add_config, load

SHORTCUTS = {
    "--model": ("model", str),
    "--served-model-name": ("serve.served_model_name", str),
    "--max-running-requests": ("serve.max_batch_size", int),
    "--admin-api-key": ("serve.admin_key", str),
    "--torch-threads": ("serve.torch_threads", int),
    "--device": ("serve.device", str),
    "--dtype": ("serve.dtype", str),
    "--own-decoder": ("serve.own_decoder", bool),
    "--cuda-graphs": ("serve.cuda_graphs", bool),
    "--chunked-prefill-size": ("serve.chunked_prefill_size", int),
    "--schedule-policy": ("serve.schedule_policy", str),
    "--max-stall-s": ("serve.max_stall_s", float),
}


def configure(parser: argparse.ArgumentParser, command: str) -> None:
    parser.description = " ".join(__doc__.split("\n\n")[:2]).replace("\n", " ").split(": ", 1)[1]
    add_config(parser)
    parser.add_argument("--model", "--model-path", dest="model", help="tiny, smollm2-135m or a model directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="0 picks a free port (printed at start)")
    parser.add_argument("--served-model-name", dest="serve.served_model_name")
    parser.add_argument("--max-running-requests", "--max-batch-size", dest="serve.max_batch_size", type=int)
    parser.add_argument("--context-length", type=int)
    parser.add_argument("--weight-version", default="0",
                        help='the starting weight version label, any string (SGLang\'s default is "default")')
    parser.add_argument("--admin-api-key", dest="serve.admin_key", help="required (Bearer) on control routes")
    parser.add_argument("--incremental-streaming-output", action="store_true", help="stream deltas, not cumulative chunks")
    parser.add_argument("--no-version-spans", dest="version_spans", action="store_false",
                        help="report only the current weight version label per response or chunk, no per-token "
                             "spans (like a server that does not track them)")
    parser.add_argument("--torch-threads", dest="serve.torch_threads", type=int, help="default: every core this process may use")
    parser.add_argument("--device", dest="serve.device", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", dest="serve.dtype", choices=["float32", "bfloat16"], help="weights and KV cache")
    parser.add_argument("--own-decoder", dest="serve.own_decoder", action=argparse.BooleanOptionalAction,
                        help="decode steps through the engine's own forward")
    parser.add_argument("--cuda-graphs", dest="serve.cuda_graphs", action=argparse.BooleanOptionalAction,
                        help="on CUDA, the own forward's decode steps captured as CUDA graphs and replayed")
    parser.add_argument("--chunked-prefill-size", dest="serve.chunked_prefill_size", type=int,
                        help="most prompt tokens prefilled between two decode steps")
    parser.add_argument("--schedule-policy", dest="serve.schedule_policy", choices=["shortest-first", "fcfs"],
                        help="the order waiting requests are admitted in")
    parser.add_argument("--max-stall-s", dest="serve.max_stall_s", type=float,
                        help="while prompts wait, how old running streams' last tokens get before a decode step")
    parser.set_defaults(run=run, shortcuts=SHORTCUTS)


def run(args: argparse.Namespace) -> int:
    config = load(args)  # a bad configuration is refused before torch and the engine load (seconds)

    import torch
    import uvicorn

    from flywheel.models import load_model, load_weights, place
    from flywheel.serve.engine.core import Engine
    from flywheel.serve.engine.cpu_threads import torch_threads
    from flywheel.serve.engine.server import create_engine_app

    serve = config.serve
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(torch_threads(serve.torch_threads))
    model, tokenizer = load_model(config.model, getattr(torch, serve.dtype))
    try:
        model = place(model, serve.device)
    except ValueError as exc:
        raise ConfigArgumentError(f"serve.device: {exc}") from None
    engine = Engine(model, tokenizer, version=args.weight_version, max_batch_size=serve.max_batch_size,
                    context_length=args.context_length, load_weights=load_weights,
                    chunked_prefill_size=serve.chunked_prefill_size, schedule_policy=serve.schedule_policy,
                    max_stall_s=serve.max_stall_s, own_decoder=serve.own_decoder,
                    cuda_graphs=serve.cuda_graphs).start()
    app = create_engine_app(engine, config.model, config.served_model, serve.admin_key,
                            args.incremental_streaming_output, args.version_spans)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"))

    async def serve_until_stopped() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if server.started:
            port = server.servers[0].sockets[0].getsockname()[1]
            print(f"engine serving {config.model} at http://{args.host}:{port}", flush=True)
        await task

    try:
        asyncio.run(serve_until_stopped())
    finally:
        engine.stop()
    return 0
