/* config: see config.h. */
#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <ini.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "log.h"

static const config_entry_t *find(const config_entry_t *t, const char *name, size_t len)
{
    for (; t->name; t++) {
        size_t n = strlen(t->name);
        if (n != len)
            continue;
        size_t i;
        for (i = 0; i < n; i++) {
            char a = name[i] == '_' ? '-' : (char)tolower((unsigned char)name[i]);
            if (a != t->name[i])
                break;
        }
        if (i == n)
            return t;
    }
    return NULL;
}

static int is_list(const config_entry_t *e)
{
    return e->type == CONFIG_STRING_LIST || e->type == CONFIG_SECRET_LIST;
}

static void list_clear(config_strings *l)
{
    for (int i = 0; i < l->n; i++)
        free(l->v[i]);
    free(l->v);
    free(l->origin);
    l->v = NULL;
    l->n = 0;
    l->origin = NULL;
}

/* Append a copy of the n bytes at val. 0, or -1 (out of memory). */
static int list_add(config_strings *l, const char *val, size_t n)
{
    char **v = realloc(l->v, (size_t)(l->n + 1) * sizeof(*v));
    if (!v)
        return -1;
    l->v = v;
    if (!(v[l->n] = strndup(val, n)))
        return -1;
    l->n++;
    return 0;
}

/* Where a value comes from: a repeatable setting keeps the values of its highest source. */
enum { SRC_DEFAULT = 0, SRC_FILE, SRC_ENV, SRC_FLAGS };

typedef struct {
    const config_entry_t *table;
    int *src; /* (entries,) the source of each list's current values */
} load_state;

static int is_space(char c)
{
    return c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == '\f' || c == '\v';
}

/* One value (n bytes at val) of list e from origin: refused when empty or blank, and, for a
 * secret, when it holds whitespace (`KEY admin` pasted from a key file would otherwise be
 * a key of its own, or two). A secret is never echoed: the message names its position. */
static int list_piece(const config_entry_t *e, const char *val, size_t n, const char *origin,
                      int piece)
{
    config_strings *l = e->ptr;
    char where[64] = "";
    if (piece > 0)
        snprintf(where, sizeof(where), " (value %d of the comma-separated list)", piece);
    size_t i = 0;
    while (i < n && is_space(val[i]))
        i++;
    if (i == n) {
        fprintf(stderr,
                "empty value for %s (from %s)%s: give a value, or leave the setting out\n",
                e->name, origin, where);
        return -1;
    }
    if (e->type == CONFIG_SECRET_LIST) {
        for (i = 0; i < n && !is_space(val[i]); i++)
            ;
        if (i < n) {
            fprintf(stderr,
                    "invalid value for %s (from %s)%s: a value holds whitespace (one key per "
                    "value, separated by commas in the environment; attributes such as admin "
                    "go in the key file)\n",
                    e->name, origin, where);
            return -1;
        }
    }
    if (list_add(l, val, n) < 0) {
        fprintf(stderr, "out of memory\n");
        return -1;
    }
    return 0;
}

/* A value of a repeatable setting from source src (origin names it): values of a lower
 * source are dropped first; the environment's value is split at commas, each piece trimmed
 * of the whitespace around it. */
static int list_value(const load_state *ls, const config_entry_t *e, const char *val,
                      const char *origin, int src)
{
    config_strings *l = e->ptr;
    int *cur = &ls->src[e - ls->table];
    if (*cur < src) {
        list_clear(l);
        *cur = src;
    }
    if (!l->origin) {
        char name[160];
        if (src == SRC_FLAGS)
            snprintf(name, sizeof(name), "--%s", e->name);
        else
            snprintf(name, sizeof(name), "%s", origin);
        if (!(l->origin = strdup(name))) {
            fprintf(stderr, "out of memory\n");
            return -1;
        }
    }
    if (src != SRC_ENV)
        return list_piece(e, val, strlen(val), origin, 0);
    int piece = strchr(val, ',') ? 1 : 0; /* numbered only when there are several */
    for (const char *p = val;; piece += piece > 0) {
        size_t n = strcspn(p, ",");
        const char *b = p, *t = p + n;
        while (b < t && is_space(*b))
            b++;
        while (t > b && is_space(t[-1]))
            t--;
        if (list_piece(e, b, (size_t)(t - b), origin, piece) < 0)
            return -1;
        if (!p[n])
            break;
        p += n + 1;
    }
    return 0;
}

