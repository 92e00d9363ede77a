/* completion: see completion.h.
 *
 * completion_start() runs the admission path top to bottom and either hands back an
 * admitted completion_t or frees everything it made; nothing of a refused request
 * outlives the call. From admission on the cluster's callbacks drive the request: tokens
 * go through the stream (and, streaming, to sink->text), and exactly one of finish()
 * (done), fail_with() (fail), completion_cancel() or completion_destroy() ends it, each
 * through completion_free(), the one place a completion and its sink's state are freed. */
#include "completion.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "log.h"
#include "protocol.h"
#include "sampler.h"
#include "stream.h"

struct completion {
    struct completion *prev, *next; /* in list */
    completion_list *list;          /* the owner's requests in flight (borrowed) */
    const completion_env *env;      /* borrowed */
    const completion_sink *sink;
    void *ud; /* the sink's; owned from admission on (sink->release) */
    uint64_t rid;
    api_kind_t kind;
    int streaming, include_usage;
    int offline; /* runs in the offline tier (flex, batch lines) */
    int flex;    /* asked for service_tier "flex": reported in every body */
    stream_t *stream;
    int n_prompt, max_tokens;
    char id[48];
    int64_t created;           /* unix seconds */
    int64_t t_first_us;        /* first tokens at the gateway (0 = none yet) */
    int64_t t_last_us;         /* latest tokens at the gateway */
    cluster_req_timing timing; /* filled by the cluster */
};

int completion_max_piece(const tokenizer_t *tok)
{
    int max_piece = 1;
    for (int id = 0; id < tokenizer_vocab_size(tok); id++) {
        size_t len = 0;
        tokenizer_piece(tok, -1, id, &len);
        if ((int)len > max_piece)
            max_piece = (int)len;
    }
    return max_piece;
}

// --- the end

static const char *ms_str(char *buf, size_t cap, double ms)
{
    if (ms < 0)
        snprintf(buf, cap, "-");
    else
        snprintf(buf, cap, "%.2f", ms);
    return buf;
}

/* The request ends: count it in the stats and (HTTP) log its one summary line (INFO) with
 * the phases of its time to first token (docs/stats.md). how: the finish reason (FINISHED)
 * or the error message. */
static void log_end(const completion_t *c, int status, stats_end_t end, const char *how)
{
    int64_t now = proto_now_us();
    int n_out = c->stream ? stream_n_tokens(c->stream) : 0;
    stats_request sr = {.rid = c->rid,
                        .how = end,
                        .finish_reason = end == STATS_END_FINISHED ? how : NULL,
                        .status = status,
                        .error = end == STATS_END_FAILED ? how : NULL,
                        .n_prompt = c->n_prompt,
                        .n_output = n_out,
                        .t_first_us = c->t_first_us,
                        .t_last_us = c->t_last_us,
                        .t_end_us = now,
                        .timing = &c->timing,
                        .offline = c->offline};
    stats_breakdown b;
    if (c->env->stats)
        stats_request_end(c->env->stats, &sr, &b);
    else
        stats_breakdown_of(&sr, &b);
    if (c->env->batch_line)
        return;
    char q[24], p[24], x[24], d[24], t[24], e[24];
    log_rinfo(c->rid,
              "request end: %s %s status=%d finish=%s prompt_tokens=%d output_tokens=%d "
              "queue_ms=%s prefill_ms=%s transfer_ms=%s first_decode_ms=%s ttft_ms=%s "
              "e2e_ms=%s prefill=%s decode=%s attempts=%d%s%s%s",
              c->kind == API_CHAT ? "/v1/chat/completions" : "/v1/completions",
              c->streaming ? "stream" : "json", status,
              end == STATS_END_FINISHED    ? how
              : end == STATS_END_CANCELLED ? "abort"
                                           : "error",
              c->n_prompt, n_out, ms_str(q, sizeof(q), b.queue_ms),
              ms_str(p, sizeof(p), b.prefill_ms), ms_str(x, sizeof(x), b.transfer_ms),
              ms_str(d, sizeof(d), b.first_decode_ms), ms_str(t, sizeof(t), b.ttft_ms),
              ms_str(e, sizeof(e), b.e2e_ms),
              c->timing.prefill_worker[0] ? c->timing.prefill_worker : "-",
              c->timing.decode_worker[0] ? c->timing.decode_worker : "-", c->timing.attempts,
              end == STATS_END_FINISHED ? "" : " reason=\"", end == STATS_END_FINISHED ? "" : how,
              end == STATS_END_FINISHED ? "" : "\"");
}

