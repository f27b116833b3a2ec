/*
 * cchatq_tool.h - single-header SDK for writing cchatq tools in C (wasm32-wasi).
 *
 * A tool is an exported function of a reactor module:
 *
 *     int32_t tool(int32_t args_ptr, int32_t args_len,
 *                  int32_t out_ptr, int32_t out_len_ptr);
 *
 *   - args: UTF-8 JSON text (the model's `arguments`), followed by a NUL byte
 *     that is not counted in args_len, so it can be used as a C string.
 *   - *out_len (u32, little-endian) holds the output capacity on entry.
 *     The tool writes its result to out, stores the length in *out_len and
 *     returns 0.
 *   - If the capacity is too small, the tool stores the needed length in
 *     *out_len, writes nothing else and returns -CCHATQ_ENOSPC (-28); the
 *     host then retries with a buffer of that size.
 *   - Any other negative return value is an error (a negated errno below).
 *   - Output must be valid UTF-8 (it need not be JSON).
 *
 * Usage:
 *
 *     #include "cchatq_tool.h"
 *     CCHATQ_TOOL(get_weather) {
 *         char city[64];
 *         if (cchatq_json_get_string(args, "city", city, sizeof city) < 0)
 *             return -CCHATQ_EINVAL;
 *         return cchatq_write_result(out, out_len, "ok", 2);
 *     }
 *
 * Build (reactor module, no main):
 *
 *     clang-14 --target=wasm32-wasi -O2 -mexec-model=reactor \
 *         -Wl,--export-table -Wl,--export=get_weather tool.c -o tool.wasm
 *
 * C99, no allocations. All helpers are static inline.
 *
 * spear.h (agent programs) includes this header and builds its tool, length
 * cell and JSON string helpers on the ones below, so there is one copy of
 * them. Names starting with cchatq__ are internal.
 */
#ifndef CCHATQ_TOOL_H
#define CCHATQ_TOOL_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/*
 * Error numbers returned (negated) by tools. These are the LINUX numbers,
 * which is what the cchatq host expects. wasi-libc's <errno.h> uses
 * different values (e.g. its ENOSPC is not 28): never return EXXX constants
 * from <errno.h>, always use these.
 */
#define CCHATQ_EPERM      1
#define CCHATQ_ENOENT     2
#define CCHATQ_EIO        5
#define CCHATQ_EBADF      9
#define CCHATQ_EAGAIN    11
#define CCHATQ_ENOMEM    12
#define CCHATQ_EACCES    13
#define CCHATQ_EFAULT    14
#define CCHATQ_EINVAL    22
#define CCHATQ_ENOSPC    28
#define CCHATQ_EPIPE     32
#define CCHATQ_EDOM      33
#define CCHATQ_ENOSYS    38
#define CCHATQ_ETIMEDOUT 110

/* The tool signature (wasm type (i32, i32, i32, i32) -> i32), unexported. */
#define CCHATQ__TOOL_SIGNATURE(name)                                         \
    int32_t name(const char *args, int32_t args_len, char *out,             \
                 uint32_t *out_len)

/*
 * The call's retry number: 0 on the first try, then 1, 2, ... when the tool's
 * policy (`max_retries`) runs it again after a failure. Like Celery's
 * request.retries: a tool can tell a retry from a first call. Imported from
 * the host module `cchatq` only by tools that call it.
 */
__attribute__((import_module("cchatq"), import_name("attempt")))
int32_t cchatq_attempt(void);

/*
 * How far a long call is: percent (0..100) and a short message (up to 200
 * bytes are kept). A background tool's reports become task.progress trace
 * events (`cchatq trace ID`); other tools may call it too. Returns 0, or
 * -CCHATQ_EINVAL for a percent outside 0..100.
 */
__attribute__((import_module("cchatq"), import_name("progress")))
int32_t cchatq_progress(int32_t percent, const char *msg, uint32_t msg_len);

/*
 * CCHATQ_TOOL(name) { ... } defines and exports the tool `name` with the
 * parameters: const char *args, int32_t args_len, char *out, uint32_t *out_len.
 * (Pointers are 32-bit on wasm32, so this matches the i32 ABI exactly.)
 */
