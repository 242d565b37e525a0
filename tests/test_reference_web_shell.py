"""The reference's own Web Shell served by acp-state (issue 39 item 1): `acp-state api
--web-shell <the web-shell/ folder of @qwen-code/qwen-code>` answers as `qwen serve` does
(packages/cli/src/serve/web-shell-static.ts): its index at `/` and for page loads of
`/session/:id`, its assets, service worker and manifest, with a CSP; without the option
acp-state's own page stays. Real API and worker processes, a real Redis, loopback HTTP.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.harness import Harness
from tests.helpers import create

ROOT = Path(__file__).resolve().parent.parent
WEB_SHELL = ROOT / "tests" / "node" / "node_modules" / "@qwen-code" / "qwen-code" / "web-shell"
TOKEN = "reference-shell-token-0123456789"
PAGE_LOAD = {"Accept": "text/html,application/xhtml+xml", "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"}

pytestmark = pytest.mark.skipif(not (WEB_SHELL / "index.html").is_file(),
                                reason="npm install --prefix tests/node (scripts/test) installs the reference")


def the_index_script() -> str:
    """The module the reference's index loads (its name is a content hash of the build)."""
    found = re.search(r'src="/assets/(index-[^"]+\.js)"', (WEB_SHELL / "index.html").read_text())
    assert found is not None
    return found[1]


async def test_the_reference_shell_is_served_as_qwen_serve_serves_it(harness: Harness, workspace: str) -> None:
    await harness.worker()
    api = await harness.api("--web-shell", str(WEB_SHELL), "--token", TOKEN)
    api.client.headers.pop("Authorization", None)  # a browser's first page load carries no token
    index = (WEB_SHELL / "index.html").read_bytes()

    # The index at `/` and for a page load of a session's URL (a deep link, a reload).
    for path in ("/", "/session/0b8e5a3e-1b2c-4d5e-8f90-123456789abc"):
        page = await api.client.get(path, headers=PAGE_LOAD)
        assert page.status_code == 200, (path, page.text[:200])
        assert page.content == index
        assert page.headers["content-type"].startswith("text/html")
        policy = page.headers["content-security-policy"]
        # Its inline scripts run by their hashes, nothing else inline or evaluated does.
        assert "'unsafe-inline'" not in policy.split("script-src", 1)[1].split(";")[0]
        assert "'unsafe-eval'" not in policy
        assert policy.count("'sha256-") == len(re.findall(rb"^\s*<script>\s*$", index, re.M)) == 5
        assert "connect-src 'self'" in policy and "frame-ancestors 'none'" in policy
        assert page.headers["x-content-type-options"] == "nosniff"
        assert page.headers["referrer-policy"] == "no-referrer"
        assert page.headers["cache-control"] == "no-cache"

    # Its assets: content-addressed ones cached for good, with their types.
    script = await api.client.get(f"/assets/{the_index_script()}")
    assert script.status_code == 200 and script.content == (WEB_SHELL / "assets" / the_index_script()).read_bytes()
    assert script.headers["content-type"].split(";")[0] in ("text/javascript", "application/javascript")
    assert script.headers["cache-control"] == "public, max-age=31536000, immutable"
    icon = await api.client.get("/assets/icon-192.png")
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/png"
    missing = await api.client.get("/assets/not-there.js")
    assert missing.status_code == 404

    # The service worker (allowed the whole origin) and the manifest.
    worker = await api.client.get("/sw.js")
    assert worker.status_code == 200 and worker.content == (WEB_SHELL / "sw.js").read_bytes()
    assert worker.headers["content-type"].startswith("application/javascript")
    assert worker.headers["service-worker-allowed"] == "/"
    manifest = await api.client.get("/manifest.webmanifest")
    assert manifest.status_code == 200 and manifest.json()["start_url"] == "/"
    assert manifest.headers["content-type"].startswith("application/manifest+json")

    # The API still wants its token; a script's GET of a session URL is no page load.
    assert (await api.client.get("/capabilities")).status_code == 401
    api.client.headers["Authorization"] = f"Bearer {TOKEN}"
    sid = (await create(api, workspace))["sessionId"]
    assert (await api.client.get(f"/session/{sid}")).status_code == 405
    assert (await api.client.get(f"/session/{sid}/status")).status_code == 200
    # acp-state's own page is not there meanwhile.
    assert (await api.client.get("/static/js/main.js")).status_code == 404


