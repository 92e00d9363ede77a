#!/usr/bin/env python3
"""gen-trace: production-shaped request traces for tidepool-sim --trace and
tidepool-bench --trace (CSV arrival_s,prompt_tokens,output_tokens,class).

With --from-azure it converts the public Azure LLM inference trace 2023 (the real requests);
otherwise it synthesises lines from published statistics.

Shapes (docs/workloads.md gives the sources and how each figure was chosen):
  conversation  prompts lognormal, median 1020 tokens; outputs lognormal, median 129
                (Azure LLM inference trace 2023, "conversation", as published in
                Splitwise, Patel et al., ISCA 2024)
  code          prompts median 1469, outputs median 13 (the same trace, "coding")
  mix           both, the share of code following a day: code peaks at the working-day
                hours, conversation in the evening
Arrivals: Poisson, or with --burstiness CV > 1 a gamma renewal process of that coefficient of
variation (BurstGPT, Wang et al. 2024, models arrivals with gamma-distributed gaps); --rate
follows a day with --tide LOW:HIGH (the rate at night and at the
peak, a cosine over --day-s seconds, trough at t = 0) and --bursts N:X:S adds N bursts of X
times the rate for S seconds; --offline N adds N offline lines queued at t = 0 (a batch job
waiting throughout), their shape --offline-shape.

Token counts are the published ones times --scale, and every line is kept within --max-context
(prompt + output <= it: a line over it is drawn again, so the distributions are truncated
there, not piled up at the cap). For stories260K (n_ctx 512) use --scale 0.25 --max-context 512.

Deterministic: the same flags and --seed give the same file. Standard library only.
  tools/bench/gen-trace.py --shape conversation --rate 8 --duration-s 120 --scale 0.25 \
      --max-context 512 --seed 1 > conversation.csv
"""

import argparse
import math
import random
import sys

# Medians (tokens) as published for the Azure LLM inference trace 2023 (Splitwise, ISCA'24)
# and found in its public sample (conversation 1020 / 129, coding 1469 / 13); the spreads
# (lognormal sigma) are fitted to that sample's 10th and 90th percentiles:
# sigma = ln(p90 / p10) / (2 * 1.2816) -- see docs/workloads.md.
SHAPES = {
    "conversation": {"prompt_median": 1020, "prompt_sigma": 1.01,
                     "output_median": 129, "output_sigma": 0.80},
    "code": {"prompt_median": 1469, "prompt_sigma": 1.39,
             "output_median": 13, "output_sigma": 0.80},
}
# offline batch work (summaries, evaluations): long-ish prompts, medium outputs
OFFLINE_SHAPES = {
    "summarize": {"prompt_median": 1500, "prompt_sigma": 0.5,
                  "output_median": 150, "output_sigma": 0.5},
    "conversation": SHAPES["conversation"],
    "code": SHAPES["code"],
}


def draw(rnd, shape, scale, max_ctx):
    for _ in range(10000):
        p = max(1, round(rnd.lognormvariate(math.log(shape["prompt_median"]),
                                            shape["prompt_sigma"]) * scale))
        o = max(1, round(rnd.lognormvariate(math.log(shape["output_median"]),
                                            shape["output_sigma"]) * scale))
        if max_ctx <= 0 or p + o <= max_ctx:
            return p, o
    sys.exit("gen-trace: --max-context %d too small for this shape at --scale %g"
             % (max_ctx, scale))


def code_share(t, day_s):
    """Share of code requests at time t of a day of day_s seconds (t = 0: midnight):
    0.15 at night, 0.75 in the working hours (9-17 h), falling through the evening."""
    h = (t % day_s) / day_s * 24
    if 9 <= h < 17:
        return 0.75
    if 7 <= h < 9:
        return 0.15 + 0.6 * (h - 7) / 2
    if 17 <= h < 22:
        return 0.75 - 0.6 * (h - 17) / 5
    return 0.15


def rate_at(t, args):
    r = args.rate
    if args.tide:
        lo, hi = args.tide
        # trough at t = 0 (night), peak at day_s / 2
        r = lo + (hi - lo) * (1 - math.cos(2 * math.pi * t / args.day_s)) / 2
    for start, mult, length in args._bursts:
        if start <= t < start + length:
            r *= mult
    return r


