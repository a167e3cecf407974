/* The chain of kvmesh.hashing in one call: h_i = BLAKE2b-128(h_{i-1} ‖ chunk_i, person), for every full chunk.

   The same bytes as hashlib's BLAKE2b (RFC 7693), without Python's work per chunk: in Python the chain of a 131k-token
   prompt (512 chunks of 256 tokens) spends ~0.12 ms of its ~0.55 ms outside BLAKE2b itself. Optional: where this
   does not build (no C compiler), kvmesh.hashing runs the same chain in Python, and tests/unit/test_hashing.py
   holds both to the golden vectors and to each other.

   chain(prev, data, step, person) -> list of bytes
     prev    the 16-byte h_0 (kvmesh.hashing.root_hash)
     data    a C-contiguous buffer of whole chunks (the uint32 token ids, little-endian), len(data) % step == 0
     step    the bytes of one chunk (chunk_tokens * 4), >= 1
     person  BLAKE2b's personalisation, <= 16 bytes (b"kvmesh.chunk")
   Each h_i is the BLAKE2b digest (16 bytes, no key, no salt) of the 16 + step bytes prev ‖ chunk_i. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define DIGEST 16
#define BLOCK 128

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};

static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

static inline uint64_t load64(const uint8_t *p) {
    uint64_t w;
    memcpy(&w, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    w = __builtin_bswap64(w);
#endif
    return w;
}

static inline void store64(uint8_t *p, uint64_t w) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    w = __builtin_bswap64(w);
#endif
    memcpy(p, &w, 8);
}

#define ROTR(x, n) (((x) >> (n)) | ((x) << (64 - (n))))
#define G(r, i, a, b, c, d)                     \
    do {                                        \
        a = a + b + m[SIGMA[r][2 * i]];         \
        d = ROTR(d ^ a, 32);                    \
        c = c + d;                              \
        b = ROTR(b ^ c, 24);                    \
        a = a + b + m[SIGMA[r][2 * i + 1]];     \
        d = ROTR(d ^ a, 16);                    \
        c = c + d;                              \
        b = ROTR(b ^ c, 63);                    \
    } while (0)
#define ROUND(r)                                \
    do {                                        \
        G(r, 0, v[0], v[4], v[8], v[12]);       \
        G(r, 1, v[1], v[5], v[9], v[13]);       \
        G(r, 2, v[2], v[6], v[10], v[14]);      \
        G(r, 3, v[3], v[7], v[11], v[15]);      \
        G(r, 4, v[0], v[5], v[10], v[15]);      \
        G(r, 5, v[1], v[6], v[11], v[12]);      \
        G(r, 6, v[2], v[7], v[8], v[13]);       \
        G(r, 7, v[3], v[4], v[9], v[14]);       \
    } while (0)

/* One compression of a 128-byte block; t: the message bytes so far, this block's included (< 2**64 here). */
static inline void compress(uint64_t h[8], const uint8_t *block, uint64_t t, int last) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++) m[i] = load64(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= t;
    if (last) v[14] = ~v[14];
    ROUND(0); ROUND(1); ROUND(2); ROUND(3); ROUND(4); ROUND(5);
    ROUND(6); ROUND(7); ROUND(8); ROUND(9); ROUND(10); ROUND(11);
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* The chain over n chunks of `step` bytes into out (n * DIGEST bytes). h0: the state after the parameter block. */
static void chain(const uint64_t h0[8], const uint8_t *prev, const uint8_t *data, size_t step, size_t n,
                  uint8_t *out) {
    uint8_t blk[BLOCK];
    const size_t len = DIGEST + step; /* one message: prev ‖ chunk */
    for (size_t i = 0; i < n; i++) {
        const uint8_t *d = data + i * step; /* message byte k >= DIGEST is d[k - DIGEST] */
        uint64_t h[8];
        memcpy(h, h0, sizeof h);
        memcpy(blk, prev, DIGEST);
        if (len <= BLOCK) { /* the only block is the last */
            memcpy(blk + DIGEST, d, step);
            memset(blk + len, 0, BLOCK - len);
            compress(h, blk, len, 1);
        } else {
            memcpy(blk + DIGEST, d, BLOCK - DIGEST);
            compress(h, blk, BLOCK, 0);
            size_t off = BLOCK; /* message bytes compressed so far; the last block (full or not) is kept back */
            for (; len - off > BLOCK; off += BLOCK) compress(h, d + off - DIGEST, off + BLOCK, 0);
            memcpy(blk, d + off - DIGEST, len - off);
            memset(blk + (len - off), 0, BLOCK - (len - off));
            compress(h, blk, len, 1);
        }
        uint8_t *o = out + i * DIGEST;
        store64(o, h[0]);
        store64(o + 8, h[1]);
        prev = o;
    }
}

static PyObject *py_chain(PyObject *self, PyObject *args) {
    Py_buffer prev, data, person;
    Py_ssize_t step;
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "y*y*ny*:chain", &prev, &data, &step, &person)) return NULL;
    if (prev.len != DIGEST || step < 1 || data.len % step != 0 || person.len > 16) {
        PyErr_Format(PyExc_ValueError,
                     "chain: prev must be %d bytes, step >= 1, len(data) a multiple of step and person <= 16 "
                     "bytes (got %zd, %zd, %zd, %zd)",
                     DIGEST, prev.len, step, data.len, person.len);
        goto done;
    }
    size_t n = (size_t)(data.len / step);
    uint8_t param[64] = {DIGEST, 0, 1, 1}; /* digest length, key length, fanout, depth; no salt */
    memcpy(param + 48, person.buf, (size_t)person.len);
    uint64_t h0[8];
    for (int i = 0; i < 8; i++) h0[i] = IV[i] ^ load64(param + 8 * i);
    uint8_t *out = PyMem_Malloc(n ? n * DIGEST : 1);
    if (out == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (n * (size_t)step >= 65536) {
        Py_BEGIN_ALLOW_THREADS chain(h0, prev.buf, data.buf, (size_t)step, n, out);
        Py_END_ALLOW_THREADS
    } else {
        chain(h0, prev.buf, data.buf, (size_t)step, n, out);
    }
    result = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; result != NULL && i < n; i++) {
        PyObject *b = PyBytes_FromStringAndSize((const char *)out + i * DIGEST, DIGEST);
        if (b == NULL) Py_CLEAR(result);
        else PyList_SET_ITEM(result, (Py_ssize_t)i, b);
    }
    PyMem_Free(out);
done:
    PyBuffer_Release(&prev);
    PyBuffer_Release(&data);
    PyBuffer_Release(&person);
    return result;
}

static PyMethodDef methods[] = {
    {"chain", py_chain, METH_VARARGS, "chain(prev, data, step, person) -> list of the chained BLAKE2b-128 digests"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvmesh._chainhash",
                                    "kvmesh.hashing's chain of BLAKE2b-128 digests, in C", -1, methods};

PyMODINIT_FUNC PyInit__chainhash(void) { return PyModule_Create(&module); }
