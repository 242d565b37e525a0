"""Baseline servers on the same stack as the API (Starlette + uvicorn, uvloop, httptools):
`hello` answers a JSON constant; `hgetall` does one Redis HGETALL per request.

    python -m bench.hello_app --port 8001 [--redis-url URL --key K]
"""

from __future__ import annotations

import argparse

import orjson
import redis.asyncio as aioredis
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


def build(redis_url: str | None, key: str) -> Starlette:
    client = aioredis.Redis.from_url(redis_url, decode_responses=True) if redis_url else None

    async def hello(_: Request) -> Response:
        return Response(orjson.dumps({"hello": "world"}), media_type="application/json")

    async def hgetall(_: Request) -> Response:
        assert client is not None
        return Response(orjson.dumps(await client.hgetall(key)), media_type="application/json")

    return Starlette(routes=[Route("/", hgetall if client else hello)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--redis-url")
    parser.add_argument("--key", default="bench:hash")
    args = parser.parse_args()
    print("listening", flush=True)
    uvicorn.run(build(args.redis_url, args.key), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
