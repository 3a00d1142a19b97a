"""experiments/stability.py: the stability and efficiency metrics of experiments/stability.md, each against a case
computed by hand, and summary.json's `stability` and `efficiency` entries (their schema, on a synthetic lab and on
every committed summary)."""
import glob
import json
import math
import os
import sys

import numpy as np
import pytest
from scipy import stats as sps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import stability  # noqa: E402
from sweep import METHODS, SweepError  # noqa: E402


# ---- per run -----------------------------------------------------------------------------------------
def test_smoothed_is_the_trailing_mean_from_the_first_full_window():
    assert stability.smoothed([1, 2, 3, 4, 5], window=2).tolist() == [1.5, 2.5, 3.5, 4.5]
    assert stability.smoothed([0.2, 0.4, 0.9], window=3).tolist() == pytest.approx([0.5])
    with pytest.raises(SweepError, match="^a curve of 4 steps is shorter than the smoothing window of 10$"):
        stability.smoothed([0.1, 0.2, 0.3, 0.4])


def test_drawdown_is_the_deepest_fall_below_the_running_maximum():
    # unsmoothed (window 1): the fall 0.5 -> 0.2 (0.3), not the last one 0.9 -> 0.7 (0.2) nor max - min (0.8)
    assert stability.drawdown([0.1, 0.5, 0.2, 0.9, 0.7], window=1) == pytest.approx(0.3)
    assert stability.drawdown([0.1, 0.2, 0.2, 0.6], window=1) == 0.0  # never falls
    assert stability.drawdown([0.9, 0.1, 0.5], window=1) == pytest.approx(0.8)  # a fall from the first step counts
    # window 2: m = [0.2, 0.5, 0.4, 0.2, 0.5]; running max [0.2, 0.5, 0.5, 0.5, 0.5]: deepest 0.3, at the 4th point
    assert stability.drawdown([0.0, 0.4, 0.6, 0.2, 0.2, 0.8], window=2) == pytest.approx(0.3)
    # the default window of 10 smooths: a reward alternating 0, 1 is flat at 0.5 once smoothed
    assert stability.drawdown([0.0, 1.0] * 15) == pytest.approx(0.0)


def test_grad_spike_is_the_largest_norm_over_the_median_one():
    assert stability.grad_spike([1.0, 2.0, 3.0, 10.0]) == pytest.approx(10 / 2.5)  # the mean (4) would give 2.5
    assert stability.grad_spike([2.0, 2.0, 2.0]) == 1.0
    with pytest.raises(SweepError, match="^the median gradient norm is 0.0: a spike over it is undefined$"):
        stability.grad_spike([0.0, 0.0, 1.0])
    with pytest.raises(SweepError, match="non-finite"):
        stability.grad_spike([1.0, float("nan"), 2.0])
    with pytest.raises(SweepError, match="^no gradient norm"):
        stability.grad_spike([])


def test_steps_to_gain_is_the_first_smoothed_step_at_half_the_runs_own_gain():
    # window 2: start = mean(0, 0) = 0, final = mean(1, 1) = 1, threshold 0.5; m at steps 1..7 =
    # [0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0]: first reached at step 4 (the trailing mean of steps 3 and 4)
    rewards = [0.0, 0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.0]
    assert stability.steps_to_gain(rewards, share=0.5, window=2) == 4
    assert stability.steps_to_gain(rewards, share=0.9, window=2) == 6  # m = 0.9 at step 6
    assert stability.steps_to_gain(rewards, share=1.0, window=2) == 7
    assert stability.steps_to_gain([0.5, 0.5, 0.4, 0.3], window=2) is None  # no gain: final <= start
    assert stability.steps_to_gain([0.3] * 12) is None


def _result(method, seed, rewards, grad_norms=None, step_times=None, pass1=0.5, prompts=4, group_size=2, lr=1e-4):
    """A result file's content as sweep.write_result writes it, with the fields stability.py and lab_summary read."""
    steps = len(rewards)
    flags = list(METHODS[method])  # the sweep's flags: lab_summary reads PACS's beta from them
    return {"method": method, "seed": seed,
            "settings": {"prompts": prompts, "group_size": group_size, "num_mini_batches": 2, "steps": steps,
                         "max_new_tokens": 8, "eval_problems": 0, "eval_n": 4, "eval_temperature": 1.0,
                         "eval_top_p": 1.0, "eval_max_new_tokens": 8, "lab_weights_sha256": "ab" * 32, "lr": lr,
                         "pacs_flags": flags},
            "metrics": {"reward": list(rewards), "entropy": [1.0] * steps,
                        "critic_auc": [None] * steps, "critic_pairs": [0] * steps,
                        "grad_norm": list(grad_norms) if grad_norms is not None else [1.0] * steps,
                        "step_time": list(step_times) if step_times is not None else [0.5] * steps},
            "calibration": None, "eval": {"test": {"1": pass1, "2": min(1.0, pass1 + 0.1), "3": min(1.0, pass1 + 0.15),
                                                   "4": min(1.0, pass1 + 0.2)}},
            "boxed_expressions": 0.0, "wall_s": 10.0}


