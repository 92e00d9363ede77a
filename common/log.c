/* log: see log.h. Lines are formatted into a stack buffer and written with one write(2)
 * so that lines from different threads never interleave. */
#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

log_level_t log_min_level = LOG_LEVEL_INFO;
static char log_role[32] = "tidepool";

static const char *level_names[] = {"DEBUG", "INFO ", "WARN ", "ERROR"};

void log_init(const char *role, log_level_t min_level)
{
    snprintf(log_role, sizeof(log_role), "%s", role ? role : "tidepool");
    log_min_level = min_level;
}

int log_level_parse(const char *name, log_level_t *out)
{
    static const char *names[] = {"debug", "info", "warn", "error"};
    for (int i = 0; i < 4; i++) {
        if (strcmp(name, names[i]) == 0) {
            *out = (log_level_t)i;
            return 0;
        }
    }
    return -1;
}

void log_write(log_level_t level, uint64_t req_id, const char *fmt, ...)
{
    char line[2048];
    struct timeval tv;
    struct tm tm;
    gettimeofday(&tv, NULL);
    gmtime_r(&tv.tv_sec, &tm);
    int n = snprintf(line, sizeof(line), "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ %s %s[%d] ",
                     tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min,
                     tm.tm_sec, (int)(tv.tv_usec / 1000), level_names[level], log_role,
                     (int)getpid());
    if (req_id != 0 && n < (int)sizeof(line))
        n += snprintf(line + n, sizeof(line) - (size_t)n, "req=%llu ",
                      (unsigned long long)req_id);
    if (n < (int)sizeof(line)) {
        va_list ap;
        va_start(ap, fmt);
        n += vsnprintf(line + n, sizeof(line) - (size_t)n, fmt, ap);
        va_end(ap);
    }
    if (n >= (int)sizeof(line) - 1)
        n = (int)sizeof(line) - 2;
    line[n++] = '\n';
    ssize_t w = write(STDERR_FILENO, line, (size_t)n);
    (void)w;
}

void log_assert_fail(const char *expr, const char *file, int line)
{
    log_write(LOG_LEVEL_ERROR, 0, "assertion failed: %s (%s:%d)", expr, file, line);
    abort();
}
