/*
 * headrace.io._hrio: the hot loops of the TFRecord / Example format layer.
 *
 * Each function has a pure-Python twin that gives identical results (including error
 * positions); see tfrecord/framing.py (scan_records_py, frame_record) and _example_wire.py
 * (scan_columns). Keep the two in step: tests compare them on random and corrupt input.
 *
 * Safety rules followed throughout: every read is bounds-checked against the end of
 * its buffer; varints are at most 10 bytes; a declared length is compared with the bytes
 * that exist (and with max_record_bytes) before anything is done with it; nothing is
 * allocated from a declared length.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define HRIO_HAVE_SSE42 1
#include <immintrin.h>
/* AVX-512 carry-less multiplication: its intrinsics and CPU feature names need GCC 10 or
 * clang 12; an older compiler builds the crc32-instruction path alone. */
#if (defined(__clang__) && __clang_major__ >= 12) || \
    (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10)
#define HRIO_HAVE_VPCLMUL 1
#endif
#endif

/* ------------------------------------------------------------------ CRC32C */

static uint32_t crc_tables[8][256];

static void init_crc_tables(void)
{
    for (uint32_t byte = 0; byte < 256; byte++) {
        uint32_t crc = byte;
        for (int bit = 0; bit < 8; bit++)
            crc = (crc & 1) ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
        crc_tables[0][byte] = crc;
    }
    for (int slice = 1; slice < 8; slice++)
        for (int byte = 0; byte < 256; byte++) {
            uint32_t prev = crc_tables[slice - 1][byte];
            crc_tables[slice][byte] = (prev >> 8) ^ crc_tables[0][prev & 0xFF];
        }
}

/* Slicing-by-8 software CRC: ~1.5 GB/s, for CPUs without SSE4.2. */
static uint32_t crc32c_software(uint32_t crc, const uint8_t *data, size_t len)
{
    uint32_t c = ~crc;
    while (len >= 8) {
        uint32_t low, high;
        memcpy(&low, data, 4);
        memcpy(&high, data + 4, 4);
        low ^= c; /* little-endian hosts only; the build targets them */
        c = crc_tables[7][low & 0xFF] ^ crc_tables[6][(low >> 8) & 0xFF] ^
            crc_tables[5][(low >> 16) & 0xFF] ^ crc_tables[4][low >> 24] ^
            crc_tables[3][high & 0xFF] ^ crc_tables[2][(high >> 8) & 0xFF] ^
            crc_tables[1][(high >> 16) & 0xFF] ^ crc_tables[0][high >> 24];
        data += 8;
        len -= 8;
    }
    while (len--)
        c = crc_tables[0][(c ^ *data++) & 0xFF] ^ (c >> 8);
    return ~c;
}

#ifdef HRIO_HAVE_SSE42
/* Three streams at once. The crc32 instruction's latency is three cycles and its
 * throughput one a cycle, so one stream runs at a third of what the core can do
 * (~8 GB/s). Three blocks are checksummed side by side and combined: the CRC register
 * is linear over GF(2), so the register after block A then block B is the register
 * after A advanced over len(B) zero bytes (a 32x32 matrix, applied with four table
 * lookups) XOR the register of B started from zero. M. Adler's method (crc32c.c,
 * zlib licence), written anew here. */
#define CRC_LONG 8192
#define CRC_SHORT 256
static uint32_t crc_long_shift[4][256];
static uint32_t crc_short_shift[4][256];

static uint32_t gf2_times(const uint32_t *matrix, uint32_t vector)
{
    uint32_t sum = 0;
    while (vector) {
        if (vector & 1)
            sum ^= *matrix;
        vector >>= 1;
        matrix++;
    }
    return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *matrix)
{
    for (int n = 0; n < 32; n++)
        square[n] = gf2_times(matrix, matrix[n]);
}

/* The operator that advances a register over ``len`` zero bytes (a power of two). */
static void crc_zeros_operator(uint32_t *even, size_t len)
{
    uint32_t odd[32];
    uint32_t row = 1;
    odd[0] = 0x82F63B78u; /* one zero bit: the reflected Castagnoli polynomial */
    for (int n = 1; n < 32; n++) {
        odd[n] = row;
        row <<= 1;
    }
    gf2_square(even, odd); /* two zero bits */
    gf2_square(odd, even); /* four */
    do {
        gf2_square(even, odd); /* eight bits: one byte, then doubling */
        len >>= 1;
        if (len == 0)
            return;
        gf2_square(odd, even);
        len >>= 1;
    } while (len);
    memcpy(even, odd, sizeof(odd));
}

static void crc_zeros_tables(uint32_t tables[4][256], size_t len)
{
    uint32_t op[32];
    crc_zeros_operator(op, len);
    for (uint32_t n = 0; n < 256; n++) {
        tables[0][n] = gf2_times(op, n);
        tables[1][n] = gf2_times(op, n << 8);
        tables[2][n] = gf2_times(op, n << 16);
        tables[3][n] = gf2_times(op, n << 24);
    }
}

static uint32_t crc_shift(uint32_t tables[4][256], uint32_t crc)
{
    return tables[0][crc & 0xFF] ^ tables[1][(crc >> 8) & 0xFF] ^ tables[2][(crc >> 16) & 0xFF] ^
           tables[3][crc >> 24];
}

__attribute__((target("sse4.2"))) static uint64_t crc_three_streams(uint64_t c, const uint8_t **data,
                                                                    size_t *len, size_t block,
                                                                    uint32_t tables[4][256])
{
    while (*len >= 3 * block) {
        const uint8_t *p = *data;
        const uint8_t *stop = p + block;
        uint64_t c1 = 0, c2 = 0;
        do {
            uint64_t w0, w1, w2;
            memcpy(&w0, p, 8);
            memcpy(&w1, p + block, 8);
            memcpy(&w2, p + 2 * block, 8);
            c = _mm_crc32_u64(c, w0);
            c1 = _mm_crc32_u64(c1, w1);
            c2 = _mm_crc32_u64(c2, w2);
            p += 8;
        } while (p < stop);
        c = crc_shift(tables, (uint32_t)c) ^ (uint32_t)c1;
        c = crc_shift(tables, (uint32_t)c) ^ (uint32_t)c2;
        *data += 3 * block;
        *len -= 3 * block;
    }
    return c;
}

/* The crc32 instruction; compiled for SSE4.2 but only called when the CPU has it. */
__attribute__((target("sse4.2"))) static uint32_t crc32c_sse42(uint32_t crc, const uint8_t *data,
                                                               size_t len)
{
    uint64_t c = (uint32_t)~crc;
    c = crc_three_streams(c, &data, &len, CRC_LONG, crc_long_shift);
    c = crc_three_streams(c, &data, &len, CRC_SHORT, crc_short_shift);
    while (len >= 8) {
        uint64_t word;
        memcpy(&word, data, 8);
        c = _mm_crc32_u64(c, word);
        data += 8;
        len -= 8;
    }
    uint32_t c32 = (uint32_t)c;
    while (len--)
        c32 = _mm_crc32_u8(c32, *data++);
    return ~c32;
}

