"""experiments/trend.py and the files it runs (stats.py, sweep.py, summary.py, lab_summary.py, figures.py; and
curves.py): the statistics (t-interval, paired bootstrap, claim sentences), the resumable sweep
(the pacs.py / eval.py runner replaced by a fake that writes their files), CLI errors, and one in-process
end-to-end sweep on the tiny model that checks pacs.py and eval.py accept every flag the sweep passes."""
import glob
import json
import math
import os
import re
import statistics as pystats
import sys
import types

import numpy as np
import pytest
from scipy import stats as scipy_stats

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
import lab_summary  # noqa: E402
import stats as trend_stats  # noqa: E402
import summary  # noqa: E402
import sweep  # noqa: E402
import trend  # noqa: E402


# ---- statistics ------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [0.9, 0.975, 0.995])
def test_t_interval_matches_closed_forms(p):
    """Half-width t_{p, n-1} * s / sqrt(n): at n = 2 (df = 1, the Cauchy distribution) and n = 3 (df = 2) the
    quantile has a closed form; at a huge n it is the normal's."""
    level = 2 * p - 1
    for x, q in (([0.2, 0.5], math.tan(math.pi * (p - 0.5))),
                 ([0.2, 0.5, 0.6], (2 * p - 1) / math.sqrt(2 * p * (1 - p)))):
        mean, lo, hi = trend_stats.t_interval(x, level)
        assert hi - mean == pytest.approx(q * np.std(x, ddof=1) / math.sqrt(len(x)), rel=1e-7)
        assert mean - lo == pytest.approx(hi - mean, rel=1e-12)
    x = np.random.default_rng(0).standard_normal(200001)
    mean, lo, hi = trend_stats.t_interval(x, level)
    assert hi - mean == pytest.approx(pystats.NormalDist().inv_cdf(p) * x.std(ddof=1) / math.sqrt(len(x)), rel=1e-4)


def test_t_interval_is_mean_plus_minus_t_times_standard_error():
    x = [0.2, 0.5, 0.6]  # n = 3: df = 2, whose 97.5% quantile has a closed form
    q = (2 * 0.975 - 1) / math.sqrt(2 * 0.975 * 0.025)
    half = q * np.std(x, ddof=1) / math.sqrt(3)
    mean, lo, hi = trend_stats.t_interval(x)
    assert (mean, lo, hi) == pytest.approx((np.mean(x), np.mean(x) - half, np.mean(x) + half), rel=1e-7)
    one = trend_stats.t_interval([0.4])
    assert one[0] == 0.4 and math.isnan(one[1]) and math.isnan(one[2])


def test_smallest_detectable_difference():
    """(t_{0.975, n-1} + t_{0.8, n-1}) s / sqrt(n): at n = 3 both quantiles have closed forms; and a difference
    of that size, tested by a paired t-test at 5% on normal samples of the same spread, is found about 4 times in 5."""
    x = [0.2, 0.5, 0.6]
    q = lambda p: (2 * p - 1) / math.sqrt(2 * p * (1 - p))  # df = 2
    assert trend_stats.smallest_detectable(x) == pytest.approx((q(0.975) + q(0.8)) * np.std(x, ddof=1) / math.sqrt(3),
                                                               rel=1e-7)
    assert math.isnan(trend_stats.smallest_detectable([0.1]))
    n, rng = 16, np.random.default_rng(0)
    spread_1 = np.linspace(-1, 1, n) / np.std(np.linspace(-1, 1, n), ddof=1)  # (n,): sample standard deviation 1
    delta = trend_stats.smallest_detectable(spread_1)
    crit = 2.1314  # t_{0.975, 15}, from the tables
    samples = rng.standard_normal((4000, n)) + delta  # (sims, n): differences of spread 1 and mean delta
    t = samples.mean(1) / (samples.std(1, ddof=1) / math.sqrt(n))
    assert 0.75 < float(np.mean(np.abs(t) > crit)) < 0.85


def test_paired_p_is_the_paired_t_tests_and_agrees_with_the_t_interval():
    """At n = 3 (df = 2) the two-sided p of t has a closed form, 1 - |t| / sqrt(2 + t^2); p < 0.05 exactly when the
    95% t-interval excludes 0; too few or unspread differences give nan."""
    d = [0.01, 0.03, 0.08]
    t = np.mean(d) / (np.std(d, ddof=1) / math.sqrt(3))
    assert trend_stats.paired_p(d) == pytest.approx(1 - abs(t) / math.sqrt(2 + t * t), rel=1e-7)
    rng = np.random.default_rng(1)
    for _ in range(200):
        a = rng.random(14)  # (14,): one method's pass@1 over 14 seeds; b the other's, paired
        b = a - rng.normal(0.02, 0.03, 14)
        x = a - b
        assert trend_stats.paired_p(x) == pytest.approx(scipy_stats.ttest_rel(a, b).pvalue, rel=1e-9)
        mean, lo, hi = trend_stats.t_interval(x)
        assert (trend_stats.paired_p(x) < 0.05) == (lo > 0 or hi < 0)
    assert math.isnan(trend_stats.paired_p([0.1])) and math.isnan(trend_stats.paired_p([0.1, 0.1]))


def test_paired_bootstrap_cancels_the_seed_spread():
    # seeds differ a lot (0.1 .. 0.9), but a beats b by exactly 0.1 at every seed: pairing sees only the 0.1
    b = {s: 0.1 + 0.16 * s for s in range(6)}
    a = {s: v + 0.1 for s, v in b.items()}
    seeds, d = trend_stats.paired_differences(a, b)
    assert seeds == list(range(6))
    mean, lo, hi = trend_stats.bootstrap_interval(d)
    assert (mean, lo, hi) == pytest.approx((0.1, 0.1, 0.1))
    # unpaired, the two methods' own intervals overlap widely: only the pairing separates them
    _, a_lo, a_hi = trend_stats.t_interval(list(a.values()))
    _, b_lo, b_hi = trend_stats.t_interval(list(b.values()))
    assert a_lo < b_hi and b_lo < a_hi
    # only seeds both have are paired
    seeds, d = trend_stats.paired_differences({0: 1.0, 1: 2.0, 2: 3.0}, {1: 0.5, 2: 1.0, 3: 9.0})
    assert seeds == [1, 2] and d.tolist() == [1.5, 2.0]


def test_bootstrap_interval_resamples_seeds():
    d = np.array([-0.3, 0.1, 0.2, -0.1, 0.4, 0.0])
    mean, lo, hi = trend_stats.bootstrap_interval(d, n_boot=20000)
    assert mean == pytest.approx(d.mean())
    assert d.min() <= lo < mean < hi <= d.max() and lo < 0 < hi
    # the resampled means of n seeds spread like s / sqrt(n): the interval's width is about 2 * 1.96 of it
    se = d.std(ddof=0) / math.sqrt(len(d))
    assert hi - lo == pytest.approx(2 * 1.96 * se, rel=0.15)
    assert trend_stats.bootstrap_interval(d) == trend_stats.bootstrap_interval(d)  # seeded: a rerun prints the same
    assert math.isnan(trend_stats.bootstrap_interval([0.2])[1])