def test_run_entry_reads_a_result_file_and_notes_what_it_lacks():
    rewards = [0.0] * 10 + [0.5] * 5 + [1.0] * 10  # start 0, final 1: m[16] = (5 * 0.5 + 2) / 10 = 0.45, m[17] 0.55
    r = _result("pacs", 3, rewards, grad_norms=[1.0] * 24 + [6.0], step_times=[0.2] * 20 + [0.9] * 5, pass1=0.3)
    entry, notes = stability.run_entry(r, base_pass1=0.4)
    assert notes == []
    assert entry["steps_to_half_gain"] == 17 and entry["samples_to_half_gain"] == 18 * 4 * 2  # 18 steps x 4 x 2
    assert entry["grad_spike"] == pytest.approx(6.0) and entry["below_base"] is True
    assert entry["drawdown"] == 0.0 and entry["median_step_time"] == pytest.approx(0.2)
    assert entry["mean_reward"] == pytest.approx((5 * 0.5 + 10) / 25)
    assert stability.run_entry(r, base_pass1=0.3)[0]["below_base"] is False  # equal is not below
    assert stability.run_entry(r, base_pass1=None)[0]["below_base"] is None
    r["metrics"]["grad_norm"] = [None] * 25  # a file without the metric: None and a note, the rest still measured
    short = _result("grpo", 0, [0.1, 0.2, 0.3])
    (entry, notes), (s_entry, s_notes) = stability.run_entry(r, 0.4), stability.run_entry(short, 0.4)
    assert entry["grad_spike"] is None and notes == [("gradient spike", "pacs-s3: the result file has no per-step "
                                                                         "grad_norm")]
    assert (s_entry["drawdown"] is None and s_entry["steps_to_half_gain"] is None
            and s_entry["mean_reward"] == pytest.approx(0.2))
    assert ("drawdown", "grpo-s0: a curve of 3 steps is shorter than the smoothing window of 10") in s_notes


# ---- per method and per comparison -------------------------------------------------------------------
def test_spread_is_the_sd_ratio_with_levenes_median_centred_test():
    runs = [{"method": "pacs", "pass@1": x} for x in (0.0, 1.0, 2.0, 10.0)] + \
           [{"method": "grpo", "pass@1": x} for x in (0.0, 2.0, 4.0, 6.0)]
    e = stability.spread_entry(runs, "pacs", "grpo")
    # by hand: SDs (n - 1) sqrt(62.75 / 3) and sqrt(20 / 3). Brown-Forsythe: |x - median| = [1.5, 0.5, 0.5, 8.5]
    # and [3, 1, 1, 3]; their one-way ANOVA: SSB = 8 * 0.375^2 = 1.125, SSW = 44.75 + 4 = 48.75,
    # F = 1.125 / (48.75 / 6)
    assert (e["sd_a"] == pytest.approx(math.sqrt(62.75 / 3), abs=1e-5)
            and e["sd_b"] == pytest.approx(math.sqrt(20 / 3), abs=1e-5))
    assert e["ratio"] == pytest.approx(math.sqrt(62.75 / 20), abs=1e-5)
    assert e["p_levene"] == pytest.approx(sps.f.sf(1.125 / (48.75 / 6), 1, 6), rel=2e-3)
    assert (e["seeds_a"], e["seeds_b"]) == (4, 4)
    assert e["detectable_ratio_80"] == pytest.approx(math.sqrt(sps.f.ppf(0.975, 3, 3) / sps.f.ppf(0.2, 3, 3)),
                                                     abs=1e-5)
    flat = stability.spread_entry([{"method": m, "pass@1": 0.5} for m in ("pacs", "ppo") for _ in range(3)], "pacs",
                                  "ppo")
    assert flat["p_levene"] is None and flat["ratio"] is None  # no spread on either side: nothing to test


