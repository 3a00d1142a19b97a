"""eval.py --diversity: paper v2's S_div (App. E) over K right samples per problem, its embedders and pooling, the
seeded draw, the problems left out, a comparison restricted to the problems every run shares, and its errors."""
import json
import math
import os

import pytest
import torch

import eval as ev
from conftest import make_tokenizer


# ---- Div(q) -------------------------------------------------------------------------------------------------
def test_pairwise_diversity_orthogonal_identical_and_a_hand_computed_set():
    assert ev.pairwise_diversity(torch.eye(4)) == pytest.approx(1.0)  # orthogonal: cos 0 for every pair
    assert ev.pairwise_diversity(torch.tensor([[3.0, 4.0]] * 3)) == pytest.approx(0.0, abs=1e-12)  # identical
    # (1,0), (0,1), (1,1): cosines 0, 1/sqrt2, 1/sqrt2 over C(3,2) = 3 pairs
    v = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert ev.pairwise_diversity(v) == pytest.approx(1 - math.sqrt(2) / 3, abs=1e-12)
    assert ev.pairwise_diversity(torch.tensor([[1.0, 0.0], [-1.0, 0.0]])) == pytest.approx(2.0)  # opposite: cos -1
    assert ev.pairwise_diversity(2.5 * v) == pytest.approx(ev.pairwise_diversity(v))  # scale does not matter


def test_char_ngram_embedder():
    embed, pooling = ev.load_embedder("char-ngrams")
    assert pooling == "char-ngrams"
    assert ev.pairwise_diversity(embed(["abcd", "wxyz"])) == pytest.approx(1.0)  # no 3-gram shared
    assert ev.pairwise_diversity(embed(["the sum is 7"] * 3)) == pytest.approx(0.0, abs=1e-12)
    # "aaaa": {aaa: 2}; "aaab": {aaa: 1, aab: 1}: cos = 2 / (2 * sqrt 2)
    assert ev.pairwise_diversity(embed(["aaaa", "aaab"])) == pytest.approx(1 - 1 / math.sqrt(2), abs=1e-12)
    assert embed(["ab", "abc"]).tolist() == [[0.0], [1.0]]  # a text shorter than 3 characters: the zero vector


# ---- a tiny embedder built from a config ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_embedders(tmp_path_factory):
    """A random 2-layer Qwen3 with the tests' character tokenizer, saved twice: under a name holding 'Embedding'
    (a Qwen3-Embedding stand-in: last-token pooling) and under a plain name (a plain LM: mean pooling)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    tokenizer = make_tokenizer()
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    root = tmp_path_factory.mktemp("embedders")
    dirs = {"last": str(root / "tiny-Qwen3-Embedding"), "mean": str(root / "tiny-lm")}
    for path in dirs.values():
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return dirs


def alone(path, text):
    """(T, H) the last layer's states of one text, unpadded, by the base model."""
    from transformers import AutoModel, AutoTokenizer
    model, tokenizer = AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        return model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]


def test_pooling_is_the_cards_and_a_padded_batch_pools_each_text_as_alone(tiny_embedders):
    texts = ["x = 7, so the answer is \\boxed{7}", "7", "Adding: 3 + 4 = 7"]  # ragged: the batch pads
    for pooling, path in tiny_embedders.items():
        ev.load_embedder.cache_clear()
        embed, used = ev.load_embedder(path)
        assert used == pooling  # 'Embedding' in the name: last token; a plain LM: the mean
        got = embed(texts)  # (3, H)
        for text, row in zip(texts, got):
            h = alone(path, text)  # (T, H)
            want = torch.nn.functional.normalize(h[-1], dim=-1) if pooling == "last" else h.mean(0)
            assert torch.allclose(row, want, atol=1e-5), (pooling, text)
        if pooling == "last":
            assert torch.allclose(got.norm(dim=-1), torch.ones(3))
        assert ev.pairwise_diversity(embed([texts[0]] * 3)) == pytest.approx(0.0, abs=1e-6)  # identical texts
    ev.load_embedder.cache_clear()
    assert ev.load_embedder(tiny_embedders["mean"], pooling="last")[1] == "last"  # the flag overrides the rule
    ev.load_embedder.cache_clear()


def test_pooling_rule():
    class Config:
        architectures = ["Qwen3ForCausalLM"]
    assert ev.prescribed_pooling("Qwen/Qwen3-Embedding-0.6B", Config) == "last"  # the paper's embedder, by name
    assert ev.prescribed_pooling("Qwen/Qwen3-0.6B", Config) == "mean"  # a plain LM
    Config.architectures = ["SomeEmbeddingModel"]
    assert ev.prescribed_pooling("models/mine", Config) == "last"  # by architecture


def test_a_sentence_transformers_pooling_file_decides(tmp_path):
    (tmp_path / "1_Pooling").mkdir()
    for modes, want in (({"pooling_mode_lasttoken": True}, "last"), ({"pooling_mode_mean_tokens": True}, "mean")):
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": False, **modes}))
        assert ev.prescribed_pooling(str(tmp_path), None) == want
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    with pytest.raises(ev.ConfigError, match="--diversity-pooling"):
        ev.prescribed_pooling(str(tmp_path), None)