def test_claim_sentence_says_whether_the_interval_excludes_zero():
    s = trend_stats.claim_sentence("pacs", "grpo", "synthetic pass@1", 6, (0.1, 0.02, 0.2), (0.1, 0.01, 0.19))
    assert "excludes zero: pacs is higher" in s and "t-interval" not in s
    s = trend_stats.claim_sentence("pacs", "grpo", "final entropy", 6, (-0.1, -0.2, -0.01), (-0.1, -0.21, -0.02))
    assert "excludes zero: pacs is lower" in s
    s = trend_stats.claim_sentence("pacs", "grpo", "synthetic pass@1", 6, (0.05, -0.02, 0.12), (0.05, -0.04, 0.14))
    assert "includes zero: pacs and grpo do not separate" in s
    # an end exactly at zero does not exclude it
    s = trend_stats.claim_sentence("pacs", "grpo", "synthetic pass@1", 6, (0.05, 0.0, 0.1), (0.05, -0.01, 0.11))
    assert "includes zero" in s and "higher" not in s
    # the bootstrap excludes zero, the t-interval does not: the sentence says so
    s = trend_stats.claim_sentence("pacs", "reinforce", "synthetic pass@1", 6, (0.05, 0.01, 0.1), (0.05, -0.01, 0.11))
    assert "excludes zero: pacs is higher" in s and "paired t-interval, [-0.010, +0.110], includes zero" in s
    s = trend_stats.claim_sentence("pacs", "grpo", "synthetic pass@1", 1, (0.05, math.nan, math.nan), (0.05,) * 3)
    assert "too few seeds" in s and "excludes" not in s and "includes" not in s


# ---- the sweep, with pacs.py and eval.py replaced by fakes that write their files --------------------
def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def _fake_value(model_path, k):
    """Held-out pass@k the fake eval reports: base 0.2; pacs beats grpo by 0.1 at every seed."""
    m = re.search(r"/([a-z0-9-]+)-s(\d+)/checkpoint-", model_path)
    if not m:
        return min(1.0, 0.2 + 0.02 * (k - 1))
    method, seed = m.group(1), int(m.group(2))
    return min(1.0, {"pacs": 0.5, "grpo": 0.4}.get(method, 0.3) + 0.05 * seed + 0.02 * (k - 1))


class FakeRunner:
    """Stands in for sweep.run_command: records each call and writes what pacs.py / eval.py would."""

    def __init__(self):
        self.calls = []

    def __call__(self, cmd):
        script = os.path.basename(cmd[1])
        self.calls.append((script, cmd))
        if script == "pacs.py":
            out, steps = _flag(cmd, "--out-dir"), int(_flag(cmd, "--steps"))
            assert "--resume" in cmd
            os.makedirs(out, exist_ok=True)
            start = sweep.trained_steps(out)
            critic = "--algo" in cmd and _flag(cmd, "--algo") in ("pacs", "ppo")
            with open(os.path.join(out, "metrics.jsonl"), "a") as f:
                for step in range(start, steps):
                    row = {"step": step, "reward": 0.1 * step, "entropy": 1.0 - 0.01 * step}
                    if critic:  # 2 pairs at even steps, ranked 0.5 + 0.05 * seed; none at odd steps
                        seed = int(_flag(cmd, "--seed"))
                        row.update({"critic_pairs": 2 * (step % 2 == 0), "critic_shift": 0.01 * step,
                                    "critic_auc": 0.5 + 0.05 * seed if step % 2 == 0 else None,
                                    # reliability counts: 4 responses a step in bin 7 (sigma ~ 0.505), 3 right
                                    "critic_calibration": {"n": [0] * 7 + [4] + [0] * 6,
                                                           "sigma": [0.0] * 7 + [2.02] + [0.0] * 6,
                                                           "right": [0] * 7 + [3] + [0] * 6}})
                    f.write(json.dumps(row) + "\n")
            ckpt = os.path.join(out, f"checkpoint-{steps - 1:06d}")
            os.makedirs(ckpt, exist_ok=True)
            open(os.path.join(ckpt, "trainer_state.pt"), "w").close()
        else:
            out, n = _flag(cmd, "--out"), int(_flag(cmd, "--n"))
            ks = [int(k) for k in _flag(cmd, "--k").split(",")]
            assert ks == list(range(1, n + 1))
            os.makedirs(out, exist_ok=True)
            metrics = {"datasets": {"synthetic": {"pass@k": {str(k): _fake_value(_flag(cmd, "--model"), k)
                                                             for k in ks}}}}
            with open(os.path.join(out, "metrics.json"), "w") as f:
                json.dump(metrics, f)
            with open(os.path.join(out, "samples.jsonl"), "w") as f:  # 3 right (one a boxed expression), 1 wrong
                f.write(json.dumps({"extracted": ["66", "71-5", "-3", "65"], "correct": [True, True, True, False]})
                        + "\n")

    def scripts(self):
        return [(s, _flag(c, "--out-dir") if s == "pacs.py" else _flag(c, "--out")) for s, c in self.calls]


def _argv(out, *more):
    return ["--out", str(out), "--methods", "pacs", "grpo", "--seeds", "0", "1", "2", "--steps", "4",
            "--eval-n", "4", "--last", "2", *more]


def test_sweep_runs_everything_once_and_resumes(tmp_path, monkeypatch):
    fake = FakeRunner()
    monkeypatch.setattr(sweep, "run_command", fake)
    out = tmp_path / "sweep"
    trend.main(_argv(out))
    # base eval, then for each seed and method: train, eval of the final checkpoint
    assert len(fake.calls) == 1 + 3 * 2 * 2
    evals = [c for s, c in fake.calls if s == "eval.py"][1:]
    assert all(_flag(c, "--model").endswith("checkpoint-000003") for c in evals)

    fake.calls.clear()
    trend.main(_argv(out))  # everything finished: nothing runs again
    assert fake.calls == []

    # a run killed after its checkpoint at step 1, and an eval killed before its metrics.json
    run = out / "grpo-s1"
    os.rename(run / "checkpoint-000003", run / "checkpoint-000001")
    os.remove(run / "eval-step4" / "metrics.json")
    os.remove(out / "pacs-s2" / "eval-step4" / "metrics.json")
    trend.main(_argv(out))
    assert fake.scripts() == [("pacs.py", str(run)), ("eval.py", str(run / "eval-step4")),
                              ("eval.py", str(out / "pacs-s2" / "eval-step4"))]

    # a longer --steps extends every run and evaluates its new final checkpoint
    fake.calls.clear()
    trend.main(_argv(out)[:-6] + ["--steps", "5", "--eval-n", "4", "--last", "2"])
    assert sorted(s for s, _ in fake.calls) == ["eval.py"] * 6 + ["pacs.py"] * 6
    assert os.path.isfile(out / "pacs-s0" / "eval-step5" / "metrics.json")


def test_summary_statistics_from_the_run_files(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "run_command", FakeRunner())
    out = tmp_path / "sweep"
    trend.main(_argv(out))
    stats = json.load(open(out / "stats.json"))
    pacs_p1 = stats["per_method"]["synthetic pass@1"]["pacs"]
    assert pacs_p1["n"] == 3
    assert pacs_p1["mean_ci95_t"] == pytest.approx(list(trend_stats.t_interval([0.5, 0.55, 0.6])))
    # final reward: mean of the last --last 2 of steps 0..3, rewards 0.1 * step
    assert stats["values"]["final training reward"]["grpo"]["1"] == pytest.approx(0.25)
    claim = next(c for c in stats["claims"] if c["b"] == "grpo" and c["metric"] == "synthetic pass@1")
    assert claim["diffs"] == pytest.approx([0.1, 0.1, 0.1])
    assert "excludes zero: pacs is higher" in claim["sentence"]
    entropy = next(c for c in stats["claims"] if c["metric"] == "final entropy")
    assert "includes zero" in entropy["sentence"]  # the fake entropy is the same for every method
    assert not any(c["b"] == "reinforce" for c in stats["claims"])  # reinforce was not run
    summary_md = (out / "summary.md").read_text()
    assert claim["sentence"] in summary_md and "| base model | - | 0.200 | 0.260 |" in summary_md
    assert summary_md.splitlines()[0].endswith(f"4 steps, lr {trend.parse_args(_argv(out)).lr:g}")
    # the header names the lr the runs had: one value when every method shares it, else each method's
    empty = {"values": {}, "claims": [], "critic": {}}
    for more, header in ((["--method-lr", "pacs=1e-4", "grpo=1e-4"], "lr 0.0001"),
                         (["--method-lr", "grpo=3e-5"], "lr pacs 1e-05, grpo 3e-05")):
        args = trend.parse_args(_argv(tmp_path / "header", "--lr", "1e-5", *more))
        os.makedirs(args.out, exist_ok=True)
        assert summary.write_summary(args, {"pacs": {}, "grpo": {}}, [], empty, None).splitlines()[0].endswith(header)
    assert os.path.getsize(out / "trend_passk.png") > 0 and os.path.getsize(out / "trend_curves.png") > 0
    # the critic: AUC pooled over a run's steps, per seed 0.5, 0.55, 0.6; the shift's mean over steps 0..3
    auc = stats["critic"]["pacs"]["critic_auc"]
    assert auc["per_seed"] == {"0": pytest.approx(0.5), "1": pytest.approx(0.55), "2": pytest.approx(0.6)}
    assert auc["mean_ci95_t"] == pytest.approx(list(trend_stats.t_interval([0.5, 0.55, 0.6])))
    assert stats["critic"]["pacs"]["critic_shift"]["mean_ci95_t"][0] == pytest.approx(0.015)
    assert "grpo" not in stats["critic"] and auc["sentence"] in summary_md
    assert os.path.getsize(out / "trend_critic.png") > 0


