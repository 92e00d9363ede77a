/*
 * costmodel: roofline latency model of prefill batches and decode steps (see costmodel.h;
 * every preset figure and its source is listed in docs/scheduler.md).
 */
#include "costmodel.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Llama 3 8B (Meta model card and config.json): 8.03e9 parameters, 32 layers, d_model
 * 4096, 32 query heads, 8 KV heads (GQA), head_dim 128. bf16 weights and KV. */
#define LLAMA3_8B                                                                                  \
    .n_params = 8.03e9, .bytes_per_param = 2, .n_layer = 32, .d_model = 4096, .n_head = 32,        \
    .n_kv_head = 8, .head_dim = 128, .kv_bytes_per_elem = 2

static const costmodel presets[] = {
    {
        /* NVIDIA A100 80GB SXM4 datasheet: 312 TFLOPS dense bf16, 2,039 GB/s HBM2e, 80 GB.
         * One 200 Gb/s HDR InfiniBand NIC per GPU (DGX A100) = 25 GB/s for KV. */
        .name = "a100-llama3-8b",
        .time_scale = 1,
        .token_scale = 1,
        .peak_flops = 312e12,
        .hbm_bytes_per_s = 2.039e12,
        .hbm_bytes = 80e9,
        .mfu_prefill = 0.5,
        .mfu_decode = 0.4,
        .mbu = 0.75,
        .mem_util = 0.9,
        .activation_bytes = 2e9,
        .prefill_overhead_ms = 5,
        .step_overhead_ms = 2,
        .link_bytes_per_s = 25e9,
        .link_latency_ms = 0.05,
        LLAMA3_8B,
        .prefill_token_budget = 4096,
        .max_seqs = 256,
    },
    {
        /* NVIDIA H100 SXM5 datasheet: 989 TFLOPS dense bf16, 3.35 TB/s HBM3, 80 GB.
         * One 400 Gb/s NDR InfiniBand NIC per GPU (DGX H100) = 50 GB/s for KV. */
        .name = "h100-llama3-8b",
        .time_scale = 1,
        .token_scale = 1,
        .peak_flops = 989e12,
        .hbm_bytes_per_s = 3.35e12,
        .hbm_bytes = 80e9,
        .mfu_prefill = 0.45,
        .mfu_decode = 0.35,
        .mbu = 0.75,
        .mem_util = 0.9,
        .activation_bytes = 2e9,
        .prefill_overhead_ms = 4,
        .step_overhead_ms = 1.5,
        .link_bytes_per_s = 50e9,
        .link_latency_ms = 0.05,
        LLAMA3_8B,
        .prefill_token_budget = 8192,
        .max_seqs = 256,
    },
};

static const char *const preset_names[] = {"a100-llama3-8b", "h100-llama3-8b", NULL};

/* One ":key=value" suffix of a preset name: *v = the number, refused unless it is all of
 * [num, end) and in [lo, hi] (lo_open: lo itself excluded). Returns 0 or -1. */
static int suffix_number(const char *num, const char *end, double lo, int lo_open, double hi,
                         double *v)
{
    char buf[COSTMODEL_NAME_MAX];
    size_t n = (size_t)(end - num);
    if (n == 0 || n >= sizeof(buf))
        return -1;
    memcpy(buf, num, n);
    buf[n] = 0;
    char *stop;
    errno = 0;
    double x = strtod(buf, &stop);
    if (errno || *stop || !(x >= lo && x <= hi) || (lo_open && x == lo))
        return -1;
    *v = x;
    return 0;
}

