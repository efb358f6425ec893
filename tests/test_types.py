"""The typed core passes mypy: config, the records, judgement/record.py and report.py (the files `make lint` checks,
its TYPED list; the settings are pyproject.toml's [tool.mypy])."""
import importlib.util
import re
import subprocess
import sys

import pytest

from conftest import ROOT


def typed_files() -> list[str]:
    """The Makefile's TYPED list, its globs expanded: the one list `make lint` and this test check."""
    line = re.search(r"^TYPED = (.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert line, "Makefile: no TYPED list"
    files = [str(p.relative_to(ROOT)) for pattern in line[1].split() for p in sorted(ROOT.glob(pattern))]
    assert files and all(f.endswith(".py") for f in files), files
    return files


def test_the_typed_list_holds_config_the_records_record_and_report():
    files = typed_files()
    assert {"scripts/config.py", "scripts/judgement/record.py", "scripts/report.py"} <= set(files)
    assert {f"scripts/records/{p.name}" for p in (ROOT / "scripts" / "records").glob("*.py")} <= set(files)


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                    reason="mypy is not installed (requirements.txt pins it; `make setup` installs it)")
def test_config_the_records_record_and_report_pass_mypy():
    out = subprocess.run([sys.executable, "-m", "mypy", *typed_files()], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, f"mypy found type errors:\n{out.stdout}{out.stderr}"
