"""eval.py: the pass@k estimator, an end-to-end run of a tiny model, resume after a kill, the report, errors."""
import itertools
import json
import math
import os
import subprocess
import sys
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings, strategies as st

import eval as ev

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- pass@k ---------------------------------------------------------------------------------------
def brute_pass_at_k(n, c, k):
    """Share of the k-subsets of n samples (the first c correct) that hold a correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


def exact_pass_at_k(n, c, k):
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def test_pass_at_k_matches_enumeration_small_n():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert ev.pass_at_k(n, c, k) == pytest.approx(float(brute_pass_at_k(n, c, k)), abs=1e-12)


@pytest.mark.parametrize("n", [16, 100, 257, 1024])
def test_pass_at_k_matches_exact_arithmetic_large_n(n):
    cs = sorted({0, 1, 2, 3, 5, 10, n // 10, n // 4, n // 2, n - 20, n - 3, n - 1, n} & set(range(n + 1)))
    ks = sorted({1, 2, 3, 4, 8, 16, 64, 256, 512, 1000, 1024, n} & set(range(1, n + 1)))
    for c in cs:
        for k in ks:
            got = ev.pass_at_k(n, c, k)
            assert abs(Fraction(got) - exact_pass_at_k(n, c, k)) < Fraction(1, 10 ** 9), (n, c, k)
            if c > n - k:  # every k-subset holds a correct sample
                assert got == 1.0
            assert 0.0 <= got <= 1.0


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_pass_at_k_property_exact(data):
    n = data.draw(st.integers(1, 1024))
    c = data.draw(st.integers(0, n))
    k = data.draw(st.integers(1, n))
    got = ev.pass_at_k(n, c, k)
    assert abs(Fraction(got) - exact_pass_at_k(n, c, k)) < Fraction(1, 10 ** 9)
    if k < n:  # more samples drawn, or more correct ones, never lower the chance
        assert ev.pass_at_k(n, c, k + 1) >= got
    if c < n:
        assert ev.pass_at_k(n, c + 1, k) >= got
    if c == 0:
        assert got == 0.0


@pytest.mark.parametrize("n, c, k", [(4, 0, 5), (4, 5, 1), (4, -1, 1), (4, 1, 0), (0, 0, 1)])
def test_pass_at_k_errors(n, c, k):
    with pytest.raises(ValueError):
        ev.pass_at_k(n, c, k)


def test_dataset_metrics_aggregates():
    rows = [{"correct": [False] * 4, "lengths": [10] * 4, "truncated": [True] * 4},
            {"correct": [True, True, False, False], "lengths": [20] * 4, "truncated": [False] * 4},
            {"correct": [True] * 4, "lengths": [30] * 4, "truncated": [False] * 4}]
    m = ev.dataset_metrics(rows, [1, 2, 4], seed=0)
    assert m["problems"] == 3 and m["n"] == 4
    assert m["pass@k"]["1"] == pytest.approx(0.5)  # pass@1 = mean accuracy
    assert m["pass@k"]["2"] == pytest.approx((0 + 5 / 6 + 1) / 3)  # 1 - C(2,2)/C(4,2) = 5/6
    assert m["pass@k"]["4"] == pytest.approx(2 / 3)
    assert m["avg@n"] == pytest.approx(0.5)
    lo, hi = m["avg@n_ci95"]
    assert 0.0 <= lo <= 0.5 <= hi <= 1.0 and lo < hi
    assert m["mean_length"] == pytest.approx(20.0) and m["truncated"] == pytest.approx(1 / 3)
    assert ev.dataset_metrics(rows, [1, 2, 4], seed=0) == m  # the bootstrap is seeded


def test_parse_ks():
    assert ev.parse_ks("", 16) == [1, 2, 4, 8, 16]
    assert ev.parse_ks("", 6) == [1, 2, 4, 6]
    assert ev.parse_ks("4,1,2,2", 4) == [1, 2, 4]
    for bad in ("1,8", "0", "a"):
        with pytest.raises(ev.ConfigError):
            ev.parse_ks(bad, 4)


# ---- end to end on the tiny model ------------------------------------------------------------------
def eval_args(model, data, out, *extra):
    return ["--model", model, "--datasets", data, "--n", "2", "--k", "1,2", "--max-new-tokens", "6",
            "--temperature", "1.0", "--batch-size", "4", "--out", str(out), *extra]


def test_eval_generates_on_the_kernels_of_the_runs_rollouts_on_cuda(tiny_model_dir, tiny_problems_file, tmp_path,
                                                                    monkeypatch):
    """On CUDA eval.py turns SDPA's math and cuDNN kernels off before the model loads, as pacs.py's run does (SDPA
    picked cuDNN for masked calls on an H200, a kernel pacs.py's rollouts never run)."""
    calls = []
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", lambda on: calls.append(("cudnn", on)))
    monkeypatch.setattr(torch.backends.cuda, "enable_math_sdp", lambda on: calls.append(("math", on)))
    monkeypatch.setattr(ev.plumbing, "resolve_device", lambda name: torch.device("cuda"))

    def load_model(*args, **kwargs):
        calls.append("load")
        raise SystemExit("stop before CUDA")
    monkeypatch.setattr(ev.plumbing, "load_model", load_model)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        with pytest.raises(SystemExit, match="stop before CUDA"):
            ev.main(eval_args(tiny_model_dir, tiny_problems_file, tmp_path / "run"))
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    assert calls == [("math", False), ("cudnn", False), "load"]


def read_rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_flags_come_from_a_dataclass_as_in_pacs_py():
    """eval.py declares its flags as pacs.py does (a dataclass, one help per field, lines within 110 columns),
    parsed by the same plumbing.parse_flags (HfArgumentParser); --report still takes one or more directories."""
    import dataclasses
    import inspect
    for cls in (ev.pacs.Config, ev.EvalConfig):
        assert all(f.metadata["help"] for f in dataclasses.fields(cls)), cls.__name__
        assert max(len(line) for line in inspect.getsource(cls).splitlines()) <= 110, cls.__name__
    args = ev.parse_args(["--report", "runs/a", "runs/b", "--top-p", "0.5", "--n", "4"])
    assert isinstance(args, ev.EvalConfig)
    assert (args.report, args.top_p, args.n, args.report_out) == (["runs/a", "runs/b"], 0.5, 4, "report.png")
    assert ev.parse_args([]).report is None


def test_end_to_end_writes_samples_and_metrics(tiny_model_dir, tiny_problems_file, tmp_path, capsys):
    from verify import verify
    ev.main(eval_args(tiny_model_dir, tiny_problems_file, tmp_path / "run"))
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    rows = read_rows(tmp_path / "run" / "samples.jsonl")
    problems = [json.loads(line) for line in open(tiny_problems_file)]
    assert [(r["dataset"], r["id"]) for r in rows] == [("tiny", p["id"]) for p in problems]
    for r, p in zip(rows, problems):
        assert set(r) == {"dataset", "id", "problem", "gold", "responses", "extracted", "correct", "lengths",
                          "truncated"}
        assert r["problem"] == p["problem"] and r["gold"] == p["answer"]
        assert all(len(r[key]) == 2 for key in ("responses", "extracted", "correct", "lengths", "truncated"))
        assert r["correct"] == [verify(t, p["answer"]) for t in r["responses"]]
        assert all(isinstance(x, int) and 1 <= x <= 6 for x in r["lengths"])
        assert all(x == 6 for t, x in zip(r["truncated"], r["lengths"]) if t)  # truncated = no EOS within the limit
    m = metrics["datasets"]["tiny"]
    assert set(m) == {"problems", "n", "pass@k", "avg@n", "avg@n_ci95", "mean_length", "truncated"}
    assert m["problems"] == 8 and m["n"] == 2 and set(m["pass@k"]) == {"1", "2"}
    flags = [x for r in rows for x in r["correct"]]
    assert m["avg@n"] == pytest.approx(sum(flags) / len(flags)) == pytest.approx(m["pass@k"]["1"])
    assert metrics["temperature"] == 1.0 and metrics["n"] == 2
    out = capsys.readouterr().out
    assert "tiny: 8 problems x 2 samples" in out and "pass@2" in out and "avg@2" in out

    # a rerun with another --k reuses the stored samples; one with other sample settings is refused
    ev.main(eval_args(tiny_model_dir, tiny_problems_file, tmp_path / "run")[:-2]
            + ["--k", "1", "--out", str(tmp_path / "run")])
    assert len(read_rows(tmp_path / "run" / "samples.jsonl")) == 8
    assert set(json.loads((tmp_path / "run" / "metrics.json").read_text())["datasets"]["tiny"]["pass@k"]) == {"1"}
    with pytest.raises(SystemExit, match="eval.py: error: .*other settings.*temperature"):
        ev.main(eval_args(tiny_model_dir, tiny_problems_file, tmp_path / "run", "--temperature", "0.5"))


def test_resume_after_kill_gives_identical_metrics(tiny_model_dir, tiny_problems_file, tmp_path, monkeypatch):
    ev.main(eval_args(tiny_model_dir, tiny_problems_file, tmp_path / "full"))

    # kill after 3 rows: the middle of the second batch (2 problems x 2 samples per generate call)
    class Killed(Exception):
        pass

    real_append, written = ev.append_row, []

    def dying_append(f, row):
        if len(written) == 3:
            raise Killed
        real_append(f, row)
        written.append(row["id"])

    monkeypatch.setattr(ev, "append_row", dying_append)
    with pytest.raises(Killed):
        ev.main(eval_args(tiny_model_dir, tiny_problems_file, tmp_path / "resumed"))
    monkeypatch.setattr(ev, "append_row", real_append)
    path = tmp_path / "resumed" / "samples.jsonl"
    assert len(read_rows(path)) == 3 and not (tmp_path / "resumed" / "metrics.json").exists()
    with open(path, "a") as f:  # and a half-written line, as a kill during write() leaves it
        f.write('{"dataset": "tiny", "id": "t3", "respon')

    ev.main(eval_args(tiny_model_dir, tiny_problems_file, tmp_path / "resumed"))
    full, resumed = read_rows(tmp_path / "full" / "samples.jsonl"), read_rows(path)
    assert [r["id"] for r in resumed] == [f"t{i}" for i in range(8)]  # each problem once, finished ones kept
    assert resumed == full  # unfinished problems were sampled exactly as in the uninterrupted run
    assert (tmp_path / "resumed" / "metrics.json").read_text() == (tmp_path / "full" / "metrics.json").read_text()


# ---- report ---------------------------------------------------------------------------------------
def fake_run(path, acc, aime_ks):
    rows = [{"correct": [i < c for i in range(8)], "lengths": [100] * 8, "truncated": [False] * 8} for c in acc]
    os.makedirs(path)
    metrics = {"model": str(path), "n": 8, "datasets": {"math500": ev.dataset_metrics(rows, [1, 2, 4, 8]),
                                                         "aime24": ev.dataset_metrics(rows[:2], aime_ks)}}
    (path / "metrics.json").write_text(json.dumps(metrics))
    return metrics


def test_report_table_and_png(tmp_path, capsys):
    base = fake_run(tmp_path / "base", [0, 1, 2, 8], [1, 4, 8])
    fake_run(tmp_path / "pacs", [1, 3, 4, 8], [1, 2, 4, 8])
    png = tmp_path / "plots" / "cmp.png"
    ev.main(["--report", str(tmp_path / "base"), str(tmp_path / "pacs"), "--report-out", str(png)])
    out = capsys.readouterr().out
    assert "base" in out and "pacs" in out and "math500 pass@8" in out and "aime24 pass@4" in out
    md = [line for line in out.splitlines() if line.startswith("| base")]
    assert md and f"{100 * base['datasets']['math500']['pass@k']['1']:.1f}" in md[0]
    assert "| - |" in md[0]  # base has no aime24 pass@2: an empty cell, not a crash
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- errors: one line, no traceback ----------------------------------------------------------------
def test_errors_are_one_line(tiny_model_dir, tiny_problems_file, tmp_path):
    cases = [
        (eval_args(tiny_model_dir, "nosuchset", tmp_path / "a"), "unknown dataset"),
        (eval_args(tiny_model_dir, tiny_problems_file, tmp_path / "b")[:-2]
         + ["--k", "4", "--out", str(tmp_path / "b")], "--k"),
        (eval_args(str(tmp_path / "no_model"), tiny_problems_file, tmp_path / "c"), "model path not found"),
        (["--report", str(tmp_path)], "no metrics.json"),
    ]
    for argv, msg in cases:
        with pytest.raises(SystemExit) as e:
            ev.main(argv)
        assert str(e.value.code).startswith("eval.py: error: ") and msg in str(e.value.code)
        assert "\n" not in str(e.value.code)
    ev.main(eval_args(tiny_model_dir, tiny_problems_file, tmp_path / "c"))  # the typo fixed: same --out works
    assert len(read_rows(tmp_path / "c" / "samples.jsonl")) == 8
    # and from the command line: a message on stderr, exit 1, no traceback
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), "--report", str(tmp_path / "empty")],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("eval.py: error: no metrics.json")


