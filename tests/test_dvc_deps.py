"""dvc.yaml tells the truth about inputs: each stage's script deps are exactly its script and the local modules
it imports (transitively), so editing any code a stage runs makes that stage stale, and nothing else does."""
import ast
from pathlib import Path

import yaml

from conftest import ROOT

SCRIPTS = ROOT / "scripts"
MODULES = sorted(str(p.relative_to(SCRIPTS).with_suffix("")).replace("/", ".") for p in SCRIPTS.rglob("*.py"))
PARTS = sorted(p.parent.name for p in SCRIPTS.glob("*/__init__.py"))


def module_file(name: str) -> Path | None:
    """scripts/ file of module `name` ("stats" or "judgement.stats"), or None where it is not ours."""
    f = SCRIPTS / (name.replace(".", "/") + ".py")
    return f if f.is_file() else None


def imported(module: str) -> set[str]:
    """The scripts/ modules `module` imports itself (function-level imports included), dotted, with the package
    (its __init__ runs on import)."""
    tree = ast.parse(module_file(module).read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            packages = [".".join(parts[:i] + ["__init__"]) for i in range(1, len(parts))]
            out |= {m for m in packages + [name] if module_file(m)}
    return out - {module}


def local_imports(module: str, seen: set[str] | None = None) -> set[str]:
    """The scripts/ modules `module` imports, at any depth."""
    seen = set() if seen is None else seen
    if module not in seen:
        seen.add(module)
        for name in imported(module):
            local_imports(name, seen)
    return seen


def as_file(module: str) -> str:
    return "scripts/" + module.replace(".", "/") + ".py"


def stage_module(stage: dict) -> str:
    """The module a dvc.yaml stage runs (`python scripts/bench.py ...` -> "bench")."""
    script = next(w for w in stage["cmd"].split() if w.startswith("scripts/") and w.endswith(".py"))
    return script[len("scripts/"):-3]


def test_every_stage_depends_on_exactly_the_code_it_runs():
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        want = {as_file(m) for m in local_imports(stage_module(stage))}
        deps = {d for d in stage.get("deps") or [] if d.startswith("scripts/")}
        assert deps == want, f"stage {name}: missing {sorted(want - deps)}, not imported {sorted(deps - want)}"


def test_no_module_imports_a_stage_script():
    # a stage is a short script with a main(): what other code needs (a runner, a model's resolution, the machine's
    # facts, a table cell) lives in the parts, so a tool or another stage never stands on a stage's own code, and
    # editing a stage makes only that stage stale. Tests may import a stage to test it
    stages = {stage_module(stage) for stage in yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"].values()}
    assert {"fingerprint", "download", "eval", "bench", "knee", "gate", "report"} <= stages
    importers = {m: sorted(imported(m) & stages) for m in MODULES}
    assert not {m: s for m, s in importers.items() if s}, "modules importing a stage script"


def test_the_import_walk_sees_function_level_imports():
    assert "serving.shape_model" in local_imports("download")  # imported inside a function


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


def test_no_two_modules_import_each_other_at_any_depth():
    # a cycle makes every stage on it depend on all of it, and hides which part of the code a stage stands on
    graph = {m: imported(m) for m in MODULES}
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
    for name in ("fingerprint", "download", "eval_baseline", "eval", "bench", "knee"):
        deps = set(stages[name]["deps"])
        assert not {d for d in deps if d.startswith("scripts/judgement/")}, name
        assert not {"scripts/report.py", "scripts/gate.py", "scripts/fill_capacity.py"} & deps, name


def test_each_part_imports_only_what_its_docstring_allows():
    # scripts/<part>/__init__.py says what the part may import; the rest of scripts/ is the stages and their CLIs
    assert PARTS == ["judgement", "measure", "records", "runner", "serving"]
    for part in PARTS:
        doc = ast.get_docstring(ast.parse((SCRIPTS / part / "__init__.py").read_text()))
        allowed = {w.strip(" .") for w in doc.split("May import:")[1].split(",")} | {part}
        for m in MODULES:
            if m.startswith(part + "."):
                used = {n.split(".")[0] for n in imported(m)}
                assert used <= allowed, f"{m} imports {sorted(used - allowed)}; {part}/ may import {sorted(allowed)}"


def test_only_the_knee_stage_stands_on_the_knee_search():
    # editing the knee search re-measures knees, never a rung's eval, bench or fingerprint; nor does it re-judge or
    # re-render: what the gate and the report read of the knee's measuring is measure/evidence.py's (a leaf)
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        assert ("scripts/measure/probing.py" in stage["deps"]) == (name == "knee"), name


def test_config_and_common_import_nothing_above_them():
    # every stage imports config (through common): whatever they import, every stage stands on. config checks
    # knee.max_prompts by the knee's pass minimum, so it stands on that one leaf, which stands on nothing
    assert imported("config") == {"measure.__init__", "measure.evidence"}
    assert local_imports("measure.evidence") == {"measure.evidence"}
    assert imported("common") == {"config"}