def test_the_detectable_sd_ratio_has_80_percent_power_for_the_f_test():
    """At the ratio detectable_sd_ratio returns, a two-sided F-test at 5% rejects equal variances in about 80% of
    normal samples (simulated, seeded): the ratio is what it says."""
    rho = stability.detectable_sd_ratio(16, 16)
    assert 1.9 < rho < 2.3
    rng = np.random.default_rng(0)
    a = rng.standard_normal((20000, 16)) * rho
    b = rng.standard_normal((20000, 16))
    f = a.var(axis=1, ddof=1) / b.var(axis=1, ddof=1)
    power = np.mean((f > sps.f.ppf(0.975, 15, 15)) | (f < sps.f.ppf(0.025, 15, 15)))
    assert power == pytest.approx(0.8, abs=0.015)
    assert math.isnan(stability.detectable_sd_ratio(1, 16))


def test_below_base_counts_and_fishers_exact_test():
    runs = [{"method": "pacs", "below_base": i < 3} for i in range(16)] + \
           [{"method": "ppo", "below_base": False} for _ in range(16)]
    e = stability.below_base_entry(runs, "pacs", "ppo")
    assert (e["below_a"], e["runs_a"], e["below_b"], e["runs_b"]) == (3, 16, 0, 16)
    # by hand: 3 of 32 runs below, 16 per side; P(all 3 in one side) = C(16, 3) / C(32, 3) = 560 / 4960, twice
    assert e["p_fisher"] == pytest.approx(2 * 560 / 4960, rel=2e-3)


def _write(root, sub, result):
    os.makedirs(os.path.join(root, sub), exist_ok=True)
    with open(os.path.join(root, sub, f"{result['method']}-s{result['seed']}.json"), "w") as f:
        json.dump(result, f)


def test_lr_robustness_is_each_methods_share_of_its_best_and_its_cliff_at_twice_the_choice(tmp_path):
    val = {"pacs": {5e-5: (0.50, 0.54), 1e-4: (0.60, 0.62), 2e-4: (0.30, 0.34)},
           "grpo": {5e-5: (0.40, 0.40), 1e-4: (0.50, 0.54), 2e-4: (0.40, 0.40)},
           "ppo": {1e-4: (0.40, 0.44), 2e-4: (0.50, 0.50)}}  # ppo chooses the grid's top: no 2x
    for m, by_lr in val.items():
        for lr, values in by_lr.items():
            for seed, v in zip((1000, 1001), values):
                _write(str(tmp_path), f"val-p4-lr{lr:g}", _result(m, seed, [0.1] * 12, pass1=v, lr=lr))
    lr = stability.lr_robustness(str(tmp_path), prompts=4)
    pacs, grpo, ppo = (lr["methods"][m] for m in ("pacs", "grpo", "ppo"))
    assert pacs["chosen"] == 1e-4 and pacs["lr_2x"] == 2e-4 and pacs["lr_half"] == 5e-5
    assert pacs["share"] == {"5e-05": pytest.approx(0.52 / 0.61, abs=1e-5), "0.0001": 1.0,
                             "0.0002": pytest.approx(0.32 / 0.61, abs=1e-5)}
    assert pacs["loss_2x"] == pytest.approx(0.61 - 0.32) and pacs["loss_half"] == pytest.approx(0.61 - 0.52)
    assert pacs["loss_2x_per_seed"] == {"1000": pytest.approx(0.30), "1001": pytest.approx(0.28)}
    assert grpo["loss_2x_per_seed"] == {"1000": pytest.approx(0.10), "1001": pytest.approx(0.14)}
    assert (ppo["chosen"] == 2e-4 and ppo["lr_2x"] is None and ppo["loss_2x"] is None
            and ppo["loss_2x_per_seed"] is None)
    assert ppo["loss_half"] == pytest.approx(0.50 - 0.42)
    # PACS - GRPO per seed: 0.20, 0.14; mean 0.17 -/+ t_{0.975, 1} * s / sqrt(2), s = 0.06 / sqrt(2)
    (pair,) = lr["paired"]
    half = sps.t.ppf(0.975, 1) * (0.06 / math.sqrt(2)) / math.sqrt(2)
    assert (pair["b"], pair["seeds"], pair["mean"]) == ("grpo", 2, pytest.approx(0.17))
    assert pair["ci95_t"] == [pytest.approx(0.17 - half, abs=1e-5), pytest.approx(0.17 + half, abs=1e-5)]
    with pytest.raises(SweepError, match="no scan result"):
        stability.lr_robustness(str(tmp_path), prompts=32)


