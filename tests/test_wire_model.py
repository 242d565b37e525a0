"""The wire model, pinned to the reference (qwen-daemon-spec.md §1.2-1.4, §4, §7 and
qwen-serve-observed.md). Pure unit tests: no Redis, no processes."""

from __future__ import annotations

import json

import orjson
import pytest
from acp.exceptions import RequestError

from acp_state import commands, events, ids, interactions, votes
from acp_state.api.reads import summaries
from acp_state.interactions import CancelSentinelCollision, normalize
from acp_state.store import SessionView
from acp_state.store.keys import F
from acp_state.store.codec import view_of
from acp_state.turn_errors import LOOP_DETECTED_MESSAGE, from_exception, from_rpc_error
from acp_state.votes import MALFORMED_OUTCOME, MalformedVote

NOW = "2026-11-30T06:03:48.993Z"
QUESTION = {"question": "Which color?", "header": "Color", "multiSelect": False,
            "options": [{"label": "Red", "description": "warm"}, {"label": "Blue", "description": "cool"}]}
ACP_OPTIONS = [
    {"optionId": "proceed_once", "name": "Submit", "kind": "allow_once"},
    {"optionId": "cancel", "name": "Cancel", "kind": "reject_once"},
]
WIRE_OPTIONS = [
    {"optionId": "proceed_once", "label": "Submit", "kind": "allow_once"},
    {"optionId": "cancel", "label": "Cancel", "kind": "reject_once"},
]


def question_call(**extra: object) -> dict:
    return {"title": "Ask user 1 question",
            "_meta": {"qwenInteractionKind": "user_question", "qwenQuestions": [QUESTION]}, **extra}


# --- §4.2 pending interactions ------------------------------------------------------------


def test_question_interaction_matches_observed_shape() -> None:
    assert normalize("rq-1", question_call(), ACP_OPTIONS, NOW) == {
        "requestId": "rq-1", "kind": "user_question", "createdAt": NOW,
        "title": "Ask user 1 question", "questions": [{**QUESTION, "answerKey": "0"}],
        "options": WIRE_OPTIONS,
    }


@pytest.mark.parametrize("tool_call", [
    {"title": "ask_user_question", "kind": "other", "rawInput": {"questions": [QUESTION]}},
    {"toolName": "ask_user_question", "_meta": {"toolName": "ask_user_question"}},
    {"_meta": {"qwenInteractionKind": "USER_QUESTION", "qwenQuestions": [QUESTION]}},
    {"_meta": {"qwenInteractionKind": "question"}},
    {"_meta": "user_question"},
], ids=["tool-name-in-title", "tool-name-in-meta", "marker-wrong-case", "marker-other-value", "meta-not-object"])
def test_only_the_exact_meta_marker_makes_a_question(tool_call: dict) -> None:
    interaction = normalize("rq", tool_call, ACP_OPTIONS, NOW)
    assert interaction["kind"] == "permission"
    assert "questions" not in interaction


@pytest.mark.parametrize("tool_call, expected", [
    # _meta.qwenQuestions wins over rawInput.questions
    ({"_meta": {"qwenInteractionKind": "user_question", "qwenQuestions": [{"q": "meta"}]},
      "rawInput": {"questions": [{"q": "raw"}]}}, [{"q": "meta", "answerKey": "0"}]),
    # rawInput.questions when qwenQuestions is not an array; sequential keys
    ({"_meta": {"qwenInteractionKind": "user_question", "qwenQuestions": "nope"},
      "rawInput": {"questions": [{"q": "a"}, {"q": "b"}]}},
     [{"q": "a", "answerKey": "0"}, {"q": "b", "answerKey": "1"}]),
    ({"_meta": {"qwenInteractionKind": "user_question"}, "rawInput": {"questions": {"q": "not a list"}}}, []),
    ({"_meta": {"qwenInteractionKind": "user_question"}, "rawInput": "nope"}, []),
    ({"_meta": {"qwenInteractionKind": "user_question"}}, []),
    # non-object entries are dropped but consume their index
    ({"_meta": {"qwenInteractionKind": "user_question", "qwenQuestions": ["x", {"q": "kept"}]}},
     [{"q": "kept", "answerKey": "1"}]),
    ({"_meta": {"qwenInteractionKind": "user_question", "qwenQuestions": [None, 3, {"q": "c"}, "s", {"q": "e"}]}},
     [{"q": "c", "answerKey": "2"}, {"q": "e", "answerKey": "4"}]),
], ids=["meta-over-raw", "raw-fallback", "raw-not-list", "raw-input-not-object", "none", "drop-keeps-index",
        "several-dropped"])
