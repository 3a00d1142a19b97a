"""experiments/lab_problems.py (each run's correct samples per test problem, from its eval samples; read back by
chain length) and lab_summary.rare_summary (pass@k on the problems the base model rarely solved, paired by seed);
and the committed counts against the result files and the lab's own measurement of its base model."""
import glob
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import lab_problems  # noqa: E402
import lab_summary  # noqa: E402
import sweep  # noqa: E402
from eval import pass_at_k  # noqa: E402


def write_eval(directory, correct, finished=True, seed=0):
    """An eval.py output directory: samples.jsonl with the given correct flags per problem id, and metrics.json
    (written last by eval.py) when finished."""
    os.makedirs(directory)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"seed": seed}, f)
    with open(os.path.join(directory, "samples.jsonl"), "w") as f:
        for pid, flags in correct.items():
            f.write(json.dumps({"dataset": "test", "id": pid, "correct": flags, "responses": ["x"] * len(flags)})
                    + "\n")
    if finished:
        with open(os.path.join(directory, "metrics.json"), "w") as f:
            json.dump({"n": len(next(iter(correct.values())))}, f)


# base: p0 solved 4 of 4, p1 1 of 4, p2 0 of 4 -> the rare problems (<= 1 of 4) are p1 and p2
BASE = {"p0": [1, 1, 1, 1], "p1": [0, 1, 0, 0], "p2": [0, 0, 0, 0]}
FRESH = {"p0": [1, 1, 1, 0], "p1": [0, 1, 1, 0], "p2": [1, 0, 0, 0]}
RUNS = {"pacs-s0": {"p0": [1, 1, 1, 1], "p1": [1, 1, 0, 0], "p2": [0, 0, 0, 1]},
        "pacs-s1": {"p0": [1, 1, 1, 0], "p1": [1, 1, 1, 0], "p2": [0, 0, 0, 0]},
        "grpo-s0": {"p0": [1, 1, 1, 1], "p1": [0, 0, 0, 1], "p2": [0, 0, 0, 0]},
        "grpo-s1": {"p0": [1, 1, 1, 1], "p1": [0, 0, 0, 0], "p2": [0, 0, 0, 0]}}


@pytest.fixture
def sweep_out(tmp_path):
    out = tmp_path / "out"
    write_eval(str(out / "eval_base"), BASE)
    write_eval(str(tmp_path / "fresh" / "eval_base"), FRESH, seed=1)  # the base model again, eval seed 1
    for run, correct in RUNS.items():
        write_eval(str(out / run / "eval-step2"), {p: [0] * 4 for p in correct})  # an earlier eval: not the last
        write_eval(str(out / run / "eval-step10"), correct)
    write_eval(str(out / "ppo-s0" / "eval-step10"), RUNS["grpo-s0"], finished=False)  # still evaluating
    (out / "ppo-s1").mkdir()  # still training
    return out


def test_collect_writes_each_finished_runs_last_eval_and_keeps_what_exists(sweep_out, tmp_path):
    into = tmp_path / "problems-test-p8"
    written = lab_problems.collect([str(sweep_out)], str(into))
    assert sorted(os.path.basename(w) for w in written) == ["base-s0.json", "grpo-s0.json", "grpo-s1.json",
                                                            "pacs-s0.json", "pacs-s1.json"]
    pacs0 = json.load(open(into / "pacs-s0.json"))
    assert pacs0 == {"method": "pacs", "seed": 0, "eval_n": 4, "correct": {"p0": 4, "p1": 2, "p2": 1}}
    assert json.load(open(into / "base-s0.json")) == {"method": "base", "seed": 0, "eval_n": 4,
                                                      "correct": {"p0": 4, "p1": 1, "p2": 0}}
    assert lab_problems.collect([str(sweep_out)], str(into)) == []  # nothing new: nothing rewritten
    write_eval(str(sweep_out / "ppo-s1" / "eval-step10"), RUNS["pacs-s1"])
    results = tmp_path / "test-p8"  # with --results: only runs whose result file is there (they count as done)
    results.mkdir()
    assert lab_problems.collect([str(sweep_out)], str(into), str(results)) == []
    (results / "ppo-s1.json").write_text("{}")
    written = lab_problems.collect([str(sweep_out)], str(into), str(results))
    assert [os.path.basename(w) for w in written] == ["ppo-s1.json"]


