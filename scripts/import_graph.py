"""The import graph between rooms and between modules, and the rules it must keep.

    python scripts/import_graph.py [--root PATH] [--rooms-only]

Reads the source (never imports it), so it runs on any checkout: `--root` a `git worktree`
of an older commit prints that commit's graph. Module names are the installed ones: a
folder that pyproject.toml's `[tool.setuptools.package-dir]` maps (`api/` installs as
`acp_state.api`) is named by its mapping. Exits 1, after the graph, when a rule is broken:

* an import cycle among modules (lazy imports inside functions count, and so do imports
  under `if TYPE_CHECKING:`: two modules that name each other's classes, even only in
  annotations, are one design cut in two; the listing marks them `(types)`);
* a break of api/'s wings (`API_WINGS`): a route module (`api/routes/`) importing another;
  a stream module (`api/streams/`, the SSE engine) importing a route, or anything that
  reaches the app state (`api/state.py`, whose `AppState` holds the streams' hubs); a read
  (`api/reads/`, what one process keeps) importing a route or a stream module; anything but
  the app (`APP_MODULES`) importing a route;
* a room importing one it may not (`MAY_IMPORT`: api and worker never import each other,
  the core and the store neither of them, the core not the store either (the store sits
  below the core's domain types: one way), production code nothing of `tests/`, `bench/`
  or `testbed/`, `bench/` nothing of `tests/`, and the test bed (`testbed/`: what tests and
  benchmarks both run on, such as its Redis servers) nothing of either, and only they
  import it);
* a private name (`_name`, or a `_module`) imported from, or read off, another module;
* a test module importing helpers from another test module (they share `tests/helpers.py`;
  importing a `test_*` function to collect it again, as `tests/test_cluster.py` does, is fine);
* an installed top-level package other than `acp_state` (a generic `api` or `worker` in
  site-packages collides with anything else of that name);
* a module over `MAX_LINES` lines, in any room (a module that long holds more than one job:
  split it by job), but for the few in `LONG_MODULES`;
* production code outside the store package (`acp_state/store/`) that reaches past its
  surface: imports one of its modules (`acp_state.store.keys`, `.scripts`, `.redis`, ...)
  rather than `acp_state.store` itself, imports the Redis client (`redis`, `fakeredis`),
  spells a key name (a string starting `acp:`) or spells a field name of the session hash
  or the registry clock (as read from `acp_state/store/keys.py`) where a field is read or
  built: a subscript, `.get(...)`, `in`, or the left of a `+`.
"""

from __future__ import annotations

import argparse
import ast
import sys
import tomllib
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

# Rooms by folder (relative to the repository root); the longest folder that holds a file
# names its room. `acp_state/cli.py`, a module, is not the folder `acp_state/cli/`.
ROOMS = {
    "acp_state": "core",
    "acp_state/store": "store",
    "acp_state/cli": "composition root",
    "acp_state/testing": "testing double",
    "api": "api",
    "worker": "worker",
    "tests": "tests",
    "bench": "bench",
    "testbed": "testbed",
    "scripts": "scripts",
}
PRODUCTION = {"core", "store", "composition root", "testing double", "api", "worker"}
EVERY_ROOM = set(ROOMS.values())
MAY_IMPORT = {
    # One way: the store sits below the core's domain types. It stores the commands, turn
    # records and events the core defines (on the core's clock, metrics and tasks); the core
    # never imports the store. What every process runs over the store (the lease view, the
    # sweeper) lives in the store package, and a command is sent by the store call that
    # carries it. Everything else reaches the store through `acp_state.store` alone.
    "core": {"core"},
    "store": {"core", "store"},
    "api": {"core", "store", "api"},
    "worker": {"core", "store", "worker"},
    "testing double": {"core", "testing double"},
    "composition root": {"core", "store", "api", "worker", "testing double", "composition root"},
    # Tests and tools drive everything; production code never imports them. The tests
    # import the benchmarks' parts (the chaos run's checker), never the other way round.
    # Both run on the test bed (its Redis servers, process wrapper, fork server, model
    # endpoint, hosts, fault proxy), which starts the product's processes and imports
    # neither of them; nothing else imports it.
    "tests": EVERY_ROOM,
    "bench": EVERY_ROOM - {"tests"},
    "testbed": {"core", "store", "composition root", "testing double", "testbed"},
    "scripts": EVERY_ROOM - {"testbed"},
}
INSTALLED_TOP_LEVEL = {"acp_state"}
# No module over this many lines, but for those named here: the chaos run's checker (one
# invariant after another over one history) and the hand-built OpenAPI document (data).
MAX_LINES = 700
LONG_MODULES = {"bench/chaos/checker.py", "api/routes/openapi.py"}
# Only the store package knows Redis: its key schema, its hash fields, its Lua, its client.
STORE_PACKAGE = "acp_state.store"
STORE_KEYS = ("acp_state/store/keys.py", "acp_state/keys.py")  # where the field names are
FIELD_CLASSES = ("F", "ClockField")
REDIS_CLIENTS = {"redis", "fakeredis"}
KEY_PREFIX = "acp:"
# api/ in wings, by job: the routes (one module per route family), the SSE engine, what one
# process keeps in memory; the request plumbing sits beside `app.py`, outside any wing.
API_PACKAGE = "acp_state.api"
API_WINGS = ("routes", "streams", "reads")
API_STATE = "acp_state.api.state"  # AppState: what the lifespan set up, the hubs among it
APP_MODULES = {"acp_state.api.app", "acp_state.api.hot_reads"}  # the app itself: it serves the routes