#ifdef HRIO_HAVE_VPCLMUL
/* Carry-less multiplication, 64 bytes at a time per register (AVX-512 VPCLMULQDQ).
 * The crc32 instruction checksums 8 bytes a cycle at best, three streams at once; a
 * cache read of large records then spends as long on the CRC as on the kernel's copy.
 * Folding instead multiplies each 128-bit lane by x^(8d) mod P (d: the distance folded,
 * in bytes) and XORs it onto the lane d bytes later, so four registers fold 256 bytes per
 * step; what is left (128 bits) goes through two crc32 instructions, which reduce it
 * modulo P and multiply by x^32 as the reflected fold constants require (the known
 * scheme of Intel's white paper "Fast CRC Computation Using PCLMULQDQ", with the
 * constants derived at start-up rather than copied). */
static uint64_t fold_256[2], fold_64[2], fold_48[2], fold_32[2], fold_16[2];

/* x^n mod P, bit-reflected (bit 31 is x^0): the fold constants. */
static uint64_t crc_xn_mod(unsigned n)
{
    uint32_t r = 0x80000000u;
    while (n--)
        r = (r & 1) ? (r >> 1) ^ 0x82F63B78u : r >> 1;
    return r;
}

static void fold_constants(uint64_t k[2], unsigned distance)
{
    k[0] = crc_xn_mod(8 * distance + 31); /* multiplies a lane's low 64 bits */
    k[1] = crc_xn_mod(8 * distance - 33); /* its high 64 bits */
}

#define HRIO_FOLD_TARGET __attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.2")))

HRIO_FOLD_TARGET static inline __m512i fold512(__m512i x, __m512i k, __m512i next)
{
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00),
                                     _mm512_clmulepi64_epi128(x, k, 0x11), next, 0x96);
}

HRIO_FOLD_TARGET static inline __m128i fold128(__m128i x, const uint64_t k[2], __m128i next)
{
    __m128i kk = _mm_set_epi64x((long long)k[1], (long long)k[0]);
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, kk, 0x00),
                                       _mm_clmulepi64_si128(x, kk, 0x11)), next);
}

HRIO_FOLD_TARGET static uint32_t crc32c_vpclmul(uint32_t crc, const uint8_t *data, size_t len)
{
    if (len < 256)
        return crc32c_sse42(crc, data, len);
    __m512i x0 = _mm512_loadu_si512((const void *)data);
    __m512i x1 = _mm512_loadu_si512((const void *)(data + 64));
    __m512i x2 = _mm512_loadu_si512((const void *)(data + 128));
    __m512i x3 = _mm512_loadu_si512((const void *)(data + 192));
    x0 = _mm512_xor_si512(x0, _mm512_inserti32x4(_mm512_setzero_si512(), _mm_cvtsi32_si128((int)~crc), 0));
    data += 256;
    len -= 256;
    __m512i k = _mm512_broadcast_i32x4(_mm_set_epi64x((long long)fold_256[1], (long long)fold_256[0]));
    while (len >= 256) {
        x0 = fold512(x0, k, _mm512_loadu_si512((const void *)data));
        x1 = fold512(x1, k, _mm512_loadu_si512((const void *)(data + 64)));
        x2 = fold512(x2, k, _mm512_loadu_si512((const void *)(data + 128)));
        x3 = fold512(x3, k, _mm512_loadu_si512((const void *)(data + 192)));
        data += 256;
        len -= 256;
    }
    k = _mm512_broadcast_i32x4(_mm_set_epi64x((long long)fold_64[1], (long long)fold_64[0]));
    x0 = fold512(x0, k, x1);
    x0 = fold512(x0, k, x2);
    x0 = fold512(x0, k, x3);
    while (len >= 64) {
        x0 = fold512(x0, k, _mm512_loadu_si512((const void *)data));
        data += 64;
        len -= 64;
    }
    /* the four lanes onto the last: lane i lies 48 - 16 i bytes before it */
    __m128i last = _mm512_extracti32x4_epi32(x0, 3);
    last = fold128(_mm512_extracti32x4_epi32(x0, 2), fold_16, last);
    last = fold128(_mm512_extracti32x4_epi32(x0, 1), fold_32, last);
    last = fold128(_mm512_castsi512_si128(x0), fold_48, last);
    uint64_t c = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(last));
    c = _mm_crc32_u64(c, (uint64_t)_mm_extract_epi64(last, 1));
    return crc32c_sse42(~(uint32_t)c, data, len);
}
#endif /* HRIO_HAVE_VPCLMUL */
#endif /* HRIO_HAVE_SSE42 */

static uint32_t (*crc32c_impl)(uint32_t, const uint8_t *, size_t) = crc32c_software;

static uint32_t masked_crc(const uint8_t *data, size_t len)
{
    uint32_t crc = crc32c_impl(0, data, len);
    return ((crc >> 15) | (crc << 17)) + 0xA282EAD8u;
}

static uint64_t load_u64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static uint32_t load_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static void store_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void store_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static PyObject *py_crc32c(PyObject *self, PyObject *args)
{
    Py_buffer view;
    unsigned long crc = 0;
    if (!PyArg_ParseTuple(args, "y*|k:crc32c", &view, &crc))
        return NULL;
    uint32_t result;
    if (view.len >= 65536) {
        Py_BEGIN_ALLOW_THREADS
        result = crc32c_impl((uint32_t)crc, view.buf, (size_t)view.len);
        Py_END_ALLOW_THREADS
    } else {
        result = crc32c_impl((uint32_t)crc, view.buf, (size_t)view.len);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(result);
}

static const char *crc32c_backend_name(uint32_t (*impl)(uint32_t, const uint8_t *, size_t))
{
#ifdef HRIO_HAVE_SSE42
#ifdef HRIO_HAVE_VPCLMUL
    if (impl == crc32c_vpclmul)
        return "vpclmulqdq";
#endif
    if (impl == crc32c_sse42)
        return "sse4.2";
#endif
    return "table";
}

/* For tests: every backend this CPU can run, checked against the others; the fastest
 * one alone serves crc32c(). */
static PyObject *py_crc32c_using(PyObject *self, PyObject *args)
{
    const char *name;
    Py_buffer view;
    unsigned long crc = 0;
    if (!PyArg_ParseTuple(args, "sy*|k:crc32c_using", &name, &view, &crc))
        return NULL;
    uint32_t (*impl)(uint32_t, const uint8_t *, size_t) = NULL;
    if (strcmp(name, "table") == 0)
        impl = crc32c_software;
#ifdef HRIO_HAVE_SSE42
    else if (strcmp(name, "sse4.2") == 0 && crc32c_impl != crc32c_software)
        impl = crc32c_sse42;
#endif
#ifdef HRIO_HAVE_VPCLMUL
    else if (strcmp(name, "vpclmulqdq") == 0 && crc32c_impl == crc32c_vpclmul)
        impl = crc32c_vpclmul;
#endif
    if (impl == NULL) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "crc32c_using: no backend %s on this CPU", name);
        return NULL;
    }
    uint32_t result = impl((uint32_t)crc, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(result);
}