def test_parameter_counts_are_the_policy_and_ppos_value_model_of_the_labs_config():
    """The lab's Qwen2 (2 layers, hidden 128, MLP 256, 24 tokens, tied embeddings) counted by hand, and PPO's value
    model: the same decoder without the (tied) LM head, and a scalar head with its bias."""
    counts = stability.parameter_counts(os.path.join(ROOT, "experiments", "labs", "lab", "base", "model"))
    V, H, I, L = 24, 128, 256, 2
    per_layer = 4 * H * H + 3 * H + 3 * H * I + 2 * H  # q, k, v, o; the q, k, v biases; the MLP; two RMSNorms
    policy = V * H + L * per_layer + H  # the embedding (the LM head shares it) and the final norm
    assert counts == {"policy": policy, "value_model": policy + H + 1}
    assert policy == json.load(open(os.path.join(ROOT, "experiments", "labs", "lab", "base",
                                                 "lab.json")))["parameters"]
    assert stability.parameter_counts(str(ROOT)) is None  # no config.json


def _row(b, metric, mean, p, lo=None, hi=None):
    return {"b": b, "metric": metric, "mean": mean, "p_t": p, "ci95_t": [lo, hi]}


def test_row_reading_follows_the_rule_fixed_before_the_numbers():
    metrics = ("drawdown", "mean_reward")
    favoured = [_row("grpo", "drawdown", -0.02, 0.001), _row("ppo", "mean_reward", +0.03, 0.004),
                _row("grpo", "mean_reward", +0.01, 0.3), _row("ppo", "drawdown", -0.001, 0.6)]
    out = stability.row_reading(favoured, [], metrics)
    assert out["threshold"] == pytest.approx(0.05 / 4) and out["verdict"] == "holds"
    assert [(t["b"], t["metric"], t["favours"], t["at_threshold"]) for t in out["tests"]] == [
        ("grpo", "drawdown", "pacs", True), ("grpo", "mean_reward", "pacs", False),
        ("ppo", "drawdown", "pacs", False), ("ppo", "mean_reward", "pacs", True)]
    # higher mean reward is better, a larger drawdown worse: the same sign reads the other way
    against = favoured[:3] + [_row("ppo", "drawdown", +0.01, 0.03)]  # disfavoured at 95%, not at 0.0125
    assert stability.row_reading(against, [], metrics)["verdict"] == "not shown"
    worse = favoured[:1] + [_row("ppo", "mean_reward", -0.03, 0.004)] + favoured[2:]
    assert stability.row_reading(worse, [], metrics)["verdict"] == "contradicted"
    only_grpo = favoured[:1] + favoured[2:]  # PACS favoured against GRPO only
    assert stability.row_reading(only_grpo, [], metrics)["verdict"] == "not shown"
    spread = [{"b": "grpo", "sd_a": 0.01, "sd_b": 0.02, "p_levene": 0.001},
              {"b": "ppo", "sd_a": 0.03, "sd_b": 0.02, "p_levene": 0.002}]
    assert stability.row_reading([], spread, ("spread",))["verdict"] == "contradicted"
    spread[1]["sd_b"] = 0.05
    assert stability.row_reading([], spread, ("spread",))["verdict"] == "holds"


