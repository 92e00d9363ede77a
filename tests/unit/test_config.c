/* Tests of common/config: the repeatable settings (CONFIG_STRING_LIST, CONFIG_SECRET_LIST):
 * every flag kept in order, the environment split at commas only, the file's repeated keys,
 * the precedence per source, empty and blank values refused, a secret list logged as a
 * count only and refused in a config file that others may read. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
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

/* A config file with text and mode; its path in path. */
static void write_ini(char *path, const char *text, mode_t mode)
{
    strcpy(path, "/tmp/tidepool-test-config-XXXXXX");
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    assert_int_equal(fchmod(fd, mode), 0);
    close(fd);
}

/* load(argc, argv) with stderr captured into out (cap bytes, NUL-terminated). */
static int load_capture(int argc, char **argv, char *out, size_t cap)
{
    char path[] = "/tmp/tidepool-test-config-err-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    fflush(stderr);
    int saved = dup(2);
    dup2(fd, 2);
    int rc = load(argc, argv);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    ssize_t n = pread(fd, out, cap - 1, 0);
    close(fd);
    unlink(path);
    out[n > 0 ? n : 0] = 0;
    return rc;
}

/* One environment variable holds several values, split at commas only; the whitespace
 * around each is dropped, whitespace inside a plain value kept. */
static void test_env_split(void **state)
{
    (void)state;
    setenv("TIDEPOOL_KEY", " k1,k2 \t, k3\n", 1);
    setenv("TIDEPOOL_NAME", "a b,c", 1);
    char *argv[] = {"test", NULL};
    assert_int_equal(load(1, argv), 0);
    assert_int_equal(opt_keys.n, 3);
    assert_string_equal(opt_keys.v[0], "k1");
    assert_string_equal(opt_keys.v[1], "k2");
    assert_string_equal(opt_keys.v[2], "k3");
    assert_string_equal(opt_keys.origin, "TIDEPOOL_KEY");
    assert_int_equal(opt_names.n, 2);
    assert_string_equal(opt_names.v[0], "a b");
    assert_string_equal(opt_names.v[1], "c");
}

/* An empty or blank value is an error wherever it comes from (`--key "$UNSET"` must not
 * leave a gateway open), and a secret holding whitespace is refused (`KEY admin` copied
 * from a key file must not make "admin" a key). The message never quotes the secret. */
static void test_empty_and_blank_refused(void **state)
{
    (void)state;
    char err[1024];
    static const struct {
        const char *env; /* TIDEPOOL_KEY, or NULL */
        const char *flag; /* the value of --key, or NULL */
        const char *want; /* stderr */
    } cases[] = {
        {NULL, "", "empty value for key (from flags): give a value, or leave the setting out\n"},
        {NULL, " \t", "empty value for key (from flags): give a value, or leave the setting out\n"},
        {"", NULL,
         "empty value for key (from TIDEPOOL_KEY): give a value, or leave the setting out\n"},
        {" ", NULL,
         "empty value for key (from TIDEPOOL_KEY): give a value, or leave the setting out\n"},
        {", ,", NULL,
         "empty value for key (from TIDEPOOL_KEY) (value 1 of the comma-separated list): give a "
         "value, or leave the setting out\n"},
        {"k1,,k2", NULL,
         "empty value for key (from TIDEPOOL_KEY) (value 2 of the comma-separated list): give a "
         "value, or leave the setting out\n"},
        {"k1,", NULL,
         "empty value for key (from TIDEPOOL_KEY) (value 2 of the comma-separated list): give a "
         "value, or leave the setting out\n"},
        {"secret-key admin", NULL,
         "invalid value for key (from TIDEPOOL_KEY): a value holds whitespace (one key per value, "
         "separated by commas in the environment; attributes such as admin go in the key "
         "file)\n"},
        {"k1, secret-key admin", NULL,
         "invalid value for key (from TIDEPOOL_KEY) (value 2 of the comma-separated list): a "
         "value holds whitespace (one key per value, separated by commas in the environment; "
         "attributes such as admin go in the key file)\n"},
        {NULL, "secret key",
         "invalid value for key (from flags): a value holds whitespace (one key per value, "
         "separated by commas in the environment; attributes such as admin go in the key "
         "file)\n"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        if (cases[i].env)
            setenv("TIDEPOOL_KEY", cases[i].env, 1);
        else
            unsetenv("TIDEPOOL_KEY");
        char *argv[] = {"test", "--key", (char *)cases[i].flag, NULL};
        int rc = load_capture(cases[i].flag ? 3 : 1, argv, err, sizeof(err));
        if (rc != -1 || strcmp(err, cases[i].want) != 0)
            fail_msg("case %zu: rc %d, got '%s', want '%s'", i, rc, err, cases[i].want);
        assert_null(strstr(err, "secret"));
        config_free(table);
    }
    unsetenv("TIDEPOOL_KEY");

    char path[64], want[512];
    write_ini(path, "key =\n", 0600);
    char *argv[] = {"test", "--config", path, NULL};
    assert_int_equal(load_capture(3, argv, err, sizeof(err)), -1);
    snprintf(want, sizeof(want),
             "empty value for key (from %s): give a value, or leave the setting out\n", path);
    assert_string_equal(err, want);
    unlink(path);
}

/* A config file that sets a secret is refused when group or others may access it, as the
 * API key file is; a file without secrets may be readable by all. */
static void test_secret_file_mode(void **state)
{
    (void)state;
    char path[64], err[1024], want[1024];
    static const mode_t modes[] = {0644, 0640, 0604, 0620};
    for (size_t i = 0; i < sizeof(modes) / sizeof(modes[0]); i++) {
        write_ini(path, "host = h\n[keys]\nkey = secret-in-file\n", modes[i]);
        char *argv[] = {"test", "--config", path, NULL};
        assert_int_equal(load_capture(3, argv, err, sizeof(err)), -1);
        snprintf(want, sizeof(want),
                 "%s: the config file sets key but is accessible by group or others (mode "
                 "%04o): make it readable by its owner only (chmod 600), or move the keys to a "
                 "key file\n",
                 path, (unsigned)modes[i]);
        assert_string_equal(err, want);
        config_free(table);
        unlink(path);
    }
    write_ini(path, "key = secret-in-file\n", 0600);
    char *argv[] = {"test", "--config", path, NULL};
    assert_int_equal(load_capture(3, argv, err, sizeof(err)), 0);
    assert_int_equal(opt_keys.n, 1);
    assert_string_equal(opt_keys.origin, path);
    config_free(table);
    unlink(path);
    write_ini(path, "name = n1\nhost = h\n", 0644); /* no secret: any mode */
    assert_int_equal(load_capture(3, argv, err, sizeof(err)), 0);
    assert_int_equal(opt_names.n, 1);
    assert_string_equal(err, "");
    unlink(path);
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

    setenv("TIDEPOOL_NAME", "e1, e2", 1);
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
    assert_string_equal(opt_names.origin, "--name");
    assert_string_equal(opt_keys.origin, path);
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
        cmocka_unit_test_setup_teardown(test_empty_and_blank_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_secret_file_mode, setup, teardown),
        cmocka_unit_test_setup_teardown(test_precedence, setup, teardown),
        cmocka_unit_test_setup_teardown(test_missing_value, setup, teardown),
        cmocka_unit_test_setup_teardown(test_log_hides_secrets, setup, teardown),
    };
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    return cmocka_run_group_tests_name("config", tests, NULL, NULL);
}
