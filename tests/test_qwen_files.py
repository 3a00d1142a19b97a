"""The default target's real files: Qwen2.5-0.5B-Instruct's tokenizer, chat template and generation_config
(../shared/models/qwen2.5-0.5b-instruct, no weights) on a tiny random Qwen2 with the real 151,936-token vocab.

Rollouts must come from exactly pi_old, the distribution response_logprobs computes: generate's own processed
scores (output_scores) are compared with the raw logits and with response_logprobs, token by token, while the
model's generation_config carries Qwen's sampling defaults (repetition penalty 1.1, top-k 20, top-p 0.8,
temperature 0.7) or every logits processor transformers has."""
import copy
import json
import math
import os

import pytest
import torch

import eval as pacs_eval
import pacs
import plumbing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN = os.path.join(ROOT, "..", "shared", "models", "qwen2.5-0.5b-instruct")
IM_START, IM_END, ENDOFTEXT = 151644, 151645, 151643  # <|im_start|>, <|im_end|> (eos), <|endoftext|> (pad, eos)
NEWLINE = 198  # "\n": the last token of every chat prompt ("<|im_start|>assistant\n")

pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(QWEN, "tokenizer.json")),
                                reason=f"Qwen2.5 tokenizer/config not found at {os.path.normpath(QWEN)} (../shared)")


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    """save_pretrained dir of a 1-layer, hidden-32 Qwen2 with Qwen2.5's config otherwise (real vocab, tied
    embeddings), its real tokenizer and its real generation_config.json. The embeddings are scaled up so that
    the model, like a real LM, often repeats the token before: a repetition penalty then changes the
    probability of the sampled tokens themselves, not only of tokens that are never drawn."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    with open(os.path.join(QWEN, "config.json")) as f:
        shape = json.load(f)
    shape.update(hidden_size=32, intermediate_size=64, num_hidden_layers=1, max_window_layers=1,
                 num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**shape), dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(25)  # tied: the LM head's rows too
    model.generation_config = GenerationConfig.from_pretrained(QWEN)
    path = tmp_path_factory.mktemp("qwen_tiny")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(QWEN).save_pretrained(path)
    return str(path)


def record_generate(model):
    """Wrap model.generate (on this instance) to also return generate's processed scores and raw logits.
    Returns the list that receives one (scores, logits) pair, each (N, T, V), per generate call."""
    calls, generate = [], model.generate

    def generate_and_record(*args, generation_config, **kwargs):
        cfg = copy.deepcopy(generation_config)  # what pacs passes, plus: return the scores
        cfg.output_scores = cfg.output_logits = cfg.return_dict_in_generate = True
        out = generate(*args, generation_config=cfg, **kwargs)
        calls.append((torch.stack(out.scores, 1), torch.stack(out.logits, 1)))
        return out.sequences

    model.generate = generate_and_record
    return calls


def sampled_logprobs(scores, response_ids):
    """log-probs (N, T) of the sampled tokens under generate's processed distribution."""
    return torch.log_softmax(scores, -1).gather(-1, response_ids[:, :scores.shape[1], None]).squeeze(-1)


def assert_on_policy(model, tok, roll, calls, temperature, group_size):
    """Generate touched the logits with the temperature and nothing else, and the sampled tokens' log-probs
    under what generate sampled from equal response_logprobs (pi_old of the PACS ratio), token by token."""
    scores, logits = calls[-1]
    torch.testing.assert_close(scores, logits / temperature, rtol=0, atol=1e-6)  # full vocab, every step
    mask = roll["response_mask"].bool()
    with torch.no_grad():
        lp, _ = pacs.response_logprobs(model, roll["prompt_ids"], roll["prompt_mask"], roll["response_ids"],
                                       roll["response_mask"], temperature, group_size=group_size)
    torch.testing.assert_close(sampled_logprobs(scores, roll["response_ids"])[mask], lp[mask], rtol=0, atol=1e-4)


def prompts_for(tok, *problems):
    return [plumbing.build_prompt(tok, p) for p in problems]


