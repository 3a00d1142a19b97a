"""The prepared GPU check's Python side (benchmarks/gpu_check.sh runs it; docs/gpu-check.md says how).

    python benchmarks/gpu_check.py prepare --wheels    # here, once: .gpu/ = model files, MATH text, the wheels
    python benchmarks/gpu_check.py probe OUT/probe.json          # versions, the card, SDPA's kernels, the allocator
    python benchmarks/gpu_check.py build STANDIN --model-dir .gpu/model [--tiny]   # random-init Qwen2.5-0.5B
    python benchmarks/gpu_check.py lab OUT/lab.json --device cuda  # the lab's step there and on one CPU core
    python benchmarks/gpu_check.py summary OUT                   # the table of every JSON in OUT

`prepare` fills the git-ignored folder .gpu/, to be sent along with the repository to the GPU machine (named, since
git ignores it): Qwen2.5-0.5B-Instruct's config, tokenizer and generation config from ../shared/models (no weights:
the check builds a random-init stand-in of the exact shape), Qwen3-4B's config (models/qwen3-4b) with the Qwen3
tokenizer (../shared/models/qwen3; step_qwen3 builds that model on the card), 1,500 MATH problems from
../shared/data (prompt text), and with --wheels the transformers wheel pacs.py needs (>= 5.24; the GPU machine has
5.17) and peft's (requirements.txt's pin), downloaded for the machine's Python 3.12.
"""
import argparse
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(ROOT, "..", "shared")
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
QWEN3_FILES = ("config.json", "generation_config.json")  # models/qwen3-4b's: the architecture step_qwen3 builds


def pinned(name):
    """requirements.txt's pin of a package ('peft==0.21.2'): the check carries the version the project pins."""
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        pins = [line.split("#")[0].strip() for line in f if re.match(rf"{name}\s*==", line)]
    if not pins:
        die(f"requirements.txt pins no {name}== (the check carries the pinned version)")
    return pins[0].replace(" ", "")


# What the GPU machine lacks, as wheels for its Python (3.12, x86-64): transformers 5.24 (the machine has 5.17;
# pacs.py passes `cache=`) and peft as requirements.txt pins it (--lora-rank; the machine has none). Their other
# needs are there at versions they accept (huggingface-hub 1.33, tokenizers 0.23.2, safetensors 0.8.0, accelerate
# 1.15, psutil, and regex, typer, tqdm, numpy, pyyaml, packaging).
WHEELS = ("transformers==5.24.0", pinned("peft"))
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
CARRY_LIMIT = 64 * 2 ** 20  # what travels to the GPU machine: the working tree and the folders named, together


def die(message):
    sys.exit(f"gpu_check.py: error: {message}")


