"""The README and docs/ link to each other's sections; a section renamed or moved must not leave a dead link."""
import json
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS, EXPERIMENTS = os.path.join(ROOT, "docs"), os.path.join(ROOT, "experiments")
LABS = os.path.join(EXPERIMENTS, "labs")
PAGES = (["README.md"] + [os.path.join("docs", f) for f in sorted(os.listdir(DOCS)) if f.endswith(".md")]
         + [os.path.join("experiments", f) for f in sorted(os.listdir(EXPERIMENTS)) if f.endswith(".md")]
         + [os.path.join("experiments", "labs", d, "README.md") for d in sorted(os.listdir(LABS))
            if os.path.isfile(os.path.join(LABS, d, "README.md"))]  # the guides, the campaign's pages, each lab's
         + [os.path.join("experiments", "gpu-runs", "README.md")])  # and the GPU calls' history
LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target)


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped (letters, digits, _ and - stay), spaces -> -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path):
    """Every anchor the page defines; a repeated heading gets -1, -2, ... as on GitHub. Code blocks hold none."""
    seen, out, in_code = {}, set(), False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("```"):
                in_code = not in_code
            elif not in_code and re.match(r"#{1,6} ", line):
                s = slug(line.lstrip("#"))
                out.add(s if s not in seen else f"{s}-{seen[s]}")
                seen[s] = seen.get(s, 0) + 1
    return out


def line_anchor_exists(path, anchor):
    """#L12 on a source file is GitHub's link to its line 12 (which line it must be: tests/test_readme.py)."""
    m = re.fullmatch(r"L(\d+)", anchor)
    with open(path, encoding="utf-8") as f:
        return bool(m) and 1 <= int(m.group(1)) <= sum(1 for _ in f)


def test_slug_matches_githubs_rule():
    assert (slug(" The same sweep with M = 2: the critic switched on")
            == "the-same-sweep-with-m--2-the-critic-switched-on")
    assert slug(" The verifier (`verify.py`)") == "the-verifier-verifypy"
    assert slug(" Paper → code") == "paper--code"


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_and_anchor_resolves(page):
    path = os.path.join(ROOT, page)
    text = open(path, encoding="utf-8").read()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # links inside code blocks are not links
    dead = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://", target):
            continue  # the web: not checked offline
        file, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(dest):
            dead.append(f"{target} (no file {os.path.relpath(dest, ROOT)})")
        elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
            dead.append(f"{target} (no heading with anchor #{anchor})")
        elif anchor and not dest.endswith(".md") and not line_anchor_exists(dest, anchor):
            dead.append(f"{target} (#{anchor} is not a line of {os.path.relpath(dest, ROOT)}: use #L<n>)")
    assert not dead, f"{page}: dead links: {dead}"


def test_the_file_tables_line_counts_are_current():
    """The README's file table gives each file's line count (`wc -l`); a folder's count is the sum over its *.py."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    table = readme[readme.index("| file | lines |"):].split("\n\n")[0]  # the table ends at the first blank line
    rows = re.findall(r"^\| `([^`]+)` \| ([\d,]+) \|", table, flags=re.M)
    assert len(rows) >= 4, rows

    def lines(path):
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            return sum(1 for _ in f)

    for name, stated in rows:
        if name.endswith("/"):
            got = sum(lines(os.path.join(name, f)) for f in os.listdir(os.path.join(ROOT, name)) if f.endswith(".py"))
        else:
            got = lines(name)
        assert int(stated.replace(",", "")) == got, f"README says {name} has {stated} lines, it has {got}"


@pytest.mark.parametrize("page", PAGES)
def test_pages_hold_no_control_characters(page):
    """A page written from a Python string without r"" loses its backslashes to escapes (`\\frac` became a form
    feed and `rac`): no control character but tab and newline belongs in Markdown."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        bad = [(n, line) for n, line in enumerate(f, 1) if re.search(r"[\x00-\x08\x0b-\x1f\x7f]", line)]
    assert not bad, f"{page}:{bad[0][0]}: a control character in {bad[0][1]!r}"


def test_the_results_page_stays_short():
    """experiments/results.md holds each question's current answer and the runs behind it; a superseded run is one line
    naming the commit where its full section stands (git keeps it), so the page stays one a reader finishes."""
    size = os.path.getsize(os.path.join(EXPERIMENTS, "results.md"))
    assert size <= 40 * 1024, (f"experiments/results.md is {size:,} bytes, over 40 kB: "
                               "fold superseded runs into one line each")