# ---- K right samples per problem, seeded; problems with fewer left out ---------------------------------------
def row(pid, correct, responses=None, extracted=None, dataset="tiny"):
    n = len(correct)
    responses = responses or [f"response {pid}.{i}: the answer is \\boxed{{{i}}}" for i in range(n)]
    return {"dataset": dataset, "id": pid, "correct": correct, "responses": responses,
            "extracted": extracted or [str(i) for i in range(n)], "lengths": [5] * n, "truncated": [False] * n}


def test_the_draw_is_seeded_reproducible_and_takes_right_samples_only():
    r = row("p1", [i % 3 != 0 for i in range(12)])
    first = ev.draw_correct(r, 4, seed=0)
    assert first == ev.draw_correct(dict(r), 4, seed=0) and len(set(first)) == 4
    assert all(r["correct"][i] for i in first)
    draws = {tuple(ev.draw_correct(r, 4, seed=s)) for s in range(10)}
    assert len(draws) > 1  # the seed matters
    assert ev.draw_correct(r, 8, 0) == [i for i in range(12) if r["correct"][i]]  # exactly the 8 right ones
    assert ev.draw_correct(r, 9, 0) is None


def test_problems_with_fewer_than_k_right_are_left_out_and_counted():
    rows = [row("a", [True, True, True, False]), row("b", [True, False, False, False]),
            row("c", [False] * 4), row("d", [True] * 4)]
    d = ev.dataset_diversity(rows, "char-ngrams", 2, seed=0)
    assert (d["problems"], d["left_out"], set(d["per_problem"])) == (2, 2, {"a", "d"})
    assert (d["embedder"], d["pooling"], d["k"], d["seed"]) == ("char-ngrams", "char-ngrams", 2, 0)
    assert d["s_div"] == pytest.approx((d["per_problem"]["a"]["div"] + d["per_problem"]["d"]["div"]) / 2)
    assert 0 < d["s_div"] < 1 and d["distinct_answers"] == 2.0  # answers "0", "1", ...: each drawn pair differs
    lo, hi = d["s_div_ci95"]
    assert lo <= d["s_div"] <= hi
    none = ev.dataset_diversity(rows, "no/such-embedder", 5, seed=0)  # nobody has 5: the embedder never loads
    assert (none["problems"], none["left_out"], none["s_div"], none["pooling"]) == (0, 4, None, None)


def test_distinct_right_answers_count_canonical_forms():
    r = row("p", [True, True, True, True], extracted=["\\frac{1}{2}", "\\dfrac{1}{2}", " \\frac{1} {2}", "0.5"])
    per_problem, _ = ev.problem_diversity([r], "char-ngrams", 4)
    assert per_problem["p"]["distinct"] == 2  # \dfrac and spaces are one spelling; 0.5 another
    same = row("q", [True] * 3, responses=["the answer is 7"] * 3, extracted=["7"] * 3)
    assert ev.problem_diversity([same], "char-ngrams", 3)[0]["q"] == {"div": pytest.approx(0.0, abs=1e-12),
                                                                      "distinct": 1}