/* The one place an admitted completion is freed: out of its list, then the sink's state
 * goes last. */
static void completion_free(completion_t *c)
{
    const completion_sink *sink = c->sink;
    void *ud = c->ud;
    if (c->prev)
        c->prev->next = c->next;
    else
        c->list->head = c->next;
    if (c->next)
        c->next->prev = c->prev;
    c->list->n--;
    stream_destroy(&c->stream);
    free(c);
    sink->release(ud);
}

/* Streaming: hand the text the stream released to the sink. Collecting: it stays in the
 * stream for completion_format_response. */
static void flush_text(completion_t *c)
{
    size_t len;
    const char *out = stream_out(c->stream, &len);
    if (!c->streaming || len == 0)
        return;
    c->sink->text(c->ud, c, out, len);
    stream_out_clear(c->stream);
}

/* The request is complete: the rest of the text, then the end of the answer; freed. */
static void finish(completion_t *c, const char *finish_reason)
{
    flush_text(c);
    api_error e;
    if (c->sink->done(c->ud, c, finish_reason, &e) == 0)
        log_end(c, 200, STATS_END_FINISHED, finish_reason);
    else
        log_end(c, e.status, STATS_END_FAILED, e.message);
    completion_free(c);
}

/* The request failed after admission: the sink reports e; freed. */
static void fail_with(completion_t *c, const api_error *e)
{
    stats_end_t how = c->sink->fail(c->ud, c, e);
    log_end(c, e->status, how, e->message);
    completion_free(c);
}

// --- cluster callbacks

static int on_tokens(void *ud, const int *tokens, int n)
{
    completion_t *c = ud;
    stats_t *stats = c->env->stats;
    int64_t now = proto_now_us();
    if (!c->t_first_us) {
        c->t_first_us = now;
        if (stats && !c->offline) /* offline waits stay out of the online figures */
            stats_first_token(stats, &c->timing, now);
    } else if (stats && !c->offline) {
        stats_tokens(stats, &c->timing, (double)(now - c->t_last_us) / 1e6, now);
    }
    c->t_last_us = now;
    api_error e;
    for (int i = 0; i < n; i++) {
        stream_status_t st = stream_push(c->stream, tokens[i]);
        if (st == STREAM_STOP) {
            finish(c, API_FINISH_STOP);
            return 1;
        }
        if (st == STREAM_ERR) {
            api_error_set(&e, 500, "server_error", NULL, NULL, "out of memory");
            fail_with(c, &e);
            return 1;
        }
    }
    if (stream_n_tokens(c->stream) >= c->max_tokens) {
        stream_status_t st = stream_finish(c->stream);
        finish(c, st == STREAM_STOP ? API_FINISH_STOP : API_FINISH_LENGTH);
        return 1;
    }
    flush_text(c);
    if (c->sink->check && c->sink->check(c->ud, c, &e) < 0) {
        fail_with(c, &e);
        return 1;
    }
    return 0;
}

static void on_finish(void *ud, int reason)
{
    completion_t *c = ud;
    stream_status_t st = stream_finish(c->stream);
    finish(c,
           st == STREAM_STOP || reason == PROTO_FINISH_STOP ? API_FINISH_STOP : API_FINISH_LENGTH);
}

static void on_error(void *ud, int status, const char *type, const char *code, const char *msg)
{
    api_error e;
    api_error_set(&e, status, type, NULL, code, "%s", msg);
    fail_with(ud, &e);
}

static const cluster_callbacks callbacks = {on_tokens, on_finish, on_error};

const cluster_callbacks *completion_callbacks(void)
{
    return &callbacks;
}

// --- admission

/* Tokenize the prompt (BOS + text; a token-id prompt: its ids, each checked against the
 * vocabulary). malloc'd ids and their count, or NULL (out of memory, tokenizer failure, an
 * id out of the vocabulary) with e set. */
