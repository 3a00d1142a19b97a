"""The claims over bases (experiments/bases.py): the recipe's window, the builds' bookkeeping, stats.over_bases against
the closed form of a balanced design and by simulation, and summary.json's "bases" entry."""
import json
import os
import sys

import numpy as np
import pytest
from scipy import stats as sstats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import bases  # noqa: E402
import lab  # noqa: E402
import stats  # noqa: E402


# ---- stats.over_bases --------------------------------------------------------------------------------------------
def reml_loglik_matrix_form(groups, ratio):
    """The REML log-likelihood of d = mu + b_base + e written out with matrices, V = s^2 (I + ratio Z Z'),
    -1/2 [log|V| + log|X'V^-1 X| + r'V^-1 r + (N - 1) log 2 pi], r = d - X mu_GLS, s^2 at its maximum
    r'V0^-1 r / (N - 1): the textbook form stats.reml_profile's closed forms must equal."""
    y = np.concatenate(groups)
    z = np.zeros((len(y), len(groups)))
    z[np.arange(len(y)), np.concatenate([[i] * len(g) for i, g in enumerate(groups)])] = 1.0
    v0 = np.eye(len(y)) + ratio * z @ z.T
    v0_inv, x = np.linalg.inv(v0), np.ones((len(y), 1))
    mu = float(np.linalg.solve(x.T @ v0_inv @ x, x.T @ v0_inv @ y)[0])
    r = y - mu
    s2 = float(r @ v0_inv @ r) / (len(y) - 1)
    v = s2 * v0
    return -0.5 * (np.linalg.slogdet(v)[1] + np.linalg.slogdet(x.T @ np.linalg.inv(v) @ x)[1]
                   + float(r @ np.linalg.inv(v) @ r) + (len(y) - 1) * np.log(2 * np.pi))


def brute_force_optimum(groups):
    """The REML profile's maximum over 0 and 2,001 ratios from 1e-8 to 1e6 (a step of 1.6%): a search that shares no
    code with the fit's."""
    grid = np.concatenate([[0.0], np.logspace(-8, 6, 2001)])
    ll = np.array([stats.reml_profile(groups, r)[0] for r in grid])
    return grid[int(np.argmax(ll))], float(ll.max())


def test_the_reml_profile_is_the_matrix_forms_likelihood():
    rng = np.random.default_rng(3)
    groups = [rng.normal(rng.normal(0, 0.02), 0.03, k) for k in (16, 2, 2, 3, 2)]
    for ratio in (0.0, 1e-4, 0.05, 0.7, 30.0):
        loglik, mu, within = stats.reml_profile(groups, ratio)
        assert loglik == pytest.approx(reml_loglik_matrix_form(groups, ratio), rel=1e-10, abs=1e-9)
    y = np.concatenate(groups)  # at ratio 0 the seeds are one sample: the mean and the sample variance
    assert stats.reml_profile(groups, 0.0)[1:] == pytest.approx((y.mean(), y.var(ddof=1)), rel=1e-12)


def bases_rows(tag, b, metric):
    summary = json.load(open(os.path.join(ROOT, "experiments", "labs", tag, "summary.json")))
    (c,) = [c for c in summary["bases"]["claims"] if (c["b"], c["metric"]) == (b, metric)]
    return {p["base"]: p["diffs"] for p in c["per_base"]}


# the rows where a search over variances reported a between-base SD that is not the REML optimum: (lab, claim,
# metric, the SD it reported, its within SD); the optimum is 0
STOPPED_SHORT = [("lab", "grpo", "pass@1", 0.00876, 0.02516), ("lab2", "grpo", "pass@256", 0.00699, 0.05798),
                 ("lab2", "ppo", "pass@256", 0.01426, 0.05665)]


@pytest.mark.parametrize("tag, b, metric, reported, within", STOPPED_SHORT, ids=[f"{t}-{b}-{m}" for t, b, m, _, _ in
                                                                                 STOPPED_SHORT])
