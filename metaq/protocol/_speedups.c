/* metaq.protocol._speedups: the consumer's per-message work in C.
 *
 * Optional: metaq/protocol/_fast.py binds each name to its pure-Python twin there
 * (py_<name>) when this module is not built (no compiler) or METAQ_NO_SPEEDUPS=1.
 * Both give the same results; tests/protocol/test_speedups.py fuzzes them against each other.
 *
 * Message bytes (metaq/protocol/_message.py, reference section 5), big-endian:
 *     int32 length | int32 checksum | int64 msgId | int32 flag | payload[length]
 * checksum = CRC32(payload) & 0x7FFFFFFF, zlib's CRC-32.
 *
 * Functions (all positions are byte offsets into ``data``):
 *   crc32(data, value=0)                  -> int, same as zlib.crc32
 *   scan(data, verify, max_payload)       -> (bounds, count, stop, kind, a, b)
 *   take(data, pos, base, limit, max_bytes, verify, max_payload,
 *        topic, partition, codec, plain, attr) -> (messages, pos, status)
 *   deliver(data, pos, base, verify, max_payload,
 *           topic, partition, codec, plain, attr, listener, later)
 *                                         -> (status, pos, count, last, failed, exc)
 *   fast_puts(buf, pos, fast, max_payload, out, tx_cls=None) -> pos   (the broker's put
 *                                         parser)
 *   encode_puts(head, flag, payloads, checksums, opaques) -> (data, sizes)   (producer)
 *   encode_tx_puts(head, flag, payloads, checksums, key, opaques) -> data  (producer,
 *                                         transactions)
 * Status: END (no further whole message: the data is used up or the next
 * message is cut short), LIMIT (``limit`` messages taken), BAD (an impossible
 * length or a checksum mismatch at ``pos``), LATER (the listener returned
 * ``later`` for the message at ``pos``), ERROR (it raised; ``exc``).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <limits.h>
#include <errno.h>
#include <sys/socket.h>

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#include <immintrin.h>
#define METAQ_X86_SIMD 1
#endif

#define VERSION 7
#define HEADER 20

enum { ST_END = 0, ST_LIMIT = 1, ST_BAD = 2, ST_LATER = 3, ST_ERROR = 4 };
enum { PROBLEM_NONE = 0, PROBLEM_LENGTH = 1, PROBLEM_CHECKSUM = 2 };

/* ---- CRC-32 (zlib's polynomial, reflected) ------------------------------------------- */

static uint32_t crc_table[8][256];
static int have_clmul = 0, have_vclmul = 0;

static void crc_init(void)
{
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = crc_table[0][n];
        for (int k = 1; k < 8; k++) {
            c = crc_table[0][c & 0xff] ^ (c >> 8);
            crc_table[k][n] = c;
        }
    }
#ifdef METAQ_X86_SIMD
    __builtin_cpu_init();
    have_clmul = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
    have_vclmul = have_clmul && __builtin_cpu_supports("avx512f")
                  && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("vpclmulqdq");
    if (getenv("METAQ_NO_AVX512") != NULL)
        have_vclmul = 0;
    if (getenv("METAQ_NO_CLMUL") != NULL)
        have_clmul = have_vclmul = 0;
#endif
}

/* ``c`` is the running (inverted) register; slicing by 8 on little-endian hosts. */
static uint32_t crc_tables(uint32_t c, const unsigned char *p, size_t n)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        uint32_t lo = (uint32_t)w ^ c, hi = (uint32_t)(w >> 32);
        c = crc_table[7][lo & 0xff] ^ crc_table[6][(lo >> 8) & 0xff]
            ^ crc_table[5][(lo >> 16) & 0xff] ^ crc_table[4][lo >> 24]
            ^ crc_table[3][hi & 0xff] ^ crc_table[2][(hi >> 8) & 0xff]
            ^ crc_table[1][(hi >> 16) & 0xff] ^ crc_table[0][hi >> 24];
        p += 8;
        n -= 8;
    }
#endif
    while (n--)
        c = crc_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    return c;
}

#ifdef METAQ_X86_SIMD
/* The end shared by both folding loops: ``x1`` holds the folded 128 bits, ``n``
 * (a multiple of 16) bytes at ``p`` are left; returns the running register. */
__attribute__((target("pclmul,sse4.1"), always_inline))
static inline uint32_t crc_clmul_finish(__m128i x1, const unsigned char *p, size_t n)
{
    const __m128i k3k4 = _mm_set_epi64x(0x00ccaa009eLL, 0x01751997d0LL);
    const __m128i k5k0 = _mm_set_epi64x(0, 0x0163cd6124LL);
    const __m128i poly = _mm_set_epi64x(0x01f7011641LL, 0x01db710641LL);
    const __m128i mask32 = _mm_setr_epi32(~0, 0, ~0, 0);
    __m128i x0 = k3k4, x2, x5;
    while (n >= 16) {
        x2 = _mm_loadu_si128((const __m128i *)p);
        x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
        x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
        p += 16;
        n -= 16;
    }
    /* 128 -> 64 bits */
    x2 = _mm_clmulepi64_si128(x1, x0, 0x10);
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), x2);
    x0 = k5k0;
    x2 = _mm_srli_si128(x1, 4);
    x1 = _mm_and_si128(x1, mask32);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    /* Barrett reduction to 32 bits */
    x0 = poly;
    x2 = _mm_and_si128(x1, mask32);
    x2 = _mm_clmulepi64_si128(x2, x0, 0x10);
    x2 = _mm_and_si128(x2, mask32);
    x2 = _mm_clmulepi64_si128(x2, x0, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    return (uint32_t)_mm_extract_epi32(x1, 1);
}

/* Folding with carry-less multiplication (Intel, "Fast CRC Computation for
 * Generic Polynomials Using PCLMULQDQ", constants for the reflected zlib
 * polynomial as in the Linux kernel's crc32-pclmul).  ``n`` >= 64 and a
 * multiple of 16; ``c`` is the running register. */
__attribute__((target("pclmul,sse4.1")))
static uint32_t crc_clmul(uint32_t c, const unsigned char *p, size_t n)
{
    const __m128i k1k2 = _mm_set_epi64x(0x01c6e41596LL, 0x0154442bd4LL);
    const __m128i k3k4 = _mm_set_epi64x(0x00ccaa009eLL, 0x01751997d0LL);
    __m128i x0, x1, x2, x3, x4, x5, x6, x7, x8;

    x1 = _mm_loadu_si128((const __m128i *)(p + 0x00));
    x2 = _mm_loadu_si128((const __m128i *)(p + 0x10));
    x3 = _mm_loadu_si128((const __m128i *)(p + 0x20));
    x4 = _mm_loadu_si128((const __m128i *)(p + 0x30));
    x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)c));
    p += 64;
    n -= 64;
    x0 = k1k2;
    while (n >= 64) {
        x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
        x6 = _mm_clmulepi64_si128(x2, x0, 0x00);
        x7 = _mm_clmulepi64_si128(x3, x0, 0x00);
        x8 = _mm_clmulepi64_si128(x4, x0, 0x00);
        x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
        x2 = _mm_clmulepi64_si128(x2, x0, 0x11);
        x3 = _mm_clmulepi64_si128(x3, x0, 0x11);
        x4 = _mm_clmulepi64_si128(x4, x0, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x5), _mm_loadu_si128((const __m128i *)(p + 0x00)));
        x2 = _mm_xor_si128(_mm_xor_si128(x2, x6), _mm_loadu_si128((const __m128i *)(p + 0x10)));
        x3 = _mm_xor_si128(_mm_xor_si128(x3, x7), _mm_loadu_si128((const __m128i *)(p + 0x20)));
        x4 = _mm_xor_si128(_mm_xor_si128(x4, x8), _mm_loadu_si128((const __m128i *)(p + 0x30)));
        p += 64;
        n -= 64;
    }
    /* four lanes into one */
    x0 = k3k4;
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x3), x5);
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x4), x5);
    return crc_clmul_finish(x1, p, n);
}

/* The same folding four 512-bit lanes at a time (VPCLMULQDQ, AVX-512): 256
 * bytes a round.  A fold constant for distance D bits is
 * reflect32(x^(D+32) mod P) << 1 (low half) and the same for x^(D-32) (high
 * half).  ``n`` >= 256 and a multiple of 16. */
#define FOLD512(a, k, b) _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128((a), (k), 0x00), \
                                                   _mm512_clmulepi64_epi128((a), (k), 0x11), \
                                                   (b), 0x96)
#define FOLD128(a, k) _mm_xor_si128(_mm_clmulepi64_si128((a), (k), 0x00), \
                                    _mm_clmulepi64_si128((a), (k), 0x11))
__attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.1")))
static uint32_t crc_vclmul(uint32_t c, const unsigned char *p, size_t n)
{
    const __m512i k2048 = _mm512_broadcast_i32x4(_mm_set_epi64x(0x1322d1430LL, 0x11542778aLL));
    const __m512i k512 = _mm512_broadcast_i32x4(_mm_set_epi64x(0x1c6e41596LL, 0x154442bd4LL));
    const __m128i k384 = _mm_set_epi64x(0x174359406LL, 0x3db1ecdcLL);
    const __m128i k256 = _mm_set_epi64x(0x15a546366LL, 0xf1da05aaLL);
    const __m128i k128 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);
    __m512i z0 = _mm512_loadu_si512((const void *)(p + 0));
    __m512i z1 = _mm512_loadu_si512((const void *)(p + 64));
    __m512i z2 = _mm512_loadu_si512((const void *)(p + 128));
    __m512i z3 = _mm512_loadu_si512((const void *)(p + 192));
    z0 = _mm512_xor_si512(z0, _mm512_inserti32x4(_mm512_setzero_si512(),
                                                 _mm_cvtsi32_si128((int)c), 0));
    p += 256;
    n -= 256;
    while (n >= 256) {
        z0 = FOLD512(z0, k2048, _mm512_loadu_si512((const void *)(p + 0)));
        z1 = FOLD512(z1, k2048, _mm512_loadu_si512((const void *)(p + 64)));
        z2 = FOLD512(z2, k2048, _mm512_loadu_si512((const void *)(p + 128)));
        z3 = FOLD512(z3, k2048, _mm512_loadu_si512((const void *)(p + 192)));
        p += 256;
        n -= 256;
    }
    z1 = FOLD512(z0, k512, z1);
    z2 = FOLD512(z1, k512, z2);
    z3 = FOLD512(z2, k512, z3);
    while (n >= 64) {
        z3 = FOLD512(z3, k512, _mm512_loadu_si512((const void *)p));
        p += 64;
        n -= 64;
    }
    __m128i x1 = _mm_xor_si128(
        _mm_xor_si128(FOLD128(_mm512_extracti32x4_epi32(z3, 0), k384),
                      FOLD128(_mm512_extracti32x4_epi32(z3, 1), k256)),
        _mm_xor_si128(FOLD128(_mm512_extracti32x4_epi32(z3, 2), k128),
                      _mm512_extracti32x4_epi32(z3, 3)));
    return crc_clmul_finish(x1, p, n);
}
#endif

/* zlib's crc32(crc, p, n) */
static uint32_t crc32_update(uint32_t crc, const unsigned char *p, size_t n)
{
    uint32_t c = ~crc;
#ifdef METAQ_X86_SIMD
    if (have_vclmul && n >= 256) {
        size_t m = n & ~(size_t)15;
        c = crc_vclmul(c, p, m);
        p += m;
        n -= m;
    } else if (have_clmul && n >= 64) {
        size_t m = n & ~(size_t)15;
        c = crc_clmul(c, p, m);
        p += m;
        n -= m;
    }
#endif
    return ~crc_tables(c, p, n);
}

/* ---- header reading ------------------------------------------------------------------- */

static inline uint32_t be32(const unsigned char *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static inline int64_t be64(const unsigned char *p)
{
    return (int64_t)(((uint64_t)be32(p) << 32) | be32(p + 4));
}

/* One step of every walk.  Returns 1 when a whole, valid message starts at
 * ``pos`` (its end in *end), 0 when the data ends before one (END), -1 when the
 * bytes at ``pos`` are bad (BAD; *kind, *a, *b say why). */
static inline int step(const unsigned char *d, Py_ssize_t n, Py_ssize_t pos, int verify,
                       long long max_payload, Py_ssize_t *end, int *kind,
                       long long *a, long long *b)
{
    if (n - pos < HEADER)
        return 0;
    int32_t length = (int32_t)be32(d + pos);
    if (length < 0 || (long long)length > max_payload) {
        *kind = PROBLEM_LENGTH;
        *a = length;
        return -1;
    }
    Py_ssize_t e = pos + HEADER + (Py_ssize_t)length;
    if (e > n)
        return 0;
    if (verify) {
        uint32_t stored = be32(d + pos + 4);
        uint32_t actual = crc32_update(0, d + pos + HEADER, (size_t)length) & 0x7FFFFFFFu;
        if (actual != stored) {
            *kind = PROBLEM_CHECKSUM;
            *a = (int32_t)stored;
            *b = actual;
            return -1;
        }
    }
    *end = e;
    return 1;
}

/* ---- crc32 ---------------------------------------------------------------------------- */

static PyObject *
py_crc32(PyObject *self, PyObject *args)
{
    Py_buffer buf;
    unsigned int value = 0;
    if (!PyArg_ParseTuple(args, "y*|I:crc32", &buf, &value))
        return NULL;
    uint32_t r;
    if (buf.len > 65536) {
        Py_BEGIN_ALLOW_THREADS
        r = crc32_update(value, buf.buf, (size_t)buf.len);
        Py_END_ALLOW_THREADS
    } else {
        r = crc32_update(value, buf.buf, (size_t)buf.len);
    }
    PyBuffer_Release(&buf);
    return PyLong_FromUnsignedLong(r);
}

/* ---- scan ----------------------------------------------------------------------------- */

static PyObject *
py_scan(PyObject *self, PyObject *args)
{
    Py_buffer buf;
    int verify = 1, want_bounds = 1;
    long long max_payload = 0x7FFFFFFF;
    if (!PyArg_ParseTuple(args, "y*|pLp:scan", &buf, &verify, &max_payload, &want_bounds))
        return NULL;
    if (buf.len > 0x7FFFFFFF) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_ValueError, "scan: data longer than 2 GiB");
        return NULL;
    }
    const unsigned char *d = buf.buf;
    Py_ssize_t n = buf.len, pos = 0, end = 0, count = 0;
    int kind = PROBLEM_NONE;
    long long a = 0, b = 0;
    int32_t *bounds = NULL;
    if (want_bounds) {
        /* every message is at least HEADER bytes: this bounds the count */
        bounds = PyMem_RawMalloc((size_t)(n / HEADER + 1) * sizeof(int32_t));
        if (bounds == NULL) {
            PyBuffer_Release(&buf);
            return PyErr_NoMemory();
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        int r = step(d, n, pos, verify, max_payload, &end, &kind, &a, &b);
        if (r <= 0)
            break;
        if (bounds != NULL)
            bounds[count] = (int32_t)pos;
        count++;
        pos = end;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    PyObject *out = Py_None;
    Py_INCREF(out);
    if (bounds != NULL) {
        bounds[count] = (int32_t)pos;
        Py_DECREF(out);
        out = PyBytes_FromStringAndSize((const char *)bounds,
                                        (Py_ssize_t)((count + 1) * sizeof(int32_t)));
        PyMem_RawFree(bounds);
        if (out == NULL)
            return NULL;
    }
    return Py_BuildValue("(NnniLL)", out, count, pos, kind, a, b);
}

/* ---- messages ------------------------------------------------------------------------- */

typedef struct {
    PyObject *topic, *partition, *codec;
    PyTypeObject *plain, *attr;
} MsgKind;

static int
check_message_type(PyObject *t, const char *name)
{
    if (!PyType_Check(t) || !PyType_IsSubtype((PyTypeObject *)t, &PyTuple_Type)
        || ((PyTypeObject *)t)->tp_basicsize != PyTuple_Type.tp_basicsize
        || ((PyTypeObject *)t)->tp_itemsize != PyTuple_Type.tp_itemsize) {
        PyErr_Format(PyExc_TypeError, "%s must be a tuple subclass without instance fields",
                     name);
        return -1;
    }
    return 0;
}

/* Message layout (metaq/consumer/_message.py):
 * (topic, partition, offset, next_offset, msg_id, flag, payload, codec)
 *
 * ``carry`` is the int the walk made for the last message's next_offset (a new
 * reference, or NULL) at ``*carry_pos``: the next message starts there, so its
 * offset is that same int (one int fewer a message); replaced by this message's
 * next_offset.  The caller releases it when the walk ends. */
static PyObject *
build(const MsgKind *k, const unsigned char *d, Py_ssize_t pos, Py_ssize_t end,
      long long base, PyObject **carry, Py_ssize_t *carry_pos)
{
    int32_t flag = (int32_t)be32(d + pos + 16);
    PyTypeObject *tp = (flag & 1) ? k->attr : k->plain;
    /* Not tp_alloc (PyType_GenericAlloc): that zeroes the items and tracks the
     * tuple, which is untracked again below; every item is set right away. */
    PyObject *m = (PyObject *)PyObject_GC_NewVar(PyTupleObject, tp, 8);
    if (m == NULL)
        return NULL;
    PyObject *off;
    if (*carry != NULL && *carry_pos == pos) {
        off = *carry;  /* the carried reference becomes the message's */
        *carry = NULL;
    } else {
        Py_CLEAR(*carry);
        off = PyLong_FromLongLong(base + pos);
    }
    PyObject *next = PyLong_FromLongLong(base + end);
    PyObject *id = PyLong_FromLongLong(be64(d + pos + 8));
    PyObject *fl = PyLong_FromLong(flag);
    PyObject *payload = PyBytes_FromStringAndSize((const char *)d + pos + HEADER,
                                                  end - pos - HEADER);
    Py_INCREF(k->topic);
    Py_INCREF(k->partition);
    Py_INCREF(k->codec);
    PyTuple_SET_ITEM(m, 0, k->topic);
    PyTuple_SET_ITEM(m, 1, k->partition);
    PyTuple_SET_ITEM(m, 2, off);
    PyTuple_SET_ITEM(m, 3, next);
    PyTuple_SET_ITEM(m, 4, id);
    PyTuple_SET_ITEM(m, 5, fl);
    PyTuple_SET_ITEM(m, 6, payload);
    PyTuple_SET_ITEM(m, 7, k->codec);
    if (!off || !next || !id || !fl || !payload) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(next);
    *carry = next;
    *carry_pos = end;
    /* Its items are strings, ints, bytes and the shared codec: a message is never
     * part of a reference cycle, so the cyclic GC need not track it (CPython
     * untracks such tuples itself, but only after a collection has looked at
     * them; a batch of 500 live messages would trigger collections).
     * PyObject_GC_NewVar leaves it untracked. */
    return m;
}

static int
parse_kind(MsgKind *k, PyObject *plain, PyObject *attr)
{
    if (check_message_type(plain, "plain") < 0 || check_message_type(attr, "attr") < 0)
        return -1;
    k->plain = (PyTypeObject *)plain;
    k->attr = (PyTypeObject *)attr;
    return 0;
}

/* Fill ``k``'s types and check ``pos``; on failure release ``buf`` and set an error. */
static int
check_args(MsgKind *k, PyObject *plain, PyObject *attr, Py_ssize_t pos, Py_buffer *buf,
           const char *fn)
{
    if (parse_kind(k, plain, attr) < 0 || pos < 0 || pos > buf->len) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "%s: pos outside the data", fn);
        PyBuffer_Release(buf);
        return -1;
    }
    return 0;
}

