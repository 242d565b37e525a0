"""The README's run command: `acp-state dev` answers /health and serves a session."""

from __future__ import annotations

import asyncio
import signal
import urllib.parse
from pathlib import Path

import httpx

from testbed.processes import ROOT, python_stacks
from tests.conftest import free_port


async def test_dev_command_serves_a_session(workspace: str, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "dev.log"  # what it said, for a failure to show
    process = await asyncio.create_subprocess_exec(
        "acp-state", "dev", "--port", str(port), "--workspace", workspace,
        stdout=asyncio.subprocess.PIPE, stderr=log.open("wb"), cwd=str(ROOT),
    )
    try:
        assert process.stdout is not None
        banner = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
        assert f"http://127.0.0.1:{port}/" in banner
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            assert (await client.get("/health")).json() == {"status": "ok"}
            created = (await client.post("/session", json={"cwd": workspace})).json()
            sid = created["sessionId"]
            accepted = (await client.post(f"/session/{sid}/prompt", json={"prompt": [{"type": "text", "text": "hi"}]})).json()
            # Await the turn's end on the event stream (replayed from the start), then read status.
            headers = {"Last-Event-ID": "0"}
            async with client.stream("GET", f"/session/{sid}/events", headers=headers, timeout=30) as stream:
                async for line in stream.aiter_lines():
                    if line.startswith("data: ") and '"type":"turn_complete"' in line:
                        assert accepted["promptId"] in line and '"stopReason":"end_turn"' in line
                        break
            summary = (await client.get(f"/session/{sid}/status")).json()
            assert summary["hasActivePrompt"] is False and summary["clientCount"] == 1
            listed = (await client.get(f"/workspace/{urllib.parse.quote(workspace, safe='')}/sessions")).json()
            assert [(s["sessionId"], s["displayName"]) for s in listed["sessions"]] == [(sid, "hi")]
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.wait_for(process.wait(), 60)  # a safety stop
        except asyncio.TimeoutError:
            stacks = await python_stacks(process.pid)
            process.kill()
            raise AssertionError(f"acp-state dev ignored SIGTERM; its threads:\n{stacks}\nits log:\n{log.read_text()[-3000:]}")
        assert code == 0, log.read_text()[-3000:]


async def test_sigterm_ends_dev_while_a_client_holds_half_a_request(workspace: str, tmp_path: Path) -> None:
    """A client that sent part of a request and then nothing (a stalled browser tab, a slow
    link) does not hold the process up: granian alone waits out its 30 s header read timeout
    for such a connection, which is how `acp-state dev` once overran a 20 s SIGTERM limit. The
    20 s below is that limit, a safety stop well under the 30 s of the fault."""
    port = free_port()
    log = tmp_path / "dev.log"
    process = await asyncio.create_subprocess_exec(
        "acp-state", "dev", "--port", str(port), "--workspace", workspace,
        stdout=asyncio.subprocess.PIPE, stderr=log.open("wb"), cwd=str(ROOT),
    )
    assert process.stdout is not None
    await asyncio.wait_for(process.stdout.readline(), 30)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # no blank line: the headers never end
    await writer.drain()
    try:
        process.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.wait_for(process.wait(), 20)
        except asyncio.TimeoutError:
            process.kill()
            raise AssertionError(f"acp-state dev waited on a half-sent request after SIGTERM; its log:\n{log.read_text()[-3000:]}")
        assert code == 0, log.read_text()[-3000:]
        assert await reader.read() == b""  # the connection went with the process, unanswered
    finally:
        writer.close()
