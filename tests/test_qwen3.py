"""Qwen3 as paper v2 prompted it: the real Qwen3 tokenizer and hybrid chat template (../shared/models/qwen3, no
weights), on a tiny random Qwen3 built from models/qwen3-4b's config with the real 151,936-token vocabulary.

v2's App. C.1 prints its prompt: a system turn "You are a helpful assistant.", the problem with the instruction, and
the assistant turn opened with no empty <think></think> block, so thinking on (an inference: v2 never names the
mode). `--prompt v2` renders exactly that; `--no-thinking` is the other choice."""
import json
import os

import pytest
import torch

import eval as pacs_eval
import pacs
import plumbing
from test_lora import randomize_adapter
import conftest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN3 = os.path.join(ROOT, "..", "shared", "models", "qwen3")
QWEN25 = os.path.join(ROOT, "..", "shared", "models", "qwen2.5-0.5b-instruct")
pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(QWEN3, "tokenizer.json")),
                                reason=f"Qwen3 tokenizer not found at {os.path.normpath(QWEN3)} (../shared)")
# v2's App. C.1, its line breaks as the chat format has them (the PDF's text drops them; its "\\boxed{}" is the
# official code's \boxed{} written in a Python string)
C1 = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{input} Please reason step by "
      "step, and put your final answer within \\boxed{{}}.<|im_end|>\n<|im_start|>assistant\n")
PROBLEM = "What is the sum of the first 10 positive integers?"


@pytest.fixture(scope="module")
def qwen3_tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(QWEN3)


def test_the_v2_prompt_is_app_c1_token_for_token(qwen3_tokenizer):
    tok, expected = qwen3_tokenizer, C1.format(input=PROBLEM)
    prompt = plumbing.build_prompt(tok, PROBLEM, "v2")
    assert prompt == expected
    assert tok(prompt, add_special_tokens=False)["input_ids"] == tok(expected, add_special_tokens=False)["input_ids"]
    # the official code's prompt: no system turn (Qwen3's template adds none of its own)
    assert plumbing.build_prompt(tok, PROBLEM) == expected.split("<|im_end|>\n", 1)[1]
    # --no-thinking: the template closes an empty think block, which C.1 does not show
    assert plumbing.build_prompt(tok, PROBLEM, "v2", thinking=False) == expected + "<think>\n\n</think>\n\n"


@pytest.mark.skipif(not os.path.isfile(os.path.join(QWEN25, "tokenizer.json")), reason="needs ../shared's Qwen2.5")
def test_the_v2_prompt_replaces_qwen25s_default_system_turn():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(QWEN25)
    assert plumbing.build_prompt(tok, PROBLEM, "v2") == C1.format(input=PROBLEM)
    assert "You are Qwen, created by Alibaba Cloud." in plumbing.build_prompt(tok, PROBLEM)  # the template's own


def test_eval_protocol_v2_takes_v2s_prompt():
    assert pacs_eval.parse_args(["--protocol", "v2"]).prompt == "v2"
    assert pacs_eval.parse_args([]).prompt == "official"
    args = pacs_eval.parse_args(["--protocol", "v2", "--prompt", "official", "--no-thinking"])
    assert (args.prompt, args.thinking) == ("official", False)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory, qwen3_tokenizer):
    """save_pretrained dir of a 2-layer, hidden-64 Qwen3 with models/qwen3-4b's config otherwise (real vocab, tied
    embeddings, q/k norms), the real tokenizer and models/qwen3-4b's generation_config.json (temperature 0.6,
    top-k 20, top-p 0.95: defaults a rollout must not inherit)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    with open(os.path.join(ROOT, "models", "qwen3-4b", "config.json")) as f:
        shape = json.load(f)
    shape.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_window_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**shape), dtype=torch.float32)
    model.generation_config = GenerationConfig.from_pretrained(os.path.join(ROOT, "models", "qwen3-4b"))
    path = tmp_path_factory.mktemp("qwen3_tiny")
    model.save_pretrained(path)
    qwen3_tokenizer.save_pretrained(path)
    return str(path)


def test_qwen3_ends_a_response_at_either_eos(tiny_qwen3):
    model, tok = plumbing.load_model(tiny_qwen3)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert plumbing.eos_token_ids(model, tok) == [151643, 151645]  # <|endoftext|>, <|im_end|>


@pytest.mark.parametrize("lora", [False, True])
def test_a_pacs_step_on_qwen3_keeps_psi_exactly_zero_at_lr_0_under_bf16(tiny_qwen3, tmp_path, monkeypatch, lora):
    monkeypatch.setattr(pacs, "reward_fn", conftest.reward_stand_in(lambda texts, answers: torch.tensor(
        [float(i % 2) for i in range(len(texts))])))  # mixed groups: the loss has a gradient to apply at lr 0
    if lora:  # a random adapter: peft's B = 0 adds exactly nothing, and the test could not fail
        real_add = plumbing.add_adapter
        monkeypatch.setattr(plumbing, "add_adapter", lambda cfg, model, checkpoint=None: randomize_adapter(
            real_add(cfg, model, checkpoint)))
    prompts, real_sample = [], pacs.sample
    monkeypatch.setattr(pacs, "sample", lambda model, tok, batch, *a, **k: prompts.extend(batch) or real_sample(
        model, tok, batch, *a, **k))
    pacs.main(["--model", tiny_qwen3, "--dataset", "synthetic", "--out-dir", str(tmp_path), "--group-size", "4",
               "--prompts-per-step", "4", "--num-mini-batches", "2", "--max-new-tokens", "8", "--lr", "0",
               "--weight-decay", "0", "--steps", "1", "--eval-every", "0", "--autocast", "bf16", "--rollout-dtype",
               "bf16", "--prompt", "v2", "--micro-batch-size", "8", "--device", "cpu"]
              + (["--lora-rank", "4"] if lora else []))
    with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert prompts and all(p.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n") and
                           p.endswith("<|im_start|>assistant\n") for p in prompts)  # C.1's, thinking on
    assert rows[0]["mixed_groups"] > 0
    assert rows[0]["psi_std"] == 0.0 and rows[0]["sigma_psi"] == 0.5
    with open(os.path.join(tmp_path, "config.json")) as f:
        assert json.load(f)["prompt"] == "v2"