def folder_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def prepare(dest, model_dir, data_dir, wheels, qwen3_dir, problems=1500):
    """dest/model (config, tokenizer, generation config), dest/qwen3-4b (models/qwen3-4b's config and generation
    config, qwen3_dir's tokenizer, its tokenizer.json gzipped: 2 of 11 MB), dest/data/math_train.jsonl (the first
    `problems` MATH problems: prompt text), and with wheels dest/wheels/*.whl; prints what would travel."""
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        die(f"no config.json in {model_dir} (the Qwen2.5-0.5B-Instruct files: ../shared/models/README.md)")
    if not os.path.isfile(os.path.join(qwen3_dir, "tokenizer.json")):
        die(f"no tokenizer.json in {qwen3_dir} (the Qwen3 tokenizer: ../shared/models/README.md)")
    os.makedirs(os.path.join(dest, "model"), exist_ok=True)
    for name in MODEL_FILES:
        shutil.copyfile(os.path.join(model_dir, name), os.path.join(dest, "model", name))
    qwen3 = os.path.join(dest, "qwen3-4b")
    os.makedirs(qwen3, exist_ok=True)
    for name in QWEN3_FILES:
        shutil.copyfile(os.path.join(ROOT, "models", "qwen3-4b", name), os.path.join(qwen3, name))
    shutil.copyfile(os.path.join(qwen3_dir, "tokenizer_config.json"), os.path.join(qwen3, "tokenizer_config.json"))
    with open(os.path.join(qwen3_dir, "tokenizer.json"), "rb") as f, \
            gzip.GzipFile(os.path.join(qwen3, "tokenizer.json.gz"), "wb", mtime=0) as g:  # gpu_step.py unpacks it
        shutil.copyfileobj(f, g)
    os.makedirs(os.path.join(dest, "data"), exist_ok=True)
    source = os.path.join(data_dir, "math_train.jsonl")
    with open(os.path.join(dest, "data", "math_train.jsonl"), "w") as out:
        if os.path.isfile(source):  # else gpu_step.py falls back to synthetic text
            with open(source) as f:
                for _, line in zip(range(problems), f):
                    row = json.loads(line)
                    out.write(json.dumps({k: row[k] for k in ("id", "problem", "answer")}) + "\n")
    source = os.path.join(data_dir, "math500.jsonl")  # the held-out set of the README's commands end to end
    if os.path.isfile(source):
        shutil.copyfile(source, os.path.join(dest, "data", "math500.jsonl"))
    if wheels:
        folder = os.path.join(dest, "wheels")
        shutil.rmtree(folder, ignore_errors=True)  # one version of each: two stop the install there
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
               "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)], "-d", folder, *WHEELS]
        if subprocess.run(cmd).returncode:
            die("pip download failed (the registry must be reachable from here; the GPU machine has none)")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True).stdout
    tree = sum(os.path.getsize(os.path.join(ROOT, f)) for f in tracked.split("\0") if f and os.path.isfile(
        os.path.join(ROOT, f)))
    carried = folder_bytes(dest)
    print(f"{dest}: {carried / 2 ** 20:.1f} MiB ({', '.join(sorted(os.listdir(dest)))}); with the tracked tree "
          f"({tree / 2 ** 20:.1f} MiB): {(tree + carried) / 2 ** 20:.1f} of the {CARRY_LIMIT // 2 ** 20} MiB that "
          "travel to the GPU machine (untracked files count too)")
    if tree + carried > CARRY_LIMIT:
        die("over the limit: send less")


def build(out, model_dir, tiny):
    """The random-init stand-in (save_pretrained dir), built once for every step of the check."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_step
    t0 = time.time()
    gpu_step.build_standin(model_dir, out, tiny)
    print(f"stand-in built in {out} in {time.time() - t0:.1f} s ({folder_bytes(out) / 2 ** 30:.2f} GiB)")


# What pacs.py and this check call on the GPU road that the CPU road never reaches, by dotted name: checked for
# presence in the installed torch and transformers, so that a release that lacks one fails in the probe (and in
# the rehearsal on a CPU, under the GPU machine's versions) before the steps run.
APIS = ("torch.cuda.mem_get_info", "torch.cuda.memory_reserved", "torch.cuda.set_per_process_memory_fraction",
        "torch.cuda.max_memory_allocated", "torch.cuda.max_memory_reserved", "torch.cuda.reset_peak_memory_stats",
        "torch.cuda.memory_stats", "torch.cuda.memory_snapshot", "torch._C._accelerator_setAllocatorSettings",
        "torch.cuda.get_rng_state_all", "torch.cuda.init", "torch.backends.cuda.enable_math_sdp",
        "torch.backends.cuda.enable_cudnn_sdp", "torch.nn.attention.sdpa_kernel",
        "torch.nn.attention.SDPBackend.FLASH_ATTENTION", "torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION",
        "torch.OutOfMemoryError", "torch.nn.utils.clip_grads_with_norm_",
        "transformers.modeling_outputs.BaseModelOutputWithPast.cache",
        "transformers.DynamicCache.batch_repeat_interleave",
        "transformers.PreTrainedModel.activation_checkpointing_enable",
        "transformers.PreTrainedModel.set_attn_implementation",
        "torch.nn.attention.flex_attention.flex_attention",  # --static-cache flex
        "torch.nn.attention.flex_attention.BlockMask.from_kv_blocks",
        "peft.LoraConfig", "peft.get_peft_model", "peft.PeftModel.from_pretrained",  # --lora-rank (the wheel)
        "peft.get_peft_model_state_dict", "peft.set_peft_model_state_dict")


def missing_apis():
    """The names of APIS the installed releases lack."""
    import importlib
    missing = []
    for name in APIS:
        parts = name.split(".")
        for i in range(len(parts) - 1, 0, -1):  # the longest importable prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:i]))
                break
            except ImportError:
                continue
        else:  # not even its package imports (peft without its wheel)
            missing.append(name)
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            missing.append(name)
    return missing


def sdpa_probe(device):
    """Each SDPA kernel on a batch with left padding, where the padding's query rows attend to no key (as in generate's
    prefill and the trainer's prompts): whether it runs, whether those rows and the others come out finite, and which
    kernel SDPA picks by itself, without and with requires_grad (torch._fused_sdp_choice, where it exists)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(2, 14, 16, 64, generator=g).to(device, dtype) for _ in range(3))
    mask = torch.ones(16, 16, dtype=torch.bool, device=device).tril().expand(2, 1, 16, 16).clone()
    mask[0, :, :, :5] = False  # row 0: 5 tokens of left padding; its queries 0..4 see no key at all
    out = {}
    for name in ("MATH", "EFFICIENT_ATTENTION", "FLASH_ATTENTION", "CUDNN_ATTENTION"):
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            continue
        try:
            with sdpa_kernel([backend]):
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            out[name] = {"runs": True, "padding_rows_finite": bool(torch.isfinite(o[0, :, :5]).all()),
                         "padding_rows_zero": bool((o[0, :, :5] == 0).all()),
                         "other_rows_finite": bool(torch.isfinite(o[:, :, 5:]).all())}
        except RuntimeError as e:
            out[name] = {"runs": False, "why": (str(e).strip().splitlines() or ["?"])[0][:200]}
    choice = getattr(torch, "_fused_sdp_choice", None)
    if choice is not None:
        names = {int(b): name for name, b in SDPBackend.__members__.items()}
        for grad in (False, True):
            qq, kk, vv = (t.detach().requires_grad_(grad) for t in (q, k, v))
            try:
                out[f"picked{'_with_grad' if grad else ''}"] = names.get(int(choice(qq, kk, vv, mask)), "?")
            except Exception as e:  # noqa: BLE001 (a private call: its answer is information only)
                out[f"picked{'_with_grad' if grad else ''}"] = f"? ({type(e).__name__})"
    return out


