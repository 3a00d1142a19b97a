"""docs/pacs.ipynb, the notebook beside pacs.py: its links point at the lines they name, it copies none of pacs.py,
its saved outputs are those of the committed code, and it runs top to bottom without writing into the repository.
Running it needs a Jupyter kernel: pip install -r docs/requirements-notebook.txt (CI does)."""
import ast
import base64
import contextlib
import io
import json
import os
import re

import pytest

import conftest
from conftest import ROOT
from test_docs import anchors

NOTEBOOK = os.path.join(ROOT, "docs", "pacs.ipynb")
LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")  # [text](target)
LAB_HEADING = "## 3."  # sections 1-2 (the toy batch) are cheap to rerun in-process; 3-4 load the lab and train
TEST_STEPS = "2"  # PACS_NOTEBOOK_STEPS when the suite runs it: the short run's steps (24 in the saved outputs)
NOTEBOOK_BUDGET_S = 300  # the whole notebook at TEST_STEPS: 40-60 s on 2 busy cores; two threads took 3-5x longer


def notebook():
    with open(NOTEBOOK, encoding="utf-8") as f:
        return json.load(f)


def text(cell_or_output, key="source"):
    value = cell_or_output[key]
    return "".join(value) if isinstance(value, list) else value


def code_cells(nb):
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def stdout(cell):
    return "".join(text(o, "text") for o in cell["outputs"] if o["output_type"] == "stream" and o["name"] == "stdout")


def toy_cells(nb):
    """The code cells before section 3."""
    cells = []
    for c in nb["cells"]:
        if c["cell_type"] == "markdown" and text(c).startswith(LAB_HEADING):
            return cells
        if c["cell_type"] == "code":
            cells.append(c)
    raise AssertionError(f"no markdown cell starts with {LAB_HEADING!r}")


# The residuals the toy cells print: float32 rounding noise, whose digits change with the CPU's kernels (AVX-512,
# AVX2 or none: ATEN_CPU_CAPABILITY=default and =avx2 try them). A printout is compared with them masked, and each
# residual, saved or printed now, must be below RESIDUAL_BOUND.
RESIDUAL = re.compile(r"(max \|difference\| over all tokens: |\|grad L \+ policy gradient\| = )(\S+)")
RESIDUAL_BOUND = 1e-6  # float32 noise on values of order 0.1-1 is ~1e-8; a wrong derivation is off by ~0.01


def residuals(printout):
    """(the printout with every residual masked, [the residuals as floats])."""
    return RESIDUAL.sub(r"\1<residual>", printout), [float(v) for _, v in RESIDUAL.findall(printout)]


def printout_problem(now, saved):
    """Why the printout `now` is not the `saved` one, or None: equal character for character once the residuals are
    masked, and every residual on both sides below RESIDUAL_BOUND."""
    (now_text, now_res), (saved_text, saved_res) = residuals(now), residuals(saved)
    if now_text != saved_text:
        now_lines, saved_lines = now_text.split("\n"), saved_text.split("\n")
        i = next((i for i, (a, b) in enumerate(zip(now_lines, saved_lines)) if a != b), None)
        if i is None:
            return f"it prints {len(now_lines)} lines where the notebook saved {len(saved_lines)}"
        return f"line {i} reads {now_lines[i]!r} where the notebook saved {saved_lines[i]!r}"
    noise = [v for v in now_res + saved_res if not abs(v) < RESIDUAL_BOUND]
    return f"residuals {noise} are not float noise (< {RESIDUAL_BOUND:g})" if noise else None


def lines_of(path):
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


# ---------------------------------------------------------------------------------------------------
# 1. Links and structure, read from the JSON
# ---------------------------------------------------------------------------------------------------
def code_link_problem(label, path):
    """Why [label](path) into a script is wrong, or None: the label is a `code` span; a bare `name` is defined at
    the top of the file (def, class or `name =`), any other `code` appears in it. Links carry no line anchor, which
    every edit above the line would move."""
    span = re.fullmatch(r"`([^`]+)`", label)
    if span is None:
        return "a link into a script must be a `code` span naming what it points at"
    source = "\n".join(lines_of(path))
    if re.fullmatch(r"\w+", span.group(1)):
        name = span.group(1)
        if not re.search(rf"^(def|class) {name}\b|^{name} = ", source, re.M):
            return f"{os.path.relpath(path, ROOT)} defines no {name}"
    elif span.group(1) not in source:
        return f"{os.path.relpath(path, ROOT)} does not hold {span.group(1)!r}"
    return None


