"""The rooms keep their rules (docs/architecture.md): `scripts/import_graph.py` finds no cycle,
no forbidden cross-room import, no private name used across modules, no generic package, no
module over its size limit."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "import_graph.py"


def load_checker():
    spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_the_repository_keeps_the_import_rules() -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), "--rooms-only"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (
        "no cycles, no forbidden imports, no private names across modules, nothing of Redis outside the store, "
        "no module over 700 lines"
    ) in run.stdout


def test_the_check_catches_each_kind_of_break(tmp_path: Path) -> None:
    """A small checkout that breaks every rule once: the check names each break."""
    files = {
        "pyproject.toml": '[tool.setuptools.package-dir]\n"acp_state.api" = "api"\n',
        "acp_state/__init__.py": "",
        "acp_state/keys.py": "from acp_state.api import app\n",  # core -> api
        "acp_state/one.py": "from . import two\n",
        "acp_state/two.py": "from . import one\n",  # a cycle
        "acp_state/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import annotated\n",
        "acp_state/annotated.py": "from . import typed\n",  # a cycle, if only for annotations
        "acp_state/ids.py": "def new(): ...\n",
        "acp_state/store/__init__.py": "from ..ids import new\n",  # store -> core: the store sits below
        "acp_state/sweeper.py": "from .store import new\n",  # core -> store: never
        "api/__init__.py": "",
        "api/app.py": "from worker import loop\nfrom .routes import _state\n",  # api -> worker; private
        "api/routes.py": "def _state(): ...\n",
        "api/reads.py": "from . import routes\nroutes._state()\n",  # a private name read off a module
        "worker/__init__.py": "",  # not mapped: a generic top-level `worker`
        "worker/loop.py": "import tests.helpers\n",  # production -> tests
        "tests/__init__.py": "",
        "tests/helpers.py": "",
        "tests/test_a.py": "def make(): ...\ndef test_a(): ...\n",
        "tests/test_b.py": "from tests.test_a import make, test_a\n",  # a helper from a test module
        "bench/__init__.py": "",
        "bench/run.py": "from tests import helpers\n",  # bench -> tests
        "bench/long.py": "x = 1\n" * 701,  # over the size limit
        "bench/chaos/checker.py": "x = 1\n" * 701,  # named as long: fine
        "bench/limit.py": "x = 1\n" * 700,  # at the limit: fine
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)

    problems = "\n".join(load_checker().build(tmp_path).problems)

    assert "forbidden import: core -> api: acp_state.keys imports acp_state.api.app" in problems
    assert "forbidden import: core -> store: acp_state.sweeper imports acp_state.store" in problems
    assert "store -> core" not in problems
    assert "forbidden import: api -> worker: acp_state.api.app imports worker.loop" in problems
    assert "forbidden import: worker -> tests: worker.loop imports tests.helpers" in problems
    assert "import cycle: acp_state.one <-> acp_state.two" in problems
    assert "import cycle: acp_state.annotated <-> acp_state.typed" in problems  # annotations count
    assert "private name: acp_state.api.app imports _state from acp_state.api.routes" in problems
    assert "private name: acp_state.api.reads reads acp_state.api.routes._state" in problems
    assert "packaging: installs a top-level package named 'worker'" in problems
    assert "tests.test_b imports make from tests.test_a" in problems
    assert "forbidden import: bench -> tests: bench.run imports tests.helpers" in problems
    assert "test_a from" not in problems  # re-collecting a test function is fine
    assert "size: bench/long.py has 701 lines (over 700: split it by job)" in problems
    assert "checker" not in problems and "limit.py" not in problems
    assert len(problems.splitlines()) == 12, problems


def test_the_check_keeps_the_wings_of_the_api(tmp_path: Path) -> None:
    """api/ by job: a route never imports another; the SSE engine imports no route and
    nothing that reaches the app state, not even through another module; what a process
    keeps imports no route and no stream; only the app imports routes."""
    files = {
        "pyproject.toml": '[tool.setuptools.package-dir]\n"acp_state.api" = "api"\n',
        "acp_state/__init__.py": "",
        "api/__init__.py": "",
        "api/app.py": "from .routes import sessions, status\n",  # the app serves the routes: fine
        "api/hot_reads.py": "from .routes.status import status\n",  # the app's own shortcut: fine
        "api/state.py": "from .streams import hub\n",  # AppState holds the hubs: fine
        "api/locator.py": "from .reads import cache\n",  # plumbing reads the cache: fine
        "api/outcomes.py": "from .routes import sessions\n",  # plumbing -> a route
        "api/routes/__init__.py": "",
        "api/routes/sessions.py": "from ..limits import MAX\nfrom ..state import AppState\n",  # fine
        "api/routes/status.py": "from . import sessions\n",  # a route -> another route
        "api/limits.py": "MAX = 1\n",
        "api/streams/__init__.py": "",
        "api/streams/hub.py": "from .frames import frame\n",  # within the wing: fine
        "api/streams/frames.py": "from ..limits import MAX\ndef frame(): ...\n",  # fine
        "api/streams/body.py": "from ..state import AppState\n",  # a stream -> AppState
        "api/streams/feed.py": "from ..reads.listings import page\n",  # reaches AppState through reads
        "api/streams/opened.py": "from ..routes.sessions import open\n",  # a stream -> a route
        "api/reads/__init__.py": "",
        "api/reads/cache.py": "",
        "api/reads/listings.py": "from ..state import AppState\nfrom .cache import x\n",  # fine for reads
        "api/reads/pages.py": "from ..streams import hub\nfrom ..routes import status\n",  # reads -> stream, route
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)

    problems = sorted(p.rsplit(" (", 1)[0] for p in load_checker().build(tmp_path).problems)

    assert problems == [
        "api wings: a route imports another route: acp_state.api.routes.status imports acp_state.api.routes.sessions",
        "api wings: only the app imports routes: acp_state.api.outcomes imports acp_state.api.routes.sessions",
        "api wings: reads import no route: acp_state.api.reads.pages imports acp_state.api.routes.status",
        "api wings: reads import no stream module: acp_state.api.reads.pages imports acp_state.api.streams.hub",
        "api wings: streams hold no AppState: acp_state.api.streams.body imports acp_state.api.state",
        "api wings: streams hold no AppState: acp_state.api.streams.feed imports acp_state.api.reads.listings, which "
        "reaches acp_state.api.state",
        "api wings: streams import no route: acp_state.api.streams.opened imports acp_state.api.routes.sessions",
    ], problems


def test_the_check_keeps_redis_inside_the_store_package(tmp_path: Path) -> None:
    """Outside `acp_state/store/`, production code that imports one of its modules or the
    Redis client, or spells a key or hash field name, is named; tests may reach in."""
    files = {
        "pyproject.toml": '[tool.setuptools.package-dir]\n"acp_state.api" = "api"\n',
        "acp_state/__init__.py": "",
        "acp_state/store/__init__.py": "from .types import View\n",
        "acp_state/store/types.py": "class View: ...\n",
        "acp_state/store/keys.py": 'class F:\n    OWNER = "inc"\n    CLIENT = "c:"\ndef session(): return "acp:{ws}:s:"\n',
        "acp_state/store/redis.py": "import redis\nfrom .keys import F\n",
        "api/summaries.py": "from acp_state.store import View\n",  # the surface: fine
        "api/__init__.py": "",
        "api/locator.py": "from acp_state.store import keys\n",  # reaches in
        "api/app.py": "from redis import exceptions\n",  # the client
        "api/sessions.py": 'def owner(fields): return fields.get("inc")\n',  # a field name
        "api/clients.py": 'def client(cid): return "c:" + cid\n',  # a field prefix
        "api/names.py": 'LIVE = "acp:{ws}:live"\n',  # a key name
        "api/plain.py": 'def kind(body): return body.get("kind"), {"inc": 1}\n',  # other strings: fine
        "tests/__init__.py": "",
        "tests/test_x.py": "from acp_state.store.keys import F\nimport redis\n",  # tests may
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)

    problems = sorted(load_checker().build(tmp_path).problems)

    assert problems == [
        "store boundary: acp_state.api.app imports the Redis client redis (app.py:1)",
        "store boundary: acp_state.api.clients spells the hash field 'c:' (clients.py:1)",
        "store boundary: acp_state.api.locator imports acp_state.store.keys; only acp_state.store itself is its surface (locator.py:1)",
        "store boundary: acp_state.api.names spells a key name 'acp:{ws}:live' (names.py:1)",
        "store boundary: acp_state.api.sessions spells the hash field 'inc' (sessions.py:1)",
    ], problems