def probe(path, device_name):
    """Versions, the card, SDPA's kernels on padded rows, and the allocator settings pacs.py makes."""
    sys.path.insert(0, ROOT)
    import torch
    import transformers
    import pacs
    import plumbing
    cfg = pacs.Config(device=device_name, prompts_per_step=1, group_size=2, max_new_tokens=1)
    try:
        import peft
        peft_version, peft_file = peft.__version__, peft.__file__
    except ImportError:
        peft_version = peft_file = None
    result = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
              "transformers": transformers.__version__, "transformers_file": transformers.__file__,
              "peft": peft_version, "peft_file": peft_file, "missing_apis": missing_apis()}
    try:
        device = plumbing.pick_device(cfg)  # on CUDA: sets the allocator's expandable segments, as pacs.py does
    except plumbing.ConfigError as e:
        result["error"] = str(e)
        device = None
    if device is not None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info()
        result.update({"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
                       "total_gib": total / plumbing.GiB, "free_gib": free / plumbing.GiB,
                       "plan_memory_gib": plumbing.device_memory("cuda") / plumbing.GiB,
                       "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")})
        x = torch.empty(2 ** 20, device=device)  # one allocation, then the allocator's own word on its segments
        result["expandable_segments"] = any(s.get("is_expandable", False) for s in torch.cuda.memory_snapshot())
        del x
        smi = shutil.which("nvidia-smi")
        if smi:
            q = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total,memory.used",
                                "--format=csv,noheader"], capture_output=True, text=True)
            result["nvidia_smi"] = q.stdout.strip()
    elif device is not None:
        result["device"] = "cpu"
    if device is not None:
        result["sdpa"] = sdpa_probe(device)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    if "error" in result:
        die(result["error"])
    if result["missing_apis"]:
        die(f"the installed releases lack {', '.join(result['missing_apis'])}")


def lab(path, device_name, extra):
    """benchmarks/lab_step.py on device_name and on one CPU core (two processes, the same flags): the lab's step
    time per phase on each, into one JSON."""
    result = {}
    for arm, args in (("device", ["--device", device_name]), ("cpu_1_core", ["--device", "cpu", "--threads", "1"])):
        tmp = f"{path}.{arm}.tmp"
        env = {**os.environ, **({"OMP_NUM_THREADS": "1"} if arm == "cpu_1_core" else {})}
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "lab_step.py"), "--lab",
                               os.path.join(ROOT, "experiments", "labs", "lab", "base"), *args, *extra, "--json", tmp],
                              env=env)
        if proc.returncode or not os.path.isfile(tmp):
            result[arm] = {"error": f"lab_step.py exited {proc.returncode}"}
            continue
        with open(tmp) as f:
            result[arm] = json.load(f)
        os.remove(tmp)
    if all("step_time" in result.get(a, {}) for a in ("device", "cpu_1_core")):
        result["speedup"] = result["cpu_1_core"]["step_time"] / result["device"]["step_time"]
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


