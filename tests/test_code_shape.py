"""The size rule: no function or method in smartspec/, deployments/ or scripts/ runs over MAX_LINES lines (its
decorators, signature, docstring and body), so each part has one job and reads on one screen. Read from the
source, as the layering test reads imports."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 50
FOLDERS = ("smartspec", "deployments", "scripts")


def long_functions(source: str, max_lines: int = MAX_LINES) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of every function in `source` longer than max_lines."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            lines = node.end_lineno - first + 1
            if lines > max_lines:
                out.append((node.name, first, lines))
    return out


def test_no_function_is_over_fifty_lines():
    found = [f"{path.relative_to(ROOT)}:{line} {name} ({lines} lines)"
             for folder in FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))
             for name, line, lines in long_functions(path.read_text())]
    assert not found, "functions over 50 lines (split them into parts of one job each):\n" + "\n".join(found)


def test_a_long_function_is_caught():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    assert long_functions(f"def f():\n{body}\n") == [("f", 1, MAX_LINES + 1)]
    method = "\n".join("    " + line for line in f"@staticmethod\ndef g():\n{body}".splitlines())
    assert long_functions(f"class C:\n{method}\n") == [("g", 2, MAX_LINES + 2)]  # its decorator counted
    assert long_functions("def f():\n    return 1\n") == []
