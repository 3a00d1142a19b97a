"""experiments/README.md's claims table and each lab page's results list are written from the labs' summary.json by
`python experiments/lab_summary.py --pages`, between markers, every cell's word by lab_summary.verdict: written
afresh here, they must equal the pages; and outside the markers a page holds no number of those lists."""
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import lab_summary  # noqa: E402

PAGES = lab_summary.pages()


@pytest.mark.parametrize("path", sorted(PAGES), ids=[os.path.relpath(p, ROOT) for p in sorted(PAGES)])
def test_the_pages_lists_are_what_the_summaries_write(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for name, block in PAGES[path].items():
        assert lab_summary.between(text, name) == block, (
            f"{os.path.relpath(path, ROOT)}: the {name} is stale: python experiments/lab_summary.py --pages")


@pytest.mark.parametrize("path", sorted(PAGES), ids=[os.path.relpath(p, ROOT) for p in sorted(PAGES)])
def test_no_number_of_a_list_stands_outside_its_markers(path):
    """A mean and its interval as the lists print them stand inside the markers only."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    outside = text
    for name in PAGES[path]:
        begin, end = lab_summary.BEGIN.format(name), lab_summary.END.format(name)
        outside = outside[:outside.index(begin)] + outside[outside.index(end) + len(end):]
    interval = r"[+−]\d\.\d{3} \[[+−]\d\.\d{3}, [+−]\d\.\d{3}\]"
    listed = {m for block in PAGES[path].values() for m in re.findall(interval, block)}
    prose = re.sub(r"^\|.*$", "", outside, flags=re.M)  # tables are the lab's own tables, not prose
    restated = sorted(m for m in listed if m in prose)
    assert not restated, f"{os.path.relpath(path, ROOT)} restates outside its markers: {restated}"


def test_verdict_names_each_case_by_the_rule():
    v = lab_summary.verdict
    assert v([[0.021, 0.052]], 0.00013, 0.05 / 12) == "above"
    assert v([[-0.031, -0.002]], 0.025, 0.05 / 12) == "below at 95% only"
    assert v([[0.001, 0.01]], 1e-6, None) == "above at 95% only"  # a family read at 95%
    assert v([[-0.004, 0.005]], 0.9, 0.05 / 16, detectable=0.006) == "level"
    assert v([[-0.010, 0.001]], 0.12, 0.05 / 16, detectable=0.008) == "not resolved"
    assert v([[-0.05, -0.016], [-0.051, -0.028]], 0.00558, 0.05 / 9) == "below at 95% only"  # on the threshold
    assert v([[0.008, 0.073], [-0.014, 0.088]], 0.12, 0.05 / 9) == "not resolved"  # one interval reaches 0


def test_a_threshold_is_printed_to_the_digits_that_decide_it():
    digits = lab_summary.threshold_digits
    assert digits(0.05 / 9) == "0.00556" and digits(0.05 / 12) == "0.00417" and digits(0.05 / 16) == "0.00313"
    assert digits(0.05 / 6) == "0.008333"  # 0.00833 would read a printed p of 0.00833 as not passing
    assert digits(0.05 / 8) == "0.00625" and digits(0.05 / 4) == "0.0125"


def test_the_readmes_evidence_numbers_are_the_claims_tables():
    """The README's table of evidence keeps a few headline numbers; each is read here from its home, the claims table
    that lab_summary writes from the labs' summary.json, so a changed summary cannot leave the README behind."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    table = readme[readme.index("| the paper's claim | first lab"):].split("\n\n")[0]
    home = lab_summary.pages()[lab_summary.README]["claims table"]
    numbers = re.findall(r"[+−]\d\.\d{3}", table)
    assert len(numbers) >= 6, numbers
    missing = [n for n in numbers if n not in home]
    assert not missing, f"README's evidence table holds numbers its home does not: {missing}"
    for word in ("below PPO, −0.025", "− PPO +0.043 [+0.012, +0.073] at 95% only"):
        assert word in table
    assert "below: − PPO −0.025" in home and "above at 95% only: − PPO +0.043 [+0.012, +0.073]" in home