def test_question_source_and_answer_keys(tool_call: dict, expected: list) -> None:
    assert normalize("rq", tool_call, [], NOW)["questions"] == expected


def test_question_entries_are_copied_not_mutated() -> None:
    source = {"question": "Q?"}
    normalize("rq", {"_meta": {"qwenInteractionKind": "user_question", "qwenQuestions": [source]}}, [], NOW)
    assert source == {"question": "Q?"}


def test_question_title_only_when_string() -> None:
    assert "title" not in normalize("rq", question_call(title=7), ACP_OPTIONS, NOW)


def test_permission_interaction_matches_observed_shape() -> None:
    tool_call = {
        "toolCallId": "t1", "kind": "execute", "title": "touch perm_check.txt (create a file)",
        "content": [{"type": "content", "content": {"type": "text", "text": "…"}}], "locations": [],
        "rawInput": {"command": "touch perm_check.txt", "description": "create a file"},
        "status": "pending",
    }
    assert normalize("rq-2", tool_call, ACP_OPTIONS, NOW) == {
        "requestId": "rq-2", "kind": "permission", "createdAt": NOW,
        "action": {"type": "execute", "title": "touch perm_check.txt (create a file)",
                   "content": tool_call["content"], "locations": [], "input": tool_call["rawInput"]},
        "options": WIRE_OPTIONS,
    }


@pytest.mark.parametrize("tool_call, action", [
    ({}, {}),
    ({"kind": "edit"}, {"type": "edit"}),
    ({"kind": 3, "title": ["t"]}, {}),  # type/title only when strings
    ({"title": "T", "rawInput": {}}, {"title": "T", "input": {}}),
    ({"locations": [{"path": "/a"}]}, {"locations": [{"path": "/a"}]}),
    ({"content": "c", "toolCallId": "x", "status": "pending"}, {"content": "c"}),
])
def test_permission_action_keys_only_when_present(tool_call: dict, action: dict) -> None:
    assert normalize("rq", tool_call, [], NOW)["action"] == action


@pytest.mark.parametrize("tool_call", [None, "a string", 42, ["list"]])
def test_malformed_tool_call_falls_back_to_empty_action(tool_call: object) -> None:
    assert normalize("rq", tool_call, ACP_OPTIONS, NOW) == {
        "requestId": "rq", "kind": "permission", "createdAt": NOW, "action": {}, "options": WIRE_OPTIONS,
    }


@pytest.mark.parametrize("option, mapped", [
    ({"optionId": "a", "name": "A", "kind": "allow_always"}, {"optionId": "a", "label": "A", "kind": "allow_always"}),
    ({"optionId": "a"}, {"optionId": "a"}),
    ({"optionId": "a", "name": None, "kind": 1}, {"optionId": "a"}),
    ({"name": "no id"}, {"optionId": "", "label": "no id"}),
    ({"optionId": None, "kind": "reject_always"}, {"optionId": "", "kind": "reject_always"}),
    ({"optionId": 7}, {"optionId": "7"}),
])
def test_option_mapping(option: dict, mapped: dict) -> None:
    assert interactions.map_options([option]) == [mapped]


