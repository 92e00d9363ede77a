/*
 * traceline: the request traces of tidepool-sim --trace and tidepool-bench --trace, read
 * line by line by one parser, so that a file means the same to the simulator and the
 * load client (docs/workloads.md).
 *
 * Format: one request per line; blank lines and lines starting with # are skipped.
 *   CSV:   arrival_s,prompt_tokens,output_tokens[,class]   (a header line is allowed as
 *          the first request line: one whose arrival_s is not a number)
 *   JSONL: {"arrival_s": 0.5, "prompt_tokens": 900, "output_tokens": 40, "class": "online"}
 * arrival_s is a finite number >= 0 (seconds); the token counts are whole numbers in
 * [1, 1e9]. class is "online" (default; also "0", "default", "auto", "interactive") or
 * "offline" ("1", "flex", "batch"), case-insensitive; JSON also takes "service_tier" for
 * it, or "offline": a boolean (or an integer, nonzero = offline), which wins.
 *
 * A reader (traceline_open) returns the requests in file order; sorting by arrival is the
 * caller's. Every refusal is "PATH:LINE: reason" (or "PATH: reason"), the reasons fixed
 * texts (tests/unit/test_traceline.c lists them). Not thread-safe; one reader per file.
 */
#ifndef TP_TRACELINE_H
#define TP_TRACELINE_H

#include <stddef.h>

/* One request of a trace. */
typedef struct {
    double arrival_s;        /* seconds after the start, finite, >= 0 */
    long long prompt_tokens; /* [1, 1e9] */
    long long output_tokens; /* [1, 1e9] */
    int offline;             /* 1: the offline class */
    size_t line;             /* its line number in the file, from 1 */
} traceline_req;

typedef struct traceline_reader traceline_reader_t;

/* Parse one line (not blank, not a comment; modified in place: CSV fields are cut at the
 * commas) into *q (q->line untouched). Returns 0; 1 when it is a CSV line whose arrival_s
 * is not a number (a header, if it is the first request line; *why = "arrival_s is not a
 * number" otherwise); -1 with the reason in *why (static text). */
int traceline_parse(char *line, traceline_req *q, const char **why);

/* The class named s (surrounding blanks ignored; "" is online) into *offline. Returns 0,
 * or -1 for an unknown name. */
int traceline_class(const char *s, int *offline);

/* Open the trace at path. Returns the reader (the caller's: traceline_close), or NULL with
 * "PATH: strerror" (or "PATH: out of memory") in err. */
traceline_reader_t *traceline_open(const char *path, char *err, size_t err_len);

/* The next request into *q, skipping blank lines, comments and a leading CSV header.
 * Returns 1; 0 at the end of the file; -1 with "PATH:LINE: reason" (a bad line) or
 * "PATH: read error" in err. */
int traceline_next(traceline_reader_t *r, traceline_req *q, char *err, size_t err_len);

/* Close; takes NULL and NULLs *r. */
void traceline_close(traceline_reader_t **r);

#endif