def test_rollouts_sample_exactly_pi_old_despite_qwens_generation_config(qwen_dir):
    model, tok = plumbing.load_model(qwen_dir)
    gc = model.generation_config  # the precondition: the shared file really carries defaults that would leak
    assert gc.repetition_penalty > 1 and gc.top_k == 20 and gc.top_p < 1 and gc.temperature != 1
    calls = record_generate(model)
    torch.manual_seed(0)
    roll = pacs.sample(model, tok, prompts_for(tok, "What is 1+1?", "Name a prime."), group_size=4,
                       max_new_tokens=10, temperature=0.9)
    ids, mask = roll["response_ids"], roll["response_mask"].bool()
    seen = torch.cat([roll["prompt_ids"], ids], 1)
    repeats = [(ids[i, t] == seen[i, :roll["prompt_ids"].shape[1] + t]).any() for i in range(len(ids))
               for t in range(ids.shape[1]) if mask[i, t]]
    assert sum(repeats) >= 4  # sampled tokens that a repetition penalty would have penalised
    assert_on_policy(model, tok, roll, calls, 0.9, group_size=4)
    assert model.generation_config is gc and gc.repetition_penalty > 1  # the model's own config is left as it was


def test_greedy_rollouts_apply_no_logits_processor(qwen_dir):
    model, tok = plumbing.load_model(qwen_dir)
    calls = record_generate(model)
    roll = pacs.sample(model, tok, prompts_for(tok, "What is 1+1?"), max_new_tokens=6, greedy=True)
    scores, logits = calls[-1]
    torch.testing.assert_close(scores, logits, rtol=0, atol=0)  # e.g. no repetition penalty on greedy eval
    assert torch.equal(roll["response_ids"], logits.argmax(-1))


@pytest.mark.parametrize("lora", [False, True])
def test_no_generation_config_field_of_the_model_reaches_the_sampler(qwen_dir, lora):
    """Every logits processor, warper and stopping field transformers reads, switched on in the model's
    generation_config: sample() must still draw from softmax(logits / T), with its own length and shape. With
    --lora-rank generate runs on the PeftModel, whose generate is its base model's."""
    from transformers import WatermarkingConfig
    model, tok = plumbing.load_model(qwen_dir)
    if lora:
        model = plumbing.add_adapter(pacs.Config(lora_rank=4), model)
    hostile = dict(repetition_penalty=1.3, encoder_repetition_penalty=1.3, top_k=5, top_p=0.5, min_p=0.2,
                   top_h=0.5, typical_p=0.5, epsilon_cutoff=0.01, eta_cutoff=0.01, temperature=0.3,
                   no_repeat_ngram_size=1, bad_words_ids=[[NEWLINE]], suppress_tokens=[NEWLINE, 13],
                   begin_suppress_tokens=[NEWLINE], sequence_bias={(NEWLINE,): -5.0}, forced_bos_token_id=11,
                   forced_eos_token_id=IM_END, min_length=60, min_new_tokens=5, max_new_tokens=2,
                   exponential_decay_length_penalty=(1, 1.5), renormalize_logits=True, guidance_scale=2.0,
                   watermarking_config=WatermarkingConfig(), num_return_sequences=2, num_beams=2,
                   length_penalty=3.0, max_time=1e-4, stop_strings=["\n"], return_dict_in_generate=True)
    for name, value in hostile.items():
        assert hasattr(model.generation_config, name), name  # a renamed field would make this test vacuous
        setattr(model.generation_config, name, value)
    calls = record_generate(model)
    torch.manual_seed(1)
    roll = pacs.sample(model, tok, prompts_for(tok, "What is 1+1?", "Name a prime."), group_size=2,
                       max_new_tokens=6, temperature=0.8)
    assert roll["response_ids"].shape == (4, 6) and roll["truncated"].all()  # this model emits no EOS here
    assert_on_policy(model, tok, roll, calls, 0.8, group_size=2)