#define TAKE_HELD 512

/* A list of the ``count`` messages in ``held``, whose references it takes (on
 * failure they are released). */
static PyObject *
take_list(PyObject **held, Py_ssize_t count)
{
    PyObject *list = PyList_New(count);
    if (list == NULL) {
        for (Py_ssize_t i = 0; i < count; i++)
            Py_DECREF(held[i]);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++)
        PyList_SET_ITEM(list, i, held[i]);
    return list;
}

static PyObject *
py_take(PyObject *self, PyObject *args)
{
    Py_buffer buf;
    Py_ssize_t pos, limit, max_bytes;
    long long base, max_payload;
    int verify;
    MsgKind k;
    PyObject *plain, *attr;
    if (!PyArg_ParseTuple(args, "y*nLnnpLOOOOO:take", &buf, &pos, &base, &limit, &max_bytes,
                          &verify, &max_payload, &k.topic, &k.partition, &k.codec, &plain,
                          &attr))
        return NULL;
    if (check_args(&k, plain, attr, pos, &buf, "take") < 0)
        return NULL;
    const unsigned char *d = buf.buf;
    Py_ssize_t n = buf.len, end = 0, start = pos;
    int kind, status = ST_LIMIT;
    long long a, b;
    PyObject *carry = NULL;
    Py_ssize_t carry_pos = -1;
    /* the first TAKE_HELD messages are held here and the list is made at their
     * count (one allocation, not a list grown append by append); more go on it */
    PyObject *held[TAKE_HELD];
    Py_ssize_t count = 0;
    PyObject *list = NULL;
    while (count < limit && pos - start < max_bytes) {
        int r = step(d, n, pos, verify, max_payload, &end, &kind, &a, &b);
        if (r <= 0) {
            status = r == 0 ? ST_END : ST_BAD;
            break;
        }
        PyObject *m = build(&k, d, pos, end, base, &carry, &carry_pos);
        if (m == NULL)
            goto fail;
        if (count < TAKE_HELD) {
            held[count] = m;
        } else {
            if (list == NULL && (list = take_list(held, TAKE_HELD)) == NULL) {
                Py_DECREF(m);
                count = 0;  /* take_list released them */
                goto fail;
            }
            int bad = PyList_Append(list, m);
            Py_DECREF(m);
            if (bad < 0)
                goto fail;
        }
        count++;
        pos = end;
    }
    if (list == NULL && (list = take_list(held, count)) == NULL) {
        count = 0;  /* take_list released them */
        goto fail;
    }
    if (status == ST_LIMIT) {
        /* say END now rather than on the next call when nothing whole follows */
        int r = step(d, n, pos, 0, max_payload, &end, &kind, &a, &b);
        if (r == 0)
            status = ST_END;
    }
    Py_XDECREF(carry);
    PyBuffer_Release(&buf);
    return Py_BuildValue("(Nni)", list, pos, status);
fail:
    if (list == NULL) {  /* the held messages are still this function's */
        for (Py_ssize_t i = 0; i < count && i < TAKE_HELD; i++)
            Py_DECREF(held[i]);
    }
    Py_XDECREF(carry);
    Py_XDECREF(list);
    PyBuffer_Release(&buf);
    return NULL;
}

static PyObject *
py_deliver(PyObject *self, PyObject *args)
{
    Py_buffer buf;
    Py_ssize_t pos, count = 0;
    long long base, max_payload;
    int verify;
    MsgKind k;
    PyObject *plain, *attr, *listener, *later;
    if (!PyArg_ParseTuple(args, "y*nLpLOOOOOOO:deliver", &buf, &pos, &base, &verify,
                          &max_payload, &k.topic, &k.partition, &k.codec, &plain, &attr,
                          &listener, &later))
        return NULL;
    if (check_args(&k, plain, attr, pos, &buf, "deliver") < 0)
        return NULL;
    const unsigned char *d = buf.buf;
    Py_ssize_t n = buf.len, end = 0;
    int kind, status;
    long long a, b;
    PyObject *last = NULL, *failed = NULL, *exc = NULL, *carry = NULL;
    Py_ssize_t carry_pos = -1;
    for (;;) {
        int r = step(d, n, pos, verify, max_payload, &end, &kind, &a, &b);
        if (r <= 0) {
            status = r == 0 ? ST_END : ST_BAD;
            break;
        }
        PyObject *m = build(&k, d, pos, end, base, &carry, &carry_pos);
        if (m == NULL)
            goto fail;
        PyObject *res = PyObject_CallOneArg(listener, m);
        if (res == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_Exception)) {
                Py_DECREF(m);
                goto fail; /* KeyboardInterrupt, SystemExit...: propagate */
            }
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_NormalizeException(&type, &value, &tb);
            if (tb != NULL && value != NULL)
                PyException_SetTraceback(value, tb);
            Py_XDECREF(type);
            Py_XDECREF(tb);
            if (value == NULL) {
                value = Py_None;
                Py_INCREF(value);
            }
            exc = value;
            failed = m;
            status = ST_ERROR;
            break;
        }
        if (res == later) {
            Py_DECREF(res);
            failed = m;
            status = ST_LATER;
            break;
        }
        Py_DECREF(res);
        Py_XDECREF(last);
        last = m;
        count++;
        pos = end;
    }
    Py_XDECREF(carry);
    PyBuffer_Release(&buf);
    return Py_BuildValue("(innNNN)", status, pos, count, last ? last : Py_NewRef(Py_None),
                         failed ? failed : Py_NewRef(Py_None),
                         exc ? exc : Py_NewRef(Py_None));
fail:
    Py_XDECREF(carry);
    Py_XDECREF(last);
    PyBuffer_Release(&buf);
    return NULL;
}


/* ---- the broker's put parser ---------------------------------------------------------- */

/* ``-?[0-9]{1,10}`` (the sign only when ``neg``) at *p: its value, or 0 when absent. */
static inline int
number(const unsigned char *d, Py_ssize_t n, Py_ssize_t *p, int neg, long long *value)
{
    Py_ssize_t i = *p;
    int minus = 0;
    if (neg && i < n && d[i] == '-') {
        minus = 1;
        i++;
    }
    Py_ssize_t first = i;
    long long v = 0;
    while (i < n && i - first < 10 && d[i] >= '0' && d[i] <= '9')
        v = v * 10 + (d[i++] - '0');
    if (i == first)
        return 0;
    *value = minus ? -v : v;
    *p = i;
    return 1;
}

static inline int
literal(const unsigned char *d, Py_ssize_t n, Py_ssize_t *p, const char *lit, Py_ssize_t len)
{
    if (n - *p < len || memcmp(d + *p, lit, (size_t)len) != 0)
        return 0;
    *p += len;
    return 1;
}

/* ---- issue 29 (broker): a transaction key: 1..512 bytes of printable ASCII but the
 * space (what metaq.protocol._transaction accepts of one, MAX_TRANSACTION_KEY), then a
 * space; *start and *end say where it is. */
#define MAX_TX_KEY 512
static inline int
tx_key_at(const unsigned char *d, Py_ssize_t n, Py_ssize_t *p, Py_ssize_t *start,
          Py_ssize_t *end)
{
    Py_ssize_t i = *p;
    while (i < n && i - *p <= MAX_TX_KEY && d[i] > 0x20 && d[i] < 0x7f)
        i++;
    if (i == *p || i - *p > MAX_TX_KEY || i >= n || d[i] != ' ')
        return 0;
    *start = *p;
    *end = i;
    *p = i + 1;
    return 1;
}

/* A put's tail after its flag when it carries a transaction key: ``<txKey> <opaque>\r\n``
 * (*tx, *tx_end: the key; *op, *op_end: the opaque's digits). */
static inline int
tx_tail_at(const unsigned char *d, Py_ssize_t n, Py_ssize_t *p, Py_ssize_t *tx,
           Py_ssize_t *tx_end, Py_ssize_t *op, Py_ssize_t *op_end, long long *opaque)
{
    if (!tx_key_at(d, n, p, tx, tx_end))
        return 0;
    *op = *p;
    if (!number(d, n, p, 1, opaque))
        return 0;
    *op_end = *p;
    return literal(d, n, p, "\r\n", 2);
}

/* The broker's hot loop (metaq/protocol/_parsers.py, RequestParser._run): from ``pos``,
 * every whole ``put <topic> <part> <len> <flag> [<checksum>] <opaque>\r\n<payload>``
 * whose ``b"<topic> <part>"`` is a key of ``fast`` becomes the tuple
 * ``(target, length, flag, checksum, opaque_token, payload)`` appended to ``out``
 * (checksum -1 when the put has none, or says -1: computed once, by the broker);
 * with ``tx_cls`` (a tuple subclass without fields), a put with a transaction key
 * becomes ``tx_cls((target, length, flag, checksum, opaque_token, payload, tx_key))``
 * (the key as bytes; without ``tx_cls`` the loop stops at it); stops at the first
 * request that is anything else (the Python parser takes it from there) and returns
 * where. */
static PyObject *
py_fast_puts(PyObject *self, PyObject *args)
{
    Py_buffer buf;
    Py_ssize_t pos;
    long long max_payload;
    PyObject *fast, *out, *tx_arg = Py_None;
    if (!PyArg_ParseTuple(args, "y*nO!LO!|O:fast_puts", &buf, &pos, &PyDict_Type, &fast,
                          &max_payload, &PyList_Type, &out, &tx_arg))
        return NULL;
    PyTypeObject *tx_cls = NULL;
    if (tx_arg != Py_None) {
        if (check_message_type(tx_arg, "tx_cls") < 0) {
            PyBuffer_Release(&buf);
            return NULL;
        }
        tx_cls = (PyTypeObject *)tx_arg;
    }
    if (pos < 0 || pos > buf.len) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_ValueError, "fast_puts: pos outside the data");
        return NULL;
    }
    const unsigned char *d = buf.buf;
    Py_ssize_t n = buf.len;
    PyObject *last_key = NULL, *target = NULL;
    for (;;) {
        Py_ssize_t p = pos;
        long long part, length, flag, check, opaque;
        if (!literal(d, n, &p, "put ", 4))
            break;
        Py_ssize_t key = p;
        while (p < n && p - key < 256 && d[p] != ' ' && d[p] != '\r' && d[p] != '\n')
            p++;
        if (p - key < 1 || p - key > 255 || !literal(d, n, &p, " ", 1)
            || !number(d, n, &p, 1, &part))
            break;
        Py_ssize_t key_end = p;
        if (!literal(d, n, &p, " ", 1) || !number(d, n, &p, 0, &length)
            || !literal(d, n, &p, " ", 1) || !number(d, n, &p, 1, &flag)
            || !literal(d, n, &p, " ", 1))
            break;
        /* ---- issue 29 (broker): every put form of Java's clients -------------------
         * ``<checksum> <opaque>`` (7 fields; Java's clients send checksum -1, "not
         * computed", which stays -1 here: the broker computes it once, when it checks
         * the puts), ``<opaque>`` alone (6 fields, the legacy form without a checksum:
         * -1 as well), and with ``tx_cls``, the transactional puts: ``<checksum>
         * <txKey> <opaque>`` (8 fields) and ``<txKey> <opaque>`` (7 fields, a slot that
         * does not start with a digit or '-', as Java's decoder tells them apart). */
        Py_ssize_t op, op_end, tx = -1, tx_end = -1;
        if (p < n && (d[p] == '-' || (d[p] >= '0' && d[p] <= '9'))) {
            op = p;
            if (!number(d, n, &p, 1, &check))
                break;
            op_end = p;
            if (literal(d, n, &p, "\r\n", 2)) {
                opaque = check;
                check = -1;
            } else {
                if (!literal(d, n, &p, " ", 1))
                    break;
                Py_ssize_t slot = p;
                op = p;
                if (number(d, n, &p, 1, &opaque) && literal(d, n, &p, "\r\n", 2)) {
                    op_end = p - 2;
                } else {
                    p = slot;
                    if (tx_cls == NULL
                        || !tx_tail_at(d, n, &p, &tx, &tx_end, &op, &op_end, &opaque))
                        break;
                }
            }
        } else {
            check = -1;
            if (tx_cls == NULL || !tx_tail_at(d, n, &p, &tx, &tx_end, &op, &op_end, &opaque))
                break;
        }
        if (last_key == NULL || PyBytes_GET_SIZE(last_key) != key_end - key
            || memcmp(PyBytes_AS_STRING(last_key), d + key, (size_t)(key_end - key)) != 0) {
            PyObject *k = PyBytes_FromStringAndSize((const char *)d + key, key_end - key);
            if (k == NULL)
                goto fail;
            /* A strong reference, taken at once: the PyTuple_New below may run a
             * collection, whose callbacks and finalizers are Python code that may let
             * another thread replace the dict's value (the broker's _index_topics
             * does), freeing a borrowed one before it is put in the tuple. */
            PyObject *found = PyDict_GetItemWithError(fast, k);
            Py_XINCREF(found);
            Py_XSETREF(target, found);
            Py_XSETREF(last_key, k);
            if (target == NULL && PyErr_Occurred())
                goto fail;
        }
        if (target == NULL || target == Py_None)
            break;
        if (length > max_payload || n - p < length)
            break;
        if (flag < INT32_MIN || flag > INT32_MAX || check < INT32_MIN || check > INT32_MAX
            || (op_end - op > 9 && (opaque < INT32_MIN || opaque > INT32_MAX)))
            break;
        int items = tx < 0 ? 6 : 7;
        PyObject *t = tx < 0 ? PyTuple_New(6) : tx_cls->tp_alloc(tx_cls, 7);
        if (t == NULL)
            goto fail;
        Py_INCREF(target);
        PyTuple_SET_ITEM(t, 0, target);
        PyTuple_SET_ITEM(t, 1, PyLong_FromLongLong(length));
        PyTuple_SET_ITEM(t, 2, PyLong_FromLongLong(flag));
        PyTuple_SET_ITEM(t, 3, PyLong_FromLongLong(check));
        PyTuple_SET_ITEM(t, 4, PyBytes_FromStringAndSize((const char *)d + op, op_end - op));
        PyTuple_SET_ITEM(t, 5, PyBytes_FromStringAndSize((const char *)d + p,
                                                         (Py_ssize_t)length));
        if (tx >= 0)
            PyTuple_SET_ITEM(t, 6, PyBytes_FromStringAndSize((const char *)d + tx, tx_end - tx));
        for (int i = 1; i < items; i++) {
            if (PyTuple_GET_ITEM(t, i) == NULL) {
                Py_DECREF(t);
                goto fail;
            }
        }
        int r = PyList_Append(out, t);
        Py_DECREF(t);
        if (r < 0)
            goto fail;
        pos = p + (Py_ssize_t)length;
    }
    Py_XDECREF(target);
    Py_XDECREF(last_key);
    PyBuffer_Release(&buf);
    return PyLong_FromSsize_t(pos);