int costmodel_preset(const char *name, costmodel *out)
{
    if (!name || strlen(name) >= COSTMODEL_NAME_MAX)
        return -1;
    /* "NAME" then ":dilate=K" and ":token-scale=S", each at most once, in any order */
    const char *colon = strchr(name, ':');
    size_t base_len = colon ? (size_t)(colon - name) : strlen(name);
    double scale = 1, tokens = 1;
    int has_dilate = 0, has_tokens = 0;
    for (const char *p = colon; p && *p;) {
        const char *key = p + 1, *next = strchr(key, ':');
        const char *end = next ? next : key + strlen(key);
        const char *eq = memchr(key, '=', (size_t)(end - key));
        if (!eq)
            return -1;
        size_t klen = (size_t)(eq - key);
        if (klen == 6 && strncmp(key, "dilate", 6) == 0 && !has_dilate) {
            if (suffix_number(eq + 1, end, 1, 0, 1000, &scale) < 0)
                return -1;
            has_dilate = 1;
        } else if (klen == 11 && strncmp(key, "token-scale", 11) == 0 && !has_tokens) {
            if (suffix_number(eq + 1, end, 0, 1, 1, &tokens) < 0)
                return -1;
            has_tokens = 1;
        } else {
            return -1;
        }
        p = next;
    }
    for (size_t i = 0; i < sizeof(presets) / sizeof(presets[0]); i++) {
        if (strlen(presets[i].name) == base_len && strncmp(presets[i].name, name, base_len) == 0) {
            *out = presets[i];
            out->time_scale = scale;
            out->token_scale = tokens;
            snprintf(out->name, sizeof(out->name), "%s", name);
            return 0;
        }
    }
    return -1;
}

const char *const *costmodel_preset_names(void)
{
    return preset_names;
}

int costmodel_check(const costmodel *cm, char *err, size_t err_len)
{
#define CHECK(cond, what)                                                                          \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            snprintf(err, err_len, "costmodel: %s", what);                                         \
            return -1;                                                                             \
        }                                                                                          \
    } while (0)
    CHECK(cm->time_scale > 0 && cm->time_scale <= 1000, "time_scale must be in (0, 1000]");
    CHECK(cm->token_scale >= 0 && cm->token_scale <= 1, "token_scale must be in (0, 1] (0: 1)");
    CHECK(cm->peak_flops > 0, "peak_flops must be > 0");
    CHECK(cm->hbm_bytes_per_s > 0, "hbm_bytes_per_s must be > 0");
    CHECK(cm->hbm_bytes > 0, "hbm_bytes must be > 0");
    CHECK(cm->mfu_prefill > 0 && cm->mfu_prefill <= 1, "mfu_prefill must be in (0, 1]");
    CHECK(cm->mfu_decode > 0 && cm->mfu_decode <= 1, "mfu_decode must be in (0, 1]");
    CHECK(cm->mbu > 0 && cm->mbu <= 1, "mbu must be in (0, 1]");
    CHECK(cm->mem_util > 0 && cm->mem_util <= 1, "mem_util must be in (0, 1]");
    CHECK(cm->activation_bytes >= 0, "activation_bytes must be >= 0");
    CHECK(cm->prefill_overhead_ms >= 0, "prefill_overhead_ms must be >= 0");
    CHECK(cm->step_overhead_ms >= 0, "step_overhead_ms must be >= 0");
    CHECK(cm->link_bytes_per_s > 0, "link_bytes_per_s must be > 0");
    CHECK(cm->link_latency_ms >= 0, "link_latency_ms must be >= 0");
    CHECK(cm->n_params > 0, "n_params must be > 0");
    CHECK(cm->bytes_per_param > 0, "bytes_per_param must be > 0");
    CHECK(cm->n_layer > 0 && cm->d_model > 0 && cm->n_head > 0 && cm->n_kv_head > 0 &&
              cm->head_dim > 0 && cm->kv_bytes_per_elem > 0,
          "model shape fields must be > 0");
    CHECK(cm->prefill_token_budget > 0, "prefill_token_budget must be > 0");
    CHECK(cm->max_seqs > 0, "max_seqs must be > 0");
    CHECK(costmodel_kv_capacity_tokens(cm) >= 1, "weights do not leave room for any KV");
#undef CHECK
    return 0;
}

