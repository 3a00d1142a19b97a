"""verify.py on real text: MATH's own worked solutions against their answers.

    python benchmarks/bench_math_selfmatch.py                 # data from ../shared/data
    python benchmarks/bench_math_selfmatch.py --data DIR --show

Self-match: every solution of MATH-500 and MATH-train (12,500 in all) is verified against
its own `answer`; a miss is a false negative (the answer is the solution's last box, so
nearly all should match). Cross-check: every solution is verified against the answer of the
problem `--shift` rows further on (a different problem; several shifts may be given); each
accept is classified:
  same    the two golds are the same string after normalisation, or after dropping a leading
          `name =` (both problems answer `2`, or `5` and `x=5`);
  equal   different spellings that are equal as exact numbers (`\\frac92` vs `4.5`, `1_6` vs
          `1`, `100\\%` vs `1`), checked here with Fraction, independently of verify.py;
  percent `20` vs `20\\%`: the same answer under the stated percent convention (a problem that
          asks for a percent is answered by the number of percent);
  review  anything else: printed, to be judged by hand (a real false positive or not).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from fractions import Fraction

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ("math500.jsonl", "math_train.jsonl")


def load(data):
    rows = []
    for name in FILES:
        with open(os.path.join(data, name), encoding="utf-8") as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return rows


def exact_value(s):
    """A plain number (int, decimal, a/b, \\frac{a}{b}, base-n `12_3`, `p\\%`, optionally signed)
    as a Fraction, or None."""
    s = re.sub(r"\\[dt]frac", r"\\frac", s.replace(" ", "").replace("{,}", "").replace(",\\!", ""))
    if s.endswith("%"):
        v = exact_value(s[:-1].rstrip("\\"))
        return None if v is None else v / 100
    m = re.fullmatch(r"(\d+)_\{?(\d+)\}?", s)
    if m and all(int(d) < int(m.group(2)) for d in m.group(1)):
        return Fraction(int(m.group(1), int(m.group(2))))
    m = re.fullmatch(r"(-?)\\frac\{?(\d+)\}?\{?(\d+)\}?", s) or re.fullmatch(r"(-?)(\d+)/(\d+)", s)
    try:
        if m:
            return (-1 if m.group(1) else 1) * Fraction(int(m.group(2)), int(m.group(3)))
        return Fraction(s) if re.fullmatch(r"-?(?:\d+\.?\d*|\.\d+)", s) else None
    except (ValueError, ZeroDivisionError):
        return None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=os.path.join(ROOT, "..", "shared", "data"),
                   help="folder with math500.jsonl and math_train.jsonl")
    p.add_argument("--shift", type=int, nargs="+", default=[1],
                   help="cross-check pairs solution i with answer i+shift (each shift given)")
    p.add_argument("--show", action="store_true", help="list the self-match misses")
    args = p.parse_args()
    sys.path.insert(0, ROOT)
    import verify

    rows = load(args.data)
    n = len(rows)
    verify.verify("\\boxed{x+1}", "1+x")  # start the sympy worker outside the timing
    start = time.perf_counter()
    miss = [r for r in rows if not verify.verify(r["solution"], r["answer"])]
    secs = time.perf_counter() - start
    print(f"self-match: {n - len(miss)}/{n} = {100 * (n - len(miss)) / n:.2f}%   ({n / secs:.0f} solutions/s)")
    if args.show:
        for r in miss:
            print(f"  miss {r['id']}: gold={r['answer']!r} extracted={verify.extract_answer(r['solution'])!r}")

    totals = {}
    for shift in args.shift:
        for kind, pairs in cross_check(verify, rows, shift).items():
            totals[kind] = totals.get(kind, 0) + len(pairs)
    if len(args.shift) > 1:
        print(f"cross-check, all {len(args.shift)} shifts: {sum(totals.values())}/{n * len(args.shift)} accepts: "
              + ", ".join(f"{v} {k}" for k, v in totals.items()))


def cross_check(verify, rows, shift):
    def plain(g):  # normalised, squashed, without a leading `x =`
        return re.sub(r"^[a-zA-Z]=", "", verify.squash(verify.normalize(g)))

    n, kinds = len(rows), {"same": [], "equal": [], "percent": [], "review": []}
    for i, r in enumerate(rows):
        other = rows[(i + shift) % n]
        if not verify.verify(r["solution"], other["answer"]):
            continue
        own, gold = r["answer"], other["answer"]
        va, vb = exact_value(plain(own)), exact_value(plain(gold))
        if plain(own) == plain(gold):
            kinds["same"].append((r, other))
        elif va is not None and va == vb:
            kinds["equal"].append((r, other))
        elif va is not None and vb is not None and (va == vb * 100 or vb == va * 100):
            kinds["percent"].append((r, other))
        else:
            kinds["review"].append((r, other))
    total = sum(map(len, kinds.values()))
    print(f"cross-check (shift {shift}): {total}/{n} accepts: {len(kinds['same'])} same gold, "
          f"{len(kinds['equal'])} equal numbers, {len(kinds['percent'])} percent convention, "
          f"{len(kinds['review'])} to review")
    for kind in ("equal", "percent", "review"):
        for r, other in kinds[kind]:
            print(f"  {kind} {r['id']} vs {other['id']}: own={r['answer']!r} other={other['answer']!r} "
                  f"extracted={verify.extract_answer(r['solution'])!r}")
    return kinds


if __name__ == "__main__":
    main()