@dataclass
class Module:
    name: str
    path: Path
    room: str
    is_package: bool
    imports: dict[str, int] = field(default_factory=dict)  # module -> line of its first import
    type_only: set[str] = field(default_factory=set)  # imported only under `if TYPE_CHECKING:`


@dataclass
class Graph:
    modules: dict[str, Module]
    problems: list[str]


def package_dirs(root: Path) -> dict[str, str]:
    """folder -> package name, from pyproject's package-dir (empty when it maps nothing)."""
    pyproject = root / "pyproject.toml"
    if not pyproject.exists():
        return {}
    config = tomllib.loads(pyproject.read_text()).get("tool", {}).get("setuptools", {})
    return {folder.strip("/"): name for name, folder in config.get("package-dir", {}).items() if name}


def room_of(relative: Path) -> str | None:
    folders = [f for f in ROOMS if relative.parts[: len(Path(f).parts)] == Path(f).parts and len(relative.parts) > len(Path(f).parts)]
    return ROOMS[max(folders, key=len)] if folders else None


def module_name(relative: Path, mapping: dict[str, str]) -> str:
    parts = list(relative.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    for folder, package in sorted(mapping.items(), key=lambda item: -len(item[0])):
        prefix = Path(folder).parts
        if tuple(parts[: len(prefix)]) == prefix:
            return ".".join([package, *parts[len(prefix):]])
    return ".".join(parts)


def discover(root: Path) -> dict[str, Module]:
    mapping = package_dirs(root)
    modules: dict[str, Module] = {}
    for folder in sorted({Path(f).parts[0] for f in ROOMS}):
        for path in sorted((root / folder).rglob("*.py")):
            relative = path.relative_to(root)
            room = room_of(relative)
            # (node_modules: npm packages installed for the tests carry Python of their own)
            if room is None or any(part.startswith(".") or part == "node_modules" for part in relative.parts):
                continue
            name = module_name(relative, mapping)
            modules[name] = Module(name, path, room, path.name == "__init__.py")
    return modules


def resolve(module: Module, level: int, target: str | None) -> str:
    """The absolute name a relative import (`from ..x import y`) refers to."""
    if level == 0:
        return target or ""
    base = module.name.split(".")
    if not module.is_package:
        base.pop()
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, *([target] if target else [])])


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def field_names(root: Path) -> set[str]:
    """The hash field names (and field-name prefixes) the store's key schema defines."""
    for relative in STORE_KEYS:
        path = root / relative
        if path.exists():
            tree = ast.parse(path.read_text(), str(path))
            return {
                node.value.value
                for cls in tree.body if isinstance(cls, ast.ClassDef) and cls.name in FIELD_CLASSES
                for node in cls.body
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            }
    return set()


def outside_store(module: Module) -> bool:
    return module.room in PRODUCTION and not (module.name == STORE_PACKAGE or module.name.startswith(STORE_PACKAGE + "."))


