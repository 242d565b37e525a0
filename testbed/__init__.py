"""The test bed: the real parts the tests and the benchmarks run acp-state on.

Its own Redis servers and clusters on free ports (`redis_server`), the one wrapper of an
`acp-state` worker or API process (`processes`) and the fork server it starts them from
(`forkserver`), the scripted model endpoint real agents talk to offline (`model_endpoint`;
Qwen Code's launch on it: `qwen`), the bed of hosts in network namespaces (`hosts`) and
the fault proxy between them and Redis (`fault_proxy`).

`tests/` and `bench/` import it; production code never does (scripts/import_graph.py). Like
them it is not installed: it is imported from the checkout (pytest and `python -m` run from
the repository's root; the processes it starts get the root as their PYTHONPATH), so the
image (Dockerfile) and an installed acp-state carry none of it.
"""
