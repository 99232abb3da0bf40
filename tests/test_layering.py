"""The modules of qvld/ and qvlctl/ import one another without a cycle, counting every
import statement: at module level, inside functions (lazy) and under TYPE_CHECKING."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("qvld", "qvlctl")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[:len(anchor) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                # `from pkg import mod` imports the module pkg.mod when there is one.
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                           for alias in node.names]
            for target in targets:
                # The deepest module of ours that the dotted name names.
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_graph_sees_lazy_imports() -> None:
    graph = import_graph()
    assert "qvld.engine.model.openvino" in graph["qvld.engine.model.backend"]  # imported lazily
    assert "qvld.app" in graph["qvld.cli"]  # imported inside main()


def test_no_import_cycles() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_a_cycle_would_be_found() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# Modules outside the engine that it may import: the base everything stands on, and the
# wire protocol's limits (a leaf: no I/O, no engine).
ENGINE_BASE = {"qvld", "qvld.config", "qvld.errors", "qvld.fairqueue", "qvld.protocol"}


def test_the_engine_imports_nothing_above_it() -> None:
    """qvld/engine/ is used by the handlers, fronts and daemon, never the reverse."""
    graph = import_graph()
    up = {f"{name} -> {target}" for name, targets in graph.items()
          if name.startswith("qvld.engine") for target in targets
          if not target.startswith("qvld.engine") and target not in ENGINE_BASE}
    assert not up, sorted(up)


# The engine's rooms, lowest first: each imports only the rooms before it (and itself).
# The modules directly in qvld/engine/ are its front (Engine, the runners, the slot
# workers, the public types), above every room.
ENGINE_ROOMS = ("qvld.engine.model", "qvld.engine.decoding", "qvld.engine.inputs",
                "qvld.engine.loop")


def engine_room(name: str) -> int:
    """The rank of the room holding engine module ``name`` (the front ranks last)."""
    for rank, room in enumerate(ENGINE_ROOMS):
        if name == room or name.startswith(room + "."):
            return rank
    return len(ENGINE_ROOMS)


def test_the_engine_rooms_point_one_way() -> None:
    """model <- decoding <- inputs <- loop <- the front: no import back up a room."""
    graph = import_graph()
    rooms = {name for name in graph if name.startswith("qvld.engine.")}
    assert {engine_room(name) for name in rooms} == set(range(len(ENGINE_ROOMS) + 1))
    up = {f"{name} -> {target}" for name in rooms for target in graph[name]
          if target.startswith("qvld.engine") and engine_room(target) > engine_room(name)}
    assert not up, sorted(up)


def test_a_room_import_back_up_would_be_found() -> None:
    assert engine_room("qvld.engine.model.openvino") < engine_room("qvld.engine.loop.blocks")
    assert engine_room("qvld.engine.loop.step_loop") < engine_room("qvld.engine.runners")


def test_the_scheduler_is_a_policy_over_data() -> None:
    """The scheduler, the block pool and the sequence import no runtime, no runner and
    no loop, and the scheduler starts or locks nothing: it is tested without a model."""
    graph = import_graph()
    allowed = {"qvld.engine.loop.blocks", "qvld.engine.loop.sequence",
               "qvld.engine.decoding.generation", "qvld.engine.decoding.constraints",
               "qvld.engine.decoding.sampling", "qvld.engine.model.interface",
               "qvld.engine.model.tokenizer", *ENGINE_BASE}
    for name in ("qvld.engine.loop.scheduler", "qvld.engine.loop.blocks",
                 "qvld.engine.loop.sequence"):
        assert graph[name] <= allowed, (name, sorted(graph[name] - allowed))
    path = ROOT / "qvld" / "engine" / "loop" / "scheduler.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    assert not imported & {"threading", "asyncio", "concurrent.futures"}


# The engine's front (#45): all that the daemon, the handlers and the HTTP and socket
# fronts may use of an Engine. Anything else (its sessions store, spec, models, step
# loop) is the engine's own.
ENGINE_FRONT = frozenset({
    "prepare", "submit", "submit_choices", "cancel", "tokenize", "generations", "counts",
    "stats", "batch_stats", "served", "preemptions", "warmup", "reconfigure", "close",
    "session_count", "list_sessions", "close_session", "close_user_sessions",
    "inherit_sessions", "infer_stuck", "compiles_beside_prefill",
})
FRONTS = ("qvld/app.py", "qvld/handlers.py", "qvld/server.py", "qvld/prepare.py",
          "qvld/cli.py", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "qvld/http")
                                 .rglob("*.py")))


def _is_an_engine(node: ast.expr) -> bool:
    """``engine``, ``old_engine``, ``self.engine``, ``state.engine``, ``self.state.engine``:
    an Engine (``config.engine`` is a config section, not one)."""
    if isinstance(node, ast.Name):
        return node.id in ("engine", "old_engine")
    if isinstance(node, ast.Attribute) and node.attr == "engine":
        owner = node.value
        return (isinstance(owner, ast.Name) and owner.id in ("self", "state")) or \
            (isinstance(owner, ast.Attribute) and owner.attr == "state")
    return False


def engine_uses(source: str) -> set[str]:
    return {node.attr for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and _is_an_engine(node.value)}


def test_the_fronts_use_only_the_engines_front() -> None:
    beyond = {path: sorted(engine_uses((ROOT / path).read_text()) - ENGINE_FRONT)
              for path in FRONTS}
    assert {p: used for p, used in beyond.items() if used} == {}
    assert engine_uses("engine.sessions.list(1)\nx = self.state.engine.spec.name\n"
                       "y = config.engine.max_images") == {"sessions", "spec"}