def from_azure(args):
    """Lines of the Azure LLM inference trace 2023 CSVs (TIMESTAMP,ContextTokens,
    GeneratedTokens), merged by time: the window [--start-s, --start-s + --duration-s) after
    the first file's first request, arrival times relative to the window times
    --time-scale, token counts times --scale; a line over --max-context has its prompt
    clipped to fit (--overflow drop: dropped instead), and --keep P keeps each line with probability P (a lower rate, the same
    shapes and burst pattern)."""
    import csv
    import datetime
    rows = []
    for path in args.from_azure:
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                t = datetime.datetime.strptime(r["TIMESTAMP"][:26], "%Y-%m-%d %H:%M:%S.%f")
                rows.append((t, int(r["ContextTokens"]), int(r["GeneratedTokens"])))
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    rnd = random.Random(args.seed)
    kept, dropped = [], 0
    for t, p, o in rows:
        s = (t - t0).total_seconds() - args.start_s
        if s < 0 or s >= args.duration_s or rnd.random() >= args.keep:
            continue
        p, o = max(1, round(p * args.scale)), max(1, round(o * args.scale))
        if args.max_context > 0 and p + o > args.max_context:
            dropped += 1
            if args.overflow == "drop" or o >= args.max_context:
                continue
            p = args.max_context - o  # clip the prompt: the request stays, its size shrinks
        kept.append((s * args.time_scale, p, o))
    out = sys.stdout
    out.write("# gen-trace.py %s\n" % " ".join(sys.argv[1:]))
    out.write("# from the Azure LLM inference trace 2023 (Azure/AzurePublicDataset, CC-BY 4.0): "
              "%d lines, %d of them over --max-context %d at --scale %g (%s)\n"
              % (len(kept) + (dropped if args.overflow == "drop" else 0), dropped,
                 args.max_context, args.scale,
                 "dropped" if args.overflow == "drop" else "prompts clipped to fit"))
    out.write("arrival_s,prompt_tokens,output_tokens,class\n")
    ortn = random.Random(args.seed + 2)
    for _ in range(args.offline):
        p, o = draw(ortn, OFFLINE_SHAPES[args.offline_shape], args.scale, args.max_context)
        out.write("0,%d,%d,offline\n" % (p, o))
    for s, p, o in kept:
        out.write("%.6f,%d,%d,online\n" % (s, p, o))