def test_eval_samples_at_the_papers_temperature_and_top_p_and_nothing_else(qwen_dir, tiny_problems_file,
                                                                          tmp_path, monkeypatch):
    from transformers import TopPLogitsWarper
    args = pacs_eval.parse_args([])
    assert (args.temperature, args.top_p) == (0.6, 0.95)  # the paper's evaluation protocol
    calls, load_model = [], plumbing.load_model

    def load_and_record(*a, **k):
        model, tok = load_model(*a, **k)
        calls.append(record_generate(model))
        return model, tok

    monkeypatch.setattr(plumbing, "load_model", load_and_record)
    pacs_eval.main(["--model", qwen_dir, "--datasets", tiny_problems_file, "--limit", "2", "--n", "2",
                    "--max-new-tokens", "4", "--out", str(tmp_path / "eval")])
    assert os.path.isfile(tmp_path / "eval" / "metrics.json")
    (scores, logits), = calls[0]  # one generate call: 2 problems x 2 samples
    # temperature 0.6, then the top-p 0.95 nucleus, step by step: (N, T, V) -> (N*T, V) rows
    expected = TopPLogitsWarper(0.95)(None, (logits / 0.6).flatten(0, 1)).view_as(logits)
    torch.testing.assert_close(scores, expected, rtol=0, atol=1e-6)
    assert torch.isinf(expected).any()  # the nucleus did cut the vocabulary: top-p was really applied


# ---- the tokenizer, template and EOS ids ---------------------------------------------------------------
def script_next_tokens(model, table, boost=50.0):
    """Make the model follow `table`, {previous token: [next tokens]}, through its weights, so that it holds in
    generate and in response_logprobs (decoder + LM head) alike: the layer's outputs are silenced (o_proj and
    down_proj zero), so the last hidden state is the normalised embedding of the token read; the i-th key
    reads as the i-th coordinate direction, along which only its next tokens' LM-head rows point (+boost
    logits, 0 for every other token): one of them is sampled with probability ~1, uniformly among them.
    The LM head is untied from the embedding first. Gradients still reach every weight."""
    with torch.no_grad():
        emb = model.get_input_embeddings().weight  # (V, H)
        if model.get_output_embeddings().weight is emb:
            model.get_output_embeddings().weight = torch.nn.Parameter(emb.detach().clone())
            model.config.tie_word_embeddings = False
        head = model.get_output_embeddings().weight  # (V, H)
        for layer in model.get_decoder().layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        H = emb.shape[1]
        for i, (key, nexts) in enumerate(table.items()):
            emb[key] = 0.0
            emb[key, i] = 1.0  # RMSNorm makes it sqrt(H) along direction i
            head[:, i] = 0.0
            head[nexts, i] = boost / H ** 0.5


FOUR, SEVEN, NINE = 19, 22, 24  # "4", "7", "9"
# after the prompt's "\n": "4" then <|im_end|>, "7" then <|endoftext|>, or "9" forever (truncated)
SCRIPT = {NEWLINE: [FOUR, SEVEN, NINE], FOUR: [IM_END], SEVEN: [ENDOFTEXT], NINE: [NINE]}


def test_chat_template_adds_qwens_default_system_prompt(qwen_dir):
    _, tok = plumbing.load_model(qwen_dir)
    prompt = plumbing.build_prompt(tok, "What is 1+1?")
    assert prompt == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                      "<|im_end|>\n<|im_start|>user\nWhat is 1+1?" + plumbing.PROMPT_SUFFIX +
                      "<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(prompt, add_special_tokens=False)["input_ids"]  # as sample() tokenises: no BOS is added
    assert ids[0] == IM_START and ids.count(IM_START) == 3 and ids.count(IM_END) == 2  # special tokens, not text
    assert ids[-1] == NEWLINE and tok.decode(ids) == prompt


def test_both_eos_ids_end_a_response_and_the_first_stays_in_the_mask(qwen_dir):
    model, tok = plumbing.load_model(qwen_dir)
    assert plumbing.eos_token_ids(model, tok) == [ENDOFTEXT, IM_END]
    assert tok.pad_token_id == ENDOFTEXT and tok.padding_side == "left"  # pad is one of the EOS ids
    script_next_tokens(model, SCRIPT)
    torch.manual_seed(0)
    roll = pacs.sample(model, tok, prompts_for(tok, "What is 2+2?"), group_size=12, max_new_tokens=5)
    ids, mask, first = roll["response_ids"], roll["response_mask"], roll["response_ids"][:, 0]
    assert {FOUR, SEVEN, NINE} <= set(first.tolist())  # the precondition: every kind of row was drawn
    for row, m, trunc, text in zip(ids.tolist(), mask.tolist(), roll["truncated"].tolist(),
                                   tok.batch_decode(ids, skip_special_tokens=True)):
        if row[0] == NINE:  # no EOS: runs to the limit, every token counts
            assert trunc and m == [1] * 5 and row == [NINE] * 5 and text == "99999"
        else:  # either EOS ends the response; it stays in the mask, the pad (= <|endoftext|>) after it does not
            assert not trunc and m == [1, 1, 0, 0, 0] and row[1] == (IM_END if row[0] == FOUR else ENDOFTEXT)
            assert row[2:] == [ENDOFTEXT] * 3 and text == tok.decode([row[0]])


