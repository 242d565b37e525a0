"""The command protocol (acp_state/commands.py): wire form, decoding errors, dispatch, and the
store carrying it."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import orjson
import pytest

from acp_state import commands
from acp_state.store import keys
from acp_state.commands import Attach, Cancel, Detach, RemovePrompt, SetMode, Close, Create, MalformedCommand, Prompt, Reply, Vote
from acp_state.store import RedisStore

BLOCKS = [{"type": "text", "text": "hi"}, {"type": "image", "data": "AA==", "mimeType": "image/png"}]

# Every command as the API sends it, next to the JSON the API wrote before commands.py
# existed (the same dict literals, in the same key order): the wire form is unchanged.
CASES: list[tuple[commands.Command, dict[str, Any]]] = [
    (
        Create(ws="0123456789abcdef", sid="s-1", cwd="/w", scope="single", client_id="c-1", wait_ms=30_000,
               request_id="r-1"),
        {"t": "create", "ws": "0123456789abcdef", "sid": "s-1", "cwd": "/w", "scope": "single", "clientId": "c-1",
         "waitMs": 30_000, "req": "r-1"},
    ),
    (
        Prompt(sid="s-1", prompt_id="p-1", blocks=BLOCKS, text="hi", meta={"qwen.channel.prompt": True},
               kind="channel", client_id="c-1", queued_at=1796080703834),
        {"t": "prompt", "sid": "s-1", "promptId": "p-1", "prompt": BLOCKS, "text": "hi",
         "meta": {"qwen.channel.prompt": True}, "kind": "channel", "clientId": "c-1", "queuedAt": 1796080703834},
    ),
    (
        Prompt(sid="s-1", prompt_id="p-2", blocks=BLOCKS, text="", meta=None, kind="cron", client_id=None),
        {"t": "prompt", "sid": "s-1", "promptId": "p-2", "prompt": BLOCKS, "text": "", "meta": None, "kind": "cron",
         "clientId": None, "queuedAt": 0},
    ),
    (Cancel(sid="s-1"), {"t": "cancel", "sid": "s-1"}),
    (
        Close(sid="s-1", request_id="r-2", reason="closed_by_client"),
        {"t": "close", "sid": "s-1", "req": "r-2", "reason": "closed_by_client"},
    ),
    (
        Vote(sid="s-1", rid="q-1", selected=True, option_id="proceed_once", metadata={"answers": {"a": "b"}},
             client_id="c-1"),
        {"t": "vote", "sid": "s-1", "rid": "q-1", "selected": True, "optionId": "proceed_once",
         "metadata": {"answers": {"a": "b"}}, "clientId": "c-1"},
    ),
    (
        Vote(sid="s-1", rid="q-2", selected=False, option_id=None, metadata={}, client_id=None),
        {"t": "vote", "sid": "s-1", "rid": "q-2", "selected": False, "optionId": None, "metadata": {},
         "clientId": None},
    ),
    (Attach(sid="s-1", client_id="c-2"), {"t": "attach", "sid": "s-1", "clientId": "c-2"}),
    (Detach(sid="s-1", client_id="c-2"), {"t": "detach", "sid": "s-1", "clientId": "c-2"}),
    (RemovePrompt(sid="s-1", prompt_id="p-1", request_id="r-1"),
     {"t": "remove_prompt", "sid": "s-1", "promptId": "p-1", "req": "r-1"}),
    (SetMode(sid="s-1", mode="plan", request_id="r-1", client_id="c-1"),
     {"t": "set_mode", "sid": "s-1", "mode": "plan", "req": "r-1", "clientId": "c-1"}),
]


@pytest.mark.parametrize(("command", "old_wire"), CASES, ids=[type(c).__name__ for c, _ in CASES])
def test_every_command_encodes_to_the_old_bytes_and_decodes_back(command: commands.Command, old_wire: dict) -> None:
    payload = commands.encode(command)
    assert payload == orjson.dumps(old_wire)
    assert commands.decode(payload) == command
    assert commands.decode(payload.decode()) == command  # redis-py hands back str


def test_every_command_type_is_covered() -> None:
    assert {type(c) for c, _ in CASES} == {Create, Prompt, Cancel, Close, Vote, Attach, Detach, RemovePrompt, SetMode}


def test_optional_fields_take_the_defaults_the_worker_used() -> None:
    assert commands.decode(b'{"t":"prompt","sid":"s","promptId":"p","prompt":[]}') == Prompt(
        sid="s", prompt_id="p", blocks=[], text="", meta=None, kind="foreground", client_id=None
    )
    assert commands.decode(b'{"t":"close","sid":"s","req":"r"}') == Close(
        sid="s", request_id="r", reason="closed_by_client"
    )
    assert commands.decode(b'{"t":"vote","sid":"s","rid":"q","selected":false}') == Vote(
        sid="s", rid="q", selected=False, option_id=None, metadata={}, client_id=None
    )
    assert commands.decode(b'{"t":"create","ws":"w","sid":"s","cwd":"/","req":"r"}') == Create(
        ws="w", sid="s", cwd="/", scope="thread", client_id=None, wait_ms=None, request_id="r"
    )


def test_unknown_keys_are_ignored() -> None:
    assert commands.decode(b'{"t":"cancel","sid":"s","later":1}') == Cancel(sid="s")


@pytest.mark.parametrize(
    ("payload", "reason", "command_type"),
    [
        (b"{not json", "is not JSON", None),
        (b"[1, 2]", "is not a JSON object", None),
        (b'{"sid":"s"}', "unknown command type None", None),
        (b'{"t":"reboot","sid":"s"}', "unknown command type 'reboot'", "reboot"),
        (b'{"t":7}', "unknown command type 7", None),
        (b'{"t":"cancel"}', "cancel command lacks 'sid'", "cancel"),
        (b'{"t":"prompt","sid":"s","prompt":[]}', "prompt command lacks 'promptId'", "prompt"),
        (b'{"t":"create","ws":"w","sid":"s","cwd":"/"}', "create command lacks 'req'", "create"),
        (b'{"t":"close","sid":null,"req":"r"}', "close command has 'sid' of the wrong type", "close"),
        (b'{"t":"vote","sid":"s","rid":"q","selected":1}', "vote command has 'selected' of the wrong type", "vote"),
        (b'{"t":"prompt","sid":"s","promptId":"p","prompt":"hi"}', "'prompt' of the wrong type", "prompt"),
        (b'{"t":"create","ws":"w","sid":"s","cwd":"/","req":"r","waitMs":"5"}', "'waitMs' of the wrong type", "create"),
        (b'{"t":"attach","sid":"s"}', "attach command lacks 'clientId'", "attach"),
        (b'{"t":"prompt","sid":"s","promptId":"p","prompt":[],"kind":"batch"}', "turn kind 'batch'", "prompt"),
    ],
)
def test_a_malformed_command_decodes_to_a_clear_error(payload: bytes, reason: str, command_type: str | None) -> None:
    with pytest.raises(MalformedCommand, match=reason.replace("(", r"\(").replace(")", r"\)")) as caught:
        commands.decode(payload)
    assert caught.value.command_type == command_type


def test_turn_kinds_and_the_sentinel_have_one_definition() -> None:
    from acp_state import interactions, votes
    from acp_state.api.routes import openapi, sessions
    from acp_state.worker import session

    assert commands.CALLER_TURN_KINDS == ("foreground", "cron", "notification", "goal")
    assert set(commands.TURN_KINDS) == {*commands.CALLER_TURN_KINDS, "channel"}
    assert set(session.AUTOMATIC_KINDS) <= set(commands.TURN_KINDS)
    assert not hasattr(sessions, "TURN_KINDS") and not hasattr(session, "TURN_KINDS")
    assert openapi.components()["PromptRequest"]["properties"]["turnKind"]["enum"] == list(commands.CALLER_TURN_KINDS)
    assert interactions.CANCEL_SENTINEL is commands.CANCEL_SENTINEL == "__cancelled__"
    body = {"outcome": {"outcome": "selected", "optionId": commands.CANCEL_SENTINEL}}
    assert votes.parse(body, sid="s", rid="r", client_id=None).is_sentinel


def test_commands_are_immutable() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Cancel(sid="s").sid = "t"  # type: ignore[misc]
    with pytest.raises(ValueError, match="turn kind"):
        Prompt(sid="s", prompt_id="p", blocks=[], kind="batch")


# ---- replies -------------------------------------------------------------------------------

# Every reply a worker gives, next to the dict literal it wrote before `Reply` existed: a
# reply written by a worker of either kind is read by an API of either kind.
REPLIES: list[tuple[Reply, dict[str, Any]]] = [
    (Reply(ok=False, code="worker_full"), {"ok": False, "code": "worker_full"}),
    (Reply(ok=False, code="agent_unavailable", error="boom"), {"ok": False, "code": "agent_unavailable", "error": "boom"}),
    (Reply(ok=True, created_at="2026-12-01T00:00:00.000Z", incarnation="w-1"),
     {"ok": True, "createdAt": "2026-12-01T00:00:00.000Z", "incarnation": "w-1"}),
    (Reply(ok=True), {"ok": True}),
]


@pytest.mark.parametrize(("reply", "old_wire"), REPLIES)
def test_every_reply_encodes_to_the_old_bytes_and_decodes_back(reply: Reply, old_wire: dict) -> None:
    assert reply.encode() == orjson.dumps(old_wire)
    assert Reply.decode(orjson.dumps(old_wire)) == reply


@pytest.mark.parametrize("payload", [b"[]", b"{broken", b'{"code":"worker_full"}', b'{"ok":1}', b'{"ok":false,"code":5}'])
def test_a_malformed_reply_is_an_error(payload: bytes) -> None:
    with pytest.raises(ValueError):
        Reply.decode(payload)


# ---- dispatch -----------------------------------------------------------------------------


class Recorder:
    """A CommandHandler that notes which method got what."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, commands.Command]] = []

    def on_create(self, command: Create) -> None:
        self.calls.append(("create", command))

    def on_prompt(self, command: Prompt) -> None:
        self.calls.append(("prompt", command))

    def on_cancel(self, command: Cancel) -> None:
        self.calls.append(("cancel", command))

    def on_close(self, command: Close) -> None:
        self.calls.append(("close", command))

    def on_vote(self, command: Vote) -> None:
        self.calls.append(("vote", command))

    def on_attach(self, command: Attach) -> None:
        self.calls.append(("attach", command))

    def on_detach(self, command: Detach) -> None:
        self.calls.append(("detach", command))

    def on_remove_prompt(self, command: RemovePrompt) -> None:
        self.calls.append(("remove_prompt", command))

    def on_set_mode(self, command: SetMode) -> None:
        self.calls.append(("set_mode", command))