/* ------------------------------------------------------------------ TFRecord framing */

enum { SCAN_LIMIT = 0, SCAN_NEED_MORE = 1, SCAN_BAD_LENGTH_CRC = 2, SCAN_BAD_DATA_CRC = 3,
       SCAN_TOO_LARGE = 4 };
#define MAX_RECORD_BYTES_CAP (1ULL << 62)

/* A call that cuts out many bytes checks and copies them without the GIL (an image
 * reader's 100 KB records: ~30 us a record that a thread decoding JPEGs beside it no
 * longer waits for). The frames are read and the bytes objects made first, with the GIL;
 * then the payloads' CRCs are checked and copied without it, one release per call (a
 * thread that gives the GIL up may wait a switch interval to have it back). Smaller
 * calls keep it: releasing costs more than their scan. */
#define SCAN_GIL_FREE_BYTES (64 * 1024)

typedef struct {
    Py_ssize_t offset, length;
    char *to;
} cut_t;

static PyObject *py_scan_records(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t pos, max_records, max_bytes;
    int verify_crc;
    unsigned long long max_record_bytes;
    if (!PyArg_ParseTuple(args, "y*nnnpK:scan_records", &view, &pos, &max_records, &max_bytes,
                          &verify_crc, &max_record_bytes))
        return NULL;
    if (max_record_bytes > MAX_RECORD_BYTES_CAP)
        max_record_bytes = MAX_RECORD_BYTES_CAP;
    const uint8_t *buf = view.buf;
    const Py_ssize_t end = view.len;
    if (pos < 0 || pos > end) {
        PyErr_SetString(PyExc_ValueError, "scan position outside the buffer");
        PyBuffer_Release(&view);
        return NULL;
    }
    /* the frames: lengths and their CRCs, up to the limits (payloads are checked below) */
    cut_t local[64], *cuts = local;
    Py_ssize_t count = 0, capacity = 64;
    int status = SCAN_LIMIT;
    unsigned long long detail = 0;
    Py_ssize_t total = 0;
    PyObject *records = NULL;
    while (count < max_records) {
        const Py_ssize_t available = end - pos;
        if (available < 12) {
            status = SCAN_NEED_MORE;
            detail = 12;
            break;
        }
        const uint64_t length = load_u64(buf + pos);
        if (verify_crc && masked_crc(buf + pos, 8) != load_u32(buf + pos + 8)) {
            status = SCAN_BAD_LENGTH_CRC;
            break;
        }
        if (length > max_record_bytes) {
            status = SCAN_TOO_LARGE;
            detail = length;
            break;
        }
        /* length <= 2**62, so 16 + length cannot overflow */
        if ((uint64_t)available < 16 + length) {
            status = SCAN_NEED_MORE;
            detail = 16 + length;
            break;
        }
        if (count > 0 && (uint64_t)total + length > (uint64_t)max_bytes)
            break;
        if (count == capacity) {
            cut_t *grown = PyMem_Malloc(2 * (size_t)capacity * sizeof(cut_t));
            if (grown == NULL) {
                PyErr_NoMemory();
                goto done;
            }
            memcpy(grown, cuts, (size_t)count * sizeof(cut_t));
            if (cuts != local)
                PyMem_Free(cuts);
            cuts = grown;
            capacity *= 2;
        }
        cuts[count].offset = pos + 12;
        cuts[count].length = (Py_ssize_t)length;
        count++;
        total += (Py_ssize_t)length;
        pos += 16 + (Py_ssize_t)length;
    }
    records = PyList_New(count);
    for (Py_ssize_t i = 0; records != NULL && i < count; i++) {
        PyObject *record = PyBytes_FromStringAndSize(NULL, cuts[i].length);
        if (record == NULL) {
            Py_CLEAR(records);
            goto done;
        }
        cuts[i].to = PyBytes_AS_STRING(record);
        PyList_SET_ITEM(records, i, record);
    }
    if (records == NULL)
        goto done;
    /* the payloads: checked and copied, without the GIL for a large call (the view stays
     * exported and the bytes objects are this call's alone, so nothing moves meanwhile) */
    Py_ssize_t bad = -1;
    PyThreadState *released = total >= SCAN_GIL_FREE_BYTES ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        const uint8_t *data = buf + cuts[i].offset;
        const size_t length = (size_t)cuts[i].length;
        if (verify_crc && masked_crc(data, length) != load_u32(data + length)) {
            bad = i;
            break;
        }
        memcpy(cuts[i].to, data, length);
    }
    if (released != NULL)
        PyEval_RestoreThread(released);
    if (bad >= 0) { /* the scan ends before the first bad payload, as if it had stopped there */
        status = SCAN_BAD_DATA_CRC;
        detail = (unsigned long long)cuts[bad].length;
        pos = cuts[bad].offset - 12;
        if (PyList_SetSlice(records, bad, count, NULL) < 0)
            Py_CLEAR(records);
    }
done:
    if (cuts != local)
        PyMem_Free(cuts);
    PyBuffer_Release(&view);
    if (records == NULL)
        return NULL;
    return Py_BuildValue("NniK", records, pos, status, detail);
}

/* ------------------------------------------------------------------ runs of alike records */

#ifdef HRIO_HAVE_SSE42
/* Three short records' CRC registers at once: one record's crc32 chain waits three
 * cycles a word, three chains keep the instruction busy every cycle. */
__attribute__((target("sse4.2"))) static void crc_three_rows(uint32_t start, const uint8_t *p,
                                                             size_t stride, size_t len,
                                                             uint32_t out[3])
{
    uint64_t c0 = start, c1 = start, c2 = start;
    size_t at = 0;
    for (; at + 8 <= len; at += 8) {
        uint64_t w0, w1, w2;
        memcpy(&w0, p + at, 8);
        memcpy(&w1, p + stride + at, 8);
        memcpy(&w2, p + 2 * stride + at, 8);
        c0 = _mm_crc32_u64(c0, w0);
        c1 = _mm_crc32_u64(c1, w1);
        c2 = _mm_crc32_u64(c2, w2);
    }
    uint32_t d0 = (uint32_t)c0, d1 = (uint32_t)c1, d2 = (uint32_t)c2;
    for (; at < len; at++) {
        d0 = _mm_crc32_u8(d0, p[at]);
        d1 = _mm_crc32_u8(d1, p[stride + at]);
        d2 = _mm_crc32_u8(d2, p[2 * stride + at]);
    }
    out[0] = ~d0;
    out[1] = ~d1;
    out[2] = ~d2;
}
#endif

