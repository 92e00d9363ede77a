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

/* One sequence of a request: a prompt's choice i, its own cluster request. */
typedef struct {
    struct completion *c;      /* the parent */
    int index;                 /* the choice's "index": n x prompt + i */
    uint64_t rid;              /* 0 until submitted */
    stream_t *stream;          /* its text and token count */
    int n_prompt, max_tokens;  /* tokens (BOS included); settled max_tokens */
    const char *finish_reason; /* static; NULL while it runs */
    int64_t t_first_us;        /* first tokens at the gateway (0 = none yet) */
    int64_t t_last_us;         /* latest tokens at the gateway */
    cluster_req_timing timing; /* filled by the cluster */
    /* log-probabilities (the request asked for them): one entry per counted token, in
     * order; kept across retries (they came with the tokens) */
    api_logprob *lpe;
    int n_lpe, cap_lpe;
    int prev_token;      /* the token before the next one (its text: tokenizer_piece) */
    int lp_sent;         /* streaming: entries given to the sink */
    int lp_offset;       /* streaming: text_offset of lpe[lp_sent] */
    int echo_sent;       /* streaming: the echo chunk went out (before the answer's text) */
    api_logprobs chunk;  /* streaming: the entries of the text() call in progress */
    double cum_logprob;  /* the sum of the kept entries' logprobs (best_of's ranking) */
    /* echo: the prompt's text and, with logprobs, its tokens' entries (plpe[0] null) */
    char *echo_text;
    size_t echo_len;
    api_logprob *plpe;   /* (n_prompt,) or NULL */
    int *prompt_ids;     /* (n_prompt,) with plpe */
} choice_t;