def from_trace(args):
    """A trace of ours (CSV arrival_s,prompt_tokens,output_tokens[,class]) retimed: arrival
    times times --time-scale, each online line kept with probability --keep (offline lines
    always), the window [--start-s, --start-s + --duration-s) of the original times."""
    rnd = random.Random(args.seed)
    out = sys.stdout
    out.write("# gen-trace.py %s\n" % " ".join(sys.argv[1:]))
    out.write("arrival_s,prompt_tokens,output_tokens,class\n")
    for line in open(args.from_trace):
        s = line.strip()
        if not s or s.startswith("#") or not (s[0].isdigit() or s[0] == "."):
            continue
        f = s.split(",")
        t = float(f[0]) - args.start_s
        cls = f[3].strip() if len(f) > 3 else "online"
        off = cls.lower() in ("offline", "1", "flex", "batch")
        if not off and (t < 0 or t >= args.duration_s or rnd.random() >= args.keep):
            continue
        out.write("%.6f,%s,%s,%s\n" % (max(0.0, t) * args.time_scale, f[1].strip(),
                                       f[2].strip(), "offline" if off else "online"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--from-azure", action="append", default=[], metavar="CSV",
                    help="convert the Azure LLM inference trace 2023 CSV(s) instead (merged)")
    ap.add_argument("--from-trace", metavar="CSV",
                    help="retime a trace of ours (--time-scale, --keep, --start-s, --duration-s)")
    ap.add_argument("--start-s", type=float, default=0, help="--from-*: window start")
    ap.add_argument("--time-scale", type=float, default=1.0,
                    help="--from-azure: arrival times times this (0.5: twice the rate)")
    ap.add_argument("--overflow", choices=("clip", "drop"), default="clip",
                    help="--from-azure: a line over --max-context: clip its prompt, or drop it")
    ap.add_argument("--keep", type=float, default=1.0,
                    help="--from-azure: keep each line with this probability")
    ap.add_argument("--shape", choices=("conversation", "code", "mix"), default="conversation")
    ap.add_argument("--rate", type=float, default=4.0, help="online requests/s (no --tide)")
    ap.add_argument("--tide", default="", help="LOW:HIGH requests/s at night and at the peak")
    ap.add_argument("--day-s", type=float, default=0,
                    help="seconds one day is compressed into (default: --duration-s)")
    ap.add_argument("--duration-s", type=float, default=120,
                    help="seconds of arrivals (--from-*: of the original times)")
    ap.add_argument("--burstiness", type=float, default=1.0,
                    help="coefficient of variation of the gaps (1: Poisson; > 1: bursty gamma)")
    ap.add_argument("--bursts", default="", help="N:X:S: N bursts of X times the rate, S s each")
    ap.add_argument("--offline", type=int, default=0, help="offline lines queued at t = 0")
    ap.add_argument("--offline-shape", choices=sorted(OFFLINE_SHAPES), default="summarize")
    ap.add_argument("--scale", type=float, default=1.0, help="token counts times this")
    ap.add_argument("--max-context", type=int, default=0,
                    help="prompt + output at most this (0: no limit)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if args.day_s <= 0:
        args.day_s = args.duration_s
    if args.tide:
        try:
            lo, hi = (float(x) for x in args.tide.split(":"))
        except ValueError:
            sys.exit("gen-trace: --tide wants LOW:HIGH")
        if not 0 <= lo <= hi or hi <= 0:
            sys.exit("gen-trace: --tide wants 0 <= LOW <= HIGH, HIGH > 0")
        args.tide = (lo, hi)
    if args.burstiness <= 0 or args.rate <= 0 or args.duration_s <= 0 or args.scale <= 0:
        sys.exit("gen-trace: --burstiness, --rate, --duration-s and --scale must be > 0")
    if args.from_trace:
        if args.time_scale <= 0 or not 0 < args.keep <= 1:
            sys.exit("gen-trace: --time-scale must be > 0 and --keep in (0, 1]")
        if "--duration-s" not in sys.argv:
            args.duration_s = float("inf")
        return from_trace(args)
    if args.from_azure:
        if args.time_scale <= 0 or not 0 < args.keep <= 1:
            sys.exit("gen-trace: --time-scale must be > 0 and --keep in (0, 1]")
        return from_azure(args)
    rnd = random.Random(args.seed)
    args._bursts = []
    if args.bursts:
        try:
            n, mult, length = args.bursts.split(":")
            n, mult, length = int(n), float(mult), float(length)
        except ValueError:
            sys.exit("gen-trace: --bursts wants N:X:S")
        brnd = random.Random(args.seed + 1)
        args._bursts = sorted((brnd.uniform(0, max(0.0, args.duration_s - length)), mult, length)
                              for _ in range(n))
    out = sys.stdout
    out.write("# gen-trace.py %s\n" % " ".join(sys.argv[1:]))
    out.write("arrival_s,prompt_tokens,output_tokens,class\n")
    ortn = random.Random(args.seed + 2)
    for _ in range(args.offline):
        p, o = draw(ortn, OFFLINE_SHAPES[args.offline_shape], args.scale, args.max_context)
        out.write("0,%d,%d,offline\n" % (p, o))
    # Online arrivals: a renewal process in "operational time" (unit rate), mapped through the
    # integral of the rate (the inversion method, so the rate may change at any time).
    k = 1.0 / (args.burstiness ** 2)  # gamma shape: CV = 1 / sqrt(k)
    t, step = 0.0, 0.01
    while True:
        need = rnd.gammavariate(k, 1.0 / k)  # mean 1
        while need > 0 and t < args.duration_s:
            r = rate_at(t, args)
            if r * step >= need:
                t += need / r if r > 0 else step
                need = 0
            else:
                need -= r * step
                t += step
        if t >= args.duration_s:
            break
        share = code_share(t, args.day_s) if args.shape == "mix" else (
            1.0 if args.shape == "code" else 0.0)
        shape = SHAPES["code"] if rnd.random() < share else SHAPES["conversation"]
        p, o = draw(rnd, shape, args.scale, args.max_context)
        out.write("%.6f,%d,%d,online\n" % (t, p, o))


if __name__ == "__main__":
    main()
