/*
 * bench: the clock, timer values and the failure names of a tidepool-bench run (bench.h).
 */
#include <math.h>
#include <sys/time.h>
#include <time.h>

#include "bench.h"

int64_t bench_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

struct timeval bench_timeval(double s)
{
    if (s < 0)
        s = 0;
    struct timeval tv = {(time_t)s, (suseconds_t)((s - floor(s)) * 1e6)};
    return tv;
}

const char *bench_fail_str(int kind)
{
    static const char *const names[] = {
        "http", "connect", "closed", "stream_error", "protocol", "timeout", "no_content",
        "client", "interrupted",
    };
    return kind >= 0 && kind < (int)(sizeof(names) / sizeof(names[0])) ? names[kind] : "?";
}