def test_changed_settings_and_overtrained_runs_are_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sweep, "run_command", FakeRunner())
    out = tmp_path / "sweep"
    trend.main(_argv(out))
    with pytest.raises(SystemExit) as e:
        trend.main(_argv(out, "--lr", "1e-6"))
    assert str(e.value).startswith("trend.py: error:") and "--lr 1e-05 there, 1e-06 now" in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(SystemExit) as e:
        trend.main(_argv(out)[:-6] + ["--steps", "3", "--eval-n", "4", "--last", "2"])
    assert "has trained 4 steps, more than --steps 3" in str(e.value)
    # a method whose pacs.py flags changed since its runs were made (grpo was token-mean once)
    monkeypatch.setitem(sweep.METHODS, "grpo", ["--algo", "grpo", "--loss-agg", "token-mean"])
    with pytest.raises(SystemExit) as e:
        trend.main(_argv(out))
    assert "holds grpo runs made with other pacs.py flags (['--algo', 'grpo'] there" in str(e.value)


@pytest.mark.parametrize("more, message", [
    (["--methods", "pacs", "dpo"], "unknown method 'dpo'"),
    (["--prompts", "6"], "--prompts 6 is not divisible by --num-mini-batches 4"),
    (["--seeds", "0", "0"], "repeats a seed"),
    (["--pass-k", "32"], "--pass-k 32 must be in 1..--eval-n (16)"),
    (["--eval-n", "0"], "--eval-n 0 is out of range"),
    (["--eval-datasets", " "], "--eval-datasets is empty"),
])
def test_bad_flags_give_one_line(tmp_path, more, message):
    with pytest.raises(SystemExit) as e:
        trend.main(["--out", str(tmp_path / "x"), *more])
    assert str(e.value).startswith("trend.py: error:") and message in str(e.value) and "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "x")  # refused before anything is written


def test_methods_are_the_papers_runs():
    assert sweep.resolve_methods(["pacs-beta1", "pacs", "grpo", "pacs-est-rloo"]) == ["pacs", "grpo"]
    flags = {m: " ".join(f) for m, f in sweep.METHODS.items()}
    assert "--beta 2.0" in flags["pacs-beta2"] and "--no-balance" in flags["pacs-no-balance"]
    assert "--estimator grpo" in flags["pacs-est-grpo"] and "--estimator drgrpo" in flags["pacs-est-drgrpo"]
    assert flags["grpo"] == "--algo grpo" and flags["reinforce"] == "--algo reinforce" and flags["ppo"] == "--algo ppo"
    assert flags["pacs-critic-off"] == flags["pacs"] + " --no-implicit-critic"
    assert sweep.DEFAULT_METHODS == ["pacs", "pacs-critic-off", "grpo", "ppo", "reinforce"]


def test_every_methods_command_is_a_valid_pacs_config(tmp_path):
    """pacs.py parses each run's command into the config the method names (no training)."""
    import pacs
    import plumbing
    args = trend.parse_args(["--out", str(tmp_path), "--pacs-args", "--micro-batch-size 8"])
    trend.check_args(args)
    want = {"pacs": ("pacs", 1.0, "rloo", True), "pacs-beta2": ("pacs", 2.0, "rloo", True),
            "pacs-est-grpo": ("pacs", 1.0, "grpo", True), "pacs-est-drgrpo": ("pacs", 1.0, "drgrpo", True),
            "pacs-no-balance": ("pacs", 1.0, "rloo", False), "pacs-critic-off": ("pacs", 1.0, "rloo", True),
            "pacs-critic-class-shuffled": ("pacs", 1.0, "rloo", True),
            "pacs-critic-group-shuffled": ("pacs", 1.0, "rloo", True)}
    for method in sweep.METHODS:
        cmd = sweep.train_command(args, method, 3)
        if "--critic-control" in cmd:  # a critic control: pacs.py's flags and one more, run by critic_controls.py
            assert cmd[1] == os.path.join("experiments", "critic_controls.py")
            i = cmd.index("--critic-control")
            assert cmd[i + 1] == method.removeprefix("pacs-critic-")
            cmd = cmd[:i] + cmd[i + 2:]
        else:
            assert cmd[1] == "pacs.py"
        cfg = pacs.parse_args(cmd[2:])
        plumbing.check_config(cfg)
        assert (cfg.seed, cfg.num_mini_batches, cfg.prompts_per_step, cfg.micro_batch_size) == (3, 4, 4, 8)
        assert cfg.resume and cfg.out_dir == os.path.join(str(tmp_path), f"{method}-s3")
        if method in want:
            assert (cfg.algo, cfg.beta, cfg.estimator, cfg.balance) == want[method]
            assert cfg.implicit_critic == (method != "pacs-critic-off")
        else:
            assert cfg.algo == method.split("-")[0]
    # the earlier sweep's grpo: verl's default token-mean, no dual clip, no grad clip; the paper's is the default
    old = pacs.parse_args(sweep.train_command(args, "grpo-token-mean", 0)[2:])
    paper = pacs.parse_args(sweep.train_command(args, "grpo", 0)[2:])
    assert (old.loss_agg, old.clip_c, old.max_grad_norm) == ("token-mean", 0.0, 0.0)
    assert (paper.loss_agg, paper.clip_c, paper.max_grad_norm) == ("seq-mean-token-sum-norm", 3.0, 1.0)


