"""experiments/lab.py: the task (splits disjoint by problem, every gold answer accepted by verify.py, near
neighbours rejected, the skills every problem shares), the tokenizer (short sequences, the chat template,
identical after a reload), and the builder at toy size: a directory pacs.py trains on and eval.py scores,
the same bytes for the same seed, one-line errors for bad flags."""
import json
import os
import re
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import lab  # noqa: E402
import pacs  # noqa: E402
import plumbing
from verify import verify  # noqa: E402

SIZES = {"sft": 3000, "train": 1000, "val": 200, "test": 200}


@pytest.fixture(scope="module")
def splits():
    return lab.make_splits(0, SIZES)


# ---- the task ---------------------------------------------------------------------------------------
def test_splits_have_their_sizes_and_share_no_problem(splits):
    assert {s: len(r) for s, r in splits.items()} == SIZES
    problems = [r["problem"] for rows in splits.values() for r in rows]
    assert len(set(problems)) == len(problems)  # no problem twice, within or across splits
    ids = [r["id"] for rows in splits.values() for r in rows]
    assert len(set(ids)) == len(ids)
    assert all(set(r) == {"id", "problem", "answer", "solution", "source"} for rows in splits.values() for r in rows)


def test_splits_are_a_function_of_the_seed(splits):
    assert lab.make_splits(0, SIZES) == splits
    assert lab.make_splits(1, SIZES)["test"] != splits["test"]


def test_every_solution_is_correct_arithmetic_from_the_same_two_skills(splits):
    # What is a+b-c?  ->  a+b=x \n x-c=\boxed{y}: a two-digit start, one-digit steps, each line from the last total
    for r in (r for rows in splits.values() for r in rows):
        expr = re.fullmatch(r"What is (\d\d)([+-])(\d)([+-])(\d)\?", r["problem"])
        assert expr, r["problem"]
        a, op1, b, op2, c = expr.groups()
        x = int(a) + int(b) if op1 == "+" else int(a) - int(b)
        y = x + int(c) if op2 == "+" else x - int(c)
        assert 0 <= x and 0 <= y and r["answer"] == str(y) and r["source"] == lab.SOURCE
        assert r["solution"] == f"{a}{op1}{b}={x}\n{x}{op2}{c}=\\boxed{{{y}}}"
    # the skills are shared: every sign pattern, carries and borrows are common in each split
    for rows in splits.values():
        ops = [r["problem"][10] + r["problem"][12] for r in rows]
        assert all(ops.count(o) > len(rows) / 8 for o in ("++", "+-", "-+", "--"))
        carries = [int(r["problem"][9]) + int(r["problem"][11]) >= 10 for r in rows if r["problem"][10] == "+"]
        assert 0.2 < sum(carries) / len(carries) < 0.8


def test_verify_accepts_every_gold_answer(splits):
    for r in (r for rows in splits.values() for r in rows):
        assert verify(r["solution"], r["answer"]), r
        assert verify(f"\\boxed{{{r['answer']}}}", r["answer"])


def near_neighbours(answer, intermediate):
    g = int(answer)
    out = {g + 1, g - 1, g + 10, g - 10, 10 * g, g // 10, -g, int(str(g)[::-1]), int(str(g) + str(g)[-1]),
           intermediate}
    return sorted(out - {g})


def test_verify_rejects_near_neighbours(splits):
    checked = 0
    for r in splits["test"] + splits["val"]:
        intermediate = int(r["solution"].split("\n")[0].split("=")[1])
        head = r["solution"].split("\\boxed")[0]
        for wrong in near_neighbours(r["answer"], intermediate):
            assert not verify(f"{head}\\boxed{{{wrong}}}", r["answer"]), (r, wrong)
            checked += 1
    assert checked > 3000


def test_verify_takes_an_expression_equal_to_the_gold_as_right():
    # not a near neighbour but the same value: verify.py reads \boxed{71-5} as 66. A policy that boxes the
    # problem's own expression is paid for it; the sweep measures how often that happens (trend.py's
    # boxed_expressions) instead of trusting it never does. Should verify.py ever refuse it, this test says so.
    assert verify("63+8=71\n71-5=\\boxed{71-5}", "66") and verify("\\boxed{63+8-5}", "66")
    assert not verify("\\boxed{63+8-4}", "66")


