/*
 * settings: a worker's settings, one field per entry of the config table in worker.c
 * (flag --name, TIDEPOOL_NAME, config key name). Validated at start-up, never changed.
 */
#ifndef TP_SETTINGS_H
#define TP_SETTINGS_H

typedef struct {
    char *gateway, *model_path, *worker_id, *role_name, *kv_bind, *kv_advertise, *log_level;
    long long kv_blocks, block_size, max_seqs, max_batch_tokens, heartbeat_ms, lease_ms;
    long long debug_step_delay_ms;
    double kv_watermark; /* --kv-watermark: fraction of the KV blocks a new sequence must
                          * leave free (vLLM's watermark) */
    long long prefill_chunk_tokens; /* prompt tokens per sequence per forward pass */
    long long threads;              /* compute threads (0 = CPUs available) */
    char *emulate;                  /* --emulate: cost-model preset ("" = real compute) */
    int emulate_kv_pad;             /* --emulate-kv-pad: pad KV transfers to the emulated bytes */
    char *mtp_setting;              /* --mtp: "auto" | "none" | a side file */
    long long mtp_depth_set;        /* --mtp-depth: -1 = 2 when modules are loaded */
    int mtp_adaptive;               /* --mtp-adaptive */
    int prefix_cache;               /* --prefix-cache: automatic prefix caching (prefill,
                                     * decode and mixed roles) */
    char *mtp_sampling;             /* --mtp-sampling: rejection | onehot */
    char *health_file;              /* --health-file: state file for health checks ("" = none) */
    char *curve_secret_key;         /* --curve-secret-key: its key pair file ("" = no CURVE) */
    char *curve_gateway_key;        /* --curve-gateway-key: the gateway's public key file */
    char *curve_authorized_keys;    /* --curve-authorized-keys: peers admitted to its kv socket */
} worker_settings;

#endif
