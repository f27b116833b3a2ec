/*
 * spear.h - single-header SDK for cchatq agent programs in C (wasm32-wasi).
 *
 * An agent program is a WASI command (it has `main`) that drives chat
 * sessions through the `spear` hostcalls and registers its own functions as
 * tools. The ABI is binary-compatible with the public SPEAR project's
 * `cchat_*` hostcalls; the reference is docs/guest-abi.md.
 *
 *   - Every import comes from module "spear". All params/results are i32,
 *     except time_now_ms / wall_time_s / random_i64 (return i64) and
 *     sleep_ms (no result). Pointer parameters are declared as C pointers:
 *     pointers are 32-bit on wasm32, so they lower to exactly the same i32.
 *   - Errors come back as -errno with LINUX numbers (SPEAR_E* below).
 *   - write-with-len: every call that hands bytes back reads the capacity from
 *     the u32 cell *len, and either writes the bytes, stores their length and
 *     returns it, or stores the needed length and returns -SPEAR_ENOSPC.
 *   - fds (sessions, responses, epoll sets) start at SPEAR_FIRST_FD and are
 *     never reused.
 *
 * A tool is a function of the tool signature whose ADDRESS is registered with
 * cchat_write_fn (in wasm32 C a function pointer is its index in the exported
 * function table). It runs in a fork of the program: a fresh instance whose
 * memory is a snapshot taken at cchat_send, so it sees globals and heap as
 * they were then; its own memory writes are not seen by the program.
 *
 *     #include "spear.h"
 *     SPEAR_TOOL_FN(add) {
 *         long long a, b;
 *         char buf[64];
 *         if (spear_json_find_int(args, "a", &a) < 0 ||
 *             spear_json_find_int(args, "b", &b) < 0)
 *             return -SPEAR_EINVAL;
 *         int n = snprintf(buf, sizeof buf, "{\"result\":%lld}", a + b);
 *         return spear_write_tool_result(out, out_len, buf, (uint32_t)n);
 *     }
 *     int main(void) {
 *         int32_t fd = cchat_create();
 *         spear_set_param_str(fd, "model", "gpt-4o-mini");
 *         cchat_write_fn(fd, (int32_t)(intptr_t)&add, json, json_len);
 *         ...
 *     }
 *
 * Build (command module; the table must be exported so the host can find
 * tools by index):
 *
 *     clang-14 --target=wasm32-wasi -O2 -Wl,--export-table prog.c -o prog.wasm
 *
 * C99. Helpers are static inline; the *_alloc helpers use malloc.
 *
 * Built on cchatq_tool.h (same directory; included below), which holds the
 * one copy of the tool signature, the u32 length-cell / tool-result helpers
 * and the JSON string decoding shared by both SDKs.
 */
#ifndef SPEAR_H
#define SPEAR_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cchatq_tool.h"

/*
 * Error numbers returned (negated) by the hostcalls, and by tools. These are
 * the LINUX numbers, which is what the host uses (the same numbers as
 * CCHATQ_E*). wasi-libc's <errno.h> uses different values (e.g. its EBADF is
 * 8, its ENOSPC is 51): never compare hostcall results with EXXX from
 * <errno.h>, always use these.
 */
#define SPEAR_EPERM     CCHATQ_EPERM     /* 1 */
#define SPEAR_ENOENT    CCHATQ_ENOENT    /* 2 */
#define SPEAR_EIO       CCHATQ_EIO       /* 5 */
#define SPEAR_EBADF     CCHATQ_EBADF     /* 9 */
#define SPEAR_EAGAIN    CCHATQ_EAGAIN    /* 11 */
#define SPEAR_ENOMEM    CCHATQ_ENOMEM    /* 12 */
#define SPEAR_EACCES    CCHATQ_EACCES    /* 13 */
#define SPEAR_EFAULT    CCHATQ_EFAULT    /* 14 */
#define SPEAR_EINVAL    CCHATQ_EINVAL    /* 22 */
#define SPEAR_ENOSPC    CCHATQ_ENOSPC    /* 28 */
#define SPEAR_EPIPE     CCHATQ_EPIPE     /* 32 */
#define SPEAR_EDOM      CCHATQ_EDOM      /* 33 */
#define SPEAR_ENOSYS    CCHATQ_ENOSYS    /* 38 */
#define SPEAR_ETIMEDOUT CCHATQ_ETIMEDOUT /* 110 */