def test_over_bases_reaches_the_optimum_at_zero_where_a_search_stopped_short(tag, b, metric, reported, within):
    d = bases_rows(tag, b, metric)
    groups = [np.asarray(v) for v in d.values()]
    fit = stats.over_bases(d)
    assert fit["converged"] is True and fit["between_sd"] == 0.0 and fit["boundary"] is True
    assert fit["loglik"] == fit["loglik_at_0"] == pytest.approx(brute_force_optimum(groups)[1], abs=1e-9)
    assert brute_force_optimum(groups)[0] == 0.0
    assert stats.reml_profile(groups, (reported / within) ** 2)[0] < fit["loglik"] - 1e-3  # the reported SD is lower
    # at s_b = 0 every seed weighs alike: the first base carries its 16 of the seeds
    assert fit["weights"][0] == pytest.approx(16 / sum(len(v) for v in d.values()), rel=1e-12)
    assert fit["mean"] == pytest.approx(np.mean(np.concatenate(groups)), rel=1e-12)


@pytest.mark.parametrize("tag", ["lab", "lab2"])
def test_over_bases_reaches_the_optimum_on_every_committed_row(tag):
    summary = json.load(open(os.path.join(ROOT, "experiments", "labs", tag, "summary.json")))
    for c in summary["bases"]["claims"]:
        groups = [np.asarray(p["diffs"]) for p in c["per_base"]]
        fit = stats.over_bases({p["base"]: p["diffs"] for p in c["per_base"]})
        ratio, best = brute_force_optimum(groups)
        assert fit["converged"] is True and fit["loglik"] >= best - 1e-9, (c["b"], c["metric"])
        assert fit["between_sd"] ** 2 / fit["within_sd"] ** 2 == pytest.approx(ratio, rel=2e-2, abs=1e-9)


def test_over_bases_in_a_balanced_design_is_the_t_interval_over_base_means():
    """Balanced, with a between-base variance above 0 (a known interior optimum): REML's variance components are
    ANOVA's, s_w^2 = MSW and s_b^2 = (MSB - MSW) / n, mu is the grand mean and its variance MSB / (n K), so the
    interval with K - 1 degrees of freedom is the t-interval over the K base means."""
    rng = np.random.default_rng(0)
    d = {f"b{i}": list(rng.normal(rng.normal(0.0, 0.03), 0.01, 4)) for i in range(5)}
    fit = stats.over_bases(d)
    mean, lo, hi = stats.t_interval([np.mean(v) for v in d.values()])
    assert fit["boundary"] is False and fit["converged"] is True and fit["df"] == 4 and fit["bases"] == 5
    assert fit["mean"] == pytest.approx(mean, rel=1e-9)
    assert fit["se"] == pytest.approx(np.std([np.mean(v) for v in d.values()], ddof=1) / np.sqrt(5), rel=1e-6)
    assert fit["ci"] == pytest.approx([lo, hi], rel=1e-6)
    within = np.mean([np.var(v, ddof=1) for v in d.values()])
    assert fit["within_sd"] ** 2 == pytest.approx(within, rel=1e-6)
    assert fit["between_sd"] ** 2 == pytest.approx(np.var([np.mean(v) for v in d.values()], ddof=1) - within / 4,
                                                   rel=1e-6)
    assert fit["weights"] == pytest.approx([0.2] * 5, rel=1e-9)


@pytest.mark.parametrize("ratio, flagged", [(1e-3, True), (4e-3, True), (6e-3, False), (0.1, False)])
def test_the_boundary_flag_reads_the_between_sd_beside_the_seeds(ratio, flagged):
    """Balanced, 2 seeds a base at +-delta around means whose spread puts REML's s_b^2 / s_w^2 at `ratio` exactly
    ((MSB - MSW) / (n MSW)); the flag is s_b^2 <= 1% of the variance of a 2-seed mean, s_w^2 / 2: ratio <= 0.005.
    An SD like 5e-5 beside seeds' 0.025 (ratio 4e-6) is flagged; one a tenth of theirs is not."""
    delta, n = 0.01, 2
    spread = np.array([-2.0, -1.0, 0.0, 1.0, 2.0]) * np.sqrt(delta ** 2 * (1 + n * ratio) / 2.5)  # var(m) = MSB / n
    d = {f"b{i}": [0.02 + m - delta, 0.02 + m + delta] for i, m in enumerate(spread)}
    fit = stats.over_bases(d)
    assert fit["converged"] is True
    assert (fit["between_sd"] / fit["within_sd"]) ** 2 == pytest.approx(ratio, rel=1e-5)
    assert fit["boundary"] is flagged