double costmodel_kv_bytes_per_token(const costmodel *cm)
{
    return 2.0 * cm->n_layer * cm->n_kv_head * cm->head_dim * cm->kv_bytes_per_elem;
}

double costmodel_weight_bytes(const costmodel *cm)
{
    return cm->n_params * cm->bytes_per_param;
}

double costmodel_kv_capacity_tokens(const costmodel *cm)
{
    double free_bytes =
        cm->hbm_bytes * cm->mem_util - costmodel_weight_bytes(cm) - cm->activation_bytes;
    double tokens = cm->token_scale > 0 ? cm->token_scale : 1;
    return free_bytes > 0 ? floor(free_bytes / costmodel_kv_bytes_per_token(cm) * tokens) : 0;
}

double costmodel_attn_pairs(double n_tokens, double ctx_before)
{
    if (n_tokens <= 0)
        return 0;
    return n_tokens * (n_tokens + 1) / 2 + (ctx_before > 0 ? ctx_before : 0) * n_tokens;
}

/* Attention FLOPs per (query, key) pair over all layers: QK^T and AV are each one
 * multiply-add (2 FLOPs) per element of the n_head * head_dim query width. */
static double attn_flops_per_pair(const costmodel *cm)
{
    return 4.0 * cm->n_layer * (double)cm->n_head * cm->head_dim;
}

double costmodel_prefill_ms(const costmodel *cm, double n_tokens, double attn_pairs)
{
    if (n_tokens <= 0)
        return 0;
    double flops = 2.0 * cm->n_params * n_tokens + attn_flops_per_pair(cm) * attn_pairs;
    double t_compute = flops / (cm->peak_flops * cm->mfu_prefill);
    double t_mem = costmodel_weight_bytes(cm) / (cm->hbm_bytes_per_s * cm->mbu);
    return (1e3 * fmax(t_compute, t_mem) + cm->prefill_overhead_ms) * cm->time_scale;
}

double costmodel_decode_step_ms(const costmodel *cm, double batch, double ctx_tokens)
{
    if (batch <= 0)
        return 0;
    if (ctx_tokens < 0)
        ctx_tokens = 0;
    double bytes = costmodel_weight_bytes(cm) + costmodel_kv_bytes_per_token(cm) * ctx_tokens;
    double t_mem = bytes / (cm->hbm_bytes_per_s * cm->mbu);
    double flops = 2.0 * cm->n_params * batch + attn_flops_per_pair(cm) * ctx_tokens;
    double t_compute = flops / (cm->peak_flops * cm->mfu_decode);
    return (1e3 * fmax(t_mem, t_compute) + cm->step_overhead_ms) * cm->time_scale;
}

double costmodel_transfer_ms(const costmodel *cm, double n_tokens)
{
    if (n_tokens <= 0)
        return 0;
    return (cm->link_latency_ms +
            1e3 * n_tokens * costmodel_kv_bytes_per_token(cm) / cm->link_bytes_per_s) *
           cm->time_scale;
}

double costmodel_prefill_tokens_per_s(const costmodel *cm, double prompt_len)
{
    if (prompt_len < 1)
        prompt_len = 1;
    double per_batch = floor(cm->prefill_token_budget / prompt_len);
    if (per_batch < 1)
        per_batch = 1;
    double tokens = per_batch * prompt_len;
    double ms = costmodel_prefill_ms(cm, tokens, per_batch * costmodel_attn_pairs(prompt_len, 0));
    return tokens / (ms / 1e3);
}

int costmodel_decode_batch_within(const costmodel *cm, double step_ms_max, double mean_ctx)
{
    if (mean_ctx < 1)
        mean_ctx = 1;
    double kv_cap = costmodel_kv_capacity_tokens(cm);
    int best = 1;
    for (int b = 1; b <= cm->max_seqs; b++) {
        if (b * mean_ctx > kv_cap)
            break;
        if (costmodel_decode_step_ms(cm, b, b * mean_ctx) > step_ms_max)
            break;
        best = b;
    }
    return best;
}
