/*
 * responses: the bodies of OpenAI's Responses API (POST /v1/responses), for text, with no
 * I/O: the response object and the streamed events. The request itself is parsed by
 * api_parse (API_RESPONSES: "input", "instructions", "max_output_tokens", ...) and runs
 * as a chat completion through completion.h; http_completion.c sends what these build.
 *
 * A stream is: response.created, response.in_progress, response.output_item.added,
 * response.content_part.added, response.output_text.delta (one per piece of text),
 * response.output_text.done, response.content_part.done, response.output_item.done,
 * then response.completed (or response.incomplete when max_output_tokens ended it); each
 * event has "type" and "sequence_number" (0, 1, ... in the stream), and is sent as
 * "event: <type>\ndata: <json>\n\n". A failure after the start is an "error" event, then
 * response.failed. A finished object is stored only when the gateway runs with
 * --responses-store (http_completion.c; "store" is echoed back either way, docs/api.md).
 */
#ifndef TP_GW_RESPONSES_H
#define TP_GW_RESPONSES_H

#include <stddef.h>
#include <stdint.h>

#include "api.h"

/* What every body and event of one response shares (strings borrowed). */
typedef struct {
    const char *id;           /* "resp_..." */
    const char *item_id;      /* the output message's id, "msg_..." */
    int64_t created_at;       /* unix seconds */
    const char *model;        /* the served model name */
    const char *instructions; /* as asked; NULL: null */
    int max_output_tokens;    /* as asked; -1: null */
    double temperature, top_p;
    int store;
    const char *service_tier; /* "default" / "flex"; NULL: none */
} responses_info;

/* The statuses of a response object. */
#define RESPONSES_IN_PROGRESS "in_progress"
#define RESPONSES_COMPLETED "completed"
#define RESPONSES_INCOMPLETE "incomplete" /* max_output_tokens reached */
#define RESPONSES_FAILED "failed"

/* The status of a response whose one choice ended with finish_reason (api.h). */
const char *responses_status(const char *finish_reason);

/* The response object with status: in_progress gives "output": [] and "usage": null;
 * completed / incomplete the one message with text (len bytes of valid UTF-8) and usage
 * {input_tokens, output_tokens, total_tokens, ...}; failed: "error" from err (not NULL
 * then). malloc'd; NULL on out of memory or invalid UTF-8. */
char *responses_format_object(const responses_info *info, const char *status, const char *text,
                              size_t len, int n_input, int n_output, const api_error *err);

/* A lifecycle event {"type", "sequence_number": seq, "response": object} (type
 * "response.created" / ".in_progress" / ".completed" / ".incomplete" / ".failed"; the
 * object as responses_format_object with the same arguments). malloc'd; NULL on OOM. */
char *responses_event_response(const responses_info *info, const char *type, int seq,
                               const char *status, const char *text, size_t len, int n_input,
                               int n_output, const api_error *err);

/* response.output_item.added (status RESPONSES_IN_PROGRESS: the message, no content yet)
 * or response.output_item.done (status completed / incomplete: the message with its text).
 * malloc'd; NULL on OOM. */
char *responses_event_item(const responses_info *info, const char *status, int seq,
                           const char *text, size_t len);

/* response.content_part.added (done = 0: empty text) or .done (done = 1: with text).
 * malloc'd; NULL on OOM. */
char *responses_event_part(const responses_info *info, int done, int seq, const char *text,
                           size_t len);

/* response.output_text.delta (done = 0: "delta": text) or response.output_text.done
 * (done = 1: "text": all of it). malloc'd; NULL on OOM or invalid UTF-8. */
char *responses_event_text(const responses_info *info, int done, int seq, const char *text,
                           size_t len);

/* The "error" event {"type": "error", "sequence_number", "code", "message", "param"}.
 * malloc'd; NULL on OOM. */
char *responses_event_error(int seq, const api_error *err);

#endif