def test_over_bases_with_no_base_effect_sits_on_the_boundary():
    d = {"a": [0.01, -0.01, 0.02, 0.0], "b": [0.01, -0.01, 0.02, 0.0], "c": [0.0, 0.01, -0.01, 0.02]}
    fit = stats.over_bases(d)
    assert fit["boundary"] is True and fit["converged"] is True and fit["between_sd"] == 0.0
    assert fit["mean"] == pytest.approx(np.mean(sum(d.values(), [])), abs=1e-9)


def test_over_bases_says_when_it_finds_no_optimum():
    """Seeds that agree exactly within each base while the bases differ: the likelihood rises without end as s_b^2 /
    s_w^2 grows, and the fit says it found no optimum rather than report the search's edge as one."""
    fit = stats.over_bases({"a": [0.1, 0.1], "b": [0.3, 0.3], "c": [0.2, 0.2, 0.2]})
    assert fit["converged"] is False
    assert stats.over_bases({"a": [0.1, 0.1], "b": [0.1, 0.1]})["converged"] is False  # no spread at all


def test_over_bases_needs_two_bases_and_a_spread_within_them():
    assert np.isnan(stats.over_bases({"a": [0.1, 0.2]})["mean"])
    one_each = stats.over_bases({"a": [0.1], "b": [0.3]})
    assert one_each["mean"] == pytest.approx(0.2) and np.isnan(one_each["se"])


def test_over_bases_covers_the_population_mean_in_an_unbalanced_design():
    """16 seeds on one base, 2 on four others, a base effect as large as the seeds': the interval over bases holds
    the true mean about 95 times in 100 (REML, K - 1 degrees of freedom); the pooled t-interval over all seeds, which
    treats the bases as one, holds it far less often."""
    rng = np.random.default_rng(1)
    hits, naive, n = 0, 0, 200
    for _ in range(n):
        d = {b: list(rng.normal(rng.normal(0.0, 0.02), 0.02, k)) for b, k in zip("abcde", (16, 2, 2, 2, 2))}
        lo, hi = stats.over_bases(d)["ci"]
        hits += lo <= 0.0 <= hi
        _, nlo, nhi = stats.t_interval(sum(d.values(), []))
        naive += nlo <= 0.0 <= nhi
    assert hits / n >= 0.9 and naive / n < 0.85
    assert sstats.binomtest(hits, n, 0.95).pvalue > 0.001 or hits / n > 0.95  # not below 95% beyond chance


# ---- the recipe and its window -----------------------------------------------------------------------------------
@pytest.mark.parametrize("tag", ["lab", "lab2"])
def test_the_recipe_is_the_first_bases_settings_and_it_lands_in_its_window(tag):
    flags, settings, defaults = bases.recipe(tag)
    assert "--out" not in flags and "--seed" not in flags
    parsed = vars(lab.parse_args(["--out", "x", "--seed", "3", *flags]))
    for key, value in settings.items():
        if key not in ("out", "seed"):
            assert parsed[key] == value, key
    built = json.load(open(os.path.join(ROOT, "experiments", "labs", tag, "base", "lab.json")))
    assert bases.in_window(tag, built, settings, defaults)
    low = {**built, "test_pass@k": {**built["test_pass@k"], "1": 0.01}}
    assert not bases.in_window(tag, low, settings, defaults)
    if tag == "lab2":  # the second lab's rule beyond the two ranges: a quarter of its problems rarely solved
        assert not bases.in_window(tag, {**built, "test_rare_share": 0.2}, settings, defaults)


def _fake_lab_py(results):
    """Stands in for lab.py in subprocess.run: writes the out dir a build leaves, with the pass@1 `results` gives."""
    calls = []

    def run(cmd, check, cwd):
        out, seed = os.path.join(cwd, cmd[cmd.index("--out") + 1]), int(cmd[cmd.index("--seed") + 1])
        calls.append(seed)
        os.makedirs(os.path.join(out, "model"))
        open(os.path.join(out, "model", "model.safetensors"), "w").write(f"weights {seed}")
        open(os.path.join(out, "sft_log.jsonl"), "w").write("{}\n")
        p1 = results[seed]
        json.dump({"settings": {"seed": seed}, "weights_sha256": f"{seed:064d}", "splits_sha256": "0" * 64,
                   "sft_steps": 400, "wall_s": 50.0, "test_pass@k": {"1": p1, "64": 0.9}}, open(
            os.path.join(out, "lab.json"), "w"))
    return run, calls