# ---- result files (--results), the lab preset, the lab's summary.json ---------------------------------
def test_result_files_alone_resume_and_summarize_a_sweep(tmp_path, monkeypatch):
    fake = FakeRunner()
    monkeypatch.setattr(sweep, "run_command", fake)
    out, results = tmp_path / "sweep", tmp_path / "results"
    trend.main(_argv(out, "--results", str(results)))
    assert sorted(os.listdir(results)) == [f"{m}-s{s}.json" for m in ("grpo", "pacs") for s in range(3)]
    r = json.load(open(results / "pacs-s1.json"))
    assert (r["method"], r["seed"], r["settings"]["lr"], r["settings"]["steps"]) == ("pacs", 1, 1e-5, 4)
    assert r["metrics"]["reward"] == pytest.approx([0.0, 0.1, 0.2, 0.3]) and r["metrics"]["critic_pairs"][0] == 2
    assert r["eval"]["synthetic"]["1"] == pytest.approx(0.55) and len(r["eval"]["synthetic"]) == 4
    assert r["boxed_expressions"] == pytest.approx(1 / 3)  # "71-5" of the 3 right ones; "-3" is an integer
    stats = json.load(open(out / "stats.json"))
    # a fresh machine: only the result files survive; nothing is trained or evaluated again but the base model
    import shutil
    shutil.rmtree(out)
    fake.calls.clear()
    trend.main(_argv(out, "--results", str(results)))
    assert [s for s, _ in fake.calls] == ["eval.py"] and fake.calls[0][1][fake.calls[0][1].index("--out") + 1] \
        == str(out / "eval_base")
    again = json.load(open(out / "stats.json"))
    assert again["values"] == stats["values"] and again["claims"] == stats["claims"]
    shutil.rmtree(out)  # --plot-only from the result files alone: the summary and figures, nothing run
    fake.calls.clear()
    trend.main(_argv(out, "--results", str(results), "--plot-only"))
    assert fake.calls == [] and json.load(open(out / "stats.json"))["claims"] == stats["claims"]
    # a result file made with other settings is refused, in one line
    with pytest.raises(SystemExit) as e:
        trend.main(_argv(tmp_path / "other", "--results", str(results), "--method-lr", "grpo=3e-5"))
    assert str(e.value).startswith("trend.py: error: ") and "lr 1e-05 there, 3e-05 now" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_sweep_json_from_before_the_new_keys_is_still_accepted(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "run_command", FakeRunner())
    out = tmp_path / "sweep"
    trend.main(_argv(out))
    saved = json.load(open(out / "sweep.json"))
    for key in sweep.NEW_SWEEP_KEYS:
        del saved[key]
    (out / "sweep.json").write_text(json.dumps(saved))
    trend.main(_argv(out))  # the same settings: accepted, and sweep.json now holds the new keys
    assert json.load(open(out / "sweep.json"))["critic_lr_ratio"] == 0.0
    (out / "sweep.json").write_text(json.dumps(saved))
    with pytest.raises(SystemExit, match="--critic-lr-ratio None there, 10.0 now"):  # another value: refused
        trend.main(_argv(out, "--critic-lr-ratio", "10"))


def test_method_lr_sets_one_methods_learning_rate(tmp_path):
    import pacs
    args = trend.parse_args(["--out", str(tmp_path), "--lr", "2e-5", "--method-lr", "grpo=1e-6", "ppo=3e-6"])
    trend.check_args(args)
    lrs = {m: pacs.parse_args(sweep.train_command(args, m, 0)[2:]).lr for m in ("pacs", "grpo", "ppo")}
    assert lrs == {"pacs": 2e-5, "grpo": 1e-6, "ppo": 3e-6}
    assert pacs.parse_args(sweep.train_command(args, "ppo", 0)[2:]).critic_lr == 1e-5  # ratio 0: pacs.py's default
    args.critic_lr_ratio = 10.0  # the paper's: the value model at 10x its actor's lr
    critic = {m: pacs.parse_args(sweep.train_command(args, m, 0)[2:]).critic_lr for m in ("pacs", "ppo")}
    assert critic["ppo"] == pytest.approx(3e-5) and critic["pacs"] == 1e-5  # only PPO has a value model
    with pytest.raises(SystemExit):
        trend.parse_args(["--method-lr", "grpo:1e-6"])
    with pytest.raises(SystemExit) as e:
        trend.main(["--out", str(tmp_path / "x"), "--method-lr", "dpo=1e-6"])
    assert "--method-lr dpo=1e-06: expected a method" in str(e.value)


def _fake_lab(path, n_train=40):
    os.makedirs(path / "model")
    (path / "lab.json").write_text(json.dumps({"weights_sha256": "ab" * 32}))
    (path / "train.jsonl").write_text("".join(json.dumps({"problem": f"{i}", "answer": "1"}) + "\n"
                                              for i in range(n_train)))
    return str(path)


def test_a_lab_sweep_without_its_base_eval_reads_the_base_pass_at_k_from_lab_json(tmp_path):
    lab = _fake_lab(tmp_path / "lab")
    args = trend.parse_args(["--lab", lab, "--out", str(tmp_path / "out")])
    trend.check_args(args)
    assert summary.base_pass_at_k(args) is None  # lab.json without test_pass@k
    (tmp_path / "lab" / "lab.json").write_text(json.dumps({"test_pass@k": {"1": 0.3, "2": 0.45}}))
    assert summary.base_pass_at_k(args) == {"test": {1: 0.3, 2: 0.45}}
    val = trend.parse_args(["--lab", lab, "--out", str(tmp_path / "out"), "--split", "val"])
    trend.check_args(val)
    assert summary.base_pass_at_k(val) is None  # lab.py measured the test split only
    (tmp_path / "out" / "eval_base").mkdir(parents=True)  # an eval in --out wins
    (tmp_path / "out" / "eval_base" / "metrics.json").write_text(
        json.dumps({"datasets": {"test": {"pass@k": {"1": 0.31}}}}))
    assert summary.base_pass_at_k(args) == {"test": {1: 0.31}}


def test_lab_preset_fills_the_flags_left_unset(tmp_path):
    lab = _fake_lab(tmp_path / "lab")
    args = trend.parse_args(["--lab", lab])
    assert (args.prompts, args.group_size, args.num_mini_batches, args.steps) == (32, 8, 4, 150)
    assert (args.eval_n, args.eval_problems, args.eval_temperature, args.seeds) == (64, 0, 1.0, list(range(16)))
    assert args.model == os.path.join(lab, "model") and args.dataset == os.path.join(lab, "train.jsonl")
    assert trend.parse_args(["--lab", os.path.relpath(lab)]).model == args.model  # absolute: runs start in ROOT
    assert args.eval_datasets == os.path.join(lab, "test.jsonl")
    # a lab built elsewhere keeps its results inside it; a shipped one (experiments/labs/<tag>/base) in
    # experiments/labs/<tag>/results/
    assert (args.results == os.path.join(lab, "results", "test-p32")
            and args.out.endswith("experiments/out_lab/test-p32"))
    shipped = trend.parse_args(["--lab"])
    assert shipped.model == os.path.join(sweep.ROOT, "experiments", "labs", "lab", "base", "model")
    assert shipped.results == os.path.join(sweep.ROOT, "experiments", "labs", "lab", "results", "test-p32")
    assert shipped.out == os.path.join(sweep.ROOT, "experiments", "out_lab", "test-p32")
    other = _fake_lab(tmp_path / "docs" / "lab2" / "base")
    json.dump({"weights_sha256": "cd" * 32, "settings": {"max_new_tokens": 48, "eval_n": 256}},
              open(os.path.join(other, "lab.json"), "w"))
    second = trend.parse_args(["--lab", other])  # the lab's own response length and eval samples
    assert (second.max_new_tokens, second.eval_n) == (48, 256) and (args.max_new_tokens, args.eval_n) == (32, 64)
    assert second.results == str(tmp_path / "docs" / "lab2" / "results" / "test-p32")
    assert second.out.endswith("experiments/out_lab2/test-p32")
    # a lab's other bases (experiments/labs/<tag>/bases/seed<N>): results inside each, run dirs apart from another
    # lab's seed<N>
    for tag in ("lab", "lab2"):
        seed2 = trend.parse_args(["--lab", _fake_lab(tmp_path / "docs" / tag / "bases" / "seed2")])
        assert seed2.results == str(tmp_path / "docs" / tag / "bases" / "seed2" / "results" / "test-p32")
        assert seed2.out == os.path.join(sweep.ROOT, "experiments", f"out_{tag}-seed2", "test-p32")
    given = trend.parse_args(["--lab", lab, "--prompts", "4", "--steps", "3"])
    assert (given.prompts, given.steps, given.results.endswith("results/test-p4")) == (4, 3, True)
    assert args.pacs_args == "--micro-batch-size 64 --device cpu"  # a mini-batch of 8 prompts in one forward
    assert given.pacs_args == "--micro-batch-size 8 --device cpu"  # 1 prompt per mini-batch: its 8 rows
    assert trend.parse_args(["--lab", lab, "--prompts", "128"]).pacs_args == "--micro-batch-size 64 --device cpu"
    import pacs
    import plumbing
    for a in (args, given):  # pacs.py accepts the micro-batch the preset picks
        trend.check_args(a)
        plumbing.check_config(pacs.parse_args(sweep.train_command(a, "pacs", 0)[2:]))
    scan = trend.parse_args(["--lab", lab, "--split", "val", "--lr", "3e-5"])
    assert scan.eval_datasets.endswith("val.jsonl") and scan.results.endswith("results/val-p32-lr3e-05")
    with pytest.raises(SystemExit) as e:  # the split is smaller than one step's prompts
        trend.main(["--lab", _fake_lab(tmp_path / "small", n_train=20), "--out", str(tmp_path / "o"), "--dry-run"])
    assert str(e.value) == (f"trend.py: error: {tmp_path / 'small' / 'train.jsonl'} holds 20 problems, fewer than "
                            "--prompts 32 per step")
    with pytest.raises(SystemExit) as e:
        trend.main(["--lab", str(tmp_path), "--out", str(tmp_path / "o"), "--dry-run"])
    assert "is not a finished lab (no lab.json)" in str(e.value)