static int *tokenize(const tokenizer_t *tok, const api_request *r, int *n_out, api_error *e)
{
    if (r->prompt_ids) {
        int n = r->n_prompt_ids, vocab = tokenizer_vocab_size(tok);
        for (int i = 0; i < n; i++)
            if (r->prompt_ids[i] >= vocab) {
                api_error_set(e, 400, "invalid_request_error", "prompt", "invalid_value",
                              "token id %d (element %d of 'prompt') is not in the model's "
                              "vocabulary of %d tokens.",
                              r->prompt_ids[i], i, vocab);
                return NULL;
            }
        int *ids = malloc((size_t)n * sizeof(int));
        if (!ids) {
            api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
            return NULL;
        }
        memcpy(ids, r->prompt_ids, (size_t)n * sizeof(int));
        *n_out = n;
        return ids;
    }
    int cap = (int)r->prompt_len + 8, needed = 0;
    int *tokens = malloc((size_t)cap * sizeof(int));
    if (!tokens) {
        api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        return NULL;
    }
    int n = tokenizer_encode(tok, r->prompt, r->prompt_len, 1, tokens, cap, &needed);
    if (n < 0 && needed > cap) {
        int *t = realloc(tokens, (size_t)needed * sizeof(int));
        if (!t) {
            free(tokens);
            api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
            return NULL;
        }
        tokens = t;
        n = tokenizer_encode(tok, r->prompt, r->prompt_len, 1, tokens, needed, &needed);
    }
    if (n < 0) {
        free(tokens);
        api_error_set(e, 500, "server_error", NULL, NULL, "tokenization failed");
        return NULL;
    }
    *n_out = n;
    return tokens;
}

/* Validate, tokenize and check r against env: the prompt's ids (malloc'd) and count, or
 * NULL with e set. */
static int *admissible(const completion_env *env, api_kind_t kind, const char *body, size_t len,
                       api_request *r, int *n, api_error *e)
{
    if (len > env->max_body) {
        api_error_set(e, 413, "invalid_request_error", NULL, "request_too_large",
                      "The request body is %zu bytes; the limit is %zu bytes.", len, env->max_body);
        return NULL;
    }
    if (api_parse(kind, body, len, r, e) < 0 || api_check_model(r, env->model, e) < 0) {
        log_debug("400: %s", e->message);
        return NULL;
    }
    if (env->batch_line && r->stream) {
        api_error_set(e, 400, "invalid_request_error", "stream", "invalid_value",
                      "'stream' is not supported in a batch.");
        return NULL;
    }
    /* A token spells at least one byte and at most max_piece bytes, so a prompt this long
     * cannot fit; refuse it before spending time on tokenizing it. */
    if (r->prompt_len / (size_t)env->max_piece >= (size_t)env->n_ctx) {
        api_error_set(e, 400, "invalid_request_error", kind == API_CHAT ? "messages" : "prompt",
                      "context_length_exceeded",
                      "This model's maximum context length is %d tokens, but the prompt is at "
                      "least %zu tokens.",
                      env->n_ctx, r->prompt_len / (size_t)env->max_piece + 1);
        return NULL;
    }
    int *tokens = tokenize(env->tok, r, n, e);
    if (!tokens)
        return NULL;
    if (api_check_length(r, *n, env->n_ctx, e) < 0 ||
        api_check_sampling(r, tokenizer_vocab_size(env->tok), e) < 0) {
        free(tokens);
        return NULL;
    }
    if (!env->cluster) {
        api_error_set(e, 503, "server_error", NULL, "not_ready", "the server is starting");
        free(tokens);
        return NULL;
    }
    return tokens;
}