/* check_alike(buf, rows, size, head, footers) -> int: a run of ``rows`` framed records of
 * ``size`` bytes each, checked as a TFRecord reader checks each one (its length is
 * size - 16, its length CRC, its data CRC), and every payload must start with ``head``
 * (the element's skeleton, the same for all: its CRC is computed once and each record's
 * continues from it). Each record's stored (masked) data CRC goes to ``footers`` (rows
 * uint32). Returns the first record that is not so (the caller checks it alone, for the
 * error that says what is wrong), or -1. The buffer is only read. */
static PyObject *py_check_alike(PyObject *self, PyObject *args)
{
    Py_buffer buf, head, footers;
    Py_ssize_t rows, size;
    if (!PyArg_ParseTuple(args, "y*nny*w*:check_alike", &buf, &rows, &size, &head, &footers))
        return NULL;
    PyObject *result = NULL;
    const size_t hlen = (size_t)head.len;
    if (rows < 0 || size < 16 + (Py_ssize_t)hlen || rows * size > buf.len || footers.len < rows * 4) {
        PyErr_SetString(PyExc_ValueError, "check_alike: the buffers are smaller than rows * size");
        goto done;
    }
    Py_ssize_t bad = -1;
    const uint8_t *base = buf.buf, *skeleton = head.buf;
    uint8_t *out = footers.buf;
    const size_t rest = (size_t)size - 16 - hlen; /* each payload's bytes after the head */
    uint8_t frame[12];
    store_u64(frame, (uint64_t)size - 16);
    store_u32(frame + 8, masked_crc(frame, 8));
    Py_BEGIN_ALLOW_THREADS
    const uint32_t start = crc32c_impl(0, skeleton, hlen);
    Py_ssize_t row = 0;
    uint32_t crcs[3];
    while (row < rows) {
        const uint8_t *p = base + row * size;
        Py_ssize_t group = 1;
#ifdef HRIO_HAVE_SSE42
        if (rest < 1024 && rows - row >= 3 && crc32c_impl != crc32c_software) {
            crc_three_rows(~start, p + 12 + hlen, (size_t)size, rest, crcs);
            group = 3;
        } else
#endif
            crcs[0] = crc32c_impl(start, p + 12 + hlen, rest);
        for (Py_ssize_t k = 0; k < group; k++, p += size) {
            const uint32_t footer = load_u32(p + size - 4);
            const uint32_t masked = ((crcs[k] >> 15) | (crcs[k] << 17)) + 0xA282EAD8u;
            store_u32(out + 4 * (row + k), footer);
            if (memcmp(p, frame, 12) != 0 || memcmp(p + 12, skeleton, hlen) != 0 ||
                masked != footer) {
                bad = row + k;
                break;
            }
        }
        if (bad >= 0)
            break;
        row += group;
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(bad);
done:
    PyBuffer_Release(&buf);
    PyBuffer_Release(&head);
    PyBuffer_Release(&footers);
    return result;
}

static PyObject *py_frame_records(PyObject *self, PyObject *arg)
{
    PyObject *seq = PySequence_Fast(arg, "frame_records expects a list of bytes");
    if (seq == NULL)
        return NULL;
    const Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_buffer view;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &view, PyBUF_SIMPLE) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        total += 16 + view.len;
        PyBuffer_Release(&view);
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    uint8_t *p = (uint8_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_buffer view;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &view, PyBUF_SIMPLE) < 0) {
            Py_DECREF(out);
            Py_DECREF(seq);
            return NULL;
        }
        store_u64(p, (uint64_t)view.len);
        store_u32(p + 8, masked_crc(p, 8));
        memcpy(p + 12, view.buf, (size_t)view.len);
        store_u32(p + 12 + view.len, masked_crc(view.buf, (size_t)view.len));
        p += 16 + view.len;
        PyBuffer_Release(&view);
    }
    Py_DECREF(seq);
    return out;
}

/* ------------------------------------------------------------------ protobuf wire */

enum { KIND_NONE = 0, KIND_BYTES = 1, KIND_FLOAT = 2, KIND_INT64 = 3 };
enum { FAILURE_MALFORMED = 1, FAILURE_KIND = 2 };
enum { WIRE_VARINT = 0, WIRE_FIXED64 = 1, WIRE_LEN = 2, WIRE_FIXED32 = 5 };

static PyObject *ParseFailure;

typedef struct {
    const uint8_t *buf;
    Py_ssize_t error_position; /* set when a function returns -1 for malformed input */
} wire_t;

/* Read a varint of at most 10 bytes at *pos; -1 (error at its start) if malformed. */
#if defined(__GNUC__) || defined(__clang__)
#define HRIO_INLINE static inline __attribute__((always_inline))
#else
#define HRIO_INLINE static inline
#endif

HRIO_INLINE int read_varint(wire_t *w, Py_ssize_t *pos, Py_ssize_t end, uint64_t *out)
{
    const Py_ssize_t start = *pos;
    if (start < end && w->buf[start] < 0x80) { /* most are one byte: tags, short lengths */
        *out = w->buf[start];
        *pos = start + 1;
        return 0;
    }
    uint64_t result = 0;
    for (int i = 0; i < 10; i++) {
        if (*pos >= end)
            break;
        const uint8_t byte = w->buf[(*pos)++];
        result |= (uint64_t)(byte & 0x7F) << (7 * i);
        if (byte < 0x80) {
            *out = result;
            return 0;
        }
    }
    w->error_position = start;
    return -1;
}

typedef struct {
    uint64_t number;
    int wire_type;
    Py_ssize_t start, end; /* the value (varint bytes, or a length-delimited payload) */
} field_t;

/* Next field in [*pos, end): 1 = got one, 0 = end, -1 = malformed. */
HRIO_INLINE int next_field(wire_t *w, Py_ssize_t *pos, Py_ssize_t end, field_t *f)
{
    if (*pos >= end)
        return 0;
    const Py_ssize_t field_start = *pos;
    uint64_t tag, value;
    if (read_varint(w, pos, end, &tag) < 0)
        return -1;
    f->wire_type = (int)(tag & 7);
    f->number = tag >> 3;
    switch (f->wire_type) {
    case WIRE_VARINT:
        f->start = *pos;
        if (read_varint(w, pos, end, &value) < 0)
            return -1;
        break;
    case WIRE_LEN:
        if (read_varint(w, pos, end, &value) < 0)
            return -1;
        f->start = *pos;
        if (value > (uint64_t)(end - f->start)) {
            w->error_position = field_start;
            return -1;
        }
        *pos = f->start + (Py_ssize_t)value;
        break;
    case WIRE_FIXED64:
    case WIRE_FIXED32:
        f->start = *pos;
        if ((f->wire_type == WIRE_FIXED64 ? 8 : 4) > end - *pos) {
            w->error_position = field_start;
            return -1;
        }
        *pos += f->wire_type == WIRE_FIXED64 ? 8 : 4;
        break;
    default:
        w->error_position = field_start;
        return -1;
    }
    if (f->number == 0) {
        w->error_position = field_start;
        return -1;
    }
    f->end = *pos;
    return 1;
}

/* A growable byte buffer (numeric values, counts, map entries). */
typedef struct {
    char *data;
    size_t len, cap;
} growbuf_t;

