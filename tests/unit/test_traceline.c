/*
 * The one parser of trace lines (tools/trace/traceline.h) that tidepool-sim --trace and
 * tidepool-bench --trace share: CSV and JSONL lines field by field, every class name, the
 * reader's skipping (blank lines, comments, CRLF, one leading CSV header) and line
 * numbers, and every refusal with its exact text ("PATH:LINE: reason").
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>

#include "traceline.h"

static char tmpdir[64];

static int setup(void **state)
{
    (void)state;
    snprintf(tmpdir, sizeof(tmpdir), "/tmp/test_traceline_XXXXXX");
    return mkdtemp(tmpdir) ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", tmpdir);
    return system(cmd) == 0 ? 0 : -1;
}

static const char *write_file(const char *name, const char *text)
{
    static char path[128];
    snprintf(path, sizeof(path), "%s/%s", tmpdir, name);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
    return path;
}

/* Parse a copy of text (the parser cuts CSV lines in place). */
static int parse(const char *text, traceline_req *q, const char **why)
{
    char buf[512];
    snprintf(buf, sizeof(buf), "%s", text);
    memset(q, 0x5a, sizeof(*q));
    *why = NULL;
    return traceline_parse(buf, q, why);
}

/* Good lines of both formats, field by field. */
static void test_parse_lines(void **state)
{
    (void)state;
    traceline_req q;
    const char *why;
    assert_int_equal(parse("1.5,100,20", &q, &why), 0);
    assert_true(q.arrival_s == 1.5 && q.prompt_tokens == 100 && q.output_tokens == 20);
    assert_int_equal(q.offline, 0);
    assert_int_equal(parse("  0 , 7 ,1e9 , Offline ", &q, &why), 0);
    assert_true(q.arrival_s == 0 && q.prompt_tokens == 7 && q.output_tokens == 1000000000LL);
    assert_int_equal(q.offline, 1);
    assert_int_equal(parse("2,3,4,", &q, &why), 0); /* an empty class is online */
    assert_int_equal(q.offline, 0);
    assert_int_equal(parse("{\"arrival_s\": 0.25, \"prompt_tokens\": 900, \"output_tokens\": 40}",
                           &q, &why),
                     0);
    assert_true(q.arrival_s == 0.25 && q.prompt_tokens == 900 && q.output_tokens == 40);
    assert_int_equal(q.offline, 0);
    assert_int_equal(parse("{\"arrival_s\": 3, \"prompt_tokens\": 9.0, \"output_tokens\": 4, "
                           "\"class\": \"batch\"}",
                           &q, &why),
                     0);
    assert_true(q.prompt_tokens == 9 && q.offline == 1);
    assert_int_equal(parse("{\"arrival_s\": 3, \"prompt_tokens\": 9, \"output_tokens\": 4, "
                           "\"service_tier\": \"flex\"}",
                           &q, &why),
                     0);
    assert_int_equal(q.offline, 1);
    /* "offline" wins over class and service_tier; an integer counts */
    assert_int_equal(parse("{\"arrival_s\": 3, \"prompt_tokens\": 9, \"output_tokens\": 4, "
                           "\"offline\": false, \"class\": \"offline\"}",
                           &q, &why),
                     0);
    assert_int_equal(q.offline, 0);
    assert_int_equal(parse("{\"arrival_s\": 3, \"prompt_tokens\": 9, \"output_tokens\": 4, "
                           "\"offline\": 2}",
                           &q, &why),
                     0);
    assert_int_equal(q.offline, 1);
    /* a CSV line whose arrival_s is not a number: 1 (the reader's header rule) */
    assert_int_equal(parse("arrival_s,prompt_tokens,output_tokens,class", &q, &why), 1);
    assert_string_equal(why, "arrival_s is not a number");
}

/* Every class name, any case, blanks around it. */
static void test_classes(void **state)
{
    (void)state;
    const char *on[] = {"online", "0", "default", "auto", "interactive", "", "  ", " ONLINE ",
                        "Interactive"};
    const char *off[] = {"offline", "1", "flex", "batch", "OFFLINE", " Flex\t", "BATCH"};
    const char *bad[] = {"later", "2", "online1", "off", "flexible", "on line"};
    int o;
    for (size_t i = 0; i < sizeof(on) / sizeof(on[0]); i++) {
        o = 7;
        assert_int_equal(traceline_class(on[i], &o), 0);
        assert_int_equal(o, 0);
    }
    for (size_t i = 0; i < sizeof(off) / sizeof(off[0]); i++) {
        o = 7;
        assert_int_equal(traceline_class(off[i], &o), 0);
        assert_int_equal(o, 1);
    }
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        assert_int_equal(traceline_class(bad[i], &o), -1);
}

/* The reader: comments, blank lines, CRLF, a header as the first request line only, both
 * formats in one file, file order and line numbers, then the end (0, and again 0). */