SUMMARY_RUN_KEYS = {"method", "seed", "pass@1", "pass@64", "final_reward", "final_entropy", "critic_auc",
                    "boxed_expressions"}


def check_summary_schema(summary):
    """The schema of experiments/labs/lab/summary.json (and a few more settings): the keys and their types. The first
    sweep's (the archive's) predates beta_axis and calibration."""
    assert {"settings", "runs", "axis", "paired", "wall_s"} <= set(summary) <= {
        "settings", "runs", "axis", "paired", "wall_s", "beta_axis", "calibration", "base", "rare", "control",
        "decomposition", "critic_window", "bases", "stability", "efficiency", "reference", "v2_ablations", "countdown"}
    if "countdown" in summary:  # the countdown lab's: out of domain and the diversity of its right answers
        cd = summary["countdown"]
        assert set(cd) == {"ood_dataset", "diversity_dataset", "k", "embedders", "base_ood_pass@k", "runs", "paired"}
        assert all(0 <= r["ood_pass@1"] <= 1 and {f"s_div_{e}" for e in cd["embedders"]} <= set(r) for r in cd["runs"])
        assert {p["metric"] for p in cd["paired"]} <= set(lab_summary.COUNTDOWN_METRICS)
    settings = summary["settings"]
    for key in ("prompts", "group_size", "num_mini_batches", "steps", "max_new_tokens", "eval_n"):
        assert isinstance(settings[key], int) and settings[key] >= 1, key
    assert isinstance(settings["eval_temperature"], float) and isinstance(settings["final_mean_of_last_steps"], int)
    methods = {r["method"] for r in summary["runs"]}
    assert set(settings["lr"]) == set(settings["pacs_flags"]) == set(settings["seeds"]) == methods
    assert all(isinstance(v, float) and v > 0 for v in settings["lr"].values())
    assert all(isinstance(s, int) for seeds in settings["seeds"].values() for s in seeds)
    for r in summary["runs"]:
        assert set(r) in (SUMMARY_RUN_KEYS, SUMMARY_RUN_KEYS | {"pass@16", "pass@256"}) and isinstance(r["seed"], int)
        for key in ("pass@1", "final_reward", "boxed_expressions"):
            assert 0 <= r[key] <= 1, (key, r)
        assert r["pass@64"] is None or r["pass@1"] <= r["pass@64"] <= 1
        assert r["critic_auc"] is None or 0 <= r["critic_auc"] <= 1
        assert r["final_entropy"] >= 0
    for a in summary["axis"]:
        assert set(a) == {"prompts_per_mini_batch", "method", "seed", "critic_auc", "pass@1"}
        assert a["method"] in lab_summary.AXIS_METHODS and isinstance(a["prompts_per_mini_batch"], int)
    for p in summary["paired"]:
        assert set(p) - {"p_t"} == {"prompts_per_mini_batch", "a", "b", "metric", "seeds", "mean", "ci95_t",
                                    "ci95_bootstrap", "detectable_80"}  # p_t: the summaries written since it was added
        if p.get("p_t") is not None:  # p < 0.05 where the 95% t-interval excludes 0 (both rounded: not at 0.05)
            assert 0 < p["p_t"] <= 1
            assert abs(p["p_t"] - 0.05) < 1e-3 or (p["p_t"] < 0.05) == (not p["ci95_t"][0] <= 0 <= p["ci95_t"][1])
        assert (p["seeds"] >= 1 and p["metric"] in ("pass@1", "pass@16", "pass@64", "pass@256")
                and len(p["ci95_t"]) == 2)
        assert p["seeds"] == 1 or p["ci95_t"][0] <= p["mean"] <= p["ci95_t"][1]
    assert isinstance(summary["wall_s"], float) and summary["wall_s"] >= 0
    for b in summary.get("beta_axis", []):
        assert set(b) == {"beta", "method", "seed", "pass@1", "pass@64", "critic_auc"}
        assert b["method"] in lab_summary.BETA_METHODS and isinstance(b["beta"], float) and b["beta"] > 0
        assert isinstance(b["seed"], int) and 0 <= b["pass@1"] <= 1
    if "base" in summary:  # the base model's test pass@k for k = 1..eval_n, from its lab.json
        base = summary["base"]
        assert set(base) == {"eval_n", "weights_sha256", "pass@k"} and base["eval_n"] == settings["eval_n"]
        assert base["weights_sha256"] == settings["lab_weights_sha256"]
        curve = [base["pass@k"][str(k)] for k in range(1, base["eval_n"] + 1)]
        assert len(base["pass@k"]) == base["eval_n"] and 0 <= curve[0] and curve[-1] <= 1
        assert all(a <= b + 1e-9 for a, b in zip(curve, curve[1:]))  # pass@k never falls with k
    if "rare" in summary:  # pass@k on the problems the base model rarely solved (lab_summary.rare_summary)
        rare = summary["rare"]
        assert set(rare) == {"threshold", "eval_n", "problems", "of", "base_selection", "base", "base_seeds", "runs",
                             "paired"} and 1 <= rare["problems"] <= rare["of"] and rare["eval_n"] == settings["eval_n"]
        metrics = set(rare["base_selection"])
        assert rare["base"] is None or set(rare["base"]) == metrics
        assert {(r["method"], r["seed"]) for r in rare["runs"]} <= {(r["method"], r["seed"]) for r in summary["runs"]}
        for r in rare["runs"]:
            assert set(r) == {"method", "seed"} | metrics and all(0 <= r[m] <= 1 for m in metrics)
        for p in rare["paired"]:
            assert p["metric"] in metrics and p["a"] == "pacs" and p["seeds"] >= 1
    if "control" in summary:  # a method at another lr (lab_summary.control_summary)
        assert set(summary["control"]) == {"runs", "paired"}
        assert all("@lr" in r["method"] and isinstance(r["seed"], int) for r in summary["control"]["runs"])
        assert all(p["metric"] in ("pass@1", "pass@16", "pass@64", "pass@256", "final_entropy") and p["seeds"] >= 1
                   for p in summary["control"]["paired"])
    for method, c in summary.get("calibration", {}).items():
        assert set(c) == {"edges", "n", "sigma", "right"} and len(c["edges"]) == len(c["n"]) + 1
        assert all(0 <= r <= n for r, n in zip(c["right"], c["n"]))
        assert all(e0 * n <= sg <= e1 * n + 1e-6
                   for e0, e1, n, sg in zip(c["edges"], c["edges"][1:], c["n"], c["sigma"]))