# ---- the summary table --------------------------------------------------------------------------------------
def _num(value, spec):
    return "-" if value is None else format(value, spec)


def step_status(out):
    """{step: its line in check.log} ('exit 1 after 12 s', 'skipped, 15 s left of 470', ...), from gpu_check.sh."""
    path, status = os.path.join(out, "check.log"), {}
    if os.path.isfile(path):
        with open(path, errors="replace") as f:
            for line in f:
                m = re.match(r"== (\w+): (exit .*|skipped.*)", line)
                if m:
                    status[m.group(1)] = m.group(2).strip()
    return status


def summary_rows(out):
    """(what, result) rows of the table, from the JSON files the steps wrote into out; a step without its JSON gives
    its line of check.log (its exit status, or that it was skipped), or 'did not run'."""
    status = step_status(out)
    missing = {}

    def load(name):
        path = os.path.join(out, f"{name}.json")
        if not os.path.isfile(path):
            missing[name] = f"no result: {status.get(name, 'did not run')} (check.log)"
            return None
        with open(path) as f:
            return json.load(f)

    rows = []
    p = load("probe")
    if p is None:
        rows.append(("probe", missing["probe"]))
    else:
        rows.append(("device", f"{p.get('device', '?')}; torch {p.get('torch')}, "
                               f"transformers {p.get('transformers')}, peft {p.get('peft')}"))
        if "error" in p:
            rows.append(("probe", f"error: {p['error']}"))
        rows.append(("APIs of the GPU road", "all present" if not p.get("missing_apis") else
                     f"MISSING: {', '.join(p['missing_apis'])}"))
        sdpa = p.get("sdpa", {})
        kernels = [f"{k}: {'NaN' if not v.get('padding_rows_finite', True) else 'ok'}" if v.get("runs") else f"{k}: -"
                   for k, v in sdpa.items() if isinstance(v, dict)]
        rows.append(("SDPA on padding rows", "; ".join(kernels) + f" | picked {sdpa.get('picked', '?')}, with grad "
                     f"{sdpa.get('picked_with_grad', '?')}"))
        if "expandable_segments" in p:
            rows.append(("allocator", f"{p.get('alloc_conf')}; expandable segments in effect: "
                                      f"{p['expandable_segments']}; plan reads {_num(p.get('plan_memory_gib'), '.1f')}"
                                      f" of {_num(p.get('total_gib'), '.1f')} GiB"))
    for name, what in PSI_STEPS:
        r = load(name)
        if r is None:
            rows.append((what, "FAIL: " + missing[name]))
        elif "error" in r:
            rows.append((what, f"FAIL: {r['error']}"))
        else:
            ok = "pass" if "psi_std_max" in r and r["psi_std_max"] == 0 else "FAIL"  # missing psi: FAIL
            rows.append((what, f"{ok}: psi_std {r.get('psi_std_max')} (prompts {r.get('varied_prompts')}.."
                               f"{r.get('prompt_tokens')} tokens, micro-batch {r.get('micro_batch_size')} rows)"))
    steps = {}
    for name, what in (("step_default", "default step, the defaults"),
                       ("step_dynamic", "default step, --static-cache off --verify-workers 1"),
                       ("step_opt", "default step, every opt-in lever (flex, compiled head and layers, gumbel, "
                                    "deferred stop)"),
                       ("step_off", "default step, every lever off (--pack-groups, --full-rows, --static-cache off, "
                                    "--verify-workers 1)"),
                       ("step_flex", "default step, --static-cache flex"),
                       ("step_defer", "default step, --defer-stop-check"),
                       ("step_shared", "default step, one group per micro-batch, shared prompt"),
                       ("step_22g", "--memory-gib 22.5, the defaults"),
                       ("step_22g_ckpt", "--memory-gib 22.5, --gradient-checkpointing"),
                       ("step_qwen3", QWEN3_STEP)):
        r = steps[name] = load(name)
        if r is None:
            rows.append((what, "FAIL: " + missing[name]))
            continue
        if "error" in r:
            rows.append((what, f"FAIL: {r['error']}"))
            continue
        rows.append((f"{what}: time", f"step {r['step_s']:.1f} s = generate {r['generate_s']:.1f} + verify "
                                      f"{r['verify_s']:.1f} + old log-probs {r['old_logprobs_s']:.1f} + updates "
                                      f"{r['update_s']:.1f}; decode {_num(r.get('decode_ms_per_token'), '.1f')} ms "
                                      f"a token; updates {_num(r.get('update_mfu') and 100 * r['update_mfu'], '.1f')}"
                                      f"% "
                                      f"of the card; compile: decode step {_num(r.get('compile_s'), '.0f')} s, "
                                      f"log-prob forwards {_num(r.get('compile_update_s'), '.0f')} s"))
        over = [ph for ph in ("generate", "update") if r[f"{ph}_over_plan"] > 1]
        rows.append((f"{what}: peaks", ("FAIL: over the plan" if over else "within the plan")
                     + f": generate {r['generate_peak_gib']:.2f} GiB (plan {r['plan_generate_gib']:.2f}, "
                       f"x{r['generate_over_plan']:.3f}), update {r['update_peak_gib']:.2f} GiB (plan "
                       f"{r['plan_update_gib']:.2f}, x{r['update_over_plan']:.3f}); micro-batch "
                       f"{r['micro_batch_size']} rows, {r['gen_batch_prompts']} prompts per generate call"))
    rows += qwen3_rows(steps.get("step_qwen3"))
    phases = {"step": "step_s", "generate": "generate_s", "verify": "verify_s", "old log-probs": "old_logprobs_s",
              "updates": "update_s"}

    def speed_up(slow, fast, *names):  # slow's time over fast's for each phase named, where both steps ran
        slow, fast = steps.get(slow), steps.get(fast)
        if slow and fast and "error" not in slow and "error" not in fast:
            return " | ".join(f"{name} x{slow[phases[name]] / fast[phases[name]]:.2f}" if fast[phases[name]]
                              else f"{name} -" for name in names)
    ratios = speed_up("step_shared", "step_default", *phases)
    if ratios:
        rows.append(("--pack-groups, --full-rows: speed-up (same card, same call)", ratios))
    ratios = speed_up("step_22g", "step_22g_ckpt", "step", "old log-probs", "updates")
    if ratios:
        rows.append(("--memory-gib 22.5: --gradient-checkpointing's speed-up (same card, same call)", ratios))
    ratios = speed_up("step_dynamic", "step_default", "step", "generate", "verify")
    if ratios:
        rows.append(("--static-cache, --verify-workers: speed-up (same card, same call)",
                     f"{ratios} ({steps['step_default'].get('verify_processes')} processes)"))
    ratios = speed_up("step_default", "step_opt", *phases)
    if ratios:
        rows.append(("the opt-in levers together: speed-up over the defaults (same card, same call)", ratios))
    for lever, name in (("--static-cache flex", "step_flex"), ("--defer-stop-check", "step_defer")):
        ratios = speed_up("step_default", name, "step", "generate")
        if ratios:
            rows.append((f"{lever}: speed-up over the defaults (same card, same call)", ratios))
    rows += target_rows(steps, rows)
    attn, forms = load("attn"), load("forms")
    rows += lever_rows(steps, attn, forms)
    if attn and "error" not in attn:  # one decode step's attention (x layers) and sampling, in each form
        rows.append(("decode forms: a step's attention | sampling, ms", " | ".join(
            f"{k} {v['ms_a_step' if 'ms_a_step' in v else 'ms']:.2f}" if "ms" in v else
            f"{k} skipped" if "skipped" in v else f"{k} FAIL"
            for k, v in attn.get("forms", {}).items())))
    decode = load("decode")
    if decode and "error" not in decode:
        runs = decode.get("profiles", {})
        rows.append(("decode: ms a step (prefill included), first call", " | ".join(
            f"{k[7:]} {v['ms_per_token']:.1f} ms, {v['first_call_s']:.1f} s" for k, v in runs.items()) or "none"))
    if forms and "error" not in forms:  # one mini-batch in each form: each lever's own ratio on the update
        f = forms.get("forms", {})
        rows.append(("update forms: one mini-batch forward + backward (forward)", " | ".join(
            f"{k} {1e3 * v['fwd_bwd_s']:.0f} ms ({1e3 * v['fwd_s']:.0f})" if "fwd_bwd_s" in v else f"{k} FAIL"
            for k, v in f.items())))
        for lever, fast, slow in (("--compile-layers", "layersc", "full"), ("--compile-head", "headc", "head")):
            for name, eager_name in form_pairs(f, slow, fast):  # the compiled form against the eager one
                v, eager = f[name], f[eager_name]
                rows.append((f"{lever}: speed-up on one mini-batch ({name} against {eager_name})",
                             f"forward + backward x{eager['fwd_bwd_s'] / v['fwd_bwd_s']:.2f}, forward "
                             f"x{eager['fwd_s'] / v['fwd_s']:.2f}; compile and first call "
                             f"{v['fwd_bwd_first_s']:.0f} s"))
    for name in ("e2e_train", "e2e_resume", "e2e_eval"):
        line = status.get(name, "did not run")
        rows.append((f"README end to end: {name[4:]}", ("pass: " if line.startswith("exit 0") else "FAIL: ") + line))
    e2e = os.path.join(out, "e2e_metrics.jsonl")
    if os.path.isfile(e2e):
        with open(e2e) as f:
            for m in (json.loads(line) for line in f if line.strip()):
                rows.append((f"README end to end: step {m['step']}",
                             f"step {m['step_time']:.1f} s, eval {_num(m.get('time_eval'), '.1f')} s, checkpoint "
                             f"before it {_num(m.get('time_save'), '.1f')} s"))
    p = load("profile")
    if p is not None:
        busy = lambda v: _num(v["busy_share"] and 100 * v["busy_share"], ".0f")
        phases = "; ".join(f"{k[5:]} {v['wall_s']:.2f} s, device busy {busy(v)}%"
                           for k, v in p.get("phases", {}).items())
        top = ", ".join(f"{k['name'][:40]} {100 * k['share']:.0f}%" for k in p.get("kernels", [])[:3])
        rows.append(("profile", f"{phases} | top: {top}"))
    return rows