static int growbuf_reserve(growbuf_t *g, size_t extra)
{
    if (g->len + extra <= g->cap)
        return 0;
    size_t cap = g->cap ? g->cap : 256;
    while (cap < g->len + extra)
        cap *= 2;
    char *data = PyMem_Realloc(g->data, cap);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    g->data = data;
    g->cap = cap;
    return 0;
}

HRIO_INLINE int growbuf_append(growbuf_t *g, const void *src, size_t n)
{
    if (g->len + n > g->cap && growbuf_reserve(g, n) < 0)
        return -1;
    memcpy(g->data + g->len, src, n);
    g->len += n;
    return 0;
}

typedef struct {
    const char *key;
    Py_ssize_t key_len;
    int kind;
    growbuf_t values;  /* float32 / int64, little-endian */
    PyObject *strings; /* list of bytes for KIND_BYTES */
    growbuf_t counts;  /* int64 per record, -1 = missing */
} column_t;

typedef struct {
    const uint8_t *key;
    Py_ssize_t key_len, value_start, value_end;
} entry_t;

/* Collect the map entries of every occurrence of message field `map_field` (an
 * Example's features, a SequenceExample's context: 1) into `entries`. */
static int collect_entries(wire_t *w, Py_ssize_t len, growbuf_t *entries, uint64_t map_field)
{
    Py_ssize_t pos = 0;
    field_t top;
    int more;
    entries->len = 0;
    while ((more = next_field(w, &pos, len, &top)) == 1) {
        if (top.number != map_field || top.wire_type != WIRE_LEN)
            continue;
        Py_ssize_t map_pos = top.start;
        field_t entry_field;
        int more_entries;
        while ((more_entries = next_field(w, &map_pos, top.end, &entry_field)) == 1) {
            if (entry_field.number != 1 || entry_field.wire_type != WIRE_LEN)
                continue;
            /* written in place: a stack copy appended as 32 bytes was loaded back while its
             * 8-byte stores were in flight (a store-forwarding stall, a fifth of a parse) */
            if (entries->len + sizeof(entry_t) > entries->cap &&
                growbuf_reserve(entries, sizeof(entry_t)) < 0)
                return -2;
            entry_t *entry = (entry_t *)(entries->data + entries->len);
            entry->key = (const uint8_t *)"";
            entry->key_len = 0;
            entry->value_start = entry->value_end = entry_field.end;
            Py_ssize_t sub_pos = entry_field.start;
            field_t sub;
            int more_sub;
            while ((more_sub = next_field(w, &sub_pos, entry_field.end, &sub)) == 1) {
                if (sub.wire_type != WIRE_LEN)
                    continue;
                if (sub.number == 1) {
                    entry->key = w->buf + sub.start;
                    entry->key_len = sub.end - sub.start;
                } else if (sub.number == 2) {
                    entry->value_start = sub.start;
                    entry->value_end = sub.end;
                }
            }
            if (more_sub < 0)
                return -1;
            entries->len += sizeof(entry_t);
        }
        if (more_entries < 0)
            return -1;
    }
    return more;
}

/* Kind of a Feature (last oneof field wins) and the range of its list. */
static int feature_kind(wire_t *w, Py_ssize_t start, Py_ssize_t end, int *kind,
                        Py_ssize_t *list_start, Py_ssize_t *list_end)
{
    *kind = KIND_NONE;
    *list_start = *list_end = start;
    Py_ssize_t pos = start;
    field_t f;
    int more;
    while ((more = next_field(w, &pos, end, &f)) == 1) {
        if (f.wire_type == WIRE_LEN && f.number >= KIND_BYTES && f.number <= KIND_INT64) {
            *kind = (int)f.number;
            *list_start = f.start;
            *list_end = f.end;
        }
    }
    return more;
}

/* Append one list's values to the column; return the count, -1 malformed, -2 Python error. */
static Py_ssize_t append_list_values(wire_t *w, column_t *col, Py_ssize_t start, Py_ssize_t end)
{
    Py_ssize_t count = 0, pos = start;
    field_t f;
    int more;
    while ((more = next_field(w, &pos, end, &f)) == 1) {
        if (f.number != 1)
            continue;
        const Py_ssize_t size = f.end - f.start;
        if (col->kind == KIND_BYTES) {
            if (f.wire_type != WIRE_LEN)
                continue;
            PyObject *value = PyBytes_FromStringAndSize((const char *)w->buf + f.start, size);
            if (value == NULL || PyList_Append(col->strings, value) < 0) {
                Py_XDECREF(value);
                return -2;
            }
            Py_DECREF(value);
            count++;
        } else if (col->kind == KIND_FLOAT) {
            if (f.wire_type == WIRE_LEN && size % 4 != 0) {
                w->error_position = f.start;
                return -1;
            }
            if (f.wire_type != WIRE_FIXED32 && f.wire_type != WIRE_LEN)
                continue;
            if (growbuf_append(&col->values, w->buf + f.start, (size_t)size) < 0)
                return -2;
            count += size / 4;
        } else {
            if (f.wire_type != WIRE_VARINT && f.wire_type != WIRE_LEN)
                continue;
            Py_ssize_t vpos = f.start;
            while (vpos < f.end) {
                uint64_t value;
                if (read_varint(w, &vpos, f.end, &value) < 0)
                    return -1;
                uint8_t le[8];
                store_u64(le, value);
                if (growbuf_append(&col->values, le, 8) < 0)
                    return -2;
                count++;
            }
        }
    }
    return more < 0 ? -1 : count;
}

static void raise_failure(int code, Py_ssize_t record, Py_ssize_t key, Py_ssize_t position,
                          int kind)
{
    PyObject *args = Py_BuildValue("(innni)", code, record, key, position, kind);
    if (args != NULL) {
        PyErr_SetObject(ParseFailure, args);
        Py_DECREF(args);
    }
}

/* Whether the column's key is `key`. Keys are short: compared here, a call to memcmp
 * per feature and column was a tenth of a record's parse. */
HRIO_INLINE int key_is(const column_t *col, const uint8_t *key, Py_ssize_t len)
{
    if (col->key_len != len)
        return 0;
    if (len > 16)
        return memcmp(col->key, key, (size_t)len) == 0;
    const uint8_t *mine = (const uint8_t *)col->key;
    for (Py_ssize_t i = 0; i < len; i++)
        if (mine[i] != key[i])
            return 0;
    return 1;
}