/* First fd number of a run (fds are shared by all kinds, never reused). */
#define SPEAR_FIRST_FD 1000

/* cchat_send flags */
#define SPEAR_SEND_METRICS        1
#define SPEAR_SEND_AUTO_TOOL_CALL 2

/* cchat_ctl commands */
#define SPEAR_CTL_SET_PARAM   1 /* arg: {"key":"..","value":<json>}; 0 or -EIO */
#define SPEAR_CTL_GET_METRICS 2 /* on a response fd: write-with-len of JSON */

/* spear_fd_ctl commands */
#define SPEAR_FD_SET_FLAGS   1 /* arg: {"set":["O_NONBLOCK"],"clear":[]} */
#define SPEAR_FD_GET_FLAGS   2
#define SPEAR_FD_GET_KIND    3
#define SPEAR_FD_GET_STATUS  4
#define SPEAR_FD_GET_METRICS 5

/* fd flag names (SET_FLAGS JSON) and kinds (GET_KIND) */
#define SPEAR_O_NONBLOCK     "O_NONBLOCK"
#define SPEAR_KIND_SESSION   "ChatSession"
#define SPEAR_KIND_RESPONSE  "ChatResponse"
#define SPEAR_KIND_EPOLL     "Epoll"

/* spear_epoll_ctl ops and events */
#define SPEAR_EPOLL_CTL_ADD 1
#define SPEAR_EPOLL_CTL_MOD 2
#define SPEAR_EPOLL_CTL_DEL 3
#define SPEAR_EPOLLIN  0x1
#define SPEAR_EPOLLOUT 0x4
#define SPEAR_EPOLLERR 0x8
#define SPEAR_EPOLLHUP 0x10

/* log levels */
#define SPEAR_LOG_TRACE 0
#define SPEAR_LOG_DEBUG 1
#define SPEAR_LOG_INFO  2
#define SPEAR_LOG_WARN  3
#define SPEAR_LOG_ERROR 4
#define SPEAR_LOG_MAX_BYTES 16384

/* One record written by spear_epoll_wait: packed little-endian, 8 bytes. */
typedef struct spear_epoll_event {
    int32_t fd;
    int32_t events;
} spear_epoll_event;

/* C99 compile-time check: the record is 8 bytes. */
typedef char spear__epoll_event_is_8_bytes[sizeof(spear_epoll_event) == 8 ? 1 : -1];

/* ------------------------------------------------------------------------ */
/* Imports (module "spear").                                                 */
/* ------------------------------------------------------------------------ */