# ---- behaviours the README states: the interval is over problems; resume and reruns never resample ----
def bootstrap_quantile_all_or_nothing(P, k, q):
    """Exact q-quantile of the bootstrap avg@n when k of P problems are all right and the rest all wrong:
    resampling P problems draws K ~ Binomial(P, k/P) all-right ones, so avg@n = K / P."""
    cdf = 0.0
    for K in range(P + 1):
        cdf += math.comb(P, K) * (k / P) ** K * (1 - k / P) ** (P - K)
        if cdf >= q:
            return K / P


def test_bootstrap_interval_resamples_problems_not_samples():
    P, n = 10, 4
    rows = lambda correct: [{"correct": c, "lengths": [1] * n, "truncated": [False] * n} for c in correct]
    # the same 20 correct samples out of 40, either as 5 all-right + 5 all-wrong problems or 2 per problem
    split = rows([[True] * n] * 5 + [[False] * n] * 5)
    even = rows([[True, True, False, False]] * P)
    for seed in (0, 1, 2):
        m_split, m_even = ev.dataset_metrics(split, [1], seed), ev.dataset_metrics(even, [1], seed)
        assert m_split["avg@n"] == m_even["avg@n"] == 0.5
        # every problem scores 0.5: resampling problems cannot move the mean (samples would: about +-0.15)
        assert m_even["avg@n_ci95"] == [0.5, 0.5]
        want = [bootstrap_quantile_all_or_nothing(P, 5, 0.025), bootstrap_quantile_all_or_nothing(P, 5, 0.975)]
        assert want == [0.2, 0.8]
        assert m_split["avg@n_ci95"] == pytest.approx(want, abs=1e-9)


