"""The package's floors, checked from its imports (every import, at module level or inside a function): a room
may import its own floor and the floors below, never one above. The floors are the map in README.md's layout and
ARCHITECTURE.md; a new module must be placed here (an unplaced one fails the test)."""

from __future__ import annotations

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "specloom")

# top to bottom; a name is a top-level module or package of specloom/
FLOORS = [
    ("__main__", "cli"),
    ("bench", "serving", "jobs", "doctor", "export", "quantize"),
    ("__init__", "engine", "scheduler"),
    ("depth", "cost", "cost_refresh", "speculative"),
    ("step",),
    ("drafters",),
    ("training",),
    ("models", "loading", "kv", "kv_quant", "tree", "verify", "sampling", "penalties", "constraint", "results", "host",
     "tokenizer", "chat_plain", "behaviour", "fingerprint", "prompts", "config", "config_fields", "moe_config"),
    ("errors", "atomic"),
]
FLOOR = {name: i for i, names in enumerate(FLOORS) for name in names}


def _imports():
    """(importing module's room, imported room, where) for every specloom import in specloom/."""
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, ROOT).split(os.sep)
            room = rel[0][:-3] if len(rel) == 1 else rel[0]
            package = rel[:-1]  # the importing module's package, below specloom/
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, ast.ImportFrom) and node.level:
                    base = package[:len(package) - node.level + 1] if node.level > 1 else package
                    parts = base + (node.module.split(".") if node.module else [a.name for a in node.names][:1])
                    target = parts[0] if parts else "__init__"
                elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("specloom"):
                    target = (node.module.split(".") + ["__init__"])[1]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names if a.name.startswith("specloom")]
                    if not names:
                        continue
                    target = (names[0].split(".") + ["__init__"])[1]
                else:
                    continue
                yield room, target, f"{'/'.join(rel)}:{node.lineno}"


def test_every_room_is_on_a_floor():
    rooms = {n[:-3] if n.endswith(".py") else n for n in os.listdir(ROOT)
             if (n.endswith(".py") or os.path.isdir(os.path.join(ROOT, n))) and n not in ("__pycache__", "bundled")}
    assert sorted(rooms - set(FLOOR)) == []


def test_imports_point_down():
    up = [f"{where}: {room} (floor {FLOOR[room]}) imports {target} (floor {FLOOR[target]})"
          for room, target, where in _imports() if FLOOR.get(target, 99) < FLOOR[room]]
    assert up == []


def test_the_core_never_imports_serving_bench_jobs_or_cli():
    core = {n for names in FLOORS[2:] for n in names}
    bad = [f"{where}: {target}" for room, target, where in _imports()
           if room in core and target in ("serving", "bench", "jobs", "cli")]
    assert bad == []