fail:
    Py_XDECREF(target);
    Py_XDECREF(last_key);
    PyBuffer_Release(&buf);
    return NULL;
}


/* ---- the producer's put lines --------------------------------------------------------- */

static inline Py_ssize_t
put_digits(char *out, long long v)
{
    char tmp[24];
    int k = 0, neg = v < 0;
    unsigned long long u = neg ? 0ULL - (unsigned long long)v : (unsigned long long)v;
    do {
        tmp[k++] = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    Py_ssize_t n = 0;
    if (neg)
        out[n++] = '-';
    while (k)
        out[n++] = tmp[--k];
    return n;
}

/* encode_puts(head, flag, payloads, checksums, opaques) -> (data, sizes): one
 * ``<head><len> <flag> <checksum> <opaque>\r\n<payload>`` per payload, where
 * ``head`` is ``b"put <topic> <partition> "`` (metaq/net/_pipeline.py put_many). */
static PyObject *
py_encode_puts(PyObject *self, PyObject *args)
{
    Py_buffer head;
    long long flag;
    PyObject *payloads, *checksums, *opaques;
    if (!PyArg_ParseTuple(args, "y*LO!O!O!:encode_puts", &head, &flag, &PyList_Type, &payloads,
                          &PyList_Type, &checksums, &PyList_Type, &opaques))
        return NULL;
    /* The second pass writes what the first one measured, reading the lists again:
     * no Python code may run in between, or from the start of the first (it could
     * change the lists, and the second pass would write past ``data``).  So the
     * one allocation that may start a collection (whose callbacks and finalizers
     * are Python code that may let other threads run), the list ``sizes``, comes
     * first, and the numbers must be ints (PyLong_AsLongLong would call any other
     * object's __index__; the binding hands them to the Python twin). */
    Py_ssize_t m = PyList_GET_SIZE(payloads);
    PyObject *data = NULL, *sizes = PyList_New(m);
    if (sizes == NULL)
        goto done;
    if (PyList_GET_SIZE(payloads) != m || PyList_GET_SIZE(checksums) != m
        || PyList_GET_SIZE(opaques) != m) {
        PyErr_SetString(PyExc_ValueError, "encode_puts: lists of different lengths");
        goto done;
    }
    char scratch[96];
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *pl = PyList_GET_ITEM(payloads, i);
        PyObject *co = PyList_GET_ITEM(checksums, i), *oo = PyList_GET_ITEM(opaques, i);
        if (!PyBytes_Check(pl)) {
            PyErr_Format(PyExc_TypeError, "encode_puts: payload %zd is not bytes", i);
            goto done;
        }
        if (!PyLong_Check(co) || !PyLong_Check(oo)) {
            PyErr_Format(PyExc_TypeError, "encode_puts: checksum or opaque %zd is not an int",
                         i);
            goto done;
        }
        long long c = PyLong_AsLongLong(co);
        long long o = PyLong_AsLongLong(oo);
        if ((c == -1 || o == -1) && PyErr_Occurred())
            goto done;
        Py_ssize_t len = PyBytes_GET_SIZE(pl);
        total += head.len + put_digits(scratch, len) + 1 + put_digits(scratch, flag) + 1
                 + put_digits(scratch, c) + 1 + put_digits(scratch, o) + 2 + len;
    }
    data = PyBytes_FromStringAndSize(NULL, total);  /* not a GC object: no collection */
    if (data == NULL)
        goto done;
    char *w = PyBytes_AS_STRING(data);
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *pl = PyList_GET_ITEM(payloads, i);
        Py_ssize_t len = PyBytes_GET_SIZE(pl);
        char *start = w;
        memcpy(w, head.buf, (size_t)head.len);
        w += head.len;
        w += put_digits(w, len);
        *w++ = ' ';
        w += put_digits(w, flag);
        *w++ = ' ';
        w += put_digits(w, PyLong_AsLongLong(PyList_GET_ITEM(checksums, i)));
        *w++ = ' ';
        w += put_digits(w, PyLong_AsLongLong(PyList_GET_ITEM(opaques, i)));
        *w++ = '\r';
        *w++ = '\n';
        memcpy(w, PyBytes_AS_STRING(pl), (size_t)len);
        w += len;
        PyObject *size = PyLong_FromSsize_t(w - start);
        if (size == NULL)
            goto done;
        PyList_SET_ITEM(sizes, i, size);
    }
    PyBuffer_Release(&head);
    return Py_BuildValue("(NN)", data, sizes);
done:
    Py_XDECREF(data);
    Py_XDECREF(sizes);
    PyBuffer_Release(&head);
    return NULL;
}

/* ==== producer per-message path (issue 29, producer part) ================================
 * Kept apart from the broker's put loop above.  Called once per message by
 * metaq/net/_pipeline.py (put_request) and metaq/producer/_send.py (untrack / track);
 * the pure-Python twins are in metaq/protocol/_fast.py.
 *
 *   put_request(prefix, partition, payload, flag, checksum, opaque) -> bytes
 *       b"%b%d %d %d %d %d\r\n%b" % (prefix, partition, len(payload), flag, checksum,
 *       opaque, payload), in one allocation (no tuple, no format parsing); anything but
 *       exact bytes and ints of 64 bits goes to that very formatting (same results).
 *   complete_acks(requests, msg_ids, partitions, offsets, state) -> waited  (see below)
 *   ack_result(cls, msg_id, index, offset, broker_id, names) -> a SendResult (see below)
 *   untrack(obj) / track(obj) -> None
 *       take a GC object out of (back into) the cyclic collector's lists; see
 *       metaq/producer/_send.py (a send in flight holds nothing that can close a cycle).
 */
static PyObject *put_request_fmt;  /* b"%b%d %d %d %d %d\r\n%b", for the general case */

static PyObject *
py_put_request(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "put_request takes 6 arguments");
        return NULL;
    }
    PyObject *prefix = args[0], *payload = args[2];
    long long v[5];
    int simple = PyBytes_CheckExact(prefix) && PyBytes_CheckExact(payload);
    static const int at[4] = {1, 3, 4, 5};
    for (int i = 0; simple && i < 4; i++) {
        PyObject *o = args[at[i]];
        if (!PyLong_CheckExact(o)) {
            simple = 0;
            break;
        }
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow || (x == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            simple = 0;
            break;
        }
        v[i] = x;
    }
    if (!simple) {
        Py_ssize_t len = PyObject_Length(payload);
        if (len < 0)
            return NULL;
        PyObject *n = PyLong_FromSsize_t(len);
        if (n == NULL)
            return NULL;
        PyObject *t = PyTuple_Pack(7, prefix, args[1], n, args[3], args[4], args[5], payload);
        Py_DECREF(n);
        if (t == NULL)
            return NULL;
        PyObject *r = PyNumber_Remainder(put_request_fmt, t);
        Py_DECREF(t);
        return r;
    }
    Py_ssize_t plen = PyBytes_GET_SIZE(payload), hlen = PyBytes_GET_SIZE(prefix);
    char line[5 * 21 + 8];
    char *w = line;
    w += put_digits(w, v[0]);
    *w++ = ' ';
    w += put_digits(w, plen);
    *w++ = ' ';
    w += put_digits(w, v[1]);
    *w++ = ' ';
    w += put_digits(w, v[2]);
    *w++ = ' ';
    w += put_digits(w, v[3]);
    *w++ = '\r';
    *w++ = '\n';
    Py_ssize_t llen = w - line;
    PyObject *data = PyBytes_FromStringAndSize(NULL, hlen + llen + plen);
    if (data == NULL)
        return NULL;
    char *d = PyBytes_AS_STRING(data);
    memcpy(d, PyBytes_AS_STRING(prefix), (size_t)hlen);
    memcpy(d + hlen, line, (size_t)llen);
    memcpy(d + hlen + llen, PyBytes_AS_STRING(payload), (size_t)plen);
    return data;
}

static PyObject *
py_untrack(PyObject *self, PyObject *obj)
{
    if (PyObject_IS_GC(obj) && PyObject_GC_IsTracked(obj))
        PyObject_GC_UnTrack(obj);
    Py_RETURN_NONE;
}

static PyObject *
py_track(PyObject *self, PyObject *obj)
{
    if (PyObject_IS_GC(obj) && !PyObject_GC_IsTracked(obj))
        PyObject_GC_Track(obj);
    Py_RETURN_NONE;
}

/* complete_acks(requests, msg_ids, partitions, offsets, state) -> list
 * For each i: requests[i].payload = b""; ._ack_id, ._ack_index, ._ack_offset = the
 * columns' items; then ._state = state (in this order: the state last, as a waiter
 * reads it first); returns the requests whose ._waited is true (to be notified).
 * (A producer's Send, metaq/producer/_send.py on_acks; no Python code runs in between
 * for slot attributes.) */
static PyObject *s_payload, *s_ack_id, *s_ack_index, *s_ack_offset, *s_state, *s_waited,
    *empty_bytes;

static PyObject *
py_complete_acks(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "complete_acks takes 5 arguments");
        return NULL;
    }
    PyObject *reqs = args[0], *ids = args[1], *parts = args[2], *offs = args[3];
    PyObject *state = args[4];
    if (!PyList_CheckExact(reqs) || !PyList_CheckExact(ids) || !PyList_CheckExact(parts)
        || !PyList_CheckExact(offs)) {
        PyErr_SetString(PyExc_TypeError, "complete_acks: the columns must be lists");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(reqs);
    if (PyList_GET_SIZE(ids) != n || PyList_GET_SIZE(parts) != n
        || PyList_GET_SIZE(offs) != n) {
        PyErr_SetString(PyExc_ValueError, "complete_acks: lists of different lengths");
        return NULL;
    }
    PyObject *waited = PyList_New(0);
    if (waited == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n && i < PyList_GET_SIZE(reqs); i++) {
        PyObject *r = PyList_GET_ITEM(reqs, i);
        Py_INCREF(r);
        int bad = PyObject_SetAttr(r, s_payload, empty_bytes) < 0
                  || i >= PyList_GET_SIZE(ids) || i >= PyList_GET_SIZE(parts)
                  || i >= PyList_GET_SIZE(offs)
                  || PyObject_SetAttr(r, s_ack_id, PyList_GET_ITEM(ids, i)) < 0
                  || PyObject_SetAttr(r, s_ack_index, PyList_GET_ITEM(parts, i)) < 0
                  || PyObject_SetAttr(r, s_ack_offset, PyList_GET_ITEM(offs, i)) < 0
                  || PyObject_SetAttr(r, s_state, state) < 0;
        if (!bad) {
            PyObject *w = PyObject_GetAttr(r, s_waited);
            int t = w == NULL ? -1 : PyObject_IsTrue(w);
            Py_XDECREF(w);
            bad = t < 0 || (t && PyList_Append(waited, r) < 0);
        }
        Py_DECREF(r);
        if (bad) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "complete_acks: a list changed");
            Py_DECREF(waited);
            return NULL;
        }
    }
    return waited;
}

/* int(b) for the decimal bytes of an acknowledgement: digits only, up to 18 of them,
 * here; anything else through int() itself (same results). */
static PyObject *
ack_int(PyObject *b)
{
    if (PyBytes_CheckExact(b)) {
        Py_ssize_t n = PyBytes_GET_SIZE(b);
        const char *p = PyBytes_AS_STRING(b);
        if (n > 0 && n <= 18) {
            long long v = 0;
            Py_ssize_t i = 0;
            for (; i < n && p[i] >= '0' && p[i] <= '9'; i++)
                v = v * 10 + (p[i] - '0');
            if (i == n)
                return PyLong_FromLongLong(v);
        }
    }
    return PyNumber_Long(b);
}

/* ``items`` (a new tuple; the reference is taken) as a ``cls`` tuple: itself when cls is
 * tuple, else tuple.__new__(cls, items); a new reference, or NULL. */
static PyObject *
tuple_as(PyObject *cls, PyObject *items)
{
    if (items == NULL || (PyTypeObject *)cls == &PyTuple_Type)
        return items;
    PyObject *a = PyTuple_Pack(1, items);
    Py_DECREF(items);
    if (a == NULL)
        return NULL;
    PyObject *r = PyTuple_Type.tp_new((PyTypeObject *)cls, a, NULL);
    Py_DECREF(a);
    return r;
}

/* One acknowledgement as a ``cls`` tuple (SendResult or tuple itself):
 * cls((msg_id, name, offset, broker_id, index)); a new reference, or NULL. */
static PyObject *
ack_pack(PyObject *cls, PyObject *id, PyObject *name, PyObject *offset, PyObject *broker_id,
         PyObject *index)
{
    return tuple_as(cls, PyTuple_Pack(5, id, name, offset, broker_id, index));
}

/* ack_result(cls, msg_id, index, offset, broker_id, names) -> cls tuple
 * tuple.__new__(cls, (int(msg_id), names[int(index)], int(offset), broker_id,
 * int(index))): a SendResult from the bytes of a bulk acknowledgement. */
