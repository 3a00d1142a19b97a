"""The speed levers (docs/gpu.md), each exact where it claims to be: --static-cache samples what the dynamic cache
samples, --verify-workers gives the in-process verdicts and leaves no process behind, --pack-groups lets the plan put
several groups in a micro-batch, --full-rows gives the shared prompt's log-probs and gradient (auto: where the plan
fits them on CUDA), every step logs the time of its eval and of the checkpoint before it, eval.py sizes
its batch from the memory plan on CUDA, and the prepared check's summary reads FAIL where a check failed."""
import copy
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import types

import pytest
import torch
import torch.nn.functional as F
from scipy import stats

import eval as ev
import levers
import pacs
import plumbing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
QWEN = os.path.join(ROOT, "..", "shared", "models", "qwen2.5-0.5b-instruct")
needs_qwen = pytest.mark.skipif(not os.path.isfile(os.path.join(QWEN, "config.json")),
                                reason="needs ../shared/models/qwen2.5-0.5b-instruct (Qwen2.5-0.5B's config)")


# ---- --static-cache ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("group_size,greedy", [(4, False), (1, True)])
def test_static_cache_samples_what_the_dynamic_cache_samples(digit_model, group_size, greedy):
    """Same seed, same tokens: the prompts' prefix cache copied into the static one (G > 1) or generate's own prefill
    into it (G = 1), with prompts of unequal length (left padding), and the masks after EOS."""
    model, tok = plumbing.load_model(digit_model)
    prompts = [plumbing.build_prompt(tok, "1 + 6 ="), plumbing.build_prompt(tok, "12 + 3 + 40 = ?")]
    rolls = []
    for cache_tokens in (0, 80):
        torch.manual_seed(0)
        rolls.append(pacs.sample(model, tok, prompts, group_size, 12, 1.5, greedy=greedy,
                                 speed=levers.Levers(cache_tokens=cache_tokens)))
    for key in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "truncated"):
        assert torch.equal(rolls[0][key], rolls[1][key]), key


def test_static_cache_samples_the_models_distribution(digit_model):
    """A chi-squared test of 4,000 first tokens sampled through the static cache (its prefix copied from the shared
    prefill) against the softmax of a plain forward over the prompt."""
    model, tok = plumbing.load_model(digit_model)
    prompt = plumbing.build_prompt(tok, "12 + 3 =")
    torch.manual_seed(1)
    roll = pacs.sample(model, tok, [prompt], 4000, 1, 1.0, batch_prompts=1, speed=levers.Levers(cache_tokens=40))
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        p = torch.softmax(model(input_ids=ids).logits[0, -1].double(), -1)
    assert chi_squared_pvalue(roll["response_ids"][:, 0], p) > 1e-3


def chi_squared_pvalue(tokens, p):
    """The chi-squared test's p-value of sampled tokens (n,) against the distribution p (V,)."""
    n, counts = len(tokens), torch.bincount(tokens, minlength=len(p)).double()
    keep = p * n >= 5  # chi-squared's rule: expected counts of 5 or more; the rest pooled into one cell
    observed = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)])
    expected = torch.cat([p[keep], p[~keep].sum(0, keepdim=True)]) * n
    if expected[-1] < 5:  # the pooled cell too small to test on its own: fold it into the largest
        observed, expected = observed[:-1].clone(), expected[:-1].clone()
        observed[expected.argmax()] += counts[~keep].sum()
        expected[expected.argmax()] += p[~keep].sum() * n
    return stats.chisquare(observed.numpy(), expected.numpy()).pvalue


def test_folded_attention_is_sdpa_over_every_head():
    """One query token: the folded heads give what SDPA gives over K/V repeated for every head, under a padding mask
    (fp32); more query tokens go to transformers' SDPA as they are."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    q, k, v = torch.randn(2, 6, 1, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)  # 6 heads on 2 K/V heads
    mask = torch.ones(2, 1, 1, 10, dtype=torch.bool)
    mask[0, ..., :4] = False  # row 0 left-padded
    out, _ = levers.folded_gqa_attention(module, q, k, v, mask, scaling=0.3)  # (B, 1, H, D)
    ref = F.scaled_dot_product_attention(q, repeat_kv(k, 3), repeat_kv(v, 3), attn_mask=mask, scale=0.3)
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-6, atol=1e-6)
    q4 = torch.randn(2, 6, 4, 8)
    mask4 = torch.ones(2, 1, 4, 10, dtype=torch.bool).tril(6)
    assert torch.equal(levers.folded_gqa_attention(module, q4, k, v, mask4, scaling=0.3)[0],
                       sdpa_attention_forward(module, q4, k, v, mask4, scaling=0.3)[0])


def flex_case():
    """q (B, 2, 7, 16), k, v (B, 2, S, 16), a mask (B, 1, 1, S) with left padding that empties a row's first block,
    caches filled to 1, 2 and 3 of their 3 blocks; and which blocks hold no key to attend (B, 3)."""
    torch.manual_seed(0)
    b, S = 3, 3 * levers.FLEX_BLOCK
    q, k, v = torch.randn(b, 2, 7, 16), torch.randn(b, 2, S, 16), torch.randn(b, 2, S, 16)
    positions = torch.arange(S)
    start, end = torch.tensor([0, 130, 5]), torch.tensor([100, S, 2 * levers.FLEX_BLOCK + 1])
    mask = ((positions >= start[:, None]) & (positions < end[:, None]))[:, None, None, :]  # (B, 1, 1, S)
    empty = ~mask.view(b, 3, levers.FLEX_BLOCK).any(-1)  # (B, 3)
    assert empty.tolist() == [[False, True, True], [True, False, False], [False, False, False]]
    return q, k, v, mask, empty


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")  # eager, on purpose
def test_flex_decode_attention_is_sdpa_under_the_mask():
    """--static-cache flex: the folded heads under flex_attention give SDPA's output under the same mask (fp32), also
    through folded_gqa_attention with the decode step's (B, H, 1, D) queries."""
    from transformers.integrations.sdpa_attention import repeat_kv
    q, k, v, mask, _ = flex_case()
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    torch.testing.assert_close(levers.flex_decode_attention(q, k, v, mask, 0.3), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="whole blocks of 128 positions"):  # folded_gqa_attention takes SDPA then
        levers.flex_decode_attention(q, k[:, :, :200], v[:, :, :200], mask[..., :200])
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 7, True
    query = q.reshape(3, 14, 1, 16)
    sdpa = F.scaled_dot_product_attention(query, repeat_kv(k, 7), repeat_kv(v, 7), attn_mask=mask, scale=0.3)
    out, _ = levers.folded_gqa_attention(module, query, k, v, mask, scaling=0.3, flex=True)
    torch.testing.assert_close(out, sdpa.transpose(1, 2), rtol=1e-5, atol=1e-5)


@pytest.fixture
def cpu_inductor(monkeypatch, tmp_path):
    """inductor on this CPU: kernels of the test's own (the shared cache may hold kernels built under another
    ATEN_CPU_CAPABILITY: a crash), scalar code without a vector ISA, as under ATEN_CPU_CAPABILITY=default (its
    vector code does not build there, torch 2.13)."""
    import torch._inductor.config as inductor_config
    from torch._inductor import cpu_vec_isa
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    with inductor_config.patch({} if cpu_vec_isa.pick_vec_isa() else {"cpp.simdlen": 1}):  # levers.scalar_cpu_compile
        yield