@pytest.mark.parametrize("raw, wire", [(True, "true"), (2.0, "2")], ids=["bool", "integral-float"])
def test_option_id_uses_js_string_conversion(raw: object, wire: str) -> None:
    assert interactions.map_options([{"optionId": raw}]) == [{"optionId": wire}]


def test_allowed_option_ids_exclude_empty_string() -> None:
    mapped = interactions.map_options([{"optionId": "a"}, {"name": "x"}, {"optionId": ""}, {"optionId": "b"}])
    assert set(interactions.allowed_option_ids(mapped)) == {"a", "b"}


def test_cancel_sentinel_offered_by_agent_raises() -> None:
    mapped = interactions.map_options([{"optionId": "ok"}, {"optionId": "__cancelled__"}])
    with pytest.raises(CancelSentinelCollision):
        interactions.check_sentinel(mapped)


def test_ordinary_options_pass_the_sentinel_check() -> None:
    interactions.check_sentinel(interactions.map_options(ACP_OPTIONS))


# --- §7 turn errors -----------------------------------------------------------------------


@pytest.mark.parametrize("data, message", [
    ("plain data string", "plain data string"),
    ({"details": "from details", "message": "m", "error": "e"}, "from details"),
    ({"message": "from data.message", "error": "e"}, "from data.message"),
    ({"error": "from data.error"}, "from data.error"),
    ({"error": {"message": "from data.error.message"}}, "from data.error.message"),
    ({"details": 5, "message": ["x"], "error": {"code": 1}}, "Internal error"),
    (None, "Internal error"),
    (42, "Internal error"),
])
def test_message_extraction_chain(data: object, message: str) -> None:
    assert from_rpc_error(-32603, "Internal error", data).message == message


@pytest.mark.parametrize("data, top_message, expected", [
    ("", "top-level message", "top-level message"),
    ({"details": "", "message": "data.message"}, "top", "data.message"),
    ({"message": "", "error": "data.error"}, "top", "data.error"),
])
def test_empty_strings_fall_through_the_message_chain(data: object, top_message: str, expected: str) -> None:
    assert from_rpc_error(-32603, top_message, data).message == expected


@pytest.mark.parametrize("message", ["terminated", "  Terminated\n", "TERMINATED"])
def test_terminated_message_is_a_model_stream_interruption(message: str) -> None:
    error = from_rpc_error(-32603, message, None)
    assert error.status_view() == {"message": message, "code": "-32603", "errorKind": "model_stream_interrupted"}


@pytest.mark.parametrize("message", ["terminated early", "process terminated", ""])
def test_other_messages_have_no_error_kind(message: str) -> None:
    assert "errorKind" not in from_rpc_error(-32603, message, None).status_view()


def test_structured_error_kind_wins_over_terminated() -> None:
    assert from_rpc_error(1, "terminated", {"errorKind": "custom"}).error_kind == "custom"


def test_empty_data_error_kind_is_ignored() -> None:
    assert from_rpc_error(1, "terminated", {"errorKind": ""}).error_kind == "model_stream_interrupted"


@pytest.mark.parametrize("code, data, wire_code", [
    (-32603, None, "-32603"),
    (-32603, {"code": "IGNORED"}, "-32603"),  # no errorKind: data.code is not used
    ("already_string", None, "already_string"),
    (-32603, {"errorKind": "k", "code": "FROM_DATA"}, "FROM_DATA"),
    (-32603, {"errorKind": "k"}, "-32603"),  # structured, no data.code: top-level fallback
    (None, None, None),
    ({"odd": 1}, None, None),
])
def test_code_derivation(code: object, data: object, wire_code: str | None) -> None:
    assert from_rpc_error(code, "boom", data).status_view().get("code") == wire_code


def test_derived_error_kind_does_not_read_data_code() -> None:
    error = from_rpc_error(-32603, "terminated", {"code": "FROM_DATA"})
    assert error.status_view() == {"message": "terminated", "code": "-32603", "errorKind": "model_stream_interrupted"}


