/*
 * fuzz_common: what the fuzzing harnesses (tests/fuzz/fuzz_*.c), the replay driver
 * (replay_main.c) and the seed generator (make_seeds.c) share: a check that aborts (so
 * libFuzzer and the replay both report it as a crash), quiet logging, page-aligned copies
 * of an input, the real default model's path, and small synthetic Llama GGUF files written
 * with the project's own writer (common/engine/gguf_writer.c).
 *
 * Each harness defines LLVMFuzzerTestOneInput(data, size) and nothing else that libFuzzer
 * calls; set-up is lazy (a static flag on the first input), kept for the process, so that
 * leak detection sees only what one input leaves behind.
 */
#ifndef TP_FUZZ_COMMON_H
#define TP_FUZZ_COMMON_H

#include <stddef.h>
#include <stdint.h>

#include "gguf.h"

/* libFuzzer's entry point, defined by each harness. Returns 0. */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* A property every input must keep: on failure print it and abort (a crash to libFuzzer). */
#define FUZZ_CHECK(cond) \
    do { if (!(cond)) fuzz_fail(#cond, __FILE__, __LINE__); } while (0)
void fuzz_fail(const char *expr, const char *file, int line) __attribute__((noreturn));

/* Silence the project's log (a harness feeds bad input on purpose: every rejection would
 * be a log line). */
void fuzz_quiet(void);

/* A copy of data (size bytes) in page-aligned memory, as a file's mmap would be (GGUF
 * tensor data is then aligned the way the file says). Free with free(). Never NULL (aborts
 * on out of memory); size 0 gives a one-byte buffer. */
void *fuzz_aligned_copy(const uint8_t *data, size_t size);

/* The whole file at path, malloc'd (caller frees), its size in *n; NULL if unreadable. */
unsigned char *fuzz_read_file(const char *path, size_t *n);

/* The default model (TIDEPOOL_TEST_MODEL, else build/models/stories260K.gguf, which `make`
 * converts from ../shared/models). Aborts with a message when it is missing. */
const char *fuzz_model_path(void);

/* A synthetic Llama model. Matrices are `wtype` (F32, F16 or Q8_0: then dim and hidden_dim
 * must be multiples of 32); vectors are F32; values are a fixed pseudo-random sequence. */
typedef struct {
    int dim, hidden_dim, n_layer, n_head, n_kv_head, n_ctx;
    int n_vocab;        /* embedding rows; with_tokenizer: 3 + 256 + the merges (ignored) */
    gguf_tensor_type wtype;
    int with_base;      /* the main model's tensors and keys (0: an MTP side file) */
    int with_tokenizer; /* tokenizer.ggml.*: <unk> <s> </s>, the 256 <0xXX>, some merges */
    int with_output;    /* a separate output.weight (0: tied to the embedding) */
    int n_nextn;        /* MTP modules: blocks n_layer .. n_layer + n_nextn - 1 */
} fuzz_tiny_spec;

/* dim 8, hidden 16, 1 layer, 2 heads, 1 KV head, n_ctx 16, vocab 16, F32, base only. */
fuzz_tiny_spec fuzz_tiny_default(void);

/* Vocabulary size with_tokenizer writes. */
#define FUZZ_TINY_TOKENIZER_VOCAB (3 + 256 + 6)

/* Write the model s describes to path. 0, or -1 (message on stderr). */
int fuzz_tiny_write(const char *path, const fuzz_tiny_spec *s);

/* The same file's bytes, malloc'd (written to a temporary file and read back); NULL on
 * failure. */
unsigned char *fuzz_tiny_bytes(const fuzz_tiny_spec *s, size_t *n);

#endif