#define SPEAR__IMPORT(name) \
    __attribute__((import_module("spear"), import_name(#name)))

/* Chat hostcalls (docs/guest-abi.md section 3). */

/* () -> i32: a new session fd. */
SPEAR__IMPORT(cchat_create)
int32_t cchat_create(void);

/* (fd, role_ptr, role_len, content_ptr, content_len) -> i32: 0. */
SPEAR__IMPORT(cchat_write_msg)
int32_t cchat_write_msg(int32_t fd, const char *role, int32_t role_len,
                        const char *content, int32_t content_len);

/* (fd, fn_offset, json_ptr, json_len) -> i32: 0. fn_offset is the function's
 * table index, i.e. (int32_t)(intptr_t)&fn. -EINVAL for bad JSON, a missing
 * name, or an offset that is not a function of the tool signature. */
SPEAR__IMPORT(cchat_write_fn)
int32_t cchat_write_fn(int32_t fd, int32_t fn_offset, const char *json,
                       int32_t json_len);

/* (fd, cmd, arg_ptr, arg_len_ptr) -> i32: 0 (set) / bytes (get).
 * *arg_len is a u32: the argument length (set) or the capacity (get). */
SPEAR__IMPORT(cchat_ctl)
int32_t cchat_ctl(int32_t fd, int32_t cmd, void *arg, uint32_t *arg_len);

/* (fd, flags) -> i32: a response fd. */
SPEAR__IMPORT(cchat_send)
int32_t cchat_send(int32_t fd, int32_t flags);

/* (resp_fd, out_ptr, out_len_ptr) -> i32: bytes written (write-with-len).
 * Reading does not consume; -EAGAIN while a non-blocking send is running. */
SPEAR__IMPORT(cchat_recv)
int32_t cchat_recv(int32_t resp_fd, char *out, uint32_t *out_len);

/* (fd) -> i32: 0 (also for an fd closed before). */
SPEAR__IMPORT(cchat_close)
int32_t cchat_close(int32_t fd);

/* Other hostcalls (docs/guest-abi.md section 6). */

/* log: (level, ptr, len) -> i32. Named spear_log_raw in C because `log`
 * is <math.h>'s; see spear_log() for NUL-terminated strings. */
SPEAR__IMPORT(log)
int32_t spear_log_raw(int32_t level, const char *msg, int32_t len);

/* () -> i64: Unix time in milliseconds / seconds; a random value. */
SPEAR__IMPORT(time_now_ms)
int64_t time_now_ms(void);

SPEAR__IMPORT(wall_time_s)
int64_t wall_time_s(void);

SPEAR__IMPORT(random_i64)
int64_t random_i64(void);

/* (i32) -> (): sleep, bounded by the run's deadline. */
SPEAR__IMPORT(sleep_ms)
void sleep_ms(int32_t ms);

/* (fd, cmd, arg_ptr, arg_len_ptr) -> i32: SPEAR_FD_* commands. */
SPEAR__IMPORT(spear_fd_ctl)
int32_t spear_fd_ctl(int32_t fd, int32_t cmd, void *arg, uint32_t *arg_len);

/* () -> i32: a new epoll fd. */
SPEAR__IMPORT(spear_epoll_create)
int32_t spear_epoll_create(void);

/* (epfd, op, fd, events) -> i32: 0. */
SPEAR__IMPORT(spear_epoll_ctl)
int32_t spear_epoll_ctl(int32_t epfd, int32_t op, int32_t fd, int32_t events);

/* (epfd, out_ptr, out_len_ptr, timeout_ms) -> i32: the record count (0 on
 * timeout). Writes spear_epoll_event records sorted by fd, as many as fit in
 * *out_len bytes, and sets *out_len to the bytes written; -ENOSPC (with
 * *out_len = 8) only if not even one fits. timeout_ms < 0 waits forever.
 * Level-triggered. */
SPEAR__IMPORT(spear_epoll_wait)
int32_t spear_epoll_wait(int32_t epfd, void *out, uint32_t *out_len,
                         int32_t timeout_ms);

/* (epfd) -> i32: 0. */
SPEAR__IMPORT(spear_epoll_close)
int32_t spear_epoll_close(int32_t epfd);

/* ------------------------------------------------------------------------ */
/* Tools.                                                                    */
/* ------------------------------------------------------------------------ */

/*
 * SPEAR_TOOL_FN(name) { ... } defines the tool `name` with the parameters
 * const char *args, int32_t args_len, char *out, uint32_t *out_len
 * (wasm type (i32, i32, i32, i32) -> i32). It is NOT exported by name: the
 * program registers it with cchat_write_fn(fd, (int32_t)(intptr_t)&name, ..).
 *
 *   - args: the model's `arguments` (UTF-8), followed by a NUL byte not
 *     counted in args_len, so it can be used as a C string.
 *   - *out_len holds the output capacity on entry. Write the result to out,
 *     store its length in *out_len and return 0; if it does not fit, store
 *     the needed length and return -SPEAR_ENOSPC (spear_write_tool_result
 *     does both). Any other negative value is an error.
 */
#define SPEAR_TOOL_FN(name) CCHATQ__TOOL_SIGNATURE(name)

/* Read/write a u32 length cell without assuming alignment. */
static inline uint32_t spear_get_u32(const uint32_t *cell)
{
    return cchatq_get_capacity(cell);
}

static inline void spear_set_u32(uint32_t *cell, uint32_t v)
{
    cchatq_set_length(cell, v);
}

/*
 * Copy `len` bytes of `data` to a tool's output, applying the ENOSPC rule.
 * Returns 0 (and *out_len = len), or -SPEAR_ENOSPC with *out_len = len when
 * the capacity is too small (nothing else is written). Return it directly.
 */
static inline int32_t spear_write_tool_result(char *out, uint32_t *out_len,
                                              const char *data, uint32_t len)
{
    return cchatq_write_result(out, out_len, data, len);
}

/* ------------------------------------------------------------------------ */
/* Hostcall helpers.                                                         */
/* ------------------------------------------------------------------------ */

/* log a NUL-terminated message (level 0 trace .. 4 error). */
static inline int32_t spear_log(int32_t level, const char *msg)
{
    return spear_log_raw(level, msg, (int32_t)strlen(msg));
}

/* Write a user/system/assistant message given as a C string. */
static inline int32_t spear_write_msg_str(int32_t fd, const char *role,
                                          const char *content)
{
    return cchat_write_msg(fd, role, (int32_t)strlen(role), content,
                           (int32_t)strlen(content));
}

/* Register a tool whose JSON is a C string. */
static inline int32_t spear_write_fn_str(int32_t fd, int32_t fn_offset,
                                         const char *json)
{
    return cchat_write_fn(fd, fn_offset, json, (int32_t)strlen(json));
}

/* JSON-escape s into dst (if dst != NULL); returns the escaped length.
 * Escapes " and \ and control characters; other bytes are copied. */
static inline size_t spear__json_escape(char *dst, const char *s)
{
    static const char hex[] = "0123456789abcdef";
    size_t n = 0;
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') {
            if (dst) { dst[n] = '\\'; dst[n + 1] = (char)c; }
            n += 2;
        } else if (c == '\n' || c == '\r' || c == '\t') {
            if (dst) {
                dst[n] = '\\';
                dst[n + 1] = c == '\n' ? 'n' : c == '\r' ? 'r' : 't';
            }
            n += 2;
        } else if (c < 0x20) {
            if (dst) {
                memcpy(dst + n, "\\u00", 4);
                dst[n + 4] = hex[c >> 4];
                dst[n + 5] = hex[c & 0xF];
            }
            n += 6;
        } else {
            if (dst) dst[n] = (char)c;
            n += 1;
        }
    }
    return n;
}

/* SET_PARAM with a raw JSON value (`value_json` is inserted as is). */
static inline int32_t spear_set_param_json(int32_t fd, const char *key,
                                           const char *value_json)
{
    size_t klen = spear__json_escape(NULL, key);
    size_t cap = klen + strlen(value_json) + 32;
    char *buf = (char *)malloc(cap);
    int32_t rc;
    int n;

    if (!buf)
        return -SPEAR_ENOMEM;
    memcpy(buf, "{\"key\":\"", 8);
    spear__json_escape(buf + 8, key);
    n = snprintf(buf + 8 + klen, cap - 8 - klen, "\",\"value\":%s}", value_json);
    if (n < 0 || (size_t)n >= cap - 8 - klen) {
        free(buf);
        return -SPEAR_EINVAL;
    }
    {
        uint32_t len = (uint32_t)(8 + klen + (size_t)n);
        rc = cchat_ctl(fd, SPEAR_CTL_SET_PARAM, buf, &len);
    }
    free(buf);
    return rc;
}

/* SET_PARAM {"key":key,"value":"value"} (both strings are JSON-escaped). */
static inline int32_t spear_set_param_str(int32_t fd, const char *key,
                                          const char *value)
{
    size_t vlen = spear__json_escape(NULL, value);
    char *quoted = (char *)malloc(vlen + 3);
    int32_t rc;

    if (!quoted)
        return -SPEAR_ENOMEM;
    quoted[0] = '"';
    spear__json_escape(quoted + 1, value);
    quoted[vlen + 1] = '"';
    quoted[vlen + 2] = '\0';
    rc = spear_set_param_json(fd, key, quoted);
    free(quoted);
    return rc;
}

/* SET_PARAM {"key":key,"value":<number>}. */
static inline int32_t spear_set_param_num(int32_t fd, const char *key,
                                          long long value)
{
    char num[32];
    snprintf(num, sizeof num, "%lld", value);
    return spear_set_param_json(fd, key, num);
}

/* Set O_NONBLOCK on an fd (spear_fd_ctl SET_FLAGS). On a session fd,
 * cchat_send then returns its response fd at once. */
static inline int32_t spear_set_nonblock(int32_t fd)
{
    static const char arg[] = "{\"set\":[\"O_NONBLOCK\"],\"clear\":[]}";
    uint32_t len = (uint32_t)(sizeof arg - 1);
    return spear_fd_ctl(fd, SPEAR_FD_SET_FLAGS, (void *)arg, &len);
}

/*
 * Call a write-with-len getter into a malloc'd buffer: start with 4 KiB,
 * and on -ENOSPC grow to the needed length and retry. which: 0 cchat_recv,
 * 1 cchat_ctl GET_METRICS, 2 spear_fd_ctl with fd_cmd.
 */
static inline int32_t spear__get_alloc(int which, int32_t fd, int32_t fd_cmd,
                                       char **out, uint32_t *len)
{
    uint32_t cap = 4096;
    char *buf = NULL;
    int attempt;

    *out = NULL;
    if (len)
        *len = 0;
    for (attempt = 0; attempt < 8; attempt++) {
        char *nbuf = (char *)realloc(buf, (size_t)cap + 1); /* + NUL */
        uint32_t cell = cap;
        int32_t rc;

        if (!nbuf) {
            free(buf);
            return -SPEAR_ENOMEM;
        }
        buf = nbuf;
        if (which == 0)
            rc = cchat_recv(fd, buf, &cell);
        else if (which == 1)
            rc = cchat_ctl(fd, SPEAR_CTL_GET_METRICS, buf, &cell);
        else
            rc = spear_fd_ctl(fd, fd_cmd, buf, &cell);
        if (rc == -SPEAR_ENOSPC && cell > cap) {
            cap = cell;
            continue;
        }
        if (rc < 0) {
            free(buf);
            return rc;
        }
        if ((uint32_t)rc > cap) { /* cannot happen with a correct host */
            free(buf);
            return -SPEAR_EIO;
        }
        buf[rc] = '\0';
        *out = buf;
        if (len)
            *len = (uint32_t)rc;
        return rc;
    }
    free(buf);
    return -SPEAR_ENOSPC;
}

/*
 * Receive a response body into a malloc'd, NUL-terminated buffer (*out, to be
 * freed by the caller; *len = bytes without the NUL). Returns the byte count
 * or a negative errno (e.g. -SPEAR_EAGAIN on a non-blocking response that is
 * not there yet), with *out = NULL.
 */
static inline int32_t spear_recv_alloc(int32_t resp_fd, char **out,
                                       uint32_t *len)
{
    return spear__get_alloc(0, resp_fd, 0, out, len);
}

/* cchat_ctl GET_METRICS on a response fd, like spear_recv_alloc. */
static inline int32_t spear_get_metrics_alloc(int32_t resp_fd, char **out,
                                              uint32_t *len)
{
    return spear__get_alloc(1, resp_fd, 0, out, len);
}

/* spear_fd_ctl GET_FLAGS/GET_KIND/GET_STATUS/GET_METRICS, like
 * spear_recv_alloc. */
static inline int32_t spear_fd_get_alloc(int32_t fd, int32_t cmd, char **out,
                                         uint32_t *len)
{
    return spear__get_alloc(2, fd, cmd, out, len);
}

/* ------------------------------------------------------------------------ */
/* Minimal JSON search for response bodies and tool args.                    */
/*                                                                           */
/* Response bodies are compact JSON with sorted keys. These helpers find the */
/* FIRST occurrence of "key" (at any depth) followed by optional whitespace, */
/* ':' and optional whitespace, and the value of the wanted type; an         */
/* occurrence with another value type is skipped. Text inside JSON strings   */
/* never matches (its quotes are escaped). `json` must be NUL-terminated.    */
/* For the answer of a chat completion, key "content" finds                  */
/* choices[0].message.content.                                               */
/* ------------------------------------------------------------------------ */

/* The first character of a value of "key" that starts with a character in
 * `first` (e.g. "\"" or "-0123456789"), or NULL. */
static inline const char *spear__json_find_value(const char *json,
                                                 const char *key,
                                                 const char *first)
{
    size_t klen = strlen(key);
    const char *p = json;

    if (klen == 0)
        return NULL;
    while ((p = strstr(p, key)) != NULL) {
        const char *hit = p;
        p += 1;
        if (hit == json || hit[-1] != '"' || hit[klen] != '"')
            continue;
        {
            /* The opening quote must not itself be escaped: count the
             * backslashes before it. */
            const char *b = hit - 1;
            size_t slashes = 0;
            while (b > json && b[-1] == '\\') {
                b--;
                slashes++;
            }
            if (slashes % 2)
                continue;
        }
        {
            const char *q = cchatq__json_ws(hit + klen + 1);
            if (*q != ':')
                continue;
            q = cchatq__json_ws(q + 1);
            if (*q && strchr(first, *q))
                return q;
        }
    }
    return NULL;
}

/*
 * Copy the decoded string value of the first "key":"..." into buf
 * (NUL-terminated; cap bytes including the NUL). Decodes \" \\ \/ \b \f \n
 * \r \t and \uXXXX (as UTF-8, with surrogate pairs; lone surrogates become
 * U+FFFD). A buffer of strlen(json) + 1 bytes is always big enough.
 * Returns the decoded length, or -SPEAR_ENOENT (no such string value),
 * -SPEAR_EINVAL (malformed), -SPEAR_ENOSPC (buf too small).
 */
static inline int32_t spear_json_find_string(const char *json, const char *key,
                                             char *buf, uint32_t cap)
{
    const char *p = spear__json_find_value(json, key, "\"");

    if (!p)
        return -SPEAR_ENOENT;
    if (cap == 0)
        return -SPEAR_ENOSPC;
    return cchatq__json_decode_string(p + 1, buf, cap);
}

/*
 * Parse the integer value of the first "key":<integer> into *out.
 * Returns 0, -SPEAR_ENOENT (no such integer value), or -SPEAR_EINVAL
 * (a fraction/exponent, or out of range for long long).
 */
static inline int32_t spear_json_find_int(const char *json, const char *key,
                                          long long *out)
{
    const char *p = spear__json_find_value(json, key, "-0123456789");
    int neg = 0;
    unsigned long long v = 0;
    int any = 0;

    if (!p)
        return -SPEAR_ENOENT;
    if (*p == '-') {
        neg = 1;
        p++;
    }
    while (*p >= '0' && *p <= '9') {
        unsigned d = (unsigned)(*p - '0');
        if (v > (9223372036854775807ULL + (unsigned)neg - d) / 10)
            return -SPEAR_EINVAL;
        v = v * 10 + d;
        any = 1;
        p++;
    }
    if (!any || *p == '.' || *p == 'e' || *p == 'E')
        return -SPEAR_EINVAL;
    if (neg)
        *out = v == 9223372036854775808ULL ? (long long)(-9223372036854775807LL - 1)
                                           : -(long long)v;
    else
        *out = (long long)v;
    return 0;
}

#endif /* SPEAR_H */