def test_every_link_resolves_and_every_code_link_names_what_is_there():
    problems, code_links = [], 0
    for cell in notebook()["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        for label, target in LINK.findall(text(cell)):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(ROOT, "docs", file))
            if not os.path.exists(dest):
                problems.append(f"{target}: no file {os.path.relpath(dest, ROOT)}")
            elif dest.endswith(".py"):
                code_links += 1
                why = code_link_problem(label, dest) or (anchor and "a line anchor: link by name")
                if why:
                    problems.append(f"[{label}]({target}): {why}")
            elif anchor and (not dest.endswith(".md") or anchor not in anchors(dest)):
                problems.append(f"{target}: no anchor #{anchor} in {os.path.relpath(dest, ROOT)}")
    assert not problems, "docs/pacs.ipynb:\n" + "\n".join(problems)
    assert code_links >= 15, code_links


def test_each_code_cell_follows_prose_that_links_what_of_pacs_it_exercises():
    """Between the first cell (imports) and the last (the run time), every code cell comes right after a markdown
    cell, and the prose above it, since the code cell before, links what of pacs.py it exercises."""
    cells, problems = notebook()["cells"], []
    codes = [i for i, c in enumerate(cells) if c["cell_type"] == "code"]
    for i in codes[1:-1]:
        above = [text(c) for c in cells[max(j for j in codes if j < i) + 1:i]]
        if cells[i - 1]["cell_type"] != "markdown":
            problems.append(f"cell {i} has no prose above it")
        elif not re.search(r"\]\(\.\./pacs\.py\)", "".join(above)):
            problems.append(f"cell {i}: the prose above it links nothing of pacs.py")
    assert not problems, problems
    assert len(codes) >= 10


def test_it_imports_pacs_and_copies_none_of_it():
    nb = notebook()
    pacs_defs = {node.name for node in ast.parse(open(os.path.join(ROOT, "pacs.py"), encoding="utf-8").read()).body
                 if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    source = "\n".join(text(c) for c in code_cells(nb))
    defined = {node.name for node in ast.walk(ast.parse(source)) if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    assert not defined & pacs_defs, f"the notebook redefines pacs.py's {sorted(defined & pacs_defs)}"
    assert re.search(r"^import pacs\b", source, flags=re.M) and re.search(r"^import lab\b", source, flags=re.M)


# ---------------------------------------------------------------------------------------------------
# 2. The saved outputs: the committed code's, read from the JSON (nothing executed)
# ---------------------------------------------------------------------------------------------------
def test_saved_outputs_are_a_clean_top_to_bottom_run_of_the_committed_cells():
    nb = notebook()
    cells = code_cells(nb)
    assert [c["execution_count"] for c in cells] == list(range(1, len(cells) + 1)), "not run top to bottom, once"
    for i, cell in enumerate(cells):
        kinds = {o["output_type"] for o in cell["outputs"]}
        assert "error" not in kinds, f"code cell {i} saved an error"
        streams = [o["name"] for o in cell["outputs"] if o["output_type"] == "stream"]
        assert "stderr" not in streams, f"code cell {i} saved stderr (a warning?): fix it, do not save it"
    assert all(c["outputs"] for c in cells[2:]), "a code cell past the setup has no saved output"
    pngs = [base64.b64decode(o["data"]["image/png"]) for c in cells for o in c["outputs"]
            if o["output_type"] == "display_data" and "image/png" in o.get("data", {})]
    assert len(pngs) == 3 and all(p.startswith(b"\x89PNG\r\n\x1a\n") for p in pngs), len(pngs)


def test_saved_outputs_say_what_the_derivation_says():
    toy = [stdout(c) for c in toy_cells(notebook())]
    out = "\n".join(toy)
    assert re.search(r"^loss (\d\.\d{4})", out, flags=re.M).group(1) == "0.6931"  # the first loss printed: ln 2
    # the side-by-side gradients: autograd's -dL/dlogprob and the derivation's beta G/(B(G-1)) A_k, row by row
    rows = re.findall(r"^\s+(\d+)\s+([01])\s+([+-]\d\.\d{3})\s+([+-]\d\.\d{6})\s+([+-]\d\.\d{6})$", out, flags=re.M)
    assert len(rows) == 8, rows
    B, G = 8, 4
    for k, R, A, autograd, derivation in rows:
        assert autograd == derivation, f"response {k}: autograd {autograd}, derivation {derivation}"
        assert float(autograd) == pytest.approx(G / (B * (G - 1)) * float(A),
                                                abs=G / (B * (G - 1)) * 5e-4)  # A: 3 places
        assert (float(A) > 0) == (R == "1")  # at psi = 0: +G/(4k) right, -G/(4(G-k)) wrong
    assert len(residuals(out)[1]) == 2 and all(abs(r) < RESIDUAL_BOUND for r in residuals(out)[1])
    aucs = re.findall(r"^beta\s+(\S+): AUC (\S+) over \d+ pairs \| advantage rewritten by the critic (\d+)%", out,
                      flags=re.M)
    assert [b for b, _, _ in aucs] == ["0.5", "1", "2", "4"]
    assert len({auc for _, auc, _ in aucs}) == 1  # beta scales psi: the ranking stays
    shares = [int(s) for _, _, s in aucs]
    assert shares == sorted(shares) and shares[0] < shares[-1]  # and the critic's say grows with it


def test_saved_outputs_of_the_lab_and_the_runs():
    nb = notebook()
    out = "\n".join(stdout(c) for c in code_cells(nb))
    mini = re.findall(r"^mini-batch (\d): loss (\S+) \| psi std (\S+) .* \| AUC (\S+) over \d+ pairs$", out,
                      flags=re.M)
    assert [m for m, *_ in mini] == ["0", "1", "2", "3"]
    assert mini[0][1:] == ("0.6931", "0.000", "0.50")  # mini-batch 0 trains at pi_old: psi = 0, loss ln 2
    assert all(float(std) > 0 and 0 <= float(auc) <= 1 for _, _, std, auc in mini[1:])
    steps = re.search(r'STEPS = int\(os\.environ\.get\("PACS_NOTEBOOK_STEPS", (\d+)\)\)',
                      "".join(text(c) for c in code_cells(nb))).group(1)
    runs = re.findall(r"^(pacs|pacs-critic-off) seed (\d) \(\d+ s\): step\s+(\d+) \| reward", out, flags=re.M)
    assert sorted(runs) == sorted((m, s, str(int(steps) - 1)) for m in ("pacs", "pacs-critic-off") for s in "01"), \
        f"the saved runs are not the notebook's {steps} steps: {runs}"
    (total, threads) = re.findall(r"^total run time (\d+) s .* (\d+) torch threads", stdout(code_cells(nb)[-1]),
                                  flags=re.M)[0]
    assert int(total) <= 300, f"the saved run took {total} s, over the 5 minutes the notebook promises"
    assert threads == "1", f"the saved run used {threads} torch threads: on busy cores they wait on each other"


# ---------------------------------------------------------------------------------------------------
# 3. Executed: the toy sections in-process (cheap, no kernel), the whole notebook in a kernel
# ---------------------------------------------------------------------------------------------------
def test_the_toy_sections_print_now_what_the_notebook_saved(monkeypatch):
    """Sections 1-2 rerun here, each cell compiled as the notebook's own code (so a deprecated call in a cell is an
    error, tests/conftest.py): they print what the notebook saved, character for character but the residuals'
    float noise (printout_problem)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    monkeypatch.chdir(os.path.join(ROOT, "docs"))
    monkeypatch.setattr(conftest, "OWN_CODE", conftest.OWN_CODE + (NOTEBOOK,))
    namespace = {"__name__": "__main__"}
    for i, cell in enumerate(toy_cells(notebook())):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(text(cell), NOTEBOOK, "exec"), namespace)
        why = printout_problem(printed.getvalue(), stdout(cell))
        assert why is None, f"toy code cell {i}: {why}"
    plt.close("all")


def test_a_printout_differs_in_any_character_but_the_residuals_noise():
    saved = ("loss 0.6931\nmax |difference| over all tokens: 7.5e-09\n"
             "weights: |grad L + policy gradient| = 2.6e-08 (x)\n")
    assert printout_problem(saved.replace("2.6e-08", "2.8e-08").replace("7.5e-09", "0.0e+00"), saved) is None
    assert "0.6932" in printout_problem(saved.replace("0.6931", "0.6932"), saved)
    assert "not float noise" in printout_problem(saved.replace("2.6e-08", "3.1e-03"), saved)
    assert printout_problem(saved.replace(" (x)", ""), saved) and printout_problem(saved + "\n", saved)


def notebook_runner():
    """(nbformat, NotebookClient), or a skip saying what to install."""
    try:
        import ipykernel  # noqa: F401  (the kernel nbclient starts)
        import nbformat
        from nbclient import NotebookClient
    except ImportError as e:
        pytest.skip(f"the notebook runner is not installed ({e.name}): pip install -r docs/requirements-notebook.txt")
    return nbformat, NotebookClient


WATCH_WRITES = """import os as _os, sys as _sys, tempfile as _tempfile
_sys.path.insert(0, {tests!r})
import conftest as _conftest  # the suite's rule: a FutureWarning or DeprecationWarning our code provokes is an error
_conftest.OWN_CODE += (_os.path.join(_tempfile.gettempdir(), f"ipykernel_{{_os.getpid()}}"),)  # the cells' own code
_written = set()
def _audit(event, args):  # every path this kernel opens for writing, creates, moves or removes
    if event == "open" and isinstance(args[0], (str, bytes, _os.PathLike)):
        mode, flags = args[1] or "", args[2] or 0
        if any(c in mode for c in "wax+") or flags & (_os.O_WRONLY | _os.O_RDWR | _os.O_CREAT):
            _written.add(_os.path.abspath(_os.fsdecode(args[0])))
    elif event in ("os.mkdir", "os.remove", "os.rmdir", "os.rename", "os.replace", "shutil.rmtree"):
        _written.update(_os.path.abspath(_os.fsdecode(a)) for a in args[:2]
                        if isinstance(a, (str, bytes, _os.PathLike)))
_sys.addaudithook(_audit)"""
REPORT_WRITES = "import json as _json\nprint(_json.dumps(sorted(_written)))"
MAY_WRITE = (re.escape(os.path.join(ROOT, "experiments", "labs", "lab", "base"))
             + r"/(sft|train|val|test)\.jsonl",  # ensure_splits
             r".*/__pycache__(/.*)?")


def test_the_notebook_runs_top_to_bottom_and_writes_only_outside_the_repo(tmp_path, monkeypatch):
    nbformat, NotebookClient = notebook_runner()
    with open(NOTEBOOK, "rb") as f:
        committed = f.read()
    nb = nbformat.reads(committed.decode("utf-8"), as_version=4)
    saved = [stdout(c) for c in toy_cells(nb)]
    nb.cells.insert(0, nbformat.v4.new_code_cell(WATCH_WRITES.format(tests=os.path.join(ROOT, "tests"))))
    nb.cells.append(nbformat.v4.new_code_cell(REPORT_WRITES))
    monkeypatch.setenv("PACS_NOTEBOOK_STEPS", TEST_STEPS)
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the kernel's tempfile: the runs land here
    client = NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=False, record_timing=False,
                            resources={"metadata": {"path": os.path.join(ROOT, "docs")}})
    client.execute()  # a cell that raises fails the test (nbclient's CellExecutionError, with the traceback)

    cells = code_cells(nb)[1:-1]
    for i, cell in enumerate(cells):
        errors = [text(o, "text") for o in cell.outputs if o.output_type == "stream" and o.name == "stderr"]
        assert not errors, f"code cell {i} wrote to stderr: {errors}"
    problems = [f"toy code cell {i}: {why}" for i, (c, s) in enumerate(zip(cells, saved))
                if (why := printout_problem(stdout(c), s))]
    assert not problems, problems
    out = "\n".join(stdout(c) for c in cells)
    assert re.findall(r"step\s+(\d+) \| reward", out) == [str(int(TEST_STEPS) - 1)] * 4
    runs = re.search(r"^runs in (\S+)$", out, flags=re.M).group(1)
    assert os.path.commonpath([runs, str(tmp_path)]) == str(tmp_path)
    assert sorted(os.listdir(runs)) == ["pacs-critic-off-s0", "pacs-critic-off-s1", "pacs-s0", "pacs-s1"]

    (total, threads) = re.findall(r"^total run time (\d+) s .* (\d+) torch threads", stdout(code_cells(nb)[-2]),
                                  flags=re.M)[0]
    assert threads == "1" and int(total) <= NOTEBOOK_BUDGET_S, \
        f"the notebook's {TEST_STEPS}-step run: {total} s on {threads} torch threads (budget {NOTEBOOK_BUDGET_S} s)"
    written = json.loads(stdout(code_cells(nb)[-1]))
    inside = [p for p in written if os.path.commonpath([p, ROOT]) == ROOT]
    assert not [p for p in inside if not any(re.fullmatch(pattern, p) for pattern in MAY_WRITE)], \
        f"the notebook wrote into the repository: {inside}"
    assert any(p.startswith(runs) for p in written)  # the watch saw the runs' writes
    with open(NOTEBOOK, "rb") as f:
        assert f.read() == committed, "running the notebook changed docs/pacs.ipynb"