static int set_value(const load_state *ls, const config_entry_t *e, const char *val,
                     const char *origin, int src)
{
    char *end;
    switch (e->type) {
    case CONFIG_STRING_LIST:
    case CONFIG_SECRET_LIST:
        return list_value(ls, e, val, origin, src);
    case CONFIG_INT: {
        errno = 0;
        long long v = strtoll(val, &end, 10);
        if (errno || end == val || *end || v < e->min || v > e->max) {
            fprintf(stderr, "invalid value '%s' for %s (from %s): want an integer in [%.0f, %.0f]\n",
                    val, e->name, origin, e->min, e->max);
            return -1;
        }
        *(long long *)e->ptr = v;
        return 0;
    }
    case CONFIG_DOUBLE: {
        errno = 0;
        double v = strtod(val, &end);
        if (errno || end == val || *end || !isfinite(v) || v < e->min || v > e->max) {
            fprintf(stderr, "invalid value '%s' for %s (from %s): want a number in [%g, %g]\n",
                    val, e->name, origin, e->min, e->max);
            return -1;
        }
        *(double *)e->ptr = v;
        return 0;
    }
    case CONFIG_STRING: {
        char **p = e->ptr;
        char *copy = strdup(val);
        if (!copy)
            return -1;
        free(*p);
        *p = copy;
        return 0;
    }
    case CONFIG_BOOL: {
        static const char *yes[] = {"1", "true", "yes", "on"};
        static const char *no[] = {"0", "false", "no", "off"};
        for (int i = 0; i < 4; i++) {
            if (strcasecmp(val, yes[i]) == 0) {
                *(int *)e->ptr = 1;
                return 0;
            }
            if (strcasecmp(val, no[i]) == 0) {
                *(int *)e->ptr = 0;
                return 0;
            }
        }
        fprintf(stderr, "invalid value '%s' for %s (from %s): want true or false\n", val,
                e->name, origin);
        return -1;
    }
    }
    return -1;
}

struct ini_ctx {
    const load_state *ls;
    const char *path;
    int failed;
    const char *secret; /* the first secret setting the file sets, or NULL */
};

static int on_ini_entry(void *user, const char *section, const char *name, const char *value)
{
    struct ini_ctx *ctx = user;
    (void)section; /* sections are allowed for readability and ignored */
    const config_entry_t *e = find(ctx->ls->table, name, strlen(name));
    if (!e || strcmp(e->name, "config") == 0) {
        fprintf(stderr, "%s: unknown setting '%s'\n", ctx->path, name);
        ctx->failed = 1;
        return 0;
    }
    if (e->type == CONFIG_SECRET_LIST && !ctx->secret)
        ctx->secret = e->name;
    if (set_value(ctx->ls, e, value, ctx->path, SRC_FILE) < 0)
        ctx->failed = 1;
    return 1;
}

/* Read the config file at path into ls. A file that sets a secret setting must be readable
 * by its owner only, as the API key file must (checked on the open file). 0 or -1. */
static int load_file(const load_state *ls, const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "%s: cannot open config file: %s\n", path, strerror(errno));
        return -1;
    }
    struct stat st;
    if (fstat(fileno(f), &st) < 0) {
        fprintf(stderr, "%s: cannot stat config file: %s\n", path, strerror(errno));
        fclose(f);
        return -1;
    }
    struct ini_ctx ctx = {ls, path, 0, NULL};
    int rc = ini_parse_file(f, on_ini_entry, &ctx);
    fclose(f);
    if (rc > 0)
        fprintf(stderr, "%s: line %d: syntax error\n", path, rc);
    if (rc < 0)
        fprintf(stderr, "%s: cannot read config file\n", path);
    if (rc || ctx.failed)
        return -1;
    if (ctx.secret && (st.st_mode & 077)) {
        fprintf(stderr,
                "%s: the config file sets %s but is accessible by group or others (mode %04o): "
                "make it readable by its owner only (chmod 600), or move the keys to a key "
                "file\n",
                path, ctx.secret, (unsigned)(st.st_mode & 07777));
        return -1;
    }
    return 0;
}

static void print_help(const config_entry_t *t, const char *program)
{
    printf("usage: %s [--setting value ...]\n\n"
           "Each setting is also read from the environment (TIDEPOOL_<NAME>, upper case,\n"
           "'-' as '_') and from an INI config file (--config FILE or TIDEPOOL_CONFIG).\n"
           "Precedence: defaults < file < environment < flags.\n\n",
           program);
    printf("  --%-22s %s\n", "config FILE", "read settings from an INI file");
    printf("  --%-22s %s\n", "help", "print this help");
    for (; t->name; t++) {
        char bounds[64] = "";
        if (t->type == CONFIG_INT)
            snprintf(bounds, sizeof(bounds), " [%.0f..%.0f]", t->min, t->max);
        else if (t->type == CONFIG_DOUBLE)
            snprintf(bounds, sizeof(bounds), " [%g..%g]", t->min, t->max);
        if (is_list(t))
            snprintf(bounds, sizeof(bounds), " (repeatable)");
        printf("  --%-22s %s (default: %s)%s\n", t->name, t->help,
               t->def && *t->def ? t->def : "none", bounds);
    }
}

