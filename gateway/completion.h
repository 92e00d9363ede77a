/*
 * completion: the one path of a completion request, whoever asked for it: the HTTP API
 * (POST /v1/completions and /v1/chat/completions, http.h) and the lines of a Batch API job
 * (batch.h) alike.
 *
 *   validate (size, api_parse, model) -> tokenize (BOS + text) -> check the context ->
 *   admit into the cluster -> stream or collect the text -> finish
 *
 * A request is a parent with one sequence (a choice) per prompt and per "n": a batch of
 * prompts and n > 1 run prompts x n sequences, each its own cluster request (retried on a
 * worker failure as any), choice index n x prompt + i, seed + i (docs/api.md). Every prompt
 * is checked before any is admitted, and all are submitted or none; the answer is
 * assembled from them (streamed: each chunk names its choice) and ends when the last one
 * ends; one that fails for good fails the request and cancels the others.
 *
 * Generated text goes through a stream_t (stream.h): only whole UTF-8 characters come out
 * and stop strings are honoured. Log-probabilities (when asked for) arrive with their
 * tokens and are kept per choice, one entry per counted token (so a retry keeps those
 * already received); a stream hands each text chunk the entries of its tokens
 * (completion_chunk_logprobs), a collected answer all of them. A streaming request hands its text to the sink as it is
 * released; any other collects it, and the sink formats the whole answer at the end
 * (completion_format_response). What differs between transports, an SSE stream or a JSON
 * reply or a batch output line, is a completion_sink: a few callbacks for text, the end,
 * an error and the release of the transport's own state. The end of every admitted request
 * is counted in the stats (stats_request_end) here, once.
 *
 * One completion_t per admitted request (its choices are the cluster's uds,
 * completion_callbacks()), and it is freed in exactly one place when the request ends: finished,
 * failed, cancelled by its owner or destroyed. Loop thread only.
 */
#ifndef TP_GW_COMPLETION_H
#define TP_GW_COMPLETION_H

#include <stddef.h>
#include <stdint.h>

#include "api.h"
#include "cluster.h"
#include "stats.h"
#include "tokenizer.h"

typedef struct completion completion_t;

/* What the completions of one transport share. Owned by the transport (the HTTP server,
 * the batch module), borrowed by every completion it starts: it must outlive them. The
 * cluster and the stats may change between requests (set later, cleared at shutdown). */
typedef struct {
    const tokenizer_t *tok; /* the served tokenizer */
    int n_ctx;              /* context length in tokens */
    int max_piece;          /* bytes of the longest token piece: completion_max_piece(tok) */
    size_t max_body;        /* larger bodies are refused with 413 */
    const char *model;      /* the served model name */
    cluster_t *cluster;     /* where requests run; NULL: refused with 503 not_ready */
    stats_t *stats;         /* NULL: no figures */
    uint64_t id_nonce;      /* HTTP: response ids are <prefix>-<nonce, 16 hex><rid, hex> */
    int batch_line;         /* 1: Batch API lines: "stream" is refused, every request runs
                             * offline (its service_tier is only reported back), ids are
                             * <prefix>-<rid, 16 hex>, no INFO line per request end, and a
                             * request refused before admission is not counted in the stats
                             * (its line result is the record; a full cluster means "later") */
} completion_env;

/* How a completion reaches its transport. Every callback gets the sink's ud and the
 * completion (borrowed for the call: read it with the accessors below). */
typedef struct {
    /* Streaming requests only: len >= 1 bytes of text that choice index's stream released
     * (whole UTF-8 characters); with log-probabilities asked for, len may be 0 at the
     * choice's end when only entries are left (completion_chunk_logprobs). */
    void (*text)(void *ud, const completion_t *c, int index, const char *text, size_t len);
    /* Optional (NULL: none). After each message of tokens that leaves the request running:
     * return 0, or -1 to end it with the error *e (the sink fills it; e.g. a client that
     * reads too slowly). */
    int (*check)(void *ud, const completion_t *c, api_error *e);
    /* Optional (NULL: none). Choice index ended with finish_reason (API_FINISH_STOP /
     * _LENGTH), its text all given to text() when streaming; others may still run. */
    void (*choice_end)(void *ud, const completion_t *c, int index, const char *finish_reason);
    /* Every choice finished (after the last choice_end): deliver the end of the stream, or
     * the whole answer (completion_format_response). Return 0, or -1 with *e set when the
     * answer could not be delivered (then the last choice is counted as failed with e). */
    int (*done)(void *ud, const completion_t *c, api_error *e);
    /* The request failed after admission with e (cluster errors, out of memory, check()):
     * report it. Return STATS_END_FAILED, or STATS_END_CANCELLED when the failure is not
     * the request's (a batch line left for the next start): counted as cancelled. */
    stats_end_t (*fail)(void *ud, const completion_t *c, const api_error *e);
    /* The completion is gone: free ud. Called exactly once per admitted request, last
     * (after done or fail, or from completion_cancel / completion_destroy). */
    void (*release)(void *ud);
    /* Optional (NULL: none). Inside completion_start, once the request is valid and before
     * it is submitted: n_prompt tokens (BOS included) and max_tokens (settled), summed over
     * its prompts and choices (max_tokens x n per prompt). Return 0 to
     * admit it, or -1 with *e set to refuse it (completion_start then returns
     * COMPLETION_ERR with that error; e.g. a 429 for an API key over its tokens/s limit). */
    int (*admit)(void *ud, int n_prompt, int max_tokens, api_error *e);
} completion_sink;