# ---- summary.json's entries --------------------------------------------------------------------------
def check_stability_schema(summary):
    """The `stability` and `efficiency` entries of a summary.json: keys, types and ranges."""
    st, ef = summary["stability"], summary["efficiency"]
    assert set(st) == {"window", "base_pass@1", "lr", "runs", "spread", "paired", "below_base", "unmeasured", "claim"}
    assert set(ef) == {"window", "gain_share", "samples_per_step", "parameters", "runs", "no_gain", "paired",
                       "unmeasured", "claim"}
    assert st["window"] == ef["window"] == stability.WINDOW and ef["gain_share"] == stability.GAIN_SHARE
    settings = summary["settings"]
    assert ef["samples_per_step"] == settings["prompts"] * settings["group_size"]
    names = {r["method"] for r in summary["runs"]} | {r["method"] for r in summary.get("control", {}).get("runs", [])}
    for r in st["runs"]:
        assert set(r) == {"method", "seed", "pass@1", "drawdown", "grad_spike", "below_base"} and r["method"] in names
        assert 0 <= r["pass@1"] <= 1 and (r["drawdown"] is None or 0 <= r["drawdown"] <= 1)
        assert r["grad_spike"] is None or r["grad_spike"] >= 1
        assert r["below_base"] in (None, True, False) and (r["below_base"] is None) == (st["base_pass@1"] is None)
    for r in ef["runs"]:
        assert set(r) == {"method", "seed", "mean_reward", "steps_to_half_gain", "samples_to_half_gain",
                          "median_step_time"}
        assert r["mean_reward"] is None or 0 <= r["mean_reward"] <= 1
        if r["steps_to_half_gain"] is not None:
            assert r["samples_to_half_gain"] == (r["steps_to_half_gain"] + 1) * ef["samples_per_step"]
            assert stability.WINDOW - 1 <= r["steps_to_half_gain"] < settings["steps"]
        assert r["median_step_time"] is None or r["median_step_time"] > 0
    assert [(r["method"], r["seed"]) for r in st["runs"]] == [(r["method"], r["seed"]) for r in ef["runs"]]
    for p in st["paired"] + ef["paired"]:
        assert p["a"] == "pacs" and p["b"] in names and p["seeds"] >= 1
        assert p["metric"] in ("drawdown", "log_grad_spike", "mean_reward", "samples_to_half_gain", "log_step_time")
        assert p["seeds"] == 1 or p["mean"] is None or p["ci95_t"][0] <= p["mean"] <= p["ci95_t"][1]
    for s in st["spread"]:
        assert set(s) == {"a", "b", "metric", "seeds_a", "seeds_b", "sd_a", "sd_b", "ratio", "p_levene",
                          "detectable_ratio_80"}
        assert s["p_levene"] is None or 0 < s["p_levene"] <= 1
    for b in st["below_base"]:
        assert 0 <= b["below_a"] <= b["runs_a"] and 0 <= b["below_b"] <= b["runs_b"]
    for claim, tests in ((st["claim"], stability.STABILITY_TESTS), (ef["claim"], stability.EFFICIENCY_TESTS)):
        assert claim["verdict"] in ("holds", "contradicted", "not shown")
        assert claim["threshold"] == pytest.approx(0.05 / (len(stability.FAMILY) * len(tests)))
        assert all(t["b"] in stability.FAMILY and t["metric"] in tests for t in claim["tests"])
    if st["lr"] is not None:
        for m, e in st["lr"]["methods"].items():
            assert str(e["chosen"]) in e["share"] and e["share"][str(e["chosen"])] <= 1
            assert max(e["share"].values()) == 1.0 and all(0 <= v <= 1 for v in e["share"].values())
            assert (e["lr_2x"] is None) == (e["loss_2x"] is None)
    if ef["parameters"] is not None:
        assert set(ef["parameters"]) == set(settings["lr"])
        for m, c in ef["parameters"].items():  # a value model beside the policy for PPO alone
            ppo = stability.algo_of(settings["pacs_flags"][m]) == "ppo"
            assert c["policy"] > 0 and (c["value_model"] > c["policy"] if ppo else c["value_model"] == 0)


def _synthetic_lab(root):
    """test-p4/ with pacs, grpo and ppo at seeds 0..3 (40 steps) and a scan at 2 lrs: every reward curve rises from
    0 to 0.5 by step 5; pacs's then dips to 0.3 for steps 20-29, grpo's to 0.4, ppo's never; ppo's steps take twice
    as long (1.0 s against 0.5 s)."""
    curve = lambda depth: [0.0] * 5 + [0.5] * 15 + [0.5 - depth] * 10 + [0.5] * 10  # smoothed: falls by `depth`
    for seed in range(4):
        _write(root, "test-p4", _result("pacs", seed, curve(0.2), pass1=0.40 + 0.01 * seed))
        _write(root, "test-p4", _result("grpo", seed, curve(0.1), pass1=0.40 + 0.02 * seed))
        _write(root, "test-p4", _result("ppo", seed, curve(0.0), step_times=[1.0] * 40, pass1=0.45))
        for lr in (1e-4, 2e-4):
            for m in ("pacs", "grpo", "ppo"):
                _write(root, f"val-p4-lr{lr:g}", _result(m, 1000 + seed % 2, [0.1] * 12, lr=lr,
                                                         pass1=0.5 if lr == 1e-4 else 0.3))