PSI_STEPS = (("psi_levers", "psi_std at --lr 0, every lever on"),
             ("psi_ckpt", "psi_std at --lr 0, every lever on, --gradient-checkpointing"),
             ("psi_lora", "psi_std at --lr 0, LoRA rank 16, its B drawn at random"))
QWEN3_STEP = "Qwen3-4B stand-in, v2's prompt, LoRA rank 16"


def qwen3_rows(r):
    """step_qwen3's rows beside its time and peaks: the model built on the card, psi at its --lr 0, and each step
    extrapolated from it (the arithmetic in its JSON and check.log)."""
    if not r or "error" in r:
        return []
    rows = [(f"{QWEN3_STEP}: the build", f"{r['params'] / 1e9:.2f}B parameters ({r.get('layers')} layers, vocab "
                                          f"{r.get('vocab')}) built on {r.get('built_on')} in "
                                          f"{_num(r.get('build_s'), '.1f')} s; prompt {r.get('prompt')}, peft "
                                          f"{r.get('peft')}"),
            (f"{QWEN3_STEP}: psi_std at --lr {_num(r.get('lr'), 'g')}",
             ("pass" if r.get("psi_std_max") == 0 else "FAIL") + f": psi_std {r.get('psi_std_max')} (its adapter's B "
                                                                 "drawn at random)")]
    for e in r.get("extrapolated", []):
        rows.append((f"{QWEN3_STEP}: a step at {e['target']}, extrapolated", e.get("error") or (
            f"{e['step_s']:.0f} s ({e['step_s'] / 3600:.2f} h) = generate {e['generate_s']:.0f} + verify "
            f"{e['verify_s']:.0f} + old log-probs {e['old_logprobs_s']:.0f} + updates {e['update_s']:.0f}; "
            f"{e['gen_batch_prompts']} prompts a generate call, micro-batch {e['micro_batch_size']} rows "
            "(the arithmetic: check.log)")))
    return rows


