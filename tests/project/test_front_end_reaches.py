"""The front ends read the engine through AsyncLLMEngine's EngineView (server/engine_view.py)
and call it through its methods: no module under server/ reaches past it into the engine
object it wraps (`x.engine.engine...`), except the modules that are AsyncLLMEngine."""

from __future__ import annotations

import ast
import pathlib

SERVER = pathlib.Path(__file__).resolve().parents[2] / "server"
# AsyncLLMEngine and its parts: they hold the engine (self.engine) and are the view.
OWNERS = {"async_engine.py", "engine_calls.py", "engine_view.py"}


def engine_reaches(source: str) -> list[int]:
    """The lines of `<...>.engine.engine` attribute chains in source."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "engine":
            inner = node.value
            if (isinstance(inner, ast.Attribute) and inner.attr == "engine") or \
                    (isinstance(inner, ast.Name) and inner.id == "engine"):
                lines.append(node.lineno)
    return lines


def test_the_rule_sees_a_reach():
    assert engine_reaches("x = state.engine.engine.scheduler\n") == [1]
    assert engine_reaches("def f(engine):\n    return engine.engine.runner\n") == [2]
    assert engine_reaches("x = state.engine.processor\n") == []


def test_no_front_end_reaches_into_the_engine():
    files = sorted(SERVER.rglob("*.py"))
    assert len(files) > 20, SERVER
    reaches = [f"{path.relative_to(SERVER)}:{line}" for path in files
               if path.name not in OWNERS or path.parent != SERVER
               for line in engine_reaches(path.read_text())]
    assert not reaches, (f"reaches past AsyncLLMEngine into the engine at {reaches}: read "
                         "what a front end needs through server/engine_view.py's EngineView "
                         "(add the property there)")
