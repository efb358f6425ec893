"""README and docs/ say the rule in the code's own words, stay short enough to read, and link only to what exists."""
import re

from conftest import ROOT
from judgement import decide, stats

README, METHOD = ROOT / "README.md", ROOT / "docs" / "method.md"


def test_readme_and_the_method_state_the_rule_in_the_codes_own_words():
    assert decide.RULE in README.read_text()
    method = METHOD.read_text()
    assert decide.RULE in method
    assert stats.DELTA_WORDS.replace("Δ vs base: ", "") in method


def test_the_readme_reads_in_two_minutes_quick_start_first():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    assert text.index("make ladder") < text.index("## What a rung is") and "**How long**" in text


def test_every_relative_link_in_readme_and_docs_points_at_a_file_that_exists():
    for doc in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" not in target:
                assert (doc.parent / target).exists(), f"{doc.name}: {target}"