def test_lab_summary_follows_the_schema(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "run_command", FakeRunner())
    runs = tmp_path / "runs"
    for prompts in (4, 8):
        trend.main(_argv(tmp_path / f"out{prompts}", "--methods", "pacs", "pacs-critic-off", "grpo", "--prompts",
                         str(prompts), "--results", str(runs / f"test-p{prompts}")))
    summary = lab_summary.lab_summary(str(runs), prompts=8, last=2)
    check_summary_schema(summary)
    assert len(summary["runs"]) == 9 and len(summary["axis"]) == 12  # 2 methods x 3 seeds x 2 prompts per step
    assert {(a["prompts_per_mini_batch"], a["method"]) for a in summary["axis"]} == {
        (p, m) for p in (1, 2) for m in ("pacs", "pacs-critic-off")}
    pacs1 = next(r for r in summary["runs"] if (r["method"], r["seed"]) == ("pacs", 1))
    assert pacs1["pass@1"] == pytest.approx(0.55) and pacs1["final_reward"] == pytest.approx(0.25)
    assert pacs1["critic_auc"] == pytest.approx(0.55) and pacs1["pass@64"] is None  # the fake eval has n = 4
    assert next(r for r in summary["runs"] if r["method"] == "grpo")["critic_auc"] is None
    # paired by seed: the sweep's claims at 2 prompts per mini-batch (pass@64 is None here), the axis's other point
    assert [(p["prompts_per_mini_batch"], p["b"], p["metric"], p["seeds"]) for p in summary["paired"]] == [
        (2, "pacs-critic-off", "pass@1", 3), (2, "grpo", "pass@1", 3), (1, "pacs-critic-off", "pass@1", 3)]
    by_seed = {(r["method"], r["seed"]): r["pass@1"] for r in summary["runs"]}
    d = [by_seed["pacs", s] - by_seed["grpo", s] for s in range(3)]
    grpo = summary["paired"][1]
    assert grpo["mean"] == pytest.approx(np.mean(d), abs=1e-5)
    assert grpo["detectable_80"] == pytest.approx(trend_stats.smallest_detectable(d), abs=1e-5)
    assert grpo["p_t"] == pytest.approx(trend_stats.paired_p(d), rel=1e-2)
    # and the same through the command line
    trend.main(_argv(tmp_path / "out8", "--methods", "pacs", "pacs-critic-off", "grpo", "--prompts", "8",
                     "--results", str(runs / "test-p8"), "--summary-json", str(tmp_path / "summary.json")))
    written = json.load(open(tmp_path / "summary.json"))  # and stability.py's entries (tests/test_stability.py)
    assert ({k: v for k, v in written.items() if k not in ("stability", "efficiency")}
            == json.loads(json.dumps(summary)))
    assert os.path.getsize(tmp_path / "lab_axis.png") > 0
    assert os.path.getsize(tmp_path / "lab_reliability.png") > 0  # one beta: pacs's and critic-off's sigma(psi)
    assert not os.path.exists(tmp_path / "lab_beta.png")
    with pytest.raises(sweep.SweepError, match="no result file for --prompts 32"):
        lab_summary.lab_summary(str(runs), prompts=32)


def test_lab_summary_beta_axis_calibration_and_figure(tmp_path, monkeypatch):
    """PACS at beta 1 and 2 beside its critic-off: the beta axis (beta read from each run's pacs.py flags), PACS(beta)
    - critic-off paired, the reliability counts summed over steps and seeds, and lab_beta.png."""
    monkeypatch.setattr(sweep, "run_command", FakeRunner())
    runs = tmp_path / "runs"
    trend.main(_argv(tmp_path / "out", "--methods", "pacs", "pacs-critic-off", "pacs-beta2", "grpo", "--prompts", "8",
                     "--results", str(runs / "test-p8"), "--summary-json", str(tmp_path / "summary.json")))
    summary = json.load(open(tmp_path / "summary.json"))
    check_summary_schema(summary)
    assert {(p["a"], p["b"], p["seeds"]) for p in summary["paired"] if p["metric"] == "pass@1"} == {
        ("pacs", "pacs-critic-off", 3), ("pacs", "grpo", 3), ("pacs-beta2", "pacs-critic-off", 3),
        ("pacs-beta2", "grpo", 3)}  # each beta against the ablation and the baselines run (no ppo here)
    assert [(b["beta"], b["method"], b["seed"]) for b in summary["beta_axis"]] == [
        (1.0, "pacs", 0), (1.0, "pacs", 1), (1.0, "pacs", 2), (2.0, "pacs-beta2", 0), (2.0, "pacs-beta2", 1),
        (2.0, "pacs-beta2", 2)]
    assert {(p["a"], p["b"], p["metric"]) for p in summary["paired"]} >= {
        ("pacs-beta2", "pacs-critic-off", "pass@1"), ("pacs", "pacs-critic-off", "pass@1")}
    # 4 steps x 3 seeds x 4 responses in bin 7, 3 of them right each step
    c = summary["calibration"]["pacs-beta2"]
    assert c["n"][7] == 48 and c["right"][7] == 36 and c["sigma"][7] == pytest.approx(24.24) and sum(c["n"]) == 48
    assert set(summary["calibration"]) == {"pacs", "pacs-critic-off", "pacs-beta2"}  # grpo has no critic
    assert os.path.getsize(tmp_path / "lab_beta.png") > 0
    result = json.load(open(runs / "test-p8" / "pacs-s0.json"))
    assert result["calibration"]["n"][7] == 16 and result["calibration"]["edges"] == list(pacs_edges())
    assert {"torch", "cpu", "threads", "python"} <= set(result["machine"])


def test_lab_summary_at_256_samples_pairs_k_1_16_64_256(tmp_path, monkeypatch):
    """The second lab evaluates 256 samples a problem: its runs carry pass@16 and pass@256 too, and each claim is
    paired at k = 1, 16, 64 and 256 (the first lab's, at 64 samples, stays pass@1 and pass@64)."""
    monkeypatch.setattr(sweep, "run_command", FakeRunner())
    runs = tmp_path / "runs"
    trend.main(["--out", str(tmp_path / "out"), "--methods", "pacs", "grpo", "--seeds", "0", "1", "2", "--steps", "4",
                "--eval-n", "256", "--last", "2", "--prompts", "8", "--results", str(runs / "test-p8")])
    summary = lab_summary.lab_summary(str(runs), prompts=8, last=2)
    check_summary_schema(summary)
    pacs0 = next(r for r in summary["runs"] if (r["method"], r["seed"]) == ("pacs", 0))
    assert (pacs0["pass@16"], pacs0["pass@256"]) == (pytest.approx(0.8), 1.0)  # the fake: 0.5 + 0.02 (k - 1), capped
    assert [p["metric"] for p in summary["paired"]] == ["pass@1", "pass@64", "pass@16", "pass@256"]


