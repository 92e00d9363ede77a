/*
 * log: the one logging path of every tidepool process.
 *
 * Each line goes to stderr as
 *   2026-11-30T06:10:00.123Z INFO  decode_worker[1234] req=42 message
 * Level-checked before formatting, printf-checked by the compiler. Library code logs only
 * through these macros (it never prints on its own). Thread-safe: one write(2) per line.
 */
#ifndef TP_LOG_H
#define TP_LOG_H

#include <stdint.h>

typedef enum {
    LOG_LEVEL_DEBUG = 0,
    LOG_LEVEL_INFO,
    LOG_LEVEL_WARN,
    LOG_LEVEL_ERROR,
} log_level_t;

/* Set the role printed on every line (copied, at most 31 bytes) and the minimum level.
 * Call once at start-up before other threads exist. */
void log_init(const char *role, log_level_t min_level);

/* Parse "debug" | "info" | "warn" | "error"; returns -1 for anything else. */
int log_level_parse(const char *name, log_level_t *out);

extern log_level_t log_min_level;

/* Write one line. req_id 0 means "no request". Use the macros below instead. */
void log_write(log_level_t level, uint64_t req_id, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define LOG_AT(lvl, rid, ...) \
    do { if ((lvl) >= log_min_level) log_write((lvl), (rid), __VA_ARGS__); } while (0)

#define log_debug(...) LOG_AT(LOG_LEVEL_DEBUG, 0, __VA_ARGS__)
#define log_info(...)  LOG_AT(LOG_LEVEL_INFO, 0, __VA_ARGS__)
#define log_warn(...)  LOG_AT(LOG_LEVEL_WARN, 0, __VA_ARGS__)
#define log_error(...) LOG_AT(LOG_LEVEL_ERROR, 0, __VA_ARGS__)
/* Request-scoped variants: the line carries req=<id>. */
#define log_rdebug(rid, ...) LOG_AT(LOG_LEVEL_DEBUG, (rid), __VA_ARGS__)
#define log_rinfo(rid, ...)  LOG_AT(LOG_LEVEL_INFO, (rid), __VA_ARGS__)
#define log_rwarn(rid, ...)  LOG_AT(LOG_LEVEL_WARN, (rid), __VA_ARGS__)
#define log_rerror(rid, ...) LOG_AT(LOG_LEVEL_ERROR, (rid), __VA_ARGS__)

/* Always-on assertion for programmer errors (never for bad input from a peer). */
#define ASSERT(cond) \
    do { if (!(cond)) log_assert_fail(#cond, __FILE__, __LINE__); } while (0)
void log_assert_fail(const char *expr, const char *file, int line) __attribute__((noreturn));

#endif
