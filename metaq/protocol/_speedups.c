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

#define VERSION 6
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
 * (topic, partition, offset, next_offset, msg_id, flag, payload, codec) */
static PyObject *
build(const MsgKind *k, const unsigned char *d, Py_ssize_t pos, Py_ssize_t end,
      long long base)
{
    int32_t flag = (int32_t)be32(d + pos + 16);
    PyTypeObject *tp = (flag & 1) ? k->attr : k->plain;
    PyObject *m = tp->tp_alloc(tp, 8);
    if (m == NULL)
        return NULL;
    PyObject *off = PyLong_FromLongLong(base + pos);
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
    /* Its items are strings, ints, bytes and the shared codec: a message is never
     * part of a reference cycle, so the cyclic GC need not track it (CPython
     * untracks such tuples itself, but only after a collection has looked at
     * them; a batch of 500 live messages would trigger collections). */
    PyObject_GC_UnTrack(m);
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
    PyObject *list = PyList_New(0);
    if (list == NULL)
        goto fail;
    while (PyList_GET_SIZE(list) < limit && pos - start < max_bytes) {
        int r = step(d, n, pos, verify, max_payload, &end, &kind, &a, &b);
        if (r <= 0) {
            status = r == 0 ? ST_END : ST_BAD;
            break;
        }
        PyObject *m = build(&k, d, pos, end, base);
        if (m == NULL)
            goto fail;
        if (PyList_Append(list, m) < 0) {
            Py_DECREF(m);
            goto fail;
        }
        Py_DECREF(m);
        pos = end;
    }
    if (status == ST_LIMIT) {
        /* say END now rather than on the next call when nothing whole follows */
        int r = step(d, n, pos, 0, max_payload, &end, &kind, &a, &b);
        if (r == 0)
            status = ST_END;
    }
    PyBuffer_Release(&buf);
    return Py_BuildValue("(Nni)", list, pos, status);
fail:
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
    PyObject *last = NULL, *failed = NULL, *exc = NULL;
    for (;;) {
        int r = step(d, n, pos, verify, max_payload, &end, &kind, &a, &b);
        if (r <= 0) {
            status = r == 0 ? ST_END : ST_BAD;
            break;
        }
        PyObject *m = build(&k, d, pos, end, base);
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
    PyBuffer_Release(&buf);
    return Py_BuildValue("(innNNN)", status, pos, count, last ? last : Py_NewRef(Py_None),
                         failed ? failed : Py_NewRef(Py_None),
                         exc ? exc : Py_NewRef(Py_None));
fail:
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
    PyObject *id = NULL, *index = NULL, *name = NULL, *offset = NULL, *items = NULL;
    PyObject *r = NULL;
    if ((id = ack_int(args[1])) == NULL || (index = ack_int(args[2])) == NULL
        || (name = PyObject_GetItem(args[5], index)) == NULL
        || (offset = ack_int(args[3])) == NULL
        || (items = PyTuple_Pack(5, id, name, offset, args[4], index)) == NULL)
        goto done;
    if ((PyTypeObject *)cls == &PyTuple_Type) {
        r = items;
        items = NULL;
    } else {
        PyObject *a = PyTuple_Pack(1, items);
        if (a != NULL) {
            r = PyTuple_Type.tp_new((PyTypeObject *)cls, a, NULL);
            Py_DECREF(a);
        }
    }
done:
    Py_XDECREF(id);
    Py_XDECREF(index);
    Py_XDECREF(name);
    Py_XDECREF(offset);
    Py_XDECREF(items);
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
    PyObject *id = NULL, *index = NULL, *name = NULL, *offset = NULL, *items = NULL;
    PyObject *r = NULL;
    if ((id = ack_long(s, a0, a1)) == NULL || (index = PyLong_FromLong(idx)) == NULL
        || (name = PyObject_GetItem(args[4], index)) == NULL
        || (offset = ack_long(s, c0, c1)) == NULL
        || (items = PyTuple_Pack(5, id, name, offset, args[3], index)) == NULL)
        goto done;
    if ((PyTypeObject *)cls == &PyTuple_Type) {
        r = items;
        items = NULL;
    } else {
        PyObject *t = PyTuple_Pack(1, items);
        if (t != NULL) {
            r = PyTuple_Type.tp_new((PyTypeObject *)cls, t, NULL);
            Py_DECREF(t);
        }
    }
done:
    Py_XDECREF(id);
    Py_XDECREF(index);
    Py_XDECREF(name);
    Py_XDECREF(offset);
    Py_XDECREF(items);
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
    if ((PyTypeObject *)cls == &PyTuple_Type)
        return items;
    PyObject *a = PyTuple_Pack(1, items);
    Py_DECREF(items);
    if (a == NULL)
        return NULL;
    PyObject *r = PyTuple_Type.tp_new((PyTypeObject *)cls, a, NULL);
    Py_DECREF(a);
    return r;
}
/* ==== end of issue 26 (sync replication) =============================================== */

/* ---- module --------------------------------------------------------------------------- */

static PyMethodDef methods[] = {
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
