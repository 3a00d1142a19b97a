"""Accuracy and speed of verify.py on labelled cases, next to HF Math-Verify.

    python benchmarks/bench_verify.py                          # verify.py only
    python benchmarks/bench_verify.py --mv-python /tmp/mv/bin/python

Math-Verify is a benchmark peer, not a dependency: install it in a scratch venv
(`python3 -m venv /tmp/mv && /tmp/mv/bin/pip install "math-verify[antlr4_13_2]"`) and pass
that interpreter with --mv-python (or run this file in an env where `math_verify` imports).
Cases are JSONL rows {response, answer, expected[, category][, source]}; default tests/verify_cases.jsonl, the
project's own cases, which verify.py's rules were written against. benchmarks/verify_cases_external.jsonl holds
cases no rule was written against, from two other graders' test suites (benchmarks/external_cases.py).
Each checker gets a warm-up call, then `--repeat` timed passes (the best pass is reported;
verify.py's result cache is cleared before every pass, so no pass is served from it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(paths):
    rows = []
    for p in paths:
        with open(p, encoding="utf-8") as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return rows


def run_verify(rows, repeat):
    sys.path.insert(0, ROOT)
    import verify

    verify.verify("\\boxed{x+1}", "1+x")  # start the sympy worker outside the timing
    best, got = None, None
    for _ in range(repeat):
        verify.VERDICT_CACHE.clear()
        start = time.perf_counter()
        got = [verify.verify(r["response"], r["answer"]) for r in rows]
        secs = time.perf_counter() - start
        best = secs if best is None else min(best, secs)
    return got, best


def run_math_verify(rows, repeat):
    from math_verify import parse, verify

    def check(response, gold):
        try:
            return bool(verify(parse("$" + gold + "$"), parse(response)))
        except Exception:  # noqa: BLE001
            return False

    check("\\boxed{x+1}", "1+x")
    best, got = None, None
    for _ in range(repeat):
        start = time.perf_counter()
        got = [check(r["response"], r["answer"]) for r in rows]
        secs = time.perf_counter() - start
        best = secs if best is None else min(best, secs)
    return got, best


def report(name, rows, got, secs):
    exp = [bool(r["expected"]) for r in rows]
    right = sum(g == e for g, e in zip(got, exp))
    fp = sum(g and not e for g, e in zip(got, exp))
    fn = sum(e and not g for g, e in zip(got, exp))
    rate = len(rows) / secs
    print(f"{name:<12} accuracy {right}/{len(rows)} = {right / len(rows):.4f}   false positives {fp:>3}   "
          f"false negatives {fn:>3}   {rate:8.0f} responses/s")
    return rate


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", default=[os.path.join(ROOT, "tests", "verify_cases.jsonl")])
    p.add_argument("--mv-python", help="interpreter that has math_verify installed")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--show", action="store_true", help="list the cases each checker gets wrong")
    p.add_argument("--by-source", action="store_true",
                   help="accuracy per source too: a row's category up to its first '/' (math-verify, hendrycks-math)")
    p.add_argument("--math-verify-only", action="store_true", help=argparse.SUPPRESS)  # child mode
    args = p.parse_args()
    rows = load(args.files)
    if args.math_verify_only:
        got, secs = run_math_verify(rows, args.repeat)
        print(json.dumps({"got": got, "secs": secs}))
        return
    print(f"{len(rows)} cases ({sum(not r['expected'] for r in rows)} expected false) from "
          f"{', '.join(map(os.path.relpath, args.files))}")
    got, secs = run_verify(rows, args.repeat)
    ours = report("verify.py", rows, got, secs)
    results = {"verify.py": got}
    mv = None
    if args.mv_python:
        out = subprocess.run([args.mv_python, os.path.abspath(__file__), *args.files, "--repeat", str(args.repeat),
                              "--math-verify-only"], capture_output=True, text=True, check=True)
        mv = json.loads(out.stdout.strip().splitlines()[-1])
    else:
        try:
            got_mv, secs_mv = run_math_verify(rows, args.repeat)
            mv = {"got": got_mv, "secs": secs_mv}
        except ImportError:
            print("math-verify: not importable (pass --mv-python /path/to/python of a venv that has it)")
    if mv is not None:
        theirs = report("math-verify", rows, mv["got"], mv["secs"])
        results["math-verify"] = mv["got"]
        print(f"speed ratio: verify.py is {ours / theirs:.1f}x math-verify")
    if args.by_source:
        sources = {}
        for i, r in enumerate(rows):
            sources.setdefault(r.get("category", "").split("/")[0], []).append(i)
        for name, got in results.items():
            for source, idx in sources.items():
                right = sum(bool(got[i]) == bool(rows[i]["expected"]) for i in idx)
                fp = sum(bool(got[i]) and not rows[i]["expected"] for i in idx)
                fn = sum(rows[i]["expected"] and not got[i] for i in idx)
                print(f"  {name:<12} {source or '(none)':<16} accuracy {right}/{len(idx)} = {right / len(idx):.4f}   "
                      f"false positives {fp:>3}   false negatives {fn:>3}")
    if args.show:
        for name, got in results.items():
            for r, g in zip(rows, got):
                if g != bool(r["expected"]):
                    print(f"  [{name}] {r.get('category', '')}: gold={r['answer']!r} expected={r['expected']} "
                          f"response=...{r['response'][-70:]!r}")


if __name__ == "__main__":
    main()
