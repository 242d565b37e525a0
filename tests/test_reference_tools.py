"""The comparison tools of the differential test (`tests/reference.py`), and the list of
deliberate differences it reads (`docs/compatibility.md`). No reference needed."""

from __future__ import annotations

from pathlib import Path

from tests.reference import Exchange, compare, load_allowed, report, shape, undocumented

ROOT = Path(__file__).resolve().parent.parent


def exchange(status: int, body: object, headers: dict[str, str] | None = None, is_json: bool = True) -> Exchange:
    return Exchange(step="idle", route="GET /session/:id/status", status=status, body=body,
                    headers=headers or {"Content-Type": "application/json"}, is_json=is_json)


def test_shape_keeps_structure_and_enum_values_not_ids() -> None:
    one = shape({"sessionId": "a", "state": "idle", "n": 1, "ok": True, "xs": [{"kind": "permission"}],
                 "features": ["b", "a"]})
    other = shape({"sessionId": "b", "state": "idle", "n": 2, "ok": True, "xs": [{"kind": "permission"}],
                   "features": ["a", "b"]})
    assert one == other
    assert one["$.state"] == "string 'idle'" and one["$.ok"] == "boolean true" and one["$.features[a]"] == "member"
    assert shape({"state": "running"})["$.state"] != shape({"state": "idle"})["$.state"]


def test_compare_reports_missing_extra_value_status_header_and_no_route() -> None:
    ref = exchange(200, {"a": {"b": 1}, "state": "idle"}, {"Content-Type": "application/json; charset=utf-8", "ETag": "x"})
    ours = exchange(200, {"state": "running", "c": [1, 2]})
    found = {(d.kind, d.what) for d in compare(ref, ours)}
    assert found == {("missing", "$.a"), ("extra", "$.c"), ("value", "$.state"),
                     ("header", "header:Content-Type"), ("header", "header:ETag")}
    assert [d.kind for d in compare(exchange(202, {}), exchange(200, {}))] == ["status"]
    assert [d.kind for d in compare(exchange(200, {}), exchange(404, "Not Found", is_json=False))] == ["no_route"]


def test_the_compatibility_list_parses_and_allows_what_it_lists() -> None:
    rules = load_allowed(ROOT / "docs" / "compatibility.md")
    assert rules
    diffs = compare(exchange(404, {"error": "x"}), exchange(404, {"error": "x", "code": "session_not_found"}))
    assert undocumented(diffs, rules) == []
    diffs = compare(exchange(404, {"error": "x"}), exchange(404, {"error": "x", "other": 1}))
    assert len(report(undocumented(diffs, rules))) == 2  # a heading and the line