def test_numeric_data_code_falls_back_to_top_level_code() -> None:
    assert from_rpc_error(-32603, "boom", {"errorKind": "k", "code": 7}).status_view()["code"] == "-32603"


def test_empty_code_and_loop_type_are_omitted() -> None:
    error = from_rpc_error("", "boom", {"errorKind": "k", "loopType": ""})
    assert "code" not in error.status_view()
    assert "loopType" not in error.event_data("s", None)


def test_qwen_loop_detected_error() -> None:
    raised = RequestError(-32603, LOOP_DETECTED_MESSAGE, {
        "code": "LOOP_DETECTED", "errorKind": "loop_detected", "loopType": "invalid_tool_params_stagnation"})
    error = from_exception(raised)
    assert LOOP_DETECTED_MESSAGE == ("Tool-call loop protection stopped this turn. The session is still "
                                     "available; send a more specific instruction to continue.")
    assert error.status_view() == {"message": LOOP_DETECTED_MESSAGE, "code": "LOOP_DETECTED",
                                   "errorKind": "loop_detected"}
    data = error.event_data("15788ed8", "5209d256")
    assert data == {"sessionId": "15788ed8", "message": LOOP_DETECTED_MESSAGE, "code": "LOOP_DETECTED",
                    "errorKind": "loop_detected", "loopType": "invalid_tool_params_stagnation",
                    "promptId": "5209d256"}
    assert list(data) == ["sessionId", "message", "code", "errorKind", "loopType", "promptId"]


def test_loop_type_never_reaches_the_status_view() -> None:
    error = from_rpc_error(-32603, "x", {"errorKind": "loop_detected", "loopType": "tool_call_repetition"})
    assert "loopType" not in error.status_view()
    assert error.event_data("s", None)["loopType"] == "tool_call_repetition"


def test_event_data_without_prompt_id_or_extras() -> None:
    assert from_rpc_error(None, "boom", None).event_data("s", None) == {"sessionId": "s", "message": "boom"}


def test_plain_exception_message() -> None:
    assert from_exception(RuntimeError("disk full")).status_view() == {"message": "disk full"}


@pytest.mark.parametrize("data, structured", [
    ({"errorKind": "loop_detected"}, True),
    (None, False),  # "terminated" -> derived model_stream_interrupted
    ({"errorKind": "model_stream_interrupted"}, True),
])
def test_structured_rejection_means_a_data_error_kind(data: object, structured: bool) -> None:
    assert from_rpc_error(-32603, "terminated", data).structured is structured


# --- §1.4 votes ---------------------------------------------------------------------------


def parse(body: object) -> commands.Vote:
    return votes.parse(body, sid="s-1", rid="r-1", client_id=None)


@pytest.mark.parametrize("body", [
    None, [], "cancelled", {}, {"outcome": None}, {"outcome": "cancelled"}, {"outcome": ["cancelled"]},
    {"outcome": {}}, {"outcome": {"outcome": "Cancelled"}}, {"outcome": {"outcome": "approved", "optionId": "a"}},
    {"outcome": {"outcome": "selected"}}, {"outcome": {"outcome": "selected", "optionId": ""}},
    {"outcome": {"outcome": "selected", "optionId": 5}}, {"outcome": {"outcome": "selected", "optionId": None}},
    {"answers": {"0": "Blue"}},
])
def test_malformed_outcome_is_rejected_with_reference_message(body: object) -> None:
    with pytest.raises(MalformedVote) as raised:
        parse(body)
    assert str(raised.value) == MALFORMED_OUTCOME
    with pytest.raises(MalformedVote):
        votes.check(body)


def test_malformed_outcome_message_is_the_reference_text() -> None:
    assert MALFORMED_OUTCOME == '`outcome` must be `{ outcome: "cancelled" }` or `{ outcome: "selected", optionId: string }`'