def form_pairs(forms, slow, fast):
    """[(compiled form, eager form)]: forms.json's forms `fast` timed beside `slow` at as many rows (layersc-32 and
    full-32), both with a forward + backward."""
    return [(name, f"{slow}-{name.rsplit('-', 1)[1]}") for name, v in forms.items()
            if name.rsplit("-", 1)[0] == fast and "fwd_bwd_s" in v
            and "fwd_bwd_s" in forms.get(f"{slow}-{name.rsplit('-', 1)[1]}", {})]


TARGETS = {"step": 2.5, "update_share": 0.30, "decode_ms": 10.0, "small_card": 2.0}  # docs/gpu-check.md's
LEVER_BAR, LEVER_MARGIN = 1.10, 0.05  # an opt-in lever stays at 1.10x on its phase in one call; within 5%: undecided


def lever_verdict(ratio):
    """An opt-in lever's fate by its same-call ratio: kept at LEVER_BAR or more, removed below it, and left opt-in,
    undecided, where the ratio falls within LEVER_MARGIN of the bar (one timed step is one sample)."""
    if ratio >= round(LEVER_BAR * (1 + LEVER_MARGIN), 4):  # x1.155
        return f"keep (x{ratio:.2f} >= x{LEVER_BAR:.2f}; a CUDA default where exact)"
    if ratio < round(LEVER_BAR / (1 + LEVER_MARGIN), 4):  # x1.0476
        return f"remove (x{ratio:.2f} < x{LEVER_BAR:.2f})"
    return f"undecided (x{ratio:.2f}, within {100 * LEVER_MARGIN:.0f}% of x{LEVER_BAR:.2f}): stays opt-in"


