/* Strict scan of a block of flat JSONL lines into typed columns, without the GIL.
 *
 * The reference reading is Python's `json.loads(line)` followed by kvtune's `as_int`, `as_float`,
 * `as_str`, `as_bool` on top-level keys. This scanner accepts only what it reads exactly like
 * that; anything else makes the whole block "not clean" (None), and the caller reads the block
 * the Python way, which reports every bad line. Saying "not clean" too often costs speed only.
 *
 * Every line ends in '\n' (the last lines of the block are scanned from a copy that adds it, and
 * STRIDE bytes of padding), so '\n' is a sentinel: it is invalid everywhere inside a line (JSON
 * whitespace here is only space, tab and CR), and the parser never reads past it, needing no
 * bounds checks, except scan_string's wide loads, which the padding covers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>
#include <locale.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h> /* getentropy: glibc 2.25, macOS 10.12 */
#ifdef __APPLE__
#include <xlocale.h>
#endif

enum { KIND_INT, KIND_FLOAT, KIND_LABEL, KIND_BOOL };
enum { CLEAN, NOT_CLEAN, NO_MEMORY };

#define MAX_KEYS 64        /* one bit each in a record's "seen" mask */
#define MAX_DEPTH 64       /* Python allows ~1000 (its recursion limit); deeper is not clean */
#define MAX_NUMBER_LEN 100 /* longer number tokens are not clean (Python caps ints at 4300 digits) */
#define MAX_INT_DIGITS 18  /* always fits int64 */

static const Py_ssize_t ITEM_SIZE[] = {8, 8, 4, 1};

/* Distinct label texts in first-seen order (code = index), found by open addressing. */
typedef struct {
    const char *text;
    Py_ssize_t len;
    uint64_t hash;
} Label;

typedef struct {
    Label *labels;
    size_t count, capacity;
    int32_t *slots; /* code + 1; 0 is empty */
    size_t nslots;  /* a power of two, at least twice count */
    uint64_t key[2]; /* the scan's secret hash key: label texts cannot be chosen to collide */
} Vocab;

typedef struct {
    const char *name;
    Py_ssize_t len;
    int kind;
    int plain; /* dig() treats an absent plain key as None; others it would look up nested */
    char *values;
    char *valid;
    Py_ssize_t invalid;
    int touched; /* the key was in some record: rows before it are zeroed, every row after written */
    Vocab vocab;
} Column;

typedef struct {
    Column cols[MAX_KEYS];
    int ncols;
    int repeated_keys; /* the same key twice in the request: every column is compared */
    int64_t *record_lines;
    Py_ssize_t row, line;
    locale_t c_locale;
} Scan;

/* ---- JSON grammar: each function returns the end of what it read, or NULL if not clean ---- */

static inline const char *skip_ws(const char *p)
{
    if ((unsigned char)*p > ' ') /* the common case: compact JSON */
        return p;
    while (*p == ' ' || *p == '\t' || *p == '\r')
        p++;
    return p;
}

static inline int is_digit(char c) { return c >= '0' && c <= '9'; }

