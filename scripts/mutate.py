"""The mutation run: each listed bug, planted in a temporary copy of the tree, must make
the tests that guard against it fail.

    python scripts/mutate.py            # every mutation
    python scripts/mutate.py vote-open  # some, by name

Each mutation is a text replacement of the Lua or of the Python (its `old` text must occur
exactly once, so a mutation that no longer matches the code is reported, not skipped).
The unmutated copy runs the same tests first and must pass. Prints, per mutation, caught
or survived; exits non-zero if any survived (or a mutation or the baseline is broken).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    bug: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    # Where `old` is moved to instead of replaced: the text it goes before.
    before: str | None = None


LUA_TESTS = ("tests/test_lua.py", "tests/test_lua_commands.py")

MUTATIONS = [
    Mutation(
        "vote-open",
        "the VOTE script leaves the request open, so a second vote also wins",
        "acp_state/store/lua/vote.lua",
        "redis.call('HDEL', KEYS[1], {{F.INTERACTION}} .. vote.rid, {{F.VOTABLE}} .. vote.rid)\n",
        "",
        LUA_TESTS,
    ),
    Mutation(
        "announce-late",
        "APPLY announces on the change channel after publishing the events",
        "acp_state/store/lua/transition.lua",
        "  if not batch then changed(at[9], at[8], at[16], ops.sid, ops.verttl) end\n",
        "",
        LUA_TESTS,
        before="  if ops.catalog then\n",
    ),
    Mutation(
        "no-gap-fill",
        "the event stream forwards a live event past a gap in ids without filling it",
        "api/streams/session_body.py",
        "            if delivery.event_id > self.cursor + 1:  # pub/sub lost some: fill the gap from the log\n"
        "                frames, self.cursor, _ = await _from_log(store, ws, sid, self.cursor, delivery.event_id - 1, self.epoch)\n"
        "                out.extend(frames)\n",
        "",
        ("tests/test_events.py::test_a_gap_in_live_ids_is_filled_from_the_log",),
    ),
    Mutation(
        "no-fence",
        "APPLY lets another incarnation write the session (the ownership fence removed)",
        "acp_state/store/lua/transition.lua",
        "  elseif owner ~= inc then\n    return {-1, 0, ''}\n",
        "",
        LUA_TESTS,
    ),
    Mutation(
        "no-fence-create",
        "APPLY lets another incarnation overwrite a session with a snapshot",
        "acp_state/store/lua/transition.lua",
        "    if owner and owner ~= inc then return {-1, 0, ''} end\n",
        "",
        LUA_TESTS,
    ),
    Mutation(
        "attention-stays",
        "a won vote leaves its request in the attention inbox",
        "acp_state/store/lua/vote.lua",
        "attention_unset({5, 6, 7, 8}, vote.sid, {{F.INTERACTION}} .. vote.rid)\n",
        "",
        LUA_TESTS,
    ),
    Mutation(
        "takeover-anyone",
        "a move's takeover is accepted from a worker the owner did not name (two new owners)",
        "acp_state/store/lua/transition.lua",
        "    if owner ~= ops.from or get({{F.MOVING}}) ~= inc then return {-1, 0, ''} end\n",
        "",
        LUA_TESTS,
    ),
    Mutation(
        "no-parking",
        "a command sent while its session moves goes to the old owner's inbox, which no longer reads it",
        "acp_state/store/lua/send.lua",
        "if redis.call('HEXISTS', KEYS[1], {{F.MOVING}}) == 1 then queue = KEYS[4] end\n",
        "",
        LUA_TESTS,
    ),
    Mutation(
        "feed-skips-gaps",
        "the live feed takes a skipped revision as the next one instead of reading the state again",
        "api/streams/live_state_hub.py",
        "            if change.revision != expected + 1:\n                return await self._resync()  # one was missed\n",
        "",
        ("tests/test_live_feed_gaps.py",),
    ),
]


def copy_tree(into: Path) -> Path:
    target = into / "tree"
    ignore = shutil.ignore_patterns(".git", "__pycache__", "*.pyc", ".pytest_cache", "results", "node_modules")
    shutil.copytree(ROOT, target, ignore=ignore)
    # `api/` and `worker/` install as `acp_state.api` and `acp_state.worker` (pyproject's
    # package-dir): links inside the copy's `acp_state` make those names find the copy's
    # folders first, before the installed project's (the original tree's).
    for side in ("api", "worker"):
        (target / "acp_state" / side).symlink_to(target / side, target_is_directory=True)
    return target


def plant(tree: Path, mutation: Mutation) -> None:
    path = tree / mutation.path
    text = path.read_text()
    if text.count(mutation.old) != 1:
        raise LookupError(f"{mutation.name}: its text occurs {text.count(mutation.old)} times in {mutation.path}")
    text = text.replace(mutation.old, mutation.new)
    if mutation.before is not None:
        if text.count(mutation.before) != 1:
            raise LookupError(f"{mutation.name}: its anchor occurs {text.count(mutation.before)} times")
        text = text.replace(mutation.before, mutation.old + mutation.before)
    path.write_text(text)


def passes(tree: Path, tests: tuple[str, ...]) -> bool:
    """Whether the tests pass on the tree (run from it, importing only it)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
        cwd=tree, env=env, capture_output=True, text=True,
    )
    return result.returncode == 0


def main(names: list[str]) -> int:
    chosen = [m for m in MUTATIONS if not names or m.name in names]
    if names and len(chosen) != len(set(names)):
        print(f"unknown mutations: {sorted(set(names) - {m.name for m in MUTATIONS})}")
        return 2
    all_tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
    with tempfile.TemporaryDirectory(prefix="acp-mutate-") as folder:
        if not passes(copy_tree(Path(folder) / "baseline"), all_tests):
            print("baseline: the unmutated tree fails its tests; nothing to judge")
            return 2
        survived = 0
        for mutation in chosen:
            tree = copy_tree(Path(folder) / mutation.name)
            try:
                plant(tree, mutation)
            except LookupError as error:
                print(f"{mutation.name:16} STALE     {error}")
                survived += 1
                continue
            caught = not passes(tree, mutation.tests)
            survived += not caught
            print(f"{mutation.name:16} {'caught  ' if caught else 'SURVIVED'}  {mutation.bug}", flush=True)
            shutil.rmtree(tree, ignore_errors=True)
    print(f"{len(chosen) - survived} of {len(chosen)} mutations caught")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
