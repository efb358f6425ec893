"""dvc.yaml tells the truth about inputs: each stage's script deps are exactly its script and the local modules
it imports (transitively), so editing any code a stage runs makes that stage stale, and nothing else does."""
import ast

import yaml
from conftest import ROOT

SCRIPTS = ROOT / "scripts"


def local_imports(module: str, seen: set[str] | None = None) -> set[str]:
    """The scripts/ modules `module` imports, at any depth (function-level imports included)."""
    seen = set() if seen is None else seen
    if module in seen:
        return seen
    seen.add(module)
    tree = ast.parse((SCRIPTS / f"{module}.py").read_text())
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
        for name in names:
            top = name.split(".")[0]
            if (SCRIPTS / f"{top}.py").exists():
                local_imports(top, seen)
    return seen


def test_every_stage_depends_on_exactly_the_code_it_runs():
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        script = next(w for w in stage["cmd"].split() if w.startswith("scripts/") and w.endswith(".py"))
        want = {f"scripts/{m}.py" for m in local_imports(script[len("scripts/"):-3])}
        deps = {d for d in stage.get("deps") or [] if d.startswith("scripts/")}
        assert deps == want, f"stage {name}: missing {sorted(want - deps)}, not imported {sorted(deps - want)}"


def test_the_import_walk_sees_function_level_imports():
    assert "shape_model" in local_imports("download")  # imported inside a function


def test_the_measuring_stages_list_every_setting_of_their_sections_but_the_judgements():
    # a setting left out would not make its stage stale when edited; a judgement threshold listed would re-measure
    import config
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    sections = {"bench": config.Bench, "knee": config.Knee}
    for name in ("bench", "knee"):
        listed = set(stages[name]["params"])
        own = {f"{name}.{f}" for f in sections[name].model_fields}
        assert listed & own == own - set(config.JUDGEMENT), name
        assert not listed & set(config.JUDGEMENT), name
        assert "gate" not in listed and "gate.measure_failed" in listed, name
    # DVC refuses to run a stage whose listed param params.yaml does not hold, even one the config defaults
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for name, stage in stages.items():
        for dotted in stage.get("params") or []:
            node = params
            for part in dotted.split("."):
                assert isinstance(node, dict) and part in node, f"stage {name}: {dotted} is not in params.yaml"
                node = node[part]


def direct_imports(module: str) -> set[str]:
    """The scripts/ modules `module` imports itself (function-level imports included)."""
    tree = ast.parse((SCRIPTS / f"{module}.py").read_text())
    out = set()
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
        out |= {n.split(".")[0] for n in names if (SCRIPTS / f"{n.split('.')[0]}.py").exists()}
    return out - {module}


def test_no_two_modules_import_each_other_at_any_depth():
    # a cycle makes every stage on it depend on all of it, and hides which part of the code a stage stands on
    graph = {p.stem: direct_imports(p.stem) for p in SCRIPTS.glob("*.py")}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt, path + [nxt])
        done.add(node)
    done: set[str] = set()
    for m in sorted(graph):
        if m not in done:
            visit(m, [m])
    assert not cycles, cycles


def test_no_measuring_stage_stands_on_the_judgement_or_the_report():
    # editing how a number is judged or shown re-judges and re-renders; it never measures a rung again
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    judging = {"scripts/stats.py", "scripts/decide.py", "scripts/record.py", "scripts/report.py", "scripts/gate.py",
               "scripts/capacity.py"}
    for name in ("fingerprint", "download", "eval_baseline", "eval", "bench", "knee"):
        assert not judging & set(stages[name]["deps"]), name
