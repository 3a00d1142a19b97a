"""The sweep's statistics over seeds: pure functions on plain numbers, scipy.stats underneath.

A run's seed fixes its data order; two methods at one seed saw the same prompts in the same order, so methods
are compared paired by seed. Per method: the mean over seeds and its t-interval. Per comparison: the paired
differences, their t-interval (scipy.stats.ttest_rel's), their percentile bootstrap over seeds
(scipy.stats.bootstrap, paired, seeded: eval.py's bootstrap_ci) and the smallest true difference the seeds could
detect. Tested in tests/test_trend.py against closed forms and by simulation.
"""
import math
import os
import sys

import numpy as np
from scipy import stats

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from eval import bootstrap_ci  # noqa: E402  (scipy.stats.bootstrap, percentile, seeded: problems or seeds)


def t_interval(values, level=0.95):
    """(mean, lo, hi): the mean over seeds and its t-interval mean -/+ t_{(1+level)/2, n-1} * s / sqrt(n),
    s the sample standard deviation (n - 1). Fewer than 2 values: lo = hi = nan (no spread to measure)."""
    x = np.asarray(values, dtype=float)  # (n,)
    if len(x) == 0:
        return (math.nan, math.nan, math.nan)
    if len(x) < 2:
        return (float(x[0]), math.nan, math.nan)
    # the same as scipy.stats.ttest_1samp(x, 0).confidence_interval(level), and for paired differences
    # ttest_rel(a, b).confidence_interval(level); written out so that a zero spread gives mean +/- 0, not nan
    half = stats.t.ppf((1 + level) / 2, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x))
    return (float(x.mean()), float(x.mean() - half), float(x.mean() + half))


def smallest_detectable(diffs, level=0.95, power=0.8):
    """The smallest true mean paired difference a two-sided paired t-test at `level` detects with probability
    `power`, given the spread of these differences: (t_{(1+level)/2, n-1} + t_{power, n-1}) * s / sqrt(n), the
    usual approximation (it takes s as known). nan with fewer than 2 differences."""
    d = np.asarray(diffs, dtype=float)  # (n,)
    if len(d) < 2:
        return math.nan
    df = len(d) - 1
    return float((stats.t.ppf((1 + level) / 2, df) + stats.t.ppf(power, df)) * d.std(ddof=1) / math.sqrt(len(d)))


def paired_p(diffs):
    """The two-sided p-value of a paired t-test that the mean difference is 0 (scipy.stats.ttest_rel's on the pairs,
    written out as t_interval is); nan with fewer than 2 differences or none of them spread. A table of many
    comparisons reads it against a threshold for all of them (Bonferroni: 0.05 / their number)."""
    d = np.asarray(diffs, dtype=float)  # (n,)
    if len(d) < 2 or d.std(ddof=1) == 0:
        return math.nan
    # t = mean / (s / sqrt(n)),  p = 2 P(T_{n-1} > |t|)
    t = d.mean() / (d.std(ddof=1) / math.sqrt(len(d)))
    return float(2 * stats.t.sf(abs(t), len(d) - 1))


def paired_differences(a, b):
    """Seeds both runs have, and a[seed] - b[seed] for each: the comparison is within a seed, where both
    methods saw the same prompts in the same order, so the seed-to-seed spread cancels."""
    seeds = sorted(set(a) & set(b))
    return seeds, np.array([a[s] - b[s] for s in seeds], dtype=float)  # (n,)


def bootstrap_interval(diffs, level=0.95, n_boot=10000, seed=0):
    """(mean, lo, hi): the mean paired difference and its percentile bootstrap interval, resampling seeds
    with replacement (seeded, so a rerun prints the same interval). Fewer than 2: lo = hi = nan.
    With few seeds the percentile bootstrap is narrower than the t-interval (it ignores that s is itself
    estimated), so the summary prints the paired t-interval beside it."""
    d = np.asarray(diffs, dtype=float)  # (n,)
    if len(d) == 0:
        return (math.nan, math.nan, math.nan)
    if len(d) < 2:
        return (float(d[0]), math.nan, math.nan)
    # resampling the differences d = a - b is scipy's paired bootstrap of (a, b) with statistic mean(a - b):
    # eval.py's bootstrap_ci, the project's one call of scipy.stats.bootstrap (percentile, seeded)
    return (float(d.mean()), *bootstrap_ci(d, level, n_boot, seed))