def test_resume_never_resamples_a_finished_batch_and_a_rerun_with_other_k_samples_nothing(
        tiny_model_dir, tiny_problems_file, tmp_path, monkeypatch):
    import pacs
    import plumbing
    out = tmp_path / "run"
    problems = [json.loads(line) for line in open(tiny_problems_file)]

    class Killed(Exception):
        pass

    real_append, real_sample = ev.append_row, pacs.sample
    appended, sampled = [], []

    def dying_append(f, row):
        if len(appended) == 3:  # killed after t0, t1 (the first batch of 2 problems) and t2
            raise Killed
        real_append(f, row)
        appended.append(row["id"])

    monkeypatch.setattr(ev, "append_row", dying_append)
    with pytest.raises(Killed):
        ev.main(eval_args(tiny_model_dir, tiny_problems_file, out))
    before = (out / "samples.jsonl").read_text().splitlines(keepends=True)
    assert len(before) == 3

    def counting_sample(model, tokenizer, prompts, *args, **kwargs):
        sampled.extend(prompts)
        return real_sample(model, tokenizer, prompts, *args, **kwargs)

    def counting_append(f, row):
        real_append(f, row)
        appended.append(row["id"])

    monkeypatch.setattr(ev, "append_row", counting_append)
    monkeypatch.setattr(pacs, "sample", counting_sample)
    appended.clear()
    ev.main(eval_args(tiny_model_dir, tiny_problems_file, out))
    _, tok = plumbing.load_model(tiny_model_dir)
    prompt = {p["id"]: plumbing.build_prompt(tok, p["problem"]) for p in problems}
    assert prompt["t0"] not in sampled and prompt["t1"] not in sampled  # the finished batch is never redone
    assert all(prompt[f"t{i}"] in sampled for i in range(3, 8))
    assert appended == [f"t{i}" for i in range(3, 8)]  # t2 finished before the kill: its row is kept, not redone
    after = (out / "samples.jsonl").read_text().splitlines(keepends=True)
    assert after[:3] == before and len(after) == 8

    # everything finished: a rerun with another --k reads samples.jsonl only (no model, no sampling)
    sampled.clear()

    def no_model(*args, **kwargs):
        raise AssertionError("a finished run loaded the model again")

    monkeypatch.setattr(plumbing, "load_model", no_model)
    ev.main(eval_args(tiny_model_dir, tiny_problems_file, out)[:-2] + ["--k", "1", "--out", str(out)])
    assert sampled == [] and (out / "samples.jsonl").read_text().splitlines(keepends=True) == after
    assert set(json.loads((out / "metrics.json").read_text())["datasets"]["tiny"]["pass@k"]) == {"1"}


