/*
 * gguf: reader (mmap) and writer for GGUF files (ggml's model format, versions 2 and 3).
 *
 * File layout (little-endian): magic "GGUF", u32 version, u64 tensor count, u64 metadata
 * count, the metadata key/value pairs (key = u64 length + bytes, u32 value type, value),
 * the tensor infos (name, u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset), padding
 * to `general.alignment` (default 32), then the tensor data; each tensor's offset is
 * relative to the start of the data section and a multiple of the alignment. ne[0] is the
 * fastest-varying dimension: a row-major matrix W (rows, cols) has ne = {cols, rows}.
 *
 * The reader validates the whole header at open: every count, string and array length is
 * checked against the file size, tensor types are known, shapes do not overflow, offsets
 * are aligned and every tensor lies inside the file. A bad file gives NULL and a message
 * naming the file, never a crash. After open the handle is read-only (thread-safe);
 * pointers it returns point into the mapping and live until gguf_close().
 */
#ifndef TP_GGUF_H
#define TP_GGUF_H

#include <stddef.h>
#include <stdint.h>

/* Metadata value types. */
typedef enum {
    GGUF_TYPE_UINT8 = 0,
    GGUF_TYPE_INT8 = 1,
    GGUF_TYPE_UINT16 = 2,
    GGUF_TYPE_INT16 = 3,
    GGUF_TYPE_UINT32 = 4,
    GGUF_TYPE_INT32 = 5,
    GGUF_TYPE_FLOAT32 = 6,
    GGUF_TYPE_BOOL = 7,
    GGUF_TYPE_STRING = 8,
    GGUF_TYPE_ARRAY = 9,
    GGUF_TYPE_UINT64 = 10,
    GGUF_TYPE_INT64 = 11,
    GGUF_TYPE_FLOAT64 = 12,
    GGUF_TYPE_COUNT_,
} gguf_type;

/* Tensor element types (ggml_type ids). Only these are accepted by the reader. */
typedef enum {
    GGUF_TENSOR_F32 = 0,
    GGUF_TENSOR_F16 = 1,
    GGUF_TENSOR_Q8_0 = 8, /* blocks of 32: f16 scale + 32 int8 (34 bytes); not yet used */
} gguf_tensor_type;

#define GGUF_MAX_DIMS 4
#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_NAME 256      /* tensor name bytes, excluding NUL */
#define GGUF_MAX_KV (1u << 20) /* sanity limits on counts in the header */
#define GGUF_MAX_TENSORS (1u << 20)

typedef struct gguf gguf_t;

/* One tensor of an open file. */
typedef struct {
    const char *name;           /* NUL-terminated copy, owned by the gguf handle */
    int n_dims;                 /* 1..GGUF_MAX_DIMS */
    uint64_t ne[GGUF_MAX_DIMS]; /* elements per dimension, ne[0] fastest; unused dims = 1 */
    gguf_tensor_type type;
    uint64_t n_elements;
    uint64_t n_bytes;
    uint64_t offset;  /* absolute file offset of the data */
    const void *data; /* into the mapping, aligned to the file's alignment */
} gguf_tensor_info;

/* Open and validate a GGUF file (read-only mmap of the whole file). On failure returns
 * NULL and writes "<path>: <problem>" into err (errlen bytes; err may be NULL). */
gguf_t *gguf_open(const char *path, char *err, size_t errlen);
/* Open and validate GGUF bytes held in memory (the same checks as gguf_open): data
 * (size bytes) is BORROWED and must outlive the handle; name (copied) stands for the path
 * in messages and gguf_path(). Tensor data is aligned to the file's alignment only when
 * data is (a page-aligned buffer always is). NULL with "<name>: <problem>" in err on
 * failure. For in-memory sources and the fuzzing harnesses (tests/fuzz/). */
gguf_t *gguf_open_mem(const void *data, size_t size, const char *name, char *err, size_t errlen);
/* Unmap (gguf_open) and free; takes NULL; sets *g to NULL. Invalidates every pointer
 * obtained. */
void gguf_close(gguf_t **g);

const char *gguf_path(const gguf_t *g);
uint32_t gguf_version(const gguf_t *g);
uint32_t gguf_alignment(const gguf_t *g);
/* Size of the file (the mapping) in bytes. */
size_t gguf_file_size(const gguf_t *g);

/* Metadata. Keys are compared as exact byte strings. */
int gguf_n_kv(const gguf_t *g);
/* Key of pair i (pointer into the mapping, *len bytes, not NUL-terminated). */
const char *gguf_kv_key(const gguf_t *g, int i, size_t *len);
gguf_type gguf_kv_type(const gguf_t *g, int i);
/* Index of `key`, or -1. */
int gguf_find_key(const gguf_t *g, const char *key);

/* Typed getters: 0 on success, -1 if the key is missing or its type does not fit.
 * get_u32/get_i32 accept any integer type whose value fits; get_f32 accepts FLOAT32 and
 * FLOAT64. */