struct completion {
    struct completion *prev, *next; /* in list */
    completion_list *list;          /* the owner's requests in flight (borrowed) */
    const completion_env *env;      /* borrowed */
    const completion_sink *sink;
    void *ud; /* the sink's; owned from admission on (sink->release) */
    api_kind_t kind;
    int streaming, include_usage;
    int offline;              /* runs in the offline tier (flex, batch lines) */
    int flex;                 /* asked for service_tier "flex": reported in every body */
    int n_choices, n_running; /* sequences; those not ended yet */
    int n_per_prompt;         /* sequences per prompt: "best_of" (= "n" unless larger) */
    int n_best;               /* "n": of them, the choices answered (the best by cumulative
                               * log-probability when fewer than n_per_prompt) */
    int logprobs;             /* 0, or alternatives shown + 1 (api_request.logprobs) */
    int lp_asked;             /* 0, or alternatives asked of the workers + 1: logprobs, or 1
                               * for best_of > n alone */
    int echo;                 /* completions "echo" */
    choice_t *choices;        /* [n_choices], in index order */
    char id[48];
    int64_t created; /* unix seconds */
    completion_params params; /* as asked (instructions owned) */
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

/* A sequence ends: count it in the stats and (HTTP) log its one summary line (INFO) with
 * the phases of its time to first token (docs/stats.md). how: the finish reason (FINISHED)
 * or the error message. */
static void log_end(const choice_t *ch, int status, stats_end_t end, const char *how)
{
    const completion_t *c = ch->c;
    int64_t now = proto_now_us();
    int n_out = ch->stream ? stream_n_tokens(ch->stream) : 0;
    stats_request sr = {.rid = ch->rid,
                        .how = end,
                        .finish_reason = end == STATS_END_FINISHED ? how : NULL,
                        .status = status,
                        .error = end == STATS_END_FAILED ? how : NULL,
                        .n_prompt = ch->n_prompt,
                        .n_output = n_out,
                        .t_first_us = ch->t_first_us,
                        .t_last_us = ch->t_last_us,
                        .t_end_us = now,
                        .timing = &ch->timing,
                        .offline = c->offline};
    stats_breakdown b;
    if (c->env->stats)
        stats_request_end(c->env->stats, &sr, &b);
    else
        stats_breakdown_of(&sr, &b);
    if (c->env->batch_line)
        return;
    char q[24], p[24], x[24], d[24], t[24], e[24], idx[32] = "";
    if (c->n_choices > 1)
        snprintf(idx, sizeof(idx), " choice=%d/%d", ch->index, c->n_choices);
    log_rinfo(ch->rid,
              "request end: %s %s%s status=%d finish=%s prompt_tokens=%d output_tokens=%d "
              "queue_ms=%s prefill_ms=%s transfer_ms=%s first_decode_ms=%s ttft_ms=%s "
              "e2e_ms=%s prefill=%s decode=%s attempts=%d%s%s%s",
              c->kind == API_CHAT        ? "/v1/chat/completions"
              : c->kind == API_RESPONSES ? "/v1/responses"
                                         : "/v1/completions",
              c->streaming ? "stream" : "json", idx, status,
              end == STATS_END_FINISHED    ? how
              : end == STATS_END_CANCELLED ? "abort"
                                           : "error",
              ch->n_prompt, n_out, ms_str(q, sizeof(q), b.queue_ms),
              ms_str(p, sizeof(p), b.prefill_ms), ms_str(x, sizeof(x), b.transfer_ms),
              ms_str(d, sizeof(d), b.first_decode_ms), ms_str(t, sizeof(t), b.ttft_ms),
              ms_str(e, sizeof(e), b.e2e_ms),
              ch->timing.prefill_worker[0] ? ch->timing.prefill_worker : "-",
              ch->timing.decode_worker[0] ? ch->timing.decode_worker : "-", ch->timing.attempts,
              end == STATS_END_FINISHED ? "" : " reason=\"", end == STATS_END_FINISHED ? "" : how,
              end == STATS_END_FINISHED ? "" : "\"");
}

/* Free the choices' streams and the array (also for a request never admitted). */
static void choices_free(completion_t *c)
{
    for (int i = 0; c->choices && i < c->n_choices; i++) {
        stream_destroy(&c->choices[i].stream);
        free(c->choices[i].lpe);
        free(c->choices[i].echo_text);
        free(c->choices[i].plpe);
        free(c->choices[i].prompt_ids);
    }
    free(c->choices);
    c->choices = NULL;
}

/* Out of the owner's list, then the sink's state goes (sink->release). */
static void owner_release(completion_t *c)
{
    if (c->prev)
        c->prev->next = c->next;
    else
        c->list->head = c->next;
    if (c->next)
        c->next->prev = c->prev;
    c->list->n--;
    c->prev = c->next = NULL;
    c->sink->release(c->ud);
    c->ud = NULL;
}

/* The one place an admitted completion is freed: out of its list, then the sink's state
 * goes last. */
static void completion_free(completion_t *c)
{
    owner_release(c);
    choices_free(c);
    free((char *)c->params.instructions);
    free(c);
}

/* The sequences still running are cancelled in the cluster and, when why is not NULL,
 * counted as cancelled with status. Only from outside the cluster's callbacks (the
 * cluster may be walking its lists then). */
static void cancel_running(completion_t *c, int status, const char *why)
{
    for (int i = 0; i < c->n_choices; i++) {
        choice_t *ch = &c->choices[i];
        if (ch->finish_reason || !ch->rid)
            continue;
        if (c->env->cluster)
            cluster_cancel(c->env->cluster, ch->rid);
        if (why)
            log_end(ch, status, STATS_END_CANCELLED, why);
        ch->finish_reason = API_FINISH_STOP; /* (ended: not cancelled twice) */
    }
    c->n_running = 0;
}

/* Streaming: hand the text the stream released to the sink. Collecting: it stays in the
 * stream for completion_format_response. */
/* Streaming echo: the prompt's text (and, with logprobs, its entries) as the choice's first
 * chunk, before any of the answer's. Every prompt position's log-probabilities have arrived
 * by then: the prefill worker sends them before the first token, on the same connection. */
static void flush_echo(choice_t *ch)
{
    completion_t *c = ch->c;
    ch->echo_sent = 1;
    int n_lp = c->logprobs && ch->plpe ? ch->n_prompt : 0;
    ch->chunk = (api_logprobs){.e = ch->plpe, .n = n_lp, .top = c->logprobs - 1, .text_offset = 0};
    c->sink->text(c->ud, c, ch->index, ch->echo_text, ch->echo_len);
    for (int i = 0; i < n_lp; i++)
        ch->lp_offset += api_token_chars(ch->plpe[i].text, ch->plpe[i].len);
    ch->chunk = (api_logprobs){0};
}

static void flush_text(choice_t *ch, int final)
{
    completion_t *c = ch->c;
    if (c->streaming && ch->echo_text && !ch->echo_sent)
        flush_echo(ch);
    size_t len;
    const char *out = stream_out(ch->stream, &len);
    /* the log-probabilities of the tokens so far go with the text they released; the last
     * flush sends what is left even without text (a stop string ate it) */
    int n_lp = c->logprobs ? ch->n_lpe - ch->lp_sent : 0;
    if (!c->streaming || (len == 0 && !(final && n_lp > 0)))
        return;
    ch->chunk = (api_logprobs){.e = ch->lpe + ch->lp_sent,
                               .n = n_lp,
                               .top = c->logprobs - 1,
                               .text_offset = ch->lp_offset};
    c->sink->text(c->ud, c, ch->index, out, len);
    for (int i = 0; i < n_lp; i++)
        ch->lp_offset += api_token_chars(ch->chunk.e[i].text, ch->chunk.e[i].len);
    ch->lp_sent += n_lp;
    ch->chunk = (api_logprobs){0};
    stream_out_clear(ch->stream);
}

/* Keep token's log-probabilities (lp, from the worker) as the answer shows them: its text
 * and its alternatives' follow ch->prev_token. 0, or -1 out of memory. */
static int keep_logprob(choice_t *ch, int token, const proto_logprob *lp)
{
    const tokenizer_t *tok = ch->c->env->tok;
    if (ch->n_lpe == ch->cap_lpe) {
        int cap = ch->cap_lpe ? 2 * ch->cap_lpe : 16;
        api_logprob *p = realloc(ch->lpe, (size_t)cap * sizeof(*p));
        if (!p)
            return -1;
        ch->lpe = p;
        ch->cap_lpe = cap;
    }
    api_logprob *x = &ch->lpe[ch->n_lpe++];
    x->text = tokenizer_piece(tok, ch->prev_token, token, &x->len);
    x->null_logprob = 0;
    x->logprob = lp->logprob;
    ch->cum_logprob += lp->logprob;
    x->n_top = 0;
    for (int j = 0; j < lp->n_top && j < API_MAX_TOP_LOGPROBS_CHAT; j++, x->n_top++) {
        x->top_text[j] = tokenizer_piece(tok, ch->prev_token, lp->top_ids[j], &x->top_len[j]);
        x->top_logprob[j] = lp->top_logprobs[j];
    }
    return 0;
}

/* A sequence is complete: the rest of its text, its end (streaming); when it was the last,
 * the end of the answer, and the request is freed. */
static void finish(choice_t *ch, const char *finish_reason)
{
    completion_t *c = ch->c;
    flush_text(ch, 1);
    ch->finish_reason = finish_reason;
    c->n_running--;
    if (c->sink->choice_end)
        c->sink->choice_end(c->ud, c, ch->index, finish_reason);
    if (c->n_running > 0) {
        log_end(ch, 200, STATS_END_FINISHED, finish_reason);
        return;
    }
    api_error e;
    if (c->sink->done(c->ud, c, &e) == 0)
        log_end(ch, 200, STATS_END_FINISHED, finish_reason);
    else
        log_end(ch, e.status, STATS_END_FAILED, e.message);
    completion_free(c);
}

/* A sequence failed after admission (its retries spent): the sink reports e for the whole
 * request, and the request ends. This is a cluster callback (maybe inside a walk of its
 * lists): the other choices are cancelled with cluster_cancel_soon, which drops their
 * callbacks now and sends their CANCELs from the event loop right after, queued or
 * running, stuck or not. */
static void fail_with(choice_t *ch, const api_error *e)
{
    completion_t *c = ch->c;
    ch->finish_reason = API_FINISH_STOP;
    c->n_running--;
    stats_end_t how = c->sink->fail(c->ud, c, e);
    log_end(ch, e->status, how, e->message);
    for (int i = 0; i < c->n_choices && c->n_running > 0; i++) {
        choice_t *o = &c->choices[i];
        if (o->finish_reason || !o->rid)
            continue;
        if (c->env->cluster)
            cluster_cancel_soon(c->env->cluster, o->rid);
        log_end(o, 499, STATS_END_CANCELLED, "another choice of the request failed");
        o->finish_reason = API_FINISH_STOP;
        c->n_running--;
    }
    completion_free(c);
}

// --- cluster callbacks (ud: the choice_t)

static int on_tokens(void *ud, const int *tokens, const proto_logprob *lps, int n)
{
    choice_t *ch = ud;
    completion_t *c = ch->c;
    stats_t *stats = c->env->stats;
    int64_t now = proto_now_us();
    if (!ch->t_first_us) {
        ch->t_first_us = now;
        if (stats && !c->offline) /* offline waits stay out of the online figures */
            stats_first_token(stats, &ch->timing, now);
    } else if (stats && !c->offline) {
        stats_tokens(stats, &ch->timing, (double)(now - ch->t_last_us) / 1e6, now);
    }
    ch->t_last_us = now;
    api_error e;
    for (int i = 0; i < n; i++) {
        int counted = stream_n_tokens(ch->stream);
        stream_status_t st = stream_push(ch->stream, tokens[i]);
        /* a token the answer counts (not EOS) has its log-probabilities shown */
        if (c->lp_asked && lps && stream_n_tokens(ch->stream) > counted &&
            keep_logprob(ch, tokens[i], &lps[i]) < 0)
            st = STREAM_ERR;
        ch->prev_token = tokens[i];
        if (st == STREAM_STOP) {
            finish(ch, API_FINISH_STOP);
            return 1;
        }
        if (st == STREAM_ERR) {
            api_error_set(&e, 500, "server_error", NULL, NULL, "out of memory");
            fail_with(ch, &e);
            return 1;
        }
    }
    if (stream_n_tokens(ch->stream) >= ch->max_tokens) {
        stream_status_t st = stream_finish(ch->stream);
        finish(ch, st == STREAM_STOP ? API_FINISH_STOP : API_FINISH_LENGTH);
        return 1;
    }
    flush_text(ch, 0);
    if (c->sink->check && c->sink->check(c->ud, c, &e) < 0) {
        fail_with(ch, &e);
        return 1;
    }
    return 0;
}

/* Echo: prompt tokens [index, index + n)'s log-probabilities; kept as their entries (the
 * first time a position is reported; positions past the prompt, a retry's generated
 * tokens, are not the prompt's). */
static void on_prompt_logprobs(void *ud, int index, const int *tokens, const proto_logprob *lps,
                               int n)
{
    choice_t *ch = ud;
    if (!ch->plpe)
        return;
    const tokenizer_t *tok = ch->c->env->tok;
    for (int i = 0; i < n && index + i < ch->n_prompt; i++) {
        int pos = index + i;
        api_logprob *x = &ch->plpe[pos];
        if (tokens[i] != ch->prompt_ids[pos]) /* not this prompt's token: never trusted */
            continue;
        x->null_logprob = 0;
        x->logprob = lps[i].logprob;
        x->n_top = 0;
        for (int j = 0; j < lps[i].n_top && j < API_MAX_TOP_LOGPROBS_CHAT; j++, x->n_top++) {
            x->top_text[j] = tokenizer_piece(tok, ch->prompt_ids[pos - 1], lps[i].top_ids[j],
                                             &x->top_len[j]);
            x->top_logprob[j] = lps[i].top_logprobs[j];
        }
    }
}

static void on_finish(void *ud, int reason)
{
    choice_t *ch = ud;
    stream_status_t st = stream_finish(ch->stream);
    finish(ch,
           st == STREAM_STOP || reason == PROTO_FINISH_STOP ? API_FINISH_STOP : API_FINISH_LENGTH);
}

static void on_error(void *ud, int status, const char *type, const char *code, const char *msg)
{
    api_error e;
    api_error_set(&e, status, type, NULL, code, "%s", msg);
    fail_with(ud, &e);
}

static const cluster_callbacks callbacks = {.on_tokens = on_tokens,
                                            .on_prompt_logprobs = on_prompt_logprobs,
                                            .on_finish = on_finish,
                                            .on_error = on_error};

const cluster_callbacks *completion_callbacks(void)
{
    return &callbacks;
}

// --- admission

/* Echo: ch's prompt text (a text prompt's as given; token ids: their pieces, made valid
 * UTF-8) and, with logprobs, its entries: each token's text, the first one's value null
 * (filled by on_prompt_logprobs as the workers report them; a position never reported
 * stays null). 0, or -1 out of memory. */
static int echo_setup(choice_t *ch, const tokenizer_t *tok, api_prompt pr, const int *ids, int n,
                      int logprobs)
{
    if (pr.text) {
        if (!(ch->echo_text = malloc(pr.len + 1)))
            return -1;
        memcpy(ch->echo_text, pr.text, pr.len);
        ch->echo_len = pr.len;
        ch->echo_text[ch->echo_len] = 0;
    } else if (!(ch->echo_text = stream_text_of(tok, -1, ids, n, &ch->echo_len))) {
        return -1; /* bytes of no whole character: U+FFFD, as in the completion's text */
    }
    if (!logprobs)
        return 0;
    ch->plpe = calloc((size_t)n, sizeof(*ch->plpe));
    ch->prompt_ids = malloc((size_t)n * sizeof(int));
    if (!ch->plpe || !ch->prompt_ids)
        return -1;
    memcpy(ch->prompt_ids, ids, (size_t)n * sizeof(int));
    for (int i = 0; i < n; i++) {
        ch->plpe[i].text = tokenizer_piece(tok, i ? ids[i - 1] : -1, ids[i], &ch->plpe[i].len);
        ch->plpe[i].null_logprob = 1;
    }
    return 0;
}

/* Tokenize prompt p (BOS + text; a token-id prompt: its ids, each checked against the
 * vocabulary). malloc'd ids and their count, or NULL (out of memory, tokenizer failure, an
 * id out of the vocabulary) with e set. */
static int *tokenize(const tokenizer_t *tok, const api_prompt *p, int *n_out, api_error *e)
{
    if (p->ids) {
        int n = p->n_ids, vocab = tokenizer_vocab_size(tok);
        for (int i = 0; i < n; i++)
            if (p->ids[i] >= vocab) {
                api_error_set(e, 400, "invalid_request_error", "prompt", "invalid_value",
                              "token id %d (element %d of 'prompt') is not in the model's "
                              "vocabulary of %d tokens.",
                              p->ids[i], i, vocab);
                return NULL;
            }
        int *ids = malloc((size_t)n * sizeof(int));
        if (!ids) {
            api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
            return NULL;
        }
        memcpy(ids, p->ids, (size_t)n * sizeof(int));
        *n_out = n;
        return ids;
    }
    int cap = (int)p->len + 8, needed = 0;
    int *tokens = malloc((size_t)cap * sizeof(int));
    if (!tokens) {
        api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        return NULL;
    }
    int n = tokenizer_encode(tok, p->text, p->len, 1, tokens, cap, &needed);
    if (n < 0 && needed > cap) {
        int *t = realloc(tokens, (size_t)needed * sizeof(int));
        if (!t) {
            free(tokens);
            api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
            return NULL;
        }
        tokens = t;
        n = tokenizer_encode(tok, p->text, p->len, 1, tokens, needed, &needed);
    }
    if (n < 0) {
        free(tokens);
        api_error_set(e, 500, "server_error", NULL, NULL, "tokenization failed");
        return NULL;
    }
    *n_out = n;
    return tokens;
}

/* In a batch, say which prompt an error is about. */
static void name_prompt(api_error *e, const api_request *r, int i)
{
    if (r->n_prompts < 2)
        return;
    size_t n = strlen(e->message);
    snprintf(e->message + n, sizeof(e->message) - n, " (prompt %d of the batch)", i);
}

/* Validate, tokenize and check every prompt of r against env, all of them before anything
 * is admitted (a batch with one prompt too long is refused as a whole): r->n_prompts
 * malloc'd token arrays (each freed by the caller, then the array) with their counts and
 * settled max_tokens in n[] and max_tokens[] (r->n_prompts each, the caller's), or NULL
 * with e set. */
static int **admissible(const completion_env *env, api_kind_t kind, const char *body, size_t len,
                        api_request *r, int **n, int **max_tokens, int *asked, api_error *e)
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
    const char *pkey = kind == API_CHAT ? "messages" : kind == API_RESPONSES ? "input" : "prompt";
    int np = r->n_prompts, max_asked = r->max_tokens;
    *asked = max_asked;
    int **toks = calloc((size_t)np, sizeof(int *));
    *n = calloc((size_t)np, sizeof(int));
    *max_tokens = calloc((size_t)np, sizeof(int));
    if (!toks || !*n || !*max_tokens) {
        api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        goto fail;
    }
    for (int i = 0; i < np; i++) {
        api_prompt p = api_request_prompt(r, i);
        /* A token spells at least one byte and at most max_piece bytes, so a prompt this
         * long cannot fit; refuse it before spending time on tokenizing it. */
        if (p.len / (size_t)env->max_piece >= (size_t)env->n_ctx) {
            api_error_set(e, 400, "invalid_request_error", pkey, "context_length_exceeded",
                          "This model's maximum context length is %d tokens, but the prompt "
                          "is at least %zu tokens.",
                          env->n_ctx, p.len / (size_t)env->max_piece + 1);
            name_prompt(e, r, i);
            goto fail;
        }
        if (!(toks[i] = tokenize(env->tok, &p, &(*n)[i], e))) {
            name_prompt(e, r, i);
            goto fail;
        }
        /* api_check_length reads the prompt of r and settles r->max_tokens: a view of
         * prompt i with the max_tokens asked */
        api_request v = *r;
        v.prompt = p.text, v.prompt_len = p.len, v.prompt_ids = p.ids, v.n_prompt_ids = p.n_ids;
        v.max_tokens = max_asked;
        if (api_check_length(&v, (*n)[i], env->n_ctx, e) < 0) {
            name_prompt(e, r, i);
            goto fail;
        }
        (*max_tokens)[i] = v.max_tokens;
    }
    if (api_check_sampling(r, tokenizer_vocab_size(env->tok), e) < 0)
        goto fail;
    r->max_tokens = (*max_tokens)[0];
    if (!env->cluster) {
        api_error_set(e, 503, "server_error", NULL, "not_ready", "the server is starting");
        goto fail;
    }
    return toks;
fail:
    for (int i = 0; toks && i < np; i++)
        free(toks[i]);
    free(toks);
    free(*n);
    free(*max_tokens);
    *n = *max_tokens = NULL;
    return NULL;
}

