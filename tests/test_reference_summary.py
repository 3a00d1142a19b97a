"""experiments/reference.py: summary.json's `reference` (PACS with --ref-reset-every K against K = 1 and the
baselines) and `v2_ablations`, from hand-made result files whose every number is known."""
import json
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import lab_summary  # noqa: E402
import reference  # noqa: E402

SETTINGS = {"prompts": 32, "group_size": 8, "num_mini_batches": 4, "steps": 8, "max_new_tokens": 32,
            "eval_problems": 0, "eval_n": 64, "eval_temperature": 1.0, "eval_top_p": 1.0, "eval_max_new_tokens": 32,
            "lab_weights_sha256": "x", "lr": 1e-4}
PASS1 = {"pacs": 0.50, "pacs-ref4": 0.53, "pacs-ref-never": 0.20, "grpo": 0.55, "ppo": 0.56, "pacs-no-balance": 0.49}


def write_result(root, method, seed, psi_abs, auc_first):
    steps = len(psi_abs)
    flags = ["--algo", method, "--beta", "1.0"]
    result = {"method": method, "seed": seed, "settings": {**SETTINGS, "pacs_flags": flags},
              "metrics": {"reward": [0.1] * steps, "entropy": [0.2 + 0.01 * seed] * steps,
                          "grad_norm": [(3e6 if method == "pacs-no-balance" else 12.0) * (0.9 + seed / 10)] * steps,
                          "critic_auc": [0.55] * steps, "critic_pairs": [4] * steps, "psi_abs": psi_abs,
                          "critic_auc_first": auc_first},
              "calibration": None, "eval": {"test.jsonl": {"1": PASS1[method] + 0.01 * seed, "64": 0.9}},
              "boxed_expressions": 0.0, "wall_s": 1.0}
    os.makedirs(os.path.join(root, "test-p32"), exist_ok=True)
    with open(os.path.join(root, "test-p32", f"{method}-s{seed}.json"), "w") as f:
        json.dump(result, f)


@pytest.fixture
def summary(tmp_path):
    root = str(tmp_path)
    # K = 4 over 8 steps: |psi| 0 at each reset (steps 0 and 4), then growing; "never": growing all run long
    for seed in range(3):
        write_result(root, "pacs", seed, [0.1] * 8, [None] * 8)
        write_result(root, "pacs-ref4", seed, [0, 1, 2, 3, 0, 1.5 + seed, 2.5, 3.5], [None, 0.6, 0.7, 0.8] * 2)
        write_result(root, "pacs-ref-never", seed, [float(s) for s in range(8)], [None] + [0.9] * 7)
        for method in ("grpo", "ppo", "pacs-no-balance"):
            write_result(root, method, seed, [None] * 8, [None] * 8)
    s = lab_summary.lab_summary(root, prompts=32, last=2)
    s["reference"] = reference.reference_summary(root, s, base_pass1=0.25)
    s["v2_ablations"] = reference.ablation_summary(s, base_pass1=0.505, runs_root=root)  # seeds 0 and 1 end below it
    return s


def test_psi_growth_reads_the_period_after_a_reset_and_before_the_next():
    rows = [{"psi_abs": v} for v in [0, 1, 2, 3, 0, 1.5, 2.5, 3.5]]
    assert reference.psi_growth(rows, 4) == {"after_reset": 1.25, "before_reset": 3.25}
    assert reference.psi_growth(rows, 1) is None
    long = [{"psi_abs": float(s)} for s in range(40)]
    assert reference.psi_growth(long, 0) == {"after_reset": np.mean(range(1, 16)),
                                              "before_reset": np.mean(range(25, 40))}