def claim_sentence(a, b, metric, n, boot, t):
    """One sentence: does the bootstrap interval of a - b exclude zero? boot, t: (mean, lo, hi).
    An end exactly at 0 does not exclude it. The t-interval is named when it reads differently."""
    mean, lo, hi = boot
    head = f"{a} - {b}, {metric}: {mean:+.3f}"
    if n < 2 or math.isnan(lo):
        return f"{head} over {n} paired seed(s): too few seeds for an interval, no claim."
    head += f", 95% bootstrap interval [{lo:+.3f}, {hi:+.3f}] over {n} paired seeds"
    if lo > 0:
        verdict, t_agrees = f"excludes zero: {a} is higher", t[1] > 0
    elif hi < 0:
        verdict, t_agrees = f"excludes zero: {a} is lower", t[2] < 0
    else:
        verdict, t_agrees = f"includes zero: {a} and {b} do not separate", t[1] <= 0 <= t[2]
    note = "" if t_agrees else (f" (the paired t-interval, [{t[1]:+.3f}, {t[2]:+.3f}], "
                                f"{'excludes' if t[1] > 0 or t[2] < 0 else 'includes'} zero)")
    return f"{head}; it {verdict}{note}."


def auc_sentence(method, n, stat):
    """One sentence: does the t-interval over seeds of a critic's AUC exclude 0.5 (chance)?"""
    mean, lo, hi = stat
    if n < 2 or math.isnan(lo):
        return f"{method}: critic AUC {mean:.3f} over {n} seed(s): too few seeds for an interval, no claim."
    verdict = ("excludes 0.5: the critic ranks right responses above wrong ones more often than chance" if lo > 0.5
               else "excludes 0.5: the critic ranks wrong responses above right ones" if hi < 0.5
               else "includes 0.5: no evidence that the critic ranks better than chance")
    return f"{method}: critic AUC {mean:.3f}, 95% t-interval [{lo:.3f}, {hi:.3f}] over {n} seeds; it {verdict}."


def fmt_ci(stat):
    mean, lo, hi = stat
    return f"{mean:.3f}" if math.isnan(lo) else f"{mean:.3f} [{lo:.3f}, {hi:.3f}]"


def final_mean(rows, key, last):
    """Mean of `key` over the last `last` logged steps: one step's reward on 32 samples is noisy."""
    return float(np.mean([r[key] for r in rows[-last:]]))


def pooled_auc(rows):
    """A run's critic AUC over all its steps: (right, wrong) pairs ranked right / pairs, pooled (steps with few
    pairs weigh little); nan when no step had a mixed group in mini-batches 1..M-1."""
    pairs = sum(r.get("critic_pairs") or 0 for r in rows)
    won = sum(r["critic_auc"] * r["critic_pairs"] for r in rows if r.get("critic_pairs"))
    return won / pairs if pairs else math.nan


def reml_profile(groups, ratio):
    """The REML log-likelihood of the one-way random-intercept model d = mu + b_base + e (b ~ N(0, s_b^2), e ~ N(0,
    s_w^2)) at the variance ratio `ratio` = s_b^2 / s_w^2, with mu and s_w^2 at their REML values for that ratio
    (both have closed forms): (loglik, mu, s_w^2). groups: one array of seeds' values per base.

    Per base b with n_b seeds and mean m_b, the weight w_b = n_b / (1 + ratio n_b); mu = sum w_b m_b / sum w_b (GLS);
    Q = SS_within + sum w_b (m_b - mu)^2; s_w^2 = Q / (N - 1); and
    loglik = -1/2 [(N - 1) (log(2 pi s_w^2) + 1) + sum log(1 + ratio n_b) + log sum w_b]: the REML log-likelihood
    -1/2 [log|V| + log|X'V^-1 X| + r'V^-1 r + (N - 1) log 2 pi] of V = s_w^2 (I + ratio Z Z'), X the column of ones,
    Z the bases' indicators, with the scale profiled out (tests/test_bases.py checks it against that matrix form)."""
    n = np.array([len(g) for g in groups], dtype=float)  # (K,)
    m = np.array([np.mean(g) for g in groups])  # (K,)
    ss_within = float(sum(np.sum((np.asarray(g, dtype=float) - np.mean(g)) ** 2) for g in groups))
    w = n / (1.0 + ratio * n)  # (K,)
    mu = float(np.sum(w * m) / np.sum(w))
    q = ss_within + float(np.sum(w * (m - mu) ** 2))
    dof = n.sum() - 1
    if q <= 0:  # every value equal: no spread to estimate a variance from
        return -math.inf, mu, 0.0
    loglik = -0.5 * (dof * (math.log(2 * math.pi * q / dof) + 1) + float(np.sum(np.log1p(ratio * n)))
                     + math.log(float(np.sum(w))))
    return loglik, mu, q / dof


# the profile's search: the ratio s_b^2 / s_w^2 at 0 and on a log grid from 1e-8 to 1e6 (20 points a decade), then
# Brent's bounded search between the best grid point's neighbours. A best point at the grid's top is no optimum found
RATIO_GRID = np.concatenate([[0.0], np.logspace(-8, 6, 281)])
NEGLIGIBLE = 0.01  # the boundary flag: s_b^2 at most 1% of the sampling variance of the best-measured base's mean