def lever_rows(steps, attn, forms):
    """A row per opt-in lever: its verdict (lever_verdict) from its own same-call A/B, or 'not measured' and the
    step it needs. --static-cache flex and --defer-stop-check: generate against step_default's; --sampler gumbel: a
    decode step's sampling (attn); --compile-head, --compile-layers: one mini-batch's forward + backward (forms)."""
    ran = {k: v for k, v in steps.items() if v and "error" not in v}
    a = attn.get("forms", {}) if attn and "error" not in attn else {}
    f = forms.get("forms", {}) if forms and "error" not in forms else {}
    def form_pair(slow, fast):  # (eager s, compiled s) of one mini-batch's forward + backward, the first size timed
        pairs = form_pairs(f, slow, fast)
        return (f[pairs[0][1]]["fwd_bwd_s"], f[pairs[0][0]]["fwd_bwd_s"]) if pairs else (None, None)
    pairs = {"--static-cache flex": ("generate", ran.get("step_default", {}).get("generate_s"),
                                     ran.get("step_flex", {}).get("generate_s"), "step_default and step_flex"),
             "--defer-stop-check": ("generate", ran.get("step_default", {}).get("generate_s"),
                                    ran.get("step_defer", {}).get("generate_s"), "step_default and step_defer"),
             "--sampler gumbel": ("a decode step's sampling", a.get("sample-hf", {}).get("ms"),
                                  a.get("sample-gumbel", {}).get("ms"), "attn"),
             "--compile-layers": ("one mini-batch's update", *form_pair("full", "layersc"), "forms (full, layersc)"),
             "--compile-head": ("one mini-batch's LM head", *form_pair("head", "headc"), "forms (head, headc)")}
    return [(f"lever {lever}: {phase}, same call", lever_verdict(slow / fast) if slow and fast
             else f"not measured: needs {needs}") for lever, (phase, slow, fast, needs) in pairs.items()]