def test_pad_equal_to_an_eos_id_breaks_neither_logprobs_nor_a_training_step(qwen_dir):
    model, tok = plumbing.load_model(qwen_dir)
    script_next_tokens(model, SCRIPT)
    torch.manual_seed(0)
    roll = pacs.sample(model, tok, prompts_for(tok, "What is 2+2?"), group_size=12, max_new_tokens=5)
    lp, _ = pacs.response_logprobs(model, roll["prompt_ids"], roll["prompt_mask"], roll["response_ids"],
                                   roll["response_mask"], group_size=12)
    mask = roll["response_mask"].bool()
    assert torch.isfinite(lp).all()  # pad (= <|endoftext|>) after an EOS is scored like any token, then masked
    assert (lp[:, 1:][mask[:, 1:]] > -1e-3).all()  # after the first token the script is certain, EOS included
    # a whole train_step: "4" is right, "7" and "9" wrong, so every group has mixed rewards
    cfg = pacs.Config(group_size=6, prompts_per_step=2, num_mini_batches=2, micro_batch_size=6, max_new_tokens=5,
                      lr=1e-2, temperature=1.0)
    plumbing.check_config(cfg)
    before = [p.detach().clone() for p in model.parameters()]
    problems = [{"id": str(i), "problem": f"What is {i}+{4 - i}?", "answer": "4"} for i in range(4)]
    optimizer = pacs.make_optimizer(cfg, model)
    metrics, examples = pacs.train_step(cfg, model, tok, optimizer, problems, 0, torch.device("cpu"))
    assert metrics["skipped"] == 0 and metrics["mixed_groups"] > 0 and 0 < metrics["reward"] < 1
    assert all(map(math.isfinite, (metrics["loss"], metrics["grad_norm"], metrics["entropy"])))
    assert metrics["grad_norm"] > 0 and any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert {e["response"] for e in examples} <= {"4", "7", "99999"}  # decoded without pad or EOS text


def test_a_pacs_checkpoint_loads_in_eval_with_the_same_tokenizer_and_template(qwen_dir, tiny_problems_file,
                                                                              tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    pacs.main(["--model", qwen_dir, "--dataset", tiny_problems_file, "--out-dir", str(run_dir), "--steps", "1",
               "--group-size", "2", "--prompts-per-step", "2", "--num-mini-batches", "1", "--micro-batch-size", "2",
               "--max-new-tokens", "3", "--eval-every", "0", "--log-samples-every", "0"])
    ckpt = plumbing.latest_checkpoint(str(run_dir))
    assert ckpt is not None and ckpt.endswith("checkpoint-000000")
    model0, tok0 = plumbing.load_model(qwen_dir)
    seen, sample = [], pacs.sample

    def sample_and_record(model, tok, prompts, *a, **k):  # what eval.py samples with: tokenizer and prompts
        seen.append((model, tok, prompts))
        return sample(model, tok, prompts, *a, **k)

    monkeypatch.setattr(pacs, "sample", sample_and_record)
    pacs_eval.main(["--model", ckpt, "--datasets", tiny_problems_file, "--limit", "2", "--n", "2",
                    "--max-new-tokens", "3", "--out", str(tmp_path / "eval")])
    with open(tmp_path / "eval" / "metrics.json") as f:
        assert json.load(f)["datasets"]["tiny"]["problems"] == 2
    model, tok, prompts = seen[0]
    with open(tiny_problems_file) as f:
        problems = [json.loads(line)["problem"] for line in f][:2]
    assert prompts == prompts_for(tok0, *problems)  # the template (system prompt included) survived the save
    for text in prompts + ["<|im_end|><|endoftext|> x² = 4"]:
        assert tok(text, add_special_tokens=False)["input_ids"] == tok0(text, add_special_tokens=False)["input_ids"]
    assert (plumbing.eos_token_ids(model, tok), tok.pad_token_id, tok.padding_side) == \
           (plumbing.eos_token_ids(model0, tok0), ENDOFTEXT, "left")