def test_a_vote_is_the_command_the_worker_answers_the_agent_with() -> None:
    body = {"outcome": {"outcome": "selected", "optionId": "ok"}, "answers": {"0": "Blue"}}
    votes.check(body)
    vote = votes.parse(body, sid="s-1", rid="r-1", client_id="c-1")
    assert vote == commands.Vote(
        sid="s-1", rid="r-1", selected=True, option_id="ok", metadata={"answers": {"0": "Blue"}}, client_id="c-1"
    )
    assert commands.decode(commands.encode(vote)).acp_response() == vote.acp_response()


def test_selected_vote_with_answers_reaches_the_agent_at_the_root() -> None:
    vote = parse({"outcome": {"outcome": "selected", "optionId": "proceed_once"}, "answers": {"0": "Blue"}})
    assert vote.selected and vote.option_id == "proceed_once"
    assert vote.acp_response() == {"outcome": {"outcome": "selected", "optionId": "proceed_once"},
                                   "answers": {"0": "Blue"}}


@pytest.mark.parametrize("answers", [["Blue"], "Blue", {"0": 1}, {"0": "a", "1": None}, {"0": ["a"]}, None])
def test_answers_not_a_string_valued_object_are_silently_dropped(answers: object) -> None:
    vote = parse({"outcome": {"outcome": "selected", "optionId": "ok"}, "answers": answers, "keep": 1})
    assert vote.acp_response() == {"outcome": {"outcome": "selected", "optionId": "ok"}, "keep": 1}


def test_empty_answers_object_is_kept() -> None:
    vote = parse({"outcome": {"outcome": "selected", "optionId": "ok"}, "answers": {}})
    assert vote.acp_response()["answers"] == {}


def test_other_keys_pass_through_and_prototype_keys_are_stripped() -> None:
    body = json.loads('{"outcome":{"outcome":"selected","optionId":"ok"},"expectedPlanExecutionMode":"default",'
                      '"__proto__":{"x":1},"constructor":"c","prototype":{},"extra":[1]}')
    assert parse(body).acp_response() == {
        "outcome": {"outcome": "selected", "optionId": "ok"}, "expectedPlanExecutionMode": "default", "extra": [1]}


@pytest.mark.parametrize("body", [
    {"outcome": {"outcome": "cancelled"}},
    {"outcome": {"outcome": "cancelled", "optionId": "ok"}, "answers": {"0": "x"}, "extra": 1},
])
def test_cancelled_vote_response_is_exactly_cancelled(body: dict) -> None:
    vote = parse(body)
    assert not vote.selected and not vote.is_sentinel
    assert orjson.dumps(vote.acp_response()) == b'{"outcome":{"outcome":"cancelled"}}'
    assert vote.acp_response() == commands.cancelled_response()  # one shape, for votes and the worker alike


def test_selecting_the_cancel_sentinel_is_flagged() -> None:
    assert parse({"outcome": {"outcome": "selected", "optionId": "__cancelled__"}}).is_sentinel
    assert not parse({"outcome": {"outcome": "selected", "optionId": "cancel"}}).is_sentinel


# --- §1.2 / §1.3 summaries ----------------------------------------------------------------

META = {"sessionId": "15788ed8", "workspaceCwd": "/tmp/qws", "createdAt": "2026-11-30T06:03:12.621Z"}
NEW_FIELDS = {"isWaitingForPermission", "isWaitingForUserQuestion", "pendingInteractionCount",
              "hasTurnError", "turnError", "pendingInteractions"}
LOOP_TURN_ERROR = {"message": LOOP_DETECTED_MESSAGE, "code": "LOOP_DETECTED", "errorKind": "loop_detected"}


