"""The committed state is true (docs/method.md: What is committed): no run's outputs are tracked, so a fresh clone's
`dvc status` names every stage as not run there; each committed example names the commit that made it."""
import json
import re
import subprocess

import pytest
import yaml

from conftest import ROOT

RUN_OUTPUTS = ["dvc.lock", "report/before_after.md", "report/knee.png", "report/rungs.png", "report/pareto.png",
               "report/ladder.json"]


def git(*args, cwd=ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def tracked() -> set[str]:
    try:
        return set(git("ls-files").split("\n"))
    except (subprocess.CalledProcessError, FileNotFoundError):
        pytest.skip("not a git checkout")


def test_no_run_output_is_committed(tracked):
    assert not [f for f in RUN_OUTPUTS if f in tracked]
    assert not [f for f in tracked if f.startswith("results/") and not f.endswith((".gitkeep", ".gitignore"))]


def test_dvc_lock_is_not_ignored_so_experiments_can_save_it():
    """DVC refuses `dvc exp run` with a git-ignored dvc.lock ('is git-ignored'): it must stay trackable."""
    p = subprocess.run(["git", "check-ignore", "-q", "dvc.lock"], cwd=ROOT)
    assert p.returncode == 1  # 1: not ignored


def test_a_fresh_clone_s_dvc_status_names_every_stage(tmp_path):
    clone = tmp_path / "clone"
    git("clone", "-q", str(ROOT), str(clone))
    p = subprocess.run(["dvc", "status", "--json"], cwd=clone, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    status = json.loads(p.stdout)
    stages = set(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"])
    assert set(status) == stages, set(stages) ^ set(status)  # nothing ran here: none claims to be up to date


def test_each_example_names_the_commit_that_made_it(tracked):
    readme = (ROOT / "README.md").read_text()
    # each one README lists: the H100 check ladders (docs/method.md: What is committed)
    examples = sorted(f for f in tracked if f.startswith("report/examples/") and f.endswith(".md"))
    shallow = git("rev-parse", "--is-shallow-repository").strip() == "true"
    for ex in examples:
        m = re.search(rf"\[`{re.escape(ex)}`\]\({re.escape(ex)}\) \(commit ([0-9a-f]{{7,40}})", readme)
        assert m, f"README names no commit for {ex}"
        if not shallow:
            assert git("cat-file", "-t", m.group(1)).strip() == "commit", m.group(1)


def test_each_example_is_what_today_s_report_renders_from_its_record(tracked, tmp_path):
    """An example ships only while the code that ships it writes the same report (docs/method.md): its
    before_after.md is today's rendering of the ladder.json beside it (the run's record, kept as it came)."""
    import report
    examples = sorted(f for f in tracked if f.startswith("report/examples/") and f.endswith("/before_after.md"))
    for ex in examples:
        folder = (ROOT / ex).parent
        md = report.render(json.loads((folder / "ladder.json").read_text()), tmp_path / folder.name)
        assert md == (ROOT / ex).read_text(), f"{ex}: re-render it with `python scripts/report.py " \
                                              f"{folder.relative_to(ROOT)}/ladder.json {folder.relative_to(ROOT)}`"