def target_rows(steps, rows):
    """One row per target of docs/gpu-check.md, read from this call's steps: 'met' or 'short' with its numbers, or
    'not measured' and the steps it needs. The step's target is against every lever off (step_off); the 22.5 GiB one is
    --gradient-checkpointing against that card's defaults (step_22g)."""
    ran = {k: v for k, v in steps.items() if v and "error" not in v}

    def row(what, measured, ok, numbers, needs):
        return what, (("met: " if ok else "short: ") + numbers) if measured else f"not measured: needs {needs}"
    speed = [(ran["step_off"]["step_s"] / ran[k]["step_s"], k) for k in ("step_default", "step_opt")
             if "step_off" in ran and k in ran]
    shares = [(ran[k]["update_mfu"], k) for k in ("step_default", "step_opt") if ran.get(k, {}).get("update_mfu")]
    decode = [(ran[k]["decode_ms_per_token"], k) for k in ("step_default", "step_opt", "step_flex")
              if ran.get(k, {}).get("decode_ms_per_token")]
    small = ran["step_22g"]["step_s"] / ran["step_22g_ckpt"]["step_s"] if {"step_22g", "step_22g_ckpt"} <= set(ran) \
        else None
    psi = {name: v for name, what in PSI_STEPS for k, v in rows if k == what}
    return [
        row(f"target: the default step x{TARGETS['step']} faster than every lever off (same call)", bool(speed),
            speed and max(speed)[0] >= TARGETS["step"], ", ".join(f"{k} x{r:.2f}" for r, k in speed),
            "step_off, and step_default or step_opt"),
        row(f"target: updates at {100 * TARGETS['update_share']:.0f}% of the card or more", bool(shares),
            shares and max(shares)[0] >= TARGETS["update_share"], ", ".join(f"{k} {100 * v:.1f}%" for v, k in shares),
            "step_default or step_opt on a card of known peak"),
        row(f"target: a decode step in {TARGETS['decode_ms']:.0f} ms or less (the default step's rows)", bool(decode),
            decode and min(decode)[0] <= TARGETS["decode_ms"], ", ".join(
                f"{k} {v:.1f} ms ({ran[k]['gen_batch_prompts']} prompts a call)" for v, k in decode),
            "step_default, step_opt or step_flex"),
        row(f"target: --memory-gib 22.5 x{TARGETS['small_card']:.0f} faster (step_22g over step_22g_ckpt)",
            small is not None, small is not None and small >= TARGETS["small_card"], f"x{small or 0:.2f}",
            "step_22g and step_22g_ckpt"),
        row("target: psi exactly 0 at --lr 0 on every route", bool(psi),
            psi and all(v.startswith("pass") for v in psi.values()),
            ", ".join(f"{name} {v.split(':')[0]}" for name, v in psi.items()), "psi_levers, psi_ckpt and psi_lora"),
    ]


def summary(out):
    """summary.md (the table) and results.json (every step's JSON, and check.log's status lines, in one file)."""
    rows = summary_rows(out)
    bundle = {"status": step_status(out)}
    for name in sorted(os.listdir(out)):
        if name.endswith(".json") and name != "results.json":
            with open(os.path.join(out, name)) as f:
                try:
                    bundle[name[:-5]] = json.load(f)
                except ValueError:
                    bundle[name[:-5]] = {"error": "not valid JSON"}
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(bundle, f, indent=1)
    width = max(len(w) for w, _ in rows)
    text = "\n".join([f"| {'check'.ljust(width)} | result |", f"|{'-' * (width + 2)}|---|"]
                     + [f"| {w.ljust(width)} | {v} |" for w, v in rows])
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text + "\n")
    print(text)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="fill .gpu/ (here, before the GPU machine is lent)")
    p.add_argument("--dest", default=os.path.join(ROOT, ".gpu"))
    p.add_argument("--model-dir", default=os.path.join(SHARED, "models", "qwen2.5-0.5b-instruct"))
    p.add_argument("--qwen3-dir", default=os.path.join(SHARED, "models", "qwen3"), help="the Qwen3 tokenizer")
    p.add_argument("--data-dir", default=os.path.join(SHARED, "data"))
    p.add_argument("--wheels", action="store_true", help="also download the wheels (needs the package registry)")
    p = sub.add_parser("probe", help="versions, card, SDPA kernels, allocator: one JSON")
    p.add_argument("json")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p = sub.add_parser("build", help="the random-init stand-in")
    p.add_argument("out")
    p.add_argument("--model-dir", default=os.path.join(ROOT, ".gpu", "model"))
    p.add_argument("--tiny", action="store_true")
    p = sub.add_parser("lab", help="the lab's step on the device and on one CPU core: one JSON")
    p.add_argument("json")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p = sub.add_parser("summary", help="the table of the JSON files in a folder")
    p.add_argument("out")
    args, rest = ap.parse_known_args(argv)
    if rest and args.cmd != "lab":
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "prepare":
        prepare(args.dest, args.model_dir, args.data_dir, args.wheels, args.qwen3_dir)
    elif args.cmd == "probe":
        probe(args.json, args.device)
    elif args.cmd == "build":
        build(args.out, args.model_dir, args.tiny)
    elif args.cmd == "lab":
        lab(args.json, args.device, rest)
    else:
        summary(args.out)


if __name__ == "__main__":
    main()