/* A seed of its own for each sequence without one asked for. */
static uint64_t random_seed(const void *salt)
{
    uint64_t seed;
    if (getrandom(&seed, sizeof(seed), 0) != (ssize_t)sizeof(seed))
        seed = (uint64_t)proto_now_us() ^ ((uint64_t)(uintptr_t)salt << 17);
    return seed;
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
    int *n = NULL, *max_tokens = NULL, np = 0;
    int max_asked = -1; /* max_tokens as asked (-1: absent), before admissible settles it */
    int **tokens = admissible(env, kind, body, len, &r, &n, &max_tokens, &max_asked, e);
    if (!tokens)
        goto refused;
    np = r.n_prompts;
    long long sum_prompt = 0, sum_max = 0;
    for (int i = 0; i < np; i++) {
        sum_prompt += n[i];
        sum_max += (long long)max_tokens[i] * r.best_of;
    }
    if (sink->admit && sink->admit(ud, (int)(sum_prompt > INT32_MAX ? INT32_MAX : sum_prompt),
                                   (int)(sum_max > INT32_MAX ? INT32_MAX : sum_max), e) < 0)
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
        .n_choices = np * r.best_of,
        .n_per_prompt = r.best_of,
        .n_best = r.n,
        .logprobs = r.logprobs,
        .echo = r.echo,
        /* ranking best_of > n needs every token's log-probability, asked for with none of
         * the alternatives when the client wants none shown */
        .lp_asked = r.logprobs ? r.logprobs : r.best_of > r.n ? 1 : 0,
        .created = (int64_t)time(NULL),
        .params = {.temperature = r.temperature,
                   .top_p = r.top_p,
                   .max_tokens = max_asked,
                   .store = r.store,
                   .instructions = r.instructions},
    };
    r.instructions = NULL; /* c's now */
    c->choices = calloc((size_t)c->n_choices, sizeof(choice_t));
    if (!c->choices)
        goto oom;
    for (int k = 0; k < c->n_choices; k++) {
        int p = k / r.best_of;
        choice_t *ch = &c->choices[k];
        ch->c = c;
        ch->index = k;
        ch->n_prompt = n[p];
        ch->max_tokens = max_tokens[p];
        ch->prev_token = tokens[p][n[p] - 1];
        ch->stream = stream_new(env->tok, tokens[p][n[p] - 1], tokenizer_eos(env->tok),
                                (const char *const *)r.stop, r.n_stop);
        if (!ch->stream)
            goto oom;
        stream_set_min_tokens(ch->stream, r.samp ? r.samp->min_tokens : 0);
        if (r.echo && echo_setup(ch, env->tok, api_request_prompt(&r, p), tokens[p], n[p],
                                 r.logprobs) < 0)
            goto oom;
    }

    /* Choice i of every prompt samples with seed + i (docs/api.md "seed"): a batch gives
     * each prompt what it gets alone, and n choices are distinct and reproducible. */
    for (int k = 0; k < c->n_choices; k++) {
        choice_t *ch = &c->choices[k];
        int p = k / r.best_of, i = k % r.best_of;
        uint64_t seed = r.has_seed ? r.seed + (uint64_t)i : random_seed(ch);
        cluster_job job = {
            .tokens = tokens[p],
            .n_tokens = n[p],
            .max_tokens = max_tokens[p],
            .temperature = (float)r.temperature,
            .top_p = (float)r.top_p,
            .top_k = r.top_k,
            .rng = sampler_seed_state(seed),
            .mtp_depth = r.mtp_depth >= 0 ? r.mtp_depth + 1 : 0,
            .samp = r.samp,
            .timing = &ch->timing,
            .offline = c->offline,
            .logprobs = c->lp_asked,
            .echo = r.echo && r.logprobs,
            .cb = &callbacks,
        };
        cluster_status_t st = cluster_submit(env->cluster, &job, ch, &ch->rid);
        if (st == CLUSTER_OK)
            continue;
        ch->rid = 0;
        for (int j = 0; j < k; j++) /* all or nothing: take back those submitted */
            cluster_cancel(env->cluster, c->choices[j].rid);
        if (st == CLUSTER_FULL) {
            api_error_set(e, 429, "rate_limit_error", NULL, "rate_limit_exceeded",
                          "The server is at capacity (the queue is full); retry later.");
            rc = COMPLETION_FULL;
            goto refused;
        }
        goto oom;
    }
    c->n_running = c->n_choices;
    uint64_t rid = c->choices[0].rid;
    const char *prefix = kind == API_CHAT        ? "chatcmpl-"
                         : kind == API_RESPONSES ? "resp_" /* OpenAI's spelling */
                                                 : "cmpl-";
    if (env->batch_line)
        snprintf(c->id, sizeof(c->id), "%s%016llx", prefix, (unsigned long long)rid);
    else
        snprintf(c->id, sizeof(c->id), "%s%016llx%llx", prefix, (unsigned long long)env->id_nonce,
                 (unsigned long long)rid);
    log_rdebug(rid,
               "admitted: %d prompt tokens, max_tokens %d, temperature %.3g, %s%s; %d prompts x "
               "n %d (rids from %llu)",
               n[0], max_tokens[0], r.temperature, r.stream ? "stream" : "json",
               r.offline ? ", offline (flex)" : "", np, r.n, (unsigned long long)rid);
    if (env->stats)
        for (int k = 0; k < c->n_choices; k++)
            stats_request_received(env->stats);
    c->next = list->head;
    if (list->head)
        list->head->prev = c;
    list->head = c;
    list->n++;
    for (int i = 0; i < np; i++)
        free(tokens[i]);
    free(tokens);
    free(n);
    free(max_tokens);
    api_request_free(&r);
    *out = c;
    return COMPLETION_OK;

