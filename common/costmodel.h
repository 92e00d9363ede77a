/*
 * costmodel: how long an accelerator takes to run one prefill batch or one decode step of
 * a named model, for emulated workers and for tidepool-sim. Figures obtained with it are
 * *emulated*, never measurements; label them so.
 *
 * A roofline with two efficiency factors, as in the "LLM inference performance
 * engineering" literature (and DistServe's own latency model):
 *   prefill_ms = max(FLOPs / (peak_flops * mfu_prefill), weight_bytes / (hbm_bw * mbu))
 *                + prefill_overhead_ms
 *     FLOPs    = 2 * n_params * n_tokens + 4 * n_layer * d_attn * attn_pairs
 *   decode_step_ms = max((weight_bytes + kv_bytes_per_token * ctx_tokens) / (hbm_bw * mbu),
 *                        (2 * n_params * batch + 4 * n_layer * d_attn * ctx_tokens)
 *                          / (peak_flops * mfu_decode))
 *                    + step_overhead_ms
 * where attn_pairs counts (query token, key token) pairs the batch's attention visits
 * (costmodel_attn_pairs) and ctx_tokens is the total context of the running sequences.
 * Every time (these two and the KV transfer) is then multiplied by time_scale, 1 unless the
 * preset is dilated ("NAME:dilate=K", emulating the accelerator K times slower). The KV
 * capacity is multiplied by token_scale ("NAME:token-scale=S"), the scale of the requests'
 * token counts (traces scaled for a small real model, docs/workloads.md).
 * Every parameter of every preset, and its source, is in docs/scheduler.md.
 *
 * Pure functions of a read-only parameter struct: thread-safe, no allocation.
 */
#ifndef TP_COSTMODEL_H
#define TP_COSTMODEL_H

#include <stddef.h>

#define COSTMODEL_NAME_MAX 64

typedef struct {
    char name[COSTMODEL_NAME_MAX]; /* preset name, e.g. "a100-llama3-8b" or
                                    * "a100-llama3-8b:dilate=10" */
    /* time dilation: every time the model gives (prefill, decode step, transfer) is
     * multiplied by this; 1 = the accelerator's own speed. Emulating K times slower keeps
     * every ratio of the accelerator (prefill vs decode, compute vs memory vs link) while the
     * real work under the emulation (the small model, sockets, the client) shrinks K times
     * relative to it. Rates divide by K and latencies multiply by K. */
    double time_scale;
    /* the requests' token scale: one token of a request stands for 1 / token_scale tokens of
     * the emulated model (docs/workloads.md scales real traces by 0.1 to fit the small real
     * model's context). It scales the KV capacity only (costmodel_kv_capacity_tokens), so a
     * scaled request holds the share of the emulated cache the real one would: as many
     * requests fit as would on the accelerator. Times are charged for the tokens as given.
     * In (0, 1]; 0 counts as 1 (a struct filled by hand without it is unscaled). */
    double token_scale;
    /* accelerator */
    double peak_flops;          /* dense bf16 FLOP/s */
    double hbm_bytes_per_s;     /* memory bandwidth, bytes/s */
    double hbm_bytes;           /* memory capacity, bytes */
    double mfu_prefill;         /* achieved / peak FLOP/s in prefill GEMMs, (0, 1] */
    double mfu_decode;          /* the same for decode steps (small GEMMs), (0, 1] */
    double mbu;                 /* achieved / peak memory bandwidth (MBU), (0, 1] */
    double mem_util;            /* share of memory the server may use (vLLM's 0.9) */
    double activation_bytes;    /* reserved for activations and workspace, bytes */
    double prefill_overhead_ms; /* per prefill batch: scheduling, sampling, launches */
    double step_overhead_ms;    /* per decode step: scheduling, sampling, launches */
    /* interconnect for KV transfer (prefill -> decode, decode -> decode migration) */
    double link_bytes_per_s;
    double link_latency_ms;
    /* model */
    double n_params;        /* parameters */
    double bytes_per_param; /* 2 = bf16 */
    int n_layer;
    int d_model;
    int n_head, n_kv_head, head_dim;
    int kv_bytes_per_elem; /* 2 = bf16 KV cache */
    /* serving limits (the emulated engine's settings) */
    int prefill_token_budget; /* tokens per prefill batch (a longer prompt runs alone) */
    int max_seqs;             /* running sequences per decode worker */
} costmodel;

/* Fill *out with the named preset. Returns 0, or -1 when the name is unknown or a suffix is
 * bad. Presets: "a100-llama3-8b", "h100-llama3-8b". Suffixes, each at most once, in any
 * order: ":dilate=K" (K a number in [1, 1000], e.g. "a100-llama3-8b:dilate=10") gives
 * time_scale K: the same accelerator running K times slower in every respect;
 * ":token-scale=S" (S in (0, 1], e.g. "a100-llama3-8b:dilate=10:token-scale=0.1") gives
 * token_scale S: the KV capacity counted in tokens of requests scaled by S. out->name is the
 * whole name given (it must be shorter than COSTMODEL_NAME_MAX). */
int costmodel_preset(const char *name, costmodel *out);

/* The preset names, NULL-terminated (static storage). */
const char *const *costmodel_preset_names(void);

/* 0 when every parameter is in range, else -1 with a message naming the field in err. */
int costmodel_check(const costmodel *cm, char *err, size_t err_len);

/* Bytes of KV cache one token occupies: 2 (K, V) * n_layer * n_kv_head * head_dim * elem. */
double costmodel_kv_bytes_per_token(const costmodel *cm);

/* Bytes of model weights: n_params * bytes_per_param. */
double costmodel_weight_bytes(const costmodel *cm);

/* Tokens of KV cache that fit on one worker: floor((hbm * mem_util - weights - activations)
 * / kv_bytes_per_token * token_scale), at least 0. Emulated workers (--emulate) size their
 * KV cache to it and tidepool-sim admits by it. */
double costmodel_kv_capacity_tokens(const costmodel *cm);

/* Attention (query, key) pairs of one prompt of n_tokens new tokens after ctx_before
 * tokens already in the cache (causal): n*(n+1)/2 + ctx_before*n. Sum over a batch. */
double costmodel_attn_pairs(double n_tokens, double ctx_before);

/* Time (ms) of one prefill batch of n_tokens new tokens whose attention visits attn_pairs
 * pairs. n_tokens <= 0 gives 0. */
double costmodel_prefill_ms(const costmodel *cm, double n_tokens, double attn_pairs);

/* Time (ms) of one decode step over batch sequences holding ctx_tokens tokens of context
 * in total (each sequence emits one token). batch <= 0 gives 0. */
double costmodel_decode_step_ms(const costmodel *cm, double batch, double ctx_tokens);

/* Time (ms) to move n_tokens tokens of KV over the link: latency + bytes / bandwidth. */
double costmodel_transfer_ms(const costmodel *cm, double n_tokens);

/* Prompt tokens per second of one prefill worker running full batches of prompts of
 * prompt_len tokens (prefill_token_budget per batch, at least one prompt). */
double costmodel_prefill_tokens_per_s(const costmodel *cm, double prompt_len);

/* The largest decode batch (1..max_seqs) whose step time stays within step_ms_max and
 * whose KV (batch * mean_ctx tokens) fits in costmodel_kv_capacity_tokens, when every
 * sequence holds mean_ctx tokens. Returns at least 1. */
int costmodel_decode_batch_within(const costmodel *cm, double step_ms_max, double mean_ctx);

#endif