def session_hash(*pending: tuple[int, dict], meta: dict = META, **fields: str) -> SessionView:
    """The view the store reads from a session hash holding these fields."""
    hashed = {F.OWNER: "w-1", F.META: orjson.dumps(meta).decode(), **fields}
    for order, interaction in pending:
        rid = interaction["requestId"]
        hashed[F.INTERACTION + rid] = orjson.dumps(interaction).decode()
        hashed[F.VOTABLE + rid] = orjson.dumps([order, ["ok"]]).decode()
    view = view_of(hashed, meta["sessionId"])
    assert view is not None
    return view


def pending(rid: str, kind: str) -> dict:
    return {"requestId": rid, "kind": kind, "createdAt": NOW, "options": []}


def test_idle_live_summary_matches_observed_status() -> None:
    fields = session_hash(**{F.UPDATED: "2026-11-30T06:03:17.161Z", F.CLIENT + "c1": "1", F.SEQ: "9"})
    result = summaries.live_summary(fields)
    assert result == {
        "sessionId": "15788ed8", "workspaceCwd": "/tmp/qws", "createdAt": "2026-11-30T06:03:12.621Z",
        "updatedAt": "2026-11-30T06:03:17.161Z", "clientCount": 1, "hasActivePrompt": False,
        "activeWorkState": "idle", "hasRunningBackgroundTasks": False, "isWaitingForPermission": False,
        "isWaitingForUserQuestion": False, "pendingInteractionCount": 0, "hasTurnError": False,
        "pendingInteractions": [],
    }
    assert list(result) == [  # the observed key order
        "sessionId", "workspaceCwd", "createdAt", "updatedAt", "clientCount", "hasActivePrompt", "activeWorkState",
        "hasRunningBackgroundTasks", "isWaitingForPermission", "isWaitingForUserQuestion",
        "pendingInteractionCount", "hasTurnError", "pendingInteractions",
    ]


def test_pending_interactions_follow_request_order_numerically() -> None:
    fields = session_hash((10, pending("late", "permission")), (9, pending("early", "user_question")),
                          (100, pending("last", "permission")), **{F.ACTIVE: "1"})
    result = summaries.live_summary(fields)
    assert [p["requestId"] for p in result["pendingInteractions"]] == ["early", "late", "last"]
    assert result["pendingInteractionCount"] == 3
    assert result["hasActivePrompt"] is True and result["activeWorkState"] == "active"


@pytest.mark.parametrize("kinds, waiting_permission, waiting_question", [
    ([], False, False),
    (["permission"], True, False),
    (["user_question"], False, True),
    (["user_question", "permission"], True, True),
])
def test_waiting_booleans_derive_from_kinds(kinds: list, waiting_permission: bool, waiting_question: bool) -> None:
    fields = session_hash(*[(i, pending(f"r{i}", kind)) for i, kind in enumerate(kinds)])
    result = summaries.live_summary(fields)
    assert result["isWaitingForPermission"] is waiting_permission
    assert result["isWaitingForUserQuestion"] is waiting_question
    assert result["pendingInteractionCount"] == len(kinds)


def test_votable_entry_without_interaction_is_not_listed() -> None:
    fields = session_hash((1, pending("kept", "permission")), **{F.VOTABLE + "gone": "[0,[]]"})
    assert [p["requestId"] for p in summaries.live_summary(fields)["pendingInteractions"]] == ["kept"]


def test_turn_error_present_only_while_set() -> None:
    without = summaries.live_summary(session_hash())
    assert without["hasTurnError"] is False and "turnError" not in without
    with_error = summaries.live_summary(session_hash(**{F.TURN_ERROR: orjson.dumps(LOOP_TURN_ERROR).decode()}))
    assert with_error["hasTurnError"] is True
    assert with_error["turnError"] == LOOP_TURN_ERROR


def test_client_count_counts_client_fields_only() -> None:
    fields = session_hash(**{F.CLIENT + "a": "1", F.CLIENT + "b": "1", F.CLIENT + "c": "1",
                             F.OWNER: "inc", F.SEQ: "3", F.ADMITTED: "2"})
    assert summaries.live_summary(fields)["clientCount"] == 3