def test_collect_refuses_a_missing_directory_and_an_uneven_eval(tmp_path):
    with pytest.raises(SystemExit, match="is not a directory"):
        lab_problems.collect([str(tmp_path / "nowhere")], str(tmp_path / "into"))
    write_eval(str(tmp_path / "out" / "pacs-s0" / "eval-step1"), {"p0": [1, 0], "p1": [1, 0, 0]})
    with pytest.raises(SystemExit, match=r"\[2, 3\] samples per problem"):
        lab_problems.collect([str(tmp_path / "out")], str(tmp_path / "into"))


def test_rare_summary_is_pass_at_k_on_the_problems_the_base_model_rarely_solved(sweep_out, tmp_path):
    into = tmp_path / "problems-test-p8"
    lab_problems.collect([str(sweep_out)], str(into))
    rare = lab_summary.rare_summary(str(into), swept=2, threshold=1)
    assert rare["base"] is None and rare["base_seeds"] == []  # no fresh look at the base model yet
    assert [os.path.basename(w) for w in lab_problems.collect([str(tmp_path / "fresh")], str(into))] == [
        "base-s1.json"]
    rare = lab_summary.rare_summary(str(into), swept=2, threshold=1)
    assert (rare["problems"], rare["of"], rare["eval_n"], rare["threshold"]) == (2, 3, 4, 1)
    # pass@1 is the mean success rate over the rare problems p1 and p2, chosen by the seed-0 samples
    assert rare["base_selection"] == {"pass@1": pytest.approx((1 / 4 + 0) / 2)}
    assert rare["base"] == {"pass@1": pytest.approx((2 / 4 + 1 / 4) / 2)} and rare["base_seeds"] == [1]
    assert {r["method"] for r in rare["runs"]} == {"pacs", "grpo"}  # the base's files are not runs
    by = {(r["method"], r["seed"]): r for r in rare["runs"]}
    assert by["pacs", 0]["pass@1"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert by["pacs", 1]["pass@1"] == pytest.approx((3 / 4 + 0) / 2)
    assert set(by["pacs", 0]) == {"method", "seed", "pass@1"}  # k = 16, 64, 256 exceed n = 4: left out
    (pair,) = [p for p in rare["paired"] if (p["a"], p["b"]) == ("pacs", "grpo")]
    assert pair["seeds"] == 2 and pair["metric"] == "pass@1" and pair["prompts_per_mini_batch"] == 2
    assert pair["mean"] == pytest.approx(((0.375 - 0.125) + (0.375 - 0)) / 2)
    assert {(p["a"], p["b"]) for p in rare["paired"]} == {("pacs", "grpo")}  # no critic-off, PPO or REINFORCE runs
    assert lab_summary.rare_summary(str(tmp_path / "nothing"), swept=2) is None  # no base.json: no "rare"
    with pytest.raises(sweep.SweepError, match="no problem solved by at most"):
        json.dump({"eval_n": 4, "correct": {"p0": 4}}, open(into / "base-s0.json", "w"))
        lab_summary.rare_summary(str(into), swept=2)


def test_rare_summary_needs_every_rare_problem_in_every_run(sweep_out, tmp_path):
    into = tmp_path / "problems-test-p8"
    lab_problems.collect([str(sweep_out)], str(into))
    run = json.load(open(into / "grpo-s1.json"))
    del run["correct"]["p2"]
    json.dump(run, open(into / "grpo-s1.json", "w"))
    with pytest.raises(sweep.SweepError, match="1 of the base model's rare problems have no count"):
        lab_summary.rare_summary(str(into), swept=2)


COMMITTED = sorted(glob.glob(os.path.join(ROOT, "experiments", "labs", "*", "results", "problems-*", "*.json")))


def test_the_committed_counts_agree_with_their_result_files_and_the_base_models_measurement():
    """Every committed count file gives back, by eval.py's estimator, the pass@k its run's result file recorded
    (k = 1, 16 and n); base-s0.json, the pass@k its lab.json recorded for the shipped base model."""
    if not COMMITTED:
        pytest.skip("no lab has committed per-problem counts (experiments/lab_problems.py writes them)")
    for path in COMMITTED:
        counts = json.load(open(path))
        n = counts["eval_n"]
        folder = os.path.dirname(path)
        if counts["method"] == "base":
            if counts["seed"] != 0:  # another eval seed: a fresh look, which nothing recorded
                continue
            recorded = json.load(open(os.path.join(folder, "..", "..", "base", "lab.json")))["test_pass@k"]
        else:
            result = os.path.join(os.path.dirname(folder), os.path.basename(folder)[len("problems-"):],
                                  os.path.basename(path))
            recorded = next(iter(json.load(open(result))["eval"].values()))
        for k in (1, 16, n):
            again = sum(pass_at_k(n, c, k) for c in counts["correct"].values()) / len(counts["correct"])
            assert again == pytest.approx(recorded[str(k)], abs=1e-9), (path, k)


def write_problems(path, lines_per_problem):
    """A lab test.jsonl: each problem's worked solution has one line per operation."""
    with open(path, "w") as f:
        for pid, lines in lines_per_problem.items():
            f.write(json.dumps({"id": pid, "problem": "?", "answer": "0",
                                "solution": "\n".join(["x"] * lines)}) + "\n")


def test_the_table_by_chain_length_averages_problems_then_seeds(sweep_out, tmp_path, capsys):
    into = tmp_path / "problems-test-p8"
    lab_problems.collect([str(sweep_out), str(tmp_path / "fresh")], str(into))
    problems = tmp_path / "test.jsonl"
    write_problems(problems, {"p0": 2, "p1": 2, "p2": 3})  # p0, p1: 2 operations; p2: 3
    table = lab_problems.by_chain_length(str(into), str(problems))
    assert set(table) == {"base", "pacs", "grpo"} and table["pacs"]["problems"] == {2: 2, 3: 1}
    assert table["base"]["seeds"] == 2 and table["pacs"]["eval_n"] == 4  # base-s0 and base-s1
    # pacs: s0 solved p0 4, p1 2, p2 1 of 4; s1 p0 3, p1 3, p2 0
    assert table["pacs"]["pass@1"] == {2: pytest.approx(((4 + 2) / 8 + (3 + 3) / 8) / 2), 3: pytest.approx(1 / 8)}
    assert table["pacs"]["pass@n"] == {2: pytest.approx(1.0), 3: pytest.approx(0.5)}  # p2 solved at s0 only
    assert table["grpo"]["pass@n"] == {2: pytest.approx(0.75), 3: pytest.approx(0.0)}  # p1 solved at s0 only
    assert table["base"]["pass@1"][3] == pytest.approx((0 + 1 / 4) / 2)
    lab_problems.main(["--table", str(problems), "--into", str(into)])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "| method | seeds | 2 ops (2 problems): pass@1, pass@4 | 3 ops (1 problems): pass@1, pass@4 |"
    assert out[2].startswith("| base | 2 | ") and out[4] == "| pacs | 2 | 0.750, 1.000 | 0.125, 0.500 |"


def test_the_table_refuses_other_problems_and_the_wrong_arguments(sweep_out, tmp_path, capsys):
    into = tmp_path / "problems-test-p8"
    lab_problems.collect([str(sweep_out)], str(into))
    other = tmp_path / "other.jsonl"
    write_problems(other, {"p0": 2, "p1": 2})  # no p2
    with pytest.raises(SystemExit, match="counts other problems than"):
        lab_problems.by_chain_length(str(into), str(other))
    with open(other, "w") as f:
        f.write(json.dumps({"id": "p0", "problem": "?", "answer": "0"}) + "\n")
    with pytest.raises(SystemExit, match="problem p0 has no worked solution"):
        lab_problems.by_chain_length(str(into), str(other))
    write_problems(other, {"p0": 2, "p1": 2, "p2": 3})
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no count files in"):
        lab_problems.by_chain_length(str(tmp_path / "empty"), str(other))
    for argv, message in ((["--into", str(into)], "name the sweep --out directories"),
                          (["--table", str(other), "--into", str(into), str(sweep_out)], "takes no run directories")):
        with pytest.raises(SystemExit):
            lab_problems.main(argv)
        assert message in capsys.readouterr().err