static inline int is_hex(char c)
{
    return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

/* One UTF-8 sequence starting with a byte >= 0x80, strictly (no overlongs, surrogates, > U+10FFFF):
 * Python decodes with "surrogatepass", so encoded surrogates would be read; we refuse them. */
static const char *skip_utf8(const char *s)
{
    const unsigned char *p = (const unsigned char *)s;
    unsigned char lo = 0x80, hi = 0xBF;
    int n;
    if (p[0] >= 0xC2 && p[0] <= 0xDF)
        n = 1;
    else if (p[0] >= 0xE0 && p[0] <= 0xEF) {
        n = 2;
        lo = p[0] == 0xE0 ? 0xA0 : 0x80;
        hi = p[0] == 0xED ? 0x9F : 0xBF;
    }
    else if (p[0] >= 0xF0 && p[0] <= 0xF4) {
        n = 3;
        lo = p[0] == 0xF0 ? 0x90 : 0x80;
        hi = p[0] == 0xF4 ? 0x8F : 0xBF;
    }
    else
        return NULL;
    if (p[1] < lo || p[1] > hi)
        return NULL;
    for (int i = 2; i <= n; i++)
        if ((p[i] & 0xC0) != 0x80)
            return NULL;
    return s + n + 1;
}

/* An escape after the backslash at p: Python accepts any four hex digits, lone surrogates too. */
static const char *skip_escape(const char *p)
{
    switch (p[1]) {
    case '"': case '\\': case '/': case 'b': case 'f': case 'n': case 'r': case 't':
        return p + 2;
    case 'u':
        for (int i = 2; i < 6; i++)
            if (!is_hex(p[i]))
                return NULL;
        return p + 6;
    default:
        return NULL;
    }
}

/* first_special(p): the index of the first of the STRIDE bytes at p that a string cannot hold as
 * they are ('"', '\\', control bytes, non-ASCII), or STRIDE when there is none. */
#if defined(__SSE2__) && defined(__GNUC__) && !defined(FLATSCAN_PORTABLE)
#include <emmintrin.h>
#define STRIDE 16

static inline int first_special(const char *p)
{
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    __m128i quote = _mm_cmpeq_epi8(v, _mm_set1_epi8('"')), backslash = _mm_cmpeq_epi8(v, _mm_set1_epi8('\\'));
    __m128i other = _mm_cmplt_epi8(v, _mm_set1_epi8(0x20)); /* signed: non-ASCII bytes are negative */
    unsigned marks = (unsigned)_mm_movemask_epi8(_mm_or_si128(_mm_or_si128(quote, backslash), other));
    return marks ? __builtin_ctz(marks) : STRIDE;
}
#else
#define STRIDE 8

static inline int first_special(const char *p)
{
    /* bit 7 of each byte that may need a look ("has zero byte" tricks: exact up to the first one) */
    const uint64_t ones = 0x0101010101010101ULL;
    uint64_t w, quote, backslash, marks;
    memcpy(&w, p, sizeof w);
    quote = w ^ (ones * '"');
    backslash = w ^ (ones * '\\');
    marks = ((quote - ones) & ~quote) | ((backslash - ones) & ~backslash) | ((w - ones * 0x20) & ~w) | w;
    if ((marks & (ones * 0x80)) == 0)
        return STRIDE;
#if defined(__GNUC__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    return __builtin_ctzll(marks & (ones * 0x80)) / 8;
#else
    int i = 0;
    while ((unsigned char)p[i] >= 0x20 && (unsigned char)p[i] < 0x80 && p[i] != '"' && p[i] != '\\')
        i++;
    return i;
#endif
}
#endif

/* The rest of a string after its opening quote; *escaped tells whether it held a backslash.
 * Reads STRIDE bytes at a time, up to STRIDE - 1 past the line's end (the block is cut so that
 * it can). */
static const char *scan_string(const char *p, int *escaped)
{
    *escaped = 0;
    for (;;) {
        int i = first_special(p);
        p += i;
        if (i == STRIDE)
            continue;
        if (*p == '"')
            return p + 1;
        if (*p == '\\') {
            *escaped = 1;
            p = skip_escape(p);
        }
        else if ((unsigned char)*p >= 0x80)
            p = skip_utf8(p);
        else
            return NULL; /* control byte, '\n' sentinel included */
        if (p == NULL)
            return NULL;
    }
}

/* A number by the strict grammar -?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?; NaN/Infinity are not clean. */
static const char *scan_number(const char *p, int *is_int)
{
    const char *start = p;
    *is_int = 1;
    if (*p == '-')
        p++;
    if (*p == '0')
        p++;
    else if (is_digit(*p))
        while (is_digit(*p))
            p++;
    else
        return NULL;
    if (*p == '.') {
        *is_int = 0;
        if (!is_digit(*++p))
            return NULL;
        while (is_digit(*p))
            p++;
    }
    if (*p == 'e' || *p == 'E') {
        *is_int = 0;
        p++;
        if (*p == '+' || *p == '-')
            p++;
        if (!is_digit(*p))
            return NULL;
        while (is_digit(*p))
            p++;
    }
    return p - start > MAX_NUMBER_LEN ? NULL : p;
}

/* A literal; byte by byte so that the sentinel stops the comparison. */
static const char *match_word(const char *p, const char *word)
{
    for (; *word; p++, word++)
        if (*p != *word)
            return NULL;
    return p;
}

static const char *skip_value(const char *p, int depth);

static const char *skip_object(const char *p, int depth)
{
    int escaped;
    if (depth > MAX_DEPTH)
        return NULL;
    p = skip_ws(p);
    if (*p == '}')
        return p + 1;
    for (;;) {
        if (*p != '"' || !(p = scan_string(p + 1, &escaped)))
            return NULL;
        p = skip_ws(p);
        if (*p != ':' || !(p = skip_value(skip_ws(p + 1), depth)))
            return NULL;
        p = skip_ws(p);
        if (*p == '}')
            return p + 1;
        if (*p != ',')
            return NULL;
        p = skip_ws(p + 1);
    }
}

static const char *skip_array(const char *p, int depth)
{
    if (depth > MAX_DEPTH)
        return NULL;
    p = skip_ws(p);
    if (*p == ']')
        return p + 1;
    for (;;) {
        if (!(p = skip_value(p, depth)))
            return NULL;
        p = skip_ws(p);
        if (*p == ']')
            return p + 1;
        if (*p != ',')
            return NULL;
        p = skip_ws(p + 1);
    }
}

/* Any JSON value, validated and thrown away; depth counts the containers around it. */
static const char *skip_value(const char *p, int depth)
{
    int flag;
    switch (*p) {
    case '"': return scan_string(p + 1, &flag);
    case '{': return skip_object(p + 1, depth + 1);
    case '[': return skip_array(p + 1, depth + 1);
    case 't': return match_word(p, "true");
    case 'f': return match_word(p, "false");
    case 'n': return match_word(p, "null");
    default: return scan_number(p, &flag);
    }
}

/* ---- values ---- */

static const double POW10[] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,  1e8,  1e9,  1e10, 1e11,
                               1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

/* Clinger's fast path: with at most 15 significant digits and |power of ten| <= 22 both operands
 * are exact doubles, so one multiplication or division is the correctly rounded result. */
static int fast_double(const char *p, const char *end, double *out)
{
    uint64_t mantissa = 0;
    int digits = 0, fraction = 0, in_fraction = 0, exponent = 0, negative = *p == '-';
    if (FLT_EVAL_METHOD != 0) /* x87 extended precision would round twice */
        return 0;
    for (p += negative; p < end && *p != 'e' && *p != 'E'; p++) {
        if (*p == '.') {
            in_fraction = 1;
            continue;
        }
        if ((mantissa != 0 || *p != '0') && ++digits > 15)
            return 0;
        mantissa = mantissa * 10 + (uint64_t)(*p - '0');
        fraction += in_fraction;
    }
    if (p < end) {
        int sign = p[1] == '-' ? -1 : 1;
        for (p += 1 + (p[1] == '-' || p[1] == '+'); p < end; p++)
            if ((exponent = exponent * 10 + (*p - '0')) > 1000)
                return 0;
        exponent *= sign;
    }
    exponent -= fraction;
    if (exponent < -22 || exponent > 22)
        return 0;
    double v = exponent >= 0 ? (double)mantissa * POW10[exponent] : (double)mantissa / POW10[-exponent];
    *out = negative ? -v : v;
    return 1;
}

/* What Python gives for a number token: float(int(text)) or float(text), both correctly rounded
 * like strtod_l in the "C" locale; only the integer -0 differs, float(0) being +0.0. */
static double number_value(const char *p, const char *end, int is_int, locale_t c_locale)
{
    char text[MAX_NUMBER_LEN + 1];
    double v;
    if (!fast_double(p, end, &v)) {
        memcpy(text, p, (size_t)(end - p));
        text[end - p] = '\0';
        v = strtod_l(text, NULL, c_locale);
    }
    return is_int && v == 0 ? 0.0 : v;
}

/* Short texts (keys, labels) compare faster inline, by words, than through a memcmp call. */
static inline int same_text(const char *a, const char *b, Py_ssize_t len)
{
    uint64_t x, y;
    if (len < 8) {
        for (Py_ssize_t i = 0; i < len; i++)
            if (a[i] != b[i])
                return 0;
        return 1;
    }
    for (Py_ssize_t i = 0; i < len - 8; i += 8) {
        memcpy(&x, a + i, sizeof x);
        memcpy(&y, b + i, sizeof y);
        if (x != y)
            return 0;
    }
    memcpy(&x, a + len - 8, sizeof x); /* the last 8 bytes, overlapping the previous word */
    memcpy(&y, b + len - 8, sizeof y);
    return x == y;
}

/* SipHash-1-3 (Aumasson and Bernstein; the variant CPython hashes str with) under a key drawn
 * per scan. The labels are the log's route/model/url values, which whoever sends requests can
 * choose: the earlier unkeyed multiply-xor hash collided on all 64 bits for 16-byte labels by
 * construction (the second word cancels the first), and 40,000 such labels took 3.5 s instead of
 * 8 ms, quadratic in their count. Words are read in host order: the hashes never leave the scan. */
#define ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND                                                                                  \
    do {                                                                                          \
        v0 += v1, v1 = ROTL(v1, 13), v1 ^= v0, v0 = ROTL(v0, 32);                                 \
        v2 += v3, v3 = ROTL(v3, 16), v3 ^= v2;                                                    \
        v0 += v3, v3 = ROTL(v3, 21), v3 ^= v0;                                                    \
        v2 += v1, v1 = ROTL(v1, 17), v1 ^= v2, v2 = ROTL(v2, 32);                                 \
    } while (0)

static uint64_t hash_text(const uint64_t key[2], const char *p, Py_ssize_t len)
{
    uint64_t v0 = key[0] ^ 0x736f6d6570736575ULL, v1 = key[1] ^ 0x646f72616e646f6dULL;
    uint64_t v2 = key[0] ^ 0x6c7967656e657261ULL, v3 = key[1] ^ 0x7465646279746573ULL;
    uint64_t m, last = (uint64_t)len << 56;
    for (; len >= 8; p += 8, len -= 8) {
        memcpy(&m, p, sizeof m);
        v3 ^= m;
        SIPROUND;
        v0 ^= m;
    }
    for (int i = 0; i < len; i++)
        last |= (uint64_t)(unsigned char)p[i] << (8 * i);
    v3 ^= last;
    SIPROUND;
    v0 ^= last;
    v2 ^= 0xff;
    SIPROUND;
    SIPROUND;
    SIPROUND;
    return v0 ^ v1 ^ v2 ^ v3;
}

static int vocab_rehash(Vocab *v, size_t nslots)
{
    int32_t *slots = PyMem_RawCalloc(nslots, sizeof *slots);
    if (slots == NULL)
        return -1;
    for (size_t code = 0; code < v->count; code++) {
        size_t i = v->labels[code].hash & (nslots - 1);
        while (slots[i])
            i = (i + 1) & (nslots - 1);
        slots[i] = (int32_t)code + 1;
    }
    PyMem_RawFree(v->slots);
    v->slots = slots;
    v->nslots = nslots;
    return 0;
}

/* The code of a label, added in first-seen order when new; -1 when out of memory. */
static int32_t vocab_code(Vocab *v, const char *text, Py_ssize_t len)
{
    uint64_t hash = hash_text(v->key, text, len);
    size_t i;
    if (2 * (v->count + 1) > v->nslots && vocab_rehash(v, v->nslots ? 2 * v->nslots : 64) < 0)
        return -1;
    for (i = hash & (v->nslots - 1); v->slots[i]; i = (i + 1) & (v->nslots - 1)) {
        const Label *label = &v->labels[v->slots[i] - 1];
        if (label->hash == hash && label->len == len && same_text(label->text, text, len))
            return v->slots[i] - 1;
    }
    if (v->count == v->capacity) {
        size_t capacity = v->capacity ? 2 * v->capacity : 32;
        Label *labels = capacity < INT32_MAX ? PyMem_RawRealloc(v->labels, capacity * sizeof *labels) : NULL;
        if (labels == NULL)
            return -1;
        v->labels = labels;
        v->capacity = capacity;
    }
    v->labels[v->count] = (Label){text, len, hash};
    v->slots[i] = (int32_t)++v->count;
    return (int32_t)v->count - 1;
}

/* An integer literal; 12.0, 1e3 and 19+ digits are not clean (the reference differs, or int64
 * could overflow). */
static const char *read_int(const char *p, int64_t *out)
{
    int negative = *p == '-';
    const char *digits = p + negative;
    uint64_t v = 0; /* wraps harmlessly on too many digits, refused below */
    for (p = digits; is_digit(*p); p++)
        v = v * 10 + (uint64_t)(*p - '0');
    Py_ssize_t n = p - digits;
    if (n == 0 || n > MAX_INT_DIGITS || (*digits == '0' && n > 1) || *p == '.' || *p == 'e' || *p == 'E')
        return NULL;
    *out = negative ? -(int64_t)v : (int64_t)v;
    return p;
}

static const char *read_float(const char *p, locale_t c_locale, double *out)
{
    int is_int;
    const char *end = scan_number(p, &is_int);
    if (end == NULL)
        return NULL;
    *out = number_value(p, end, is_int, c_locale);
    return isfinite(*out) ? end : NULL; /* as_float refuses 1e400 */
}

static const char *read_bool(const char *p, uint8_t *out)
{
    const char *end;
    if ((end = match_word(p, "true")) || (end = match_word(p, "false")))
        *out = *p == 't';
    return end;
}

/* Only strings without escapes, so that the label is the raw (already valid UTF-8) bytes. */
static int read_label(Vocab *vocab, const char *p, int32_t *out, const char **end)
{
    int escaped;
    if (*p != '"' || !(*end = scan_string(p + 1, &escaped)) || escaped)
        return NOT_CLEAN;
    *out = vocab_code(vocab, p + 1, *end - p - 2);
    return *out < 0 ? NO_MEMORY : CLEAN;
}

static void set_invalid(Column *c, Py_ssize_t row)
{
    memset(c->values + row * ITEM_SIZE[c->kind], 0, (size_t)ITEM_SIZE[c->kind]);
    c->valid[row] = 0;
    c->invalid++;
}

/* A key absent from a record: nothing is written while the key has been in no record at all, so
 * the columns of keys a log never has (most of the native ones, usually) cost no memory traffic. */
static void set_absent(Column *c, Py_ssize_t row)
{
    if (c->touched)
        set_invalid(c, row);
    else
        c->invalid++;
}

/* The first record with the key: the rows before it become invalid zeros. */
static void touch(Column *c, Py_ssize_t row)
{
    memset(c->values, 0, (size_t)(row * ITEM_SIZE[c->kind]));
    memset(c->valid, 0, (size_t)row);
    c->touched = 1;
}

/* An extracted value at p, its end in *end; every as_* reads null and "" as None. */
static int read_value(Scan *s, Column *c, const char *p, const char **end)
{
    Py_ssize_t row = s->row;
    if (!c->touched)
        touch(c, row);
    if ((*end = match_word(p, "null")) || (*end = match_word(p, "\"\""))) {
        set_invalid(c, row);
        return CLEAN;
    }
    c->valid[row] = 1;
    switch (c->kind) {
    case KIND_INT: *end = read_int(p, (int64_t *)c->values + row); break;
    case KIND_FLOAT: *end = read_float(p, s->c_locale, (double *)c->values + row); break;
    case KIND_BOOL: *end = read_bool(p, (uint8_t *)c->values + row); break;
    default: return read_label(&c->vocab, p, (int32_t *)c->values + row, end);
    }
    return *end ? CLEAN : NOT_CLEAN;
}

/* The member at p (after '{' or ','): a wanted key's value is read, any other validated. */
static int scan_member(Scan *s, const char *p, uint64_t *seen, const char **end)
{
    const char *key = p + 1;
    int escaped, status;
    /* an escaped key could decode to a wanted one */
    if (*p != '"' || !(p = scan_string(key, &escaped)) || escaped)
        return NOT_CLEAN;
    Py_ssize_t len = p - 1 - key;
    p = skip_ws(p);
    if (*p != ':')
        return NOT_CLEAN;
    p = skip_ws(p + 1);
    *end = NULL;
    for (int k = 0; k < s->ncols; k++) {
        Column *c = &s->cols[k];
        if (c->len != len || !same_text(c->name, key, len))
            continue;
        if (*seen >> k & 1) /* Python keeps the last one; rare enough to leave to it */
            return NOT_CLEAN;
        *seen |= 1ULL << k;
        if ((status = read_value(s, c, p, end)) != CLEAN)
            return status;
        if (!s->repeated_keys)
            break;
    }
    if (*end == NULL && (*end = skip_value(p, 1)) == NULL)
        return NOT_CLEAN;
    return CLEAN;
}

/* One record line from its start; *next is the start of the following line. */
static int scan_record(Scan *s, const char *p, const char **next)
{
    uint64_t seen = 0;
    int status;
    p = skip_ws(p);
    if (*p != '{')
        return NOT_CLEAN; /* arrays, scalars, a BOM, \v or \f before the object */
    p = skip_ws(p + 1);
    if (*p != '}')
        for (;;) {
            if ((status = scan_member(s, p, &seen, &p)) != CLEAN)
                return status;
            p = skip_ws(p);
            if (*p == '}')
                break;
            if (*p != ',')
                return NOT_CLEAN;
            p = skip_ws(p + 1);
        }
    p = skip_ws(p + 1);
    if (*p != '\n')
        return NOT_CLEAN;
    for (int k = 0; k < s->ncols; k++) {
        if (seen >> k & 1)
            continue;
        if (!s->cols[k].plain)
            return NOT_CLEAN;
        set_absent(&s->cols[k], s->row);
    }
    *next = p + 1;
    return CLEAN;
}

/* Lines in [p, end), each ending in '\n'; a line that bytes.strip() empties is not a record. */
static int scan_lines(Scan *s, const char *p, const char *end)
{
    while (p < end) {
        const char *q = p;
        while (*q == ' ' || *q == '\t' || *q == '\r' || *q == '\v' || *q == '\f')
            q++;
        if (*q == '\n') {
            p = q + 1;
            s->line++;
            continue;
        }
        int status = scan_record(s, p, &p);
        if (status != CLEAN)
            return status;
        s->record_lines[s->row++] = s->line++;
    }
    return CLEAN;
}

/* Where the lines that scan_string may read past the block's end begin: those ending in its last
 * STRIDE bytes, and a last line without '\n'. */
static Py_ssize_t body_end(const char *buf, Py_ssize_t len)
{
    Py_ssize_t cut = len > STRIDE ? len - STRIDE : 0;
    while (cut > 0 && buf[cut - 1] != '\n')
        cut--;
    return cut;
}

/* The body of the block in place, then its tail from a copy that ends in '\n' and STRIDE more bytes.
 * The copy outlives the scan: labels point into it. */
static int scan_all(Scan *s, const char *buf, Py_ssize_t len, char **tail)
{
    Py_ssize_t body = body_end(buf, len), size = len - body;
    int status = scan_lines(s, buf, buf + body);
    if (status != CLEAN || size == 0)
        return status;
    if ((*tail = PyMem_RawCalloc((size_t)size + 1 + STRIDE, 1)) == NULL)
        return NO_MEMORY;
    memcpy(*tail, buf + body, (size_t)size);
    if (buf[len - 1] != '\n')
        (*tail)[size++] = '\n';
    return scan_lines(s, *tail, *tail + size);
}

static Py_ssize_t count_newlines(const char *p, const char *end)
{
    Py_ssize_t n = 0;
    for (; (p = memchr(p, '\n', (size_t)(end - p))) != NULL; p++)
        n++;
    return n;
}

/* ---- the Python side ---- */

static int set_columns(Scan *s, PyObject *keys, const char *kinds, Py_ssize_t nkinds)
{
    Py_ssize_t n = PyTuple_GET_SIZE(keys);
    if (n != nkinds || n > MAX_KEYS) {
        PyErr_Format(PyExc_ValueError, "need one kind per key and at most %d keys", MAX_KEYS);
        return -1;
    }
    s->ncols = (int)n;
    for (Py_ssize_t k = 0; k < n; k++) {
        Column *c = &s->cols[k];
        PyObject *key = PyTuple_GET_ITEM(keys, k);
        if (!PyBytes_Check(key) || (unsigned char)kinds[k] > KIND_BOOL) {
            PyErr_SetString(PyExc_ValueError, "keys must be bytes and kinds 0 to 3");
            return -1;
        }
        c->name = PyBytes_AS_STRING(key);
        c->len = PyBytes_GET_SIZE(key);
        c->kind = kinds[k];
        /* dig() splits on '.', '[' and ']' when the whole key is absent, and "" digs to the record */
        c->plain = c->len > 0;
        for (Py_ssize_t i = 0; i < c->len; i++)
            if (c->name[i] == '.' || c->name[i] == '[' || c->name[i] == ']')
                c->plain = 0;
        for (Py_ssize_t j = 0; j < k; j++)
            if (s->cols[j].len == c->len && memcmp(s->cols[j].name, c->name, (size_t)c->len) == 0)
                s->repeated_keys = 1;
    }
    return 0;
}

/* Output arrays sized for every line being a record; trimmed to the records afterwards. */
static int allocate(Scan *s, Py_ssize_t lines, PyObject **values, PyObject **valid, PyObject **record_lines)
{
    if (!(*record_lines = PyByteArray_FromStringAndSize(NULL, lines * 8)))
        return -1;
    s->record_lines = (int64_t *)PyByteArray_AS_STRING(*record_lines);
    for (int k = 0; k < s->ncols; k++) {
        Column *c = &s->cols[k];
        if (!(values[k] = PyByteArray_FromStringAndSize(NULL, lines * ITEM_SIZE[c->kind])) ||
            !(valid[k] = PyByteArray_FromStringAndSize(NULL, lines)))
            return -1;
        c->values = PyByteArray_AS_STRING(values[k]);
        c->valid = PyByteArray_AS_STRING(valid[k]);
    }
    return 0;
}

static PyObject *vocab_list(const Vocab *v)
{
    PyObject *list = PyList_New((Py_ssize_t)v->count);
    for (size_t i = 0; list != NULL && i < v->count; i++) {
        PyObject *text = PyUnicode_DecodeUTF8(v->labels[i].text, v->labels[i].len, "strict");
        if (text == NULL)
            Py_CLEAR(list);
        else
            PyList_SET_ITEM(list, (Py_ssize_t)i, text);
    }
    return list;
}

/* Trims the arrays to the records; what is all valid, or has no blank lines, becomes None. */
static int trim(PyObject **array, Py_ssize_t size, int keep)
{
    if (keep)
        return PyByteArray_Resize(*array, size);
    Py_SETREF(*array, Py_NewRef(Py_None));
    return 0;
}

/* (rows, lines, record_lines, [values], [valid], [vocab]) with bytearrays the wrapper views. */
static PyObject *build_result(Scan *s, PyObject **values, PyObject **valid, PyObject **record_lines)
{
    Py_ssize_t rows = s->row;
    PyObject *lists[3] = {PyList_New(s->ncols), PyList_New(s->ncols), PyList_New(s->ncols)};
    PyObject *result = NULL;
    if (!lists[0] || !lists[1] || !lists[2] || trim(record_lines, rows * 8, rows != s->line) < 0)
        goto done;
    for (int k = 0; k < s->ncols; k++) {
        Column *c = &s->cols[k];
        /* a key in no record: values and valid both None */
        if (trim(&values[k], rows * ITEM_SIZE[c->kind], c->touched) < 0 ||
            trim(&valid[k], rows, c->touched && c->invalid > 0) < 0)
            goto done;
        PyObject *vocab = c->kind == KIND_LABEL ? vocab_list(&c->vocab) : Py_NewRef(Py_None);
        if (vocab == NULL)
            goto done;
        PyList_SET_ITEM(lists[0], k, Py_NewRef(values[k]));
        PyList_SET_ITEM(lists[1], k, Py_NewRef(valid[k]));
        PyList_SET_ITEM(lists[2], k, vocab);
    }
    result = Py_BuildValue("nnOOOO", rows, s->line, *record_lines, lists[0], lists[1], lists[2]);
done:
    for (int i = 0; i < 3; i++)
        Py_XDECREF(lists[i]);
    return result;
}

PyDoc_STRVAR(scan_block_doc,
"scan_block(block, keys, kinds) -> (rows, lines, record_lines, values, valid, vocabs) or None\n\n"
"Reads top-level `keys` (a tuple of UTF-8 bytes) of every JSON line of `block` as `kinds`\n"
"(bytes: 0 int64, 1 float64, 2 label int32 codes, 3 bool) into bytearrays, without the GIL.\n"
"None when any record is not read exactly as json.loads and kvtune's as_* would read it.\n"
"The block must not change during the call.");

static PyObject *scan_block(PyObject *module, PyObject *args)
{
    Py_buffer view;
    PyObject *keys, *result = NULL, *record_lines = NULL;
    PyObject *values[MAX_KEYS] = {NULL}, *valid[MAX_KEYS] = {NULL};
    const char *kinds;
    Py_ssize_t nkinds, lines;
    Scan s = {0};
    uint64_t hash_key[2];
    char *tail = NULL;
    int status;
    (void)module;

    if (!PyArg_ParseTuple(args, "y*O!y#:scan_block", &view, &PyTuple_Type, &keys, &kinds, &nkinds))
        return NULL;
    const char *buf = view.buf;
    if (set_columns(&s, keys, kinds, nkinds) < 0)
        goto done;
    if (getentropy(hash_key, sizeof hash_key) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    for (int k = 0; k < s.ncols; k++)
        memcpy(s.cols[k].vocab.key, hash_key, sizeof hash_key);
    Py_BEGIN_ALLOW_THREADS
    lines = count_newlines(buf, buf + view.len) + (view.len > 0 && buf[view.len - 1] != '\n');
    Py_END_ALLOW_THREADS
    if (allocate(&s, lines, values, valid, &record_lines) < 0)
        goto done;
    if ((s.c_locale = newlocale(LC_ALL_MASK, "C", (locale_t)0)) == (locale_t)0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    status = scan_all(&s, buf, view.len, &tail);
    Py_END_ALLOW_THREADS
    if (status == NO_MEMORY)
        PyErr_NoMemory();
    else if (status == NOT_CLEAN)
        result = Py_NewRef(Py_None);
    else
        result = build_result(&s, values, valid, &record_lines);
done:
    if (s.c_locale)
        freelocale(s.c_locale);
    for (int k = 0; k < s.ncols; k++) {
        Py_XDECREF(values[k]);
        Py_XDECREF(valid[k]);
        PyMem_RawFree(s.cols[k].vocab.labels);
        PyMem_RawFree(s.cols[k].vocab.slots);
    }
    Py_XDECREF(record_lines);
    PyMem_RawFree(tail);
    PyBuffer_Release(&view);
    return result;
}

/* ---------------------------------------------------------------------------------------------
 * Dense counting for kvtune.profile.counting: counts[row·stride + value (+ half where cut)] += 1
 * over a batch, in one pass and without the GIL, so a profile's counting runs beside the reader
 * thread's decoding instead of taking turns with it. numpy needs two passes and a temporary
 * (the key array, then np.add.at, which holds the GIL) for the same counts.
 */

static int int64_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (view->itemsize != 8 || view->format == NULL || (strcmp(view->format, "q") != 0 &&
                                                        strcmp(view->format, "l") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a contiguous int64 buffer", what);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(add_counts_doc,
"add_counts(counts, rows, stride, values, cut, half) -> None\n\n"
"counts[rows[i]*stride + values[i] + (half if cut[i] else 0)] += 1 for every i, without the GIL.\n"
"counts, rows, values: contiguous int64 buffers (counts writable); cut: a bool buffer or None.\n"
"A key outside counts raises ValueError (the rows before it are counted: a caller's bug).");

static PyObject *add_counts(PyObject *module, PyObject *args)
{
    PyObject *counts_obj, *rows_obj, *values_obj, *cut_obj;
    long long stride, half;
    Py_buffer counts = {0}, rows = {0}, values = {0}, cut = {0};
    PyObject *result = NULL;
    int bad = 0;
    (void)module;

    if (!PyArg_ParseTuple(args, "OOLOOL:add_counts", &counts_obj, &rows_obj, &stride, &values_obj, &cut_obj, &half))
        return NULL;
    if (int64_buffer(counts_obj, &counts, 1, "counts") < 0)
        return NULL;
    if (int64_buffer(rows_obj, &rows, 0, "rows") < 0)
        goto done;
    if (int64_buffer(values_obj, &values, 0, "values") < 0)
        goto done;
    if (cut_obj != Py_None && PyObject_GetBuffer(cut_obj, &cut, PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    Py_ssize_t n = rows.len / 8, size = counts.len / 8;
    if (values.len / 8 != n || (cut.buf != NULL && cut.len != n)) {
        PyErr_SetString(PyExc_ValueError, "rows, values and cut must have one entry per row");
        goto done;
    }
    const int64_t *r = rows.buf, *v = values.buf;
    const unsigned char *c = cut.buf;
    int64_t *out = counts.buf;
    Py_BEGIN_ALLOW_THREADS
    /* one pass: a key outside counts stops the count there (a caller's bug, as np.add.at's
       IndexError is; the branch is never taken, so it costs next to nothing) */
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t key = (uint64_t)(r[i] * stride + v[i] + (c != NULL && c[i] ? half : 0));
        if (key >= (uint64_t)size) {
            bad = 1;
            break;
        }
        out[key]++;
    }
    Py_END_ALLOW_THREADS
    if (bad)
        PyErr_SetString(PyExc_ValueError, "add_counts: a key falls outside counts");
    else
        result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&counts);
    if (rows.buf) PyBuffer_Release(&rows);
    if (values.buf) PyBuffer_Release(&values);
    if (cut.buf) PyBuffer_Release(&cut);
    return result;
}

PyDoc_STRVAR(add_pair_counts_doc,
"add_pair_counts(counts, rows, stride, first, second, table, scale) -> None\n\n"
"counts[rows[i]*stride + table[first[i]]*scale + table[second[i]]] += 1 for every i, without\n"
"the GIL (the joint histogram's cells: table maps a count to its bin, int32). first and second\n"
"must index table; a value outside it or a key outside counts raises ValueError.");

static PyObject *add_pair_counts(PyObject *module, PyObject *args)
{
    PyObject *counts_obj, *rows_obj, *first_obj, *second_obj, *table_obj;
    long long stride, scale;
    Py_buffer counts = {0}, rows = {0}, first = {0}, second = {0}, table = {0};
    PyObject *result = NULL;
    int bad = 0;
    (void)module;

    if (!PyArg_ParseTuple(args, "OOLOOOL:add_pair_counts", &counts_obj, &rows_obj, &stride, &first_obj, &second_obj,
                          &table_obj, &scale))
        return NULL;
    if (int64_buffer(counts_obj, &counts, 1, "counts") < 0)
        return NULL;
    if (int64_buffer(rows_obj, &rows, 0, "rows") < 0 || int64_buffer(first_obj, &first, 0, "first") < 0 ||
        int64_buffer(second_obj, &second, 0, "second") < 0)
        goto done;
    if (PyObject_GetBuffer(table_obj, &table, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        goto done;
    if (table.itemsize != 4 || table.format == NULL || strcmp(table.format, "i") != 0) {
        PyErr_SetString(PyExc_TypeError, "table: expected a contiguous int32 buffer");
        goto done;
    }
    Py_ssize_t n = rows.len / 8, size = counts.len / 8, bins = table.len / 4;
    if (first.len / 8 != n || second.len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "rows, first and second must have one entry per row");
        goto done;
    }
    const int64_t *r = rows.buf, *a = first.buf, *b = second.buf;
    const int32_t *t = table.buf;
    int64_t *out = counts.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {  /* one pass, stopping at the first bad value (see add_counts) */
        if ((uint64_t)a[i] >= (uint64_t)bins || (uint64_t)b[i] >= (uint64_t)bins) {
            bad = 1;
            break;
        }
        uint64_t key = (uint64_t)(r[i] * stride + (int64_t)t[a[i]] * scale + t[b[i]]);
        if (key >= (uint64_t)size) {
            bad = 1;
            break;
        }
        out[key]++;
    }
    Py_END_ALLOW_THREADS
    if (bad)
        PyErr_SetString(PyExc_ValueError, "add_pair_counts: a value falls outside table or a key outside counts");
    else
        result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&counts);
    if (rows.buf) PyBuffer_Release(&rows);
    if (first.buf) PyBuffer_Release(&first);
    if (second.buf) PyBuffer_Release(&second);
    if (table.buf) PyBuffer_Release(&table);
    return result;
}

static PyMethodDef methods[] = {
    {"scan_block", scan_block, METH_VARARGS, scan_block_doc},
    {"add_counts", add_counts, METH_VARARGS, add_counts_doc},
    {"add_pair_counts", add_pair_counts, METH_VARARGS, add_pair_counts_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvtune.ingest._flatscan",
    .m_doc = "Strict, GIL-free scan of flat JSONL blocks (see kvtune.ingest.flatscan) and dense counting "
             "(kvtune.profile.counting).",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__flatscan(void) { return PyModule_Create(&module_def); }