int gguf_get_u32(const gguf_t *g, const char *key, uint32_t *out);
int gguf_get_i32(const gguf_t *g, const char *key, int32_t *out);
int gguf_get_f32(const gguf_t *g, const char *key, float *out);
/* String value: pointer into the mapping, *len bytes, NOT NUL-terminated. */
int gguf_get_str(const gguf_t *g, const char *key, const char **s, size_t *len);
/* Copy a string value into buf (NUL-terminated, truncated to cap - 1 bytes). */
int gguf_get_str_copy(const gguf_t *g, const char *key, char *buf, size_t cap);

/* Array value: element type and count (either out pointer may be NULL). -1 if missing or
 * not an array. */
int gguf_get_arr_info(const gguf_t *g, const char *key, gguf_type *elem_type, uint64_t *n);
/* Copy an array of strings: ptrs[i]/lens[i] point into the mapping (not NUL-terminated).
 * n must equal the array's length. 0, or -1 on missing key / wrong type / wrong n. */
int gguf_get_arr_str(const gguf_t *g, const char *key, const char **ptrs, size_t *lens, uint64_t n);
/* Copy an array of FLOAT32 into out (n must equal the array's length). */
int gguf_get_arr_f32(const gguf_t *g, const char *key, float *out, uint64_t n);
/* Copy an array of any integer type into out as int32 (values must fit). */
int gguf_get_arr_i32(const gguf_t *g, const char *key, int32_t *out, uint64_t n);

/* Tensors. */
int gguf_n_tensors(const gguf_t *g);
const gguf_tensor_info *gguf_tensor(const gguf_t *g, int i);
/* Tensor by name, or NULL. */
const gguf_tensor_info *gguf_find_tensor(const gguf_t *g, const char *name);

const char *gguf_tensor_type_name(gguf_tensor_type t);
/* Bytes of n elements of type t (n must be a multiple of the block size for Q8_0);
 * 0 for an unknown type. */
uint64_t gguf_tensor_nbytes(gguf_tensor_type t, uint64_t n);

/* IEEE half <-> single conversion (round to nearest even; NaN/Inf preserved). */
float gguf_fp16_to_fp32(uint16_t h);
uint16_t gguf_fp32_to_fp16(float f);

/* ---------------------------------------------------------------------------------------
 * Writer: collects key/value pairs and tensors, then writes a version-3 file in one go.
 * Keys are written in the order they were added. Not thread-safe.
 */
typedef struct gguf_writer gguf_writer_t;

/* New empty writer (alignment 32). NULL on out of memory. */
gguf_writer_t *gguf_writer_new(void);
void gguf_writer_destroy(gguf_writer_t **w);

/* Add a metadata pair. Strings and arrays are copied. Adding `general.alignment` (u32, a
 * power of two) changes the alignment used for the tensor data. Return 0, or -1 on out of
 * memory or a bad argument. A key added twice is written twice (don't). */
int gguf_writer_add_u32(gguf_writer_t *w, const char *key, uint32_t v);
int gguf_writer_add_i32(gguf_writer_t *w, const char *key, int32_t v);
int gguf_writer_add_f32(gguf_writer_t *w, const char *key, float v);
int gguf_writer_add_bool(gguf_writer_t *w, const char *key, int v);
int gguf_writer_add_str(gguf_writer_t *w, const char *key, const char *s);
/* Array of n strings given as (ptr, len) pairs (may contain any bytes). */
int gguf_writer_add_arr_str(gguf_writer_t *w, const char *key, const char *const *strs,
                            const size_t *lens, uint64_t n);
int gguf_writer_add_arr_f32(gguf_writer_t *w, const char *key, const float *v, uint64_t n);
int gguf_writer_add_arr_i32(gguf_writer_t *w, const char *key, const int32_t *v, uint64_t n);

/* Add a tensor. ne[0] is the fastest dimension. `data` (gguf_tensor_nbytes(type, n)
 * bytes) is BORROWED: it must stay valid until gguf_writer_write() returns. Names must be
 * unique and at most GGUF_MAX_NAME bytes. 0 or -1. */
int gguf_writer_add_tensor(gguf_writer_t *w, const char *name, gguf_tensor_type type, int n_dims,
                           const uint64_t *ne, const void *data);

/* Write the file atomically: to "<path>.tmp.<pid>", fsync, rename to path. 0, or -1 with
 * a message naming the path in err. */
int gguf_writer_write(gguf_writer_t *w, const char *path, char *err, size_t errlen);
/* For programs that write a file and may be interrupted: install SIGINT, SIGTERM and
 * SIGHUP handlers that remove the temporary file of a gguf_writer_write() in progress,
 * then die of the signal as they would have (so the caller's exit status still says
 * which). A finished file (renamed) is never removed; a signal already ignored (nohup)
 * stays ignored. 0, or -1 (errno) if sigaction fails. */
int gguf_writer_cleanup_on_signals(void);

#endif
