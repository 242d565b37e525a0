"""The README's run command: `acp-state dev` answers /health and serves a session."""

from __future__ import annotations

import asyncio
import signal
import urllib.parse

import httpx

from tests.conftest import free_port
from tests.harness import ROOT


async def test_dev_command_serves_a_session(workspace: str) -> None:
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        "acp-state", "dev", "--port", str(port), "--workspace", workspace,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, cwd=str(ROOT),
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
        assert await asyncio.wait_for(process.wait(), 20) == 0
