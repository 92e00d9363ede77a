/* Tests of common/config: the repeatable settings (CONFIG_STRING_LIST, CONFIG_SECRET_LIST):
 * every flag kept in order, the environment split at commas and whitespace, the file's
 * repeated keys, the precedence per source, and a secret list logged as a count only. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>

#include "config.h"
#include "log.h"

static config_strings opt_names, opt_keys;
static char *opt_host;

static const config_entry_t table[] = {
    {"name", CONFIG_STRING_LIST, &opt_names, NULL, 0, 0, "a repeatable setting"},
    {"key", CONFIG_SECRET_LIST, &opt_keys, NULL, 0, 0, "a repeatable secret"},
    {"host", CONFIG_STRING, &opt_host, "localhost", 0, 0, "a plain string"},
    {NULL, 0, NULL, NULL, 0, 0, NULL},
};

static int load(int argc, char **argv)
{
    return config_load(table, "test", argc, argv);
}

static int setup(void **state)
{
    (void)state;
    unsetenv("TIDEPOOL_NAME");
    unsetenv("TIDEPOOL_KEY");
    unsetenv("TIDEPOOL_CONFIG");
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    config_free(table);
    return setup(state);
}

/* Every occurrence of a flag is kept, in order, in both spellings (--x v, --x=v). */
static void test_flags_repeat(void **state)
{
    (void)state;
    char *argv[] = {"test", "--name", "a", "--name=b,c", "--host", "h", "--name", "d", NULL};
    assert_int_equal(load(8, argv), 0);
    assert_int_equal(opt_names.n, 3);
    assert_string_equal(opt_names.v[0], "a");
    assert_string_equal(opt_names.v[1], "b,c"); /* a flag is one value, commas included */
    assert_string_equal(opt_names.v[2], "d");
    assert_int_equal(opt_keys.n, 0);
    assert_null(opt_keys.v);
    assert_string_equal(opt_host, "h");
    config_free(table);
    assert_int_equal(opt_names.n, 0);
    assert_null(opt_names.v);
}

/* One environment variable holds several values, split at commas and whitespace; empty
 * pieces are dropped. */
static void test_env_split(void **state)
{
    (void)state;
    setenv("TIDEPOOL_KEY", " k1,k2 \tk3,,\n", 1);
    char *argv[] = {"test", NULL};
    assert_int_equal(load(1, argv), 0);
    assert_int_equal(opt_keys.n, 3);
    assert_string_equal(opt_keys.v[0], "k1");
    assert_string_equal(opt_keys.v[1], "k2");
    assert_string_equal(opt_keys.v[2], "k3");
}

/* Precedence per source: the file's values (its repeated key) are replaced by the
 * environment's, which are replaced by the flags'; a source that gives none keeps the
 * lower one's. */
static void test_precedence(void **state)
{
    (void)state;
    char path[] = "/tmp/tidepool-test-config-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    const char *ini = "name = f1\nname = f2\nkey = fk\n";
    assert_int_equal(write(fd, ini, strlen(ini)), (ssize_t)strlen(ini));
    close(fd);
    char *argv1[] = {"test", "--config", path, NULL};
    assert_int_equal(load(3, argv1), 0);
    assert_int_equal(opt_names.n, 2);
    assert_string_equal(opt_names.v[0], "f1");
    assert_string_equal(opt_names.v[1], "f2");
    assert_int_equal(opt_keys.n, 1);
    assert_string_equal(opt_keys.v[0], "fk");
    config_free(table);

    setenv("TIDEPOOL_NAME", "e1 e2", 1);
    assert_int_equal(load(3, argv1), 0);
    assert_int_equal(opt_names.n, 2);
    assert_string_equal(opt_names.v[0], "e1");
    assert_string_equal(opt_names.v[1], "e2");
    assert_int_equal(opt_keys.n, 1); /* nothing else for "key": the file's stays */
    config_free(table);

    char *argv2[] = {"test", "--config", path, "--name", "x", NULL};
    assert_int_equal(load(5, argv2), 0);
    assert_int_equal(opt_names.n, 1);
    assert_string_equal(opt_names.v[0], "x");
    unlink(path);
}

/* A missing value is an error, as for other settings. */
static void test_missing_value(void **state)
{
    (void)state;
    char *argv[] = {"test", "--name", NULL};
    assert_int_equal(load(2, argv), -1);
}

/* config_log prints each value of a plain list and only the count of a secret list. */
static void test_log_hides_secrets(void **state)
{
    (void)state;
    char *argv[] = {"test", "--name", "visible-name", "--key", "s3cret-value-1", "--key",
                    "s3cret-value-2", NULL};
    assert_int_equal(load(7, argv), 0);
    char path[] = "/tmp/tidepool-test-config-log-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    fflush(stderr);
    int saved = dup(2);
    dup2(fd, 2);
    log_init("test", LOG_LEVEL_INFO);
    config_log(table);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    char buf[4096];
    ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
    close(fd);
    unlink(path);
    assert_true(n > 0);
    buf[n] = 0;
    assert_non_null(strstr(buf, "config name = visible-name"));
    assert_non_null(strstr(buf, "config key = (2 given, not shown)"));
    assert_null(strstr(buf, "s3cret"));
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_flags_repeat, setup, teardown),
        cmocka_unit_test_setup_teardown(test_env_split, setup, teardown),
        cmocka_unit_test_setup_teardown(test_precedence, setup, teardown),
        cmocka_unit_test_setup_teardown(test_missing_value, setup, teardown),
        cmocka_unit_test_setup_teardown(test_log_hides_secrets, setup, teardown),
    };
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    return cmocka_run_group_tests_name("config", tests, NULL, NULL);
}