static void env_name(const char *name, char *out, size_t cap)
{
    size_t n = (size_t)snprintf(out, cap, "TIDEPOOL_");
    for (; *name && n + 1 < cap; name++)
        out[n++] = *name == '-' ? '_' : (char)toupper((unsigned char)*name);
    out[n] = 0;
}

/* config_load with its per-entry state allocated. */
static int load(const load_state *ls, const char *program, int argc, char **argv)
{
    const config_entry_t *table = ls->table;
    const char *config_path = getenv("TIDEPOOL_CONFIG");
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            print_help(table, program);
            return 1;
        }
        if (strcmp(argv[i], "--config") == 0 && i + 1 < argc)
            config_path = argv[i + 1];
        else if (strncmp(argv[i], "--config=", 9) == 0)
            config_path = argv[i] + 9;
    }
    for (const config_entry_t *e = table; e->name; e++) {
        if (e->type == CONFIG_STRING)
            *(char **)e->ptr = NULL;
        if (is_list(e))
            *(config_strings *)e->ptr = (config_strings){NULL, 0, NULL};
        if (e->def && set_value(ls, e, e->def, "default", SRC_DEFAULT) < 0)
            return -1;
    }
    if (config_path && *config_path && load_file(ls, config_path) < 0)
        return -1;
    for (const config_entry_t *e = table; e->name; e++) {
        char env[128];
        env_name(e->name, env, sizeof(env));
        const char *v = getenv(env);
        if (v && set_value(ls, e, v, env, SRC_ENV) < 0)
            return -1;
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strncmp(a, "--", 2) != 0) {
            fprintf(stderr, "%s: unexpected argument '%s' (see --help)\n", program, a);
            return -1;
        }
        a += 2;
        const char *eq = strchr(a, '=');
        size_t len = eq ? (size_t)(eq - a) : strlen(a);
        if (len == 6 && strncmp(a, "config", 6) == 0) {
            if (!eq)
                i++;
            continue;
        }
        const config_entry_t *e = find(table, a, len);
        if (!e) {
            fprintf(stderr, "%s: unknown flag '%s' (see --help)\n", program, argv[i]);
            return -1;
        }
        const char *val;
        if (eq) {
            val = eq + 1;
        } else if (e->type == CONFIG_BOOL && (i + 1 >= argc || strncmp(argv[i + 1], "--", 2) == 0)) {
            val = "true";
        } else if (i + 1 < argc) {
            val = argv[++i];
        } else {
            fprintf(stderr, "%s: flag --%s needs a value\n", program, e->name);
            return -1;
        }
        if (set_value(ls, e, val, "flags", SRC_FLAGS) < 0)
            return -1;
    }
    return 0;
}

int config_load(const config_entry_t *table, const char *program, int argc, char **argv)
{
    size_t n = 0;
    while (table[n].name)
        n++;
    load_state ls = {table, calloc(n + 1, sizeof(int))};
    if (!ls.src) {
        fprintf(stderr, "out of memory\n");
        return -1;
    }
    int rc = load(&ls, program, argc, argv);
    free(ls.src);
    return rc;
}

void config_log(const config_entry_t *t)
{
    for (; t->name; t++) {
        switch (t->type) {
        case CONFIG_INT:
            log_info("config %s = %lld", t->name, *(long long *)t->ptr);
            break;
        case CONFIG_DOUBLE:
            log_info("config %s = %g", t->name, *(double *)t->ptr);
            break;
        case CONFIG_STRING: {
            const char *s = *(char **)t->ptr;
            log_info("config %s = %s", t->name, s ? s : "");
            break;
        }
        case CONFIG_BOOL:
            log_info("config %s = %s", t->name, *(int *)t->ptr ? "true" : "false");
            break;
        case CONFIG_STRING_LIST: {
            const config_strings *l = t->ptr;
            if (l->n == 0)
                log_info("config %s = (none)", t->name);
            for (int i = 0; i < l->n; i++)
                log_info("config %s = %s", t->name, l->v[i]);
            break;
        }
        case CONFIG_SECRET_LIST:
            log_info("config %s = (%d given, not shown)", t->name, ((config_strings *)t->ptr)->n);
            break;
        }
    }
}

void config_free(const config_entry_t *t)
{
    for (; t->name; t++) {
        if (t->type == CONFIG_STRING) {
            free(*(char **)t->ptr);
            *(char **)t->ptr = NULL;
        }
        if (is_list(t))
            list_clear(t->ptr);
    }
}