def test_each_arm_is_paired_with_pacs_and_the_baselines(summary):
    arms = {a["method"]: a for a in summary["reference"]["arms"]}
    assert list(arms) == ["pacs", "pacs-ref4", "pacs-ref-never"]  # ARMS' order; arms without runs left out
    ref4 = arms["pacs-ref4"]
    assert (ref4["ref_reset_every"], ref4["clears_optimizer"], ref4["seeds"]) == (4, True, 3)
    assert ref4["pass@1"]["mean"] == pytest.approx(0.54)
    pair = {(p["b"], p["metric"]): p for p in ref4["paired"]}
    assert pair["pacs", "pass@1"]["mean"] == pytest.approx(0.03) and pair["pacs", "pass@1"]["seeds"] == 3
    assert pair["grpo", "pass@1"]["mean"] == pytest.approx(-0.02)
    assert pair["ppo", "pass@1"]["mean"] == pytest.approx(-0.03)
    assert pair["pacs", "final_entropy"]["mean"] == pytest.approx(0.0)
    assert ref4["critic_auc_first"]["mean"] == pytest.approx(0.7)
    # |psi| right after a reset (steps 1 and 5) and before the next (3 and 7), seed by seed, then over seeds
    assert ref4["psi_abs_after_reset"]["mean"] == pytest.approx(np.mean([(1 + 1.5 + s) / 2 for s in range(3)]))
    assert ref4["psi_abs_before_reset"]["mean"] == pytest.approx(3.25)
    assert arms["pacs"]["critic_auc_first"] is None and arms["pacs"]["psi_abs_after_reset"] is None
    # below the base model's pass@1 (0.25): every "never" run, no other
    assert [arms[m]["diverged"] for m in arms] == [0, 0, 3]


def test_ablations_are_paired_with_pacs_and_the_tables_print(summary):
    (abl,) = summary["v2_ablations"]
    assert abl["method"] == "pacs-no-balance" and abl["seeds"] == 3
    assert next(p for p in abl["paired"] if p["metric"] == "pass@1")["mean"] == pytest.approx(-0.01)
    text = reference.tables(json.loads(json.dumps(summary)))
    assert "| 4 | 3 | 0.540 [" in text and "| never | 3 | 0.210 [" in text and "| 3 of 3 |" in text
    assert "| pacs-no-balance | 3 | 0.500 [" in text and "| -0.010 [" in text and text.endswith("| 2 of 3 |")
    assert abl["pass@1"]["mean"] == pytest.approx(0.50) and abl["diverged"] == 2
    assert abl["grad_norm"]["mean"] == pytest.approx(3e6) and abl["grad_norm_pacs"]["mean"] == pytest.approx(12.0)
    assert "| 3e+06 (12) |" in text
    p = next(p for p in abl["paired"] if p["metric"] == "pass@1")  # the column beside the difference
    assert f"| {p['mean']:+.3f} [" in text and f") | {p['detectable_80']:.3f} | " in text, p


def test_no_reference_entry_without_an_arm(tmp_path):
    for seed in range(2):
        write_result(str(tmp_path), "pacs", seed, [0.1] * 8, [None] * 8)
    s = lab_summary.lab_summary(str(tmp_path), prompts=32, last=2)
    assert reference.reference_summary(str(tmp_path), s) is None and reference.ablation_summary(s) is None


def test_the_figure_is_drawn(summary, tmp_path):
    path = tmp_path / "ref.png"
    reference.plot(json.loads(json.dumps(summary)), str(path))
    assert os.path.getsize(path) > 10_000


def test_the_beta_table_pairs_each_beta_with_beta_1_and_the_next_one_up():
    runs = [{"method": m, "seed": s, "pass@1": base + 0.01 * s + (0.002 if s % 2 else 0)}
            for m, base in (("pacs-beta0.5", 0.50), ("pacs", 0.52), ("pacs-beta2", 0.55), ("grpo", 0.9))
            for s in range(4)]
    rows = reference.beta_table({"runs": runs})
    assert rows[0].startswith("| β | seeds | test pass@1 | − β = 1 |") and len(rows) == 2 + 3  # grpo is no β
    half, one, two = (r.split(" | ") for r in rows[2:])
    assert half[0] == "| 0.5" and half[3].startswith("-0.020 [-0.020, -0.020]") and half[5].startswith("-0.020")
    assert one[3] == "–" and one[5].startswith("-0.030 [") and two[3].startswith("+0.030 [") and two[5] == "– |"
    assert two[2].startswith(f"{np.mean([0.55, 0.562, 0.57, 0.582]):.3f} [")
    assert reference.beta_table({"runs": [r for r in runs if r["method"] == "pacs"]}) == []


def test_the_lab_pages_beta_table_is_the_one_reference_py_prints():
    lab_dir = os.path.join(ROOT, "experiments", "labs", "lab")
    with open(os.path.join(lab_dir, "summary.json")) as f:
        rows = reference.beta_table(json.load(f))
    with open(os.path.join(lab_dir, "README.md"), encoding="utf-8") as f:
        page = f.read().splitlines()
    assert len(rows) == 8 and all(row in page for row in rows), "experiments/labs/lab/README.md's β table is stale"
