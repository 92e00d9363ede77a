/*
 * sim_workload: the arrivals tidepool-sim replays, either read from a trace file or
 * generated (seeded, so the same seed gives the same arrivals).
 *
 * Trace: one request per line, sorted by arrival on load (stable: ties keep file order).
 *   CSV:   arrival_s,prompt_tokens,output_tokens[,class]   (a header line is allowed)
 *   JSONL: {"arrival_s": 0.5, "prompt_tokens": 900, "output_tokens": 40, "class": "online"}
 * class is "online" (default) or "offline"; "flex"/"batch" (and service_tier "flex", JSON
 * "offline": true, CSV 1) also mean offline. Blank lines and lines starting with # are
 * skipped. A bad line fails the load with the file name, line number and reason.
 *
 * phase-shift: Poisson arrivals at `rate` req/s for `duration_s`, alternating every
 * `phase_s` between a prefill-heavy shape (long prompts, short answers) and a
 * decode-heavy one (short prompts, long answers), prefill-heavy first; a share
 * `offline_frac` of arrivals is offline work of a medium shape. Lengths are uniform in the
 * ranges of sim_workload_shapes.
 *
 * A sim_workload is a plain struct, read by the simulator (is_trace, n_recs); a copy is an
 * independent cursor over the same arrivals (a trace's records stay owned by the
 * original, which sim_workload_free releases). Not thread-safe.
 */
#ifndef TP_SIM_WORKLOAD_H
#define TP_SIM_WORKLOAD_H

#include <stddef.h>
#include <stdint.h>

#include "sim_rng.h"

/* One request. */
typedef struct {
    double arrival_s; /* seconds after the start */
    int prompt;       /* prompt tokens, >= 1 */
    int out;          /* output tokens, >= 1 (the first comes from prefill) */
    int offline;      /* 1 = offline (flex / batch) */
} sim_workload_arrival;

/* Length ranges (tokens, inclusive) of a generated request. */
typedef struct {
    int prompt_lo, prompt_hi, out_lo, out_hi;
} sim_workload_shape;

enum {
    SIM_WORKLOAD_SHAPE_PREFILL_HEAVY, /* online, prefill-heavy phases */
    SIM_WORKLOAD_SHAPE_DECODE_HEAVY,  /* online, decode-heavy phases */
    SIM_WORKLOAD_SHAPE_OFFLINE,       /* offline, every phase */
    SIM_WORKLOAD_SHAPE_CONVERSATION,  /* online, the conversation workload */
    SIM_WORKLOAD_SHAPE_CODE,          /* online, the code-completion workload */
    SIM_WORKLOAD_N_SHAPES,
};

/* By SIM_WORKLOAD_SHAPE_*: prefill-heavy 512..1536 / 16..64, decode-heavy 64..192 /
 * 512..1536, offline 256..768 / 128..384, conversation 200..1800 / 100..300, code
 * 500..2500 / 5..30 (prompt / output tokens; docs/tidal.md gives the sources). */
extern const sim_workload_shape sim_workload_shapes[SIM_WORKLOAD_N_SHAPES];

/* Generated workloads (sim_workload.kind). */
typedef enum {
    SIM_WORKLOAD_PHASE_SHIFT = 0,
    SIM_WORKLOAD_CONVERSATION, /* steady: every online request of the conversation shape */
    SIM_WORKLOAD_CODE,         /* steady: every online request of the code shape */
    SIM_WORKLOAD_MIX,          /* steady: each online request either, with equal odds */
    SIM_WORKLOAD_SHIFT,        /* a compressed day (duration_s): code with the share
                                * sim_workload_code_share, else conversation */
} sim_workload_kind;

typedef struct {
    int is_trace;
    /* trace */
    sim_workload_arrival *recs; /* n_recs, sorted by arrival */
    size_t n_recs, pos;         /* pos: the next to replay */
    /* generators */
    sim_workload_kind kind;
    sim_rng rng;
    double rate, offline_frac, phase_s, duration_s;
    double t_s; /* last arrival */
} sim_workload;

/* Set *w to the steady generator of kind (not SIM_WORKLOAD_PHASE_SHIFT): Poisson arrivals
 * at rate/s (> 0) for duration_s, offline_frac of them offline (the offline shape), from
 * seed. */
void sim_workload_steady(sim_workload *w, sim_workload_kind kind, double rate, double duration_s,
                         double offline_frac, uint64_t seed);

/* The kind named name ("phase-shift", "conversation", "code", "mix", "shift") into *kind.
 * Returns 0, or -1 for an unknown name. */
int sim_workload_kind_parse(const char *name, sim_workload_kind *kind);

/* Set *w to the phase-shift generator: rate arrivals/s (> 0) for duration_s seconds,
 * phases of phase_s seconds, offline_frac in [0, 1], from seed. */
void sim_workload_phase_shift(sim_workload *w, double rate, double duration_s, double phase_s,
                              double offline_frac, uint64_t seed);

/* Load the trace at path into *w. max_tokens bounds prompt + output of every request (the
 * emulated worker's KV capacity, tokens). Returns 0, or -1 with a message naming the file
 * (and line) in err: cannot open, a line of the wrong form, arrival_s not finite or < 0,
 * token counts < 1, more than max_tokens, no requests. */
int sim_workload_load_trace(sim_workload *w, const char *path, double max_tokens, char *err,
                            size_t err_len);

/* Free a trace's records (w came from sim_workload_load_trace or is zeroed); takes a
 * generator too (nothing to free). */
void sim_workload_free(sim_workload *w);

/* The shift workload's share of code requests at t_s seconds of a day of day_s seconds
 * (t = 0: midnight; the working day of tools/bench/gen-trace.py, docs/workloads.md): 0.15
 * at night (22-7 h), rising to 0.75 by 9 h, 0.75 until 17 h, falling to 0.15 by 22 h. */
double sim_workload_code_share(double t_s, double day_s);

/* Phase-shift: the phase at t_s seconds: 0 = prefill-heavy, 1 = decode-heavy. */
int sim_workload_phase(const sim_workload *w, double t_s);

/* The next arrival into *a, in arrival order. Returns 1, or 0 when the workload has ended
 * (a trace's last record was returned; a generator's next arrival is at or after
 * duration_s). */
int sim_workload_next(sim_workload *w, sim_workload_arrival *a);

/* Length of the arrival window in seconds (the goodput denominator): duration_s for a
 * generator; a trace's last arrival, at least 1. */
double sim_workload_span_s(const sim_workload *w);

/* Shape statistics of the online requests (tokens), for the capacity estimates: the
 * token-weighted mean prompt sum(p^2) / sum(p) (what a prefill batch sees) and the
 * output-weighted mean context of a decoding sequence sum(o * (p + o / 2)) / sum(o);
 * 512 each when there is no online request. Over the first 200000 arrivals, from the
 * start, on a copy (w is untouched). */
void sim_workload_shape_stats(const sim_workload *w, double *mean_prompt, double *mean_ctx);

#endif