def over_bases(diffs_by_base, level=0.95):
    """A paired difference's mean over the population of bases a recipe builds, from each base's per-seed paired
    differences ({base: [d per seed]}, unbalanced allowed): a linear mixed model d = mu + b_base + e, b ~ N(0, s_b^2)
    the base's random intercept, e ~ N(0, s_w^2) the seed's, fitted by REML.

    The fit profiles the REML likelihood over the one parameter left once mu and s_w^2 take their closed forms, the
    ratio s_b^2 / s_w^2 (`reml_profile`): every point of RATIO_GRID, 0 included, then Brent's bounded search between
    the best point's neighbours, and 0 again if no positive ratio beats it. The REML optimum lies at 0 whenever the
    bases' means differ no more than their seeds say they would; a search over variances (statsmodels' MixedLM) often
    stops short of it. `converged` is False, and said, when the best point is the grid's top (s_b^2 beyond 1e6 s_w^2:
    no seed spread to weigh the bases by) or Brent's search fails.

    Returns mu, its standard error, the interval mu +- t_{K-1} se (the K bases are the units: K - 1 degrees of
    freedom, as the t-interval over base means has, which it equals in a balanced design), s_b and s_w, each base's
    share of mu's weight (`weights`, in the input's order), the REML log-likelihood at the optimum and at s_b = 0,
    `converged`, and `boundary`: s_b negligible beside the seeds', s_b^2 <= NEGLIGIBLE * s_w^2 / (the largest base's
    seeds), where it changes no base's weight by more than 1%. Fewer than 2 bases: nan."""
    from scipy import optimize
    bases = [b for b in diffs_by_base if len(diffs_by_base[b])]
    K = len(bases)
    nan = {"mean": math.nan, "se": math.nan, "ci": [math.nan, math.nan], "between_sd": math.nan,
           "within_sd": math.nan, "bases": K, "df": max(K - 1, 0), "boundary": None, "converged": None,
           "weights": [math.nan] * K, "loglik": math.nan, "loglik_at_0": math.nan}
    if K < 2:
        return nan
    groups = [np.asarray(diffs_by_base[b], dtype=float) for b in bases]
    sizes = np.array([len(g) for g in groups], dtype=float)  # (K,)
    if sizes.sum() == K:  # one seed per base: no within-base spread to separate from the between-base one
        return {**nan, "mean": float(np.mean([g[0] for g in groups]))}
    if np.ptp(np.concatenate(groups)) == 0:  # every difference the same: no variance to estimate, no optimum
        return {**nan, "mean": float(groups[0][0]), "converged": False}
    profile = lambda r: reml_profile(groups, r)[0]
    grid = np.array([profile(r) for r in RATIO_GRID])  # (281 + 1,)
    i = int(np.argmax(grid))
    ratio, loglik, converged = float(RATIO_GRID[i]), float(grid[i]), bool(np.isfinite(grid[i]))
    if converged and i == len(RATIO_GRID) - 1:
        converged = False  # still rising at s_b^2 = 1e6 s_w^2: no optimum in the search
    elif converged:
        lo, hi = RATIO_GRID[max(i - 1, 0)], RATIO_GRID[i + 1]
        res = optimize.minimize_scalar(lambda r: -profile(r), bounds=(lo, hi), method="bounded",
                                       options={"xatol": 1e-9 * hi})
        converged = bool(res.success)
        if converged and -res.fun > loglik:
            ratio, loglik = float(res.x), float(-res.fun)
        if grid[0] >= loglik - 1e-10:  # nothing measurably above s_b = 0 (1e-10 nats): the boundary is the optimum
            ratio, loglik = 0.0, float(grid[0])
    _, mu, within = reml_profile(groups, ratio)
    between = ratio * within
    # mu is the GLS mean, each base weighted by 1 / (s_b^2 + s_w^2 / n_b); its variance is 1 / sum of the weights
    weights = 1.0 / (between + within / sizes) if within > 0 else sizes  # (K,)
    se = math.sqrt(1.0 / float(np.sum(weights))) if within > 0 else math.nan
    half = stats.t.ppf((1 + level) / 2, K - 1) * se
    return {"mean": mu, "se": se, "ci": [float(mu - half), float(mu + half)], "between_sd": math.sqrt(between),
            "within_sd": math.sqrt(within), "bases": K, "df": K - 1,
            "boundary": bool(between <= NEGLIGIBLE * within / sizes.max()), "converged": converged,
            "weights": [float(x) for x in weights / weights.sum()], "loglik": loglik, "loglik_at_0": float(grid[0])}
