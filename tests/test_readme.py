"""The README keeps its word: its size, the flags it shows, the code it points at, and the snippet it runs.
(Its links and anchors: tests/test_docs.py.)"""
import ast
import contextlib
import functools
import io
import os
import re
import runpy
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_BYTES = 24_000
README_WORDS = 1_500  # a ten-minute read; the guides live in docs/, the evidence in experiments/
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")  # --num-mini-batches, --no_balance
SCRIPT = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.py)\b")  # pacs.py, benchmarks/vs_trl.py


def readme_text():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return re.sub(r"<!--.*?-->", "", f.read(), flags=re.S)  # a comment shows nothing


def is_script(path):
    """A file the README can run: it exists and has a __main__ block (tests/*.py and modules do not count)."""
    full = os.path.join(ROOT, path)
    return os.path.isfile(full) and "__name__ == \"__main__\"" in open(full, encoding="utf-8").read()


def shown_flags(text):
    """[(flag, scripts it may belong to, where)] for every --flag the README shows outside ```python blocks.
    In a command (`python X.py ...`, in a code block or an inline span), a flag belongs to X. A flag in a bare
    inline span belongs to a script the same paragraph (or table) names, or to pacs.py when it names none."""
    out = []
    blocks = re.split(r"(```\w*\n.*?```)", text, flags=re.S)
    for block in blocks:
        if block.startswith("```python"):
            continue
        if block.startswith("```"):
            commands, paragraphs = [block], []
        else:  # an inline span may wrap onto the next line of its paragraph
            paragraphs = re.split(r"\n\s*\n", block)
            commands = [" ".join(span.split()) for para in paragraphs for span in re.findall(r"`([^`]+)`", para)]
        for cmd in commands:
            cmd = re.sub(r"\\\n", " ", cmd)
            for segment in re.split(r"&&|;|\||\n|(?<!-)&", cmd):
                segment = segment.split(" #")[0]  # a shell comment
                m = re.search(r"\bpython3?\s+(\S+\.py)\b(.*)", segment)
                if m:
                    out += [(f, [m.group(1)], segment.strip()) for f in FLAG.findall(m.group(2))]
        for para in paragraphs:
            scripts = list(dict.fromkeys(s for s in SCRIPT.findall(para) if is_script(s))) or ["pacs.py"]
            for span in re.findall(r"`([^`]+)`", para):
                if not re.search(r"\bpython3?\s+\S+\.py", span) and span.lstrip().startswith("--"):
                    out += [(f, scripts, span) for f in FLAG.findall(span)]
    return out


@functools.lru_cache(maxsize=None)
def help_text(script):
    """What `python SCRIPT --help` prints, run in this process (the imports are already paid for), or None when
    the script imports a package that is not installed (TRL for examples/). A script whose help says that other
    arguments are pacs.py flags (benchmarks/gpu_step.py) also answers with pacs.py's."""
    path = os.path.join(ROOT, script)
    argv, sys_path, out = sys.argv[:], sys.path[:], io.StringIO()
    try:
        sys.argv = [path, "--help"]
        sys.path.insert(0, os.path.dirname(path))  # as `python SCRIPT` does: its folder's modules import
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
            runpy.run_path(path, run_name="__main__")
    except ModuleNotFoundError as e:
        if os.path.exists(os.path.join(os.path.dirname(path), e.name.split(".")[0] + ".py")):
            raise
        return None
    finally:
        sys.argv[:], sys.path[:] = argv, sys_path
    assert exit_.value.code in (0, None), f"{script} --help exited with {exit_.value.code}"
    text = out.getvalue()
    assert "usage:" in text, f"{script} --help printed no usage:\n{text[:500]}"
    if re.search(r"Other arguments are pacs\.py flags", text):
        text += help_text("pacs.py")
    return text


