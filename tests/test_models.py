"""models/: the published configs of the paper's models (plan-only, no weights), docs/gpu.md's fit tables regenerated
from them, and the one-line refusal, before any weight loads, that names the smallest change that would fit."""
import json
import os
import sys

import pytest

import pacs
import plumbing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import fit_table  # noqa: E402

SHARED_QWEN = os.path.join(ROOT, "..", "shared", "models", "qwen2.5-0.5b-instruct")
PUBLISHED_SIZES = {"qwen2.5-0.5b-instruct": 0.49, "qwen2.5-1.5b-instruct": 1.54, "qwen2.5-3b-instruct": 3.09,
                   "qwen2.5-7b-instruct": 7.62, "qwen3-4b": 4.02, "qwen3-8b": 8.19}  # the model cards' counts, 1e9


@pytest.mark.parametrize("name", fit_table.MODELS)
def test_each_config_builds_its_model_at_the_published_size(name):
    config = plumbing.load_model_config(os.path.join(ROOT, "models", name))
    assert type(config).__name__ == ("Qwen3Config" if name.startswith("qwen3") else "Qwen2Config")
    assert round(plumbing.count_parameters(config) / 1e9, 2) == PUBLISHED_SIZES[name]
    with open(os.path.join(ROOT, "models", name, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == [151645, 151643]  # <|im_end|>, <|endoftext|>: both end a response


@pytest.mark.skipif(not os.path.isfile(os.path.join(SHARED_QWEN, "config.json")), reason="needs ../shared/models")
def test_the_default_models_config_is_the_shared_copy_of_the_hub_file():
    for name in ("config.json", "generation_config.json"):
        with open(os.path.join(ROOT, "models", "qwen2.5-0.5b-instruct", name)) as a, \
                open(os.path.join(SHARED_QWEN, name)) as b:
            assert json.load(a) == json.load(b)


def test_docs_gpu_md_holds_the_fit_tables_the_configs_give():
    with open(os.path.join(ROOT, "docs", "gpu.md"), encoding="utf-8") as f:
        text = f.read()
    shown = text[text.index(fit_table.BEGIN) + len(fit_table.BEGIN):text.index(fit_table.END)].strip()
    assert shown == fit_table.fit_tables(), "docs/gpu.md's fit tables are stale: benchmarks/fit_table.py --write"


def test_the_fit_tables_cells_are_what_the_plan_says():
    # one cell of each kind, from the plan itself: LoRA fits where full fine-tuning's state alone does not
    config = plumbing.load_model_config(os.path.join(ROOT, "models", "qwen3-8b"))
    n = plumbing.count_parameters(config)
    v2 = dict(max_prompt_tokens=1024, max_new_tokens=8192)
    assert fit_table.cell(pacs.Config(memory_gib=79.0, **v2), config, n) == "no"
    lora = fit_table.cell(pacs.Config(memory_gib=79.0, lora_rank=16, **v2), config, n)
    assert lora.endswith(" ckpt")
    with pytest.raises(plumbing.ConfigError):  # without checkpointing it does not fit
        plumbing.plan_memory(pacs.Config(memory_gib=79.0, lora_rank=16, **v2), config, n, "cuda", quiet=True)


def test_a_run_that_fits_nowhere_is_refused_before_any_weight_loads_naming_the_smallest_change(monkeypatch):
    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded before the plan refused the run")

    monkeypatch.setattr(plumbing, "load_model", no_weights)
    argv = ["--model", os.path.join(ROOT, "models", "qwen3-8b"), "--dataset", "synthetic", "--device", "cpu",
            "--memory-gib", "79", "--max-new-tokens", "1024"]
    with pytest.raises(SystemExit, match=r"the weights and AdamW states alone need .* the smallest change that fits: "
                                         r"--lora-rank 16 \(planned \d+\.\d GiB, \d+ rows? per micro-batch\)$"):
        pacs.main(argv)
    with pytest.raises(SystemExit, match=r"nothing tried fits \(--gradient-checkpointing, --lora-rank 16, "
                                         r"--max-new-tokens down to 256\)"):
        pacs.main(argv[:-3] + ["4", "--max-new-tokens", "1024"])


def test_the_smallest_change_is_the_first_that_fits():
    config = plumbing.load_model_config(os.path.join(ROOT, "models", "qwen2.5-0.5b-instruct"))
    n = plumbing.count_parameters(config)
    fix = plumbing.smallest_change(pacs.Config(memory_gib=22.5, micro_batch_size=64), config, n, "cuda")
    assert fix.startswith("; the smallest change that fits: --micro-batch-size 0 (planned")  # the plan's own sizes
    ppo = plumbing.smallest_change(pacs.Config(memory_gib=22.5, algo="ppo"), config, n, "cuda")
    assert "--gradient-checkpointing (planned" in ppo and "lora" not in ppo  # PPO has no LoRA to offer
    short = plumbing.smallest_change(pacs.Config(memory_gib=22.5, max_new_tokens=32768, gradient_checkpointing=True,
                                                 lora_rank=16), config, n, "cuda")
    assert "--max-new-tokens" in short


def test_a_plan_only_config_cannot_be_trained_and_says_so(tmp_path):
    with pytest.raises(SystemExit, match="holds a config and no weights .*pass the model's hub id"):
        pacs.main(["--model", os.path.join(ROOT, "models", "qwen2.5-0.5b-instruct"), "--dataset", "synthetic",
                   "--device", "cpu", "--steps", "1", "--prompts-per-step", "4", "--max-new-tokens", "8",
                   "--out-dir", str(tmp_path)])


def test_models_load_without_the_hubs_kernels(tiny_model_dir, monkeypatch):
    """transformers 5.25 kernelizes every from_pretrained by default (layers swapped for kernels fetched from the Hub;
    5.24: off): load_model asks for none, so a run is the one measured, with a network or without."""
    from transformers import PreTrainedModel
    asked = []
    set_use_kernels = PreTrainedModel.set_use_kernels

    def recorded(self, use_kernels, *args, **kwargs):
        asked.append(use_kernels)
        return set_use_kernels(self, use_kernels, *args, **kwargs)
    monkeypatch.setattr(PreTrainedModel, "set_use_kernels", recorded)
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    plumbing.load_model(tiny_model_dir, "cpu")
    assert asked == [False]
