"""The GPU speed levers of pacs.py, each behind its flag, none needed to read the algorithm (docs/gpu.md has each
one's measured ratio, or "not run on a GPU").

A leaf module: torch and transformers only. pacs.py and plumbing.py reach it through a few hooks:
    on_device        what each `auto` flag means on the run's device: the one place `auto` becomes "on with CUDA"
    VerifierPool     --verify-workers: the verifier in processes, beside phase 3 (pacs.reward_fn's wait=False)
    decoding         generate's levers around one model.generate call: --static-cache (with static_cache), --sampler
                     gumbel, --defer-stop-check
    compiled_head    --compile-head: the LM head's log-probs compiled (compiled_head_logprobs runs a chunk)
    compile_layers   --compile-layers: the decoder layers compiled (as_in_training runs phase 3 on phase 4's graph)
A lever's bad setting raises a plain ValueError, which the run turns into its one-line error.
"""
from __future__ import annotations

import atexit
import copy
import functools
import inspect
import multiprocessing
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class Levers:
    """What the speed and precision flags do on a run's device (on_device). The defaults are every lever off, as
    eval.py and a script calling pacs.sample get them: transformers' plain generate, fp32, the verifier in-process."""
    autocast: Optional[torch.dtype] = None  # the training forwards' matmuls: bf16, or None (fp32)
    rollout_dtype: torch.dtype = torch.float32  # the weights generate runs on (a copy where not fp32)
    verify_workers: int = 1  # verifier processes (VerifierPool); 0: a core each
    pack_groups: bool = False  # the plan may put several whole groups in a micro-batch
    full_rows: Optional[bool] = False  # log-prob forwards of whole rows; None: where the plan fits whole groups
    cache_tokens: int = 0  # --static-cache: generate's KV cache length, one shape for the run; 0: the dynamic cache
    flex: bool = False  # --static-cache flex: the decode attention reads the cache's filled blocks only
    sampler: str = "multinomial"  # generate's draw of each token: multinomial | gumbel
    defer_stop: bool = False  # --defer-stop-check (CUDA only)
    compile_head: bool = False
    compile_layers: bool = False


def on_device(cfg, device_type):
    """cfg's levers on device_type ("cuda" or "cpu"): each `auto` is on with CUDA and off elsewhere; --verify-workers
    -1 is a core each with CUDA (the verifier took 5.2 s of a 58 s default step on an H200 in-process, 3.5 s over 16
    processes; experiments/gpu-runs/), this process without."""
    cuda = device_type == "cuda"
    on = lambda setting: setting == "on" or (setting == "auto" and cuda)  # noqa: E731
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32, "auto": torch.bfloat16 if cuda else torch.float32}
    static = cfg.static_cache == "flex" or on(cfg.static_cache)
    return Levers(autocast=torch.bfloat16 if cfg.autocast == "bf16" or (cfg.autocast == "auto" and cuda) else None,
                  rollout_dtype=dtypes[cfg.rollout_dtype],
                  verify_workers=cfg.verify_workers if cfg.verify_workers >= 0 else (0 if cuda else 1),
                  pack_groups=on(cfg.pack_groups),
                  full_rows={"on": True, "off": False}.get(cfg.full_rows, None if cuda else False),
                  cache_tokens=cfg.max_prompt_tokens + cfg.max_new_tokens if static else 0,
                  flex=cfg.static_cache == "flex", sampler=cfg.sampler, defer_stop=cfg.defer_stop_check and cuda,
                  compile_head=cfg.compile_head, compile_layers=cfg.compile_layers)