def _field_reads(tree: ast.AST) -> list[ast.Constant]:
    """String constants where a hash field would be read or built."""
    found: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript):
            found.append(node.slice)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if node.func.attr in ("get", "pop", "hget", "hdel", "hset", "hexists", "setdefault"):
                found.append(node.args[0])
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            found.append(node.left)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            found.append(node.left)
    return [n for n in found if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def scan_store_boundary(module: Module, tree: ast.AST, fields: set[str], problems: list[str]) -> None:
    """The store package's rule, for production code outside it."""
    where = module.path.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            names = []
        for name in names:
            if name.split(".")[0] in REDIS_CLIENTS:
                problems.append(f"store boundary: {module.name} imports the Redis client {name} ({where}:{node.lineno})")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(KEY_PREFIX):
            problems.append(f"store boundary: {module.name} spells a key name {node.value!r} ({where}:{node.lineno})")
    for constant in _field_reads(tree):
        if constant.value in fields:
            problems.append(
                f"store boundary: {module.name} spells the hash field {constant.value!r} ({where}:{constant.lineno})"
            )


def scan(module: Module, modules: dict[str, Module], problems: list[str], fields: set[str] | None = None) -> None:
    tree = ast.parse(module.path.read_text(), str(module.path))
    where = f"{module.path.name}"
    if fields is not None and outside_store(module):
        scan_store_boundary(module, tree, fields, problems)
    aliases: dict[str, str] = {}  # a local name bound to one of our modules -> that module

    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for inner in ast.walk(node)
    }
    runtime: set[str] = set()

    def edge(target: str, line: int) -> None:
        if target == module.name:
            return
        module.imports.setdefault(target, line)
        if id(current) not in typing_only:
            runtime.add(target)

    for node in ast.walk(tree):
        current = node
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    edge(alias.name, node.lineno)
                    aliases[alias.asname or alias.name] = alias.name
                    if any(private(part) for part in alias.name.split(".")):
                        problems.append(f"private module: {module.name} imports {alias.name} ({where}:{node.lineno})")
        elif isinstance(node, ast.ImportFrom):
            source = resolve(module, node.level, node.module)
            if source not in modules:
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in modules:  # `from package import module`
                    edge(submodule, node.lineno)
                    aliases[alias.asname or alias.name] = submodule
                else:
                    edge(source, node.lineno)
                if private(alias.name) and source != module.name:
                    problems.append(
                        f"private name: {module.name} imports {alias.name} from {source} ({where}:{node.lineno})"
                    )
                if (
                    module.room == "tests" and source.startswith("tests.test_")
                    and not alias.name.startswith("test_") and submodule not in modules
                ):
                    problems.append(
                        f"test helper shared between test modules: {module.name} imports {alias.name} "
                        f"from {source} (helpers live in tests/helpers.py) ({where}:{node.lineno})"
                    )
    module.type_only = set(module.imports) - runtime
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id in aliases and private(node.attr)
        ):
            problems.append(
                f"private name: {module.name} reads {aliases[node.value.id]}.{node.attr} ({where}:{node.lineno})"
            )


def cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        for target in modules[name].imports:
            if target not in index:
                visit(target)
                low[name] = min(low[name], low[target])
            elif target in stack:
                low[name] = min(low[name], index[target])
        if low[name] == index[name]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == name:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for name in sorted(modules):
        if name not in index:
            visit(name)
    return found


def wing(name: str) -> str | None:
    """The api wing a module belongs to (None: beside `app.py`, or not the API's)."""
    parts = name.split(".")
    prefix = API_PACKAGE.split(".")
    if parts[: len(prefix)] != prefix or len(parts) <= len(prefix) + 1 or parts[len(prefix)] not in API_WINGS:
        return None
    return parts[len(prefix)]


def reaches(modules: dict[str, Module], start: str, goal: str) -> bool:
    """Whether `start` imports `goal`, directly or through other modules."""
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name == goal:
            return True
        if name not in seen:
            seen.add(name)
            todo.extend(modules[name].imports)
    return False