def test_readme_fits_its_budget():
    size = os.path.getsize(os.path.join(ROOT, "README.md"))
    assert size <= README_BYTES, (f"README.md is {size:,} bytes, over its budget of {README_BYTES:,}: "
                                  "move detail to docs/")
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        words = len(f.read().split())  # as `wc -w` counts them, code blocks included
    assert words <= README_WORDS, f"README.md has {words:,} words, over {README_WORDS:,}: move detail to docs/"


def test_every_flag_the_readme_shows_is_in_the_help_of_its_script():
    shown = shown_flags(readme_text())
    assert len(shown) >= 20, f"only {len(shown)} flags found: the README's commands were not parsed"
    missing, unchecked = [], set()
    for flag, scripts, where in shown:
        helps = [help_text(s) for s in scripts]
        if any(h is not None and flag in FLAG.findall(h) for h in helps):
            continue
        if any(h is None for h in helps):
            unchecked.add(f"{flag} ({' or '.join(s for s, h in zip(scripts, helps) if h is None)} "
                          "does not import here)")
        else:
            missing.append(f"{flag} (in `{where}`: not in the --help of {' or '.join(scripts)})")
    assert not missing, "README shows flags its scripts do not have:\n" + "\n".join(sorted(set(missing)))
    if unchecked:
        pytest.skip(f"every other flag is in its script's --help; unchecked: {sorted(unchecked)}")


def test_the_flag_parser_attributes_flags_to_their_script():
    """The attribution rules above, on a made-up page (a flag in the wrong script must not pass as pacs.py's)."""
    page = ("```bash\npython eval.py --n 16 --k 1,2 \\\n    --out x   # --not-a-flag\npip install --no-deps y\n```\n\n"
            "Run `benchmarks/vs_trl.py` with `--rounds 2`.\n\nThe `--lr` flag.\n\n"
            "`python experiments/trend.py --seeds 0` and\n"
            "`--steps 6`\n")
    got = {(f, tuple(s)) for f, s, _ in shown_flags(page)}
    assert got == {("--n", ("eval.py",)), ("--k", ("eval.py",)), ("--out", ("eval.py",)),
                   ("--rounds", ("benchmarks/vs_trl.py",)), ("--lr", ("pacs.py",)),
                   ("--seeds", ("experiments/trend.py",)), ("--steps", ("experiments/trend.py",))}, got


def pacs_source():
    with open(os.path.join(ROOT, "pacs.py"), encoding="utf-8") as f:
        return f.read()


def pacs_functions():
    """{name: (line, parameter names)} of pacs.py's top-level functions and classes."""
    out = {}
    for node in ast.parse(pacs_source()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            params = ([a.arg for a in node.args.args + node.args.kwonlyargs] if isinstance(node, ast.FunctionDef)
                      else [])
            out[node.name] = (node.lineno, params)
    return out


def paper_to_code_rows():
    text = readme_text()
    start = text.index("## Paper → code")
    section = text[start:text.index("\n## ", start + 1)]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| paper")]
    return [row.strip("|").split(" | ", 1)[1] for row in rows if not set(row) <= set("|- ")]


def test_every_pacs_function_the_paper_to_code_map_names_exists():
    """The map links each function by name to pacs.py (no line anchor, which any edit above it would move) and
    quotes code and signatures that must be pacs.py's."""
    functions, source = pacs_functions(), pacs_source()
    flat = " ".join(source.split())
    rows = paper_to_code_rows()
    assert len(rows) >= 6, rows
    problems, linked = [], set()
    for row in rows:
        for name, anchor in re.findall(r"\[`(\w+)`\]\(pacs\.py(#[^)]*)?\)", row):
            linked.add(name)
            if name not in functions:
                problems.append(f"{name}: no such function in pacs.py")
            if anchor:
                problems.append(f"{name}: linked with {anchor}; link the file, the name finds the function")
        for span in re.findall(r"`([^`]+)`", re.sub(r"\[`\w+`\]\([^)]*\)", "", row)):  # spans outside links
            if span.startswith("--") or span.endswith(".py"):
                continue  # flags: the flag test; files: the link test
            call = re.fullmatch(r"(\w+)\((.*)\)", span)
            if call:
                name, args = call.groups()
                if name not in functions:
                    problems.append(f"{span}: no function {name} in pacs.py")
                else:
                    problems += [f"{span}: {name} has no parameter {kw}" for kw in re.findall(r"(\w+)=", args)
                                 if kw not in functions[name][1]]
            elif re.fullmatch(r"\w+", span):
                if not re.search(rf"\b{span}\b", source):
                    problems.append(f"{span}: not in pacs.py")
            elif " ".join(span.split()) not in flat:
                problems.append(f"`{span}`: this code is not in pacs.py")
    assert len(linked) >= 8, f"the map links only {sorted(linked)}"
    assert not problems, "README's paper → code map:\n" + "\n".join(problems)


def test_the_copying_snippet_runs_and_prints_what_the_readme_says(monkeypatch):
    text = readme_text()
    section = text[text.index("## Copying the loss"):]
    snippet = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    claimed = re.search(r"It prints `loss ([\d.]+)`, then `loss ([\d.]+)`", section).groups()
    monkeypatch.syspath_prepend(ROOT)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(snippet, "README.md (Copying the loss)", "exec"), {"__name__": "readme_snippet"})
    printed = tuple(re.findall(r"loss ([\d.]+)", out.getvalue()))
    assert printed == claimed, f"the snippet prints {printed}, the README says {claimed}"
    assert printed[0] == "0.6931" and printed[1] != printed[0], "at pi_old the loss is ln 2; after an update it is not"


