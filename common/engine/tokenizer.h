/*
 * tokenizer: SentencePiece-style BPE for GGUF `tokenizer.ggml.model = "llama"`, as in
 * llama2.c's run.c: a dummy-prefix space, merges chosen by highest score, byte fallback to
 * <0xXX> tokens for text the vocabulary cannot spell, optional BOS.
 *
 * Loaded from the tokenizer.ggml.* keys of a GGUF file only (the gateway never maps the
 * weights). Read-only after load, safe to share between threads.
 */
#ifndef TP_TOKENIZER_H
#define TP_TOKENIZER_H

#include <stddef.h>

#include "gguf.h"

typedef struct tokenizer tokenizer_t;

/* Load the vocabulary from a GGUF file. NULL on failure with a message naming the file
 * in err. */
tokenizer_t *tokenizer_load(const char *gguf_path, char *err, size_t errlen);
/* Load the vocabulary from a GGUF already open (borrowed: the tokenizer copies what it
 * keeps, so g may be closed afterwards). NULL on failure with a message naming
 * gguf_path(g) in err. */
tokenizer_t *tokenizer_load_gguf(const gguf_t *g, char *err, size_t errlen);
void tokenizer_destroy(tokenizer_t **t);

int tokenizer_vocab_size(const tokenizer_t *t);
int tokenizer_bos(const tokenizer_t *t);
int tokenizer_eos(const tokenizer_t *t);

/* Encode len bytes of text (need not be NUL-terminated) into at most cap ids.
 * add_bos: prepend BOS. Returns the number of ids, or -1 if cap is too small
 * (then the count needed is in *needed when needed != NULL) or out of memory (*needed
 * untouched). SentencePiece-style BPE as llama2.c's run.c: one id per codepoint (byte
 * fallback), then the adjacent pair whose merged piece scores highest is merged, the
 * leftmost on a tie, until none is in the vocabulary; in O(n log n) time for n bytes (a
 * heap of candidate merges), so a long prompt costs what its length says. */
int tokenizer_encode(const tokenizer_t *t, const char *text, size_t len, int add_bos, int *out,
                     int cap, int *needed);

/* The same with run.c's own merge loop, O(n^2): the reference tokenizer_encode is tested
 * against (ids identical for every input). */
int tokenizer_encode_ref(const tokenizer_t *t, const char *text, size_t len, int add_bos,
                         int *out, int cap, int *needed);

/* Bytes that token `id` adds to the text when it follows token `prev` (-1 for none):
 * byte tokens <0xXX> give their byte; the leading space of a piece right after BOS is
 * dropped (run.c's rule); BOS/EOS/unknown control tokens give "". Borrowed pointer,
 * *len bytes, not NUL-terminated. id out of range gives "". */
const char *tokenizer_piece(const tokenizer_t *t, int prev, int id, size_t *len);

#endif