oom:
    api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
refused:
    if (c) {
        choices_free(c);
        free((char *)c->params.instructions);
        free(c);
    }
    for (int i = 0; tokens && i < np; i++)
        free(tokens[i]);
    free(tokens);
    free(n);
    free(max_tokens);
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
    cancel_running(c, status, why);
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
    return c->choices[0].rid;
}

const char *completion_id(const completion_t *c)
{
    return c->id;
}

int completion_streaming(const completion_t *c)
{
    return c->streaming;
}

completion_params completion_request_params(const completion_t *c)
{
    return c->params;
}

int completion_n_choices(const completion_t *c)
{
    return c->n_choices;
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
    *n_prompt = *n_completion = 0;
    for (int k = 0; k < c->n_choices; k++) {
        const choice_t *ch = &c->choices[k];
        if (k % c->n_per_prompt == 0) /* a prompt counts once, whatever its n */
            *n_prompt += ch->n_prompt;
        *n_completion += stream_n_tokens(ch->stream);
    }
}

const char *completion_choice_text(const completion_t *c, int index, size_t *len,
                                   const char **finish_reason)
{
    const choice_t *ch = &c->choices[index];
    if (finish_reason)
        *finish_reason = ch->finish_reason;
    return stream_out(ch->stream, len);
}