def test_ops_ranges_give_longer_chains_than_sft_saw():
    """--ops A-B draws each RL problem's number of operations in [A, B], --sft-ops SFT's; a solution writes one line
    per operation, and the answer is the chain's value."""
    splits = lab.make_splits(0, {"sft": 2000, "train": 400, "val": 100, "test": 100}, 9, "2-4", "1-3")
    lines = lambda rows: {r["solution"].count("\n") + 1 for r in rows}
    assert lines(splits["sft"]) == {1, 2, 3} and lines(splits["test"]) == lines(splits["train"]) == {2, 3, 4}
    for r in splits["test"]:
        assert eval(r["problem"][len("What is "):-1]) == int(r["answer"])  # noqa: S307 (digits, + and - only)
        assert r["solution"].count("\n") + 1 == len(re.findall(r"[+-]", r["problem"]))
    assert lab.parse_ops("3") == (3, 3) and lab.parse_ops("2-5") == (2, 5)


# ---- the tokenizer ----------------------------------------------------------------------------------
def test_tokenizer_keeps_sequences_short_and_survives_a_reload(splits, tmp_path):
    tok = lab.make_tokenizer()
    assert len(tok) < 32
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer
    again = AutoTokenizer.from_pretrained(tmp_path)  # as plumbing.load_model reloads it
    for r in splits["test"]:
        prompt = plumbing.build_prompt(tok, r["problem"])
        assert prompt.startswith("<|user|>What is") and prompt.endswith(plumbing.PROMPT_SUFFIX + "<|assistant|>")
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        s_ids = tok(r["solution"], add_special_tokens=False)["input_ids"]
        assert len(p_ids) == 12 and len(s_ids) <= 20  # + EOS: at most 21 tokens to write
        assert tok.decode(s_ids) == r["solution"] and tok.decode(p_ids) == prompt
        assert again(prompt, add_special_tokens=False)["input_ids"] == p_ids
        assert again(r["solution"], add_special_tokens=False)["input_ids"] == s_ids
        assert plumbing.build_prompt(again, r["problem"]) == prompt


# ---- the builder ------------------------------------------------------------------------------------
TOY = ["--sft-problems", "64", "--train-problems", "64", "--val-problems", "16", "--test-problems", "8",
       "--hidden", "32", "--layers", "1", "--heads", "2", "--max-sft-steps", "6", "--check-every", "3",
       "--check-problems", "4", "--check-n", "2", "--eval-n", "4", "--max-new-tokens", "24"]


@pytest.fixture(scope="module")
def toy_lab(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("lab") / "lab")
    return out, lab.build(lab.parse_args(["--out", out, "--seed", "3", *TOY]))