static PyObject *
py_ack_result(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "ack_result takes 6 arguments");
        return NULL;
    }
    PyObject *cls = args[0];
    if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "ack_result: cls must be a tuple class");
        return NULL;
    }
    PyObject *id = NULL, *index = NULL, *name = NULL, *offset = NULL;
    PyObject *r = NULL;
    if ((id = ack_int(args[1])) != NULL && (index = ack_int(args[2])) != NULL
        && (name = PyObject_GetItem(args[5], index)) != NULL
        && (offset = ack_int(args[3])) != NULL)
        r = ack_pack(cls, id, name, offset, args[4], index);
    Py_XDECREF(id);
    Py_XDECREF(index);
    Py_XDECREF(name);
    Py_XDECREF(offset);
    return r;
}
/* ==== end of the producer per-message path ============================================= */

/* ==== issue 29 (sync send): one put's acknowledgement, whole ==========================
 * put_ack(buf, opaque, cls, broker_id, names) -> cls tuple | None | False
 *   What a blocking send read on its own thread (PipelinedConnection.put_wait):
 *   - buf is exactly one "result 200 <len> <opaque>\r\n<msgId> <index> <offset>" with
 *     this opaque (len [0-9]{1,9} and at most 64, opaque -?[0-9]{1,10}, msgId and offset
 *     -?[0-9]{1,19}, index [0-9]{1,9}): tuple.__new__(cls, (int(msgId), names[index],
 *     int(offset), broker_id, index));
 *   - buf may still become that (no CRLF yet and under 64 bytes, or the body short of
 *     len): None;
 *   - anything else (another code or opaque, more than one reply, not a reply): False.
 * The twin is py_put_ack in metaq/protocol/_fast.py. */
static Py_ssize_t
ack_num(const char *s, Py_ssize_t p, Py_ssize_t end, int sign, int maxd)
{
    if (sign && p < end && s[p] == '-')
        p++;
    Py_ssize_t d = p;
    while (p < end && p - d <= maxd && s[p] >= '0' && s[p] <= '9')
        p++;
    if (p == d || p - d > maxd)
        return -1;
    return p;
}

static PyObject *
ack_long(const char *s, Py_ssize_t a, Py_ssize_t b)
{
    char tmp[24];  /* at most a sign and 19 digits */
    memcpy(tmp, s + a, (size_t)(b - a));
    tmp[b - a] = '\0';
    return PyLong_FromString(tmp, NULL, 10);
}

/* put_ack on s[0:end]; args as put_ack's but for buf (args[0] unused); cls checked */
static PyObject *
put_ack_at(const char *s, Py_ssize_t end, PyObject *const *args)
{
    PyObject *cls = args[2];
    int overflow = 0;
    long long want = PyLong_AsLongLongAndOverflow(args[1], &overflow);
    if (want == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t eol = -1;  /* the first CRLF */
    for (Py_ssize_t i = 0; i + 1 < end; i++) {
        if (s[i] == '\r' && s[i + 1] == '\n') {
            eol = i;
            break;
        }
    }
    if (eol < 0) {
        if (end < 64)
            Py_RETURN_NONE;
        Py_RETURN_FALSE;
    }
    /* the header: "result 200 " [0-9]{1,9} " " -?[0-9]{1,10} "\r\n" */
    Py_ssize_t p = 11, q;
    if (end < 11 || memcmp(s, "result 200 ", 11) != 0)
        Py_RETURN_FALSE;
    if ((q = ack_num(s, p, end, 0, 9)) < 0 || q >= end || s[q] != ' ')
        Py_RETURN_FALSE;
    long long n = 0;
    for (Py_ssize_t i = p; i < q; i++)
        n = n * 10 + (s[i] - '0');
    p = q + 1;
    if ((q = ack_num(s, p, end, 1, 10)) < 0 || q + 1 >= end || s[q] != '\r' || s[q + 1] != '\n')
        Py_RETURN_FALSE;
    long long op = 0;
    for (Py_ssize_t i = (s[p] == '-' ? p + 1 : p); i < q; i++)
        op = op * 10 + (s[i] - '0');
    if (s[p] == '-')
        op = -op;
    if (overflow || op != want)
        Py_RETURN_FALSE;
    p = q + 2;
    Py_ssize_t have = end - p;
    if (n > 64 || have > n)
        Py_RETURN_FALSE;
    if (have < n)
        Py_RETURN_NONE;
    /* the body: -?[0-9]{1,19} " " [0-9]{1,9} " " -?[0-9]{1,19}, all of it */
    Py_ssize_t a0 = p, a1, b0, b1, c0, c1;
    if ((a1 = ack_num(s, a0, end, 1, 19)) < 0 || a1 >= end || s[a1] != ' ')
        Py_RETURN_FALSE;
    b0 = a1 + 1;
    if ((b1 = ack_num(s, b0, end, 0, 9)) < 0 || b1 >= end || s[b1] != ' ')
        Py_RETURN_FALSE;
    c0 = b1 + 1;
    if ((c1 = ack_num(s, c0, end, 1, 19)) < 0 || c1 != end)
        Py_RETURN_FALSE;
    long idx = 0;
    for (Py_ssize_t i = b0; i < b1; i++)
        idx = idx * 10 + (s[i] - '0');
    PyObject *id = NULL, *index = NULL, *name = NULL, *offset = NULL;
    PyObject *r = NULL;
    if ((id = ack_long(s, a0, a1)) != NULL && (index = PyLong_FromLong(idx)) != NULL
        && (name = PyObject_GetItem(args[4], index)) != NULL
        && (offset = ack_long(s, c0, c1)) != NULL)
        r = ack_pack(cls, id, name, offset, args[3], index);
    Py_XDECREF(id);
    Py_XDECREF(index);
    Py_XDECREF(name);
    Py_XDECREF(offset);
    return r;
}
static int
ack_cls_ok(PyObject *cls, const char *fn)
{
    if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, &PyTuple_Type)) {
        PyErr_Format(PyExc_TypeError, "%s: cls must be a tuple class", fn);
        return 0;
    }
    return 1;
}

static PyObject *
py_put_ack(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "put_ack takes 5 arguments");
        return NULL;
    }
    if (!PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "put_ack: buf must be bytes");
        return NULL;
    }
    if (!ack_cls_ok(args[2], "put_ack"))
        return NULL;
    return put_ack_at(PyBytes_AS_STRING(args[0]), PyBytes_GET_SIZE(args[0]), args);
}

/* put_round_trip(sock, send_lock, data, opaque, cls, broker_id, names)
 *   -> cls tuple | bytes | None
 * A blocking send's write and first read in one call: send all of data on sock's
 * descriptor (the GIL released), release send_lock (always, whatever happens), then
 * one blocking recv of up to 16 KiB (sock's SO_RCVTIMEO bounds it): put_ack's tuple
 * when that read is exactly the request's lone success (no bytes object made); else
 * the bytes read (b"": the peer closed), or None when the receive timeout passed with
 * nothing read.  OSError for a failed send or recv.  The twin is py_put_round_trip. */
static PyObject *s_fileno, *s_release;

static PyObject *
py_put_round_trip(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "put_round_trip takes 7 arguments");
        return NULL;
    }
    PyObject *sock = args[0], *lock = args[1], *data = args[2];
    int fd = -1, ok = 1, err = 0;  /* err: errno of a failed send */
    if (!PyBytes_Check(data)) {
        PyErr_SetString(PyExc_TypeError, "put_round_trip: data must be bytes");
        ok = 0;
    } else if (!ack_cls_ok(args[4], "put_round_trip")) {
        ok = 0;
    }
    if (ok) {
        PyObject *f = PyObject_CallMethodNoArgs(sock, s_fileno);
        if (f == NULL) {
            ok = 0;
        } else {
            fd = (int)PyLong_AsLong(f);
            Py_DECREF(f);
            if (fd == -1 && PyErr_Occurred())
                ok = 0;
        }
    }
    if (ok) {
        const char *p = PyBytes_AS_STRING(data);
        Py_ssize_t left = PyBytes_GET_SIZE(data);
        while (left > 0) {
            ssize_t n;
            Py_BEGIN_ALLOW_THREADS
            n = send(fd, p, (size_t)left, MSG_NOSIGNAL);
            Py_END_ALLOW_THREADS
            if (n < 0) {
                if (errno == EINTR) {
                    if (PyErr_CheckSignals() < 0) {
                        ok = 0;
                        break;
                    }
                    continue;
                }
                err = errno;
                break;
            }
            p += n;
            left -= n;
        }
    }
    /* send_lock is released whatever happened (keeping an exception set above) */
    PyObject *exc_type = NULL, *exc_value = NULL, *exc_tb = NULL;
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
    PyObject *rel = PyObject_CallMethodNoArgs(lock, s_release);
    if (rel == NULL) {
        Py_XDECREF(exc_type);
        Py_XDECREF(exc_value);
        Py_XDECREF(exc_tb);
        return NULL;
    }
    Py_DECREF(rel);
    PyErr_Restore(exc_type, exc_value, exc_tb);
    if (!ok)
        return NULL;
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    char buf[16384];
    ssize_t n;
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        n = recv(fd, buf, sizeof buf, 0);
        Py_END_ALLOW_THREADS
        if (n < 0 && errno == EINTR) {
            if (PyErr_CheckSignals() < 0)
                return NULL;
            continue;
        }
        break;
    }
    if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK)
            Py_RETURN_NONE;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (n > 0) {
        PyObject *r = put_ack_at(buf, (Py_ssize_t)n, args + 2);
        if (r == NULL || (r != Py_None && r != Py_False))
            return r;
        Py_DECREF(r);
    }
    return PyBytes_FromStringAndSize(buf, (Py_ssize_t)n);
}
/* ==== end of issue 29 (sync send) ====================================================== */
/* ==== issue 29, transactions: the producer's transactional puts encoded together ======= */

/* encode_tx_puts(head, flag, payloads, checksums, key, opaques) -> data: one
 * ``<head><len> <flag> <checksum> <key> <opaque>\r\n<payload>`` per payload, where
 * ``head`` is ``b"put <topic> <partition> "`` and ``key`` the transaction key's bytes
 * (metaq/protocol/_commands.py encode_tx_puts, its twin and the checks). */
static PyObject *
py_encode_tx_puts(PyObject *self, PyObject *args)
{
    Py_buffer head, key;
    long long flag;
    PyObject *payloads, *checksums, *opaques;
    if (!PyArg_ParseTuple(args, "y*LO!O!y*O!:encode_tx_puts", &head, &flag, &PyList_Type,
                          &payloads, &PyList_Type, &checksums, &key, &PyList_Type, &opaques))
        return NULL;
    /* As encode_puts: no Python code runs between the two passes (only ints and bytes
     * are read, the one allocation is a bytes object, not a GC one). */
    PyObject *data = NULL;
    Py_ssize_t m = PyList_GET_SIZE(payloads);
    if (PyList_GET_SIZE(checksums) != m || PyList_GET_SIZE(opaques) != m) {
        PyErr_SetString(PyExc_ValueError, "encode_tx_puts: lists of different lengths");
        goto done;
    }
    char scratch[96];
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *pl = PyList_GET_ITEM(payloads, i);
        PyObject *co = PyList_GET_ITEM(checksums, i), *oo = PyList_GET_ITEM(opaques, i);
        if (!PyBytes_Check(pl)) {
            PyErr_Format(PyExc_TypeError, "encode_tx_puts: payload %zd is not bytes", i);
            goto done;
        }
        if (!PyLong_Check(co) || !PyLong_Check(oo)) {
            PyErr_Format(PyExc_TypeError,
                         "encode_tx_puts: checksum or opaque %zd is not an int", i);
            goto done;
        }
        long long c = PyLong_AsLongLong(co);
        long long o = PyLong_AsLongLong(oo);
        if ((c == -1 || o == -1) && PyErr_Occurred())
            goto done;
        Py_ssize_t len = PyBytes_GET_SIZE(pl);
        total += head.len + put_digits(scratch, len) + 1 + put_digits(scratch, flag) + 1
                 + put_digits(scratch, c) + 1 + key.len + 1 + put_digits(scratch, o) + 2 + len;
    }
    data = PyBytes_FromStringAndSize(NULL, total);
    if (data == NULL)
        goto done;
    char *w = PyBytes_AS_STRING(data);
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *pl = PyList_GET_ITEM(payloads, i);
        Py_ssize_t len = PyBytes_GET_SIZE(pl);
        memcpy(w, head.buf, (size_t)head.len);
        w += head.len;
        w += put_digits(w, len);
        *w++ = ' ';
        w += put_digits(w, flag);
        *w++ = ' ';
        w += put_digits(w, PyLong_AsLongLong(PyList_GET_ITEM(checksums, i)));
        *w++ = ' ';
        memcpy(w, key.buf, (size_t)key.len);
        w += key.len;
        *w++ = ' ';
        w += put_digits(w, PyLong_AsLongLong(PyList_GET_ITEM(opaques, i)));
        *w++ = '\r';
        *w++ = '\n';
        memcpy(w, PyBytes_AS_STRING(pl), (size_t)len);
        w += len;
    }
done:
    PyBuffer_Release(&head);
    PyBuffer_Release(&key);
    return data;
}
/* ==== end of issue 29, transactions ==================================================== */

/* ==== send_async in one call (issue 29, producer part: branch i29-async) ================
 * submit_put(state, topic, route, payload, flag) -> Send or None
 *   What Producer.send_async does after checking and encoding a message, on the common
 *   path, in one call (metaq/producer/_producer.py; its Python twin is the code it
 *   replaces there: ``Send(...)`` then ``SendPath.submit``):
 *     state = (send_type, path, conns, faults, conn_type, timeout, running)
 *   - the future: send_type's tp_new (no __init__), out of the cyclic collector's lists,
 *     its slots stored as Send.__init__ stores them (checksum = crc32 & 0x7fffffff,
 *     deadline = time.monotonic() + timeout);
 *   - when faults is empty and route.partitions is not: the round-robin pick
 *     (partitions[next(route.counter) % len]) into send.part;
 *   - when conns[part.broker_id] is a usable conn_type at route's address, with a cached
 *     prefix for topic and room in its window, and its lock free: PipelinedConnection.put's
 *     body (opaque, request bytes, _pipe_sent/_pipe_size, pending map, window bytes,
 *     out queue, wake the writer / a parked reader), and send.attempts = 1.
 *   Whatever it could not do is left to the Python path (send.attempts == 0: part None
 *   -> SendPath.submit, else SendPath.dispatch), which does it the same way (and waits,
 *   connects, raises or fails the future where the C side declines).  None (nothing
 *   done) for a payload that is not exact bytes or a flag that is not an int.
 */
#include <time.h>
#include <structmember.h>

enum { SS_STATE, SS_RESULT, SS_EXC, SS_WAITED, SS_PATH, SS_TOPIC, SS_PAYLOAD, SS_FLAG,
       SS_CHECKSUM, SS_DEADLINE, SS_ATTEMPTS, SS_PART, SS_TRIED, SS_FLUSH, SS_SENT, SS_SIZE,
       SS_N };
static const char *const ss_names[SS_N] = {
    "_state", "_result", "_exception", "_waited", "path", "topic", "payload", "flag",
    "checksum", "deadline", "attempts", "part", "tried", "flush", "_pipe_sent", "_pipe_size"};
static PyTypeObject *ss_type;     /* the send type whose slot offsets are cached */
static Py_ssize_t ss_off[SS_N];
static PyObject *ss_empty_tuple, *ss_zero, *one_long;
enum { SN_PARTITIONS, SN_COUNTER, SN_BROKER_ID, SN_INDEX, SN_ADDRESSES, SN_USABLE, SN_ADDRESS,
       SN_MAX_IN_FLIGHT, SN_INFLIGHT_BYTES, SN_MAX_INFLIGHT_BYTES, SN_ERROR, SN_CLOSING,
       SN_PARKED, SN_FLAG, SN_LAST_PUT, SN_WRITE_NOW, SN_C_PUT, SN_N };
static const char *const sn_text[SN_N] = {
    "partitions", "counter", "broker_id", "index", "addresses", "usable", "address",
    "max_in_flight", "_inflight_bytes", "max_in_flight_bytes", "_error", "_closing",
    "_parked", "_flag", "_last_put", "_write_now", "_c_put"};
