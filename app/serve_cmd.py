"""`ragcache serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn on the async vLLM engine).

Thin flag parsing over :mod:`ragcache.server`; flags override the [serve] settings.
"""

from __future__ import annotations

import argparse
import sys

from app.help import HelpFormatter


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="OpenAI-compatible server: /v1/chat/completions (streaming), /v1/models, /metrics",
        description="Serve every index under ingest.index_dir as an OpenAI model (`model` = index name) on vLLM's "
        "async engine: concurrent requests are batched, chunk KV is reused. Clients: the openai SDK with "
        "base_url=http://HOST:PORT/v1, curl, any OpenAI-compatible tool. The engine starts first (~30 s on 2 "
        "CPU cores). A non-loopback --host needs serve.api_key (RAGCACHE_SERVE__API_KEY) or a keys file. If "
        "reuse/blend turns out unavailable for the model (see the start-up self-check) it refuses to start in "
        "blend mode, unless --blend-fallback names the mode to serve instead (GET /health says which).",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--host", default=None, help="address to bind (default: serve.host, 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="TCP port (default: serve.port, 8000)")
    p.add_argument("--index", default=None, metavar="NAME",
                   help="index answered when a request's model is 'ragcache' or 'default' (default: serve.index)")
    p.add_argument("--max-in-flight", type=int, default=None,
                   help="requests answered at once; more get HTTP 429 (default: serve.max_in_flight, 64)")
    p.add_argument("--keys-file", default=None, metavar="PATH",
                   help="TOML file of keys scoped to indexes (sha256 of each key, its tenant, the indexes it may "
                   "read; see docs/serving.md) (default: serve.keys_file, none)")
    p.add_argument("--blend-fallback", choices=("refuse", "full", "prefix"), default=None,
                   help="when reuse/blend turns out unavailable at start: refuse to start (exit 2), or serve in "
                   "full or prefix mode (default: serve.blend_fallback, refuse)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ragcache.config import Settings
    from ragcache.server import check_serve_settings, serve

    flags = {"host": args.host, "port": args.port, "index": args.index, "max_in_flight": args.max_in_flight,
             "keys_file": args.keys_file, "blend_fallback": args.blend_fallback}
    settings = Settings.load(args.settings, serve={k: v for k, v in flags.items() if v is not None})
    check_serve_settings(settings)  # before the engine starts
    s = settings.serve
    print(f"ragcache serve: starting the engine, then http://{s.host}:{s.port}/v1 (default index {s.index!r}); "
          "Ctrl-C stops", file=sys.stderr, flush=True)
    serve(settings, log_level="debug" if args.verbose else "info")
    return 0
