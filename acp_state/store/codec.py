"""The codec of stored values: the domain types (`types`) as Redis holds them, and back.

One pair each: a session hash read as a `SessionView` (`view_of`), a `Transition` written
as the ops JSON the APPLY and SWEEP scripts read (`transition_ops`), a create's idempotency
record (`pack_create_record`, `unpack_create_record`), and the attention index's replies
read as entries (`attention_entries`). The field names are `keys.F`'s; nothing else of the
store spells them.
"""

from __future__ import annotations

from typing import Any

import orjson

from .. import events
from ..clock import from_iso, now_ms
from ..turns import KEPT_ENDED_TURNS
from .keys import F
from .types import AttentionEntry, CatalogRow, CreateRecord, Mode, Retention, SessionView, Transition

# Stands for each admitted prompt's id in the terminal APPLY gives the prompts left (orphan).
PROMPT_ID_SLOT = "@PID@"


def view_of(fields: dict[str, str], sid: str) -> SessionView | None:
    """Session `sid`'s hash (HGETALL) as readers see it; None unless it is a live session's
    (an owner and its meta). Fields at their zero value are absent (see keys.F)."""
    owner, created = fields.get(F.OWNER), fields.get(F.CREATED)
    if not owner:
        return None
    if created is not None:
        meta = {"sessionId": sid, "workspaceCwd": fields.get(F.CWD, ""), "createdAt": created}
        if F.TITLE in fields:
            meta["displayName"] = fields[F.TITLE]
    elif F.META in fields:
        meta = orjson.loads(fields[F.META])
    else:
        return None
    ordered: list[tuple[float, str]] = []
    client_count = 0
    for name, value in fields.items():
        if name.startswith(F.VOTABLE):
            ordered.append((orjson.loads(value)[0], name[len(F.VOTABLE):]))
        elif name.startswith(F.CLIENT):
            client_count += 1
    ordered.sort()
    pending = [orjson.loads(fields[F.INTERACTION + rid]) for _, rid in ordered if F.INTERACTION + rid in fields]
    turn_error, turn_error_event = fields.get(F.TURN_ERROR), fields.get(F.TURN_ERROR_EVENT)
    return SessionView(
        owner=owner,
        meta=meta,
        updated_at=fields.get(F.UPDATED, meta["createdAt"]),
        active=fields.get(F.ACTIVE) == "1",
        admitted=int(fields.get(F.ADMITTED, "0")),
        client_count=client_count,
        turn_error=orjson.loads(turn_error) if turn_error is not None else None,
        turn_error_event=orjson.loads(turn_error_event) if turn_error_event is not None else None,
        pending=pending,
        last_event_id=int(fields.get(F.SEQ, "0")),
        epoch=fields.get(F.EPOCH, ""),
        told=F.REQUEST not in fields,
        moving=F.MOVING in fields,
        available_commands=orjson.loads(fields[F.COMMANDS]) if F.COMMANDS in fields else None,
        approval_mode=fields.get(F.MODE),
        agent_state=orjson.loads(fields[F.AGENT_STATE]) if F.AGENT_STATE in fields else None,
        usage=orjson.loads(fields[F.USAGE]) if F.USAGE in fields else None,
    )