/* PipelinedConnection._c_put's items */
enum { CP_OPAQUES, CP_PREFIXES, CP_PENDING, CP_ACQUIRE, CP_RELEASE, CP_APPEND, CP_WAKE,
       CP_WAKE_SET, CP_UNPARK_SET, CP_N };
/* PipelinedConnection's _QUIET: a put this long after the previous one is written by
 * the caller's thread (_write_now), not handed to the writer thread */
#define SS_QUIET 0.0005
static PyObject *sn[SN_N];

static int
ss_init_names(void)
{
    for (int i = 0; i < SN_N; i++)
        if (sn[i] == NULL && (sn[i] = PyUnicode_InternFromString(sn_text[i])) == NULL)
            return -1;
    if (ss_empty_tuple == NULL && (ss_empty_tuple = PyTuple_New(0)) == NULL)
        return -1;
    if (ss_zero == NULL && (ss_zero = PyLong_FromLong(0)) == NULL)
        return -1;
    if (one_long == NULL && (one_long = PyLong_FromLong(1)) == NULL)
        return -1;
    return 0;
}

/* The offsets of send_type's slots (member descriptors, as __slots__ makes them). */
static int
ss_offsets(PyTypeObject *t)
{
    if (t == ss_type)
        return 0;
    Py_ssize_t off[SS_N];
    for (int i = 0; i < SS_N; i++) {
        PyObject *d = PyObject_GetAttrString((PyObject *)t, ss_names[i]);
        if (d == NULL)
            return -1;
        if (Py_TYPE(d) != &PyMemberDescr_Type
            || (((PyMemberDescrObject *)d)->d_member->flags & READONLY)) {
            Py_DECREF(d);
            PyErr_Format(PyExc_TypeError, "submit_put: %s.%s is not a slot", t->tp_name,
                         ss_names[i]);
            return -1;
        }
        off[i] = ((PyMemberDescrObject *)d)->d_member->offset;
        Py_DECREF(d);
    }
    Py_INCREF(t);
    Py_XSETREF(ss_type, t);
    memcpy(ss_off, off, sizeof off);
    return 0;
}

/* Store a new reference in a slot (steals v). */
static inline void
ss_set(PyObject *o, int i, PyObject *v)
{
    PyObject **p = (PyObject **)((char *)o + ss_off[i]);
    PyObject *old = *p;
    *p = v;
    Py_XDECREF(old);
}

static inline void
ss_set_borrowed(PyObject *o, int i, PyObject *v)
{
    Py_INCREF(v);
    ss_set(o, i, v);
}

/* PipelinedConnection.put's body on conn (its instance dict cd), or 0 (declined: nothing
 * changed but the opaque counter) or -1 (an error). */
static int
ss_put(PyObject *send, PyObject *conn, PyObject *cd, PyObject *topic, PyObject *part,
       PyObject *payload, PyObject *flag, PyObject *checksum, double now)
{
    int quiet = 0;
    /* the connection's _c_put: the objects a put uses, fixed for the connection's life
     * (PipelinedConnection.__init__), in one lookup */
    PyObject *parts = PyDict_GetItemWithError(cd, sn[SN_C_PUT]);
    PyObject *maxn = PyDict_GetItemWithError(cd, sn[SN_MAX_IN_FLIGHT]);
    PyObject *maxb = PyDict_GetItemWithError(cd, sn[SN_MAX_INFLIGHT_BYTES]);
    if (parts == NULL || maxn == NULL || maxb == NULL || !PyTuple_CheckExact(parts)
        || PyTuple_GET_SIZE(parts) != CP_N || !PyLong_CheckExact(maxn)
        || !PyLong_CheckExact(maxb))
        return PyErr_Occurred() ? -1 : 0;
    PyObject *opaques = PyTuple_GET_ITEM(parts, CP_OPAQUES);
    PyObject *prefixes = PyTuple_GET_ITEM(parts, CP_PREFIXES);
    PyObject *pending = PyTuple_GET_ITEM(parts, CP_PENDING);
    if (!PyDict_CheckExact(prefixes) || !PyDict_CheckExact(pending))
        return 0;
    PyObject *prefix = PyDict_GetItemWithError(prefixes, topic);
    if (prefix == NULL)
        return PyErr_Occurred() ? -1 : 0;  /* the first put of this topic: put() makes it */
    PyObject *index = PyObject_GetAttr(part, sn[SN_INDEX]);
    if (index == NULL)
        return -1;
    Py_INCREF(parts);  /* (Python code may run below: _write_now) */
    PyObject *op = PyIter_Next(opaques), *opaque = NULL, *data = NULL;
    int rc = -1;
    if (op == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "submit_put: the opaque counter ended");
        goto done;
    }
    {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(op, &overflow);
        if (v == -1 && PyErr_Occurred())
            goto done;
        if (overflow) {
            PyObject *mask = PyLong_FromLong(0x7fffffffL);
            if (mask == NULL)
                goto done;
            opaque = PyNumber_And(op, mask);
            Py_DECREF(mask);
        } else {
            opaque = PyLong_FromLongLong(v & 0x7fffffffLL);
        }
        if (opaque == NULL)
            goto done;
    }
    {
        PyObject *args[6] = {prefix, index, payload, flag, checksum, opaque};
        data = py_put_request(NULL, args, 6);
        if (data == NULL)
            goto done;
    }
    Py_ssize_t size = PyBytes_GET_SIZE(data);
    Py_ssize_t n_max = PyLong_AsSsize_t(maxn);
    long long b_max = PyLong_AsLongLong(maxb);
    if (PyErr_Occurred())
        goto done;
    PyObject *infl = PyDict_GetItemWithError(cd, sn[SN_INFLIGHT_BYTES]);
    if (infl == NULL || !PyLong_CheckExact(infl)) {
        rc = PyErr_Occurred() ? -1 : 0;
        goto done;
    }
    long long inflight = PyLong_AsLongLong(infl);
    if (inflight == -1 && PyErr_Occurred())
        goto done;
    if (PyDict_GET_SIZE(pending) >= n_max || inflight + size > b_max) {
        rc = 0;  /* the window is full: put() waits for room */
        goto done;
    }
    /* with self._lock: (not waited for: put() waits when another thread holds it) */
    PyObject *got = PyObject_CallOneArg(PyTuple_GET_ITEM(parts, CP_ACQUIRE), Py_False);
    if (got == NULL)
        goto done;
    int locked = got == Py_True;
    Py_DECREF(got);
    if (!locked) {
        rc = 0;
        goto done;
    }
    {
        PyObject *err = PyDict_GetItemWithError(cd, sn[SN_ERROR]);
        PyObject *closing = PyDict_GetItemWithError(cd, sn[SN_CLOSING]);
        int refuse = err == NULL || err != Py_None || closing == NULL
                     || PyObject_IsTrue(closing) != 0;
        /* (re-read: no Python code ran since, but the lock is what makes it final) */
        infl = refuse ? NULL : PyDict_GetItemWithError(cd, sn[SN_INFLIGHT_BYTES]);
        if (!refuse && (infl == NULL || !PyLong_CheckExact(infl)))
            refuse = 1;
        if (!refuse) {
            inflight = PyLong_AsLongLong(infl);
            refuse = inflight == -1 && PyErr_Occurred();
        }
        PyObject *sent = NULL, *sz = NULL, *total = NULL;
        if (!refuse) {
            /* put() raises ConnectionClosedError for these: it is called next */
            if ((sent = PyFloat_FromDouble(now)) == NULL
                || (sz = PyLong_FromSsize_t(size)) == NULL
                || (total = PyLong_FromLongLong(inflight + size)) == NULL) {
                Py_XDECREF(sent);
                Py_XDECREF(sz);
                refuse = -1;
            } else {
                ss_set(send, SS_SENT, sent);
                ss_set(send, SS_SIZE, sz);
                /* attempts = 1 before the reader (or a failing connection) can see it, as
                 * SendPath.submit sets it before put() */
                Py_INCREF(one_long);
                ss_set(send, SS_ATTEMPTS, one_long);
                if (PyDict_SetItem(pending, opaque, send) < 0)
                    refuse = -1;
                else if (PyDict_SetItem(cd, sn[SN_INFLIGHT_BYTES], total) < 0) {
                    refuse = -1;
                } else {
                    PyObject *r = PyObject_CallOneArg(PyTuple_GET_ITEM(parts, CP_APPEND),
                                                      data);
                    if (r == NULL)
                        refuse = -1;
                    Py_XDECREF(r);
                }
                if (!refuse) {  /* put()'s quiet = now - _last_put >= _QUIET; _last_put = now */
                    PyObject *last = PyDict_GetItemWithError(cd, sn[SN_LAST_PUT]);
                    quiet = last != NULL && PyFloat_CheckExact(last)
                            && now - PyFloat_AS_DOUBLE(last) >= SS_QUIET;
                    PyObject *nowf = PyFloat_FromDouble(now);
                    if (nowf == NULL || PyDict_SetItem(cd, sn[SN_LAST_PUT], nowf) < 0)
                        refuse = -1;
                    Py_XDECREF(nowf);
                }
                Py_DECREF(total);
            }
        }
        PyObject *exc = NULL, *tb = NULL, *val = NULL;
        if (PyErr_Occurred())
            PyErr_Fetch(&exc, &val, &tb);
        PyObject *released = PyObject_CallNoArgs(PyTuple_GET_ITEM(parts, CP_RELEASE));
        Py_XDECREF(released);
        if (released == NULL) {
            Py_XDECREF(exc);
            Py_XDECREF(val);
            Py_XDECREF(tb);
            goto done;
        }
        if (exc != NULL) {
            PyErr_Restore(exc, val, tb);
            goto done;
        }
        if (refuse) {
            rc = refuse < 0 ? -1 : 0;
            goto done;
        }
    }
    /* the first put after a pause: written from this thread (put()'s _write_now) */
    if (quiet) {
        PyObject *r = PyObject_CallMethodNoArgs(conn, sn[SN_WRITE_NOW]);
        if (r == NULL)
            goto done;
        int w = PyObject_IsTrue(r);
        Py_DECREF(r);
        if (w < 0)
            goto done;
        quiet = w;
    }
    /* wake the writer (unless awake or written above), and a parked reader thread */
    {
        PyObject *f = quiet ? NULL : PyObject_GetAttr(PyTuple_GET_ITEM(parts, CP_WAKE),
                                                      sn[SN_FLAG]);
        int set = quiet ? 1 : f == NULL ? -1 : PyObject_IsTrue(f);
        Py_XDECREF(f);
        if (set == 0) {
            PyObject *r = PyObject_CallNoArgs(PyTuple_GET_ITEM(parts, CP_WAKE_SET));
            set = r == NULL ? -1 : 1;
            Py_XDECREF(r);
        }
        if (set < 0)
            goto done;
        PyObject *parked = PyDict_GetItemWithError(cd, sn[SN_PARKED]);
        int p = parked == NULL ? (PyErr_Occurred() ? -1 : 0) : PyObject_IsTrue(parked);
        if (p > 0) {
            PyObject *r = PyObject_CallNoArgs(PyTuple_GET_ITEM(parts, CP_UNPARK_SET));
            p = r == NULL ? -1 : 1;
            Py_XDECREF(r);
        }
        if (p < 0)
            goto done;
    }
    rc = 1;
done:
    Py_DECREF(parts);
    Py_DECREF(index);
    Py_XDECREF(op);
    Py_XDECREF(opaque);
    Py_XDECREF(data);
    return rc;
}

static PyObject *
py_submit_put(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "submit_put takes 5 arguments");
        return NULL;
    }
    PyObject *state = args[0], *topic = args[1], *route = args[2], *payload = args[3];
    PyObject *flag = args[4];
    if (!PyTuple_CheckExact(state) || PyTuple_GET_SIZE(state) != 7
        || !PyType_Check(PyTuple_GET_ITEM(state, 0))
        || !PyDict_CheckExact(PyTuple_GET_ITEM(state, 2))
        || !PyDict_CheckExact(PyTuple_GET_ITEM(state, 3))
        || !PyFloat_CheckExact(PyTuple_GET_ITEM(state, 5))) {
        PyErr_SetString(PyExc_TypeError, "submit_put: state must be (send_type, path, conns, "
                        "faults, conn_type, timeout, running)");
        return NULL;
    }
    if (!PyBytes_CheckExact(payload) || !PyLong_CheckExact(flag))
        Py_RETURN_NONE;
    PyTypeObject *stype = (PyTypeObject *)PyTuple_GET_ITEM(state, 0);
    PyObject *path = PyTuple_GET_ITEM(state, 1), *conns = PyTuple_GET_ITEM(state, 2);
    PyObject *faults = PyTuple_GET_ITEM(state, 3), *conn_type = PyTuple_GET_ITEM(state, 4);
    double timeout = PyFloat_AS_DOUBLE(PyTuple_GET_ITEM(state, 5));
    PyObject *running = PyTuple_GET_ITEM(state, 6);
    if (ss_init_names() < 0 || ss_offsets(stype) < 0)
        return NULL;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);  /* time.monotonic()'s clock */
    double now = (double)ts.tv_sec + ts.tv_nsec * 1e-9;
    uint32_t crc = crc32_update(0, (const unsigned char *)PyBytes_AS_STRING(payload),
                                (size_t)PyBytes_GET_SIZE(payload)) & 0x7fffffffu;
    PyObject *checksum = PyLong_FromUnsignedLong(crc);
    PyObject *deadline = PyFloat_FromDouble(now + timeout);
    PyObject *send = NULL, *parts = NULL, *part = NULL, *bid = NULL, *cd = NULL;
    PyObject *addresses = NULL;
    if (checksum == NULL || deadline == NULL)
        goto fail;
    send = stype->tp_new(stype, ss_empty_tuple, NULL);
    if (send == NULL)
        goto fail;
    if (Py_TYPE(send) != stype) {
        PyErr_SetString(PyExc_TypeError, "submit_put: send_type made another type");
        goto fail;
    }
    if (PyObject_IS_GC(send) && PyObject_GC_IsTracked(send))
        PyObject_GC_UnTrack(send);  /* as Send.__init__ (see metaq/producer/_send.py) */
    ss_set_borrowed(send, SS_STATE, running);
    ss_set_borrowed(send, SS_RESULT, Py_None);
    ss_set_borrowed(send, SS_EXC, Py_None);
    ss_set_borrowed(send, SS_WAITED, Py_False);
    ss_set_borrowed(send, SS_PATH, path);
    ss_set_borrowed(send, SS_TOPIC, topic);
    ss_set_borrowed(send, SS_PAYLOAD, payload);
    ss_set_borrowed(send, SS_FLAG, flag);
    Py_INCREF(checksum);
    ss_set(send, SS_CHECKSUM, checksum);
    Py_INCREF(deadline);
    ss_set(send, SS_DEADLINE, deadline);
    ss_set_borrowed(send, SS_ATTEMPTS, ss_zero);
    ss_set_borrowed(send, SS_PART, Py_None);
    ss_set_borrowed(send, SS_TRIED, Py_None);
    ss_set_borrowed(send, SS_FLUSH, Py_False);
    if (PyDict_GET_SIZE(faults))
        goto python;  /* a broker failed lately: pick() steers away from it */
    parts = PyObject_GetAttr(route, sn[SN_PARTITIONS]);
    if (parts == NULL)
        goto fail;
    if (!PyTuple_CheckExact(parts) || PyTuple_GET_SIZE(parts) == 0)
        goto python;
    {
        PyObject *counter = PyObject_GetAttr(route, sn[SN_COUNTER]);
        if (counter == NULL)
            goto fail;
        PyObject *c = PyIter_Next(counter);
        Py_DECREF(counter);
        if (c == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_RuntimeError, "submit_put: the route's counter ended");
            goto fail;
        }
        PyObject *n = PyLong_FromSsize_t(PyTuple_GET_SIZE(parts));
        PyObject *i = n == NULL ? NULL : PyNumber_Remainder(c, n);
        Py_DECREF(c);
        Py_XDECREF(n);
        if (i == NULL)
            goto fail;
        Py_ssize_t k = PyLong_AsSsize_t(i);
        Py_DECREF(i);
        if (k == -1 && PyErr_Occurred())
            goto fail;
        part = PyTuple_GET_ITEM(parts, k);
        Py_INCREF(part);
    }
    ss_set_borrowed(send, SS_PART, part);
    if ((bid = PyObject_GetAttr(part, sn[SN_BROKER_ID])) == NULL)
        goto fail;
    PyObject *conn = PyDict_GetItemWithError(conns, bid);
    if (conn == NULL) {
        if (PyErr_Occurred())
            goto fail;
        goto python;
    }
    if ((PyObject *)Py_TYPE(conn) != conn_type)
        goto python;
    Py_INCREF(conn);
    cd = PyObject_GenericGetDict(conn, NULL);
    Py_DECREF(conn);
    if (cd == NULL)
        goto fail;
    {
        PyObject *usable = PyDict_GetItemWithError(cd, sn[SN_USABLE]);
        if (usable != Py_True)
            goto python_or_fail;
        PyObject *address = PyDict_GetItemWithError(cd, sn[SN_ADDRESS]);
        if (address == NULL)
            goto python_or_fail;
        if ((addresses = PyObject_GetAttr(route, sn[SN_ADDRESSES])) == NULL)
            goto fail;
        if (!PyDict_CheckExact(addresses))
            goto python;
        PyObject *want = PyDict_GetItemWithError(addresses, bid);
        if (want == NULL)
            goto python_or_fail;
        Py_INCREF(address);
        Py_INCREF(want);
        int same = PyObject_RichCompareBool(address, want, Py_EQ);
        Py_DECREF(address);
        Py_DECREF(want);
        if (same < 0)
            goto fail;
        if (!same)
            goto python;
    }
    Py_INCREF(conn);  /* (Python code runs inside: the pool may drop it meanwhile) */
    int rc = ss_put(send, conn, cd, topic, part, payload, flag, checksum, now);
    Py_DECREF(conn);
    if (rc < 0)
        goto fail;
    goto python;  /* put (attempts 1) or declined (attempts 0): the caller goes on */