def compiled_flex_skip():
    """Why inductor cannot compile flex_attention on this CPU (it needs a vector ISA: none under
    ATEN_CPU_CAPABILITY=default), or None. CUDA's compiled decode step has its own flex kernels."""
    from torch._inductor import cpu_vec_isa
    if not cpu_vec_isa.pick_vec_isa():
        return "inductor compiles flex_attention on the CPU only with a vector ISA (none under this capability)"
    return None


@pytest.mark.skipif(not shutil.which("g++"), reason="torch.compile on the CPU needs a C++ compiler")
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch's own
def test_compiled_flex_decode_attention_never_reads_an_empty_block(cpu_inductor):
    """Compiled, as the decode step runs it: SDPA's output, and a block with no key to attend is never read (NaN
    there leaves the output finite, where SDPA's masked read of it gives NaN)."""
    if compiled_flex_skip():
        pytest.skip(compiled_flex_skip())
    q, k, v, mask, empty = flex_case()
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    poisoned = [t.clone() for t in (k, v)]
    for t in poisoned:  # (B, 2, 3 blocks, FLEX_BLOCK, 16)
        blocks = (3, 2, 3, levers.FLEX_BLOCK, 16)
        t.view(blocks)[empty[:, None, :, None, None].expand(blocks)] = float("nan")
    torch.testing.assert_close(torch.compile(levers.flex_decode_attention)(q, *poisoned, mask, 0.3), ref,
                               rtol=1e-5, atol=1e-5)
    assert F.scaled_dot_product_attention(q, *poisoned, attn_mask=mask, scale=0.3).isnan().any()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")
def test_flex_static_cache_samples_what_the_dynamic_cache_samples(digit_model, monkeypatch):
    """--static-cache flex: the same tokens as the dynamic cache for a seed, its cache rounded up to whole blocks
    (80 positions asked: one block of 128), and setup_model picks the kernel from the flag."""
    model, tok = plumbing.load_model(digit_model)
    prompts = [plumbing.build_prompt(tok, "1 + 6 ="), plumbing.build_prompt(tok, "12 + 3 + 40 = ?")]
    torch.manual_seed(0)
    dynamic = pacs.sample(model, tok, prompts, 4, 12, 1.5)
    lengths, flex, static_cache = [], levers.flex_decode_attention, levers.static_cache
    monkeypatch.setattr(levers, "flex_decode_attention", lambda q, k, *a: lengths.append(k.shape[2]) or flex(q, k, *a))
    monkeypatch.setattr(levers, "static_cache", lambda *a: static_cache(*a))
    torch.manual_seed(0)
    blocks = pacs.sample(model, tok, prompts, 4, 12, 1.5, speed=levers.Levers(cache_tokens=80, flex=True))
    for key in dynamic:
        assert torch.equal(dynamic[key], blocks[key]), key
    assert lengths and set(lengths) == {levers.FLEX_BLOCK}
    speed = levers.on_device(pacs.parse_args(["--static-cache", "flex", "--device", "cpu"]), "cpu")
    assert speed.cache_tokens == 1536 and speed.flex
    speed = levers.on_device(pacs.parse_args(["--device", "cpu"]), "cuda")
    assert speed.cache_tokens == 1536 and not speed.flex


