/*
 * replay_main: runs a fuzzing harness (tests/fuzz/fuzz_<name>.c) without libFuzzer, on
 * every file of its seed corpus (tests/fuzz/corpus/<name>/) and of its saved crash inputs
 * (tests/fuzz/crashes/<name>/), so that `make test` (plain and under ASan+UBSan) checks
 * them with the normal compiler. Linked once per harness as $(BUILD)/tests/test_fuzz_<name>;
 * the name comes from the program's own name. A property that fails aborts (a crash),
 * and so does any sanitizer report.
 *
 *   test_fuzz_<name>              the two folders (under TIDEPOOL_FUZZ_DIR, default
 *                                 tests/fuzz, relative to the repository root)
 *   test_fuzz_<name> FILE|DIR...  just these (e.g. a crash input libFuzzer saved)
 *
 * Prints each input and a cmocka-style summary (tests/run_tests.sh counts the inputs as
 * cases). Exits 1 when the corpus folder is missing or empty: a replay of nothing tests
 * nothing.
 */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz_common.h"

static int n_run;

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static int run_file(const char *path)
{
    size_t n = 0;
    unsigned char *b = fuzz_read_file(path, &n);
    if (!b) {
        fprintf(stderr, "replay: cannot read %s\n", path);
        return -1;
    }
    printf("[ RUN      ] %s (%zu bytes)\n", path, n);
    fflush(stdout);
    /* an exact-size copy, as libFuzzer passes it: ASan sees a read one past the end */
    unsigned char *exact = malloc(n ? n : 1);
    if (!exact) {
        free(b);
        return -1;
    }
    memcpy(exact, b, n);
    free(b);
    LLVMFuzzerTestOneInput(exact, n);
    free(exact);
    printf("[       OK ] %s\n", path);
    n_run++;
    return 0;
}

/* Every regular file of dir (names starting with '.' skipped), in name order. Returns the
 * number run, or -1 when dir cannot be read (missing_ok: 0 instead). */
static int run_dir(const char *dir, int missing_ok)
{
    DIR *d = opendir(dir);
    if (!d) {
        if (missing_ok)
            return 0;
        fprintf(stderr, "replay: cannot open %s\n", dir);
        return -1;
    }
    char **names = NULL;
    int n = 0, cap = 0, ran = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        if (n == cap) {
            cap = cap ? cap * 2 : 64;
            char **nn = realloc(names, (size_t)cap * sizeof(char *));
            if (!nn)
                abort();
            names = nn;
        }
        if (!(names[n++] = strdup(e->d_name)))
            abort();
    }
    closedir(d);
    if (n > 0)
        qsort(names, (size_t)n, sizeof(char *), cmp_str);
    for (int i = 0; i < n; i++) {
        char path[4096];
        struct stat st;
        snprintf(path, sizeof(path), "%s/%s", dir, names[i]);
        if (stat(path, &st) == 0 && S_ISREG(st.st_mode)) {
            if (run_file(path) < 0)
                ran = -1;
            else if (ran >= 0)
                ran++;
        }
        free(names[i]);
    }
    free(names);
    return ran;
}

int main(int argc, char **argv)
{
    const char *prog = strrchr(argv[0], '/');
    prog = prog ? prog + 1 : argv[0];
    const char *name = strncmp(prog, "test_fuzz_", 10) == 0 ? prog + 10 : prog;
    int rc = 0;
    if (argc > 1) {
        for (int i = 1; i < argc; i++) {
            struct stat st;
            if (stat(argv[i], &st) == 0 && S_ISDIR(st.st_mode))
                rc |= run_dir(argv[i], 0) < 0;
            else
                rc |= run_file(argv[i]) < 0;
        }
    } else {
        const char *root = getenv("TIDEPOOL_FUZZ_DIR");
        char dir[4096];
        if (!root || !*root)
            root = "tests/fuzz";
        snprintf(dir, sizeof(dir), "%s/corpus/%s", root, name);
        int n = run_dir(dir, 0);
        if (n == 0)
            fprintf(stderr, "replay: %s has no inputs\n", dir);
        rc |= n <= 0;
        snprintf(dir, sizeof(dir), "%s/crashes/%s", root, name);
        rc |= run_dir(dir, 1) < 0;
    }
    printf("[==========] %d test(s) run.\n", n_run);
    if (rc)
        printf("[  FAILED  ] 1 test(s), listed below:\n[  FAILED  ] replay of %s\n", name);
    else
        printf("[  PASSED  ] %d test(s).\n", n_run);
    return rc;
}