# ---- --verify-workers: the verifier in processes, beside phase 3 --------------------------------------------------
def ignore_sigint():
    """A verifier worker's initializer: Ctrl-C is the trainer's to handle (it ends the pool on its way out)."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Verdicts:
    """R in {0, 1} (N,) once they arrive: .get() waits for a VerifierPool's (an AsyncResult) and hands back the
    float tensor; verdicts already worked out (a list or a tensor) are handed back as they are."""

    def __init__(self, verdicts):
        self.verdicts = verdicts

    def get(self):
        verdicts = self.verdicts.get() if hasattr(self.verdicts, "get") else self.verdicts
        return torch.as_tensor(verdicts, dtype=torch.float32)


class VerifierPool:
    """--verify-workers: processes for a pure function of strings (the verifier; never torch), used for min_answers
    answers or more (fewer verify faster in-process). workers 0: one per core this process may use, at most 16; 1:
    none. Forked (a script that calls pacs in-process needs no `__main__` guard), before the model loads; ended by
    close() or at exit, Ctrl-C included."""
    min_answers = 64

    def __init__(self, workers):
        self.workers = min(len(os.sched_getaffinity(0)), 16) if workers == 0 else workers
        self.pool = None
        if self.workers > 1:
            self.modules = set(sys.modules)  # what the processes inherit: they can call functions of these only
            self.pool = multiprocessing.get_context("fork").Pool(self.workers, initializer=ignore_sigint)
            atexit.register(self.close)  # a pool still running at exit (Ctrl-C, an error) is ended

    def takes(self, n):
        """Whether n answers go to the processes."""
        return self.pool is not None and n >= self.min_answers

    def map_async(self, fn, *columns):
        """[fn(*row) for row in zip(*columns)] over the processes, handed back at once (a multiprocessing AsyncResult:
        .get() waits for the list, and raises a worker's error): four chunks a worker, balanced, few round trips."""
        module = getattr(fn, "module", fn.__module__)  # a plumbing.RewardChecker names its function's
        if module not in self.modules:  # a worker could not unpickle the call, and its verdicts would never come
            raise ValueError(f"{module} was imported after the verifier's processes started: import it before")
        rows = list(zip(*columns))
        return self.pool.starmap_async(fn, rows, chunksize=-(-len(rows) // (4 * self.workers)))

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def close(self):
        pool, self.pool = self.pool, None
        atexit.unregister(self.close)
        if pool is not None:
            pool.terminate()
            pool.join()


# ---- generate's levers: --static-cache (and flex), --sampler gumbel, --defer-stop-check ------------------------
@contextmanager
def decoding(model, generation_config, inputs, speed):
    """Around one model.generate call: yields the (generation_config, inputs) to call it with under `speed` (a Levers).
    --static-cache (a StaticCache in inputs, from static_cache): a lone query's heads folded onto their K/V head
    (folded_gqa_attention) where the model runs transformers' SDPA, then SDPA again (the log-prob forwards never see
    it); flex reads the cache's filled blocks only, compiled per batch shape. --sampler gumbel: the draw as greedy
    decoding over noised scores (gumbel_max_generation). --defer-stop-check: the stop read a step late."""
    undo = []
    if speed.sampler == "gumbel" and generation_config.do_sample:
        generation_config, inputs = gumbel_max_generation(generation_config, inputs)
    if speed.defer_stop:
        undo.append(defer_stop_check())
    if speed.cache_tokens and model.config._attn_implementation == "sdpa":
        if speed.flex:  # a static graph per batch shape (the eval's, an OOM's halving): compiled with a dynamic
            # batch, inductor's flex_attention does not build on the CPU (torch 2.13), and is untried on CUDA
            from transformers import CompileConfig
            generation_config = copy.deepcopy(generation_config)  # its compile_config too: the caller's stays
            generation_config.compile_config = generation_config.compile_config or CompileConfig()
            generation_config.compile_config.dynamic = False
        model.set_attn_implementation(register_folded_attention(speed.flex))
        undo.append(lambda: model.set_attn_implementation("sdpa"))
    try:
        yield generation_config, inputs
    finally:
        for step in reversed(undo):
            step()


FOLDED_GQA = "sdpa_folded_gqa"  # the attention --static-cache's generate runs (registered with transformers)
FLEX_FOLDED_GQA = "flex_folded_gqa"  # the same, through flex_decode_attention (--static-cache flex)
FLEX_BLOCK = 128  # positions per block of flex_decode_attention's block mask


def register_folded_attention(flex=False):
    """folded_gqa_attention registered with transformers under its name (one name per kernel: the compiled decode
    step sees one name throughout, one compile), SDPA's masks as they are. Returns the name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask
    name = FLEX_FOLDED_GQA if flex else FOLDED_GQA
    AttentionInterface.register(name, functools.partial(folded_gqa_attention, flex=flex))
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def static_cache(model, prefix, group_size, max_len, flex=False):
    """--static-cache: a StaticCache of max_len tokens, holding the prompts' prefix cache (a DynamicCache of one row
    per prompt, or None) repeated for each prompt's group_size rows; generate() fills the rest in place."""
    from transformers import StaticCache
    if flex:  # whole blocks for flex_decode_attention (<= 127 positions over the plan's)
        max_len = -(-max_len // FLEX_BLOCK) * FLEX_BLOCK
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    if prefix is not None:
        for src, dst in zip(prefix.layers, cache.layers):  # one layer's repeat at a time: no second full copy
            keys, values = (t.repeat_interleave(group_size, 0) for t in (src.keys, src.values))  # (n*G, h, L, d)
            dst.lazy_initialization(keys, values)
            dst.keys[:, :, :keys.shape[2]].copy_(keys)
            dst.values[:, :, :values.shape[2]].copy_(values)
            dst.cumulative_length.fill_(keys.shape[2])
    return cache


def folded_gqa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, flex=False, **kwargs):
    """transformers' SDPA attention, but a lone query token's heads attend as queries of the K/V head they share:
    (B, H, 1, D) -> (B, Hkv, H/Hkv, D), and no copy of K/V for each query head. transformers folds so itself, but
    not in compiled code, where --static-cache's decode step runs: there it copied the whole cache H/Hkv times a
    layer (7 for Qwen2.5-0.5B; experiments/gpu-runs/). The same softmax over the same keys, row by row. flex: through
    flex_decode_attention where the mask is a boolean one per row over whole blocks."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    groups = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] != 1 or groups == 1 or (attention_mask is not None and attention_mask.shape[1] != 1):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    b, h, _, d = query.shape  # query (B, H, 1, D); key, value (B, Hkv, S, D); attention_mask (B, 1, 1, S) or None
    folded = query.reshape(b, h // groups, groups, d)  # (B, Hkv, g, D): head i is query i % g of K/V head i // g
    if flex and getattr(attention_mask, "dtype", None) == torch.bool and \
            key.shape[2] % FLEX_BLOCK == 0 and attention_mask.shape[0] == b:  # a mask per row, whole blocks
        out = flex_decode_attention(folded, key, value, attention_mask, scaling)
    else:
        out = F.scaled_dot_product_attention(folded, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                             scale=scaling)  # (B, Hkv, g, D)
    return out.reshape(b, 1, h, d), None  # (B, 1, H, D), as transformers' attention functions return it


def flex_decode_attention(query, key, value, mask, scale=None):
    """SDPA(query, key, value, attn_mask=mask) for a few queries that share their keys (a decode step's folded
    heads), by flex_attention over the blocks of FLEX_BLOCK positions that hold a key to attend, the others never
    read: a static cache's unfilled tail costs nothing. The block list is built from the mask on the device, with no
    host sync, so a compiled decode step (CUDA graphs) keeps one shape; the kernel reads its length at run time.
    query (B, Hkv, q, D); key, value (B, Hkv, S, D); mask (B, 1, 1, S) bool, True: attend. Returns (B, Hkv, q, D)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    b, S = mask.shape[0], mask.shape[-1]
    if S % FLEX_BLOCK or b != query.shape[0]:
        raise ValueError(f"flex_decode_attention takes whole blocks of {FLEX_BLOCK} positions and a mask per row: "
                         f"got {S} positions, a mask of {b} rows for {query.shape[0]}")
    n, keys = S // FLEX_BLOCK, mask.reshape(b, S)  # keys (B, S)
    live = keys.view(b, n, FLEX_BLOCK).any(-1)  # (B, n): a block with a key to attend
    kv_num_blocks = live.sum(-1, dtype=torch.int32).view(b, 1, 1)  # (B, 1, 1): one head row, one query block
    kv_indices = torch.argsort((~live).to(torch.int8), dim=-1, stable=True).to(torch.int32).view(b, 1, 1, n)
    block_mask = BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=FLEX_BLOCK,
                                          mask_mod=lambda bi, hi, qi, ki: keys[bi, ki],
                                          seq_lengths=(query.shape[2], S), compute_q_blocks=False)  # no backward
    return flex_attention(query, key, value, block_mask=block_mask, scale=scale)


# ---- --sampler gumbel ------------------------------------------------------------------------------------------
def gumbel_max_generation(generation_config, inputs):
    """--sampler gumbel: a sampling config as greedy decoding over noised scores, the same draw. With u_v ~ U(0, 1),
    argmax_v (s_v / tau - log(-log u_v)) is distributed as softmax(s / tau) (the Gumbel-max trick, which
    torch.multinomial also uses for one sample: argmax p / q, q ~ Exp(1), in fp32); where top_p < 1, transformers' own
    warpers cut the nucleus first, so the argmax draws from the nucleus renormalised, as its sampling does. One
    compiled pass over the vocabulary takes the place of the softmax, the multinomial's passes and its checks
    (docs/gpu.md). Returns (the greedy config, inputs with the processors)."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper
    config = copy.deepcopy(generation_config)  # its compile_config too: the caller's stays as it was
    warpers = {"top_k": (None, 0), "min_p": (None, 0.0), "typical_p": (None, 1.0), "epsilon_cutoff": (None, 0.0),
               "eta_cutoff": (None, 0.0), "top_h": (None,)}  # greedy decoding would drop them: the rollouts set none
    kept = [f"{k}={getattr(config, k)}" for k, off in warpers.items() if getattr(config, k, None) not in off]
    if kept:
        raise ValueError(f"--sampler gumbel draws with temperature and top-p only; this config also sets {kept}")
    tau, top_p = config.temperature, config.top_p
    config.do_sample, config.temperature, config.top_p, config.top_k = False, 1.0, 1.0, None
    noise = GumbelNoise(tau if top_p >= 1.0 else 1.0, inputs["input_ids"].device)
    cut = [TemperatureLogitsWarper(tau), TopPLogitsWarper(top_p)] if top_p < 1.0 else []
    return config, {**inputs, "logits_processor": LogitsProcessorList(cut + [noise])}


def gumbel_noised(scores, temperature):  # (B, V) fp32 -> (B, V): its argmax per row ~ softmax(scores / temperature)
    tiny, eps = torch.finfo(scores.dtype).tiny, torch.finfo(scores.dtype).eps
    uniform = torch.rand_like(scores).clamp_(tiny, 1.0 - eps / 2)  # (B, V) in (0, 1): never log(0) nor -log(1) = 0
    return scores / temperature - torch.log(-torch.log(uniform))


@functools.cache
def compiled_gumbel_noised():
    """gumbel_noised under torch.compile, built once for the process, at the first --sampler gumbel generate."""
    return torch.compile(gumbel_noised)


class GumbelNoise:
    """A logits processor (transformers calls it with the step's ids and fp32 scores): compiled_gumbel_noised."""

    def __init__(self, temperature, device):
        if device.type == "cpu":
            scalar_cpu_compile()  # inductor's scalar code on a CPU without a vector ISA
        self.noise, self.temperature = compiled_gumbel_noised(), temperature

    def __call__(self, input_ids, scores):  # (B, L), (B, V) -> (B, V)
        return self.noise(scores, self.temperature)


# ---- --defer-stop-check ----------------------------------------------------------------------------------------
def defer_stop_check():
    """--defer-stop-check: generate reads whether every row has stopped from the step before, as transformers'
    DeferredStopCheck does (the flag copied to the host without a wait; the one decode step too many undone at the
    end) where transformers enables it, on Apple's mps only. Elsewhere its StopCheck reads a device tensor at every
    decode step: the host waits for the card, and the card waits while the host prepares the next step (on the
    static cache's compiled step; the dynamic cache's mask reads the device at each step anyway). The same tokens for a
    seed; the extra step draws random numbers, so the draws after it differ. Returns the undo."""
    from transformers.generation import utils as generation_utils
    check = generation_utils.DeferredStopCheck
    supported = check.__dict__["is_supported"]  # transformers' rule, but for the device: a cache that can drop the
    # extra step (or none returned), and no assistant model
    check.is_supported = staticmethod(lambda device, cache, cache_is_returned, is_assistant: not is_assistant and (
        cache is None or cache.is_croppable or not cache_is_returned))
    return lambda: setattr(check, "is_supported", supported)


def check_defer_stop():
    """A ValueError where this transformers has no DeferredStopCheck.is_supported for --defer-stop-check to widen."""
    from transformers.generation import utils as generation_utils
    if "is_supported" not in getattr(generation_utils, "DeferredStopCheck", object).__dict__:
        raise ValueError("--defer-stop-check needs transformers' DeferredStopCheck.is_supported (transformers 5.24)")


# ---- --compile-head, --compile-layers -------------------------------------------------------------------------
@functools.cache
def compiled(function):
    """function under torch.compile, one dynamic graph for every shape, built once for the process."""
    return torch.compile(function, dynamic=True)


def compiled_head(token_logprobs, device_type):
    """--compile-head: pacs.token_logprobs under torch.compile, one graph for every chunk length (dynamic). Compiled
    for the first length, then again for all, it gave one chunk two kernels in phases 3 and 4: psi 1.1e-6 at --lr 0
    in the GPU check's CPU rehearsal (psi_levers)."""
    if device_type == "cpu":
        scalar_cpu_compile()
    return compiled(token_logprobs)


def compiled_head_logprobs(head, lm_head, hidden, targets, temperature):
    """A chunk's (log-probs (n,), entropy (n,)) by the compiled head, inside checkpoint with grad whether or not
    grad is on (then detached): psi = 0 at --lr 0 needs phases 3 and 4's log-probs equal bit for bit, and a graph
    compiled without grad may fuse the function differently; the entropy always: one graph."""
    grad = torch.is_grad_enabled()
    with torch.enable_grad():
        lp, ent = checkpoint(head, lm_head, hidden if grad else hidden.detach().requires_grad_(), targets,
                             temperature, True, use_reentrant=False)
    return (lp, ent) if grad else (lp.detach(), ent)


def compile_layers(model, device):
    """--compile-layers: the decoder's layers run their class's forward under torch.compile wherever they are called
    without a KV cache: the log-prob forwards of full rows (--full-rows, --gradient-checkpointing); generate and the
    shared prompt's cached forwards stay eager. One graph serves every layer, its weights the graph's inputs
    (regional compilation: a layer's compile, not the whole decoder's), dynamic in rows and length (one row, and a
    mask or none, are graphs of their own). psi = 0 at --lr 0 needs phases 3 and 4 on the same graph: response_hidden
    runs phase 3's forward as phase 4 runs it (as_in_training), and a frozen pi_ref keeps requires_grad
    (plumbing.frozen_copy, made in pacs.train_loop)."""
    decoder = model.get_decoder()  # the decoder stack, of a causal LM or through a PeftModel
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise ValueError(f"--compile-layers needs a decoder with a list of layers; {type(decoder).__name__} has none")
    if device.type == "cpu":
        scalar_cpu_compile()
    # the layer's own forward: transformers wraps it in its checkpointing (and a keyword's rename), which compiled
    # would recompile per mode; that wrapper's checkpoint is kept, in eager code, around the compiled forward
    compiled = torch.compile(inspect.unwrap(type(layers[0]).forward), dynamic=True)

    def layer_forward(layer, eager, *args, **kwargs):
        if kwargs.get("cache") is not None:
            return eager(*args, **kwargs)
        if getattr(layer, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled():
            return layer._gradient_checkpointing_func(functools.partial(compiled, layer, **kwargs), *args)
        return compiled(layer, *args, **kwargs)

    for layer in layers:
        layer.forward = functools.partial(layer_forward, layer, layer.forward)
    decoder.compiled_layers = True


def as_in_training(decoder, kwargs):
    """decoder(**kwargs)'s last hidden state (b, L, H), detached, computed as phase 4 computes it: in training mode,
    with grad, inside checkpoint (no activation kept, nothing backpropagated). Under --compile-layers the compiled
    graph depends on both (the attention reads self.training; a graph without grad fuses on its own): phase 3's
    log-probs, and pi_ref's, then equal phase 4's bit for bit, and psi = 0 at --lr 0."""
    training = decoder.training
    decoder.train()
    try:
        with torch.enable_grad():
            return checkpoint(lambda: decoder(**kwargs).last_hidden_state, use_reentrant=False).detach()
    finally:
        decoder.train(training)


def scalar_cpu_compile():
    """torch.compile on a CPU without a vector ISA (ATEN_CPU_CAPABILITY=default, or no AVX2): inductor emits vector
    code there that does not build (torch 2.13), scalar code does (cpp.simdlen 1). Returns whether it is such a CPU."""
    from torch._inductor import config, cpu_vec_isa
    scalar = not cpu_vec_isa.pick_vec_isa()
    if scalar:
        config.cpp.simdlen = 1
    return scalar
