"""Shared test fixtures: a tiny random causal LM and a character-level tokenizer, built locally (no network)."""
import ast
import functools
import os
import string
import sys
import types
import warnings

import pytest
from hypothesis import settings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
from lab import byte_level_chars  # noqa: E402  (GPT-2's byte -> character map, as the lab's tokenizer uses it)

# Property tests draw the same examples on every default run (derandomized: seeded by each test's own
# source; no example database), so red means a change broke something. The fuzz run searches hard with
# fresh randomness, tens of thousands of examples per property (tests/test_verify.py's fuzz tests):
#     HYPOTHESIS_PROFILE=fuzz python -m pytest -q tests/test_verify.py    (or --hypothesis-profile=fuzz)
settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("fuzz", derandomize=False, database=None, print_blob=True,
                          max_examples=int(os.environ.get("FUZZ_EXAMPLES", "50000")))  # per property
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# A patch reaches the callers it means to reach only where the name is defined: `from x import name` copies the
# binding, and a patch of the copy misses x's callers. So a test that patches a name of one of the project's top-level
# modules (pacs.py, plumbing.py, levers.py, eval.py, verify.py) that the module does not define (it imports it, or the
# name has moved) fails, naming where to patch instead. experiments/ patches a consumer's own binding on purpose.
PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def defined_names(path):
    """The names a module's source binds at its top level: its functions, classes and assignments."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            names |= {t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                      if isinstance(t, ast.Name)}
    return names


def top_level_module(module):
    """Whether module is one of the project's top-level .py files."""
    path = getattr(module, "__file__", None) or ""
    return isinstance(module, types.ModuleType) and os.path.isabs(path) and os.path.dirname(path) == PROJECT


def check_patched_name(module, name):
    if top_level_module(module) and name not in defined_names(module.__file__):
        owner = next((m.__name__ for m in list(sys.modules.values())
                      if top_level_module(m) and name in defined_names(m.__file__)), None)
        pytest.fail(f"monkeypatch of {module.__name__}.{name}: {module.__name__} does not define {name}"
                    + (f"; patch {owner}.{name}" if owner else ""), pytrace=False)


# Faking CUDA. The run reads whether CUDA is here through plumbing.visible_gpus alone. A test that fakes a GPU or its
# absence patches that, or a CUDA call the run makes (torch.cuda.X, torch.version.cuda, torch._C's allocator setting),
# and says so with @pytest.mark.fakes_cuda: .ci/run runs those once more on PyPI's torch, a CUDA build, on a machine
# without a GPU. torch.cuda.is_available and device_count are never patched: torch's own code reads them too (on a
# CUDA build, AdamW's step then asks torch.accelerator for a stream, which raises without a driver), so the fake would
# reach further than the test means. A test that patches CUDA without the marker fails, and so does a marked test that
# patches nothing of CUDA's.
TORCH_READS = ("is_available", "device_count")
cuda_faked = {"item": None, "faked": False}


def is_cuda_fake(module, name):
    """Whether patching module.name fakes CUDA's state; fails a patch of a name torch's own code reads."""
    import torch
    module_name = getattr(module, "__name__", "")
    if module_name == "torch.cuda" and name in TORCH_READS:
        pytest.fail(f"monkeypatch of torch.cuda.{name}: torch's own code reads it too; patch plumbing.visible_gpus",
                    pytrace=False)
    return (module_name == "torch.cuda" or module_name.startswith("torch.cuda.")
            or (module is torch.version and name == "cuda") or (module is torch._C and name.startswith("_accelerator"))
            or (top_level_module(module) and module_name == "plumbing" and name == "visible_gpus"))


def check_cuda_fake(module, name):
    if not is_cuda_fake(module, name):
        return
    item = cuda_faked["item"]
    if item is None or item.get_closest_marker("fakes_cuda") is None:
        pytest.fail(f"monkeypatch of {getattr(module, '__name__', module)}.{name} fakes CUDA: mark the test "
                    "@pytest.mark.fakes_cuda (.ci/run runs those on a CUDA build of torch too)", pytrace=False)
    cuda_faked["faked"] = True


@pytest.fixture(autouse=True)
def cuda_fakes_are_declared(request):
    """A test marked fakes_cuda patches something of CUDA's (check_cuda_fake sees each patch)."""
    cuda_faked.update(item=request.node, faked=False)
    yield
    faked = cuda_faked["faked"]
    cuda_faked.update(item=None, faked=False)
    if request.node.get_closest_marker("fakes_cuda") is not None and not faked:
        pytest.fail("marked fakes_cuda but patched nothing of CUDA's: drop the marker", pytrace=False)


def guarded_setattr(self, target, *args, **kwargs):
    if isinstance(target, str):  # the dotted form: setattr("module.name", value)
        module_name, name = target.rsplit(".", 1)
        module = sys.modules.get(module_name)
    else:
        module, name = target, args[0] if args else kwargs.get("name")
    check_patched_name(module, name)
    check_cuda_fake(module, name)
    return unguarded_setattr(self, target, *args, **kwargs)


unguarded_setattr, pytest.MonkeyPatch.setattr = pytest.MonkeyPatch.setattr, guarded_setattr