def wing_problems(module: Module, modules: dict[str, Module]) -> list[str]:
    """api/'s wing rules for one module's imports (see the docstring)."""
    if module.room != "api":
        return []
    found = []
    own = wing(module.name)
    for target, line in module.imports.items():
        if modules[target].room != "api":
            continue
        where = f"({module.path.name}:{line})"
        other = wing(target)
        if other == "routes" and own == "routes":
            found.append(f"api wings: a route imports another route: {module.name} imports {target} {where}")
        elif other == "routes" and own in ("streams", "reads"):
            found.append(f"api wings: {own} import no route: {module.name} imports {target} {where}")
        elif other == "routes" and own is None and module.name not in APP_MODULES and module.name != API_PACKAGE:
            found.append(f"api wings: only the app imports routes: {module.name} imports {target} {where}")
        elif own == "reads" and other == "streams":
            found.append(f"api wings: reads import no stream module: {module.name} imports {target} {where}")
        elif own == "streams" and API_STATE in modules and reaches(modules, target, API_STATE):
            through = "" if target == API_STATE else f", which reaches {API_STATE}"
            found.append(f"api wings: streams hold no AppState: {module.name} imports {target}{through} {where}")
    return found


def build(root: Path) -> Graph:
    modules = discover(root)
    problems: list[str] = []
    fields = field_names(root)
    for module in modules.values():
        scan(module, modules, problems, fields)
    for module in modules.values():
        for target, line in module.imports.items():
            if outside_store(module) and target.startswith(STORE_PACKAGE + ".") and STORE_PACKAGE in modules:
                problems.append(
                    f"store boundary: {module.name} imports {target}; only {STORE_PACKAGE} itself is its surface "
                    f"({module.path.name}:{line})"
                )
            room = modules[target].room
            if room not in MAY_IMPORT[module.room]:
                problems.append(
                    f"forbidden import: {module.room} -> {room}: {module.name} imports {target} "
                    f"({module.path.name}:{line})"
                )
    for module in modules.values():
        problems.extend(wing_problems(module, modules))
    for component in cycles(modules):
        problems.append(f"import cycle: {' <-> '.join(component)}")
    for module in modules.values():
        relative = module.path.relative_to(root).as_posix()
        lines = len(module.path.read_text().splitlines())
        if lines > MAX_LINES and relative not in LONG_MODULES:
            problems.append(f"size: {relative} has {lines} lines (over {MAX_LINES}: split it by job)")
    generic = sorted({m.name.split(".")[0] for m in modules.values() if m.room in PRODUCTION} - INSTALLED_TOP_LEVEL)
    for name in generic:
        problems.append(f"packaging: installs a top-level package named {name!r} (map its folder under acp_state)")
    return Graph(modules, problems)


def render(graph: Graph, rooms_only: bool = False) -> str:
    modules = graph.modules
    lines = ["rooms (modules) and the rooms each imports (number of module imports):"]
    by_room: dict[str, list[Module]] = defaultdict(list)
    for module in modules.values():
        by_room[module.room].append(module)
    for room in sorted(by_room, key=list(dict.fromkeys(ROOMS.values())).index):
        counts: dict[str, int] = defaultdict(int)
        for module in by_room[room]:
            for target in module.imports:
                if modules[target].room != room:
                    counts[modules[target].room] += 1
        targets = ", ".join(f"{r} ({n})" for r, n in sorted(counts.items())) or "-"
        lines.append(f"  {room} ({len(by_room[room])}) -> {targets}")
    if not rooms_only:
        lines.append("")
        lines.append("modules and the modules each imports:")
        for room in sorted(by_room, key=list(dict.fromkeys(ROOMS.values())).index):
            lines.append(f"  [{room}]")
            for module in sorted(by_room[room], key=lambda m: m.name):
                targets = [f"{t} (types)" if t in module.type_only else t for t in sorted(module.imports)]
                lines.append(f"    {module.name} -> {', '.join(targets) or '-'}")
    lines.append("")
    if graph.problems:
        lines.append(f"{len(graph.problems)} problems:")
        lines.extend(f"  {problem}" for problem in sorted(graph.problems))
    else:
        lines.append(
            "no cycles, no forbidden imports, no private names across modules, nothing of Redis outside the store, "
            f"no module over {MAX_LINES} lines, api/'s wings kept"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="the checkout to read (default: this one)")
    parser.add_argument("--rooms-only", action="store_true", help="leave out the module listing")
    args = parser.parse_args(argv)
    graph = build(args.root.resolve())
    print(render(graph, args.rooms_only))
    return 1 if graph.problems else 0


if __name__ == "__main__":
    sys.exit(main())
