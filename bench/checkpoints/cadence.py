#!/usr/bin/env python3
"""The checkpoint interval ddplaunch.checkpoint_due chooses (python/ddplaunch/cadence.py) for a job
that crashes every P seconds, after N crashes: the real policy and its history file, driven on a
simulated clock (a crash is a restart of the workers: TORCHELASTIC_RESTART_COUNT goes up). Each
row sets the chosen interval T beside the Young/Daly optimum for the true MTBF (within the same
bounds), and the time each loses to checkpoints and rework, to first order: C / T + T / (2 P).

    bench/checkpoints/cadence.py [--stall 1.0] [--periods 30,300] [--measure-mb 256]

--measure-mb N also measures the stall of ddplaunch.save on an N MB state on this machine
(needs torch; the median of 3 saves, each after the previous write completed) and prints its rows.
Prints a Markdown table; writes nothing outside a temporary directory.
"""
import argparse
import math
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))

from ddplaunch import cadence  # noqa: E402

CRASHES = (0, 1, 3, 10, 30, 100)


def measure(megabytes):
    import torch
    import ddplaunch
    state = {"w": torch.zeros(megabytes * (1 << 20) // 4)}
    tmp = tempfile.mkdtemp(prefix="cadence_bench_")
    try:
        stalls = []
        for _ in range(3):
            began = time.monotonic()
            ddplaunch.save(state, tmp, keep=1)
            stalls.append(time.monotonic() - began)
            ddplaunch.wait_for_save()
        return sorted(stalls)[1]
    finally:
        shutil.rmtree(tmp, True)


def rows(stall, period):
    """(crashes, MTBF estimate, chosen interval, optimum, lost with chosen, lost at optimum)."""
    tmp = tempfile.mkdtemp(prefix="cadence_bench_")
    now = [0.0]
    env = {"RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_RUN_ID": "bench"}
    try:
        c = cadence.Cadence(tmp, clock=lambda: now[0], wall=lambda: now[0], env=env, say=lambda line: None)
        c.saved(stall)
        out = []
        for n in CRASHES:
            now[0] = n * period
            env["TORCHELASTIC_RESTART_COUNT"] = str(n)
            d = c.decision()
            lo, hi = cadence.bounds(stall)
            best = min(max(cadence.young_daly(stall, period), lo), hi)

            def lost(t):
                return stall / t + t / (2 * period)
            out.append((n, d.mtbf, d.interval, best, lost(d.interval), lost(best)))
        return out
    finally:
        shutil.rmtree(tmp, True)


def table(stall, periods, what):
    print("| crash every | save stall C | crashes so far | MTBF estimate | interval chosen | optimum for the true MTBF "
          "| time lost, chosen | time lost, optimum |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for period in periods:
        for n, mtbf, chosen, best, lost, lost_best in rows(stall, period):
            print("| %g s | %.3g s (%s) | %d | %.0f s | **%.1f s** | %.1f s | %.0f%% | %.0f%% |"
                  % (period, stall, what, n, mtbf, chosen, best, 100 * lost, 100 * lost_best))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stall", type=float, default=1.0, help="the save stall C in seconds (default 1)")
    parser.add_argument("--periods", default="30,300", help="seconds between crashes, comma-separated")
    parser.add_argument("--measure-mb", type=int, default=0, help="also measure the stall of an N MB state")
    args = parser.parse_args()
    try:
        periods = [float(p) for p in args.periods.split(",")]
        if any(not math.isfinite(p) or p <= 0 for p in periods) or args.stall <= 0:
            raise ValueError
    except ValueError:
        parser.error("--periods takes positive seconds (30,300) and --stall a positive number of seconds")
    table(args.stall, periods, "given")
    if args.measure_mb:
        print()
        table(measure(args.measure_mb), periods, "measured, %d MB" % args.measure_mb)


if __name__ == "__main__":
    main()