def test_toy_build_writes_the_lab(toy_lab, capsys):
    out, summary = toy_lab
    for split, n in (("sft", 64), ("train", 64), ("val", 16), ("test", 8)):
        with open(os.path.join(out, f"{split}.jsonl")) as f:
            assert len([json.loads(line) for line in f]) == n
    assert os.path.isfile(os.path.join(out, "model", "config.json"))
    assert os.path.isfile(os.path.join(out, "eval_base", "metrics.json"))
    with open(os.path.join(out, "lab.json")) as f:
        saved = json.load(f)
    assert saved["weights_sha256"] == summary["weights_sha256"] and len(saved["test_pass@k"]) == 4
    with open(os.path.join(out, "eval_base", "samples.jsonl")) as f:  # the test problems rarely solved
        right = [sum(json.loads(line)["correct"]) for line in f]
    assert len(right) == 8 and saved["test_rare_share"] == sum(c <= 1 for c in right) / 8
    with open(os.path.join(out, "sft_log.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [3, 6]  # --target is out of reach: every check ran


def test_toy_build_prints_base_pass_at_k_last(tmp_path, capsys):
    lab.main(["--out", str(tmp_path / "lab"), "--seed", "3", *TOY])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"pass@1 \d\.\d{3}  solved by at most 1 of 4: \d\.\d{3}", last), last


def test_toy_build_is_deterministic_for_a_seed(toy_lab, tmp_path):
    _, summary = toy_lab
    again = lab.build(lab.parse_args(["--out", str(tmp_path / "again"), "--seed", "3", *TOY]))
    other = lab.build(lab.parse_args(["--out", str(tmp_path / "other"), "--seed", "4", *TOY]))
    assert again["weights_sha256"] == summary["weights_sha256"]
    assert again["test_pass@k"] == summary["test_pass@k"]
    assert other["weights_sha256"] != summary["weights_sha256"]


@pytest.mark.parametrize("checks, kept", [([0.1, 0.2, 0.45, 0.5], 2), ([0.1, 0.26, 0.33, 0.5], 3),
                                          ([0.1, 0.28, 0.33, 0.5], 2),
                                          ([0.35, 0.5], 1)])
def test_sft_keeps_the_check_closest_to_the_target(monkeypatch, checks, kept):
    """SFT ends at the first check >= --target (0.3) and keeps that check's weights or the previous one's."""
    splits = lab.make_splits(0, {"sft": 32, "train": 1, "val": 4, "test": 1})
    args = lab.parse_args(["--out", "unused", *TOY, "--check-every", "2", "--max-sft-steps", "20"])
    tok = lab.make_tokenizer()
    model = lab.make_model(tok, 32, 1, 2, 0)
    script, weights = iter(checks), {}

    def fake_pass1(model, *_):
        weights[len(weights) + 1] = {k: v.clone() for k, v in model.state_dict().items()}
        return next(script)

    monkeypatch.setattr(lab, "sample_pass1", fake_pass1)
    import io
    log = io.StringIO()
    step, val = lab.sft(model, tok, splits["sft"], splits["val"], args, log)
    assert (step, val) == (2 * kept, checks[kept - 1])
    assert len(log.getvalue().splitlines()) == len(weights) == min(len(checks), next(
        i + 1 for i, v in enumerate(checks) if v >= 0.3))  # no check after the first at the target
    state = model.state_dict()
    assert all(torch.equal(state[k], weights[kept][k]) for k in state)


def test_pacs_trains_on_the_toy_lab(toy_lab, tmp_path):
    out, _ = toy_lab
    run = tmp_path / "run"
    pacs.main(["--model", os.path.join(out, "model"), "--dataset", os.path.join(out, "train.jsonl"),
               "--steps", "1", "--prompts-per-step", "4", "--group-size", "4", "--num-mini-batches", "2",
               "--max-new-tokens", "24", "--lr", "1e-3", "--eval-every", "0", "--device", "cpu",
               "--out-dir", str(run)])
    with open(run / "metrics.jsonl") as f:
        (row,) = [json.loads(line) for line in f]
    assert row["step"] == 0 and row["psi_std"] > 0 and row["grad_norm"] > 0  # mini-batch 1 moved off pi_old


@pytest.mark.parametrize("flags, message", [
    (["--hidden", "30", "--heads", "4"], "--hidden 30 is not divisible by --heads 4"),
    (["--eval-n", "0"], "--eval-n must be at least 1"),
    (["--target", "1.5"], "--target must be in (0, 1]"),
    (["--ops", "4-2"], "operations '4-2': expected 1 <= A <= B"),
    (["--sft-ops", "two"], "operations 'two': expected N or A-B"),
])
def test_bad_flags_are_one_line_errors(tmp_path, flags, message):
    with pytest.raises(SystemExit) as e:
        lab.main(["--out", str(tmp_path / "lab"), *flags])
    assert str(e.value).startswith("lab.py: error: ") and message in str(e.value) and "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "lab")


def test_an_existing_out_is_refused(tmp_path):
    (tmp_path / "lab").mkdir()
    with pytest.raises(SystemExit) as e:
        lab.main(["--out", str(tmp_path / "lab")])
    assert str(e.value) == f"lab.py: error: --out {tmp_path / 'lab'} exists; the lab is built into a new directory"


# ---- SFT's loss ---------------------------------------------------------------------------------------
def test_sft_loss_reads_only_the_solution_and_its_eos(splits):
    """encode_sft's labels are -100 on the chat prompt and the padding, and the ids on the solution and its EOS:
    SFT teaches the model to write answers, never to predict the problem it was given."""
    tok = lab.make_tokenizer()
    rows = [splits["sft"][0], splits["sft"][1],
            {"problem": "What is 10+1+1?", "solution": "10+1=11\n11+1=\\boxed{12}"}]
    ids, labels, attention = lab.encode_sft(tok, rows)  # (N, L) each
    for i, r in enumerate(rows):
        prompt = tok(plumbing.build_prompt(tok, r["problem"]), add_special_tokens=False)["input_ids"]
        answer = tok(r["solution"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        n = len(prompt) + len(answer)
        assert ids[i, :n].tolist() == prompt + answer and attention[i].tolist() == [1] * n + [0] * (ids.shape[1] - n)
        assert labels[i].tolist() == [-100] * len(prompt) + answer + [-100] * (ids.shape[1] - n)
        assert tok.decode(labels[i][labels[i] != -100]) == r["solution"] + tok.eos_token


# ---- the shipped labs (experiments/labs/lab/base, and any experiments/labs/<tag>/base) --------------------
# every base of every lab: experiments/labs/<tag>/base, and experiments/labs/<tag>/bases/seed<N>
# (experiments/bases.py), each tested alike
SHIPPED_LABS = sorted(b for d in os.listdir(os.path.join(ROOT, "experiments", "labs"))
                      if os.path.isfile(os.path.join(ROOT, "experiments", "labs", d, "base", "lab.json"))
                      for b in lab.shipped_bases(os.path.join(ROOT, "experiments", "labs", d)))


def test_the_first_lab_is_shipped():
    assert lab.SHIPPED in SHIPPED_LABS


@pytest.mark.parametrize("base", SHIPPED_LABS, ids=lambda p: os.path.relpath(p, ROOT))
def test_a_shipped_labs_splits_regenerate_from_its_seed(base, tmp_path):
    """Python's random is the same on every machine: lab.json's seed and sizes give the splits whose hash it records,
    and ensure_splits writes them into a lab directory that has none (a shipped one commits none)."""
    info = json.load(open(os.path.join(base, "lab.json")))
    cfg = info["settings"]
    splits = lab.splits_for(cfg)  # the chain task's make_splits, or the countdown task's
    assert lab.splits_sha(splits) == info["splits_sha256"]
    (tmp_path / "lab").mkdir()
    (tmp_path / "lab" / "lab.json").write_text(json.dumps(info))
    lab.ensure_splits(str(tmp_path / "lab"))
    assert [json.loads(line) for line in open(tmp_path / "lab" / "test.jsonl")] == splits["test"]
    info["splits_sha256"] = "0" * 64  # a lab.json whose splits the seed does not give: refused, nothing written
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "lab.json").write_text(json.dumps(info))
    with pytest.raises(lab.LabError, match="do not match"):
        lab.ensure_splits(str(tmp_path / "bad"))
    assert not (tmp_path / "bad" / "test.jsonl").exists()


@pytest.mark.parametrize("base", SHIPPED_LABS, ids=lambda p: os.path.relpath(p, ROOT))
def test_a_shipped_labs_weights_are_the_ones_its_lab_json_names(base):
    from transformers import AutoModelForCausalLM
    info = json.load(open(os.path.join(base, "lab.json")))
    model = AutoModelForCausalLM.from_pretrained(os.path.join(base, "model"))
    assert lab.weights_sha(model) == info["weights_sha256"]
    assert sum(p.numel() for p in model.parameters()) == info["parameters"]
    assert {"torch", "cpu", "threads", "python"} <= set(info["machine"])


def _result_files(base):
    """Every result file under experiments/labs/<tag>/results/; problems-*/ holds lab_problems.py's per-problem counts,
    which tests/test_lab_problems.py ties to these (each count file gives back its result file's pass@k)."""
    root = lab.results_root(base)
    return sorted(os.path.join(d, f) for d, _, files in os.walk(root) for f in files
                  if f.endswith(".json") and not os.path.relpath(d, root).startswith("problems-"))


@pytest.mark.parametrize("base", SHIPPED_LABS, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_committed_result_trained_from_its_shipped_base(base):
    """experiments/labs/<tag>/results/** holds only runs from experiments/labs/<tag>/base's weights, each with the
    machine it ran on; runs from another base live in an archive of their own (experiments/labs/<tag>/archive-<sha>/),
    each with that sha."""
    sha = json.load(open(os.path.join(base, "lab.json")))["weights_sha256"]
    files = _result_files(base)
    if not files:
        pytest.skip(f"no result file from {os.path.relpath(base, ROOT)} committed yet")
    for path in files:
        r = json.load(open(path))
        assert r["settings"]["lab_weights_sha256"] == sha, f"{os.path.relpath(path, ROOT)} trained from another base"
        assert {"torch", "cpu"} <= set(r["machine"]), path
    docs = os.path.dirname(base)
    for archive in (d for d in os.listdir(docs) if d.startswith("archive-")):
        prefix = archive.split("-", 1)[1]
        for d, _, names in os.walk(os.path.join(docs, archive)):
            for f in (n for n in names if n.endswith(".json") and re.fullmatch(r".+-s\d+\.json", n)):
                assert json.load(open(os.path.join(d, f)))["settings"]["lab_weights_sha256"].startswith(prefix)