SPECIALS = ["<|pad|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|unk|>"]
def reward_stand_in(rewards_of):
    """A stand-in for pacs.reward_fn from rewards_of(texts, answers) -> (N,) rewards: called as train_step calls the
    real one, it hands back what the real one does (the tensor; with wait=False a levers.Verdicts)."""
    import levers

    def reward_fn(responses, answers, verifier_pool=None, check=None, wait=True):
        verdicts = levers.Verdicts(rewards_of(responses, answers))
        return verdicts.get() if wait else verdicts
    return reward_fn


CHAT_TEMPLATE = ("{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_tokenizer(chars=None):
    """A character-level byte-level-BPE tokenizer with a chat template: every printable ASCII char is one
    token. Byte-level (space -> 'Ġ') because transformers reloads a Qwen2 model's tokenizer as byte-level BPE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    byte_char = byte_level_chars()
    chars = string.printable if chars is None else chars
    chars = sorted({byte_char[ord(c)] for c in chars if c not in "\x0b\x0c\r"})
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|eos|>",
                                   unk_token="<|unk|>", additional_special_tokens=SPECIALS[2:4])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model_dir(path, seed=0, layers=2, hidden=64, chars=None):
    """save_pretrained dir of a random 2-layer Qwen2 with the tokenizer above; loadable by plumbing.load_model.
    chars: restrict the vocabulary (characters outside it are dropped by the tokenizer)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    tokenizer = make_tokenizer(chars)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=False,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def tiny_problems_file(tmp_path_factory):
    """A small local JSONL dataset with the default columns."""
    import json
    path = tmp_path_factory.mktemp("data") / "tiny.jsonl"
    rows = [{"id": f"t{i}", "problem": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="session")
def const7_file(tmp_path_factory):
    """A local JSONL dataset whose every answer is 7 ("i + (7 - i) ="): rewards a tiny model can learn in steps."""
    import json
    path = tmp_path_factory.mktemp("const7") / "const7.jsonl"
    rows = [{"id": str(i), "problem": f"{i} + {7 - i} =", "answer": "7"} for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="session")
def digit_model(tmp_path_factory):
    """A tiny model whose vocabulary is digits and a few symbols, so a 1-token answer is right ~1/18 of
    the time at random: groups have mixed rewards from the first step."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("digit_model"), chars="0123456789 +?=")


@pytest.fixture(scope="session")
def digit_rollout(digit_model):
    """A fixed rollout of 2 prompts x G=4 with mixed rewards and ragged response lengths: (roll, rewards)."""
    import torch
    import pacs
    import plumbing
    model, tok = plumbing.load_model(digit_model)
    torch.manual_seed(0)
    prompts = [plumbing.build_prompt(tok, "1 + 6 ="), plumbing.build_prompt(tok, "12 + 3 =")]
    roll = pacs.sample(model, tok, prompts, group_size=4, max_new_tokens=6)
    roll["response_mask"][1, 2:] = 0  # an early EOS
    roll["response_mask"][6, 4:] = 0
    return roll, torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 1])


# ---- a deprecated call in our own code fails the suite -----------------------------------------------------
# A FutureWarning or DeprecationWarning provoked by a call in the project's code (OWN_CODE) is raised as an error,
# so that the day a dependency deprecates something we call, the suite goes red with the warning's text. pytest's
# filterwarnings cannot say this: it matches the module a warning is attributed to (warn's stacklevel), and
# transformers attributes a deprecated forward() keyword to its own decorator (utils/output_capturing.py), one
# frame above its wrapper, not to our line. So warnings.warn is wrapped: from the attributed frame, frames that
# only pass a call through (torch's Module.__call__, no_grad's and transformers' decorators) are skipped, and the
# warning is ours when the next frame is our code. A warning third-party code raises on its own behalf (its
# attributed frame is its own code) stays a warning. tests/test_warnings.py checks both.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OWN_CODE = tuple(os.path.join(ROOT, p) for p in ("pacs.py", "plumbing.py", "levers.py", "verify.py", "eval.py",
                                                  "experiments" + os.sep,
                                                  "benchmarks" + os.sep, "examples" + os.sep))
PASS_THROUGH = tuple(os.sep + os.path.join(*p) for p in (
    ("torch", "nn", "modules", "module.py"), ("torch", "utils", "_contextlib.py"),
    ("transformers", "utils", "generic.py"), ("transformers", "utils", "output_capturing.py"),
    ("transformers", "utils", "deprecation.py")))


def provoked_by_our_code(frame):
    """Whether a warning attributed to `frame` comes from a call in OWN_CODE (pass-through frames skipped)."""
    while frame is not None and frame.f_code.co_filename.endswith(PASS_THROUGH):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(OWN_CODE)


def _warn_ours_as_error(message, category=None, stacklevel=1, source=None, **kwargs):
    category = type(message) if isinstance(message, Warning) else category or UserWarning
    if issubclass(category, (DeprecationWarning, FutureWarning)):
        try:
            attributed = sys._getframe(stacklevel)  # 0 is this wrapper, 1 the caller of warn
        except ValueError:  # a stacklevel past the outermost frame: warn attributes it to sys
            attributed = None
        if provoked_by_our_code(attributed):
            raise message if isinstance(message, Warning) else category(message)
    return _warn(message, category, stacklevel + 1, source, **kwargs)


_warn, warnings.warn = warnings.warn, _warn_ours_as_error