def python_files():
    """The project's own .py files: the top level and its code folders (not a venv, a run dir or a cache)."""
    out = [f for f in os.listdir(ROOT) if f.endswith(".py")]
    for folder in ("benchmarks", "examples", "experiments", "tests"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
            dirnames[:] = [d for d in dirnames if not d.startswith((".", "__")) and not d.startswith("out")]
            out += [os.path.relpath(os.path.join(dirpath, f), ROOT) for f in filenames if f.endswith(".py")]
    return sorted(out)


def test_every_python_line_fits_119_characters():
    """HF's width, kept by transformers and TRL: no line of the project's code is wider (characters, not bytes)."""
    files = python_files()
    assert {"pacs.py", "verify.py", "eval.py", "tests/test_docs.py"} <= set(files)
    wide = []
    for f in files:
        with open(os.path.join(ROOT, f), encoding="utf-8") as fh:
            wide += [f"{f}:{i}: {len(line)}" for i, line in enumerate(fh.read().splitlines(), 1) if len(line) > 119]
    assert not wide, "lines over 119 characters:\n" + "\n".join(wide)


def sweep_difference_table(page_text):
    """(threshold, header cells, rows of cells) of a lab page's sweep table of differences (headed `| difference |`
    or `| PACS − |`) and the Bonferroni threshold the page states last before it (`p < 0.05 / 12 = 0.0042`)."""
    start = re.search(r"^\| (difference|PACS −) \|", page_text, flags=re.M)
    assert start, "no table of differences headed | difference | or | PACS − |"
    thresholds = re.findall(r"p < (?:0\.05 / \d+ = )?(0\.\d+)", page_text[:start.start()])
    assert thresholds, "the page states no threshold p < ... before its table of differences"
    table = re.match(r"(\|.*\n)+", page_text[start.start():]).group().splitlines()
    cells = [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in table]
    return float(thresholds[-1]), cells[0], cells[2:]


def pair_of(name):
    """The (a, b) methods a row of a sweep table compares: `pacs − grpo`, `pacs, β = 2 − ppo`, or `grpo` under a
    `PACS −` header; None for a control row (outside the table's family)."""
    if name.startswith("*control"):
        return None
    a, _, b = name.rpartition(" − ")
    a = re.sub(r"^pacs, β = ([\d.]+)$", r"pacs-beta\1", a) or "pacs"
    return a, b.replace("critic-off", "pacs-critic-off").replace("pacs-pacs-", "pacs-")


@pytest.mark.parametrize("lab", ["lab", "lab2"])
def test_a_sweep_tables_bold_cells_are_those_past_its_threshold_and_each_p_is_summary_jsons(lab):
    """In each lab page's table of differences a pass@k cell is bold exactly where its p passes the page's own
    Bonferroni threshold, and every p printed there is summary.json's p_t for that pair and metric."""
    import json
    with open(os.path.join(LABS, lab, "README.md"), encoding="utf-8") as f:
        threshold, header, rows = sweep_difference_table(f.read())
    with open(os.path.join(LABS, lab, "summary.json")) as f:
        paired = {(p["a"], p["b"], p["metric"]): p["p_t"] for p in json.load(f)["paired"]
                  if p["prompts_per_mini_batch"] == 8}
    checked, problems = 0, []
    for row in rows:
        pair = pair_of(row[0])
        for column, cell in zip(header[1:], row[1:]):
            metric = re.search(r"pass@\d+", column)
            p = re.search(r"\bp ([\d.e-]+)", cell)
            if pair is None or metric is None or p is None:
                continue
            checked += 1
            p_t = paired.get((*pair, metric.group()))
            if p_t is None or float(p.group(1)) != pytest.approx(p_t, rel=0.05, abs=1e-12):
                problems.append(f"{row[0]}, {column}: p {p.group(1)} where summary.json has {p_t}")
            if cell.startswith("**") != (p_t is not None and p_t < threshold):
                problems.append(f"{row[0]}, {column}: {cell} is {'' if cell.startswith('**') else 'not '}bold, "
                                f"its p against the page's threshold {threshold}")
    assert checked >= 8, f"{lab}: only {checked} cells read: the table was not found"
    assert not problems, f"experiments/labs/{lab}/README.md:\n" + "\n".join(problems)


def test_the_gpu_guide_is_short_and_its_cells_are_sentences():
    """docs/gpu.md answers what to type on a card and how fast it ran in a five-minute read: at most 200 lines, no
    table cell over 60 words; the check's how-to and the calls' history live on pages of their own."""
    with open(os.path.join(ROOT, "docs", "gpu.md"), encoding="utf-8") as f:
        text = f.read()
    assert len(text.splitlines()) <= 200
    cells = [c.strip() for line in text.splitlines() if line.startswith("|") for c in line.strip("|").split("|")]
    long = [c[:60] for c in cells if len(c.split()) > 60]
    assert cells and not long, long


def over_bases_verdict(claim, rows=9):
    """A margin over bases, by experiments/README.md's rule: 'threshold' where both the mixed model's p and the
    t-test's over the base means pass 0.05 / rows, '95% only' where both 95% intervals exclude 0 but a p does not."""
    import numpy as np
    from scipy import stats
    o, means = claim["over_bases"], [b["mean"] for b in claim["per_base"]]
    p_mixed = 2 * stats.t.sf(abs(o["mean"] / o["se"]), o["df"])
    p_means = 2 * stats.t.sf(abs(np.mean(means) / (np.std(means, ddof=1) / np.sqrt(len(means)))), len(means) - 1)
    if max(p_mixed, p_means) < 0.05 / rows:
        return "threshold"
    t = claim["t_over_base_means"]["ci95"]
    return "95% only" if o["ci95"][0] * o["ci95"][1] > 0 and t[0] * t[1] > 0 else "neither"


def test_a_margin_over_bases_is_at_the_threshold_only_where_both_p_values_pass_it():
    """The first lab's accuracy cell names each margin over five bases as its summary.json's numbers read by the page's
    own rule (both p-values, 0.05 / 9); the mixed model's p of 0.00558 for PPO is on the threshold, not below it."""
    with open(os.path.join(EXPERIMENTS, "labs", "lab", "summary.json"), encoding="utf-8") as f:
        claims = {(c["b"], c["metric"]): c for c in json.load(f)["bases"]["claims"] if c["a"] == "pacs"}
    readme = open(os.path.join(EXPERIMENTS, "README.md"), encoding="utf-8").read()
    row = next(line for line in readme.splitlines() if line.startswith("| PACS above PPO and GRPO in accuracy"))
    cell = row.split(" | ")[2]  # the first lab's
    words = {"threshold": "over five bases below", "95% only": "over five bases below at 95% only"}
    for method, name in (("ppo", "PPO"), ("grpo", "GRPO")):
        verdict = over_bases_verdict(claims[method, "pass@1"])
        assert re.search(rf"{re.escape(words[verdict])}: − {name} ", cell), (name, verdict, cell)
    assert over_bases_verdict(claims["ppo", "pass@1"]) == "95% only"


def test_every_threshold_is_printed_to_the_digits_that_decide_it():
    """A Bonferroni threshold '0.05 / N = X' on any page prints X as lab_summary.threshold_digits gives it: the digits
    that read every 3-significant-digit p as the exact threshold does (0.00556, not 0.0056, where 0.00558 fails)."""
    import sys
    sys.path.insert(0, EXPERIMENTS)
    from lab_summary import threshold_digits
    wrong = []
    for page in PAGES:
        text = open(os.path.join(ROOT, page), encoding="utf-8").read()
        for n, x in re.findall(r"0\.05 / (\d+) = (0\.\d+)", text):
            if x != threshold_digits(0.05 / int(n)):
                wrong.append(f"{page}: 0.05 / {n} = {x}, where {threshold_digits(0.05 / int(n))} decides")
    assert not wrong, "\n".join(wrong)


def one_line(text):
    """A page's prose with its line breaks and runs of spaces as one space, so a sentence reads the same wrapped."""
    return re.sub(r"\s+", " ", text)


def at_its_digits(printed, value):
    """True where `value` rounds to `printed` at the digits printed (0.71 holds 0.7122, not 0.7162)."""
    decimals = len(printed.partition(".")[2])
    return abs(float(printed) - value) <= 0.5 * 10 ** -decimals + 1e-9


def test_the_results_pages_quickstart_numbers_are_its_logs():
    """experiments/results.md's quickstart answer is read from the log it links: the mean rewards, the critic's AUC
    (the mean over the steps that print one, named with their count), dA's mean and shift's range, and the run's
    wall time, load and commit as the log's first lines give them; the question table's row says the same."""
    text = open(os.path.join(EXPERIMENTS, "results.md"), encoding="utf-8").read()
    section = one_line(text[text.index("\n## The quickstart\n"):].split("\n## ")[1])
    row = one_line(next(line for line in text.splitlines() if line.startswith("| [The quickstart]")))
    link = re.search(r"\]\((logs/[^)\s]+\.log)\)", section)
    assert link, "results.md's quickstart links no logs/*.log"
    with open(os.path.join(EXPERIMENTS, link.group(1)), encoding="utf-8") as f:
        lines = f.read().splitlines()
    head = " ".join(x for x in lines if x.startswith("# "))
    steps = {}
    for line in (x for x in lines if x.startswith("step ")):
        cols = {k: v for k, v in re.findall(r"(reward|auc|shift|dA) (\S+)", line)}
        steps[int(line.split()[1])] = {k: float(v) for k, v in cols.items() if re.fullmatch(r"[\d.]+", v)}

    def mean(key, first, last):
        values = [steps[s][key] for s in range(int(first), int(last) + 1) if key in steps[s]]
        return sum(values) / len(values)

    wrong = []
    m = re.search(r"mean reward ([\d.]+) over steps (\d+)–(\d+) to ([\d.]+) over steps (\d+)–(\d+)", section)
    assert m, "results.md's quickstart names no mean reward over steps A–B to C over steps D–E"
    for printed, first, last in (m.group(1, 2, 3), m.group(4, 5, 6)):
        if not at_its_digits(printed, mean("reward", first, last)):
            wrong.append(f"mean reward {printed} over steps {first}–{last}: the log's {mean('reward', first, last)}")
    m = re.search(r"AUC of ([\d.]+), the mean of the (\d+) per-step AUCs the log prints \(steps (\d+)–(\d+)", section)
    assert m, "results.md's quickstart names no AUC as the mean of the N per-step AUCs the log prints (steps A–B"
    auc, count, first, last = m.groups()
    printed_at = [s for s in sorted(steps) if "auc" in steps[s]]
    if printed_at != list(range(int(first), int(last) + 1)) or int(count) != len(printed_at):
        wrong.append(f"{count} AUCs over steps {first}–{last}: the log prints one at steps {printed_at}")
    if not at_its_digits(auc, mean("auc", first, last)):
        wrong.append(f"AUC {auc} over steps {first}–{last}: the log's mean is {mean('auc', first, last)}")
    if f"critic AUC {auc} (mean of steps {first}–{last})" not in row:
        wrong.append(f"the question table's row does not give AUC {auc} over steps {first}–{last}: {row}")
    m = re.search(r"`dA` averages ([\d.]+) over steps (\d+)–(\d+)", section)
    if not m or not at_its_digits(m.group(1), mean("dA", *m.group(2, 3))):
        wrong.append(f"dA's mean over its steps: {m and m.group()}, the log's {m and mean('dA', *m.group(2, 3))}")
    m = re.search(r"`shift` ([\d.]+)–([\d.]+) after step 0", section)
    shifts = [steps[s]["shift"] for s in steps if s > 0]
    if not m or (float(m.group(1)), float(m.group(2))) != (min(shifts), max(shifts)):
        wrong.append(f"shift's range after step 0: {m and m.group()}, the log's {min(shifts)}–{max(shifts)}")
    wall = re.search(r"# wall: \d+ s \((\d+ min \d+ s)\)", head).group(1)
    load = "–".join(re.search(r"# load average: ([\d.]+) to ([\d.]+)", head).groups())
    commit = re.search(r"# commit: ([0-9a-f]+)", head).group(1)
    for what, needle in (("wall time", f"{wall} wall on one thread"), ("load", f"load average {load}"),
                         ("commit", f"at {commit}")):
        if needle not in section:
            wrong.append(f"results.md's quickstart does not give the log's {what} ({needle!r})")
    if f"{wall} on one thread" not in row:
        wrong.append(f"the question table's row does not give the log's wall time {wall}: {row}")
    assert not wrong, "experiments/results.md, the quickstart:\n" + "\n".join(wrong)


GPU_RUNS = os.path.join(EXPERIMENTS, "gpu-runs", "2026-11-27-h200")


def test_the_sampling_share_of_a_decode_step_is_call_5s_profile():
    """experiments/gpu-runs/README.md's sampling share is call 5's profile of the static cache's decode step, kernel
    by kernel: each kernel's ms and their sum at the digits printed, its steps the kernels' calls, and the share a
    step (the sum over the steps) and the step itself (ms_per_token) as both of the page's sentences give them."""
    text = one_line(open(os.path.join(EXPERIMENTS, "gpu-runs", "README.md"), encoding="utf-8").read())
    m = re.search(r"about ([\d.]+) ms of a ([\d.]+) ms decode step at ([\d,]+) rows with the static cache, by call 5's"
                  r" profile at \w+: `_softmax` ([\d.]+) \+ `div` ([\d.]+) \+ `exponential_` ([\d.]+) = ([\d.]+) ms"
                  r" over (\d+) steps", text)
    assert m, "the page gives no sampling share as 'about A ms of a B ms decode step ... = S ms over N steps'"
    share, step_ms, rows, softmax, div, exponential, total, n = m.groups()
    with open(os.path.join(GPU_RUNS, "call5", "results.json"), encoding="utf-8") as f:
        profile = json.load(f)["decode"]["profiles"][f"decode_static_{rows.replace(',', '')}x{n}"]
    kernels = {k["name"]: k for k in profile["profiled"]["kernels"]}
    wrong = []
    for printed, name in ((softmax, "aten::_softmax"), (div, "aten::div"), (exponential, "aten::exponential_")):
        if not at_its_digits(printed, kernels[name]["ms"]) or kernels[name]["calls"] != int(n):
            wrong.append(f"{name}: {printed} ms over {n} steps, the profile's {kernels[name]}")
    summed = sum(kernels[k]["ms"] for k in ("aten::_softmax", "aten::div", "aten::exponential_"))
    if not at_its_digits(total, summed):
        wrong.append(f"the sum {total} ms, the profile's {summed:.4f}")
    if not at_its_digits(share, summed / int(n)):
        wrong.append(f"{share} ms a step, the profile's {summed / int(n):.4f}")
    if not at_its_digits(step_ms, profile["ms_per_token"]):
        wrong.append(f"a {step_ms} ms decode step, the profile's {profile['ms_per_token']:.4f}")
    other = re.search(r"call 5's profile of the compiled step \(([\d.]+) ms at ([\d,]+) rows\), softmax, exponential"
                      r" and division kernels come to about ([\d.]+) ms a step", text)
    if not other or other.groups() != (step_ms, rows, share):
        wrong.append(f"the caveat's sentence says otherwise: {other and other.group()}")
    assert not wrong, "experiments/gpu-runs/README.md:\n" + "\n".join(wrong)


def test_the_checkpoint_write_times_are_the_calls_logs():
    """docs/gpu.md's checkpoint write time is the range of the `[save] ... in S s` lines of the calls it names, and
    it names every call whose check.log wrote one."""
    text = one_line(open(os.path.join(DOCS, "gpu.md"), encoding="utf-8").read())
    m = re.search(r"one took ([\d.]+)–([\d.]+) s to write \(calls ((?:\d+, )*\d+ and \d+),", text)
    assert m, "docs/gpu.md gives no 'one took A–B s to write (calls X, Y and Z,'"
    named = [int(c) for c in re.findall(r"\d+", m.group(3))]
    saves = {}
    for call in sorted(os.listdir(GPU_RUNS)):
        log = os.path.join(GPU_RUNS, call, "check.log")
        if os.path.isfile(log):
            found = re.findall(r"^\[save\] checkpoint-\d+ in ([\d.]+) s$", open(log, encoding="utf-8").read(), re.M)
            if found:
                saves[int(call.removeprefix("call"))] = [float(s) for s in found]
    assert named == sorted(saves), f"docs/gpu.md names calls {named}; the calls whose check.log saved: {sorted(saves)}"
    every = [s for call in named for s in saves[call]]
    assert (float(m.group(1)), float(m.group(2))) == (min(every), max(every)), (m.group(), min(every), max(every))