python_or_fail:
    if (PyErr_Occurred())
        goto fail;
python:
    Py_XDECREF(addresses);
    Py_XDECREF(cd);
    Py_XDECREF(bid);
    Py_XDECREF(part);
    Py_XDECREF(parts);
    Py_DECREF(checksum);
    Py_DECREF(deadline);
    return send;
fail:
    Py_XDECREF(addresses);
    Py_XDECREF(cd);
    Py_XDECREF(bid);
    Py_XDECREF(part);
    Py_XDECREF(parts);
    Py_XDECREF(checksum);
    Py_XDECREF(deadline);
    Py_XDECREF(send);
    return NULL;
}
/* take_acks(buf, pending, send_type, finished) -> (used, freed, waited)
 *   The reader's bulk completion of successful put replies (metaq/net/_reader.py
 *   _handle), in one call: from the start of buf, each whole reply
 *   ``result 200 <len> <opaque>\r\n<msgId> <partition> <offset>`` (digits only, the
 *   body exactly <len> bytes, 0 <= opaque <= 0x7fffffff) whose request in pending is
 *   exactly a send_type is popped from pending and completed as Send.on_acks completes it
 *   (payload = b"", _ack_id / _ack_index / _ack_offset = the three numbers as ints, or
 *   their bytes past 18 digits, then _state = finished).  Stops at the first reply it
 *   does not take (another code or shape, a request of another type or none, a reply
 *   cut short): buf[used:] goes to the Python parser, which does the rest as before.
 *   freed: the sum of the taken requests' _pipe_size; waited: those whose _waited is
 *   true (the caller notifies them).  Its twin is the Python path it skips
 *   (scan_acks / scan_results, then on_acks / on_reply).
 */
enum { SA_ID, SA_INDEX, SA_OFFSET, SA_N };
static const char *const sa_names[SA_N] = {"_ack_id", "_ack_index", "_ack_offset"};
static PyTypeObject *sa_type;
static Py_ssize_t sa_off[SA_N];

static int
sa_offsets(PyTypeObject *t)
{
    if (t == sa_type && t == ss_type)
        return 0;
    if (ss_offsets(t) < 0)
        return -1;
    for (int i = 0; i < SA_N; i++) {
        PyObject *d = PyObject_GetAttrString((PyObject *)t, sa_names[i]);
        if (d == NULL)
            return -1;
        if (Py_TYPE(d) != &PyMemberDescr_Type
            || (((PyMemberDescrObject *)d)->d_member->flags & READONLY)) {
            Py_DECREF(d);
            PyErr_Format(PyExc_TypeError, "take_acks: %s.%s is not a slot", t->tp_name,
                         sa_names[i]);
            return -1;
        }
        sa_off[i] = ((PyMemberDescrObject *)d)->d_member->offset;
        Py_DECREF(d);
    }
    sa_type = t;  /* (ss_offsets holds the reference) */
    return 0;
}

/* digits at p[0..n): 1 when all are digits (n >= 1), value in *v when n <= 18 */
static inline int
sa_digits(const char *p, Py_ssize_t n, long long *v)
{
    if (n < 1)
        return 0;
    long long x = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (p[i] < '0' || p[i] > '9')
            return 0;
        if (i < 18)
            x = x * 10 + (p[i] - '0');
    }
    *v = x;
    return 1;
}

static PyObject *
sa_number(const char *p, Py_ssize_t n, long long v)
{
    return n <= 18 ? PyLong_FromLongLong(v) : PyBytes_FromStringAndSize(p, n);
}

static PyObject *
py_take_acks(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "take_acks takes 4 arguments");
        return NULL;
    }
    PyObject *bufo = args[0], *pending = args[1], *finished = args[3];
    if (!PyBytes_CheckExact(bufo) || !PyDict_CheckExact(pending) || !PyType_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "take_acks(bytes, dict, type, state)");
        return NULL;
    }
    PyTypeObject *stype = (PyTypeObject *)args[2];
    if (ss_init_names() < 0 || sa_offsets(stype) < 0)
        return NULL;
    if (empty_bytes == NULL && (empty_bytes = PyBytes_FromStringAndSize("", 0)) == NULL)
        return NULL;
    const char *buf = PyBytes_AS_STRING(bufo);
    Py_ssize_t end = PyBytes_GET_SIZE(bufo), pos = 0;
    long long freed = 0;
    PyObject *waited = PyList_New(0);
    if (waited == NULL)
        return NULL;
    while (pos < end) {
        /* result 200 <len> <opaque>\r\n */
        const char *p = buf + pos;
        Py_ssize_t left = end - pos;
        if (left < 11 || memcmp(p, "result 200 ", 11) != 0)
            break;
        Py_ssize_t i = 11, j = i;
        while (j < left && j - i <= 9 && p[j] >= '0' && p[j] <= '9')
            j++;
        if (j >= left || p[j] != ' ' || j - i < 1 || j - i > 9)
            break;
        long long blen = 0;
        sa_digits(p + i, j - i, &blen);
        i = ++j;
        while (j < left && j - i <= 10 && p[j] >= '0' && p[j] <= '9')
            j++;
        if (j + 1 >= left || p[j] != '\r' || p[j + 1] != '\n' || j - i < 1 || j - i > 10)
            break;
        long long op = 0;
        sa_digits(p + i, j - i, &op);
        if (op > 0x7fffffffLL)
            break;
        Py_ssize_t body = j + 2;
        if (blen > left - body)
            break;  /* cut short */
        /* <msgId> <partition> <offset>, exactly blen bytes */
        const char *b = p + body;
        Py_ssize_t s1 = -1, s2 = -1;
        for (Py_ssize_t k = 0; k < blen; k++) {
            if (b[k] == ' ') {
                if (s1 < 0)
                    s1 = k;
                else if (s2 < 0)
                    s2 = k;
                else {
                    s2 = -2;
                    break;
                }
            }
        }
        long long vid, vindex, voff;
        if (s1 < 0 || s2 < 0 || !sa_digits(b, s1, &vid)
            || !sa_digits(b + s1 + 1, s2 - s1 - 1, &vindex)
            || !sa_digits(b + s2 + 1, blen - s2 - 1, &voff))
            break;
        PyObject *key = PyLong_FromLongLong(op);
        if (key == NULL)
            goto fail;
        PyObject *req = PyDict_GetItemWithError(pending, key);
        if (req == NULL || Py_TYPE(req) != stype) {
            Py_DECREF(key);
            if (PyErr_Occurred())
                goto fail;
            break;
        }
        PyObject *size = *(PyObject **)((char *)req + ss_off[SS_SIZE]);
        long long sz = 0;
        if (size != NULL && PyLong_CheckExact(size)) {
            sz = PyLong_AsLongLong(size);
            if (sz == -1 && PyErr_Occurred()) {
                Py_DECREF(key);
                goto fail;
            }
        } else {
            Py_DECREF(key);
            break;
        }
        PyObject *nid = sa_number(b, s1, vid);
        PyObject *nindex = nid == NULL ? NULL : sa_number(b + s1 + 1, s2 - s1 - 1, vindex);
        PyObject *noff = nindex == NULL ? NULL : sa_number(b + s2 + 1, blen - s2 - 1, voff);
        if (noff == NULL) {
            Py_XDECREF(nid);
            Py_XDECREF(nindex);
            Py_DECREF(key);
            goto fail;
        }
        Py_INCREF(req);
        if (PyDict_DelItem(pending, key) < 0) {
            Py_DECREF(req);
            Py_DECREF(nid);
            Py_DECREF(nindex);
            Py_DECREF(noff);
            Py_DECREF(key);
            goto fail;
        }
        Py_DECREF(key);
        freed += sz;
        ss_set_borrowed(req, SS_PAYLOAD, empty_bytes);
        PyObject **slot;
        slot = (PyObject **)((char *)req + sa_off[SA_ID]);
        Py_XSETREF(*slot, nid);
        slot = (PyObject **)((char *)req + sa_off[SA_INDEX]);
        Py_XSETREF(*slot, nindex);
        slot = (PyObject **)((char *)req + sa_off[SA_OFFSET]);
        Py_XSETREF(*slot, noff);
        ss_set_borrowed(req, SS_STATE, finished);  /* last: a waiter reads it first */
        PyObject *w = *(PyObject **)((char *)req + ss_off[SS_WAITED]);
        int t = w == NULL ? 0 : PyObject_IsTrue(w);
        if (t < 0 || (t && PyList_Append(waited, req) < 0)) {
            Py_DECREF(req);
            goto fail;
        }
        Py_DECREF(req);
        pos += body + blen;
    }
    return Py_BuildValue("(nLN)", pos, freed, waited);
fail:
    Py_DECREF(waited);
    return NULL;
}
/* bind_send_result(send_type, result_cls, names, slow) -> a method for send_type.result
 *   send.result(timeout=None) for a finished send with no exception, in C: its _result,
 *   or, after a bulk acknowledgement (_result None), ack_result(result_cls, _ack_id,
 *   _ack_index, _ack_offset, part.broker_id, names[part.broker_id]); anything else
 *   (not finished, an exception, no name cache for the broker yet) is
 *   slow(send, timeout), the Python method it stands in for (metaq/producer/_send.py).
 *   One Send class per process (the statics below).
 */
static PyObject *sr_cls, *sr_names, *sr_slow, *sr_finished;
static PyTypeObject *sr_type;
static Py_ssize_t sr_off[SS_N], sr_ack[SA_N];

#define sr_slow_call(args, nargs) PyObject_Vectorcall(sr_slow, (args), (nargs), kwnames)

static PyObject *
py_send_result(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (sr_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "send_result: not bound");
        return NULL;
    }
    if (nargs < 1 || nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0) > 2
        || !PyObject_TypeCheck(args[0], sr_type))
        return sr_slow_call(args, nargs);
    PyObject *s = args[0];
#define SR(i) (*(PyObject **)((char *)s + sr_off[i]))
#define SA(i) (*(PyObject **)((char *)s + sr_ack[i]))
    PyObject *state = SR(SS_STATE);
    if (state == NULL || (state != sr_finished
                          && (!PyUnicode_Check(state)
                              || PyUnicode_Compare(state, sr_finished) != 0))) {
        if (PyErr_Occurred())
            return NULL;
        return sr_slow_call(args, nargs);
    }
    PyObject *exc = SR(SS_EXC), *r = SR(SS_RESULT);
    if (exc == NULL || exc != Py_None || r == NULL)
        return sr_slow_call(args, nargs);
    if (r != Py_None) {
        Py_INCREF(r);
        return r;
    }
    PyObject *part = SR(SS_PART), *id = SA(SA_ID), *index = SA(SA_INDEX), *off = SA(SA_OFFSET);
    if (part == NULL || part == Py_None || id == NULL || index == NULL || off == NULL)
        return sr_slow_call(args, nargs);
    Py_INCREF(part);
    PyObject *bid = PyObject_GetAttr(part, sn[SN_BROKER_ID]);
    Py_DECREF(part);
    if (bid == NULL)
        return NULL;
    PyObject *names = PyDict_GetItemWithError(sr_names, bid);
    if (names == NULL) {
        Py_DECREF(bid);
        if (PyErr_Occurred())
            return NULL;
        return sr_slow_call(args, nargs);
    }
    Py_INCREF(names);
    Py_INCREF(id);
    Py_INCREF(index);
    Py_INCREF(off);
    PyObject *res = NULL;
    if (PyLong_CheckExact(id) && PyLong_CheckExact(index) && PyLong_CheckExact(off)) {
        /* ints (take_acks): cls(id, names[index], offset, bid, index) built in place, as
         * tuple.__new__(cls, items) builds a tuple subclass */
        PyObject *name = PyObject_GetItem(names, index);
        if (name != NULL) {
            res = ((PyTypeObject *)sr_cls)->tp_alloc((PyTypeObject *)sr_cls, 5);
            if (res != NULL) {
                PyObject *items[5] = {id, name, off, bid, index};
                for (int k = 0; k < 5; k++) {
                    Py_INCREF(items[k]);
                    PyTuple_SET_ITEM(res, k, items[k]);
                }
            }
            Py_DECREF(name);
        }
    } else {
        PyObject *a[6] = {sr_cls, id, index, off, bid, names};
        res = py_ack_result(NULL, a, 6);
    }
    Py_DECREF(id);
    Py_DECREF(index);
    Py_DECREF(off);
    Py_DECREF(names);
    Py_DECREF(bid);
    return res;
#undef SR
#undef SA
}
#undef sr_slow_call

static PyMethodDef sr_def = {
    "result", (PyCFunction)(void (*)(void))py_send_result, METH_FASTCALL | METH_KEYWORDS,
    "result(timeout=None): the SendResult (see metaq/producer/_send.py)."};

