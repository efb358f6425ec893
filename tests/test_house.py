"""The house rules the code is held to: no function or method in scripts/ over MAX_LINES lines (its def line to its
last, decorators aside), so each reads on one screen and its parts have names."""
import ast

from conftest import ROOT

SCRIPTS = ROOT / "scripts"
MAX_LINES = 60


def functions(tree: ast.AST, prefix: str):
    """Every function and method in `tree`, nested ones included, as (dotted name, node)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}.{node.name}"
            if not isinstance(node, ast.ClassDef):
                yield name, node
            yield from functions(node, name)
        else:
            yield from functions(node, prefix)


def long_functions() -> dict[str, int]:
    out = {}
    for path in sorted(SCRIPTS.rglob("*.py")):
        module = str(path.relative_to(SCRIPTS).with_suffix("")).replace("/", ".")
        for name, node in functions(ast.parse(path.read_text(), str(path)), module):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_LINES:
                out[name] = lines
    return out


def test_no_function_is_over_the_limit():
    over = long_functions()
    assert not over, f"over {MAX_LINES} lines: " + ", ".join(f"{k} ({v})" for k, v in sorted(over.items()))