def test_dispatch_hands_each_command_to_its_method_in_order() -> None:
    handler = Recorder()
    sent = [command for command, _ in CASES]
    for command in sent:
        commands.dispatch(handler, command)
    assert handler.calls == [(type(c).TYPE, c) for c in sent]


def test_dispatch_refuses_what_is_not_a_command() -> None:
    with pytest.raises(TypeError, match="not a command"):
        commands.dispatch(Recorder(), {"t": "cancel", "sid": "s"})  # type: ignore[arg-type]


async def test_the_store_carries_commands_and_reads_a_malformed_entry_as_its_error() -> None:
    """Through the embedded store: what send_control writes is the encoded command, and a
    stream entry that is no command comes back as a MalformedCommand, its neighbours intact."""
    store = RedisStore.from_url(f"memory://commands-{uuid.uuid4().hex}")
    try:
        create = CASES[0][0]
        stream = keys.worker_control("inc-1")
        await store.send_control("inc-1", create)
        await store.redis.xadd(stream, {"c": "{broken"})
        await store.redis.xadd(stream, {"x": "no command field"})
        await store.send_control("inc-1", create)
        assert (await store.redis.xrange(stream))[0][1] == {"c": commands.encode(create).decode()}
        received = await store.read_commands({stream: "0"}, block_ms=10)
        assert [entry[0] for entry in received] == [stream] * 4
        first, broken, no_field, last = (entry[2] for entry in received)
        assert first == create and last == create
        assert isinstance(broken, MalformedCommand) and "not JSON" in str(broken)
        assert isinstance(no_field, MalformedCommand) and "no command field" in str(no_field)
    finally:
        await store.close()
