/*
 * config: one table of settings per program (name, type, default, bounds, help).
 *
 * Every setting has one name used three ways: flag `--kv-port 5560`, environment
 * `TIDEPOOL_KV_PORT=5560`, config-file key `kv-port = 5560` (INI syntax, parsed by inih; keys
 * may use '-' or '_'). Precedence: default < file (`--config FILE` or TIDEPOOL_CONFIG) <
 * environment < flags. Values are validated against their bounds at start-up and never
 * change afterwards. `--help` prints the table with defaults.
 *
 * A repeatable setting (CONFIG_STRING_LIST, CONFIG_SECRET_LIST) collects every value it is
 * given: `--api-key A --api-key B`, the key repeated in the file, or one environment
 * variable holding several values separated by commas (whitespace around each is dropped).
 * The precedence holds per source, not per value: values given as flags replace those of
 * the environment, which replace those of the file. An empty or blank value is an error
 * (`--api-key "$UNSET"` must not mean "no key"), and so is a CONFIG_SECRET_LIST value that
 * holds whitespace. A CONFIG_SECRET_LIST is logged as a count, never its values, and a
 * config file that sets one must be readable by its owner only (mode & 077 == 0).
 */
#ifndef TP_CONFIG_H
#define TP_CONFIG_H

#include <stdio.h>

typedef enum {
    CONFIG_INT,    /* long long, bounds [min, max] */
    CONFIG_DOUBLE, /* double, bounds [min, max] */
    CONFIG_STRING, /* char *, owned by the config module (freed by config_free) */
    CONFIG_BOOL,   /* int 0/1; accepts 1/0, true/false, yes/no, on/off */
    CONFIG_STRING_LIST, /* config_strings, repeatable; owned by the config module */
    CONFIG_SECRET_LIST, /* the same, for secrets (API keys): config_log prints only a count */
} config_type_t;

/* The values of a repeatable setting, in the order given (each NUL-terminated, non-empty).
 * Filled by config_load, freed by config_free; a default (config_entry_t.def) is one
 * value. origin names where the values came from, to quote in messages: "--NAME" (flags),
 * "TIDEPOOL_NAME" (environment), the config file's path, or "default"; NULL when n is 0. */
typedef struct {
    char **v;
    int n;
    char *origin;
} config_strings;

typedef struct {
    const char *name; /* flag name without "--", e.g. "kv-port" */
    config_type_t type;
    void *ptr;        /* long long *, double *, char **, int *, config_strings * by type */
    const char *def;  /* default as text (NULL = empty string / unset for strings) */
    double min, max;  /* bounds for INT and DOUBLE (inclusive) */
    const char *help;
} config_entry_t;

/* Apply defaults, then the config file, environment and argv in that order.
 * `table` ends with an entry whose name is NULL. `program` names the program in --help.
 * Returns 0 on success, 1 when --help was printed (caller exits 0), -1 on any invalid
 * value (empty list values included), unknown flag, unreadable file or a config file
 * setting a secret that group or others may access (a message naming the setting or file
 * is on stderr). Positional arguments are not accepted. */
int config_load(const config_entry_t *table, const char *program, int argc, char **argv);

/* Log the effective settings, one line each (INFO). */
void config_log(const config_entry_t *table);

/* Free strings allocated for CONFIG_STRING and the lists' values (an emptied list: v NULL,
 * n 0). */
void config_free(const config_entry_t *table);

#endif
