"""Baseline servers on the same stack as the API (Starlette on the ASGI server `acp-state api
--server` picks, served by the very code that serves the API: `acp_state.cli.serving.serve_http`,
on uvloop): `hello` answers a JSON constant; `hgetall` does one Redis HGETALL per request.

    python -m bench.hello_app --port 8001 [--server granian|uvicorn] [--redis-url URL --key K]

`hello()` is the bare hello as an app factory, for servers run from their own command line
(e.g. `granian --interface asgi --factory bench.hello_app:hello`; bench/servers.py).
"""

from __future__ import annotations

import argparse
import asyncio

import orjson
import redis.asyncio as aioredis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from acp_state.cli.serving import DEFAULT_SERVER, SERVERS, serve_http, started, until_signal


def build(redis_url: str | None, key: str) -> Starlette:
    client = aioredis.Redis.from_url(redis_url, decode_responses=True) if redis_url else None

    async def hello(_: Request) -> Response:
        return Response(orjson.dumps({"hello": "world"}), media_type="application/json")

    async def hgetall(_: Request) -> Response:
        assert client is not None
        return Response(orjson.dumps(await client.hgetall(key)), media_type="application/json")

    return Starlette(routes=[Route("/", hgetall if client else hello)])


def hello() -> Starlette:
    return build(None, "")


async def serve(app: Starlette, port: int, server_name: str) -> None:
    server = serve_http(app, "127.0.0.1", port, server_name)

    async def run() -> None:
        serving = asyncio.ensure_future(server.serve())
        await started(server, serving)
        print(f"listening on http://127.0.0.1:{server.port} ({server_name})", flush=True)
        await serving

    await until_signal(run, server.stop)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--server", choices=SERVERS, default=DEFAULT_SERVER)
    parser.add_argument("--redis-url")
    parser.add_argument("--key", default="bench:hash")
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()  # as `acp-state` does
    except ImportError:
        pass
    asyncio.run(serve(build(args.redis_url, args.key), args.port, args.server))


if __name__ == "__main__":
    main()
