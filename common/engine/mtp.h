/*
 * mtp: multi-token-prediction modules (DeepSeek-V3 layout, llama.cpp "nextn" tensor names)
 * for a loaded model: loading, validation and the module forward pass. The format and the
 * exact forward semantics are in docs/mtp.md; the draft-and-verify loop that uses the
 * modules is specdec.h.
 *
 * Modules come from the model file itself (when it has `llama.nextn_predict_layers`; its
 * `llama.block_count` then counts them, as llama.cpp writes DeepSeek-V3, and the main
 * stack is the first block_count - nextn blocks) or from a side file that holds only the
 * modules (`llama.block_count` = the base's blocks). Module k (k = 1, 2) is block
 * `L + k - 1` (L = the main model's blocks) and keeps its K/V in KV-cache layer
 * `L + k - 1`: a cache for MTP has n_layer = L + mtp_n_modules() layers.
 *
 * Module k at position i reads the hidden state h_{k-1}[i] (h_0 = the main model's
 * residual before the final norm, model_seq_batch.hidden) and the token t_{i+k}; its
 * output h_k[i] feeds module k + 1, and its logits (the main model's final norm and head)
 * predict t_{i+k+1}. The handle is read-only after loading and may be shared by threads.
 */
#ifndef TP_MTP_H
#define TP_MTP_H

#include <stddef.h>
#include <stdint.h>

#include "kvcache.h"
#include "model.h"

#define MTP_MAX_MODULES 2 /* modules used (MTP depth); a file with more uses the first two */

typedef struct mtp mtp_t;

/* Whether the model file itself carries modules (llama.nextn_predict_layers > 0). */
int mtp_model_has_modules(const model_t *m);

/* Load the modules for model m (borrowed: must outlive the handle). path NULL: from the
 * model file itself; else a side file (mmapped). Every dimension and the semantics keys
 * (`tidepool.mtp.rope_position` = "hidden", `hidden_input` = "pre_final_norm", `head` =
 * "shared", `tidepool.rope.pairing` = "adjacent", when present) are checked against the
 * base and what this engine implements. On failure returns NULL and writes a message
 * naming the file and the problem into err. */
mtp_t *mtp_load(const model_t *m, const char *path, char *err, size_t errlen);
/* mtp_load from a side file already open (gguf_open or gguf_open_mem): *side is consumed
 * (the handle owns it, or it is closed on failure; set to NULL either way). The same
 * checks and messages as mtp_load with a path. */
mtp_t *mtp_load_gguf(const model_t *m, gguf_t **side, char *err, size_t errlen);
/* Unmap and free; takes NULL; sets *mt to NULL. */
void mtp_destroy(mtp_t **mt);

/* The default side file of a model: the first existing of, with NAME = the model's
 * general.name (else the file's base name without .gguf):
 *   DIR/NAME-mtp.gguf and DIR/mtp/NAME-mtp.gguf (DIR = the model file's directory),
 *   models/mtp/NAME-mtp.gguf relative to the working directory, and relative to the
 *   repository the running program was built in (the executable's ../../).
 * Writes it into out (cap bytes) and returns 0, or -1 when none exists. */
int mtp_default_path(const model_t *m, const char *model_path, char *out, size_t cap);

int mtp_n_modules(const mtp_t *mt);
/* The file the modules came from (the model's, or the side file). */
const char *mtp_path(const mtp_t *mt);
/* XXH64 over the modules' tensors (names, types, shapes, bytes): two workers with the same
 * value compute the same module K/V. */
uint64_t mtp_fingerprint(const mtp_t *mt);
/* Cache layer of module k (1-based): the model's n_layer + k - 1. */
int mtp_kv_layer(const mtp_t *mt, int k);
/* Bytes of module k's matrices (one forward pass of the module, head not counted). */
uint64_t mtp_matmul_bytes(const mtp_t *mt, int k);
/* Acceptance measured by the trainer (`tidepool.mtp.acceptance_rate`: P(d1 accepted),
 * P(d2 accepted | d1 accepted)) into rate[0..1]. Returns 0, or -1 when the file does not
 * say (rate untouched). */
int mtp_acceptance_rate(const mtp_t *mt, float rate[2]);

/* Run module k (1-based) over n batch items: model_forward_nextn on its cache layer (see
 * model.h for the item fields: hidden_in required, logits and hidden optional). Returns 0,
 * or -1 on invalid arguments. */
int mtp_forward(model_ctx_t *ctx, kvcache_t *kv, const mtp_t *mt, int k,
                const model_seq_batch *batch, int n);

/* --- the draft vocabulary (FR-Spec, Zhao et al. 2025, arXiv 2502.14856)
 *
 * A module's logits through the full output head cost vocab x dim multiply-adds per
 * draft: on a 32k vocabulary as much as the module's block. Drafts are only proposals (the
 * main model's verify pass decides, so greedy output is unchanged), so they may be taken
 * over a frequency-ranked subset of the vocabulary: the first n tokens of mtp_draft_ids.
 * The subset head is the output matrix's own rows gathered once (mtp_set_draft_vocab), so
 * each subset logit is bit-identical to the full head's at that token. The ranking is
 * computed at load: the modules' file's measured list (`tidepool.mtp.draft_vocab`, i32
 * token ids, most frequent first; ids out of range and repeats skipped) when present, then EOS and BOS, then the tokenizer's
 * normal tokens by score (BPE merge order), then the rest (bytes, control) by id. */
#define MTP_DRAFT_VOCAB_MIN 256 /* mtp_default_draft_vocab: at least this many tokens */
#define MTP_DRAFT_VOCAB_DIV 4   /* ... and vocab / 4 */

/* The load-time ranking: a permutation of the vocabulary (vocab ids), most likely draft
 * first; borrowed, lives as long as mt. */
const int *mtp_draft_ids(const mtp_t *mt);
/* The default draft vocabulary size: max(MTP_DRAFT_VOCAB_MIN, vocab / MTP_DRAFT_VOCAB_DIV),
 * capped at vocab. */
int mtp_default_draft_vocab(const mtp_t *mt);
/* Draft over the first n tokens of mtp_draft_ids (n <= 0 or >= vocab: the full head).
 * mtp_load sets mtp_default_draft_vocab. Gathers n rows of the output matrix (n x dim in its type;
 * owned by mt). Not thread-safe against forward passes using mt. Returns 0, or -1 out of
 * memory (the previous setting stays). */
int mtp_set_draft_vocab(mtp_t *mt, int n);
/* Tokens the draft logits of mtp_forward_draft cover (vocab for the full head). */
int mtp_draft_vocab(const mtp_t *mt);
/* The token of each draft logit: NULL with the full head (entry j is token j), else
 * mtp_draft_ids (entry j is token ids[j], j < mtp_draft_vocab). Borrowed. */
const int *mtp_draft_map(const mtp_t *mt);
/* mtp_forward with the draft head: each wanted logit row is mtp_draft_vocab(mt) floats,
 * entry j the logit of token mtp_draft_map(mt)[j] (with the full head: token j, exactly
 * mtp_forward). Returns 0, or -1 on invalid arguments. */
int mtp_forward_draft(model_ctx_t *ctx, kvcache_t *kv, const mtp_t *mt, int k,
                      const model_seq_batch *batch, int n);

#endif