/* Echo: o's text becomes the prompt's then the completion's, and lp (when shown) the
 * prompt's entries then the completion's; the two buffers made go to bufs[0..1] (the
 * caller frees them). 0, or -1 out of memory. */
static int echo_join(const choice_t *ch, api_choice *o, api_logprobs *lp, void **bufs)
{
    char *t = malloc(ch->echo_len + o->len + 1);
    if (!t)
        return -1;
    memcpy(t, ch->echo_text, ch->echo_len);
    memcpy(t + ch->echo_len, o->text, o->len);
    o->text = t;
    o->len += ch->echo_len;
    bufs[0] = t;
    if (!lp || !ch->plpe)
        return 0;
    api_logprob *e = malloc((size_t)(ch->n_prompt + ch->n_lpe) * sizeof(*e));
    if (!e)
        return -1;
    memcpy(e, ch->plpe, (size_t)ch->n_prompt * sizeof(*e));
    if (ch->n_lpe)
        memcpy(e + ch->n_prompt, ch->lpe, (size_t)ch->n_lpe * sizeof(*e));
    lp->e = e;
    lp->n = ch->n_prompt + ch->n_lpe;
    bufs[1] = e;
    return 0;
}

char *completion_format_response(const completion_t *c)
{
    api_choice stack[8],
        *chs = c->n_choices <= 8 ? stack : calloc((size_t)c->n_choices, sizeof(api_choice));
    if (!chs)
        return NULL;
    api_logprobs lstack[8], *lps = !c->logprobs ? NULL
                                 : c->n_choices <= 8 ? lstack
                                                     : calloc((size_t)c->n_choices, sizeof(*lps));
    if (c->logprobs && !lps) {
        if (chs != stack)
            free(chs);
        return NULL;
    }
    /* each prompt's n_best choices: all its sequences in order, or (best_of > n) the n_best
     * with the highest cumulative log-probability, best first (ties: the lower index) */
    int per = c->n_per_prompt, n_out = 0, n_heap = 0, ok = 1;
    /* echo: each answered choice's joined text and entries (2 buffers each) */
    void **heap = c->echo ? calloc((size_t)c->n_choices * 2, sizeof(void *)) : NULL;
    if (c->echo && !heap)
        ok = 0;
    for (int base = 0; ok && base < c->n_choices; base += per) {
        int picked[API_MAX_N];
        for (int r = 0; r < c->n_best; r++) {
            int best = -1;
            for (int k = base; k < base + per; k++) {
                int used = 0;
                for (int q = 0; q < r; q++)
                    used |= picked[q] == k;
                if (!used && (best < 0 || (per > c->n_best &&
                                           c->choices[k].cum_logprob > c->choices[best].cum_logprob)))
                    best = k;
            }
            picked[r] = best;
            api_choice *o = &chs[n_out];
            const choice_t *ch = &c->choices[best];
            o->text = completion_choice_text(c, best, &o->len, &o->finish_reason);
            o->logprobs = NULL;
            if (lps) {
                lps[n_out] = (api_logprobs){.e = ch->lpe, .n = ch->n_lpe, .top = c->logprobs - 1};
                o->logprobs = &lps[n_out];
            }
            if (ch->echo_text && echo_join(ch, o, lps ? &lps[n_out] : NULL, &heap[n_heap]) < 0)
                ok = 0;
            n_heap += ch->echo_text ? 2 : 0;
            n_out++;
        }
    }
    int n_prompt, n_completion;
    completion_usage(c, &n_prompt, &n_completion);
    api_response_info info = completion_info(c);
    char *body = ok ? api_format_response_n(&info, chs, n_out, n_prompt, n_completion) : NULL;
    for (int i = 0; i < n_heap; i++)
        free(heap[i]);
    free(heap);
    if (chs != stack)
        free(chs);
    if (lps && lps != lstack)
        free(lps);
    return body;
}

const api_logprobs *completion_chunk_logprobs(const completion_t *c, int index)
{
    if (!c->logprobs || index < 0 || index >= c->n_choices)
        return NULL;
    return &c->choices[index].chunk;
}

int completion_logprobs(const completion_t *c)
{
    return c->logprobs;
}