/* The requests in flight of one owner (the HTTP server, a batch job): a completion joins
 * its owner's list when admitted and leaves it when freed. Zero-initialize; it must
 * outlive the completions in it. */
typedef struct {
    completion_t *head; /* the latest admitted first; next: completion_next() */
    int n;
} completion_list;

typedef enum {
    COMPLETION_OK = 0,   /* admitted: *out is the request; the sink hears of its end */
    COMPLETION_FULL = 1, /* the cluster's queue is full: *e is the 429 to answer, or try
                          * again later */
    COMPLETION_ERR = -1, /* refused: *e is the error to answer (4xx, 5xx) */
} completion_status_t;

/* Bytes of the longest piece of tok (>= 1), for completion_env.max_piece: a token spells
 * at most this many bytes, so a prompt of n bytes is at least n / max_piece tokens. */
int completion_max_piece(const tokenizer_t *tok);

/* The callbacks that route the cluster's reports to completions (the cluster's ud is the
 * completion_t). Every job completion_start submits names them; give them to cluster_new()
 * as well. Static storage. */
const cluster_callbacks *completion_callbacks(void);

/* Validate body (len bytes, need not be NUL-terminated; not read when len exceeds
 * env->max_body) for endpoint kind, tokenize it, and admit it into env->cluster. env,
 * sink and list are borrowed for the request's life. On COMPLETION_OK *out is the request,
 * at the head of list, and it owns ud from then on (sink->release frees it); otherwise
 * *out is NULL, ud stays the caller's and *e says why (see completion_status_t). No sink
 * callback but sink->admit runs inside this call. */
completion_status_t completion_start(const completion_env *env, api_kind_t kind, const char *body,
                                     size_t len, const completion_sink *sink, void *ud,
                                     completion_list *list, completion_t **out, api_error *e);

/* The owner gives up on the request (its client went away, its batch was cancelled): it
 * is cancelled in the cluster, counted as cancelled ("abort") with status (logged: 499)
 * and why, and freed (sink->release, no other callback). Takes NULL; sets *c to NULL
 * before the release. */
void completion_cancel(completion_t **c, int status, const char *why);

/* Forget the request without an answer or a count (shutdown): cancelled in the cluster
 * when there is one, then freed (sink->release). Takes NULL; sets *c to NULL before the
 * release. */
void completion_destroy(completion_t **c);

// --- accessors (c borrowed; strings valid while c lives)

/* The sink's state given to completion_start. */
void *completion_ud(const completion_t *c);

/* The next request in c's list (NULL after the last). */
completion_t *completion_next(const completion_t *c);

/* The cluster's request id of the first choice (logs). */
uint64_t completion_rid(const completion_t *c);

/* What the request asked for, as the Responses API echoes it back. */
typedef struct {
    double temperature, top_p;
    int max_tokens;           /* as asked (max_tokens / max_output_tokens); -1: absent */
    int store;                /* responses: "store" (nothing is stored either way) */
    const char *instructions; /* responses: "instructions"; NULL: absent (borrowed from c) */
} completion_params;

/* The request's parameters (strings borrowed from c). */
completion_params completion_request_params(const completion_t *c);

/* The choices (prompts x n, >= 1). */
int completion_n_choices(const completion_t *c);

/* Choice index's text so far (collected: all of it at the end; streaming: what is not yet
 * given to text()), len bytes of valid UTF-8, and its finish reason (NULL while it runs;
 * finish_reason may be NULL). Borrowed from c. */
const char *completion_choice_text(const completion_t *c, int index, size_t *len,
                                   const char **finish_reason);

/* The response id ("cmpl-..." / "chatcmpl-..." / "resp-..."). */
const char *completion_id(const completion_t *c);

/* 1 when the request asked for a stream ("stream": true): text goes to sink->text. */
int completion_streaming(const completion_t *c);

/* What every response body and chunk of the request shares (strings borrowed from c and
 * its env). */
api_response_info completion_info(const completion_t *c);

/* The usage figures: prompt tokens (BOS included; each prompt once, whatever its n) and
 * completion tokens so far (all choices). */
void completion_usage(const completion_t *c, int *n_prompt, int *n_completion);

/* 0 when the request asked for no log-probabilities, else the alternatives asked for + 1. */
int completion_logprobs(const completion_t *c);

/* Streaming, inside sink->text for choice index: the log-probabilities of the tokens whose
 * text this call carries (borrowed for the call; n may be 0); NULL when the request asked
 * for none. */
const api_logprobs *completion_chunk_logprobs(const completion_t *c, int index);

/* The non-streaming response body (completions, chat) with every choice's text collected
 * and finish reason (api_format_response_n). malloc'd (the caller frees); NULL on out of
 * memory. */
char *completion_format_response(const completion_t *c);

#endif