static PyObject *
py_bind_send_result(PyObject *self, PyObject *args)
{
    PyObject *t, *cls, *names, *slow;
    if (!PyArg_ParseTuple(args, "O!O!O!O:bind_send_result", &PyType_Type, &t, &PyType_Type,
                          &cls, &PyDict_Type, &names, &slow))
        return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)cls, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "bind_send_result: result_cls must be a tuple class");
        return NULL;
    }
    if (ss_init_names() < 0 || sa_offsets((PyTypeObject *)t) < 0)
        return NULL;
    if (sr_finished == NULL && (sr_finished = PyUnicode_InternFromString("FINISHED")) == NULL)
        return NULL;
    memcpy(sr_off, ss_off, sizeof sr_off);
    memcpy(sr_ack, sa_off, sizeof sr_ack);
    Py_INCREF(t);
    Py_XSETREF(sr_type, (PyTypeObject *)t);
    Py_INCREF(cls);
    Py_XSETREF(sr_cls, cls);
    Py_INCREF(names);
    Py_XSETREF(sr_names, names);
    Py_INCREF(slow);
    Py_XSETREF(sr_slow, slow);
    PyObject *f = PyCFunction_New(&sr_def, NULL);
    if (f == NULL)
        return NULL;
    PyObject *m = PyInstanceMethod_New(f);
    Py_DECREF(f);
    return m;
}
/* bind_send_async(producer_type, slow, doc) -> a method descriptor for producer_type.send_async
 *   producer.send_async(topic, body) in C, with no Python frame: for exactly two
 *   positional arguments, a str topic and a bytes body, it reads the producer's instance
 *   attributes (_fast, _closed, and _c_send: _routes, _raw_bytes, _max_size) and, when
 *   _fast is the submit_put state, the producer is open, bytes go as they are, the body is within
 *   _max_size and the topic's route is known, makes the send with submit_put; a send
 *   submit_put could not put (attempts 0) goes on in producer._go_on(send, topic, route,
 *   body, None), as the Python method does.  Anything else is slow(producer, ...), the
 *   Python method it stands in for (metaq/producer/_producer.py), which raises the errors.
 *   A method descriptor (as a C type's methods are): producer.send_async(...) is called
 *   with no bound method made.  One Producer class per process (the statics below).
 */
static PyObject *sa_slow, *sa_fast_name, *sa_closed_name, *sa_c_send_name, *sa_go_on_name;

static PyObject *
sa_slow_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    Py_ssize_t n = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
    PyObject *small[8], **a = small;
    if (n + 1 > 8 && (a = PyMem_Malloc((size_t)(n + 1) * sizeof(PyObject *))) == NULL)
        return PyErr_NoMemory();
    a[0] = self;
    for (Py_ssize_t i = 0; i < n; i++)
        a[i + 1] = args[i];
    PyObject *r = PyObject_Vectorcall(sa_slow, a, (size_t)(nargs + 1), kwnames);
    if (a != small)
        PyMem_Free(a);
    return r;
}

static PyObject *
py_send_async(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (nargs != 2 || kwnames != NULL || !PyUnicode_CheckExact(args[0])
        || !PyBytes_CheckExact(args[1]))
        return sa_slow_call(self, args, nargs, kwnames);
    PyObject *topic = args[0], *body = args[1];
    PyObject *d = PyObject_GenericGetDict(self, NULL);
    if (d == NULL)
        return NULL;
    PyObject *fast = PyDict_GetItemWithError(d, sa_fast_name);
    PyObject *closed = fast ? PyDict_GetItemWithError(d, sa_closed_name) : NULL;
    /* _c_send = (_routes, _raw_bytes, _max_size): fixed for the producer's life */
    PyObject *cs = closed ? PyDict_GetItemWithError(d, sa_c_send_name) : NULL;
    PyObject *route = NULL, *routes = NULL, *raw = NULL, *maxs = NULL;
    if (cs != NULL && PyTuple_CheckExact(cs) && PyTuple_GET_SIZE(cs) == 3) {
        routes = PyTuple_GET_ITEM(cs, 0);
        raw = PyTuple_GET_ITEM(cs, 1);
        maxs = PyTuple_GET_ITEM(cs, 2);
    }
    if (routes != NULL && PyTuple_CheckExact(fast) && closed == Py_False && raw == Py_True
        && PyLong_CheckExact(maxs) && PyDict_CheckExact(routes)) {
        Py_ssize_t max_size = PyLong_AsSsize_t(maxs);
        if (max_size == -1 && PyErr_Occurred()) {
            PyErr_Clear();  /* (not a size: the Python method says what it is) */
        } else if (PyBytes_GET_SIZE(body) <= max_size) {
            route = PyDict_GetItemWithError(routes, topic);
        }
    }
    if (route == NULL) {
        Py_DECREF(d);
        if (PyErr_Occurred())
            return NULL;
        return sa_slow_call(self, args, nargs, kwnames);
    }
    Py_INCREF(route);
    Py_INCREF(fast);
    Py_DECREF(d);
    PyObject *a[5] = {fast, topic, route, body, ss_zero};
    PyObject *send = py_submit_put(NULL, a, 5);
    Py_DECREF(fast);
    if (send == NULL || send == Py_None) {
        Py_DECREF(route);
        if (send == NULL)
            return NULL;
        Py_DECREF(send);
        return sa_slow_call(self, args, nargs, kwnames);
    }
    PyObject *attempts = *(PyObject **)((char *)send + ss_off[SS_ATTEMPTS]);
    int put = attempts == NULL ? 0 : attempts == one_long ? 1 : PyObject_IsTrue(attempts);
    if (put == 0) {  /* not put (no partition, a broker avoided, a full window): go on */
        PyObject *g[6] = {self, send, topic, route, body, Py_None};
        PyObject *r = PyObject_VectorcallMethod(sa_go_on_name, g, 6, NULL);
        put = r == NULL ? -1 : 1;
        Py_XDECREF(r);
    }
    Py_DECREF(route);
    if (put < 0) {
        Py_DECREF(send);
        return NULL;
    }
    return send;
}

static PyMethodDef sa_def = {
    "send_async", (PyCFunction)(void (*)(void))py_send_async, METH_FASTCALL | METH_KEYWORDS,
    NULL};

static PyObject *
py_bind_send_async(PyObject *self, PyObject *args)
{
    PyObject *t, *slow, *doc;
    if (!PyArg_ParseTuple(args, "O!OU:bind_send_async", &PyType_Type, &t, &slow, &doc))
        return NULL;
    if (!PyCallable_Check(slow)) {
        PyErr_SetString(PyExc_TypeError, "bind_send_async: slow must be callable");
        return NULL;
    }
    if (ss_init_names() < 0)
        return NULL;
    PyObject **names[] = {&sa_fast_name, &sa_closed_name, &sa_c_send_name, &sa_go_on_name};
    const char *text[] = {"_fast", "_closed", "_c_send", "_go_on"};
    for (int i = 0; i < 4; i++)
        if (*names[i] == NULL && (*names[i] = PyUnicode_InternFromString(text[i])) == NULL)
            return NULL;
    if (sa_def.ml_doc == NULL) {  /* kept for the life of the process, as the method */
        Py_ssize_t n;
        const char *u = PyUnicode_AsUTF8AndSize(doc, &n);
        if (u == NULL)
            return NULL;
        char *copy = PyMem_RawMalloc((size_t)n + 1);
        if (copy == NULL)
            return PyErr_NoMemory();
        memcpy(copy, u, (size_t)n + 1);
        sa_def.ml_doc = copy;
    }
    Py_INCREF(slow);
    Py_XSETREF(sa_slow, slow);
    return PyDescr_NewMethod((PyTypeObject *)t, &sa_def);
}
/* ==== end of send_async in one call ================================================== */

/* ---- consumer messages' fields as slots (issue 29, consumer rate) ----------------------- */

#include <structmember.h> /* T_OBJECT_EX, READONLY (Python.h has them only from 3.12) */

/* slot_fields(cls, size, fields): for each (name, index, doc) of ``fields`` a read-only
 * member descriptor on ``cls`` (a tuple subclass without instance fields) that reads
 * item ``index`` of the tuple in place.  ``m.body`` is then one load for the
 * interpreter (CPython specializes member reads), not a property calling an
 * itemgetter.  The caller makes every instance of ``cls`` (and its subclasses) have
 * ``size`` items (``index`` < ``size``): the descriptor does not check the length.
 * The definitions live as long as the process (classes are made once). */
static PyObject *
py_slot_fields(PyObject *self, PyObject *args)
{
    PyObject *cls, *fields;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "OnO!:slot_fields", &cls, &size, &PyTuple_Type, &fields))
        return NULL;
    if (check_message_type(cls, "cls") < 0)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(fields);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *f = PyTuple_GET_ITEM(fields, i);
        Py_ssize_t index;
        PyObject *name, *doc;
        if (!PyTuple_Check(f) || !PyArg_ParseTuple(f, "UnU:slot_fields field", &name, &index,
                                                   &doc))
            goto bad;
        if (index < 0 || index >= size) {
            PyErr_Format(PyExc_ValueError, "slot_fields: index %zd of %R outside 0..%zd",
                         index, name, size - 1);
            return NULL;
        }
    }
    /* one block, never freed: the names and docs are copied into it */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *f = PyTuple_GET_ITEM(fields, i);
        PyObject *name = PyTuple_GET_ITEM(f, 0), *doc = PyTuple_GET_ITEM(f, 2);
        Py_ssize_t index = PyLong_AsSsize_t(PyTuple_GET_ITEM(f, 1));
        Py_ssize_t name_len, doc_len;
        const char *name_s = PyUnicode_AsUTF8AndSize(name, &name_len);
        const char *doc_s = name_s ? PyUnicode_AsUTF8AndSize(doc, &doc_len) : NULL;
        if (doc_s == NULL)
            return NULL;
        PyMemberDef *def = PyMem_Calloc(1, sizeof(PyMemberDef) + (size_t)name_len + 1
                                        + (size_t)doc_len + 1);
        if (def == NULL)
            return PyErr_NoMemory();
        char *text = (char *)(def + 1);
        memcpy(text, name_s, (size_t)name_len + 1);
        memcpy(text + name_len + 1, doc_s, (size_t)doc_len + 1);
        def->name = text;
        def->type = T_OBJECT_EX;
        def->offset = offsetof(PyTupleObject, ob_item) + index * (Py_ssize_t)sizeof(PyObject *);
        def->flags = READONLY;
        def->doc = text + name_len + 1;
        PyObject *descr = PyDescr_NewMember((PyTypeObject *)cls, def);
        if (descr == NULL)
            return NULL;  /* ``def`` stays allocated: harmless, and never on this path */
        int r = PyObject_SetAttr(cls, name, descr);
        Py_DECREF(descr);
        if (r < 0)
            return NULL;
    }
    Py_RETURN_NONE;
bad:
    if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError,
                        "slot_fields: fields must be (name: str, index: int, doc: str) tuples");
    }
    return NULL;
}

/* ---- end of the consumer messages' fields ------------------------------------------------ */

/* ==== issue 26 (sync replication): a get line, read whole ==============================
 * get_line(line, topics, groups, cls) -> cls tuple | None
 *   line (its CRLF cut) exactly "get <topic> <group> <partition> <offset> <maxSize>
 *   <opaque>" with, optionally, " hold=<ms>" and then " records=<opaque>" (single
 *   spaces, nothing after), the topic and group tokens keys of the dicts topics and
 *   groups (the parser's caches of checked names), every number "-?[0-9]+" of at most
 *   20 bytes within its range (partition, maxSize, opaque, records: int32; offset: int64;
 *   hold: 0..INT32_MAX): tuple.__new__(cls, (topic, group, partition, offset, maxSize,
 *   opaque, hold, records or None)).  None for anything else: the full parser reads it
 *   (py_get_line in _fast.py is its twin).
 */

/* The token at *p up to the next space or the end: 1 with its bounds, 0 when empty. */
static inline int
gl_token(const unsigned char *d, Py_ssize_t n, Py_ssize_t *p, Py_ssize_t *start,
         Py_ssize_t *len)
{
    Py_ssize_t i = *p;
    while (i < n && d[i] != ' ')
        i++;
    if (i == *p)
        return 0;
    *start = *p;
    *len = i - *p;
    *p = i;
    return 1;
}

/* The number token at *p (to the next space or the end) in lo..hi: 1 and *out. */
static inline int
gl_int(const unsigned char *d, Py_ssize_t n, Py_ssize_t *p, long long lo, long long hi,
       long long *out)
{
    Py_ssize_t i = *p, e = i;
    while (e < n && d[e] != ' ')
        e++;
    if (e == i || e - i > 20)
        return 0;
    int minus = 0;
    if (d[i] == '-') {
        minus = 1;
        if (++i == e)
            return 0;
    }
    unsigned long long v = 0;
    for (; i < e; i++) {
        if (d[i] < '0' || d[i] > '9')
            return 0;
        if (v > 922337203685477580ULL)  /* v * 10 would pass 2**63: out of every range */
            return 0;
        v = v * 10 + (unsigned long long)(d[i] - '0');
    }
    long long value;
    if (minus) {
        if (v > 9223372036854775808ULL)
            return 0;
        value = v == 0 ? 0 : -(long long)(v - 1) - 1;
    } else {
        if (v > 9223372036854775807ULL)
            return 0;
        value = (long long)v;
    }
    if (value < lo || value > hi)
        return 0;
    *out = value;
    *p = e;
    return 1;
}

