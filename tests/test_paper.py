"""docs/paper.md: the facts about the paper's two versions that a later edit could silently undo.

v1's headline pass@256 numbers are its Table 2's AIME 2024 cells (AIME 2025's margins are others); β's values per
version; v2's reset of π_ref has two halves, the weights and the optimizer, and pacs.py does both."""
import dataclasses
import os
import re

import pytest
import torch

import eval as ev
import pacs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "paper.md")


def page():
    with open(PAGE, encoding="utf-8") as f:
        return f.read()


def table(first_header):
    """{first cell: [the other cells]} of the page's markdown table whose first header cell is first_header."""
    lines = page().splitlines()
    starts = [i for i, line in enumerate(lines[:-1])  # a header: the line above a |---| separator
              if lines[i + 1].startswith("|---") and cells(line)[0] == first_header]
    assert len(starts) == 1, f"docs/paper.md: {len(starts)} tables headed {first_header!r}, expected 1"
    rows = {}
    for line in [lines[starts[0]]] + lines[starts[0] + 2:]:
        if not line.startswith("|"):
            break
        row = cells(line)
        rows[row[0]] = row[1:]
    return rows


def cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def number(text):
    """'+13.32', '−2.77' (a minus sign) or '59.78' -> float."""
    return float(text.replace("−", "-").replace("+", ""))


def numbers(text):
    return {float(x) for x in re.findall(r"\d+(?:\.\d+)?", text)}


# ---- v1's headline: the AIME 2024 column -------------------------------------------------------------------
def test_v1_headline_numbers_are_the_aime_2024_cells_of_table_2():
    t = table("v1 Table 2, Qwen2.5-7B, pass@256")
    columns = t["v1 Table 2, Qwen2.5-7B, pass@256"]
    assert columns == ["AIME 2024", "AIME 2025", "AMC 23"]
    cell = {(row, col): number(t[row][j]) for row in t if row != "v1 Table 2, Qwen2.5-7B, pass@256"
            for j, col in enumerate(columns)}
    # the abstract's 59.78, +13.32 over PPO and +14.36 over GRPO: v1 Table 2's AIME 2024 cells
    assert cell["PACS", "AIME 2024"] == 59.78
    assert (cell["PPO", "AIME 2024"], cell["GRPO", "AIME 2024"], cell["base", "AIME 2024"]) == (46.46, 45.42, 62.55)
    assert (cell["PACS − PPO", "AIME 2024"], cell["PACS − GRPO", "AIME 2024"]) == (13.32, 14.36)
    assert cell["base", "AIME 2024"] > cell["PACS", "AIME 2024"]  # the base model is above PACS there
    # on AIME 2025 the margins are others
    assert (cell["PACS", "AIME 2025"], cell["PPO", "AIME 2025"], cell["GRPO", "AIME 2025"]) == (58.22, 42.91, 46.45)
    assert (cell["PACS − PPO", "AIME 2025"], cell["PACS − GRPO", "AIME 2025"]) == (15.31, 11.77)
    for col in columns:  # every margin row is its two cells' difference
        for other in ("PPO", "GRPO", "base"):
            assert cell[f"PACS − {other}", col] == pytest.approx(cell["PACS", col] - cell[other, col], abs=0.005)


def test_every_line_quoting_the_headline_margins_names_aime_2024():
    """The abstract's sentence says "AIME 2025": wherever the page gives 13.32 or 14.36, it says which set it is."""
    quoting = [line for line in page().splitlines() if "13.32" in line or "14.36" in line]
    assert quoting
    paragraphs = page().split("\n\n")
    for line in quoting:
        paragraph = next(p for p in paragraphs if line in p)
        assert "AIME 2024" in paragraph, f"docs/paper.md gives the v1 headline without its set: {line!r}"