def test_the_quickstart_quotes_its_committed_log_and_shows_the_critic():
    """The quickstart runs M >= 2, so its log's critic columns hold numbers; the lines it quotes are lines of the log
    it links, the only log in experiments/logs/, beside its metrics.jsonl (a new run replaces the old), whose first
    lines name the conditions it ran in (command, commit, CPU, threads, load, wall time); its mean rewards are the
    log's."""
    text = readme_text()
    command = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)
    assert int(re.search(r"--num-mini-batches (\d+)", command).group(1)) >= 2, "M = 1: the critic never acts"
    link = re.search(r"\[every line\]\((experiments/logs/[^)\s]+\.log)\)\)?:\n\n```\n(.*?)```", text, flags=re.S)
    assert link, "the quickstart links no experiments/logs/*.log right above its quoted lines"
    name = os.path.basename(link.group(1))
    assert sorted(os.listdir(os.path.join(ROOT, "experiments", "logs"))) == [name, name[:-4] + ".metrics.jsonl"]
    with open(os.path.join(ROOT, link.group(1)), encoding="utf-8") as f:
        lines = f.read().splitlines()
    conditions, log = [x for x in lines if x.startswith("# ")], [x for x in lines if not x.startswith("# ")]
    for what in ("command:", "commit:", "cpu:", "threads:", "load average:", "wall:"):  # the log's own conditions
        assert any(x.startswith(f"# {what}") for x in conditions), f"the log's first lines do not name its {what}"
    assert len(log) == int(re.search(r"--steps (\d+)", command).group(1)), "the log is not one line per step"
    quoted = [line for line in link.group(2).splitlines() if line != "..."]
    assert quoted and all(line in log for line in quoted), "the README quotes lines its log does not hold"
    assert sum(bool(re.search(r"critic auc \d", line)) for line in log) >= len(log) // 2
    rewards = [float(re.search(r"\| reward ([\d.]+) \|", line).group(1)) for line in log]
    m = re.search(r"Mean reward ([\d.]+) over steps (\d+)–(\d+), ([\d.]+) over (\d+)–(\d+)", text)
    for mean, first, last in (m.group(1, 2, 3), m.group(4, 5, 6)):
        window = rewards[int(first):int(last) + 1]
        assert float(mean) == pytest.approx(sum(window) / len(window), abs=0.0051), (mean, first, last)
