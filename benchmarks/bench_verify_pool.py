"""The verifier of one step in this process against a pool of processes (pacs.py --verify-workers), same verdicts.

    python benchmarks/bench_verify_pool.py                     # 1,024 answers, workers 1 and one per core
    python benchmarks/bench_verify_pool.py --answers 1024 --workers 1 2 4 --rounds 3

The answers are the labelled cases of tests/verify_cases.jsonl and benchmarks/verify_cases_external.jsonl, cycled to
--answers (a default step verifies 128 x 8 = 1,024). Per worker count, a fresh pool (or this process, with verify's
cache cleared) runs --rounds rounds of reward_fn: round 1 is cold (each process starts its sympy worker on first
need), later rounds are warm and partly served from each process's cache, as a run's later steps are. Prints seconds
per round and checks that every round's verdicts equal the in-process ones.
"""
import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import levers  # noqa: E402
import pacs  # noqa: E402
import verify  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--answers", type=int, default=1024)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 0], help="0: one per core")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for name in ("tests/verify_cases.jsonl", "benchmarks/verify_cases_external.jsonl"):
        with open(os.path.join(ROOT, name)) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    rows = [rows[i % len(rows)] for i in range(args.answers)]
    responses, answers = [r["response"] for r in rows], [r["answer"] for r in rows]
    reference = None
    print(f"{args.answers} answers, {len(os.sched_getaffinity(0))} cores")
    for workers in args.workers:
        verify.VERDICT_CACHE.clear()
        t0 = time.time()
        pool = levers.VerifierPool(workers)
        n, start = pool.workers, time.time() - t0
        times = []
        for _ in range(args.rounds):
            t0 = time.time()
            rewards = pacs.reward_fn(responses, answers, pool)
            times.append(time.time() - t0)
            reference = rewards if reference is None else reference
            assert (rewards == reference).all(), f"workers {n}: verdicts differ"
        pool.close()
        print(f"workers {n:2d}: pool start {start:.2f} s | rounds " + " ".join(f"{t:.2f}" for t in times)
              + " s | verdicts equal")


if __name__ == "__main__":
    main()
