"""--reward FILE.py:FUNCTION: a checker of the user's own, called as verify.verify is, in pacs.py and its verifier's
processes; None hands a row to verify.py (a mixed dataset); a bad spec or a verdict that is not a bool is one line."""
import json
import os
import sys
import textwrap

import pytest
import torch

import levers
import pacs
import plumbing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def checker_file(tmp_path, body, name="mine.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


PARITY = """
    def check(response, answer):
        if not answer.startswith("parity:"):
            return None  # not a row of this task: verify.py's
        return response.strip() == ("even" if int(answer[7:]) % 2 == 0 else "odd")
"""


def test_the_checker_decides_its_rows_and_leaves_the_others_to_verify_py(tmp_path):
    check = plumbing.load_reward(checker_file(tmp_path, PARITY) + ":check")
    responses = ["even", "odd", "even", "The answer is \\boxed{4}.", "The answer is \\boxed{5}."]
    answers = ["parity:4", "parity:4", "parity:7", "4", "4"]
    assert [check(r, a) for r, a in zip(responses, answers)] == [True, False, False, True, False]
    assert pacs.reward_fn(responses, answers, check=check).tolist() == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert plumbing.load_reward("") is pacs.verify  # no flag: verify.py's verifier


def test_the_checker_runs_in_the_verifier_processes(tmp_path):
    check = plumbing.load_reward(checker_file(tmp_path, PARITY) + ":check")  # before the fork, as train() does
    responses, answers = ["even", "odd"] * 40, ["parity:2", "parity:2"] * 40
    with levers.VerifierPool(2) as pool:
        assert pool.takes(len(responses))
        assert pacs.reward_fn(responses, answers, pool, check).tolist() == [1.0, 0.0] * 40


@pytest.mark.parametrize("spec, message", [
    ("mine.py", "expected FILE.py:FUNCTION"),
    ("mine.txt:check", "expected FILE.py:FUNCTION"),
    ("mine.py:", "expected FILE.py:FUNCTION"),
    ("absent.py:check", "no file"),
    ("mine.py:absent", "has no function absent"),
    ("broken.py:check", "importing .*broken.py failed: ZeroDivisionError"),
])
def test_a_bad_reward_is_one_line(tmp_path, monkeypatch, capsys, spec, message):
    checker_file(tmp_path, PARITY)
    checker_file(tmp_path, "x = 1 / 0\n", "broken.py")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        pacs.main(["--reward", spec, "--plan-only", "--model", "absent-model"])
    assert str(e.value).startswith(f"pacs.py: error: --reward {spec}: ") and "\n" not in str(e.value)
    assert __import__("re").search(message, str(e.value)), str(e.value)


def test_a_verdict_that_is_not_a_bool_is_one_line(tmp_path, tiny_model_dir, tiny_problems_file):
    spec = checker_file(tmp_path, "def check(response, answer):\n    return 1\n") + ":check"
    with pytest.raises(SystemExit) as e:
        pacs.main(["--model", tiny_model_dir, "--dataset", tiny_problems_file, "--reward", spec, "--steps", "1",
                   "--group-size", "2", "--prompts-per-step", "2", "--num-mini-batches", "1", "--max-new-tokens", "2",
                   "--eval-every", "0", "--out-dir", str(tmp_path / "run"), "--verify-workers", "1"])
    assert "returned int '1'" in str(e.value) and "not a bool" in str(e.value) and "\n" not in str(e.value)


def test_a_run_trains_on_the_checker_and_evaluates_with_it(tmp_path, tiny_model_dir, tiny_problems_file):
    """A short run with a checker that rewards odd-length responses: the logged rewards are its verdicts on the
    logged samples. The held-out set's rows are all right by the checker (verify.py would find no \\boxed{} answer in
    a random model's responses), so its greedy accuracy is 1."""
    spec = checker_file(tmp_path, """
        def check(response, answer):
            return answer == "any" or len(response) % 2 == 1
    """) + ":check"
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"problem": f"What is {i}?", "answer": "any"}) + "\n" for i in range(3)))
    out = tmp_path / "run"
    pacs.main(["--model", tiny_model_dir, "--dataset", tiny_problems_file, "--reward", spec, "--steps", "2",
               "--group-size", "4", "--prompts-per-step", "2", "--num-mini-batches", "2", "--max-new-tokens", "5",
               "--eval-every", "1", "--eval-dataset", str(held_out), "--eval-size", "3",
               "--log-samples-every", "1", "--temperature", "1.5", "--out-dir", str(out)])
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    assert samples and all(s["reward"] == float(len(s["response"]) % 2 == 1) for s in samples), samples
    metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [m["eval_acc"] for m in metrics] == [1.0, 1.0]


def test_eval_scores_a_mixed_dataset_row_by_row(tmp_path, tiny_model_dir, capsys):
    """eval.py --reward: the checker's rows by the checker (here every response right), the others by verify.py (a
    random model's responses hold no \\boxed{} answer: all wrong); a rerun with another checker is refused."""
    import eval as ev
    spec = checker_file(tmp_path, """
        def check(response, answer):
            return True if answer.startswith("parity:") else None
    """) + ":check"
    data = tmp_path / "mixed.jsonl"
    data.write_text(json.dumps({"id": "p", "problem": "Is 4 even?", "answer": "parity:4"}) + "\n"
                    + json.dumps({"id": "m", "problem": "What is 1 + 1?", "answer": "2"}) + "\n")
    out = tmp_path / "eval"
    ev.main(["--model", tiny_model_dir, "--datasets", str(data), "--reward", spec, "--n", "2", "--max-new-tokens",
             "4", "--out", str(out), "--device", "cpu"])
    rows = {r["id"]: r for r in map(json.loads, open(out / "samples.jsonl"))}
    assert rows["p"]["correct"] == [True, True] and rows["m"]["correct"] == [False, False]
    with pytest.raises(SystemExit) as e:
        ev.main(["--model", tiny_model_dir, "--datasets", str(data), "--n", "2", "--max-new-tokens", "4",
                 "--out", str(out), "--device", "cpu", "--limit", "1"])
    assert "--reward" in str(e.value) and "other settings" in str(e.value)
    with pytest.raises(SystemExit) as e:
        ev.main(["--model", tiny_model_dir, "--datasets", str(data), "--reward", "absent.py:check",
                 "--out", str(tmp_path / "other")])
    assert str(e.value).startswith("eval.py: error: --reward absent.py:check: no file")