/* Parse one record into the columns; 0 ok, -1 error set. */
static int scan_record(const uint8_t *data, Py_ssize_t len, Py_ssize_t record_index,
                       column_t *cols, Py_ssize_t ncols, growbuf_t *entries, int64_t *found)
{
    wire_t w = {data, 0};
    int status = collect_entries(&w, len, entries, 1);
    if (status == -1) {
        raise_failure(FAILURE_MALFORMED, record_index, -1, w.error_position, KIND_NONE);
        return -1;
    }
    if (status == -2)
        return -1;
    for (Py_ssize_t k = 0; k < ncols; k++)
        found[k] = -1;
    const entry_t *list = (const entry_t *)entries->data;
    for (Py_ssize_t i = (Py_ssize_t)(entries->len / sizeof(entry_t)) - 1; i >= 0; i--) {
        const entry_t *entry = &list[i];
        Py_ssize_t k = 0;
        while (k < ncols && !key_is(&cols[k], entry->key, entry->key_len))
            k++;
        if (k == ncols || found[k] != -1)
            continue;
        int kind;
        Py_ssize_t list_start, list_end;
        if (feature_kind(&w, entry->value_start, entry->value_end, &kind, &list_start,
                         &list_end) < 0) {
            raise_failure(FAILURE_MALFORMED, record_index, -1, w.error_position, KIND_NONE);
            return -1;
        }
        if (kind == KIND_NONE)
            continue;
        if (kind != cols[k].kind) {
            raise_failure(FAILURE_KIND, record_index, k, entry->value_start, kind);
            return -1;
        }
        const Py_ssize_t count = append_list_values(&w, &cols[k], list_start, list_end);
        if (count == -1)
            raise_failure(FAILURE_MALFORMED, record_index, -1, w.error_position, KIND_NONE);
        if (count < 0)
            return -1;
        found[k] = count;
    }
    for (Py_ssize_t k = 0; k < ncols; k++) {
        uint8_t le[8];
        store_u64(le, (uint64_t)found[k]);
        if (growbuf_append(&cols[k].counts, le, 8) < 0)
            return -1;
    }
    return 0;
}

static void free_columns(column_t *cols, Py_ssize_t ncols)
{
    for (Py_ssize_t k = 0; k < ncols; k++) {
        PyMem_Free(cols[k].values.data);
        PyMem_Free(cols[k].counts.data);
        Py_XDECREF(cols[k].strings);
    }
    PyMem_Free(cols);
}

static int init_columns(column_t *cols, PyObject *keys, PyObject *kinds, Py_ssize_t ncols)
{
    for (Py_ssize_t k = 0; k < ncols; k++) {
        PyObject *key = PySequence_Fast_GET_ITEM(keys, k);
        if (!PyBytes_Check(key)) {
            PyErr_SetString(PyExc_TypeError, "feature keys must be bytes");
            return -1;
        }
        cols[k].key = PyBytes_AS_STRING(key);
        cols[k].key_len = PyBytes_GET_SIZE(key);
        const long kind = PyLong_AsLong(PySequence_Fast_GET_ITEM(kinds, k));
        if (kind < KIND_BYTES || kind > KIND_INT64) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "feature kinds must be 1, 2 or 3");
            return -1;
        }
        cols[k].kind = (int)kind;
        if (kind == KIND_BYTES && (cols[k].strings = PyList_New(0)) == NULL)
            return -1;
    }
    return 0;
}

static PyObject *build_result(column_t *cols, Py_ssize_t ncols)
{
    PyObject *result = PyList_New(ncols);
    if (result == NULL)
        return NULL;
    for (Py_ssize_t k = 0; k < ncols; k++) {
        PyObject *values;
        if (cols[k].kind == KIND_BYTES) {
            values = cols[k].strings;
            Py_INCREF(values);
        } else {
            values = PyByteArray_FromStringAndSize(cols[k].values.data,
                                                   (Py_ssize_t)cols[k].values.len);
        }
        PyObject *counts = PyByteArray_FromStringAndSize(cols[k].counts.data,
                                                         (Py_ssize_t)cols[k].counts.len);
        PyObject *pair = (values && counts) ? PyTuple_Pack(2, values, counts) : NULL;
        Py_XDECREF(values);
        Py_XDECREF(counts);
        if (pair == NULL) {
            Py_DECREF(result);
            return NULL;
        }
        PyList_SET_ITEM(result, k, pair);
    }
    return result;
}