def test_the_summary_entries_on_a_synthetic_lab(tmp_path):
    _synthetic_lab(str(tmp_path))
    summary = stability.summary_json(str(tmp_path), prompts=4, last=2)
    check_stability_schema(summary)
    st, ef = summary["stability"], summary["efficiency"]
    dd = {(p["b"], p["metric"]): p for p in st["paired"]}
    # pacs falls 0.2 below its smoothed maximum 0.5, grpo 0.1, ppo never: the same at every seed
    assert dd["grpo", "drawdown"]["mean"] == pytest.approx(0.1) and dd["ppo", "drawdown"]["mean"] == pytest.approx(0.2)
    assert dd["grpo", "drawdown"]["seeds"] == 4
    tm = next(p for p in ef["paired"] if (p["b"], p["metric"]) == ("ppo", "log_step_time"))
    assert tm["mean"] == pytest.approx(math.log(0.5), abs=1e-5)  # half of ppo's step time
    spread = next(s for s in st["spread"] if s["b"] == "grpo")
    assert spread["ratio"] == pytest.approx(0.5, abs=1e-5)  # pacs's pass@1 steps by 0.01 a seed, grpo's by 0.02
    assert st["base_pass@1"] is None and st["below_base"] == [] and ef["parameters"] is None  # no lab dir
    assert st["lr"]["methods"]["pacs"]["loss_2x"] == pytest.approx(0.2)
    assert ef["no_gain"] == [] and st["unmeasured"] == [] and ef["unmeasured"] == []
    # sweep.CLAIMS's pairs that ran (no critic-off, reinforce)
    assert [p["b"] for p in st["spread"]] == ["grpo", "ppo"]


def test_a_control_run_is_compared_as_its_own_method(tmp_path):
    _synthetic_lab(str(tmp_path))
    for seed in range(4):
        _write(str(tmp_path), "control-p4-lr5e-05", _result("ppo", seed, [0.2] * 40, pass1=0.45, lr=5e-5))
    summary = stability.summary_json(str(tmp_path), prompts=4, last=2)
    check_stability_schema(summary)
    assert [p["b"] for p in summary["stability"]["spread"]] == ["grpo", "ppo", "ppo@lr5e-05"]
    flat = next(p for p in summary["efficiency"]["paired"] if (p["b"], p["metric"]) == ("ppo@lr5e-05", "mean_reward"))
    assert flat["seeds"] == 4
    assert "ppo@lr5e-05-s0" in summary["efficiency"]["no_gain"]  # a flat reward gains nothing


def test_every_committed_lab_summary_has_stability_and_efficiency():
    """experiments/labs/lab/summary.json and experiments/labs/lab2/summary.json (every lab that ships a base) carry
    both entries in their schema, with the parameters counted from the shipped model and the base model's pass@1 from
    lab.json."""
    labs = sorted(os.path.dirname(p) for p in glob.glob(os.path.join(ROOT, "experiments", "labs", "*", "summary.json"))
                  if os.path.isfile(os.path.join(os.path.dirname(p), "base", "lab.json")))
    assert {os.path.basename(d) for d in labs} >= {"lab", "lab2"}
    for lab in labs:
        summary = json.load(open(os.path.join(lab, "summary.json")))
        check_stability_schema(summary)
        built = json.load(open(os.path.join(lab, "base", "lab.json")))
        assert summary["stability"]["base_pass@1"] == built["test_pass@k"]["1"]
        assert summary["efficiency"]["parameters"]["pacs"]["policy"] == built["parameters"]


def test_the_cli_prints_tables_and_draws_the_figure(tmp_path, capsys):
    _synthetic_lab(str(tmp_path / "runs"))
    summary = stability.summary_json(str(tmp_path / "runs"), prompts=4, last=2)
    (tmp_path / "labx").mkdir()
    (tmp_path / "labx" / "summary.json").write_text(json.dumps(summary))
    stability.main(["--table", str(tmp_path / "labx")])
    out = capsys.readouterr().out
    assert "| grpo (4 seeds) |" in out and "Stability row: " in out and "Efficiency row: " in out
    stability.main(["--figure", str(tmp_path / "lr.png"), str(tmp_path / "labx")])
    assert os.path.getsize(tmp_path / "lr.png") > 10_000
    with pytest.raises(SystemExit, match="^stability.py: error: no summary.json in "):
        stability.main(["--table", str(tmp_path)])
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "summary.json").write_text(json.dumps({"settings": {}}))
    with pytest.raises(SystemExit, match="has no stability/efficiency entries"):
        stability.main(["--table", str(tmp_path / "old")])