# ---- paper v2's protocol and the BeyondAIME preset -------------------------------------------------------------
def test_protocol_v2_gives_its_settings_to_the_flags_left_unset():
    """--protocol v2 is arXiv 2509.02522v2's evaluation (Sec. 4.1, Table 5); a flag given keeps its value."""
    v2 = ev.parse_args(["--protocol", "v2"])
    assert (v2.datasets, v2.n, v2.k, v2.temperature, v2.top_p, v2.max_new_tokens) == (
        "math500,amc23,aime24,aime25,beyondaime", 128, "1,4,8,16,32,64", 0.6, 0.95, 8192)
    assert ev.parse_ks(v2.k, v2.n) == [1, 4, 8, 16, 32, 64]
    default = ev.parse_args([])
    assert (default.datasets, default.n, default.k, default.temperature, default.top_p, default.max_new_tokens) == (
        "math500,amc23,aime24,aime25", 16, "", 0.6, 0.95, 1024)
    mine = ev.parse_args(["--protocol", "v2", "--n", "16", "--temperature", "1.0", "--max-new-tokens", "64",
                          "--datasets", "aime24"])
    assert (mine.n, mine.temperature, mine.max_new_tokens, mine.datasets) == (16, 1.0, 64, "aime24")
    assert (mine.top_p, mine.k) == (0.95, "1,4,8,16")  # the protocol's k, those within the --n given
    assert ev.parse_args(["--protocol", "v2", "--k", "2,128"]).k == "2,128"  # a --k given is kept as given
    with pytest.raises(SystemExit):  # not a protocol: argparse's usage error
        ev.parse_args(["--protocol", "v3"])


