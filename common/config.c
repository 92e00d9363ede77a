/* config: see config.h. */
#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <ini.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

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

static int set_value(const config_entry_t *e, const char *val, const char *origin)
{
    char *end;
    switch (e->type) {
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
    const config_entry_t *table;
    const char *path;
    int failed;
};

static int on_ini_entry(void *user, const char *section, const char *name, const char *value)
{
    struct ini_ctx *ctx = user;
    (void)section; /* sections are allowed for readability and ignored */
    const config_entry_t *e = find(ctx->table, name, strlen(name));
    if (!e || strcmp(e->name, "config") == 0) {
        fprintf(stderr, "%s: unknown setting '%s'\n", ctx->path, name);
        ctx->failed = 1;
        return 0;
    }
    if (set_value(e, value, ctx->path) < 0)
        ctx->failed = 1;
    return 1;
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

int config_load(const config_entry_t *table, const char *program, int argc, char **argv)
{
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
        if (e->def && set_value(e, e->def, "default") < 0)
            return -1;
    }
    if (config_path && *config_path) {
        struct ini_ctx ctx = {table, config_path, 0};
        int rc = ini_parse(config_path, on_ini_entry, &ctx);
        if (rc < 0) {
            fprintf(stderr, "%s: cannot open config file: %s\n", config_path, strerror(errno));
            return -1;
        }
        if (rc > 0 || ctx.failed) {
            if (rc > 0)
                fprintf(stderr, "%s: line %d: syntax error\n", config_path, rc);
            return -1;
        }
    }
    for (const config_entry_t *e = table; e->name; e++) {
        char env[128];
        env_name(e->name, env, sizeof(env));
        const char *v = getenv(env);
        if (v && set_value(e, v, env) < 0)
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
        if (set_value(e, val, "flags") < 0)
            return -1;
    }
    return 0;
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
    }
}