async def test_without_the_option_acp_states_own_page_stays(harness: Harness) -> None:
    await harness.worker()
    api = await harness.api()
    page = await api.client.get("/", headers=PAGE_LOAD)
    assert page.status_code == 200 and page.content == (ROOT / "api" / "static" / "index.html").read_bytes()
    assert (await api.client.get("/static/js/main.js")).status_code == 200
    assert (await api.client.get("/sw.js")).status_code == 404
    assert (await api.client.get(f"/assets/{the_index_script()}")).status_code == 404


async def test_a_folder_that_is_no_web_shell_build_is_refused_at_start(harness: Harness, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError) as refused:
        await harness.api("--web-shell", str(tmp_path))
    assert "not a Web Shell build" in str(refused.value)



async def test_listing_page_sizes_are_clamped_as_the_reference_clamps_them(harness: Harness, workspace: str) -> None:
    """The reference's Web Shell lists with `size=1000` (and 200): the reference clamps any
    integer to 1..100 and answers 200; acp-state answered 400 `invalid_size`."""
    await harness.worker()
    api = await harness.api()
    made = [(await create(api, workspace))["sessionId"] for _ in range(3)]
    listed = f"/workspace/{workspace.replace('/', '%2F')}/sessions"
    for size, count in (("1000", 3), ("200", 3), ("0", 1), ("-4", 1), (" 2 ", 2), ("+2", 2), ("9" * 400, 3)):
        page = await api.client.get(listed, params={"size": size, "archiveState": "active"})
        assert page.status_code == 200, (size, page.text)
        assert {row["sessionId"] for row in page.json()["sessions"]} <= set(made)
        assert len(page.json()["sessions"]) == count, size
    refused = await api.client.get(listed, params={"size": "many"})  # no integer: a clear 400 still
    assert refused.status_code == 400 and refused.json()["code"] == "invalid_size"