static PyObject *py_parse_example_columns(PyObject *self, PyObject *args)
{
    PyObject *records_arg, *keys_arg, *kinds_arg;
    if (!PyArg_ParseTuple(args, "OOO:parse_example_columns", &records_arg, &keys_arg, &kinds_arg))
        return NULL;
    PyObject *records = PySequence_Fast(records_arg, "records must be a sequence of bytes");
    PyObject *keys = PySequence_Fast(keys_arg, "keys must be a sequence of bytes");
    PyObject *kinds = PySequence_Fast(kinds_arg, "kinds must be a sequence of ints");
    PyObject *result = NULL;
    column_t *cols = NULL;
    int64_t *found = NULL;
    growbuf_t entries = {NULL, 0, 0};
    Py_ssize_t ncols = 0;
    if (records == NULL || keys == NULL || kinds == NULL)
        goto done;
    ncols = PySequence_Fast_GET_SIZE(keys);
    if (PySequence_Fast_GET_SIZE(kinds) != ncols) {
        PyErr_SetString(PyExc_ValueError, "keys and kinds differ in length");
        goto done;
    }
    cols = PyMem_Calloc((size_t)ncols + 1, sizeof(column_t));
    found = PyMem_Calloc((size_t)ncols + 1, sizeof(int64_t));
    if (cols == NULL || found == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (init_columns(cols, keys, kinds, ncols) < 0)
        goto done;
    const Py_ssize_t nrecords = PySequence_Fast_GET_SIZE(records);
    for (Py_ssize_t r = 0; r < nrecords; r++) {
        PyObject *record = PySequence_Fast_GET_ITEM(records, r);
        int failed;
        if (PyBytes_Check(record)) {
            failed = scan_record((const uint8_t *)PyBytes_AS_STRING(record),
                                 PyBytes_GET_SIZE(record), r, cols, ncols, &entries, found);
        } else { /* bytearray, memoryview, ...: same bytes, through the buffer protocol */
            Py_buffer view;
            if (PyObject_GetBuffer(record, &view, PyBUF_SIMPLE) < 0)
                goto done;
            failed = scan_record(view.buf, view.len, r, cols, ncols, &entries, found);
            PyBuffer_Release(&view);
        }
        if (failed < 0)
            goto done;
    }
    result = build_result(cols, ncols);
done:
    if (cols != NULL)
        free_columns(cols, ncols);
    PyMem_Free(found);
    PyMem_Free(entries.data);
    Py_XDECREF(records);
    Py_XDECREF(keys);
    Py_XDECREF(kinds);
    return result;
}

/* decode_features(buf, map_field): every feature of one Example (or a SequenceExample's
 * context), as _example_wire.decode_features returns it: {key: (kind, values)}, values a
 * list of bytes (bytes_list) or the raw little-endian float32 / int64 (a bytearray).
 * Every entry is decoded in order, and a later entry of a key replaces an earlier one
 * at the end of the order. A malformed record raises ParseFailure with its byte. */
static PyObject *py_decode_features(PyObject *self, PyObject *args)
{
    Py_buffer data;
    unsigned long long map_field;
    if (!PyArg_ParseTuple(args, "y*K:decode_features", &data, &map_field))
        return NULL;
    wire_t w = {(const uint8_t *)data.buf, 0};
    growbuf_t entries = {NULL, 0, 0};
    PyObject *decoded = NULL, *result = NULL;
    int status = collect_entries(&w, data.len, &entries, (uint64_t)map_field);
    if (status == -1)
        raise_failure(FAILURE_MALFORMED, 0, -1, w.error_position, KIND_NONE);
    if (status < 0 || (decoded = PyDict_New()) == NULL)
        goto done;
    const entry_t *list = (const entry_t *)entries.data;
    const Py_ssize_t count = (Py_ssize_t)(entries.len / sizeof(entry_t));
    for (Py_ssize_t i = 0; i < count; i++) {
        const entry_t *entry = &list[i];
        int kind;
        Py_ssize_t list_start, list_end;
        if (feature_kind(&w, entry->value_start, entry->value_end, &kind, &list_start,
                         &list_end) < 0) {
            raise_failure(FAILURE_MALFORMED, 0, -1, w.error_position, KIND_NONE);
            goto done;
        }
        column_t col = {NULL, 0, kind, {NULL, 0, 0}, NULL, {NULL, 0, 0}};
        PyObject *values = NULL;
        if (kind == KIND_BYTES && (col.strings = PyList_New(0)) == NULL)
            goto done;
        Py_ssize_t appended = 0;
        if (kind != KIND_NONE) {
            appended = append_list_values(&w, &col, list_start, list_end);
            if (appended == -1)
                raise_failure(FAILURE_MALFORMED, 0, -1, w.error_position, KIND_NONE);
        }
        if (appended >= 0) {
            if (kind == KIND_BYTES) {
                values = col.strings;
                col.strings = NULL;
            } else {
                values = PyByteArray_FromStringAndSize(col.values.data,
                                                       (Py_ssize_t)col.values.len);
            }
        }
        PyMem_Free(col.values.data);
        Py_XDECREF(col.strings);
        PyObject *key = values == NULL ? NULL
            : PyBytes_FromStringAndSize((const char *)entry->key, entry->key_len);
        PyObject *pair = key == NULL ? NULL : Py_BuildValue("(iN)", kind, values);
        if (pair == NULL) {
            if (key == NULL)
                Py_XDECREF(values);
            Py_XDECREF(key);
            goto done;
        }
        /* the last entry of a key wins and takes its place at the end of the order */
        if ((PyDict_Contains(decoded, key) == 1 && PyDict_DelItem(decoded, key) < 0) ||
            PyDict_SetItem(decoded, key, pair) < 0) {
            Py_DECREF(key);
            Py_DECREF(pair);
            goto done;
        }
        Py_DECREF(key);
        Py_DECREF(pair);
    }
    result = decoded;
    decoded = NULL;
done:
    Py_XDECREF(decoded);
    PyMem_Free(entries.data);
    PyBuffer_Release(&data);
    return result;
}

/* ------------------------------------------------------------------ shuffle */

/* tf.data's fill-then-draw shuffle ring, over int64 indices: before each draw the
 * ring is topped up from `incoming` while it holds fewer than `capacity`; a draw
 * outputs slot (start + draw % held) % capacity and moves the oldest into it. */
static PyObject *py_shuffle_draw(PyObject *self, PyObject *args)
{
    Py_buffer slots, incoming, draws, out;
    Py_ssize_t capacity, start, end;
    if (!PyArg_ParseTuple(args, "w*nnny*y*w*", &slots, &capacity, &start, &end, &incoming,
                          &draws, &out))
        return NULL;
    PyObject *result = NULL;
    int64_t *ring = (int64_t *)slots.buf;
    const int64_t *in = (const int64_t *)incoming.buf;
    const uint64_t *draw = (const uint64_t *)draws.buf;
    int64_t *output = (int64_t *)out.buf;
    Py_ssize_t ring_len = slots.len / 8, in_len = incoming.len / 8;
    Py_ssize_t count = out.len / 8;
    if (draws.len / 8 < count || capacity <= 0 || start < 0 || end < start) {
        PyErr_SetString(PyExc_ValueError, "shuffle_draw: inconsistent arguments");
        goto done;
    }
    Py_ssize_t used_in = 0, produced = 0;
    while (produced < count) {
        if (end - start < capacity && used_in < in_len) {
            Py_ssize_t slot = end % capacity;
            if (slot >= ring_len) {
                PyErr_SetString(PyExc_ValueError, "shuffle_draw: ring smaller than capacity");
                goto done;
            }
            ring[slot] = in[used_in++];
            end++;
        }
        if (end == start)
            break;
        Py_ssize_t held = end - start;
        Py_ssize_t first = start % capacity;
        Py_ssize_t slot = (Py_ssize_t)((start + (Py_ssize_t)(draw[produced] % (uint64_t)held)) %
                                       capacity);
        if (slot >= ring_len || first >= ring_len) {
            PyErr_SetString(PyExc_ValueError, "shuffle_draw: ring smaller than its contents");
            goto done;
        }
        output[produced++] = ring[slot];
        ring[slot] = ring[first];
        start++;
    }
    result = Py_BuildValue("nnnn", produced, start, end, used_in);
done:
    PyBuffer_Release(&slots);
    PyBuffer_Release(&incoming);
    PyBuffer_Release(&draws);
    PyBuffer_Release(&out);
    return result;
}

/* ------------------------------------------------------------------ module */

/* ------------------------------------------------------------------ bytes columns */
/*
 * A column of bytes objects (an object array of records, ids, JPEGs) as one buffer plus
 * int64 offsets, and back: what worker processes send instead of pickling each object,
 * and what sizeof uses to cost such a column. Twins: headrace/io/columns.py.
 */

/* The sum of a list's items' lengths; -1 if an item is not exactly bytes; -2 (with an
 * exception set) if it is not a list */
static Py_ssize_t exact_bytes_total(PyObject *list, const char *who)
{
    if (!PyList_Check(list)) {
        PyErr_Format(PyExc_TypeError, "%s expects a list", who);
        return -2;
    }
    const Py_ssize_t count = PyList_GET_SIZE(list);
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyList_GET_ITEM(list, i);
        if (!PyBytes_CheckExact(item))
            return -1;
        total += PyBytes_GET_SIZE(item);
    }
    return total;
}

/* bytes_total(list) -> the sum of the items' lengths, or -1 if an item is not exactly bytes */
static PyObject *py_bytes_total(PyObject *self, PyObject *arg)
{
    const Py_ssize_t total = exact_bytes_total(arg, "bytes_total");
    return total == -2 ? NULL : PyLong_FromSsize_t(total);
}

/* lengths(list) -> bytes: each item's length (exactly bytes: TypeError otherwise) as native
 * int64, a record batch's lengths for an origin log without a Python int per record */