def test_static_cache_decodes_with_folded_heads(digit_model, monkeypatch):
    """--static-cache's generate runs folded_gqa_attention: every decode step's attention on the K/V heads (2 here,
    2 query heads each), none on K/V copied for each of the 4 query heads. The model is back on SDPA afterwards,
    also after an error, and the dynamic cache's generate runs SDPA."""
    model, tok = plumbing.load_model(digit_model)
    prompts = [plumbing.build_prompt(tok, "1 + 6 ="), plumbing.build_prompt(tok, "12 + 3 + 40 = ?")]
    shapes, names, sdpa, generate = [], [], F.scaled_dot_product_attention, model.generate
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, k, *a, **kw: shapes.append(
        (tuple(q.shape), k.shape[1])) or sdpa(q, k, *a, **kw))
    monkeypatch.setattr(model, "generate", lambda *a, **k: names.append(model.config._attn_implementation)
                        or generate(*a, **k))
    pacs.sample(model, tok, prompts, 4, 6, speed=levers.Levers(cache_tokens=80))
    pacs.sample(model, tok, prompts, 4, 6)
    assert names == [levers.FOLDED_GQA, "sdpa"] and model.config._attn_implementation == "sdpa"
    decode = [s for s in shapes if s[0][0] == 8]  # 2 prompts x 4 rows: the prefill ran on one row a prompt
    assert decode and all(q == (8, 2, 2, 16) and kv_heads == 2 for q, kv_heads in decode), set(shapes)
    monkeypatch.setattr(model, "generate", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        pacs.sample(model, tok, prompts, 4, 6, speed=levers.Levers(cache_tokens=80))
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.skipif(not shutil.which("g++"), reason="torch.compile on the CPU needs a C++ compiler")
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch's own
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_compiled_static_cache_samples_what_the_dynamic_cache_samples(digit_model, monkeypatch, attention,
                                                                       cpu_inductor):
    """The CUDA road's decode step, compiled, on the CPU (transformers compiles it on CUDA only, unless told to):
    the folded heads, under SDPA or flex_attention (--static-cache flex), give the dynamic cache's tokens for the
    same seed, and flex at a second batch shape too."""
    from transformers import CompileConfig
    if attention == "flex" and compiled_flex_skip():
        pytest.skip(compiled_flex_skip())
    speed = levers.Levers(cache_tokens=80, flex=attention == "flex")
    torch._dynamo.reset()  # a decode step compiled earlier in this process at another cache length would make that
    # length dynamic here, which inductor's flex_attention on the CPU does not take (a run keeps one length)
    model, tok = plumbing.load_model(digit_model)
    prompts = [plumbing.build_prompt(tok, "1 + 6 ="), plumbing.build_prompt(tok, "12 + 3 + 40 = ?")]
    torch.manual_seed(0)
    dynamic = pacs.sample(model, tok, prompts, 4, 12, 1.5)
    compile_config = CompileConfig(mode="default")  # no CUDA graphs on the CPU
    compile_config._compile_all_devices = True
    config = pacs.rollout_generation_config

    def compiled(*args, **kwargs):
        generation_config = config(*args, **kwargs)
        generation_config.compile_config = compile_config
        return generation_config
    monkeypatch.setattr(pacs, "rollout_generation_config", compiled)
    traced, flex = [], levers.flex_decode_attention
    monkeypatch.setattr(levers, "flex_decode_attention", lambda *a: traced.append(a[1].shape) or flex(*a))
    torch.manual_seed(0)
    compiled = pacs.sample(model, tok, prompts, 4, 12, 1.5, speed=speed)
    for key in dynamic:
        assert torch.equal(dynamic[key], compiled[key]), key
    assert bool(traced) == (attention == "flex")  # traced into the compiled decode step (flex), or never called
    if attention == "sdpa":
        return
    # a second batch shape (an eval's, an OOM's halving) compiles the step again, statically: compiled for a dynamic
    # batch, flex does not build on the CPU. Without the spy, whose list dynamo guards (every call recompiled, until
    # its limit sends the step to eager)
    monkeypatch.setattr(levers, "flex_decode_attention", flex)
    torch._dynamo.reset()
    pacs.sample(model, tok, prompts, 4, 12, 1.5, speed=speed)
    torch.manual_seed(1)
    compiled = pacs.sample(model, tok, prompts[:1], 4, 12, 1.5, speed=speed)
    monkeypatch.setattr(pacs, "rollout_generation_config", config)
    torch.manual_seed(1)
    dynamic = pacs.sample(model, tok, prompts[:1], 4, 12, 1.5)
    for key in dynamic:
        assert torch.equal(dynamic[key], compiled[key]), key


# ---- --sampler gumbel -------------------------------------------------------------------------------------------
@pytest.mark.skipif(not shutil.which("g++"), reason="torch.compile on the CPU needs a C++ compiler")
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch's own
@pytest.mark.parametrize("temperature,top_p", [(0.5, 1.0), (1.5, 0.8)])
def test_gumbel_sampler_samples_what_transformers_samples(digit_model, monkeypatch, temperature, top_p, cpu_inductor):
    """--sampler gumbel: a chi-squared test of 4,000 first tokens against the law transformers' sampling draws from
    (the softmax of the logits over the temperature, cut by its top-p warper), no token outside the nucleus, the same
    tokens again for the same seed (a resumed run's), and greedy decoding (the held-out eval's) as it was."""
    from transformers import TopPLogitsWarper
    model, tok = plumbing.load_model(digit_model)
    with torch.no_grad():  # the tiny model's next token is near uniform: a peaked law, so that a wrong one is seen
        model.get_output_embeddings().weight.mul_(20)
    prompt = plumbing.build_prompt(tok, "12 + 3 =")
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        scores = model(input_ids=ids).logits[:, -1] / temperature  # (1, V)
    p = torch.softmax(TopPLogitsWarper(top_p)(ids, scores)[0].double(), -1)  # (V,): transformers' law
    greedy = pacs.sample(model, tok, [prompt, "1 + 6 ="], 1, 8, greedy=True)
    gumbel = levers.Levers(sampler="gumbel")
    draws = []
    for _ in range(2):
        torch.manual_seed(1)
        draws.append(pacs.sample(model, tok, [prompt], 4000, 1, temperature, top_p, batch_prompts=1, speed=gumbel))
    first = draws[0]["response_ids"][:, 0]  # (4000,)
    assert (p[first] > 0).all() and (p > 0).sum() <= len(p) - 4 * (top_p < 1.0)  # the nucleus, a cut that bites
    assert chi_squared_pvalue(first, p) > 1e-3
    assert torch.equal(draws[0]["response_ids"], draws[1]["response_ids"])
    again = pacs.sample(model, tok, [prompt, "1 + 6 ="], 1, 8, greedy=True, speed=gumbel)
    for key in greedy:
        assert torch.equal(greedy[key], again[key]), key
    config = pacs.rollout_generation_config(4, top_p=top_p)
    config.top_k = 5  # a warper that greedy decoding would drop: refused
    with pytest.raises(ValueError, match=r"temperature and top-p only.*top_k=5"):
        levers.gumbel_max_generation(config, {"input_ids": ids})
    assert levers.on_device(pacs.parse_args(["--sampler", "gumbel"]), "cpu").sampler == "gumbel"
    assert levers.on_device(pacs.parse_args([]), "cuda").sampler == "multinomial"


# ---- --defer-stop-check -----------------------------------------------------------------------------------------
class HostEvent:
    """torch.Event where the CPU has none (transformers' DeferredStopCheck records one per step): on the CPU the
    copies it would wait for are done when they return."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self):
        pass

    def synchronize(self):
        pass


@pytest.mark.parametrize("cache_tokens", [0, 80])
def test_deferred_stop_check_gives_the_tokens_of_the_check_each_step(digit_model, monkeypatch, cache_tokens):
    """--defer-stop-check: generate's stop read a step late (transformers' DeferredStopCheck, run on the CPU with a
    stand-in for CUDA's events) gives the tokens of the check at each step for a seed, where every row stops before
    the limit (the step run too many is undone), on the dynamic and the static cache; transformers' own rule is back
    after the call, after an error too; setup_model turns it on with CUDA only."""
    from transformers.generation import utils as generation_utils
    check = generation_utils.DeferredStopCheck
    rule, finish = check.__dict__["is_supported"], check.finish
    model, tok = plumbing.load_model(digit_model)
    prompts = [plumbing.build_prompt(tok, "1 + 6 =")]
    torch.manual_seed(3)
    plain = pacs.sample(model, tok, prompts, 2, 40, speed=levers.Levers(cache_tokens=cache_tokens))
    assert not plain["truncated"].any()  # every row stops before the limit: the deferred check runs a step too many
    undone = []
    monkeypatch.setattr(torch, "Event", HostEvent)
    monkeypatch.setattr(check, "finish", lambda self: undone.append(finish(self)) or undone[-1])
    torch.manual_seed(3)
    deferred = pacs.sample(model, tok, prompts, 2, 40, speed=levers.Levers(cache_tokens=cache_tokens, defer_stop=True))
    assert undone == [1]  # deferred, and the extra step undone
    for key in plain:
        assert torch.equal(plain[key], deferred[key]), key
    assert check.__dict__["is_supported"] is rule
    monkeypatch.setattr(model, "generate", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        pacs.generate_exactly(model, pacs.rollout_generation_config(4), levers.Levers(defer_stop=True),
                              input_ids=deferred["prompt_ids"])
    assert check.__dict__["is_supported"] is rule
    assert not levers.on_device(pacs.parse_args(["--defer-stop-check"]), "cpu").defer_stop  # nothing to wait for
    assert levers.on_device(pacs.parse_args(["--defer-stop-check"]), "cuda").defer_stop


def test_static_cache_length_is_one_shape_for_the_run():
    cache_tokens = lambda device_type, **k: levers.on_device(pacs.Config(**k), device_type).cache_tokens  # noqa: E731
    assert cache_tokens("cuda", max_prompt_tokens=512, max_new_tokens=1024) == 1536  # auto: on CUDA
    assert cache_tokens("cpu") == 0  # auto: the dynamic cache on the CPU, as before
    assert cache_tokens("cpu", max_new_tokens=8, static_cache="on") == 520
    assert cache_tokens("cuda", static_cache="off") == 0
    assert pacs.parse_args(["--static-cache"]).static_cache == "on"  # the flag alone, as before it had values


def test_static_cache_is_priced_by_the_plan():
    from transformers import Qwen2Config
    c = Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
    plan = lambda device="cuda", **k: plumbing.memory_plan(pacs.Config(**k), c, 100_000, device, 8, 4)  # noqa: E731
    extra = plan()["generate: static cache extras"]  # auto: on CUDA
    assert plan(static_cache="off")["generate: static cache extras"] == 0 and extra > 0
    assert plan()["peak: generate"] == plan(static_cache="off")["peak: generate"] + extra
    cpu_extra = plan("cpu", static_cache="on")["generate: static cache extras"]
    assert plan("cpu")["generate: static cache extras"] == 0 < cpu_extra  # auto: off on the CPU


# ---- --compile-head ----------------------------------------------------------------------------------------------
def graphs():
    """How many graphs dynamo has compiled in this process."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


@pytest.mark.skipif(not shutil.which("g++"), reason="torch.compile on the CPU needs a C++ compiler")
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch's own
def test_compiled_head_gives_the_eager_log_probs_and_psi_exactly_zero_at_lr_0(digit_model, digit_rollout, const7_file,
                                                                             tmp_path, monkeypatch, cpu_inductor):
    """--compile-head: the log-probs, entropy and gradient of the eager LM head and log-softmax (fp32, chunks of 4
    tokens: a short last chunk), and a run at --lr 0 under bf16 autocast keeps psi exactly 0: phase 3's no-grad
    graph and phase 4's grad graph of the compiled head agree bit for bit."""
    roll, _ = digit_rollout
    model, _ = plumbing.load_model(digit_model)
    out = []
    for compiled in (None, torch.compile(pacs.token_logprobs)):
        lp, ent = pacs.response_logprobs(model, roll["prompt_ids"], roll["prompt_mask"], roll["response_ids"],
                                         roll["response_mask"], 1.5, with_entropy=True, group_size=4, chunk=4,
                                         compiled_head=compiled)
        lp.sum().backward()
        out.append((lp.detach(), ent, [p.grad.clone() for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
    (lp, ent, grads), (lp_c, ent_c, grads_c) = out
    torch.testing.assert_close(lp_c, lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_c, ent, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads_c, grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    before = graphs()
    pacs.main(["--model", digit_model, "--dataset", const7_file, "--out-dir", str(tmp_path / "run"), "--group-size",
               "8", "--prompts-per-step", "8", "--num-mini-batches", "2", "--micro-batch-size", "16", "--steps", "2",
               "--lr", "0", "--autocast", "bf16", "--rollout-dtype", "bf16", "--max-new-tokens", "4",
               "--temperature", "1.5", "--eval-every", "0", "--log-samples-every", "0", "--compile-head"])
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert any(r["mixed_groups"] > 0 for r in rows)  # a gradient was computed (and applied with lr 0)
    assert all(r["psi_mean"] == 0.0 and r["psi_std"] == 0.0 for r in rows)
    assert levers.compiled.cache_info().currsize and graphs() > before  # it compiled


# ---- --compile-layers --------------------------------------------------------------------------------------------
def counted_compile(monkeypatch):
    """torch.compile, counting the calls of what it returns by the compiled function's name: {name: calls}."""
    calls, compile_ = {}, torch.compile

    def counting(fn, **kwargs):
        compiled = compile_(fn, **kwargs)

        def call(*args, **kw):
            calls[fn.__name__] = calls.get(fn.__name__, 0) + 1
            return compiled(*args, **kw)
        return call
    monkeypatch.setattr(torch, "compile", counting)
    return calls


@pytest.mark.skipif(not shutil.which("g++"), reason="torch.compile on the CPU needs a C++ compiler")
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch's own
def test_compiled_layers_give_the_eager_log_probs_and_psi_exactly_zero_at_lr_0(digit_model, digit_rollout, const7_file,
                                                                               tmp_path, monkeypatch, cpu_inductor):
    """--compile-layers: full rows' log-probs and gradient (plain and checkpointed) as the eager layers give them
    (fp32, left-padded rows); phase 3 (eval, no grad) runs phase 4's graph (train, grad: no graph of its own) and
    gives its log-probs bit for bit; a deep copy (pi_ref) calls its own layers; generate and the shared prompt's cached
    forwards stay eager. Runs at --lr 0 under bf16 autocast keep psi exactly 0 on full rows, and on the checkpointing
    route against a frozen pi_ref (--ref-reset-every 2) with the compiled head."""
    calls = counted_compile(monkeypatch)
    roll, _ = digit_rollout
    full = {"group_size": 4, "shared_prompt": False, "mask_right_padding": False}
    args = (roll["prompt_ids"], roll["prompt_mask"], roll["response_ids"], roll["response_mask"], 1.5)
    out = {}
    for compiled, ckpt in ((False, False), (True, False), (True, True)):
        model, tok = plumbing.load_model(digit_model)
        if ckpt:
            model.activation_checkpointing_enable()
        if compiled:
            levers.compile_layers(model, torch.device("cpu"))
        model.train()  # phase 4
        lp, _ = pacs.response_logprobs(model, *args, **full)
        lp.sum().backward()
        model.eval()
        before = graphs()
        with torch.no_grad():  # phase 3
            lp_old, _ = pacs.response_logprobs(model, *args, **full)
        assert graphs() == before, (compiled, ckpt)  # phase 4's graph
        out[compiled, ckpt] = (lp.detach(), lp_old, [p.grad.clone() for p in model.parameters()])
    assert calls == {"forward": 2 * (2 + 3)}  # 2 layers: phases 4 and 3, and 4's recomputation when checkpointed
    lp, lp_old, grads = out[False, False]
    assert torch.equal(lp_old, lp)
    for key in ((True, False), (True, True)):
        lp_c, lp_old_c, grads_c = out[key]
        assert torch.equal(lp_old_c, lp_c), key
        torch.testing.assert_close(lp_c, lp, rtol=1e-5, atol=1e-5)
        for a, b in zip(grads_c, grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    ref = copy.deepcopy(model)
    assert all(layer.forward.args[0] is layer and layer.forward.args[1].__self__ is layer
               for layer in ref.base_model.layers)
    with torch.no_grad():  # a KV cache: eager
        pacs.response_logprobs(model, *args, group_size=4)
        pacs.sample(model, tok, [plumbing.build_prompt(tok, "1 + 6 =")], group_size=2, max_new_tokens=3)
    assert calls == {"forward": 10}
    run = ["--model", digit_model, "--dataset", const7_file, "--group-size", "8", "--prompts-per-step", "8",
           "--num-mini-batches", "2", "--micro-batch-size", "16", "--steps", "2", "--lr", "0", "--autocast", "bf16",
           "--rollout-dtype", "bf16", "--max-new-tokens", "4", "--temperature", "1.5", "--eval-every", "0",
           "--log-samples-every", "0", "--compile-layers"]
    for name, route in (("full", ["--full-rows", "on"]),
                        ("ckpt", ["--gradient-checkpointing", "--ref-reset-every", "2", "--compile-head"])):
        before = calls["forward"]
        pacs.main(run + route + ["--out-dir", str(tmp_path / name)])
        with open(tmp_path / name / "metrics.jsonl") as f:
            rows = [json.loads(line) for line in f]
        assert any(r["mixed_groups"] > 0 for r in rows)  # a gradient was computed (and applied with lr 0)
        assert all(r["psi_mean"] == 0.0 and r["psi_std"] == 0.0 for r in rows), name
        assert calls["forward"] > before  # the layers ran compiled


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch's own
def test_compile_layers_says_when_the_run_leaves_them_eager(tiny_model_dir, capsys):
    """The shared prompt's forwards run on its KV cache, where the layers stay eager: a run on that route says so."""
    for route, said in (([], True), (["--full-rows", "on"], False), (["--gradient-checkpointing"], False)):
        cfg = pacs.parse_args(["--model", tiny_model_dir, "--device", "cpu", "--compile-layers", *route])
        model, *_ = plumbing.setup_model(cfg, tiny_model_dir, torch.device("cpu"))
        assert model.base_model.compiled_layers
        assert ("--compile-layers acts on full rows' forwards" in capsys.readouterr().err) == said, route


def test_compile_layers_needs_a_list_of_layers(tiny_model_dir, monkeypatch, capsys):
    """A plain ValueError from the lever, the run's one-line error from setup_model."""
    model, _ = plumbing.load_model(tiny_model_dir)
    del model.base_model.layers
    with pytest.raises(ValueError, match="--compile-layers needs a decoder with a list of layers; Qwen2Model"):
        levers.compile_layers(model, torch.device("cpu"))
    monkeypatch.setattr(plumbing, "load_model", lambda *a: (model, None))
    with pytest.raises(plumbing.ConfigError, match="--compile-layers needs a decoder with a list of layers"):
        plumbing.setup_model(pacs.parse_args(["--compile-layers", "--device", "cpu"]), tiny_model_dir,
                             torch.device("cpu"))


# ---- --verify-workers --------------------------------------------------------------------------------------------
def verify_cases(n):
    with open(os.path.join(ROOT, "tests", "verify_cases.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r["response"] for r in rows[:n]], [r["answer"] for r in rows[:n]]


def test_verifier_workers_give_the_in_process_verdicts():
    responses, answers = verify_cases(160)
    serial = pacs.reward_fn(responses, answers)
    with levers.VerifierPool(2) as pool:
        assert pool.workers == 2 and pool.takes(len(responses)) and not pool.takes(pool.min_answers - 1)
        assert torch.equal(pacs.reward_fn(responses, answers, pool), serial)
        verdicts = pacs.reward_fn(responses, answers, pool, wait=False)  # a handle, the processes at work
        assert isinstance(verdicts, levers.Verdicts) and torch.equal(verdicts.get(), serial)
    assert pool.pool is None and levers.VerifierPool(1).pool is None


def test_the_reward_handle_comes_back_before_the_processes_verify(tmp_path):
    """reward_fn(..., wait=False) over the verifier's processes returns at once: here each verdict waits (up to 20 s)
    for a file the caller writes only after the call has returned, so a call that waited for its verdicts would
    find no file in them. The checker is a --reward file, loaded before the fork: the processes call it by name."""
    go = tmp_path / "go"
    (tmp_path / "late.py").write_text(textwrap.dedent(f"""
        import os, time

        def check(response, answer):
            for _ in range(2000):
                if os.path.exists({str(go)!r}):
                    return True
                time.sleep(0.01)
            return False
    """))
    (tmp_path / "broken.py").write_text("def check(response, answer):\n    raise RuntimeError('a checker failed')\n")
    check, broken = (plumbing.load_reward(f"{tmp_path / name}:check") for name in ("late.py", "broken.py"))
    with levers.VerifierPool(2) as pool:
        verdicts = pacs.reward_fn(["1"] * 64, ["1"] * 64, pool, check, wait=False)
        go.write_text("")
        assert verdicts.get().tolist() == [1.0] * 64  # every verdict saw the file
        verdicts = pacs.reward_fn(["1"] * 64, ["1"] * 64, pool, broken, wait=False)
        with pytest.raises(RuntimeError, match="a checker failed"):  # a worker's error comes with the verdicts
            verdicts.get()
        (tmp_path / "later.py").write_text("def check(response, answer):\n    return True\n")
        later = plumbing.load_reward(f"{tmp_path / 'later.py'}:check")  # after the fork: refused, never a hang
        with pytest.raises(ValueError, match="imported after the verifier's processes started"):
            pacs.reward_fn(["1"] * 64, ["1"] * 64, pool, later, wait=False)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended


@pytest.mark.parametrize("ending", ["exit", "ctrl-c"])
def test_verifier_workers_leave_no_process_behind(tmp_path, ending):
    """A process that started a pool of verifier workers, then exits normally or is interrupted (SIGINT to its
    process group, as Ctrl-C sends it) while they work: every worker and the forkserver are gone shortly after."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, signal, sys, threading
        sys.path.insert(0, {ROOT!r})
        import levers
        import pacs
        import plumbing
        # Python's own Ctrl-C handler, as in a terminal, also where this test runs in the background (a shell starts
        # a background job with SIGINT ignored, and the child would inherit that)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        pool = levers.VerifierPool(2)
        pids = [p.pid for p in pool.pool._pool]
        with open(os.path.join({ROOT!r}, "tests", "verify_cases.jsonl")) as f:
            rows = [json.loads(line) for line in f][:200]
        pacs.reward_fn([r["response"] for r in rows], [r["answer"] for r in rows], pool)  # the workers are up
        print(json.dumps(pids), flush=True)
        if {ending!r} == "ctrl-c":
            threading.Timer(0.2, lambda: os.killpg(os.getpgid(0), signal.SIGINT)).start()  # as a terminal does
            while True:
                pacs.reward_fn([r["response"] for r in rows] * 4, [r["answer"] for r in rows] * 4, pool)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          start_new_session=True)  # its own process group, which the SIGINT goes to
    pids = json.loads(proc.stdout.splitlines()[0])
    assert len(pids) == 2
    if ending == "ctrl-c":
        assert "KeyboardInterrupt" in proc.stderr and proc.returncode != 0
    deadline = time.time() + 10
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)


def test_verifier_processes_work_beside_phase_3_and_leave_the_step_unchanged(digit_model, monkeypatch, tmp_path):
    """With verifier processes, train_step's phase 3 (the old log-probs) runs while the verdicts are still on their
    way: the step asks for them (the handle's get) only after phase 3 has run, and waits half a second more there,
    which it logs as the verifier's time. The step equals the in-process step (rewards, loss, psi, gradient norm,
    weights), and the step's phases still sum to its time. The rewards come from a --reward checker."""
    import threading
    (tmp_path / "odd.py").write_text("def check(response, answer):\n    return len(response) % 2 == 1\n")
    problems = [{"problem": f"{i} + 1 =", "answer": str(i + 1)} for i in range(8)]
    cfg = pacs.Config(group_size=4, prompts_per_step=4, num_mini_batches=2, max_new_tokens=4, micro_batch_size=8,
                      lr=1e-2, seed=3, reward=f"{tmp_path / 'odd.py'}:check")  # mixed groups, from the texts alone
    phase_3, asked = threading.Event(), []
    real_reference = pacs.reference_logprobs

    def reference_logprobs(*args):
        try:
            return real_reference(*args)
        finally:
            phase_3.set()  # phase 3 has run

    class LateVerdicts:  # the pool's handle: asked for after phase 3, it takes half a second more
        def __init__(self, verdicts):
            self.verdicts = verdicts

        def get(self):
            asked.append(phase_3.is_set())
            time.sleep(0.5)
            return self.verdicts

    workers = types.SimpleNamespace(takes=lambda n: True, map_async=lambda check, *columns: LateVerdicts(
        [check(*row) for row in zip(*columns)]))  # a stand-in pool: the verdicts are the checker's
    monkeypatch.setattr(pacs, "reference_logprobs", reference_logprobs)
    runs = []
    for pool in (None, workers):
        phase_3.clear()
        model, tok = plumbing.load_model(digit_model)
        torch.manual_seed(0)
        optimizer = pacs.make_optimizer(cfg, model)
        metrics, _ = pacs.train_step(cfg, model, tok, optimizer, problems, 0, torch.device("cpu"), verifier_pool=pool)
        runs.append((metrics, [p.detach().clone() for p in model.parameters()]))
    assert asked == [True]  # the pool's verdicts were asked for once, after phase 3
    (serial, weights), (beside, weights_beside) = runs
    assert beside["time_verify"] >= 0.5 > serial["time_verify"]  # the wait after phase 3 is the verifier's time
    for key in ("reward", "mixed_groups", "loss", "psi_mean", "psi_std", "grad_norm", "entropy"):
        assert beside[key] == serial[key], key
    assert 0 < serial["reward"] < 1 and all(torch.equal(a, b) for a, b in zip(weights, weights_beside))
    phases = sum(beside[k] for k in ("time_generate", "time_verify", "time_old_logprobs", "time_update"))
    assert abs(phases - beside["step_time"]) < 1e-3 and min(beside[k] for k in plumbing.PHASES[:4]) >= 0


def test_verify_workers_flag_is_checked():
    with pytest.raises(plumbing.ConfigError, match="--verify-workers must be >= -1"):
        plumbing.check_config(pacs.Config(verify_workers=-2))


def test_verify_workers_default_is_a_core_each_with_cuda(monkeypatch):
    """-1, the default: a process a core with CUDA (the GPU check timed it faster), this process without."""
    assert pacs.Config().verify_workers == -1
    workers = lambda device_type, **k: levers.on_device(pacs.Config(**k), device_type).verify_workers  # noqa: E731
    assert workers("cuda") == 0 and workers("cpu") == 1
    assert workers("cuda", verify_workers=3) == 3 and workers("cpu", verify_workers=0) == 0


# ---- --pack-groups -----------------------------------------------------------------------------------------------
def test_pack_groups_lets_the_plan_put_several_groups_in_a_micro_batch(capsys):
    from transformers import Qwen2Config
    c = Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
    cfg = dict(prompts_per_step=16, group_size=4, num_mini_batches=2, max_prompt_tokens=32, max_new_tokens=32,
               memory_gib=8)
    one, _ = plumbing.plan_memory(pacs.Config(**cfg, pack_groups="off"), c, 100_000, "cuda")
    packed, _ = plumbing.plan_memory(pacs.Config(**cfg), c, 100_000, "cuda")  # auto: on with CUDA
    assert one.micro_batch_size == 4 and packed.micro_batch_size == 32  # a whole mini-batch: 8 prompts x 4
    peak = lambda rows: plumbing.memory_plan(pacs.Config(**cfg), c, 100_000, "cuda", rows, 1)["peak: update"]
    budget = (peak(16) + peak(32)) / 2  # 16 rows fit, 32 do not
    gib = (budget / 0.9 + plumbing.CUDA_CONTEXT) / plumbing.GiB
    tight, _ = plumbing.plan_memory(pacs.Config(**{**cfg, "memory_gib": gib}, pack_groups="on"), c, 100_000, "cuda")
    assert tight.micro_batch_size == 16  # as many groups as the budget fits


# ---- --full-rows ------------------------------------------------------------------------------------------------
def full_rows_roll(model, tok):
    """Two prompts of unequal length (the shorter one's group left-padded), G = 4, an early EOS in two rows."""
    prompts = [plumbing.build_prompt(tok, "What is 1 + 1?"),
               plumbing.build_prompt(tok, "A longer one: what is 10 + 20 + 30?")]
    torch.manual_seed(0)
    roll = pacs.sample(model, tok, prompts, group_size=4, max_new_tokens=7)
    roll["response_mask"][1, 3:] = 0
    roll["response_mask"][6, 1:] = 0
    return roll


@pytest.mark.parametrize("rows", [slice(0, 8), slice(0, 4), slice(4, 8)])
def test_full_rows_give_the_shared_prompts_log_probs_and_gradient(tiny_model_dir, rows):
    """--full-rows runs each row whole with the padding after each response unmasked (no mask at all where no row
    is left-padded: one group alone after trimming): the same log-probs and gradient as the shared-prompt route, in
    fp32, for two groups (left padding) and for each group alone."""
    model, tok = plumbing.load_model(tiny_model_dir)
    roll = full_rows_roll(model, tok)
    assert (roll["prompt_mask"][rows] == 0).any() == (rows.start == 0)  # the first prompt is the shorter one
    mask = roll["response_mask"][rows].float()
    results = []
    for full_rows in ("off", "on"):
        cfg = pacs.Config(group_size=4, temperature=0.8, full_rows=full_rows)
        model.zero_grad()
        lp, _ = pacs.step_logprobs(cfg, model, roll, rows)
        (lp * mask).sum().backward()
        results.append((lp.detach() * mask, [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
    for shared, full in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(shared, full, atol=1e-5, rtol=1e-4)


def test_full_rows_drop_the_mask_only_where_no_row_is_left_padded(tiny_model_dir, monkeypatch):
    """The decoder gets no attention mask for one group alone (SDPA may take flash), and a mask with every response
    column 1 for two groups of unequal prompts."""
    model, tok = plumbing.load_model(tiny_model_dir)
    roll = full_rows_roll(model, tok)
    seen, forward = [], type(model.base_model).forward

    def spy(self, *a, attention_mask=None, **k):
        seen.append(attention_mask)
        return forward(self, *a, attention_mask=attention_mask, **k)
    monkeypatch.setattr(type(model.base_model), "forward", spy)
    cfg = pacs.Config(group_size=4, full_rows="on")
    with torch.no_grad():
        pacs.step_logprobs(cfg, model, roll, slice(4, 8))
        pacs.step_logprobs(cfg, model, roll, slice(0, 8))
    assert len(seen) == 2 and seen[0] is None
    width = roll["response_ids"].shape[1]
    assert (seen[1][:, -width:] == 1).all() and (seen[1][:, :-width] == 0).any()


def test_full_rows_are_priced_by_the_plan():
    """Each row's prompt is in the activations, and there is no shared-prompt KV cache."""
    from transformers import Qwen2Config
    c = Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
    cfg = dict(prompts_per_step=16, group_size=4, num_mini_batches=2, max_prompt_tokens=48, max_new_tokens=32)
    shared, full = (plumbing.memory_plan(pacs.Config(**cfg, full_rows=f), c, 100_000, "cuda", 8, 1)
                    for f in ("off", "on"))
    per_token = plumbing.activation_bytes_per_token(c, 2)
    assert full["activations of a micro-batch"] == 8 * (48 + 32) * per_token
    assert full["KV cache of the shared prompt"] == 0 and shared["KV cache of the shared prompt"] > 0
    assert full["attention masks (SDPA)"] == plumbing.attention_mask_bytes(c, 2, 8, 80, 80)


@needs_qwen
def test_full_rows_auto_takes_full_rows_on_cuda_where_a_whole_group_fits_them():
    """--full-rows auto (the default): full rows on CUDA at the plan's micro-batch where they fit it, the shared
    prompt where only that fits (PPO on a 40 GB card) or below a group (a 24 GB card), never on the CPU; the route is
    kept with the sizes, and a checkpoint from before it resumes at the plan's."""
    c = plumbing.load_model_config(QWEN)
    n = plumbing.count_parameters(c)
    chosen = {}
    for name, over in {"40": dict(memory_gib=39.5), "40 ppo": dict(memory_gib=39.5, algo="ppo"),
                       "24": dict(memory_gib=22.5), "cpu": dict(memory_gib=22.5)}.items():
        sizes, _ = plumbing.plan_memory(pacs.Config(**over), c, n, "cpu" if name == "cpu" else "cuda")
        chosen[name] = (sizes.micro_batch_size, sizes.full_rows)
    assert chosen == {"40": (8, True), "40 ppo": (8, False), "24": (2, False), "cpu": (2, False)}
    cfg = pacs.Config(memory_gib=39.5)
    planned = plumbing.Sizes(8, 128, True)
    assert plumbing.resumed_sizes(cfg, planned, {"sizes": {"micro_batch_size": 8, "gen_batch_prompts": 128},
                                             "config": {"micro_batch_size": 0, "gen_batch_prompts": 0}}) == planned
    saved = {"sizes": {"micro_batch_size": 4, "gen_batch_prompts": 64, "full_rows": False},
             "config": {"micro_batch_size": 0, "gen_batch_prompts": 0, "full_rows": "auto"}}
    assert plumbing.resumed_sizes(cfg, planned, saved) == plumbing.Sizes(4, 64, False)  # as the checkpoint left them


# ---- time outside the step ---------------------------------------------------------------------------------------
def test_each_step_logs_its_eval_and_the_checkpoint_before_it(digit_model, const7_file, tmp_path, capsys):
    pacs.main(["--model", digit_model, "--dataset", const7_file, "--eval-dataset", const7_file, "--out-dir",
               str(tmp_path), "--group-size", "4", "--prompts-per-step", "2", "--num-mini-batches", "1",
               "--max-new-tokens", "2", "--steps", "3", "--eval-every", "2", "--eval-size", "2", "--save-every", "1",
               "--log-samples-every", "0"])
    with open(tmp_path / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["time_save"] > 0 for r in rows] == [False, True, True]  # the checkpoints after steps 0 and 1
    assert [r["time_eval"] > 0 for r in rows] == [True, False, True]  # --eval-every 2, and the last step
    assert "eval_acc" in rows[0] and "eval_acc" not in rows[1]
    out = capsys.readouterr()
    assert "saved" in out.out and "[save] checkpoint-000000 in" in out.err


# ---- eval.py's batch -----------------------------------------------------------------------------------------------
def test_eval_batch_size_comes_from_the_plan_on_cuda_and_stays_on_resume(monkeypatch, tmp_path):
    from transformers import Qwen2Config
    args = ev.EvalConfig(model="m", max_new_tokens=512, n=4)
    assert ev.planned_batch_size(args, torch.device("cpu"), 100, None) == 64
    assert ev.planned_batch_size(args, torch.device("cuda"), 100, 256) == 256  # the first run's, on resume
    c = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                    num_attention_heads=14, num_key_value_heads=2)
    monkeypatch.setattr(plumbing, "load_model_config", lambda name, base="": c)  # eval.py passes --base
    monkeypatch.setattr(plumbing, "count_parameters", lambda config: 494_032_768)
    sizes = {}
    for gib, static in ((22.5, False), (80, False), (80, True)):
        monkeypatch.setattr(plumbing, "device_memory", lambda device_type, memory_gib=0.0: gib * plumbing.GiB)
        args.static_cache = static  # eval.py's --static-cache, opt-in: its extras priced when on
        sizes[gib, static] = ev.planned_batch_size(args, torch.device("cuda"), 300, None)
        cfg = pacs.Config(group_size=1, max_prompt_tokens=300, max_new_tokens=512, rollout_dtype="bf16",
                          static_cache="on" if static else "off")
        need = lambda rows: sum(v for k, v in plumbing.memory_plan(cfg, c, 494_032_768, "cuda", 1, rows).items()
                                if k.startswith(("KV cache of one", "generate")))
        budget = plumbing.plan_budget("cuda", gib * plumbing.GiB) - 2 * 494_032_768
        assert need(sizes[gib, static]) <= budget < need(2 * sizes[gib, static])  # the most that fit, powers of 2
    assert 64 < sizes[22.5, False] < sizes[80, False]
    seen, plan = [], plumbing.memory_plan
    monkeypatch.setattr(plumbing, "memory_plan", lambda cfg, *a, **k: seen.append(
        levers.on_device(cfg, "cuda").cache_tokens > 0) or plan(cfg, *a, **k))
    for static in (False, True):
        args.static_cache = static
        ev.planned_batch_size(args, torch.device("cuda"), 300, None)
        assert set(seen) == {static}, static  # the plan prices the cache eval.py runs
        seen.clear()


# ---- the prepared check's verdicts ---------------------------------------------------------------------------------
def write(path, obj):
    path.write_text(json.dumps(obj))


def step_json(**over):
    r = {"step_s": 10.0, "generate_s": 4.0, "verify_s": 1.0, "old_logprobs_s": 1.0, "update_s": 4.0,
         "generate_peak_gib": 1.0, "plan_generate_gib": 2.0, "generate_over_plan": 0.5, "update_peak_gib": 1.0,
         "plan_update_gib": 2.0, "update_over_plan": 0.5, "micro_batch_size": 8, "gen_batch_prompts": 4}
    return {**r, **over}


def test_the_checks_summary_reads_each_target_met_short_or_not_measured(tmp_path):
    """A row per target of docs/gpu.md, at its threshold: the step against every lever off (step_off), the updates'
    share of the card, a decode step's ms, --memory-gib 22.5 with checkpointing against without, psi on both routes."""
    import gpu_check

    def targets():
        rows = gpu_check.summary_rows(str(tmp_path))
        return [v for k, v in rows if k.startswith("target:")]
    assert targets()[:4] == ["not measured: needs step_off, and step_default or step_opt",
                             "not measured: needs step_default or step_opt on a card of known peak",
                             "not measured: needs step_default, step_opt or step_flex",
                             "not measured: needs step_22g and step_22g_ckpt"]
    assert targets()[4] == "short: psi_levers FAIL, psi_ckpt FAIL, psi_lora FAIL"  # psi missing
    write(tmp_path / "step_off.json", step_json(step_s=80.0))
    write(tmp_path / "step_default.json", step_json(step_s=40.0, update_mfu=0.2, decode_ms_per_token=12.0))
    write(tmp_path / "step_opt.json", step_json(step_s=32.0, update_mfu=0.3, decode_ms_per_token=10.0))
    write(tmp_path / "step_22g.json", step_json(step_s=100.0))
    write(tmp_path / "step_22g_ckpt.json", step_json(step_s=50.0))
    for name in ("psi_levers", "psi_ckpt", "psi_lora"):
        write(tmp_path / f"{name}.json", {"psi_std_max": 0.0})
    assert targets() == ["met: step_default x2.00, step_opt x2.50", "met: step_default 20.0%, step_opt 30.0%",
                         "met: step_default 12.0 ms (4 prompts a call), step_opt 10.0 ms (4 prompts a call)",
                         "met: x2.00", "met: psi_levers pass, psi_ckpt pass, psi_lora pass"]
    write(tmp_path / "step_opt.json", step_json(step_s=32.1, update_mfu=0.299, decode_ms_per_token=10.1))
    write(tmp_path / "step_22g_ckpt.json", step_json(step_s=50.1))
    write(tmp_path / "psi_ckpt.json", {"psi_std_max": 1e-7})
    assert [v.split(":")[0] for v in targets()] == ["short"] * 5


def test_the_checks_summary_reads_each_opt_in_levers_verdict_at_the_bar(tmp_path):
    """A row per opt-in lever from its own same-call A/B: kept at x1.10 or more on its phase, removed below, and left
    opt-in where the ratio falls within 5% of the line (x1.048 to x1.155); not measured without its steps."""
    import gpu_check

    def verdicts():
        return {k[6:].split(":")[0]: v.split(" ")[0] for k, v in gpu_check.summary_rows(str(tmp_path))
                if k.startswith("lever ")}
    assert set(verdicts().values()) == {"not"}  # not measured: nothing ran
    assert set(verdicts()) == {"--static-cache flex", "--defer-stop-check", "--sampler gumbel", "--compile-layers",
                               "--compile-head"}
    write(tmp_path / "step_default.json", step_json(generate_s=11.55))
    write(tmp_path / "step_flex.json", step_json(generate_s=10.0))  # x1.155: keep
    write(tmp_path / "step_defer.json", step_json(generate_s=11.0))  # x1.05: undecided
    write(tmp_path / "attn.json", {"forms": {"sample-hf": {"ms": 1.047}, "sample-gumbel": {"ms": 1.0}}})  # remove
    form = lambda s: {"fwd_bwd_s": s, "fwd_s": s / 3, "fwd_bwd_first_s": 9.0}  # noqa: E731
    write(tmp_path / "forms.json", {"forms": {"full-32": form(1.154), "layersc-32": form(1.0), "head-4": form(2.4),
                                              "headc-4": form(2.0)}})
    assert verdicts() == {"--static-cache flex": "keep", "--defer-stop-check": "undecided",
                          "--sampler gumbel": "remove", "--compile-layers": "undecided", "--compile-head": "keep"}
    assert [gpu_check.lever_verdict(r).split(" ")[0] for r in (1.0475, 1.0476, 1.1549, 1.155)] == [
        "remove", "undecided", "undecided", "keep"]


def test_the_checks_summary_reads_fail_for_a_missing_or_nonzero_psi_and_a_peak_over_its_plan(tmp_path):
    import gpu_check
    write(tmp_path / "psi_levers.json", {"varied_prompts": 128, "prompt_tokens": 512})  # psi missing
    write(tmp_path / "psi_ckpt.json", {"psi_std_max": 1e-4})  # psi nonzero
    write(tmp_path / "psi_lora.json", {"psi_std_max": 1e-4})
    write(tmp_path / "step_default.json", step_json(update_over_plan=1.02, update_peak_gib=2.04))  # over the plan
    write(tmp_path / "step_shared.json", step_json())
    rows = dict(gpu_check.summary_rows(str(tmp_path)))
    assert rows["psi_std at --lr 0, every lever on"].startswith("FAIL")
    assert rows["psi_std at --lr 0, every lever on, --gradient-checkpointing"].startswith("FAIL")
    assert rows["psi_std at --lr 0, LoRA rank 16, its B drawn at random"].startswith("FAIL")
    assert rows["Qwen3-4B stand-in, v2's prompt, LoRA rank 16"].startswith("FAIL: no result")
    assert rows["default step, the defaults: peaks"].startswith("FAIL: over the plan")
    assert rows["default step, one group per micro-batch, shared prompt: peaks"].startswith("within the plan")
    assert rows["--memory-gib 22.5, the defaults"].startswith("FAIL: no result")  # no JSON at all
    assert rows["README end to end: train"].startswith("FAIL")  # did not run
    write(tmp_path / "psi_levers.json", {"psi_std_max": 0.0})
    assert dict(gpu_check.summary_rows(str(tmp_path)))["psi_std at --lr 0, every lever on"].startswith("pass")


# ---- auto: on with CUDA, off elsewhere ----------------------------------------------------------------------------
def test_every_auto_flag_is_off_on_the_cpu_and_on_with_cuda():
    """levers.on_device is the one place `auto` is read: each flag that takes `auto` (and --verify-workers' -1) is
    off on the CPU and on with CUDA; typed `on`, it is on on the CPU too. The plan packs no groups on the CPU."""
    import typing
    auto = [f.name for f in dataclasses.fields(pacs.Config) if f.default == "auto"]
    assert set(auto) == {"device", "rollout_dtype", "autocast", "pack_groups", "full_rows", "static_cache"}
    off = {"rollout_dtype": ("rollout_dtype", torch.float32), "autocast": ("autocast", None),
           "pack_groups": ("pack_groups", False), "full_rows": ("full_rows", False),
           "static_cache": ("cache_tokens", 0)}
    on = {"rollout_dtype": torch.bfloat16, "autocast": torch.bfloat16, "pack_groups": True, "full_rows": None,
          "static_cache": 1536}  # full_rows None: with CUDA the plan chooses
    cpu, cuda = levers.on_device(pacs.Config(), "cpu"), levers.on_device(pacs.Config(), "cuda")
    for flag, (field, value) in off.items():
        assert getattr(cpu, field) == value, flag
        assert getattr(cuda, field) == on[flag], flag
    assert cpu.verify_workers == 1 and cuda.verify_workers == 0  # -1: in-process on the CPU, a core each with CUDA
    typed = levers.on_device(pacs.Config(pack_groups="on", full_rows="on", static_cache="on", autocast="bf16",
                                         rollout_dtype="bf16"), "cpu")
    assert typed.pack_groups and typed.full_rows and typed.cache_tokens and typed.autocast and \
        typed.rollout_dtype == torch.bfloat16
    assert "auto" in typing.get_args(typing.get_type_hints(pacs.Config)["pack_groups"])
    from transformers import Qwen2Config
    c = Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
    sizes, _ = plumbing.plan_memory(pacs.Config(prompts_per_step=16, group_size=4, num_mini_batches=2,
                                                max_prompt_tokens=32, max_new_tokens=32), c, 100_000, "cpu")
    assert sizes.micro_batch_size == 4 and not sizes.full_rows  # one group, shared prompts: auto is off here