def test_build_ships_the_seeds_in_the_window_and_keeps_every_try(tmp_path, monkeypatch):
    docs = tmp_path / "experiments" / "labs" / "lab"
    (docs / "base").mkdir(parents=True)
    (docs / "base" / "lab.json").write_text(json.dumps({"settings": {"seed": 0, "eval_n": 64}}))
    monkeypatch.setattr(bases, "ROOT", str(tmp_path))
    run, calls = _fake_lab_py({1: 0.2, 2: 0.6, 3: 0.3, 4: 0.1, 5: 0.25})  # 2 and 4 outside [0.15, 0.5]
    monkeypatch.setattr(bases.subprocess, "run", run)
    builds = bases.build("lab", bases=3)
    assert calls == [1, 2, 3, 4, 5]
    assert [(b["seed"], b["in_window"]) for b in builds] == [(1, True), (2, False), (3, True), (4, False), (5, True)]
    assert sorted(os.listdir(docs / "bases")) == ["builds.json", "seed1", "seed3", "seed5"]
    assert sorted(os.listdir(docs / "bases" / "seed3")) == ["lab.json", "model", "sft_log.jsonl"]
    assert [os.path.relpath(b, docs) for b in lab.shipped_bases(str(docs))] == ["base", "bases/seed1",
                                                                               "bases/seed3", "bases/seed5"]
    recorded = json.load(open(docs / "bases" / "builds.json"))
    assert recorded["recipe"][:6] == ["python", "experiments/lab.py", "--out", "<dir>", "--seed", "<N>"]
    assert bases.build("lab", bases=3) == recorded["builds"] and calls == [1, 2, 3, 4, 5]  # resumed: nothing rebuilt
    with pytest.raises(bases.SweepError, match="only 3 of 5 seeds landed in the window"):
        bases.build("lab", bases=4, max_tries=5)


# ---- summary.json's "bases" --------------------------------------------------------------------------------------
def _runs(diffs_by_claim, seeds, offset=0.0):
    """Summary run entries whose PACS - X differences per seed are diffs_by_claim[X] + offset."""
    runs = []
    for s in seeds:
        runs.append({"method": "pacs", "seed": s, "pass@1": 0.5, "pass@64": 0.9, "final_entropy": 0.1})
        for m, d in diffs_by_claim.items():
            runs.append({"method": m, "seed": s, "pass@1": 0.5 - d[s] - offset, "pass@64": 0.9 - d[s] / 2,
                         "final_entropy": 0.1 + d[s] / 10})
    return runs


