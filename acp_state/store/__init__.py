"""The runtime-state store both sides share: its interface in domain terms, and Redis.

It sits below the core's domain types (commands, turns, events), which it stores; the core
never imports it. Everything outside this package uses only what is imported here: the
protocols (`interface`), the domain types (`types`), `RedisStore` and its connection's few
public facts, the fan-out (live delivery and change feed), what a store error means
(`faults`), the check that the process's Redis user may run what it needs (`acl`), and what every process runs over the store: the lease view
(`WorkerRegistry`) and the sweeper (`run_sweeper`). The key schema (`keys`), the Lua (`scripts`, `lua/`) and redis-py stay inside;
`scripts/import_graph.py` fails the suite when anything else reaches for them.
"""

from __future__ import annotations

from .acl import MissingPermission, check_permissions
from .connection import MEMORY, UnsuitableRedis
from .connection import check as check_redis
from .fanout import Delivery, Fanout, Subscription
from .faults import STORE_ERRORS, is_out_of_memory, is_transient, never_ran, outage_namer
from .interface import LeaseReader, ReaderStore, Store, SweeperStore, WorkerStore
from .redis import RedisStore
from .registry import WorkerRegistry
from .sweeper import run_sweeper
from .types import (
    ABANDONED,
    SESSION_ID_SLOT,
    Admission,
    AdmissionStatus,
    Applied,
    ApplyOutcome,
    AttentionCursor,
    AttentionEntry,
    CatalogRow,
    CatalogVersion,
    Change,
    CreateKey,
    CreateRecord,
    DeadClaims,
    DeleteOutcome,
    EndAdmitted,
    IdClaim,
    LeaseView,
    ListedSession,
    LoadClaim,
    LoadSnapshot,
    Mode,
    PendingInteraction,
    Presence,
    ReplyFate,
    Retention,
    SessionView,
    Standing,
    Transition,
    VoteOutcome,
    WorkerReport,
)

__all__ = [
    "ABANDONED", "SESSION_ID_SLOT", "Admission", "AdmissionStatus", "Applied", "ApplyOutcome", "AttentionCursor", "AttentionEntry", "CatalogRow", "CatalogVersion", "Change",
    "CreateKey", "CreateRecord", "DeadClaims", "DeleteOutcome", "Delivery", "EndAdmitted", "Fanout", "IdClaim",
    "LeaseReader", "LeaseView", "ListedSession", "LoadClaim", "LoadSnapshot", "MEMORY", "MissingPermission", "Mode",
    "PendingInteraction", "Presence", "ReaderStore",
    "RedisStore", "ReplyFate", "Retention", "STORE_ERRORS", "SessionView", "Standing", "Store",
    "Subscription", "SweeperStore", "Transition", "UnsuitableRedis", "VoteOutcome",
    "WorkerRegistry", "WorkerReport", "WorkerStore", "check_permissions", "check_redis", "is_out_of_memory", "is_transient", "never_ran",
    "outage_namer",
    "run_sweeper",
]