static PyObject *
py_get_line(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "get_line takes 4 arguments");
        return NULL;
    }
    PyObject *line = args[0], *topics = args[1], *groups = args[2], *cls = args[3];
    if (!PyBytes_Check(line) || !PyDict_Check(topics) || !PyDict_Check(groups)
        || !PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError,
                        "get_line(line: bytes, topics: dict, groups: dict, cls: tuple class)");
        return NULL;
    }
    const unsigned char *d = (const unsigned char *)PyBytes_AS_STRING(line);
    Py_ssize_t n = PyBytes_GET_SIZE(line), p = 0, ts, tl, gs, gl;
    long long part, offset, size, opaque, hold = 0, records = 0;
    int has_records = 0;
    if (!literal(d, n, &p, "get ", 4) || !gl_token(d, n, &p, &ts, &tl)
        || !literal(d, n, &p, " ", 1) || !gl_token(d, n, &p, &gs, &gl)
        || !literal(d, n, &p, " ", 1)
        || !gl_int(d, n, &p, INT32_MIN, INT32_MAX, &part) || !literal(d, n, &p, " ", 1)
        || !gl_int(d, n, &p, LLONG_MIN, LLONG_MAX, &offset) || !literal(d, n, &p, " ", 1)
        || !gl_int(d, n, &p, INT32_MIN, INT32_MAX, &size) || !literal(d, n, &p, " ", 1)
        || !gl_int(d, n, &p, INT32_MIN, INT32_MAX, &opaque))
        Py_RETURN_NONE;
    if (p < n) {
        if (!literal(d, n, &p, " hold=", 6) || !gl_int(d, n, &p, 0, INT32_MAX, &hold))
            Py_RETURN_NONE;
        if (p < n) {
            if (!literal(d, n, &p, " records=", 9)
                || !gl_int(d, n, &p, INT32_MIN, INT32_MAX, &records) || p < n)
                Py_RETURN_NONE;
            has_records = 1;
        }
    }
    PyObject *key = PyBytes_FromStringAndSize((const char *)d + ts, tl);
    if (key == NULL)
        return NULL;
    PyObject *topic = PyDict_GetItemWithError(topics, key);  /* borrowed */
    Py_DECREF(key);
    if (topic == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    key = PyBytes_FromStringAndSize((const char *)d + gs, gl);
    if (key == NULL)
        return NULL;
    PyObject *group = PyDict_GetItemWithError(groups, key);
    Py_DECREF(key);
    if (group == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    PyObject *items = PyTuple_New(8);
    if (items == NULL)
        return NULL;
    Py_INCREF(topic);
    PyTuple_SET_ITEM(items, 0, topic);
    Py_INCREF(group);
    PyTuple_SET_ITEM(items, 1, group);
    PyObject *v;
    long long nums[5] = {part, offset, size, opaque, hold};
    for (int k = 0; k < 5; k++) {
        if ((v = PyLong_FromLongLong(nums[k])) == NULL) {
            Py_DECREF(items);
            return NULL;
        }
        PyTuple_SET_ITEM(items, 2 + k, v);
    }
    if (has_records) {
        if ((v = PyLong_FromLongLong(records)) == NULL) {
            Py_DECREF(items);
            return NULL;
        }
    } else {
        v = Py_None;
        Py_INCREF(v);
    }
    PyTuple_SET_ITEM(items, 7, v);
    return tuple_as(cls, items);
}
/* ==== end of issue 26 (sync replication) =============================================== */

/* ==== issue 29 (transactions): a transaction's put answers, in bulk ======================
 * tx_acks(buf, pos, end, opaques, cls, broker_id, index, name) -> (results, used) | None | False
 *   The answers to a transaction's puts to one partition (BrokerConnection.read_tx_acks):
 *   from buf[pos:end], one reply per opaque, each exactly
 *   ``result 200 <L> <O>\r\n<I> <index> -1`` (L: 1-9 digits, at most 40; O: 1-10 digits,
 *   equal to the opaque; the body exactly L bytes: I 1-18 digits, the index as "%d"
 *   writes it).  All there: the cls tuples (int(I), name, -1, broker_id, index) and the
 *   position after the last.  None while buf ends where every byte so far fits that
 *   shape (more is coming); False for anything else.  Twin: _fast.py_tx_acks.
 */
static PyObject *
py_tx_acks(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "tx_acks takes 8 arguments");
        return NULL;
    }
    PyObject *opaques = args[3], *cls = args[4], *broker_id = args[5], *index = args[6];
    PyObject *name = args[7];
    if (!PyList_Check(opaques)) {
        PyErr_SetString(PyExc_TypeError, "tx_acks: opaques must be a list");
        return NULL;
    }
    if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "tx_acks: cls must be a tuple class");
        return NULL;
    }
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]);
    if (pos == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t end = PyLong_AsSsize_t(args[2]);
    if (end == -1 && PyErr_Occurred())
        return NULL;
    long long want_index = PyLong_AsLongLong(index);
    if (want_index == -1 && PyErr_Occurred())
        return NULL;
    char want[32];
    int want_n = snprintf(want, sizeof want, "%lld", want_index);
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *d = (const unsigned char *)view.buf;
    if (end > view.len)
        end = view.len;
    if (pos < 0 || pos > end) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "tx_acks: pos out of range");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(opaques);
    PyObject *out = PyList_New(0);
    PyObject *minus1 = PyLong_FromLong(-1);
    if (out == NULL || minus1 == NULL)
        goto error;
    static const char head[] = "result 200 ";
    Py_ssize_t p = pos;
    for (Py_ssize_t i = 0; i < n; i++) {
        for (int k = 0; k < 11; k++, p++) {
            if (p >= end)
                goto more;
            if (d[p] != (unsigned char)head[k])
                goto other;
        }
        long long len = 0, opq = 0;
        int digits = 0;
        for (;; p++) {
            if (p >= end)
                goto more;
            if (d[p] < '0' || d[p] > '9')
                break;
            if (++digits > 9)
                goto other;
            len = len * 10 + (d[p] - '0');
        }
        if (digits == 0 || d[p] != ' ')
            goto other;
        p++;
        digits = 0;
        for (;; p++) {
            if (p >= end)
                goto more;
            if (d[p] < '0' || d[p] > '9')
                break;
            if (++digits > 10)
                goto other;
            opq = opq * 10 + (d[p] - '0');
        }
        if (digits == 0 || d[p] != '\r')
            goto other;
        if (++p >= end)
            goto more;
        if (d[p] != '\n')
            goto other;
        p++;
        if (len > 40)
            goto other;
        {
            long long expected = PyLong_AsLongLong(PyList_GET_ITEM(opaques, i));
            if (expected == -1 && PyErr_Occurred())
                goto error;
            if (opq != expected)
                goto other;
        }
        if (end - p < len)
            goto more;
        Py_ssize_t stop = p + (Py_ssize_t)len;
        long long id = 0;
        digits = 0;
        for (; p < stop && d[p] >= '0' && d[p] <= '9'; p++) {
            if (++digits > 18)
                goto other;
            id = id * 10 + (d[p] - '0');
        }
        if (digits == 0 || p >= stop || d[p] != ' ')
            goto other;
        p++;
        if (stop - p != want_n + 3 || memcmp(d + p, want, (size_t)want_n) != 0
            || memcmp(d + p + want_n, " -1", 3) != 0)
            goto other;
        p = stop;
        PyObject *v = PyLong_FromLongLong(id);
        if (v == NULL)
            goto error;
        PyObject *r = ack_pack(cls, v, name, minus1, broker_id, index);
        Py_DECREF(v);
        if (r == NULL)
            goto error;
        int bad = PyList_Append(out, r);
        Py_DECREF(r);
        if (bad < 0)
            goto error;
    }
    PyBuffer_Release(&view);
    Py_DECREF(minus1);
    return Py_BuildValue("(Nn)", out, p);
more:
    PyBuffer_Release(&view);
    Py_DECREF(out);
    Py_DECREF(minus1);
    Py_RETURN_NONE;
other:
    PyBuffer_Release(&view);
    Py_DECREF(out);
    Py_DECREF(minus1);
    Py_RETURN_FALSE;
error:
    PyBuffer_Release(&view);
    Py_XDECREF(out);
    Py_XDECREF(minus1);
    return NULL;
}
/* tx_answers(opaques, ids, tail) -> bytes
 *   The broker's answers to a run of a transaction's puts (Transactions._same_tx): for
 *   each opaque (decimal bytes) and msgId (an int), ``result 200 <len> <opaque>\r\n<msgId>
 *   <tail>``, the body being b"%d%b" % (msgId, tail) and len its length; all joined.
 *   Twin: _fast.py_tx_answers. */
static int
tx_decimal(char *w, long long v)
{
    char tmp[24];
    int n = 0;
    unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
    do {
        tmp[n++] = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    int k = 0;
    if (v < 0)
        w[k++] = '-';
    while (n)
        w[k++] = tmp[--n];
    return k;
}

static PyObject *
py_tx_answers(PyObject *self, PyObject *args)
{
    PyObject *opaques_arg, *ids_arg;
    Py_buffer tail;
    if (!PyArg_ParseTuple(args, "OOy*:tx_answers", &opaques_arg, &ids_arg, &tail))
        return NULL;
    PyObject *opaques = PySequence_Fast(opaques_arg, "tx_answers: opaques must be a sequence");
    PyObject *ids = opaques ? PySequence_Fast(ids_arg, "tx_answers: ids must be a sequence")
                            : NULL;
    PyObject *out = NULL;
    if (ids == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(opaques);
    if (PySequence_Fast_GET_SIZE(ids) != n) {
        PyErr_SetString(PyExc_ValueError, "tx_answers: opaques and ids of different lengths");
        goto done;
    }
    Py_ssize_t cap = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(opaques, i);
        if (!PyBytes_Check(o)) {
            PyErr_SetString(PyExc_TypeError, "tx_answers: an opaque is not bytes");
            goto done;
        }
        cap += 11 + 24 + 1 + PyBytes_GET_SIZE(o) + 2 + 24 + tail.len;
    }
    out = PyBytes_FromStringAndSize(NULL, cap);
    if (out == NULL)
        goto done;
    char *w = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(opaques, i);
        long long id = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(ids, i));
        if (id == -1 && PyErr_Occurred()) {
            Py_CLEAR(out);
            goto done;
        }
        char idb[24];
        int idn = tx_decimal(idb, id);
        memcpy(w, "result 200 ", 11);
        w += 11;
        w += tx_decimal(w, (long long)(idn + tail.len));
        *w++ = ' ';
        memcpy(w, PyBytes_AS_STRING(o), (size_t)PyBytes_GET_SIZE(o));
        w += PyBytes_GET_SIZE(o);
        *w++ = '\r';
        *w++ = '\n';
        memcpy(w, idb, (size_t)idn);
        w += idn;
        memcpy(w, tail.buf, (size_t)tail.len);
        w += tail.len;
    }
    if (_PyBytes_Resize(&out, w - PyBytes_AS_STRING(out)) < 0)
        out = NULL;
done:
    Py_XDECREF(opaques);
    Py_XDECREF(ids);
    PyBuffer_Release(&tail);
    return out;
}
/* ==== end of issue 29 (transactions) ===================================================== */

/* ---- module --------------------------------------------------------------------------- */

static PyMethodDef methods[] = {
    /* issue 29 (transactions) */
    {"tx_acks", (PyCFunction)(void (*)(void))py_tx_acks, METH_FASTCALL,
     "tx_acks(buf, pos, end, opaques, cls, broker_id, index, name) -> (results, used) |\n"
     "None | False: a transaction's put answers to one partition, in bulk."},
    {"tx_answers", py_tx_answers, METH_VARARGS,
     "tx_answers(opaques, ids, tail) -> bytes: the broker's answers to a run of a\n"
     "transaction's puts."},
    {"crc32", py_crc32, METH_VARARGS,
     "crc32(data, value=0) -> int: zlib's CRC-32 (carry-less multiply when the CPU has it)."},
    {"scan", py_scan, METH_VARARGS,
     "scan(data, verify=True, max_payload=2**31-1, bounds=True)\n"
     "-> (bounds, count, stop, kind, a, b).\n\n"
     "Walk the whole messages at the start of data.  bounds: native int32 start of\n"
     "each, then stop (the end of the last); None when not asked for.  kind 0: what follows stop is empty or\n"
     "cut short; 1: impossible length a; 2: checksum mismatch (a stored, b actual)."},
    {"take", py_take, METH_VARARGS,
     "take(data, pos, base, limit, max_bytes, verify, max_payload, topic, partition, codec,\n"
     "plain, attr) -> (messages, pos, status): up to limit messages from pos, and no more\n"
     "once they span max_bytes (at least one)."},
    {"deliver", py_deliver, METH_VARARGS,
     "deliver(data, pos, base, verify, max_payload, topic, partition, codec, plain, attr,\n"
     "listener, later) -> (status, pos, count, last, failed, exc): call listener(m) for\n"
     "each message from pos until the data ends, a bad message, a later or an error."},
    {"fast_puts", py_fast_puts, METH_VARARGS,
     "fast_puts(buf, pos, fast, max_payload, out, tx_cls=None) -> pos: the broker's put\n"
     "fast path (see RequestParser): append a tuple per whole put to a key of fast (a\n"
     "tx_cls one per transactional put, given tx_cls); stop at anything else."},
    {"encode_tx_puts", py_encode_tx_puts, METH_VARARGS,
     "encode_tx_puts(head, flag, payloads, checksums, key, opaques) -> data: the\n"
     "transactional put requests of several payloads to one partition, together."},
    {"encode_puts", py_encode_puts, METH_VARARGS,
     "encode_puts(head, flag, payloads, checksums, opaques) -> (data, sizes): the put\n"
     "requests of one partition, head being b'put <topic> <partition> '."},
    /* producer per-message path (issue 29, producer part) */
    {"put_request", (PyCFunction)(void (*)(void))py_put_request, METH_FASTCALL,
     "put_request(prefix, partition, payload, flag, checksum, opaque) -> bytes: one put\n"
     "request, prefix being b'put <topic> '."},
    {"untrack", py_untrack, METH_O,
     "untrack(obj): take obj out of the cyclic garbage collector's lists."},
    {"track", py_track, METH_O, "track(obj): put obj back into them (after untrack)."},
    {"ack_result", (PyCFunction)(void (*)(void))py_ack_result, METH_FASTCALL,
     "ack_result(cls, msg_id, index, offset, broker_id, names) -> cls: tuple.__new__(cls,\n"
     "(int(msg_id), names[int(index)], int(offset), broker_id, int(index)))."},
    {"complete_acks", (PyCFunction)(void (*)(void))py_complete_acks, METH_FASTCALL,
     "complete_acks(requests, msg_ids, partitions, offsets, state) -> list: store each\n"
     "answer on its request, then its state; the requests with _waited set."},
    /* end of the producer per-message path */
    /* send_async in one call (issue 29, producer part: branch i29-async) */
    {"submit_put", (PyCFunction)(void (*)(void))py_submit_put, METH_FASTCALL,
     "submit_put(state, topic, route, payload, flag) -> Send or None: send_async's\n"
     "submit on the common path in one call (see metaq/producer/_producer.py)."},
    {"take_acks", (PyCFunction)(void (*)(void))py_take_acks, METH_FASTCALL,
     "take_acks(buf, pending, send_type, finished) -> (used, freed, waited): the reader's\n"
     "bulk completion of successful put replies to send_type requests."},
    {"bind_send_async", py_bind_send_async, METH_VARARGS,
     "bind_send_async(producer_type, slow, doc) -> a method descriptor: producer_type.send_async\n"
     "in C for its common call (see the C file), slow (the Python method) for the rest."},
    {"bind_send_result", py_bind_send_result, METH_VARARGS,
     "bind_send_result(send_type, result_cls, names, slow) -> a method: send_type.result\n"
     "in C for a finished send, slow(send, timeout) otherwise."},
    /* issue 29 (sync send) */
    {"put_ack", (PyCFunction)(void (*)(void))py_put_ack, METH_FASTCALL,
     "put_ack(buf, opaque, cls, broker_id, names) -> cls | None | False: buf as exactly one\n"
     "successful put reply with this opaque, as a cls tuple; None while it may still become\n"
     "one; False for anything else."},
    {"put_round_trip", (PyCFunction)(void (*)(void))py_put_round_trip, METH_FASTCALL,
     "put_round_trip(sock, send_lock, data, opaque, cls, broker_id, names) -> cls | bytes |\n"
     "None: send data, release send_lock, one blocking recv: put_ack's tuple when it is the\n"
     "lone success; else the bytes read (b'': closed), None when nothing came in time."},
    /* end of issue 29 (sync send) */
    /* consumer messages' fields (issue 29, consumer rate) */
    {"slot_fields", py_slot_fields, METH_VARARGS,
     "slot_fields(cls, size, fields): a read-only member descriptor on cls (a tuple\n"
     "subclass whose instances all have size items) for each (name, index, doc) of\n"
     "fields, reading that item in place."},
    /* issue 26 (sync replication) */
    {"get_line", (PyCFunction)(void (*)(void))py_get_line, METH_FASTCALL,
     "get_line(line, topics, groups, cls) -> cls | None: a well-formed get line (CRLF cut)\n"
     "whose topic and group are keys of topics and groups, as a cls tuple; None otherwise."},
    /* end of issue 26 (sync replication) */
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "metaq.protocol._speedups",
    "The consumer's per-message work in C (see metaq/protocol/_fast.py).", -1, methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    crc_init();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if ((put_request_fmt == NULL
         && (put_request_fmt = PyBytes_FromString("%b%d %d %d %d %d\r\n%b")) == NULL)
        || (s_payload == NULL && (s_payload = PyUnicode_InternFromString("payload")) == NULL)
        || (s_ack_id == NULL && (s_ack_id = PyUnicode_InternFromString("_ack_id")) == NULL)
        || (s_ack_index == NULL
            && (s_ack_index = PyUnicode_InternFromString("_ack_index")) == NULL)
        || (s_ack_offset == NULL
            && (s_ack_offset = PyUnicode_InternFromString("_ack_offset")) == NULL)
        || (s_state == NULL && (s_state = PyUnicode_InternFromString("_state")) == NULL)
        || (s_waited == NULL && (s_waited = PyUnicode_InternFromString("_waited")) == NULL)
        || (empty_bytes == NULL && (empty_bytes = PyBytes_FromStringAndSize("", 0)) == NULL)
        || (s_fileno == NULL && (s_fileno = PyUnicode_InternFromString("fileno")) == NULL)
        || (s_release == NULL
            && (s_release = PyUnicode_InternFromString("release")) == NULL)) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "VERSION", VERSION) < 0
        || PyModule_AddIntConstant(m, "END", ST_END) < 0
        || PyModule_AddIntConstant(m, "LIMIT", ST_LIMIT) < 0
        || PyModule_AddIntConstant(m, "BAD", ST_BAD) < 0
        || PyModule_AddIntConstant(m, "LATER", ST_LATER) < 0
        || PyModule_AddIntConstant(m, "ERROR", ST_ERROR) < 0
        || PyModule_AddIntConstant(m, "CLMUL", have_clmul) < 0
        || PyModule_AddIntConstant(m, "VCLMUL", have_vclmul) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