def transition_ops(sid: str, t: Transition, retention: Retention) -> dict[str, Any]:
    """The APPLY script's ops JSON for a transition (see apply.lua): mode, set {field:
    str}, del [field], incr {field: int}, events [envelope bodies], tev (1-based index of
    the event to keep as the turn-error event), catalog (row JSON) with its score,
    single, missing_only, uncatalog, orphan (the terminal body for each admitted prompt
    left, `@PID@` standing for its id), endturn (the error a delete ends every admitted
    prompt's turn record with), op; with the retention each needs."""
    fields: dict[str, str] = {}
    if t.meta is not None:
        for name, value in ((F.CREATED, t.meta.get("createdAt")), (F.CWD, t.meta.get("workspaceCwd")),
                            (F.TITLE, t.meta.get("displayName"))):
            if value:
                fields[name] = value
    if t.epoch is not None:
        fields[F.EPOCH] = t.epoch
    if t.updated_at is not None:
        fields[F.UPDATED] = t.updated_at
    if t.active is not None:
        fields[F.ACTIVE] = "1" if t.active else "0"
    if t.admitted:
        fields[F.ADMITTED] = str(t.admitted)
    for prompt_id in t.prompts_admitted:
        fields[F.PROMPT + prompt_id] = "1"
    for client_id in t.clients:
        fields[F.CLIENT + client_id] = "1"
    if t.turn_error is not None:
        fields[F.TURN_ERROR] = orjson.dumps(t.turn_error).decode()
    if t.approval_mode is not None:
        fields[F.MODE] = t.approval_mode
    if t.available_commands is not None:
        fields[F.COMMANDS] = orjson.dumps(t.available_commands).decode()
    # An agent that reported no modes or options leaves no field: readers take a missing one
    # as `{}` (most agents' sessions, and every idle scripted one).
    if t.agent_state:
        fields[F.AGENT_STATE] = orjson.dumps(t.agent_state).decode()
    if t.usage is not None:
        fields[F.USAGE] = orjson.dumps(t.usage).decode()
    for pending in t.interactions_added:
        fields[F.INTERACTION + pending.rid] = orjson.dumps(pending.interaction).decode()
        fields[F.VOTABLE + pending.rid] = orjson.dumps([pending.order, pending.allowed]).decode()
    if t.untold_request is not None:
        fields[F.REQUEST] = t.untold_request
    removed = [F.PROMPT + prompt_id for prompt_id in t.prompts_ended]
    for rid in t.interactions_removed:
        removed += [F.INTERACTION + rid, F.VOTABLE + rid]
    if t.clear_turn_error_event:
        removed.append(F.TURN_ERROR_EVENT)
    if t.clear_turn_error:
        removed.append(F.TURN_ERROR)
    if t.agent_state is not None and not t.agent_state:
        removed.append(F.AGENT_STATE)
    if t.told:
        removed.append(F.REQUEST)

    ops: dict[str, Any] = {"mode": t.mode.value, "sid": sid, "verttl": retention.catalog_ms}
    if t.turns:
        ops["turns"] = [[turn.prompt_id, turn.pack(), 1 if turn.ended else 0] for turn in t.turns]
        ops["turnkeep"] = KEPT_ENDED_TURNS
        ops["turnttl"] = retention.catalog_ms
    if fields:
        ops["set"] = fields
    if removed:
        ops["del"] = removed
    if t.admitted_change:
        ops["incr"] = {F.ADMITTED: t.admitted_change}
    if t.mode is Mode.CREATE and t.single:
        ops["single"] = True
    if t.restore:
        ops["missing_only"] = True
    if t.resumed:
        ops["resumed"] = True
    if t.takeover_from is not None:
        ops["from"] = t.takeover_from
    if t.uncatalog:
        ops["uncatalog"] = True
    if t.uncatalog_untold:
        ops["uncatalog_untold"] = True
    if t.op is not None:
        ops["op"] = t.op
    if t.end_admitted is not None:
        data = {"sessionId": sid, "message": t.end_admitted.message, "code": t.end_admitted.code,
                "promptId": PROMPT_ID_SLOT}
        ops["orphan"] = events.body("turn_error", data, PROMPT_ID_SLOT)
        # Every prompt the delete ends has its turn record ended so too, where the records
        # stay (a session that stays listed): a resume answers them (GET turns/:promptId).
        ops["endturn"] = {"message": t.end_admitted.message, "code": t.end_admitted.code, "at": str(now_ms()),
                          "keep": KEPT_ENDED_TURNS, "ttl": retention.catalog_ms}
    ops["events"] = list(t.events)
    if t.keep_turn_error_event is not None:
        ops["tev"] = t.keep_turn_error_event
    if t.events or t.end_admitted is not None:
        ops["evmax"] = retention.events_max
        ops["evttl"] = retention.events_ms
        ops["tr"] = [i + 1 for i, body in enumerate(t.events) if events.in_transcript(body)]
        ops["trmax"] = retention.transcript_max
        ops["trttl"] = retention.transcript_ms
    if t.catalog is not None:
        now = now_ms()
        ops["score"] = str(t.catalog.updated_ms)
        ops["catalog"] = pack_catalog_row(t.catalog)
        ops["retention"] = retention.catalog_ms
        ops["cutoff"] = str(now - retention.catalog_ms)
    return ops


# A catalog row's optional fields: attribute, JSON key.
_CATALOG_OPTIONAL = (("agent", "agent"), ("state_store", "stateStore"), ("agent_sid", "agentSessionId"),
                     ("resumable", "resumable"), ("source_type", "sourceType"), ("source_id", "sourceId"))


def pack_catalog_row(row: CatalogRow) -> str:
    """The catalog hash's value for a session (its id is the field, its cwd the workspace's)."""
    return orjson.dumps(_catalog_json(row)).decode()


def unpack_catalog_row(value: str | bytes) -> CatalogRow:
    """A catalog hash's value as the row it is (`updated_ms` read from its `updatedAt`)."""
    wire = orjson.loads(value)
    updated_at = wire.get("updatedAt") or wire["createdAt"]
    return CatalogRow(
        wire["createdAt"], updated_at, from_iso(updated_at), wire.get("displayName") or None,
        **{name: wire.get(key) for name, key in _CATALOG_OPTIONAL},
    )


def _catalog_json(row: CatalogRow) -> dict[str, Any]:
    value: dict[str, Any] = {"createdAt": row.created_at, "updatedAt": row.updated_at}
    if row.display_name:
        value["displayName"] = row.display_name
    for name, key in _CATALOG_OPTIONAL:
        if getattr(row, name) is not None:
            value[key] = getattr(row, name)
    return value


def pack_create_record(record: CreateRecord) -> str:
    """`<sid> <clientId> <attached 0/1> <state>`: state `-` claimed, `<request>` sent, `+` told."""
    state = "+" if record.kept else record.request or "-"
    return f"{record.sid} {record.client_id} {int(record.attached)} {state}"


def unpack_create_record(value: str) -> CreateRecord:
    sid, client_id, attached, request = value.split(" ")
    return CreateRecord(sid, client_id, attached == "1", request if request not in ("+", "-") else None, request == "+")


def attention_entries(ws: str | None, flat: list[Any]) -> list[AttentionEntry]:
    """ATTENTION_PAGE / ATTENTION_OF replies -> entries: members `<sid>/<requestId>` of
    workspace `ws`, or `<ws>/<sid>/<requestId>` of the deployment's index (`ws` None); `!`
    for a turn error. One without details is skipped, never fails a page."""
    found = []
    for i in range(0, len(flat), 3):
        member, since, details = flat[i], flat[i + 1], flat[i + 2]
        if not details:
            continue
        of, _, member = member.partition("/") if ws is None else (ws, "", member)
        sid, _, rid = member.partition("/")
        owner, _, value = details.partition("\n")
        found.append(AttentionEntry(of, sid, None if rid == "!" else rid, int(since), owner, value))
    return found