def test_bases_summary_pairs_each_base_and_fits_over_them(tmp_path, monkeypatch):
    rng = np.random.default_rng(2)
    claims = {m: {s: float(x) for s, x in enumerate(rng.normal(0.02, 0.01, 16))} for m in
              ("grpo", "ppo", "pacs-critic-off")}
    tag = tmp_path / "lab"
    for name, seed in (("base", 0), ("bases/seed1", 1), ("bases/seed2", 2)):
        (tag / name).mkdir(parents=True)
        (tag / name / "lab.json").write_text(json.dumps({"settings": {"seed": seed, "eval_n": 64},
                                                         "weights_sha256": f"{seed:064d}",
                                                         "test_pass@k": {"1": 0.25, "64": 0.97}}))
    (tag / "bases" / "seed1" / "results" / "test-p32").mkdir(parents=True)
    (tag / "bases" / "seed2" / "results" / "test-p32").mkdir(parents=True)
    offsets = {"seed1": -0.05, "seed2": 0.01}  # seed1: every claim flips sign at pass@1
    monkeypatch.setattr(bases, "lab_summary", lambda results, prompts, last: {"runs": _runs(
        claims, [0, 1], offsets[os.path.basename(os.path.dirname(results))])})
    summary = {"runs": _runs(claims, range(16))}
    out = bases.bases_summary(str(tag), summary)
    check_bases_schema(out)
    assert [b["base"] for b in out["bases"]] == ["base", "bases/seed1", "bases/seed2"]
    assert out["bases"][1]["seeds"]["pacs"] == [0, 1] and out["bases"][0]["seeds"]["grpo"] == list(range(16))
    (c,) = [c for c in out["claims"] if (c["b"], c["metric"]) == ("ppo", "pass@1")]
    assert [p["seeds"] for p in c["per_base"]] == [16, 2, 2]
    assert c["per_base"][1]["mean"] == pytest.approx(np.mean([claims["ppo"][s] for s in (0, 1)]) - 0.05, abs=1e-5)
    assert c["holds_on"] == 2 and c["of"] == 3  # the first base and seed2 above 0, seed1 below
    fit = stats.over_bases({p["base"]: p["diffs"] for p in c["per_base"]})
    assert c["over_bases"]["mean"] == pytest.approx(fit["mean"], abs=1e-5)
    assert c["t_over_base_means"]["mean"] == pytest.approx(np.mean([p["mean"] for p in c["per_base"]]), abs=1e-5)
    (e,) = [c for c in out["claims"] if (c["b"], c["metric"]) == ("ppo", "final_entropy")]
    assert e["per_base"][0]["mean"] < 0 and e["holds_on"] == 3  # PACS's entropy below PPO's on every base
    rows = bases.table(out).splitlines()
    assert rows[0].startswith("| claim | metric | base 0 | base 1 | base 2 | mixed model [95%] | t over base means "
                              "[95%] | base 0's weight |")
    (row,) = [r for r in rows if r.startswith("| pacs − ppo | pass@1 |")]
    cells = [x.strip() for x in row.strip("|").split("|")]
    assert cells[2] == bases.fmt(c["per_base"][0]["mean"]) + " (16)" and cells[3].endswith("(2)")
    assert cells[5] == (f"{bases.fmt(c['over_bases']['mean'])} [{bases.fmt(c['over_bases']['ci95'][0])}, "
                        f"{bases.fmt(c['over_bases']['ci95'][1])}]") + (" ‡" if c["over_bases"]["boundary"] else "") \
        + f" p {2 * sstats.t.sf(abs(c['over_bases']['mean'] / c['over_bases']['se']), 2):.2g}"
    t = c["t_over_base_means"]
    assert cells[6] == (f"{bases.fmt(t['mean'])} [{bases.fmt(t['ci95'][0])}, {bases.fmt(t['ci95'][1])}] p "
                        f"{sstats.ttest_1samp([p['mean'] for p in c['per_base']], 0).pvalue:.2g}")
    assert cells[7] == f"{c['over_bases']['weights'][0]:.2f}"
    assert cells[-1] == "2 of 3" and bases.fmt(-0.0123) == "−0.012"
    only = tmp_path / "only"  # a lab with no other base's runs: no entry
    (only / "base").mkdir(parents=True)
    (only / "base" / "lab.json").write_text((tag / "base" / "lab.json").read_text())
    assert bases.bases_summary(str(only), summary) is None


