"""`adaspark serve`: the OpenAI-compatible HTTP server on one model and one arm.

The port opens at once; the model loads in the background (/health answers 503 until it is
ready). A model that fails to load stops the server with that error. Up to --parallel requests
decode at once (plain decoding batches their rows into one forward; the speculative arms run one
at a time), up to --queue more wait, and past that a request gets 429 (server/worker.py).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
from pathlib import Path

from adaspark.errors import UserError
from adaspark.memory import bound_native_heap, freeze_loaded_heap
from adaspark.options import ModelOptions, add_model_options
from adaspark.server.auth import ENV_VAR, ApiKey


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    add_model_options(parser)
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on every route but /health "
                             "and the dashboard's page (default: $ADASPARK_API_KEY, else none)")
    parser.add_argument("--public-metrics", action="store_true",
                        help="serve /metrics and the dashboard's data without the key")
    parser.add_argument("--parallel", type=int, default=None, metavar="N",
                        help="requests decoding at once, their rows batched into one forward "
                             "(default: two per core, at most 8, and no more KV slots than a "
                             "quarter of the free memory holds)")
    parser.add_argument("--queue", type=int, default=None, metavar="N",
                        help="requests waiting at most before new ones get 429 with Retry-After "
                             "(default: 8 per parallel slot)")


def api_key(args: argparse.Namespace, environ=os.environ) -> str | None:
    """--api-key, else ADASPARK_API_KEY, else None (no key); an empty or padded key is refused."""
    key = args.api_key if args.api_key is not None else environ.get(ENV_VAR)
    if key is not None:
        ApiKey(key)  # refuses a bad key before the port opens
    return key


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads so a busy port fails at once."""
    if not 0 < port < 65536:
        raise UserError(f"--port must be between 1 and 65535, not {port}")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    return sock


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def load_engine(model_path, options: ModelOptions):
    """The server's engine, loaded; then every Python object alive goes out of the garbage
    collector's reach, so that no full collection walks the model's objects again (one took
    161-232 ms, every stream waiting: docs/results/zen3-s21/)."""
    from adaspark.engine import Engine

    engine = Engine.load(model_path, options)
    freeze_loaded_heap()
    return engine


def run(args: argparse.Namespace) -> int:
    bound_native_heap()  # before torch's first matmul and the model's load (memory.py)
    import uvicorn

    from adaspark.engine import Engine
    from adaspark.model.sources import resolve_model
    from adaspark.server import create_app
    from adaspark.speculative import open_round_log

    # Bad options fail here, at once, rather than after the port has opened (--arm: argparse).
    key = api_key(args)
    for flag, value in (("--parallel", args.parallel), ("--queue", args.queue)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be at least 1, not {value}")
    options = ModelOptions.from_args(args)
    model_path = resolve_model(options.model)
    if options.round_log:  # the server's file: not each request's failure (a 400) later
        open_round_log(Path(options.round_log)).close()
    failure: list[BaseException] = []

    def load() -> Engine:
        try:
            return load_engine(model_path, options)
        except BaseException as err:
            failure.append(err)
            server.should_exit = True
            raise

    sock = listen(args.host, args.port)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    if key is None and not _loopback(args.host):
        logging.warning("listening on %s without an API key: anyone who reaches the port can "
                        "use it (--api-key)", args.host)
    app = create_app(load, model_id=model_path.stem, api_key=key,
                     public_metrics=args.public_metrics, parallel=args.parallel,
                     queue_limit=args.queue)
    shown = f"[{args.host}]" if ":" in args.host else args.host
    keyed = "" if key is None else (" (open: --public-metrics)" if args.public_metrics
                                     else " (both behind the API key)")
    logging.info("dashboard at http://%s:%d/dashboard, Prometheus metrics at /metrics%s", shown,
                 args.port, keyed)
    # On shutdown, a request still decoding is cancelled after a short grace (its stream's
    # cancellation stops the engine at the next token) instead of holding the exit to its end.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=3)
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if failure:
        raise UserError(f"the model failed to load: {failure[0]}")
    return 0