async def test_a_session_keeps_its_source_listed_and_filtered_on(harness: Harness, workspace: str) -> None:
    """`session_source_metadata`: every create of the reference's Web Shell sends `sourceType`,
    and needs the feature, else it throws before sending (New task did nothing)."""
    await harness.worker()
    api = await harness.api()
    assert "session_source_metadata" in (await api.client.get("/capabilities")).json()["features"]
    web = await create(api, workspace, sourceType="web_shell")
    assert web["sourceType"] == "web_shell" and web["sourcePersisted"] is True and "sourceId" not in web
    bot = await create(api, workspace, sourceType="channel", sourceId="chat-42")
    assert (bot["sourceType"], bot["sourceId"], bot["sourcePersisted"]) == ("channel", "chat-42", True)
    plain = await create(api, workspace)
    assert "sourceType" not in plain and "sourcePersisted" not in plain

    listed = f"/workspace/{workspace.replace('/', '%2F')}/sessions"

    async def listing(**query: str) -> dict[str, dict]:
        page = await api.client.get(listed, params=query)
        assert page.status_code == 200, page.text
        return {row["sessionId"]: row for row in page.json()["sessions"]}

    rows = await listing()
    assert rows[web["sessionId"]]["sourceType"] == "web_shell" and "sourceId" not in rows[web["sessionId"]]
    assert (rows[bot["sessionId"]]["sourceType"], rows[bot["sessionId"]]["sourceId"]) == ("channel", "chat-42")
    assert "sourceType" not in rows[plain["sessionId"]]
    assert set(await listing(sourceType="web_shell")) == {web["sessionId"]}
    assert set(await listing(sourceType="channel", sourceId="chat-42")) == {bot["sessionId"]}
    assert set(await listing(sourceType="channel", sourceId="other")) == set()
    assert set(await listing(sourceType="default")) == {plain["sessionId"]}  # also those created without one
    first = await api.client.get(listed, params={"sourceType": "default", "size": "1"})
    assert [row["sessionId"] for row in first.json()["sessions"]] == [plain["sessionId"]]

    # Bad sources: the reference's 400s.
    for body, code in (({"sourceType": "Web"}, "invalid_session_source"),
                       ({"sourceId": "x"}, "invalid_session_source"),
                       ({"sourceType": "web", "sourceId": "a\nb"}, "invalid_session_source"),
                       ({"sourceType": "standalone"}, "reserved_session_source")):
        refused = await api.client.post("/session", json={"cwd": workspace, "sessionScope": "thread", **body})
        assert refused.status_code == 400 and refused.json()["code"] == code, (body, refused.text)
    refused = await api.client.get(listed, params={"sourceId": "x"})
    assert refused.status_code == 400 and refused.json()["code"] == "invalid_session_source"

    # Kept with the session after it stops being live: closed, it is listed with its source.
    assert (await api.client.delete(f"/session/{bot['sessionId']}")).status_code == 204
    rows = await listing(sourceType="channel")
    assert rows[bot["sessionId"]]["sourceId"] == "chat-42" and rows[bot["sessionId"]]["clientCount"] == 0
    # ... and resumed by a load, it keeps it (the resume writes its row again).
    loaded = await api.client.post(f"/session/{bot['sessionId']}/load", json={})
    assert loaded.status_code == 200, loaded.text
    rows = await listing(sourceType="channel", sourceId="chat-42")
    assert rows[bot["sessionId"]]["clientCount"] >= 1 and rows[bot["sessionId"]]["sourceId"] == "chat-42"


async def test_brand_and_goals_answer_as_a_daemon_with_none_configured(harness: Harness) -> None:
    """The reference's Web Shell reads `/brand` at start and `/goals` from its sidebar (a 404
    there is a red toast); `qwen serve` with no brand and no goal answers these."""
    await harness.worker()
    api = await harness.api()
    brand = await api.client.get("/brand")
    assert brand.status_code == 200 and brand.json() == {}
    goals = await api.client.get("/goals")
    assert goals.status_code == 200 and goals.json() == {"v": 1, "goals": [], "droppedCount": 0}


async def test_the_batch_catalog_filters_by_source_as_the_listing(harness: Harness, workspace: str) -> None:
    """`POST /sessions/catalog` `options.sourceType`/`sourceId` (refused as unsupported before)."""
    await harness.worker()
    api = await harness.api()
    web = (await create(api, workspace, sourceType="web_shell", sourceId="tab-1"))["sessionId"]
    await create(api, workspace)

    async def catalog(options: dict) -> dict:
        answer = await api.client.post("/sessions/catalog", json={"workspaces": "all", "options": options})
        assert answer.status_code == 200, answer.text
        return answer.json()

    member = (await catalog({"sourceType": "web_shell", "sourceId": "tab-1"}))["workspaces"][0]
    assert [(row["sessionId"], row["sourceType"], row["sourceId"]) for row in member["sessions"]] == [
        (web, "web_shell", "tab-1")]
    assert (await catalog({"sourceType": "web_shell", "sourceId": "tab-2"}))["workspaces"][0]["sessions"] == []
    assert len((await catalog({}))["workspaces"][0]["sessions"]) == 2
    refused = await api.client.post("/sessions/catalog", json={"workspaces": "all", "options": {"sourceId": "x"}})
    assert refused.status_code == 400 and refused.json()["code"] == "invalid_session_catalog_request"
