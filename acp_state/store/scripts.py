"""Every Lua script of acp-state, rendered from its template in `acp_state/store/lua/`.

Each script declares every key it touches in KEYS (the sharded channels it publishes on
too: a cluster checks their slot like a key's), all of one slot (see keys.py), so each
state transition is one atomic round trip on a single Redis and on a cluster alike. Live
messages go out with SPUBLISH (sharded pub/sub, Redis >= 7.0): on a cluster they stay on
the slot's shard instead of being broadcast to every node, and a single Redis treats them
as ordinary pub/sub. Numbers that must survive Lua's float formatting (timestamps) travel
as strings.

Field names are never written by hand in the Lua: a template says `{{F.OWNER}}` and gets
`'inc'` from `keys.F` here, at import; a name that `keys` does not define fails the import.
Each template's header comment documents its KEYS, ARGV and reply.
"""

from __future__ import annotations

import re
from importlib import resources

from . import keys

# The classes of field names a template may name, as `{{<class>.<NAME>}}`.
FIELD_CLASSES: dict[str, type] = {"F": keys.F, "CLOCK": keys.ClockField, "VER": keys.VersionField}
_PLACEHOLDER = re.compile(r"\{\{(\w+)\.(\w+)\}\}")
_SAFE_NAME = re.compile(r"[a-z:]+")  # quoted as is in Lua: no quote or escape can occur


def _field(match: re.Match[str]) -> str:
    owner, name = match.groups()
    value = getattr(FIELD_CLASSES[owner], name)  # KeyError / AttributeError: not defined
    if not isinstance(value, str) or not _SAFE_NAME.fullmatch(value):
        raise ValueError(f"{owner}.{name} = {value!r} cannot be a Lua field name")
    return f"'{value}'"


def render(template: str) -> str:
    """The template with each field placeholder replaced by its name from `keys`."""
    source = _PLACEHOLDER.sub(_field, template)
    if "{{" in source:
        raise ValueError(f"a placeholder is left unrendered: {source[source.index('{{'):][:40]!r}")
    return source


def template(name: str) -> str:
    """The template text of `acp_state/store/lua/<name>.lua` (package data)."""
    return resources.files(__package__).joinpath("lua", f"{name}.lua").read_text()


def load(name: str, *preludes: str) -> str:
    """A script: its preludes' shared functions, then its own body."""
    return render("".join(template(prelude) for prelude in preludes) + template(name))


# Session-slot scripts (KEYS all carry the workspace's hash tag).
APPLY = load("apply", "changes", "attention", "transition")
SWEEP = load("sweep", "changes", "attention", "transition")
SEND = load("send")
MOVE = load("move", "changes")
VOTE = load("vote", "changes", "attention")
ATTACH = load("attach", "changes")
CLIENT_SEEN = load("client_seen")
DETACH = load("detach", "changes")
PRUNE_CLIENTS = load("prune_clients", "changes")
VERSION = load("version", "changes")
TOLD = load("told", "changes")
CURRENT_TURN = load("current_turn")
LIST = load("list")
RELEASE_SINGLE = load("release_single")
CLAIM_LOAD = load("claim_load")
DELETE_LISTED = load("delete_listed", "changes")
ATTENTION_PAGE = load("attention_page")
ATTENTION_OF = load("attention_of", "attention")

# Registry scripts (KEYS = keys.REGISTRY_KEYS, one slot), run on the lease client.
HEARTBEAT = load("heartbeat", "registry")
CLAIM_DEAD = load("claim_dead", "registry")
RELEASE = load("release")
RESIGN = load("resign", "registry")

# Create and close replies (KEYS: the reply list and its given list).
REPLY = load("reply")
ABANDON = load("abandon", "replies")
TAKE = load("take", "replies")
RECLAIM = load("reclaim", "replies")

# The session id's locator (KEYS: the locator alone, tagged by the session id).
CLAIM_SID = load("claim_sid")

ALL = {
    "APPLY": APPLY, "SWEEP": SWEEP, "SEND": SEND, "MOVE": MOVE, "VOTE": VOTE, "ATTACH": ATTACH, "VERSION": VERSION, "TOLD": TOLD, "CURRENT_TURN": CURRENT_TURN, "LIST": LIST,
    "RELEASE_SINGLE": RELEASE_SINGLE, "CLAIM_LOAD": CLAIM_LOAD, "DELETE_LISTED": DELETE_LISTED, "ATTENTION_PAGE": ATTENTION_PAGE, "ATTENTION_OF": ATTENTION_OF, "HEARTBEAT": HEARTBEAT, "CLAIM_DEAD": CLAIM_DEAD,
    "RELEASE": RELEASE, "RESIGN": RESIGN, "REPLY": REPLY, "ABANDON": ABANDON, "TAKE": TAKE, "RECLAIM": RECLAIM,
    "CLAIM_SID": CLAIM_SID, "CLIENT_SEEN": CLIENT_SEEN, "DETACH": DETACH, "PRUNE_CLIENTS": PRUNE_CLIENTS,
}