#define CCHATQ_TOOL(name)                                                    \
    __attribute__((export_name(#name))) CCHATQ__TOOL_SIGNATURE(name)

/* Read/write *out_len without assuming alignment. */
static inline uint32_t cchatq_get_capacity(const uint32_t *out_len)
{
    uint32_t v;
    memcpy(&v, out_len, sizeof v);
    return v;
}

static inline void cchatq_set_length(uint32_t *out_len, uint32_t len)
{
    memcpy(out_len, &len, sizeof len);
}

/*
 * Check that `needed` bytes fit in the output buffer. Returns 0 if they do
 * (nothing is written). Otherwise stores `needed` in *out_len and returns
 * -CCHATQ_ENOSPC, which the tool should return as-is. Useful for tools that
 * generate output directly into `out`; finish with cchatq_set_length().
 */
static inline int32_t cchatq_check_capacity(uint32_t *out_len, uint32_t needed)
{
    if (needed > cchatq_get_capacity(out_len)) {
        cchatq_set_length(out_len, needed);
        return -CCHATQ_ENOSPC;
    }
    return 0;
}

/*
 * Copy `len` bytes of `data` to the output, applying the ENOSPC rule.
 * Returns 0 on success (and *out_len = len), or -CCHATQ_ENOSPC with
 * *out_len = len when the capacity is too small. Return its result directly.
 */
static inline int32_t cchatq_write_result(char *out, uint32_t *out_len,
                                          const char *data, uint32_t len)
{
    int32_t rc = cchatq_check_capacity(out_len, len);
    if (rc < 0)
        return rc;
    if (len > 0)
        memcpy(out, data, len);
    cchatq_set_length(out_len, len);
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Minimal JSON helpers for flat objects.                                    */
/*                                                                           */
/* `json` must be NUL-terminated (tool args always are). Only top-level keys */
/* of the outer object are found; nested objects/arrays are skipped. A key   */
/* is matched as a quoted string (compared byte-for-byte, escapes are not    */
/* decoded) followed by optional whitespace and ':'. First match wins.       */
/* ------------------------------------------------------------------------ */

static inline const char *cchatq__json_ws(const char *p)
{
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')
        p++;
    return p;
}

/* p points at an opening '"'; returns the pointer after the closing '"'. */
static inline const char *cchatq__json_skip_string(const char *p)
{
    p++;
    while (*p && *p != '"') {
        if (*p == '\\') {
            p++;
            if (!*p)
                return NULL;
        }
        p++;
    }
    return *p == '"' ? p + 1 : NULL;
}

/* Returns a pointer to the first character of the key's value, or NULL. */
static inline const char *cchatq__json_find(const char *json, const char *key)
{
    const char *p = cchatq__json_ws(json);
    size_t klen = strlen(key);
    int depth = 1;

    if (*p != '{')
        return NULL;
    p++;
    while (*p) {
        char c = *p;
        if (c == '"') {
            const char *start = p + 1;
            const char *end = cchatq__json_skip_string(p);
            if (!end)
                return NULL;
            if (depth == 1) {
                const char *q = cchatq__json_ws(end);
                if (*q == ':') {
                    if ((size_t)(end - 1 - start) == klen &&
                        memcmp(start, key, klen) == 0)
                        return cchatq__json_ws(q + 1);
                    p = q + 1;
                    continue;
                }
            }
            p = end;
            continue;
        }
        if (c == '{' || c == '[') {
            depth++;
        } else if (c == '}' || c == ']') {
            if (--depth == 0)
                return NULL;
        }
        p++;
    }
    return NULL;
}

static inline int cchatq__json_hex4(const char *p, uint32_t *out)
{
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) {
        char c = p[i];
        v <<= 4;
        if (c >= '0' && c <= '9')
            v |= (uint32_t)(c - '0');
        else if (c >= 'a' && c <= 'f')
            v |= (uint32_t)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F')
            v |= (uint32_t)(c - 'A' + 10);
        else
            return -1;
    }
    *out = v;
    return 0;
}

/* Encode code point cp (<= 0x10FFFF) as UTF-8 into enc; returns its length. */
static inline uint32_t cchatq__utf8_encode(uint32_t cp, char enc[4])
{
    if (cp < 0x80) {
        enc[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        enc[0] = (char)(0xC0 | (cp >> 6));
        enc[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        enc[0] = (char)(0xE0 | (cp >> 12));
        enc[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        enc[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    enc[0] = (char)(0xF0 | (cp >> 18));
    enc[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    enc[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    enc[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/*
 * Decode the JSON string whose body starts at p (just after the opening '"')
 * into buf (cap bytes, including the NUL). Handles \" \\ \/ \b \f \n \r \t
 * and \uXXXX (incl. surrogate pairs; lone surrogates become U+FFFD), and
 * encodes to UTF-8. Returns the decoded length (excluding the NUL), or
 * -CCHATQ_EINVAL (malformed or unterminated) or -CCHATQ_ENOSPC (buf too
 * small; with cap == 0 a malformed escape may still give -CCHATQ_EINVAL).
 */
static inline int32_t cchatq__json_decode_string(const char *p, char *buf,
                                                 uint32_t cap)
{
    uint32_t n = 0;

    for (;;) {
        unsigned char c = (unsigned char)*p++;
        uint32_t cp;
        char enc[4];
        uint32_t elen;

        if (c == '"')
            break;
        if (c == 0)
            return -CCHATQ_EINVAL; /* unterminated */
        if (c != '\\') {
            if (n + 1 >= cap)
                return -CCHATQ_ENOSPC;
            buf[n++] = (char)c;
            continue;
        }
        c = (unsigned char)*p++;
        switch (c) {
        case '"': case '\\': case '/': cp = c; break;
        case 'b': cp = '\b'; break;
        case 'f': cp = '\f'; break;
        case 'n': cp = '\n'; break;
        case 'r': cp = '\r'; break;
        case 't': cp = '\t'; break;
        case 'u':
            if (cchatq__json_hex4(p, &cp) < 0)
                return -CCHATQ_EINVAL;
            p += 4;
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                uint32_t lo;
                if (p[0] == '\\' && p[1] == 'u' &&
                    cchatq__json_hex4(p + 2, &lo) == 0 &&
                    lo >= 0xDC00 && lo <= 0xDFFF) {
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                    p += 6;
                } else {
                    cp = 0xFFFD;
                }
            } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
                cp = 0xFFFD;
            }
            break;
        default:
            return -CCHATQ_EINVAL;
        }
        elen = cchatq__utf8_encode(cp, enc);
        if (n + elen >= cap)
            return -CCHATQ_ENOSPC;
        memcpy(buf + n, enc, elen);
        n += elen;
    }
    if (cap == 0)
        return -CCHATQ_ENOSPC;
    buf[n] = '\0';
    return (int32_t)n;
}

/*
 * Copy the decoded string value of top-level `key` into buf (NUL-terminated).
 * Handles \" \\ \/ \b \f \n \r \t and \uXXXX (incl. surrogate pairs; lone
 * surrogates become U+FFFD). Returns the decoded length (excluding the NUL),
 * or: -CCHATQ_ENOENT if the key is absent, -CCHATQ_EINVAL if the value is
 * not a string or is malformed, -CCHATQ_ENOSPC if buf (cap bytes, including
 * the NUL) is too small. Note: do not pass -CCHATQ_ENOSPC from here back to
 * the host unchanged; to the host it means "give me a bigger output buffer".
 */
static inline int32_t cchatq_json_get_string(const char *json, const char *key,
                                             char *buf, uint32_t cap)
{
    const char *p = cchatq__json_find(json, key);

    if (!p)
        return -CCHATQ_ENOENT;
    if (*p != '"')
        return -CCHATQ_EINVAL;
    return cchatq__json_decode_string(p + 1, buf, cap);
}

/*
 * Parse the number value of top-level `key` into *out. Returns 0, or
 * -CCHATQ_ENOENT if the key is absent, -CCHATQ_EINVAL if the value is not a
 * JSON number (strings, null, true/false, inf/nan, hex are rejected).
 */
static inline int32_t cchatq_json_get_number(const char *json, const char *key,
                                             double *out)
{
    const char *p = cchatq__json_find(json, key);
    const char *q;
    char *end;
    double v;

    if (!p)
        return -CCHATQ_ENOENT;
    /* Validate JSON number grammar: -?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)? */
    q = p;
    if (*q == '-')
        q++;
    if (*q == '0') {
        q++;
    } else if (*q >= '1' && *q <= '9') {
        while (*q >= '0' && *q <= '9')
            q++;
    } else {
        return -CCHATQ_EINVAL;
    }
    if (*q == '.') {
        q++;
        if (!(*q >= '0' && *q <= '9'))
            return -CCHATQ_EINVAL;
        while (*q >= '0' && *q <= '9')
            q++;
    }
    if (*q == 'e' || *q == 'E') {
        q++;
        if (*q == '+' || *q == '-')
            q++;
        if (!(*q >= '0' && *q <= '9'))
            return -CCHATQ_EINVAL;
        while (*q >= '0' && *q <= '9')
            q++;
    }
    v = strtod(p, &end);
    if (end != q)
        return -CCHATQ_EINVAL;
    *out = v;
    return 0;
}

#endif /* CCHATQ_TOOL_H */