def test_update_and_background_flag_appear_once_a_turn_ended() -> None:
    """The reference's status has neither `updatedAt` nor `hasRunningBackgroundTasks` until
    a turn of the session reached its terminal."""
    fresh = summaries.live_summary(session_hash())
    assert "updatedAt" not in fresh and "hasRunningBackgroundTasks" not in fresh
    ended = summaries.live_summary(session_hash(**{F.UPDATED: "2026-11-30T06:03:17.161Z"}))
    assert ended["updatedAt"] == "2026-11-30T06:03:17.161Z" and ended["hasRunningBackgroundTasks"] is False


def test_display_name_is_the_listings_never_the_status() -> None:
    named = session_hash(meta={**META, "displayName": "PERM please run"})
    assert "displayName" not in summaries.live_summary(named)
    listed = summaries.merged_row({}, summaries.live_summary(named), named.meta)
    assert listed["displayName"] == "PERM please run"


ROW = {"sessionId": "15788ed8", "workspaceCwd": "/tmp/qws", "createdAt": "2026-11-30T06:00:00.000Z",
       "updatedAt": "2026-11-30T06:10:00.000Z", "displayName": "persisted title"}


def test_persisted_row_has_no_runtime_fields() -> None:
    row = summaries.persisted_row(ROW)
    assert NEW_FIELDS.isdisjoint(row)
    assert row == {**ROW, "clientCount": 0, "hasActivePrompt": False, "isArchived": False}


def test_persisted_row_without_update_uses_created_at() -> None:
    row = summaries.persisted_row({k: v for k, v in ROW.items() if k not in ("updatedAt", "displayName")})
    # A session never prompted: the reference lists its chat file's empty first prompt.
    assert row["updatedAt"] == ROW["createdAt"] and row["displayName"] == ""


def live(**overrides: object) -> dict:
    return summaries.live_summary(live_hash(**overrides))


def live_hash(**overrides: object) -> SessionView:
    return session_hash((1, pending("r1", "permission")), meta={**META, **overrides.pop("meta", {})},
                        **{F.UPDATED: "2026-11-30T06:03:17.161Z", F.CLIENT + "a": "1", F.CLIENT + "b": "1",
                           F.TURN_ERROR: orjson.dumps(LOOP_TURN_ERROR).decode()})


def test_merged_row_overlays_live_runtime_fields() -> None:
    named = live_hash(meta={"displayName": "PERM please run"})
    live_summary = summaries.live_summary(named)
    merged = summaries.merged_row(ROW, live_summary, named.meta)
    assert merged["createdAt"] == ROW["createdAt"]
    assert merged["updatedAt"] == ROW["updatedAt"]  # the later of the two
    assert merged["displayName"] == "PERM please run"
    assert merged["isArchived"] is False
    assert merged["clientCount"] == 2
    for key in NEW_FIELDS | {"hasActivePrompt", "activeWorkState"}:
        assert merged[key] == live_summary[key]
    assert list(merged) == [
        "sessionId", "workspaceCwd", "createdAt", "updatedAt", "displayName", "clientCount", "hasActivePrompt",
        "isArchived", "activeWorkState", "hasRunningBackgroundTasks", "isWaitingForPermission",
        "isWaitingForUserQuestion", "pendingInteractionCount", "hasTurnError", "turnError", "pendingInteractions",
    ]


def test_merged_row_takes_live_update_when_later_and_persisted_name_as_fallback() -> None:
    merged = summaries.merged_row({**ROW, "updatedAt": "2026-11-30T06:00:01.000Z"}, live())
    assert merged["updatedAt"] == "2026-11-30T06:03:17.161Z"
    assert merged["displayName"] == "persisted title"


