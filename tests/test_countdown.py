"""experiments/countdown.py, the countdown task's checker (right answers in several forms, the target alone, other
numbers, a number twice, none, malformed, a division by zero: each its verdict; None for a chain row), its
canonical forms, and lab.py's countdown task: several right answers per problem, the chain task's build unchanged,
a toy build."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import countdown  # noqa: E402
import lab  # noqa: E402

GOLD = countdown.answer_field([2, 5, 8], 18)  # 'countdown: 2 5 8 -> 18'


def box(expr):
    return f"5-2=3\n3*8=24\n\\boxed{{{expr}}}"


@pytest.mark.parametrize("expr", ["2*5+8", "8+2*5", "5*2+8", "(5*2)+8", "8+(2*5)", "2 × 5 + 8", "((2*5))+8"])
def test_a_right_answer_written_many_ways_scores_true(expr):
    assert countdown.check(box(expr), GOLD) is True


def test_right_answers_of_several_forms_score_true():
    gold = countdown.answer_field([3, 4, 6], 6)  # five forms, as countdown_solutions finds them
    right = ["3*4-6", "(4-3)*6", "6/(4-3)", "6/3+4", "(6-4)*3", "6 ÷ (4 - 3)"]
    assert all(countdown.check(box(e), gold) for e in right)
    assert len({countdown.canonical(e) for e in right}) == 5
    assert set(lab.countdown_solutions([3, 4, 6])[6]) == {countdown.canonical(e) for e in right}
    assert countdown.check(box("6"), gold) is False  # the target, a given number too, alone: not all numbers used


@pytest.mark.parametrize("expr,why", [
    ("18", "the target alone"), ("9+9", "other numbers"), ("2*5+8+0", "an extra number"),
    ("2*5+8*1", "an extra number"), ("2*8+2", "a number twice, one missing"), ("2*5", "a number missing"),
    ("5*5-8+1", "other numbers"), ("2+5+8", "a wrong value"), ("", "no number"), ("()", "no number"),
    ("2*5+", "malformed"), ("2**5+8", "malformed"), ("-2+5+8+7", "a unary minus"), ("2*5+8=18", "an equation"),
    ("2.0*5+8", "a decimal"), ("02*5+8", "a leading zero"), ("(2*5+8", "unclosed"), ("2*5)+8", "unopened"),
    ("8/(5-5)+2", "a division by zero"), ("2/(8-8)*5", "a division by zero"), ("x", "a letter"),
    ("2\\cdot 5+8", "outside the grammar"), ("(" * 30 + "2*5+8" + ")" * 30, "nested too deep"),
    ("2*5" + " " * 300 + "+8", "too long")])
def test_wrong_or_malformed_answers_score_false(expr, why):
    assert countdown.check(box(expr), GOLD) is False, why


def test_what_the_box_rule_reads():
    assert countdown.check("2*5+8", GOLD) is False  # no box
    assert countdown.check("\\boxed{2*5+8", GOLD) is False  # unclosed
    assert countdown.check("\\boxed{18} no, \\boxed{2*5+8}", GOLD) is True  # the last box
    assert countdown.check("\\boxed{2*5+8} so \\boxed{18}", GOLD) is False
    assert countdown.check("\\boxed{2*5+8}, \\boxed{18}", GOLD) is False  # side-by-side boxes are one list
    assert countdown.check(None, GOLD) is False and countdown.check("\\boxed{" + "9" * 10**5 + "}", GOLD) is False


def test_a_chain_row_is_not_the_checkers_and_a_bad_countdown_field_is_one_line():
    assert countdown.check("\\boxed{66}", "66") is None
    assert countdown.check("\\boxed{66}", None) is None
    with pytest.raises(ValueError, match="expected 'countdown: N N N -> TARGET'"):
        countdown.check("\\boxed{1+2}", "countdown: 1, 2 -> 3")
    assert countdown.parse_answer(GOLD) == ([2, 5, 8], 18)
    assert countdown.check("\\boxed{10-2*4}", countdown.answer_field([2, 4, 10], 2)) is True
    assert countdown.check("\\boxed{(2+2)/2}", countdown.answer_field([2, 2, 2], 2)) is True  # a number given twice


def test_canonical_sorts_the_operands_of_plus_and_times_and_nothing_else():
    same = [("(8-5)*6", "6*(8-5)"), ("2+(5+8)", "8+5+2"), ("(2*3)*4", "4*(3 * 2)"), ("12/(2*3)", "12/(3*2)"),
            ("(10+2)-2", "(2+10)-2"), ("((2+5))", "5+2")]
    for a, b in same:
        assert countdown.canonical(a) == countdown.canonical(b), (a, b)
    different = [("8-(5-2)", "8+2-5"), ("6*3", "6+6+6"), ("8-5", "5-8"), ("12/3/2", "12/(3/2)"), ("2*5+8", "2*(5+8)")]
    for a, b in different:
        assert countdown.canonical(a) != countdown.canonical(b), (a, b)
    with pytest.raises(ValueError, match="not a countdown expression"):
        countdown.canonical("2+")


# ---- lab.py's countdown task -------------------------------------------------------------------------------------
SIZES = {"test": 200, "val": 100, "train": 600, "sft": 8000, "chain_sft": 500, "chain_test": 200}


@pytest.fixture(scope="module")
def splits():
    return lab.make_countdown_splits(0, SIZES, 13, 3)


def test_every_countdown_solution_is_right_and_every_rl_problem_has_three_right_answers(splits):
    for split in ("test", "val", "train"):
        forms = lab.countdown_forms(splits[split])
        assert min(forms) >= 3 and sum(forms.values()) == SIZES[split]  # all of them (the task's rule: >= 3)
    assert lab.countdown_forms(splits["test"])[3] < 0.75 * SIZES["test"]  # a quarter have 4 or more
    rows = [r for s in ("test", "val", "train", "sft") for r in splits[s] if r["source"] == lab.COUNTDOWN_SOURCE]
    assert all(countdown.check(r["solution"], r["answer"]) for r in rows)
    assert all(lab.score([r["solution"]], [r["answer"]]).item() == 1.0 for r in splits["chain_test"][:20])


def test_splits_share_no_problem_and_sft_mixes_both_tasks(splits):
    rl = [r["problem"] for s in ("test", "val", "train") for r in splits[s]]
    assert len(set(rl)) == len(rl)
    sft = {r["problem"] for r in splits["sft"]}
    assert not sft & set(rl) and not sft & {r["problem"] for r in splits["chain_test"]}
    sources = [r["source"] for r in splits["sft"]]
    assert sources.count(lab.SOURCE) == SIZES["chain_sft"] and len(sources) == SIZES["sft"] + SIZES["chain_sft"]
    ids = [r["id"] for rows in splits.values() for r in rows]
    assert len(set(ids)) == len(ids)
    # an SFT problem's rows draw among its right answers: more than one form of a problem seen
    by_problem = {}
    for r in splits["sft"]:
        if r["source"] == lab.COUNTDOWN_SOURCE:
            by_problem.setdefault(r["problem"], set()).add(countdown.canonical(r["solution"].split("{")[-1][:-1]))
    assert sum(len(f) > 1 for f in by_problem.values()) > 100
    assert lab.make_countdown_splits(0, SIZES, 13, 3) == splits
    with pytest.raises(lab.LabError, match="with at least 3 right answers"):
        lab.make_countdown_splits(0, {**SIZES, "train": 10**4}, 13, 3)


def test_the_task_switch_leaves_the_chain_task_as_it_was():
    """The first lab's splits hash and tokenizer are those of before the switch: lab.json's sha, 24 tokens."""
    info = json.load(open(os.path.join(lab.SHIPPED, "lab.json")))
    assert lab.splits_sha(lab.splits_for(info["settings"])) == info["splits_sha256"]
    chain, cd = lab.make_tokenizer(), lab.make_tokenizer("countdown")
    assert len(chain) == info["vocab"] == 24 and len(cd) == 30
    assert vars(lab.parse_args(["--out", "x"]))["task"] == "chain"
    text = "What is 63+8-5?"
    assert cd.decode(cd(text)["input_ids"]) == text and len(cd(text)["input_ids"]) == len(chain(text)["input_ids"])


def test_a_toy_countdown_build_runs_end_to_end(tmp_path):
    out = str(tmp_path / "lab3")
    summary = lab.build(lab.parse_args([
        "--out", out, "--task", "countdown", "--seed", "1", "--sft-problems", "200", "--chain-sft-problems", "50",
        "--train-problems", "20", "--val-problems", "8", "--test-problems", "8", "--chain-test-problems", "8",
        "--hidden", "32", "--layers", "1", "--heads", "2", "--max-sft-steps", "4", "--check-every", "2",
        "--check-problems", "4", "--check-n", "2", "--eval-n", "4", "--max-new-tokens", "40", "--sft-batch", "8"]))
    assert set(summary["test_pass@k"]) == set(summary["chain_test_pass@k"]) == {"1", "2", "3", "4"}
    assert sum(summary["test_right_answers"].values()) == 8
    for split in lab.COUNTDOWN_SPLITS:
        assert os.path.isfile(os.path.join(out, f"{split}.jsonl"))
    for split in lab.COUNTDOWN_SPLITS:  # ensure_splits regenerates them from lab.json alone
        os.remove(os.path.join(out, f"{split}.jsonl"))
    lab.ensure_splits(out)
    assert [json.loads(line) for line in open(os.path.join(out, "test.jsonl"))][0]["source"] == lab.COUNTDOWN_SOURCE