static PyObject *py_lengths(PyObject *self, PyObject *arg)
{
    if (!PyList_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "lengths expects a list");
        return NULL;
    }
    const Py_ssize_t count = PyList_GET_SIZE(arg);
    PyObject *out = PyBytes_FromStringAndSize(NULL, count * (Py_ssize_t)sizeof(int64_t));
    if (out == NULL)
        return NULL;
    int64_t *lengths = (int64_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyList_GET_ITEM(arg, i);
        if (!PyBytes_CheckExact(item)) {
            Py_DECREF(out);
            PyErr_Format(PyExc_TypeError, "lengths: item %zd is not bytes", i);
            return NULL;
        }
        lengths[i] = PyBytes_GET_SIZE(item);
    }
    return out;
}

/* join_bytes(list) -> (data, offsets) with offsets count+1 native int64, or None if an item
 * is not exactly bytes */
static PyObject *py_join_bytes(PyObject *self, PyObject *arg)
{
    const Py_ssize_t total = exact_bytes_total(arg, "join_bytes");
    if (total == -2)
        return NULL;
    if (total == -1)
        Py_RETURN_NONE;
    const Py_ssize_t count = PyList_GET_SIZE(arg);
    PyObject *data = PyBytes_FromStringAndSize(NULL, total);
    if (data == NULL)
        return NULL;
    PyObject *offsets = PyBytes_FromStringAndSize(NULL, (count + 1) * (Py_ssize_t)sizeof(int64_t));
    if (offsets == NULL) {
        Py_DECREF(data);
        return NULL;
    }
    char *out = PyBytes_AS_STRING(data);
    int64_t *ends = (int64_t *)PyBytes_AS_STRING(offsets);
    int64_t at = 0;
    ends[0] = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyList_GET_ITEM(arg, i);  /* the list is ours: no item changed */
        const Py_ssize_t length = PyBytes_GET_SIZE(item);
        memcpy(out + at, PyBytes_AS_STRING(item), (size_t)length);
        at += length;
        ends[i + 1] = at;
    }
    PyObject *pair = PyTuple_Pack(2, data, offsets);
    Py_DECREF(data);
    Py_DECREF(offsets);
    return pair;
}

/* split_bytes(data, offsets) -> list of bytes: data[offsets[i]:offsets[i+1]] each; the
 * offsets (native int64) must start at 0, never decrease and end within data */
static PyObject *py_split_bytes(PyObject *self, PyObject *args)
{
    Py_buffer data, offsets;
    if (!PyArg_ParseTuple(args, "y*y*", &data, &offsets))
        return NULL;
    PyObject *out = NULL;
    if (offsets.len % (Py_ssize_t)sizeof(int64_t) || offsets.len == 0) {
        PyErr_SetString(PyExc_ValueError, "split_bytes: offsets is not a non-empty int64 array");
        goto done;
    }
    const Py_ssize_t count = offsets.len / (Py_ssize_t)sizeof(int64_t) - 1;
    int64_t previous = 0;
    const char *ends = (const char *)offsets.buf;
    int64_t first;
    memcpy(&first, ends, sizeof first);
    if (first != 0) {
        PyErr_SetString(PyExc_ValueError, "split_bytes: offsets do not start at 0");
        goto done;
    }
    out = PyList_New(count);
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < count; i++) {
        int64_t end;
        memcpy(&end, ends + (i + 1) * (Py_ssize_t)sizeof(int64_t), sizeof end);
        if (end < previous || end > (int64_t)data.len) {
            PyErr_Format(PyExc_ValueError,
                         "split_bytes: offset %zd (%lld) is out of order or past the data "
                         "(%zd bytes)", i + 1, (long long)end, data.len);
            Py_CLEAR(out);
            goto done;
        }
        PyObject *item = PyBytes_FromStringAndSize((const char *)data.buf + previous,
                                                   (Py_ssize_t)(end - previous));
        if (item == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, item);
        previous = end;
    }
done:
    PyBuffer_Release(&data);
    PyBuffer_Release(&offsets);
    return out;
}

static PyMethodDef methods[] = {
    {"crc32c", py_crc32c, METH_VARARGS, "crc32c(data, crc=0) -> int: CRC32C, continuing crc."},
    {"check_alike", py_check_alike, METH_VARARGS,
     "check_alike(buf, rows, size, head, footers) -> int: first unsound record or -1."},
    {"crc32c_using", py_crc32c_using, METH_VARARGS,
     "crc32c_using(backend, data, crc=0) -> int: crc32c() by one named backend (tests)."},
    {"scan_records", py_scan_records, METH_VARARGS,
     "scan_records(buf, pos, max_records, max_bytes, verify_crc, max_record_bytes)"
     " -> (records, pos, status, detail)"},
    {"frame_records", py_frame_records, METH_O, "frame_records(records) -> bytes (TFRecord)."},
    {"parse_example_columns", py_parse_example_columns, METH_VARARGS,
     "parse_example_columns(records, keys, kinds) -> [(values, counts)]"},
    {"decode_features", py_decode_features, METH_VARARGS,
     "decode_features(buf, map_field) -> {key: (kind, values)} (every feature of a record)"},
    {"shuffle_draw", py_shuffle_draw, METH_VARARGS,
     "shuffle_draw(ring, capacity, start, end, incoming, draws, out)"
     " -> (produced, start, end, used_incoming)"},
    {"bytes_total", py_bytes_total, METH_O,
     "bytes_total(list) -> sum of lengths, or -1 if an item is not exactly bytes"},
    {"lengths", py_lengths, METH_O,
     "lengths(list of bytes) -> bytes of the items' lengths as native int64"},
    {"join_bytes", py_join_bytes, METH_O,
     "join_bytes(list) -> (data, int64 offsets), or None if an item is not exactly bytes"},
    {"split_bytes", py_split_bytes, METH_VARARGS,
     "split_bytes(data, offsets) -> list of bytes between consecutive int64 offsets"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_hrio", "headrace's C hot loops for TFRecord and Example.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__hrio(void)
{
    init_crc_tables();
#ifdef HRIO_HAVE_SSE42
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2")) {
        crc_zeros_tables(crc_long_shift, CRC_LONG);
        crc_zeros_tables(crc_short_shift, CRC_SHORT);
        crc32c_impl = crc32c_sse42;
#ifdef HRIO_HAVE_VPCLMUL
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
            __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("pclmul")) {
            fold_constants(fold_256, 256);
            fold_constants(fold_64, 64);
            fold_constants(fold_48, 48);
            fold_constants(fold_32, 32);
            fold_constants(fold_16, 16);
            crc32c_impl = crc32c_vpclmul;
        }
#endif
    }
#endif
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    ParseFailure = PyErr_NewException("headrace.io._hrio.ParseFailure", PyExc_ValueError, NULL);
    if (ParseFailure == NULL || PyModule_AddObject(m, "ParseFailure", ParseFailure) < 0) {
        Py_XDECREF(ParseFailure);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(ParseFailure);
    PyObject *backend = PyUnicode_FromString(crc32c_backend_name(crc32c_impl));
    if (backend == NULL || PyModule_AddObject(m, "crc32c_backend", backend) < 0) {
        Py_XDECREF(backend);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
