/*
 * stream: incremental detokenization with stop strings, for one request.
 *
 * Tokens go in one at a time; text comes out only when it is final:
 *   - bytes are released only as whole UTF-8 characters (a character split across byte
 *     tokens is held until complete; malformed bytes become U+FFFD), so every piece of
 *     output is valid UTF-8 and can go into a JSON string;
 *   - the longest tail that could be the start of a stop string is held back, so a stop
 *     string spanning several tokens is never sent; when one matches, the text before it
 *     is released, the stop string and everything after it are dropped, and the stream
 *     ends with STREAM_STOP;
 *   - the EOS token ends the stream with STREAM_STOP (its text is empty).
 * stream_finish() releases what is held back once the request ended for another reason
 * (length, error). Output accumulates in an internal buffer read with stream_out() and
 * emptied with stream_out_clear(). Not thread-safe; one stream per request.
 */
#ifndef TP_GW_STREAM_H
#define TP_GW_STREAM_H

#include <stddef.h>

#include "tokenizer.h"

typedef struct stream stream_t;

typedef enum {
    STREAM_CONTINUE = 0, /* more tokens welcome */
    STREAM_STOP = 1,     /* EOS or a stop string: the request is complete (finish "stop") */
    STREAM_ERR = -1,     /* out of memory */
} stream_status_t;

/* New stream. tok is borrowed (must outlive the stream). prev_token: the last prompt token
 * (for tokenizer_piece's after-BOS rule), or -1. stops: n_stops strings (copied; empty
 * strings are ignored). eos: the EOS id (-1 = none). NULL on out of memory. */
stream_t *stream_new(const tokenizer_t *tok, int prev_token, int eos, const char *const *stops,
                     int n_stops);
/* Free; takes NULL and NULLs *s. */
void stream_destroy(stream_t **s);

/* Feed one generated token. Returns STREAM_CONTINUE, STREAM_STOP (the stream is now
 * finished; further pushes are ignored and return STREAM_STOP) or STREAM_ERR. */
stream_status_t stream_push(stream_t *s, int token);

/* Release everything held back (an incomplete UTF-8 tail becomes U+FFFD). A stop string
 * can still match here (then its text and what follows are dropped). Idempotent. */
stream_status_t stream_finish(stream_t *s);

/* Text released so far and not yet cleared: borrowed, *len bytes of valid UTF-8,
 * NUL-terminated. Valid until the next call on s. */
const char *stream_out(const stream_t *s, size_t *len);
/* Forget the text released so far (the caller has sent it); what is held back stays. */
void stream_out_clear(stream_t *s);

/* The text of n token ids as a completion streams it (whole characters; malformed or
 * cut bytes as U+FFFD, one per maximal ill-formed subsequence), EOS included as no text
 * and without stop strings: an echoed token-id prompt, POST /detokenize. prev_token as
 * stream_new's. malloc'd, NUL-terminated, its length in *len; NULL on out of memory. */
char *stream_text_of(const tokenizer_t *tok, int prev_token, const int *ids, int n, size_t *len);

/* A stop string completed by one of the first min_tokens tokens does not count (the
 * request's min_tokens: vLLM checks stop strings only after them, as EOS and
 * stop_token_ids are masked). Default 0. */
void stream_set_min_tokens(stream_t *s, int min_tokens);

/* Tokens pushed that counted: up to and including the one that completed a stop string;
 * EOS is not counted. */
int stream_n_tokens(const stream_t *s);
/* 1 once the stream ended with STREAM_STOP. */
int stream_stopped(const stream_t *s);

#endif