# ---- β per version ----------------------------------------------------------------------------------------
def test_beta_per_version_and_pacs_py_default():
    t = table("β")
    assert t["β"] == ["official code", "paper v1", "paper v2", "`pacs.py`"]
    code, v1, v2, ours = t["set to"]
    assert numbers(code) == {1.0, 2.0}  # pacs_beta_1.0.sh, pacs_beta_2.0.sh
    assert numbers(v2) == {1.0}  # v2 Sec. 4.1 and 5.1: beta = 1 chosen
    assert numbers(t["ablated"][2]) == {0.1, 0.5, 1.0, 2.0, 10.0}  # v2 Sec. 5.1, Fig. 4
    assert not numbers(v1) and not numbers(t["ablated"][1])  # v1's body text: not among the sources
    assert numbers(ours) == {pacs.Config().beta} == {1.0}
    text = page()
    assert "pacs_beta_2.0.sh" in t["source"][0]
    assert not re.search(r"β = 2[^.|]*\bthe paper'?s\b", text)  # beta = 2 is a script, not the paper's setting


# ---- v2's reset: the weights and the optimizer ----------------------------------------------------------------
def test_the_reset_has_both_halves_on_the_page():
    t = table("half of the reset")
    assert set(t) == {"half of the reset", "the weights", "the optimizer"}
    assert "π_ref" in t["the weights"][0] and "snapshot of πθ" in t["the weights"][0]
    assert "re-initialised" in t["the optimizer"][0]
    assert "AdamW" in t["the optimizer"][1]
    summary = table("method")  # the method table: the optimizer half again, beside the code's none
    assert summary["and at a reset"][1] == "optimizer states re-initialised"
    flags = table("flag")
    assert flags["`--ref-reset-every`"][0] == str(pacs.Config().ref_reset_every) == "1"
    assert flags["`--ref-reset-optimizer`"][0] == "on" and pacs.Config().ref_reset_optimizer is True


def test_pacs_py_resets_both_halves():
    """What the page says pacs.py does at a reset (--ref-reset-every K): pi_ref <- pi_theta and AdamW cleared."""
    torch.manual_seed(0)
    model, ref = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)

    def train():
        model(torch.randn(4, 3)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))

    cfg = dataclasses.replace(pacs.Config(), ref_reset_every=3)
    train()
    assert pacs.reset_reference(cfg, 1, model, ref, optimizer) is False  # between resets: nothing moves
    assert not same(model, ref) and optimizer.state
    assert pacs.reset_reference(cfg, 3, model, ref, optimizer) is True  # a reset step: both halves
    assert same(model, ref) and not optimizer.state
    train()
    keep = dataclasses.replace(cfg, ref_reset_optimizer=False)  # --no-ref-reset-optimizer: the weights alone
    assert pacs.reset_reference(keep, 6, model, ref, optimizer) is True
    assert same(model, ref) and optimizer.state


# ---- the page's flags and eval.py's protocol -----------------------------------------------------------------
def test_every_flag_on_the_page_is_a_flag_of_pacs_py_or_eval_py():
    known = set()
    for cls in (pacs.Config, ev.EvalConfig):
        for f in dataclasses.fields(cls):
            known |= {f"--{f.name.replace('_', '-')}", f"--no-{f.name.replace('_', '-')}"}
    named = set(re.findall(r"(--[a-z][a-z-]*)", page()))
    assert named and named <= known, f"docs/paper.md names flags no script has: {sorted(named - known)}"


def test_the_pages_v2_protocol_is_eval_pys():
    t = table("evaluation")
    column = t["evaluation"].index("`eval.py --protocol v2`")
    v2 = ev.PROTOCOLS["v2"]
    assert numbers(t["temperature, top-p"][column]) == {v2["temperature"], v2["top_p"]} == {0.6, 0.95}
    assert numbers(t["samples per problem"][column]) == {v2["n"]} == {128}
    assert number(t["max new tokens"][column].replace(",", "")) == v2["max_new_tokens"] == 8192
    assert max(int(k) for k in v2["k"].split(",")) == 64 and "64" in t["k reported"][column]
    assert v2["datasets"].split(",")[-1] == "beyondaime" and t["sets"][column] == "v2's five"