def test_a_control_at_another_lr_is_paired_with_pacs_and_with_its_own_method(tmp_path, monkeypatch):
    """Result files in control-p8-lr<lr>/ (a method at an lr its scan did not choose) give summary.json "control":
    "grpo@lr2e-05" paired by seed with the sweep's PACS and with the sweep's GRPO; a control run whose schedule
    differs from the sweep's is refused."""
    monkeypatch.setattr(sweep, "run_command", FakeRunner())
    runs = tmp_path / "runs"
    argv = _argv(tmp_path / "out", "--prompts", "8", "--results", str(runs / "test-p8"),
                 "--summary-json", str(tmp_path / "summary.json"))
    trend.main(argv)
    assert "control" not in json.load(open(tmp_path / "summary.json"))  # no control-p8-lr*/: no "control"
    trend.main(_argv(tmp_path / "control", "--methods", "grpo", "--seeds", "0", "1", "--lr", "2e-5", "--prompts", "8",
                     "--results", str(runs / "control-p8-lr2e-05")))
    trend.main(argv)
    summary = json.load(open(tmp_path / "summary.json"))
    check_summary_schema(summary)
    control = summary["control"]
    assert [(r["method"], r["seed"]) for r in control["runs"]] == [("grpo@lr2e-05", 0), ("grpo@lr2e-05", 1)]
    assert len(summary["runs"]) == 6  # the sweep's runs stay the sweep's
    pairs = {(p["a"], p["b"], p["metric"]): p for p in control["paired"]}
    assert set(pairs) == {(a, b, m) for a, b in (("pacs", "grpo@lr2e-05"), ("grpo@lr2e-05", "grpo"))
                          for m in ("pass@1", "final_entropy")}  # n = 4: no pass@16 and up
    assert pairs["pacs", "grpo@lr2e-05", "pass@1"]["seeds"] == 2
    assert pairs["pacs", "grpo@lr2e-05", "pass@1"]["mean"] == pytest.approx(0.1)
    assert pairs["grpo@lr2e-05", "grpo", "pass@1"]["mean"] == pytest.approx(0.0)  # the fake eval does not read the lr
    assert control["runs"][0]["final_entropy"] == pytest.approx(1.0 - 0.01 * 2.5)  # the mean of steps 2 and 3
    trend.main(_argv(tmp_path / "control2", "--methods", "grpo", "--seeds", "2", "--steps", "2", "--lr", "2e-5",
                     "--prompts", "8", "--results", str(runs / "control-p8-lr2e-05")))
    with pytest.raises(sweep.SweepError, match="control run grpo-s2 differs from the sweep's in steps"):
        lab_summary.control_summary(str(runs), lab_summary.lab_summary(str(runs), prompts=8, last=2), last=2)


@pytest.mark.parametrize("tag, eval_n", [("lab", 64), ("lab2", 256)])
def test_summary_base_is_the_shipped_labs_measured_pass_at_k(tag, eval_n):
    """summary.json's "base": the base model's pass@1..eval_n as lab.py measured it (lab.json), tied to the weights."""
    lab_dir = os.path.join(sweep.ROOT, "experiments", "labs", tag, "base")
    base = lab_summary.base_entry(lab_dir)
    built = json.load(open(os.path.join(lab_dir, "lab.json")))
    assert base["eval_n"] == eval_n and len(base["pass@k"]) == eval_n
    assert base["weights_sha256"] == built["weights_sha256"]
    assert base["pass@k"]["1"] == pytest.approx(built["test_pass@k"]["1"], abs=1e-5)
    assert base["pass@k"][str(eval_n)] == pytest.approx(built["test_pass@k"][str(eval_n)], abs=1e-5)
    assert list(base["pass@k"]) == [str(k) for k in range(1, eval_n + 1)]  # in k's order, not the string's
    assert lab_summary.base_entry(os.path.join(sweep.ROOT, "experiments", "labs", tag)) is None  # no lab.json there


def test_a_lab_sweeps_summary_json_carries_its_base_model(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "run_command", FakeRunner())
    lab = _fake_lab(tmp_path / "lab")
    passk = {"1": 0.3, "2": 0.4, "3": 0.45, "4": 0.5}
    (tmp_path / "lab" / "lab.json").write_text(json.dumps(
        {"weights_sha256": "ab" * 32, "settings": {"eval_n": 4}, "test_pass@k": passk}))
    trend.main(_argv(tmp_path / "out", "--lab", lab, "--prompts", "8", "--results", str(tmp_path / "runs" / "test-p8"),
                     "--summary-json", str(tmp_path / "summary.json")))
    summary = json.load(open(tmp_path / "summary.json"))
    check_summary_schema(summary)
    assert summary["base"] == {"eval_n": 4, "weights_sha256": "ab" * 32, "pass@k": passk}


def test_a_lab_sweeps_summary_json_carries_pass_at_k_on_the_base_models_rare_problems(tmp_path, monkeypatch):
    """With lab_problems.py's counts beside the result files (problems-test-p8/), summary.json gets "rare" and the
    summary writes lab_rare.png; PACS against GRPO there is paired by seed."""
    monkeypatch.setattr(sweep, "run_command", FakeRunner())
    runs = tmp_path / "runs"
    argv = _argv(tmp_path / "out", "--prompts", "8", "--results", str(runs / "test-p8"),
                 "--summary-json", str(tmp_path / "summary.json"))
    trend.main(argv)
    assert "rare" not in json.load(open(tmp_path / "summary.json"))  # no counts: no "rare"
    problems = runs / "problems-test-p8"
    problems.mkdir()
    counts = lambda *c: {"eval_n": 4, "correct": {f"p{i}": x for i, x in enumerate(c)}}
    (problems / "base-s0.json").write_text(json.dumps({"method": "base", "seed": 0, **counts(4, 1, 0, 0)}))
    for seed in (0, 1, 2):
        for method, extra in (("pacs", seed), ("grpo", 0)):
            (problems / f"{method}-s{seed}.json").write_text(json.dumps(
                {"method": method, "seed": seed, **counts(4, 1 + extra, extra, 0)}))
    trend.main(argv)
    summary = json.load(open(tmp_path / "summary.json"))
    check_summary_schema(summary)
    rare = summary["rare"]
    assert (rare["problems"], rare["of"]) == (3, 4) and rare["base_selection"] == {"pass@1": round(1 / 12, 5)}
    (pair,) = rare["paired"]
    assert (pair["a"], pair["b"], pair["metric"], pair["seeds"]) == ("pacs", "grpo", "pass@1", 3)
    assert pair["mean"] == pytest.approx((0 + 2 / 12 + 4 / 12) / 3, abs=1e-5)  # seed s adds 2s correct of 12
    assert os.path.getsize(tmp_path / "lab_rare.png") > 10_000
    assert not os.path.exists(tmp_path / "lab_axis.png")  # one prompts per mini-batch: a point, not an axis


def test_the_reliability_figures_best_beta_is_the_validation_scans(tmp_path):
    """lab_beta.png pictures sigma(psi) at beta = 1 and at the beta the validation scan scores best (each beta at its
    own chosen lr); without a scan of every beta there is no best."""
    runs = tmp_path / "runs"
    args = types.SimpleNamespace(results=str(runs / "test-p32"), prompts=32)
    val = {"pacs": {1e-4: 0.60, 2e-4: 0.50}, "pacs-beta0.5": {1e-4: 0.58, 2e-4: 0.66},  # 0.5 best, at 2e-4
           "pacs-beta2": {1e-4: 0.62, 2e-4: 0.40}, "pacs-beta4": {1e-4: 0.61, 2e-4: 0.30}}
    for i, (method, by_lr) in enumerate(val.items()):
        if i == 3:
            assert trend.best_beta(args) is None  # beta 4 not scanned yet
        for lr, v in by_lr.items():
            (runs / f"val-p32-lr{lr:g}").mkdir(parents=True, exist_ok=True)
            for seed, d in ((1000, -0.01), (1001, 0.01)):
                (runs / f"val-p32-lr{lr:g}" / f"{method}-s{seed}.json").write_text(json.dumps(
                    {"method": method, "seed": seed, "settings": {"lr": lr}, "eval": {"val": {"1": v + d}}}))
    assert trend.best_beta(args) == 0.5


def pacs_edges():
    import pacs
    return pacs.CALIBRATION_EDGES


