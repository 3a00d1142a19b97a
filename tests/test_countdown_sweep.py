"""The countdown lab's sweep: trend.py --lab on a countdown lab gives pacs.py and eval.py its checker (--reward),
scores the chain test split out of domain at the test split only, and keeps v2's diversity by two embedders in each
result file (sweep.result_diversity); lab_summary.countdown_summary pairs runs by seed, diversity over the problems
both runs have K right in, distinct forms by countdown.canonical."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import eval as eval_py  # noqa: E402
import lab_summary  # noqa: E402
import sweep  # noqa: E402
import trend  # noqa: E402


def fake_lab(path, task):
    os.makedirs(path / "model")
    (path / "lab.json").write_text(json.dumps({"weights_sha256": "ab" * 32, "settings": {"task": task}}))
    rows = [{"problem": f"{i}", "answer": "1"} for i in range(40)]
    (path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_a_countdown_lab_sweep_brings_its_checker_the_second_domain_and_the_embedders(tmp_path):
    cd = fake_lab(tmp_path / "cd", "countdown")
    test = trend.parse_args(["--lab", cd, "--out", str(tmp_path / "o1")])
    trend.check_args(test)
    assert f"--reward {trend.COUNTDOWN_REWARD}" in test.pacs_args and f"--reward {trend.COUNTDOWN_REWARD}" in \
        test.eval_args
    assert [os.path.basename(d) for d in test.eval_datasets.split(",")] == ["test.jsonl", "chain_test.jsonl"]
    assert test.diversity == ["char-ngrams", "smollm2"]
    assert "--reward" in sweep.train_command(test, "pacs", 0) and "--reward" in sweep.eval_command(test, "m", "o")
    val = trend.parse_args(["--lab", cd, "--out", str(tmp_path / "o2"), "--split", "val"])
    assert os.path.basename(val.eval_datasets) == "val.jsonl" and val.diversity == []  # the scan: in domain only
    assert "--reward" in val.pacs_args
    chain = trend.parse_args(["--lab", fake_lab(tmp_path / "chain", "chain"), "--out", str(tmp_path / "o3")])
    assert "--reward" not in chain.pacs_args + chain.eval_args and chain.diversity == []  # the chain labs unchanged
    assert "diversity" not in sweep.result_settings(chain, "pacs")  # old result files still match their settings


def test_a_bad_diversity_k_fails_before_any_run(tmp_path):
    args = trend.parse_args(["--lab", fake_lab(tmp_path / "cd", "countdown"), "--out", str(tmp_path / "o"),
                             "--diversity-k", "1"])
    with pytest.raises(sweep.SweepError, match="at least 2"):
        trend.check_args(args)


def sample_row(pid, extracted, correct):
    return {"dataset": "test", "id": pid, "responses": [f"\\boxed{{{e}}}" for e in extracted],
            "extracted": extracted, "correct": correct}


def test_result_diversity_keeps_each_embedders_div_and_the_drawn_answers(tmp_path):
    ev = tmp_path / "eval"
    ev.mkdir()
    rows = [sample_row("p0", ["2+3", "3+2", "8-3", "1"], [True, True, True, False]),  # 3 right: K = 2 drawn
            sample_row("p1", ["2+3", "9", "9", "9"], [True, False, False, False])]  # 1 right: left out
    (ev / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = type("A", (), {"diversity": ["char-ngrams"], "diversity_k": 2})()
    out = sweep.result_diversity(args, str(ev), "test")
    drawn = eval_py.draw_correct(rows[0], 2, sweep.DIVERSITY_SEED)
    assert out["drawn_answers"] == {"p0": [rows[0]["extracted"][i] for i in drawn]}
    d = out["by_embedder"]["char-ngrams"]
    assert set(d["div"]) == {"p0"} and d["left_out"] == 1 and d["problems"] == 1
    texts = [rows[0]["responses"][i] for i in drawn]
    want = eval_py.pairwise_diversity(eval_py.char_ngram_vectors(texts))
    assert d["div"]["p0"] == pytest.approx(want, abs=1e-6) and d["s_div"] == pytest.approx(want)


def result(method, seed, div, drawn, ood1):
    return {"method": method, "seed": seed, "settings": {"prompts": 32, "num_mini_batches": 4},
            "eval": {"test": {"1": 0.5}, "chain_test": {"1": ood1, "64": 0.9}},
            "diversity": {"dataset": "test", "k": 2, "seed": 0, "drawn_answers": drawn,
                          "by_embedder": {"char-ngrams": {"pooling": "char-ngrams", "s_div": 0, "problems": 0,
                                                          "left_out": 0, "div": div}}}}


def test_countdown_summary_compares_diversity_on_the_problems_both_runs_share(tmp_path):
    d = tmp_path / "results" / "test-p32"
    d.mkdir(parents=True)
    files = {  # seed 0: only p1 is shared (a +0.2 in Div, 2 forms - 1); seed 1: p1 and p2 (mean +0.1 and +0.5)
        "pacs-s0": result("pacs", 0, {"p1": 0.5, "p2": 0.1}, {"p1": ["2+3", "8-3"], "p2": ["1", "1"]}, 0.6),
        "grpo-s0": result("grpo", 0, {"p1": 0.3, "p3": 0.9}, {"p1": ["3+2", "2+3"], "p3": ["1", "1"]}, 0.5),
        "pacs-s1": result("pacs", 1, {"p1": 0.4, "p2": 0.6}, {"p1": ["2+3", "8-3"], "p2": ["4*2", "2*4"]}, 0.7),
        "grpo-s1": result("grpo", 1, {"p1": 0.4, "p2": 0.4}, {"p1": ["2+3", "3+2"], "p2": ["4*2", "8/1"]}, 0.4)}
    for name, r in files.items():
        (d / f"{name}.json").write_text(json.dumps(r))
    out = lab_summary.countdown_summary(str(tmp_path / "results"), {"settings": {"num_mini_batches": 4}})
    pairs = {(p["a"], p["b"], p["metric"]): p for p in out["paired"]}
    s_div = pairs[("pacs", "grpo", "s_div_char-ngrams")]
    assert s_div["seeds"] == 2 and s_div["shared_problems"] == [1, 2]
    assert s_div["mean"] == pytest.approx((0.2 + 0.1) / 2)  # seed 1: (0.4 + 0.6) / 2 - (0.4 + 0.4) / 2
    forms = pairs[("pacs", "grpo", "distinct_forms")]  # seed 0: 2 - 1 on p1; seed 1: (2 + 1) / 2 - (1 + 2) / 2
    assert forms["mean"] == pytest.approx((1 + 0) / 2)
    assert pairs[("pacs", "grpo", "ood_pass@1")]["mean"] == pytest.approx((0.1 + 0.3) / 2)
    assert ("pacs", "ppo", "ood_pass@1") not in pairs  # no PPO run: no pair
    runs = {(r["method"], r["seed"]): r for r in out["runs"]}
    assert runs[("pacs", 0)]["s_div_char-ngrams"] == pytest.approx(0.3) and runs[("grpo", 0)]["distinct_forms"] == 1