static void test_reader(void **state)
{
    (void)state;
    const char *path = write_file("ok.csv", "# made by hand\r\n"
                                            "\n"
                                            "arrival_s,prompt_tokens,output_tokens,class\r\n"
                                            "   \t\n"
                                            "5,10,2,online\r\n"
                                            "# a comment between\n"
                                            "1,20,3,flex\n"
                                            "{\"arrival_s\": 0, \"prompt_tokens\": 30, "
                                            "\"output_tokens\": 4, \"offline\": true}\n"
                                            "0,40,5");
    char err[256] = "";
    traceline_reader_t *r = traceline_open(path, err, sizeof(err));
    assert_non_null(r);
    static const struct {
        double t;
        long long p, o;
        int off;
        size_t line;
    } want[] = {{5, 10, 2, 0, 5}, {1, 20, 3, 1, 7}, {0, 30, 4, 1, 8}, {0, 40, 5, 0, 9}};
    traceline_req q;
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
        assert_int_equal(traceline_next(r, &q, err, sizeof(err)), 1);
        assert_true(q.arrival_s == want[i].t);
        assert_int_equal(q.prompt_tokens, want[i].p);
        assert_int_equal(q.output_tokens, want[i].o);
        assert_int_equal(q.offline, want[i].off);
        assert_int_equal(q.line, want[i].line);
    }
    assert_int_equal(traceline_next(r, &q, err, sizeof(err)), 0);
    assert_int_equal(traceline_next(r, &q, err, sizeof(err)), 0);
    traceline_close(&r);
    assert_null(r);
    traceline_close(&r); /* NULL: a no-op */
    /* an empty file: the end at once (the callers say "no requests") */
    r = traceline_open(write_file("empty.csv", "# nothing\n\n"), err, sizeof(err));
    assert_non_null(r);
    assert_int_equal(traceline_next(r, &q, err, sizeof(err)), 0);
    traceline_close(&r);
    /* a file that is not there */
    char missing[128];
    snprintf(missing, sizeof(missing), "%s/none.csv", tmpdir);
    assert_null(traceline_open(missing, err, sizeof(err)));
    char want_err[256];
    snprintf(want_err, sizeof(want_err), "%s: No such file or directory", missing);
    assert_string_equal(err, want_err);
}

/* Every refusal, CSV and JSONL, with its exact text and line. */
static void test_bad_lines(void **state)
{
    (void)state;
    static const struct {
        const char *text, *want;
    } bad[] = {
        {"0,10\n", ":1: want arrival_s,prompt_tokens,output_tokens[,class]"},
        {"0,10,5,online,x\n", ":1: want arrival_s,prompt_tokens,output_tokens[,class]"},
        {"0,10,5\nsoon,10,5\n", ":2: arrival_s is not a number"},
        {"arrival,prompt,out\nagain,p,o\n", ":2: arrival_s is not a number"},
        {"# c\n\narrival_s,p,o\n1,ten,5\n", ":4: prompt_tokens / output_tokens are not numbers"},
        {"1,10,5x\n", ":1: prompt_tokens / output_tokens are not numbers"},
        {"1,10,5,sometimes\n", ":1: class must be online or offline"},
        {"-1,10,5\n", ":1: arrival_s must be a finite number >= 0"},
        {"nan,10,5\n", ":1: arrival_s must be a finite number >= 0"},
        {"inf,10,5\n", ":1: arrival_s must be a finite number >= 0"},
        {"1,0,5\n", ":1: prompt_tokens and output_tokens must be whole numbers in [1, 1e9]"},
        {"1,10,0\n", ":1: prompt_tokens and output_tokens must be whole numbers in [1, 1e9]"},
        {"1,2.5,3\n", ":1: prompt_tokens and output_tokens must be whole numbers in [1, 1e9]"},
        {"1,1e10,3\n", ":1: prompt_tokens and output_tokens must be whole numbers in [1, 1e9]"},
        {"\r\n1,10,5\r\n1,-3,5\r\n",
         ":3: prompt_tokens and output_tokens must be whole numbers in [1, 1e9]"},
        {"{nope\n", ":1: not a JSON object"},
        {"{\"arrival_s\": 1}\n", ":1: want numbers arrival_s, prompt_tokens, output_tokens"},
        {"{\"arrival_s\": \"1\", \"prompt_tokens\": 5, \"output_tokens\": 5}\n",
         ":1: want numbers arrival_s, prompt_tokens, output_tokens"},
        {"{\"arrival_s\": -0.5, \"prompt_tokens\": 5, \"output_tokens\": 5}\n",
         ":1: arrival_s must be a finite number >= 0"},
        {"{\"arrival_s\": 1, \"prompt_tokens\": 5, \"output_tokens\": 0.5}\n",
         ":1: prompt_tokens and output_tokens must be whole numbers in [1, 1e9]"},
        {"{\"arrival_s\": 1, \"prompt_tokens\": 5, \"output_tokens\": 5, \"offline\": \"y\"}\n",
         ":1: offline must be a boolean"},
        {"{\"arrival_s\": 1, \"prompt_tokens\": 5, \"output_tokens\": 5, \"class\": \"vip\"}\n",
         ":1: class / service_tier must be online, offline or flex"},
        {"{\"arrival_s\": 1, \"prompt_tokens\": 5, \"output_tokens\": 5, \"service_tier\": 1}\n",
         ":1: class / service_tier must be online, offline or flex"},
        {"0,1,1\n{\"arrival_s\": 1, \"prompt_tokens\": 5, \"output_tokens\": 5} x\n",
         ":2: not a JSON object"},
    };
    char err[256], want[256];
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        const char *path = write_file("bad.csv", bad[i].text);
        traceline_reader_t *r = traceline_open(path, err, sizeof(err));
        assert_non_null(r);
        traceline_req q;
        int rc;
        err[0] = 0;
        while ((rc = traceline_next(r, &q, err, sizeof(err))) == 1)
            ;
        traceline_close(&r);
        snprintf(want, sizeof(want), "%s%s", path, bad[i].want);
        if (rc != -1 || strcmp(err, want) != 0)
            fail_msg("case %zu: rc %d, got '%s', want '%s'", i, rc, err, want);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_lines),
        cmocka_unit_test(test_classes),
        cmocka_unit_test(test_reader),
        cmocka_unit_test(test_bad_lines),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