def test_merged_row_keeps_display_name_position_when_taken_from_persisted_row() -> None:
    merged = summaries.merged_row(ROW, live())
    assert list(merged)[4] == "displayName"


# --- ids ----------------------------------------------------------------------------------


def test_workspace_id_matches_reference() -> None:
    assert ids.workspace_id("/tmp/qws") == "214b51c6c4dca81d"
    assert ids.is_workspace_id(ids.workspace_id("/any/where"))


@pytest.mark.parametrize("value, valid", [
    ("15788ed8-0c4e-4b1a-9c0e-2f4a6b8d0e1f", True),
    ("15788ED8-0C4E-1B1A-AC0E-2F4A6B8D0E1F", True),
    ("15788ed8-0c4e-6b1a-9c0e-2f4a6b8d0e1f", False),  # version 6
    ("15788ed8-0c4e-4b1a-cc0e-2f4a6b8d0e1f", False),  # variant
    ("15788ed80c4e4b1a9c0e2f4a6b8d0e1f", False),
    ("{15788ed8-0c4e-4b1a-9c0e-2f4a6b8d0e1f}", False),
    ("15788ed8-0c4e-4b1a-9c0e-2f4a6b8d0e1f\n", False),  # `$` alone would let a trailing newline in
    ("", False), (None, False), (123, False),
])
def test_session_id(value: object, valid: bool) -> None:
    assert ids.is_session_id(value) is valid


def test_new_ids_are_valid_session_ids() -> None:
    assert ids.is_session_id(ids.new_id())
    assert ids.new_id() != ids.new_id()


@pytest.mark.parametrize("value, valid", [
    ("web-shell:tab_1.a", True), ("x" * 128, True), ("x" * 129, False), ("", False),
    ("has space", False), ("a{b}", False), ("a/b", False), ("é", False), (None, False), ("abc\n", False),
])
def test_client_and_request_token(value: object, valid: bool) -> None:
    assert ids.is_token(value) is valid


@pytest.mark.parametrize("value, valid", [
    ("214b51c6c4dca81d", True), ("214B51C6C4DCA81D", False), ("214b51c6c4dca81", False),
    ("214b51c6c4dca81dd", False), ("214b51c6c4dca81g", False), (None, False), ("214b51c6c4dca81d\n", False),
])
def test_workspace_id_validator(value: object, valid: bool) -> None:
    assert ids.is_workspace_id(value) is valid


# --- §2 event envelope --------------------------------------------------------------------


def test_event_body_wraps_into_the_reference_envelope() -> None:
    data = from_rpc_error(-32603, LOOP_DETECTED_MESSAGE, {
        "code": "LOOP_DETECTED", "errorKind": "loop_detected", "loopType": "invalid_tool_params_stagnation",
    }).event_data("15788ed8", "5209d256")
    envelope = json.loads('{"id":5,' + events.body("turn_error", data, "5209d256") + "}")
    assert list(envelope) == ["id", "v", "type", "promptId", "data", "_meta"]
    assert envelope["id"] == 5 and envelope["v"] == 1 and envelope["type"] == "turn_error"
    assert envelope["promptId"] == "5209d256" and envelope["data"] == data
    assert list(envelope["_meta"]) == ["serverTimestamp"]
    assert isinstance(envelope["_meta"]["serverTimestamp"], int) and envelope["_meta"]["serverTimestamp"] > 1.7e12


def test_event_body_without_prompt_id() -> None:
    envelope = json.loads('{"id":1,' + events.body("replay_complete", {"replayedCount": 0}) + "}")
    assert list(envelope) == ["id", "v", "type", "data", "_meta"]


@pytest.mark.parametrize("data", [{"text": 'quote " brace } newline \n'}, [], None, "s", {"nested": {"a": [1]}}])
def test_event_body_is_valid_json_members_for_any_data(data: object) -> None:
    assert json.loads('{"id":2,' + events.body("session_update", data) + "}")["data"] == data