BEYONDAIME_ROWS = [{"problem": f"Find {i} + 100.", "answer": 100 + i} for i in range(4)]  # the hub's columns


def write_beyondaime(data_dir):
    """An offline copy in the hub's format: its columns problem and answer, the answers integers."""
    data_dir.mkdir(exist_ok=True)
    (data_dir / "beyondaime.jsonl").write_text("".join(json.dumps(r) + "\n" for r in BEYONDAIME_ROWS))
    return str(data_dir)


def test_beyondaime_preset_from_an_offline_copy_under_protocol_v2(tiny_model_dir, tmp_path):
    data = write_beyondaime(tmp_path / "data")
    ev.main(["--protocol", "v2", "--model", tiny_model_dir, "--datasets", "beyondaime", "--data-dir", data,
             "--n", "2", "--max-new-tokens", "4", "--batch-size", "4", "--out", str(tmp_path / "run")])
    rows = read_rows(tmp_path / "run" / "samples.jsonl")
    assert [(r["dataset"], r["id"], r["problem"], r["gold"]) for r in rows] == [
        ("beyondaime", str(i), r["problem"], str(r["answer"])) for i, r in enumerate(BEYONDAIME_ROWS)]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert (metrics["n"], metrics["temperature"], metrics["top_p"], metrics["max_new_tokens"]) == (2, 0.6, 0.95, 4)
    assert set(metrics["datasets"]) == {"beyondaime"}
    assert set(metrics["datasets"]["beyondaime"]["pass@k"]) == {"1"}  # v2's k within n = 2
    assert "beyondaime" not in ev.plumbing.PRESETS  # added for the call only: the training presets stay as they are


def test_beyondaime_preset_loads_its_hub_dataset(monkeypatch, tmp_path):
    """Through plumbing.load_problems's hub code: ByteDance-Seed/BeyondAIME, split test, columns problem and answer."""
    import datasets
    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        return datasets.Dataset.from_list(BEYONDAIME_ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert ev.load_problems("beyondaime") == [{"id": str(i), "problem": r["problem"], "answer": str(r["answer"])}
                                              for i, r in enumerate(BEYONDAIME_ROWS)]
    assert calls == [("ByteDance-Seed/BeyondAIME", None, "test")]

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    errors = [(["--datasets", "beyondaime"], "cannot load ByteDance-Seed/BeyondAIME from the hub"),
              (["--datasets", "beyondaime", "--data-dir", str(tmp_path)], "dataset file not found"),
              (["--datasets", "nosuchset"], "beyondaime")]  # the error lists it among the presets
    for argv, msg in errors:
        with pytest.raises(SystemExit) as e:
            ev.main(["--model", "unused", "--out", str(tmp_path / "out"), *argv])
        assert str(e.value.code).startswith("eval.py: error: ") and msg in str(e.value.code)
        assert "\n" not in str(e.value.code)