def check_bases_schema(entry):
    assert set(entry) == {"methods", "large_k", "bases", "claims"} and entry["large_k"] in ("pass@64", "pass@256")
    assert entry["bases"][0]["base"] == "base" and len(entry["bases"]) >= 2
    for b in entry["bases"]:
        assert {"base", "seed", "weights_sha256", "base_pass@1", "seeds"} <= set(b) and len(b["weights_sha256"]) == 64
        assert set(b["seeds"]) == set(entry["methods"])
    assert len({b["weights_sha256"] for b in entry["bases"]}) == len(entry["bases"])  # each base another model
    for c in entry["claims"]:
        assert c["a"] == "pacs" and c["metric"] in ("pass@1", entry["large_k"], "final_entropy")
        assert set(c) == {"a", "b", "metric", "per_base", "over_bases", "t_over_base_means", "holds_on", "of"}
        assert 0 <= c["holds_on"] <= c["of"] == len(c["per_base"])
        for p in c["per_base"]:
            assert p["seeds"] == len(p["diffs"]) >= 1
            assert p["mean"] == pytest.approx(np.mean(p["diffs"]), abs=2e-5)
        o = c["over_bases"]
        assert o["df"] == c["of"] - 1
        assert set(o) == {"mean", "se", "ci95", "df", "between_sd", "within_sd", "boundary", "converged", "weights"}
        if o["se"] is not None:
            assert o["ci95"][0] <= o["mean"] <= o["ci95"][1] and o["within_sd"] >= 0 and o["between_sd"] >= 0
            assert o["converged"] is True and len(o["weights"]) == c["of"]
            assert sum(o["weights"]) == pytest.approx(1.0, abs=1e-4)
            assert o["boundary"] is (o["between_sd"] ** 2 <= stats.NEGLIGIBLE * o["within_sd"] ** 2 / max(
                p["seeds"] for p in c["per_base"]) + 1e-9)
        t = c["t_over_base_means"]
        assert t["mean"] == pytest.approx(np.mean([p["mean"] for p in c["per_base"]]), abs=2e-5)


def test_table_prints_each_claims_numbers_from_the_entry():
    entry = {"bases": [{"base": "base", "seed": 0}, {"base": "bases/seed3", "seed": 3}],
             "claims": [{"a": "pacs", "b": "ppo", "metric": "final_entropy", "holds_on": 1, "of": 2,
                         "per_base": [{"base": "base", "seeds": 16, "mean": 0.0051},
                                      {"base": "bases/seed3", "seeds": 2, "mean": -0.0304}],
                         "over_bases": {"mean": -0.0111, "se": 0.0111, "df": 1, "ci95": [-0.2, 0.18],
                                        "between_sd": 0.0234, "within_sd": 0.0081, "boundary": True, "converged": True,
                                        "weights": [0.8888, 0.1112]},
                         "t_over_base_means": {"mean": -0.0127, "ci95": [-0.3, 0.3]}}]}
    head, rule, row = bases.table(entry).splitlines()[:3]
    assert head == ("| claim | metric | base 0 | base 3 | mixed model [95%] | t over base means [95%] "
                    "| base 0's weight | between SD | within SD | holds on |")
    assert rule.count("|") == head.count("|")
    # p: t = mean / se with df 1 is 1 (p 0.5); over the two base means, mean -0.01265 and se 0.01775 (p 0.61)
    assert row == ("| pacs − ppo | entropy | +0.005 (16) | −0.030 (2) | −0.011 [−0.200, +0.180] ‡ p 0.5 | −0.013 "
                   "[−0.300, +0.300] p 0.61 | 0.89 | 0.023 | 0.008 | 1 of 2 |")
    entry["claims"][0]["over_bases"]["converged"] = False  # a fit without an optimum says so where it is printed
    assert "(no REML optimum found)" in bases.table(entry).splitlines()[2]


def test_table_without_a_bases_entry_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    (tmp_path / "experiments" / "labs" / "lab" / "base").mkdir(parents=True)
    (tmp_path / "experiments" / "labs" / "lab" / "base" / "lab.json").write_text("{}")
    (tmp_path / "experiments" / "labs" / "lab" / "summary.json").write_text(json.dumps({"runs": []}))
    monkeypatch.setattr(bases, "ROOT", str(tmp_path))
    with pytest.raises(SystemExit) as e:
        bases.main(["table", "--lab-tag", "lab"])
    assert "no bases entry" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("tag", ["lab", "lab2"])
def test_a_committed_summarys_bases_follow_the_schema(tag):
    summary = json.load(open(os.path.join(ROOT, "experiments", "labs", tag, "summary.json")))
    if "bases" not in summary:
        pytest.skip(f"docs/{tag}/summary.json has no bases entry yet (no new base's runs committed)")
    check_bases_schema(summary["bases"])
    shipped = [os.path.relpath(b, os.path.join(ROOT, "experiments", "labs", tag)) for b in lab.shipped_bases(
        os.path.join(ROOT, "experiments", "labs", tag))]
    assert [b["base"] for b in summary["bases"]["bases"]] == [b for b in shipped if b in
                                                            {x["base"] for x in summary["bases"]["bases"]}]
