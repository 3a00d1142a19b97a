"""Labelled cases for verify.py that no rule of it was written against: the equivalence tests of two other open
graders, read from their repositories and written as benchmarks/verify_cases_external.jsonl for bench_verify.py.

    python benchmarks/external_cases.py --math-verify DIR --math-verify-commit SHA \
        --hendrycks DIR --hendrycks-commit SHA --out benchmarks/verify_cases_external.jsonl

DIR is a checkout of each repository at that commit (the commit is recorded in every row, not read from DIR):
- huggingface/Math-Verify (licence: Apache-2.0, its LICENCE; tests/test_all.py carries an MIT header): every
  parametrized case (gold, pred, expected) of tests/test_*.py whose test compares with the library's defaults,
  precision 6, strict=True, allow_set_relation_comp=False (a case with another setting is left out: its label
  answers another question), whatever extraction targets the test names. The row's response is the case's pred,
  its answer the case's gold, verbatim, both as the test passes them.
- hendrycks/math (MIT): every case of modeling/math_equivalence_test.py, is_equiv(test_in, test_out) asserted
  true or false; the response is test_out, the answer test_in.

The rule above was fixed before any case was scored, and no label is changed: a label that reads as another
grader's policy (a decimal comma, an order that matters) stays as written. A case whose values are not Python
literals (an f-string) is left out and counted.
"""
from __future__ import annotations

import argparse
import ast
import glob
import json
import os

DEFAULTS = {"precision": 6, "strict": True, "allow_set_relation_comp": False}


def _literal(node):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def _call_options(fn, names):
    """The keyword options the test passes to compare_strings (or verify), each a constant or a parameter's name."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") in names:
            return {k.arg: (k.value.id if isinstance(k.value, ast.Name) else _literal(k.value)) for k in node.keywords
                    if k.arg != "match_types"}
    return None


def math_verify_cases(root, commit):
    """(rows, skipped): the default-setting cases of Math-Verify's tests, one row each, in file and test order."""
    rows, skipped = [], 0
    for path in sorted(glob.glob(os.path.join(root, "tests", "test_*.py"))):
        tree = ast.parse(open(path, encoding="utf-8").read())
        for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
            deco = [d for d in fn.decorator_list if isinstance(d, ast.Call) and getattr(d.func, "attr", "") ==
                    "parametrize"]
            options = _call_options(fn, ("compare_strings", "verify"))
            if not deco or options is None:
                continue
            names = [n.strip() for n in _literal(deco[0].args[0]).split(",")]
            if not {"gold", "pred"} <= set(names):
                continue
            label = "expected" if "expected" in names else "result"
            for case in deco[0].args[1].elts:
                values = [_literal(v) for v in case.elts]
                if any(v is None for v in values):
                    skipped += 1
                    continue
                case = dict(zip(names, values))
                settings = {k: case.get(v, v) if isinstance(v, str) else v for k, v in options.items()}
                if any(settings.get(k, d) != d for k, d in DEFAULTS.items()):
                    continue
                rows.append({"response": case["pred"], "answer": case["gold"], "expected": bool(case[label]),
                             "category": f"math-verify/{os.path.basename(path)}::{fn.name}",
                             "source": f"huggingface/Math-Verify@{commit}:{os.path.relpath(path, root)}::{fn.name}"})
    return rows, skipped


def hendrycks_cases(root, commit):
    """The cases of hendrycks/math's is_equiv tests: each test method's test_in, test_out and assertTrue/False."""
    rel = os.path.join("modeling", "math_equivalence_test.py")
    tree = ast.parse(open(os.path.join(root, rel), encoding="utf-8").read())
    rows = []
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        values = {t.id: _literal(a.value) for a in fn.body if isinstance(a, ast.Assign) for t in a.targets}
        check = next(c for c in ast.walk(fn) if isinstance(c, ast.Call) and getattr(c.func, "attr", "") in (
            "assertTrue", "assertFalse"))
        rows.append({"response": values["test_out"], "answer": values["test_in"],
                     "expected": check.func.attr == "assertTrue", "category": f"hendrycks-math/{fn.name}",
                     "source": f"hendrycks/math@{commit}:{rel}::{fn.name}"})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--math-verify", required=True, help="a checkout of huggingface/Math-Verify")
    p.add_argument("--math-verify-commit", required=True)
    p.add_argument("--hendrycks", required=True, help="a checkout of hendrycks/math")
    p.add_argument("--hendrycks-commit", required=True)
    p.add_argument("--out", default=os.path.join("benchmarks", "verify_cases_external.jsonl"))
    args = p.parse_args(argv)
    mv, skipped = math_verify_cases(args.math_verify, args.math_verify_commit)
    rows = mv + hendrycks_cases(args.hendrycks, args.hendrycks_commit)
    with open(args.out, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"{args.out}: {len(mv)} Math-Verify cases ({skipped} not literals, left out), {len(rows) - len(mv)} "
          f"hendrycks/math cases; {sum(not r['expected'] for r in rows)} of {len(rows)} expected false")


if __name__ == "__main__":
    main()