# ---- from a finished eval dir; a comparison of runs -----------------------------------------------------------
def write_run(path, rows, n=4):
    """An eval.py --out dir: samples.jsonl and metrics.json as evaluate writes them (no sampling)."""
    os.makedirs(path)
    with open(os.path.join(path, "samples.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    metrics = {"model": str(path), "n": n, "datasets": {"tiny": ev.dataset_metrics(rows, [1, 2])}}
    with open(os.path.join(path, "metrics.json"), "w") as f:
        json.dump(metrics, f)
    return str(path)


def test_a_finished_run_gains_diversity_without_sampling(tiny_model_dir, tiny_problems_file, tmp_path, monkeypatch,
                                                         capsys):
    out = tmp_path / "run"
    argv = ["--model", tiny_model_dir, "--datasets", tiny_problems_file, "--n", "3", "--k", "1", "--max-new-tokens",
            "4", "--temperature", "1.0", "--batch-size", "6", "--out", str(out)]
    ev.main(argv)
    rows = [json.loads(line) for line in open(out / "samples.jsonl")]
    for i, r in enumerate(rows):  # make the first five problems right 3, 2, 3, 2, 3 times
        r["correct"] = [j < 2 + (i % 2 == 0) for j in range(3)] if i < 5 else [False] * 3
    (out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def no_model(*args, **kwargs):
        raise AssertionError("a finished run loaded the model again")
    monkeypatch.setattr(ev.plumbing, "load_model", no_model)
    ev.main(argv + ["--diversity", "char-ngrams", "--diversity-k", "3"])
    d = json.loads((out / "metrics.json").read_text())["datasets"]["tiny"]["diversity"]
    assert (d["problems"], d["left_out"], sorted(d["per_problem"])) == (3, 5, ["t0", "t2", "t4"])
    want = ev.dataset_diversity(rows, "char-ngrams", 3, seed=0)
    assert d == json.loads(json.dumps(want))
    text = capsys.readouterr().out
    assert "S_div" in text and "character 3-gram counts" in text and "5 with fewer than 3 right left out" in text

    # an embedder that fails to load (after sampling, in a long run) costs the diversity, not pass@k
    (tmp_path / "empty").mkdir()
    (out / "metrics.json").unlink()
    with pytest.raises(SystemExit, match="eval.py: error: --diversity: cannot load the embedder"):
        ev.main(argv + ["--diversity", str(tmp_path / "empty"), "--diversity-k", "2"])
    assert "diversity" not in json.loads((out / "metrics.json").read_text())["datasets"]["tiny"]


def test_a_comparison_uses_only_the_problems_every_run_has_k_right(tmp_path, capsys):
    a = write_run(tmp_path / "a", [row("p1", [True] * 4), row("p2", [True, True, False, False]),
                                   row("p3", [True, False, False, False]), row("p4", [True, True, False, False])])
    b = write_run(tmp_path / "b", [row("p1", [True, True, True, False]), row("p2", [True] * 4),
                                   row("p3", [True] * 4), row("p4", [False] * 4)])
    got = ev.report([a, b], str(tmp_path / "r.png"), "char-ngrams", 2)
    assert got["tiny"]["problems"] == ["p1", "p2"] and got["tiny"]["left_out"] == 2  # p3: a has 1 right; p4: b 0
    for name in ("a", "b"):
        alone = ev.run_diversity(tmp_path / name, "char-ngrams", 2)["tiny"]
        assert alone["problems"] == 3  # alone, a would count p4 and b p3
        assert got["tiny"]["runs"][name]["s_div"] == pytest.approx(
            (alone["per_problem"]["p1"]["div"] + alone["per_problem"]["p2"]["div"]) / 2)
    alone_b = alone
    out = capsys.readouterr().out
    assert "tiny: 2 problems, 2 left out" in out and "| a |" in out and "tiny S_div" in out

    # the same from what metrics.json holds (no --diversity in the report): no embedding again
    for d in (a, b):
        m = json.load(open(os.path.join(d, "metrics.json")))
        m["datasets"]["tiny"]["diversity"] = ev.run_diversity(d, "char-ngrams", 2)["tiny"]
        json.dump(m, open(os.path.join(d, "metrics.json"), "w"))
    assert ev.report([a, b], str(tmp_path / "r.png")) == got
    entries = [ev.run_diversity(d, "char-ngrams", 3)["tiny"] for d in (a, b)]
    assert ev.common_problems(entries) == ["p1"]  # K = 3: a has 3 right in p1 only
    with pytest.raises(ev.ConfigError, match="other settings"):  # K 2 beside K 3: not comparable
        ev.compare_diversity([entries[0], alone_b])


# ---- flags ----------------------------------------------------------------------------------------------------
def test_protocol_v2_names_the_papers_embedder():
    assert ev.parse_args(["--protocol", "v2"]).diversity == "Qwen/Qwen3-Embedding-0.6B"
    assert ev.parse_args(["--protocol", "v2", "--diversity", "char-ngrams"]).diversity == "char-ngrams"
    assert ev.parse_args(["--protocol", "v2", "--diversity", "none"]).diversity == ""
    assert ev.parse_args([]).diversity == "" and ev.parse_args([]).diversity_k == 4


def test_bad_input_is_one_line(tiny_problems_file, tmp_path):
    run = write_run(tmp_path / "run", [row("p1", [True] * 4)])
    evaluate = ["--model", "unused", "--datasets", tiny_problems_file, "--out", str(tmp_path / "o")]
    report = ["--report", run, "--report-out", str(tmp_path / "r.png")]
    empty = tmp_path / "empty_embedder"
    empty.mkdir()
    cases = [(evaluate + ["--diversity", "char-ngrams", "--diversity-k", "1"], "--diversity-k 1: "),
             (report + ["--diversity", "char-ngrams", "--diversity-k", "1"], "--diversity-k 1: "),
             (evaluate + ["--diversity", str(tmp_path / "no_embedder")], "--diversity: model path not found"),
             (report + ["--diversity", str(tmp_path / "no_embedder")], "--diversity: model path not found"),
             (evaluate + ["--diversity", str(tmp_path / "no.gguf")], "--diversity: GGUF file not found"),
             (report + ["--diversity", str(empty), "--diversity-k", "2"], "--diversity: cannot load the embedder"),
             (["--report", str(tmp_path), "--diversity", "char-ngrams"], "no metrics.json")]
    for argv, msg in cases:
        with pytest.raises(SystemExit) as e:
            ev.main(argv)
        assert str(e.value.code).startswith("eval.py: error: ") and msg in str(e.value.code), e.value.code
        assert "\n" not in str(e.value.code)
