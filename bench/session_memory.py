"""`python -m bench.session_memory`: what an idle session costs Redis, part by part.

    python -m bench.session_memory [--sessions 10000] [--workspaces 1]

A redis-server of its own, one worker (scripted agent) and one API process; `--sessions`
idle sessions created through the API, spread over `--workspaces` workspaces. Then:

1. the whole: `INFO memory` `used_memory` before and after, per session, once the creates'
   answers (kept 75 s for their APIs, gone at rest) are deleted;
2. each key kind's encoding and `MEMORY USAGE` (one of each sampled);
3. part by part, by taking each away from every session in turn and reading `used_memory`
   again: each field of the session hash, each key of the catalog row's JSON, then the row,
   its order entry, its change-log entry, its live-set member, its worker-index member, its
   locator and the hash's key itself. The parts add up to the whole but for the main
   dictionaries' bucket arrays (8 B a bucket, for each key and its TTL), which Redis shrinks
   only later (`left after every part went`).

Sizes come in jemalloc's size classes (16 B steps up to 128 B, then 32, 64...), so a part
costs a whole step or nothing: taking 9 B from a 216 B listpack (the `ast` field's `{}`) frees
nothing, and a part's figure moves by a step between runs with the order things are freed in.
`--wait-answers` first reads memory 80 s on, as the scale run does: by then the answers'
TTLs ran out, but Redis frees an expired key only when it is touched or its expire cycle
samples it: 18% of them were still held at 10,000 sessions, 29% at 100,000.

10,000 sessions in one workspace is the shape of `python -m bench --scale` (100,000 in
10): each workspace's sets and hashes are past Redis's listpack thresholds (128 entries) at
either size, so their per-entry costs are the same; the main dictionary's bucket array
differs by a few bytes a key. Writes bench/results/session_memory.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import redis.asyncio as aioredis

from acp_state.ids import workspace_id
from acp_state.store import keys

from .__main__ import log
from .procs import RedisServer, api, worker
from .scale_load import Http

RESULTS = Path(__file__).resolve().parent / "results"
CONNECTIONS = 16
REPLY_KEPT_S = 80  # a create's answer is kept 75 s (the API's wait + 15 s)


async def create(port: int, cwds: list[str], total: int) -> list[str]:
    plan = [cwds[n % len(cwds)] for n in range(total)]
    sids: list[str] = []

    async def client() -> None:
        http = Http(port)
        try:
            while plan:
                cwd = plan.pop()
                status, body = await http.request("POST", "/session", {"cwd": cwd, "sessionScope": "thread"})
                if status != 200:
                    raise RuntimeError(f"create failed: {status} {body[:200]!r}")
                sids.append(json.loads(body)["sessionId"])
        finally:
            await http.close()

    await asyncio.gather(*(client() for _ in range(CONNECTIONS)))
    return sids


async def used(r: aioredis.Redis) -> int:
    return int((await r.info("memory"))["used_memory"])


async def scan(r: aioredis.Redis, pattern: str) -> list[str]:
    return [k async for k in r.scan_iter(match=pattern, count=1000)]


async def kinds(r: aioredis.Redis) -> dict[str, dict[str, Any]]:
    """Each key kind (the key with its ids replaced), its count, encoding and MEMORY USAGE."""
    found: dict[str, dict[str, Any]] = {}
    count: Counter[str] = Counter()
    async for key in r.scan_iter(count=1000):
        kind = key
        for part in key.replace("}", "{").split("{")[1::2]:
            kind = kind.replace(part, "<id>")
        if ":s:" in kind:
            kind = kind.split(":s:")[0] + ":s:<sid>"
        count[kind] += 1
        if kind not in found:
            found[kind] = {"type": await r.type(key), "encoding": await r.object("encoding", key),
                           "memory_usage": await r.memory_usage(key, samples=0)}
            if found[kind]["type"] in ("hash", "zset", "set"):
                found[kind]["entries"] = await {"hash": r.hlen, "zset": r.zcard, "set": r.scard}[found[kind]["type"]](key)
    for kind in found:
        found[kind]["keys"] = count[kind]
    return dict(sorted(found.items()))


async def parts(r: aioredis.Redis, by_ws: dict[str, list[str]], n: int) -> list[dict[str, Any]]:
    """Take each part away from every session, in turn; its cost is what used_memory fell by."""
    steps: list[dict[str, Any]] = []
    before = await used(r)

    async def step(name: str, raw: float | None = None) -> None:
        nonlocal before
        now = await used(r)
        steps.append({"part": name, "bytes_per_session": round((before - now) / n, 1),
                      **({"raw_bytes": round(raw, 1)} if raw is not None else {})})
        before = now

    hashes = [(ws, sid) for ws, sids in by_ws.items() for sid in sids]
    sample = await r.hgetall(keys.session(*hashes[0]))
    names = [name for name in sample if name != keys.F.OWNER]
    for name in names:  # each field of the session hash (a client's field, by its prefix)
        prefix = keys.F.CLIENT if name.startswith(keys.F.CLIENT) else None
        raw = 0
        for chunk in range(0, len(hashes), 1000):
            pipe = r.pipeline(transaction=False)
            for ws, sid in hashes[chunk:chunk + 1000]:
                pipe.hgetall(keys.session(ws, sid))
            fields = await pipe.execute()
            for (ws, sid), held in zip(hashes[chunk:chunk + 1000], fields):
                gone = [k for k in held if (k.startswith(prefix) if prefix else k == name)]
                raw += sum(len(k) + len(held[k]) for k in gone)
                if gone:
                    pipe.hdel(keys.session(ws, sid), *gone)
            await pipe.execute()
        await step(f"session hash field {prefix + '<clientId>' if prefix else name!r}", raw / n)

    all_rows = {}  # each key of the catalog row, the last first
    for ws, sids in by_ws.items():
        all_rows[ws] = {sid: orjson.loads(v) for sid, v in zip(sids, await r.hmget(keys.catalog(ws), sids)) if v}
    row_keys = list(next(iter(next(iter(all_rows.values())).values())))
    for key in reversed(row_keys[1:]):
        raw = 0
        for ws, rows in all_rows.items():
            for row in rows.values():
                if key in row:
                    raw += len(orjson.dumps({key: row.pop(key)})) - 1  # `"key":value,`
            if rows:
                await r.hset(keys.catalog(ws), mapping={sid: orjson.dumps(row) for sid, row in rows.items()})
        await step(f"catalog row key {key!r}", raw / n)

    async def each(name: str, call: Any) -> None:
        for ws, sids in by_ws.items():
            for chunk in range(0, len(sids), 1000):
                pipe = r.pipeline(transaction=False)
                for sid in sids[chunk:chunk + 1000]:
                    call(pipe, ws, sid)
                await pipe.execute()
        await step(name)

    await each("catalog row (its field, its entry and the rest of its JSON)", lambda p, ws, sid: p.hdel(keys.catalog(ws), sid))
    await each("catalog order entry", lambda p, ws, sid: p.zrem(keys.catalog_order(ws), sid))
    await each("change log entry", lambda p, ws, sid: p.zrem(keys.change_log(ws), sid))
    await each("live set member", lambda p, ws, sid: p.srem(keys.live(ws), sid))
    workers = await scan(r, "acp:w:*:sessions")
    await each("worker index member",
               lambda p, ws, sid: [p.srem(w, f"{ws}/{sid}") for w in workers])
    await each("locator", lambda p, ws, sid: p.delete(keys.locator(sid)))
    await each(f"session hash key (with its {keys.F.OWNER!r} field and TTL)", lambda p, ws, sid: p.delete(keys.session(ws, sid)))
    return steps


async def run(args: argparse.Namespace) -> dict[str, Any]:
    server = RedisServer()
    logs = Path(tempfile.mkdtemp(prefix="acp-session-memory-"))
    cwds = []
    for n in range(args.workspaces):
        (logs / f"ws{n}").mkdir()
        cwds.append(str(logs / f"ws{n}"))
    r = aioredis.Redis.from_url(server.url, decode_responses=True)
    processes = []
    try:
        processes.append(await worker(server.url, logs, "--max-sessions", str(args.sessions + 1000)))
        extra = [a for cwd in cwds[1:] for a in ("--workspace", cwd)]
        process, port = await api(server.url, cwds[0], logs, *extra)
        processes.append(process)
        await create(port, cwds, len(cwds))  # the agent children start; each workspace's keys exist
        for key in await scan(r, "acp:reply:*"):
            await r.delete(key)
        before = await used(r)
        log(f"creating {args.sessions} sessions in {len(cwds)} workspaces")
        sids = await create(port, cwds, args.sessions)
        n = len(sids)
        result: dict[str, Any] = {}
        if args.wait_answers:
            # What `python -m bench --scale` reads at rest: 80 s on, the answers' TTLs ran
            # out, but Redis frees an expired key only when it is touched or its sampling
            # (the active expire cycle) happens on it.
            log(f"  waiting {REPLY_KEPT_S} s for the creates' answers to expire")
            await asyncio.sleep(REPLY_KEPT_S)
            keyspace = (await r.info("keyspace")).get("db0", {})
            result["after_answers_expired"] = {
                "bytes_per_session": round((await used(r) - before) / n, 1),
                "keys_held": keyspace.get("keys"), "live_keys_of_sessions": 2 * n + 2 * len(cwds),
            }
        # A create's answer is kept 75 s for its API; at rest it is gone (a SCAN frees an
        # expired one it meets, as any touch does).
        for key in await scan(r, "acp:reply:*"):
            await r.delete(key)
        after = await used(r)
        # A worker whose lease lapsed on a loaded machine had its sessions swept (and their
        # `session_died` logs written): not an idle session's memory.
        if await r.zcard(keys.DEAD):
            raise RuntimeError("a worker was declared dead during the run: its figures would not be an idle session's")
        result.update({"sessions": n, "workspaces": len(cwds),
                                  "bytes_per_session": round((after - before) / n, 1),
                       "redis_version": (await r.info("server"))["redis_version"]})
        log(f"  {result['bytes_per_session']} B per idle session")
        result["keys"] = await kinds(r)
        # The worker would write again (its index, heartbeats): it stops first, its sessions
        # closed by nobody (SIGKILL), so what it wrote stays to be taken apart.
        for process in processes:
            process.proc.kill()
            await process.proc.wait()
        processes.clear()
        result["bytes_per_session_without_the_processes"] = round((await used(r) - before) / n, 1)
        located = dict(zip(sids, await r.mget([keys.locator(s) for s in sids])))
        by_ws: dict[str, list[str]] = {}
        for sid, ws in located.items():
            by_ws.setdefault(ws, []).append(sid)
        assert set(by_ws) == {workspace_id(c) for c in cwds}, "every session has its locator"
        result["parts"] = await parts(r, by_ws, n)
        result["parts_sum"] = round(sum(p["bytes_per_session"] for p in result["parts"]), 1)
        result["left_per_session"] = round((await used(r) - before) / n, 1)
        return result
    finally:
        for process in processes:
            await process.terminate()
        await r.aclose()
        server.stop()


def table(result: dict[str, Any]) -> str:
    lines = []
    if "after_answers_expired" in result:
        lines.append(f"80 s on: {result['after_answers_expired']}")
    lines += [f"{result['bytes_per_session']} B per idle session ({result['sessions']} sessions, "
             f"{result['workspaces']} workspaces, redis {result['redis_version']}); the parts:"]
    for p in result["parts"]:
        raw = f"  ({p['raw_bytes']} B of data)" if "raw_bytes" in p else ""
        lines.append(f"  {p['bytes_per_session']:8.1f}  {p['part']}{raw}")
    lines.append(f"  {result['parts_sum']:8.1f}  sum")
    lines.append(f"  {result['bytes_per_session_without_the_processes']:8.1f}  the whole, once the API and worker left")
    lines.append(f"  {result['left_per_session']:8.1f}  left after every part went (buckets not yet shrunk)")
    lines.append("keys:")
    for kind, k in result["keys"].items():
        lines.append(f"  {k['keys']:7} x {kind} {k['type']} {k['encoding']} {k.get('entries', '')} ({k['memory_usage']} B)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=10_000)  # 100000 with --workspaces 10: the scale run's shape
    parser.add_argument("--workspaces", type=int, default=1)
    parser.add_argument("--wait-answers", action="store_true",
                        help="first read memory 80 s on, as the scale run does, before the expired answers are freed")
    parser.add_argument("--out", default=str(RESULTS / "session_memory.json"))
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    print(table(result))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