completion_status_t completion_start(const completion_env *env, api_kind_t kind, const char *body,
                                     size_t len, const completion_sink *sink, void *ud,
                                     completion_list *list, completion_t **out, api_error *e)
{
    *out = NULL;
    api_request r;
    memset(&r, 0, sizeof(r));
    completion_status_t rc = COMPLETION_ERR;
    completion_t *c = NULL;
    int n = 0;
    int *tokens = admissible(env, kind, body, len, &r, &n, e);
    if (!tokens)
        goto refused;
    if (sink->admit && sink->admit(ud, n, r.max_tokens, e) < 0)
        goto refused;
    c = malloc(sizeof(*c));
    if (!c)
        goto oom;
    *c = (completion_t){
        .list = list,
        .env = env,
        .sink = sink,
        .ud = ud,
        .kind = kind,
        .streaming = r.stream,
        .include_usage = r.stream && r.include_usage,
        .offline = env->batch_line || r.offline,
        .flex = r.offline,
        .stream = stream_new(env->tok, tokens[n - 1], tokenizer_eos(env->tok),
                             (const char *const *)r.stop, r.n_stop),
        .n_prompt = n,
        .max_tokens = r.max_tokens,
        .created = (int64_t)time(NULL),
    };
    if (!c->stream)
        goto oom;

    uint64_t seed = r.seed;
    if (!r.has_seed && getrandom(&seed, sizeof(seed), 0) != (ssize_t)sizeof(seed))
        seed = (uint64_t)proto_now_us() ^ ((uint64_t)(uintptr_t)c << 17);
    cluster_job job = {
        .tokens = tokens,
        .n_tokens = n,
        .max_tokens = r.max_tokens,
        .temperature = (float)r.temperature,
        .top_p = (float)r.top_p,
        .top_k = r.top_k,
        .rng = sampler_seed_state(seed),
        .mtp_depth = r.mtp_depth >= 0 ? r.mtp_depth + 1 : 0,
        .samp = r.samp,
        .timing = &c->timing,
        .offline = c->offline,
        .cb = &callbacks,
    };
    cluster_status_t st = cluster_submit(env->cluster, &job, c, &c->rid);
    if (st == CLUSTER_FULL) {
        api_error_set(e, 429, "rate_limit_error", NULL, "rate_limit_exceeded",
                      "The server is at capacity (the queue is full); retry later.");
        rc = COMPLETION_FULL;
        goto refused;
    }
    if (st != CLUSTER_OK)
        goto oom;
    const char *prefix = kind == API_CHAT ? "chatcmpl" : "cmpl";
    if (env->batch_line)
        snprintf(c->id, sizeof(c->id), "%s-%016llx", prefix, (unsigned long long)c->rid);
    else
        snprintf(c->id, sizeof(c->id), "%s-%016llx%llx", prefix, (unsigned long long)env->id_nonce,
                 (unsigned long long)c->rid);
    log_rdebug(c->rid, "admitted: %d prompt tokens, max_tokens %d, temperature %.3g, %s%s", n,
               r.max_tokens, r.temperature, r.stream ? "stream" : "json",
               r.offline ? ", offline (flex)" : "");
    if (env->stats)
        stats_request_received(env->stats);
    c->next = list->head;
    if (list->head)
        list->head->prev = c;
    list->head = c;
    list->n++;
    free(tokens);
    api_request_free(&r);
    *out = c;
    return COMPLETION_OK;

oom:
    api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
refused:
    if (c) {
        stream_destroy(&c->stream);
        free(c);
    }
    free(tokens);
    api_request_free(&r);
    if (env->stats && !env->batch_line) {
        stats_request_received(env->stats);
        stats_request_rejected(env->stats);
    }
    return rc;
}

/* The owner ends the request: cancelled in the cluster, counted as cancelled when why is
 * not NULL, freed. */
static void drop(completion_t **pc, int status, const char *why)
{
    if (!pc || !*pc)
        return;
    completion_t *c = *pc;
    *pc = NULL;
    if (c->env->cluster)
        cluster_cancel(c->env->cluster, c->rid);
    if (why)
        log_end(c, status, STATS_END_CANCELLED, why);
    completion_free(c);
}

void completion_cancel(completion_t **c, int status, const char *why)
{
    drop(c, status, why ? why : "cancelled");
}

void completion_destroy(completion_t **c)
{
    drop(c, 0, NULL);
}

// --- accessors

void *completion_ud(const completion_t *c)
{
    return c->ud;
}

completion_t *completion_next(const completion_t *c)
{
    return c->next;
}

uint64_t completion_rid(const completion_t *c)
{
    return c->rid;
}

const char *completion_id(const completion_t *c)
{
    return c->id;
}

int completion_streaming(const completion_t *c)
{
    return c->streaming;
}

api_response_info completion_info(const completion_t *c)
{
    api_response_info info = {
        .kind = c->kind,
        .id = c->id,
        .created = c->created,
        .model = c->env->model,
        .include_usage = c->include_usage,
        .service_tier = c->flex ? "flex" : "default",
    };
    return info;
}

void completion_usage(const completion_t *c, int *n_prompt, int *n_completion)
{
    *n_prompt = c->n_prompt;
    *n_completion = stream_n_tokens(c->stream);
}

char *completion_format_response(const completion_t *c, const char *finish_reason)
{
    size_t len;
    const char *text = stream_out(c->stream, &len);
    api_response_info info = completion_info(c);
    return api_format_response(&info, text, len, finish_reason, c->n_prompt,
                               stream_n_tokens(c->stream));
}
