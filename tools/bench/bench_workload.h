/*
 * bench_workload: what each request of tidepool-bench asks for, and when it arrives.
 *
 * Every random choice comes from --seed through counter-based streams: request i draws
 * its lengths and words from its own generator (seed, i), and the Poisson arrival times
 * from another (seed, "arrivals"), so request i is the same whatever the timing, the
 * concurrency or the order in which requests finish. Synthetic prompts are words drawn
 * from a fixed list of 64 short, common English words (1-2 tokens each with most
 * tokenizers); lengths are counted in words, and the exact token count comes back in the
 * server's usage. A dataset (bench_dataset.h) gives prompts or chat messages instead; its
 * lines are used in file order, cycling when --num-prompts exceeds the number of lines.
 *
 * The phase-shift workload alternates phases of --phase-seconds, starting at t = 0 with a
 * prefill-heavy one (prompts as configured, max_tokens --phase-short-len), then a
 * decode-heavy one (prompts of --phase-short-len words, max_tokens as configured); with
 * --decode-rate the arrival rate differs in the decode-heavy phases.
 *
 * The multi-turn workload (prefix caching, docs/prefix-cache.md) runs --conversations
 * chats of --turns user turns: request idx is turn idx / C of conversation idx % C (C =
 * --conversations), and it is sent only once turn - 1 of its conversation ended
 * (bench_workload_after); it resends the conversation so far: a system prompt of
 * --system-len words shared by every conversation, the user messages (--input-len words
 * each, fixed per conversation and turn) and the replies the earlier turns received
 * (a->reply_of), then the new user message. On the completions endpoint the messages are
 * joined as "User: ...\nAssistant:<reply>" text. The shared-prefix workload prefixes every
 * synthetic prompt with the same --prefix-len words (on chat, as a system message).
 */
#ifndef TP_BENCH_WORKLOAD_H
#define TP_BENCH_WORKLOAD_H

#include <stddef.h>

#include "bench_args.h"
#include "bench_dataset.h"

/* Phases of the phase-shift workload (values stored in records and result files). */
enum {
    BENCH_WORKLOAD_PHASE_NONE = -1, /* not the phase-shift workload */
    BENCH_WORKLOAD_PHASE_PREFILL = 0,
    BENCH_WORKLOAD_PHASE_DECODE = 1,
};

/* The shape of one request, as sent. */
typedef struct {
    long long prompt_words; /* words in the prompt (the estimate of its tokens) */
    long long max_tokens;   /* -1 when the body does not set it */
} bench_workload_shape;

/* Whether a->workload is "multi-turn" / "shared-prefix". */
int bench_workload_multi_turn(const bench_args *a);
int bench_workload_shared_prefix(const bench_args *a);

/* Requests in a run: --conversations x --turns for multi-turn, else --num-prompts. */
size_t bench_workload_n_requests(const bench_args *a);

/* The request idx must wait for (multi-turn: the previous turn of its conversation,
 * idx - conversations), or -1 when it waits for none. */
long long bench_workload_after(const bench_args *a, size_t idx);

/* Whether a->workload is "phase-shift". */
int bench_workload_phase_shift(const bench_args *a);

/* Phase-shift: the phase (BENCH_WORKLOAD_PHASE_PREFILL or _DECODE) at t_s >= 0 seconds
 * after the start: phases of a->phase_s, prefill-heavy first. */
int bench_workload_phase_at(const bench_args *a, double t_s);

/* The arrival after time t_s (seconds; finite a->request_rate), given e, a draw of the
 * exponential distribution of mean 1. A Poisson process at a->request_rate; with the
 * phase-shift workload and a->decode_rate > 0 its rate is a->decode_rate during the
 * decode-heavy phases, and e is spent across phases at each phase's rate (the inversion
 * method for a piecewise-constant rate), so the process stays Poisson within every
 * phase. Returns seconds after the start, >= t_s. */
double bench_workload_next_arrival(const bench_args *a, double t_s, double e);

/* The arrival schedule of up to n requests into arrival_s[0..n) (seconds after the start,
 * non-decreasing, arrival_s[0] = 0): all 0 for an infinite a->request_rate, else Poisson
 * gaps from the seed's arrival stream (bench_workload_next_arrival). With a->duration_s
 * > 0 the schedule stops before the first arrival at or after it. Returns the number of
 * arrivals written (n when there is no duration; >= 1 when n >= 1). */
size_t bench_workload_arrivals(const bench_args *a, double *arrival_s, size_t n);

/* The JSON body of request idx: its prompt (synthetic, or line idx % size of ds when ds
 * is not NULL; a "prompt" becomes "messages" for chat), max_tokens (the line's
 * max_tokens or max_completion_tokens, else drawn from a's output length), "model",
 * "stream": true with usage, temperature (unless the line sets it) and "ignore_eos" with
 * a->ignore_eos; a string "prompt" becomes its token ids with a->tokenize. phase (BENCH_WORKLOAD_PHASE_*) overrides the drawn lengths of synthetic
 * prompts as described above. Fills *shape. Returns a malloc'd compact JSON text (the
 * caller's), or NULL on out of memory. */
char *bench_workload_body(const bench_args *a, const bench_dataset_t *ds, const char *model,
                          int chat, size_t idx, int phase, bench_workload_shape *shape);

/* n_words synthetic words (the prompts' word list) separated by single spaces, from the
 * seed's own stream for filler text (tidepool-bench --trace tokenizes it into the pool its
 * prompts are cut from). Returns a malloc'd NUL-terminated text (the caller's; *len its
 * length), or NULL on out of memory. */
char *bench_workload_filler(long long seed, long long n_words, size_t *len);

#endif
