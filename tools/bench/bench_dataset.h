/*
 * bench_dataset: the prompts of tidepool-bench --dataset, a JSONL file with one request
 * body per line: {"prompt": "...", "max_tokens": N} or, for a chat endpoint,
 * {"messages": [...]} (other fields are sent as they are). The whole file (up to the
 * number of requests) is parsed and checked at start-up, so a bad line stops the run
 * before anything is sent; lines are used in file order (bench_workload.h cycles them).
 */
#ifndef TP_BENCH_DATASET_H
#define TP_BENCH_DATASET_H

#include <jansson.h>
#include <stddef.h>

typedef struct bench_dataset bench_dataset_t;

/* Load at most max_items non-blank lines of the JSONL file at path. Each must be an object
 * with a string "prompt" or a non-empty array "messages" (the latter only when chat is
 * set), and an optional integer "max_tokens" >= 1. Returns the dataset (>= 1 item, the
 * caller's), or NULL with a message naming the file (and line) in err: cannot open, a
 * line that is not a JSON object or breaks a rule above, a read error, no prompts, out of
 * memory. */
bench_dataset_t *bench_dataset_load(const char *path, size_t max_items, int chat, char *err,
                                    size_t err_len);

/* Free; takes NULL and NULLs *ds. */
void bench_dataset_destroy(bench_dataset_t **ds);

/* Number of items (>= 1). */
size_t bench_dataset_size(const bench_dataset_t *ds);

/* Item i (i < bench_dataset_size), the object of its line; borrowed, valid until the
 * dataset is destroyed. */
const json_t *bench_dataset_item(const bench_dataset_t *ds, size_t i);

#endif