def test_lab_scan_picks_each_methods_best_mean_validation_pass1(tmp_path, capsys):
    runs = tmp_path / "runs"
    val = {("pacs", 1e-5): [0.30, 0.40], ("pacs", 3e-5): [0.45, 0.33], ("pacs", 1e-4): [0.10, 0.20],
           ("grpo", 1e-5): [0.35, 0.35], ("grpo", 3e-5): [0.30, 0.40]}  # grpo: a tie, the smaller lr wins
    for (method, lr), values in val.items():
        (runs / f"val-p32-lr{lr:g}").mkdir(parents=True, exist_ok=True)
        for seed, v in zip((1000, 1001), values):
            (runs / f"val-p32-lr{lr:g}" / f"{method}-s{seed}.json").write_text(json.dumps(
                {"method": method, "seed": seed, "settings": {"lr": lr}, "eval": {"val": {"1": v}}}))
    (runs / "test-p32").mkdir()  # the test split's runs are never read by the scan
    (runs / "test-p32" / "pacs-s0.json").write_text(json.dumps(
        {"method": "pacs", "seed": 0, "settings": {"lr": 1e-4}, "eval": {"test": {"1": 0.99}}}))
    scan = lab_summary.lab_scan(str(runs))
    assert scan["choice"] == {"pacs": 3e-5, "grpo": 1e-5}
    assert scan["pass@1"]["pacs"]["0.0001"] == [0.10, 0.20] and len(scan["pass@1"]["pacs"]) == 3
    trend.main(["--lab", _fake_lab(tmp_path / "lab"), "--split", "val", "--results", str(runs / "val-p32-lr1e-05"),
                "--scan-json", str(tmp_path / "scan.json")])
    assert json.load(open(tmp_path / "scan.json")) == json.loads(json.dumps(scan))
    assert "pacs: lr 1e-05: 0.350 (2 seeds), lr 3e-05: 0.390 (2 seeds), lr 0.0001: 0.150 (2 seeds) -> 3e-05" \
        in capsys.readouterr().out
    with pytest.raises(sweep.SweepError, match="no scan result"):
        lab_summary.lab_scan(str(tmp_path / "nothing"))


LAB_DOCS = os.path.join(sweep.ROOT, "experiments", "labs", "lab")
ARCHIVE = os.path.join(LAB_DOCS, "archive-7e4899b1")  # the first sweep's files, from a base that was not committed


def test_every_committed_lab_summary_follows_the_schema_and_names_its_shipped_base():
    """experiments/labs/<lab>/summary.json, for every lab that ships a base (the first lab's at least): the schema, and
    the weights it summarises are the ones that lab ships (lab.json's sha256), its base pass@k the one lab.json
    measured."""
    labs = sorted(os.path.dirname(p)
                  for p in glob.glob(os.path.join(sweep.ROOT, "experiments", "labs", "*", "summary.json"))
                  if os.path.isfile(os.path.join(os.path.dirname(p), "base", "lab.json")))
    assert LAB_DOCS in labs, "experiments/labs/lab/summary.json is missing"
    for lab in labs:
        summary = json.load(open(os.path.join(lab, "summary.json")))
        check_summary_schema(summary)
        shipped = json.load(open(os.path.join(lab, "base", "lab.json")))
        assert summary["settings"]["lab_weights_sha256"] == shipped["weights_sha256"], lab
        assert _close(summary["base"]["pass@k"], shipped["test_pass@k"]) == [], lab


def _close(a, b, path="", tol=1e-4):
    """Where two JSON trees differ by more than tol in a number, or at all elsewhere: a list of paths."""
    if isinstance(a, dict) and isinstance(b, dict):
        return ([f"{path}/{k}: only one side" for k in set(a) ^ set(b)]
                + [d for k in set(a) & set(b) for d in _close(a[k], b[k], f"{path}/{k}", tol)])
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items against {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _close(x, y, f"{path}[{i}]", tol)]
    if isinstance(a, float) and isinstance(b, (int, float)) or isinstance(b, float) and isinstance(a, (int, float)):
        return [] if abs(a - b) <= tol else [f"{path}: {a} against {b}"]
    return [] if a == b else [f"{path}: {a!r} against {b!r}"]


def test_the_archived_summary_and_scan_regenerate_from_their_result_files():
    """The first sweep's summary.json and scan.json, recomputed from its committed result files by today's code
    (scipy's t quantiles and bootstrap), agree with the committed ones to 1e-4 in every number."""
    committed = json.load(open(os.path.join(ARCHIVE, "summary.json")))
    check_summary_schema(committed)
    again = json.loads(json.dumps(lab_summary.lab_summary(ARCHIVE, prompts=32, last=10)))
    assert again["beta_axis"] and all(b["beta"] == 1.0 for b in again["beta_axis"])  # the first sweep ran beta 1
    assert again["calibration"] == {}  # its result files predate the reliability counts
    for p in again["paired"]:  # the archive predates the paired t-test's p-value
        del p["p_t"]
    assert _close({k: again[k] for k in committed}, committed) == []
    scan = json.loads(json.dumps(lab_summary.lab_scan(ARCHIVE, prompts=32)))
    assert _close(scan, json.load(open(os.path.join(ARCHIVE, "scan.json")))) == []
    assert _close({"x": [1.0, {"y": 0.5}]}, {"x": [1.0, {"y": 0.5002}]}) == ["/x[1]/y: 0.5 against 0.5002"]


# ---- end to end, in process, on the tiny model --------------------------------------------------------
def test_tiny_sweep_end_to_end(tmp_path, monkeypatch, tiny_model_dir):
    """The real pacs.py and eval.py, called through their command lines in this process (no second torch
    import): every flag the sweep passes must be accepted, and the summary must read what they write."""
    import eval as eval_py
    import pacs

    def run_in_process(cmd):
        monkeypatch.setattr(sys, "argv", cmd[1:])
        (pacs if cmd[1] == "pacs.py" else eval_py).main()

    monkeypatch.setattr(sweep, "run_command", run_in_process)
    monkeypatch.setenv("TQDM_DISABLE", "1")
    out = tmp_path / "tiny"
    trend.main(["--out", str(out), "--model", tiny_model_dir, "--methods", "pacs", "grpo", "--seeds", "0",
                "--steps", "2", "--prompts", "2", "--group-size", "2", "--num-mini-batches", "2",
                "--max-new-tokens", "4", "--eval-problems", "2", "--eval-n", "2", "--save-every", "1",
                "--pacs-args", "--log-samples-every 0"])
    for run in ("pacs-s0", "grpo-s0"):
        assert sweep.trained_steps(str(out / run)) == 2
        assert json.load(open(out / run / "config.json"))["num_mini_batches"] == 2
        assert json.load(open(out / run / "eval-step2" / "metrics.json"))["model"].endswith("checkpoint-000001")
    assert json.load(open(out / "pacs-s0" / "config.json"))["algo"] == "pacs"
    assert json.load(open(out / "grpo-s0" / "config.json"))["algo"] == "grpo"
    stats = json.load(open(out / "stats.json"))
    assert set(stats["values"]) == {"synthetic pass@1", "synthetic pass@2", "final training reward", "final entropy"}
    assert "too few seeds" in stats["claims"][0]["sentence"]


# ---- experiments/curves.py: metrics of runs against step ---------------------------------------------
def test_curves_running_mean_skips_gaps_and_the_figure_is_written(tmp_path):
    import curves
    assert curves.running_mean([1.0, float("nan"), 3.0, 5.0], 2) == [1.0, 1.0, 3.0, 4.0]
    assert np.isnan(curves.running_mean([float("nan"), 2.0], 3)[0])
    for name, rewards in (("a", [0.1, 0.2, 0.4]), ("b", [0.0, 0.3, 0.3])):
        (tmp_path / name).mkdir()
        rows = [{"step": s, "reward": r, "critic_auc": None if s == 1 else 0.6} for s, r in enumerate(rewards)]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[::-1]))
    out = tmp_path / "fig.png"
    curves.main([str(tmp_path / "a"), str(tmp_path / "b"), "--keys", "reward", "critic_auc", "--smooth", "2",
                 "--out", str(out)])
    assert out.stat().st_size > 0
    with pytest.raises(SystemExit, match="no metrics.jsonl in"):
        curves.main([str(tmp_path / "missing"), "--out", str(out)])
