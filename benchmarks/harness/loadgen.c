/*
 * The benchmark harness's load generator and upstream (benchmarks/README.md), in C so that they
 * cost far less per unit of work than any proxy they measure. benchmarks/bench_loadgen.py builds
 * it with the machine's gcc (with OpenSSL when its headers are there: the https mode) and drives
 * it. It connects to and listens on 127.0.0.1 only.
 *
 *   loadgen upstream    the tunnel port (answers READY once it has read one whole TLS record,
 *                       the ClientHello), the opaque port (answers READY once it has read one
 *                       line, an SSH identification string: a stream that is neither TLS nor
 *                       HTTP) and the bulk port (as the tunnel port, then a command: "U"+size:
 *                       sink size bytes and answer the count; "D"+size: send size bytes);
 *                       prints {"pid":..,"tunnel":..,"opaque":..,"bulk":..}; ends when stdin
 *                       closes
 *   loadgen tunnels     new tunnels, one epoll loop: TCP connect, CONNECT (or SOCKS5, or
 *                       nothing: direct), the target's first flight (its ClientHello, or any
 *                       bytes the targets file holds), the upstream's answer
 *   loadgen bulk        bytes one way through one or several tunnels (a thread per tunnel)
 *   loadgen https       TLS through the tunnel (OpenSSL, the session CA verified) and HTTP/1.1
 *                       requests inside it (a thread per concurrent tunnel)
 *
 * A client sets up and warms up, prints {"ready":true}, and reads a line: "go" runs the phase
 * and prints one JSON line of results; anything else (or EOF) ends it. A failure before ready
 * is printed as {"failed":"..."}. Every phase is bounded by a count and a time; every socket
 * operation by a timeout. Without a proxy, `--address` (a 127.0.0.0/8 address) is where a
 * client connects instead of 127.0.0.1: an address a network namespace redirects.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#ifdef BENCH_TLS
#include <openssl/err.h>
#include <openssl/ssl.h>
#endif

#define READY_BYTE 'R'
#define MAX_TARGETS 100000
#define MAX_COUNT 2000000L
#define KEPT_ERRORS 3
#define ERROR_LIMIT 50
#define UPSTREAM_LIFETIME (6 * 3600) /* a safety net: the harness ends it by closing stdin */
#define CHUNK (1 << 20)
#define BULK_WARMUP (64L << 20)
#define MAX_BULK_TUNNELS 256
#define MAX_THREADS 1024
#define HEAD_LIMIT 16384

enum proxy_kind { PROXY_NONE, PROXY_CONNECT, PROXY_SOCKS5 };

struct target {
    char host[256];
    unsigned char *hello;
    size_t hello_len;
    char head[700]; /* the CONNECT request */
    size_t head_len;
    unsigned char socks[300]; /* the SOCKS5 CONNECT request (domain name) */
    size_t socks_len;
};

static struct {
    enum proxy_kind proxy;
    int proxy_port, port;
    struct target *targets;
    size_t ntargets;
    long concurrency, count, warmup, requests;
    double seconds, timeout;
    int up;
    long bytes;
    const char *ca, *path;
    uint32_t address; /* where a client connects (host order): 127.0.0.1 unless --address */
} opt = {PROXY_NONE, 0, 0, NULL, 0, 1, 1, 0, 1, 5.0, 10.0, 1, 0, NULL, "/", INADDR_LOOPBACK};

/* -- small helpers ------------------------------------------------------------------------- */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static double cpu_self(void) {
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return (double)(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
           (double)(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

static void json_string(FILE *out, const char *s) {
    fputc('"', out);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            fprintf(out, "\\%c", c);
        else if (c < 0x20 || c > 0x7e)
            fprintf(out, "\\u%04x", c);
        else
            fputc(c, out);
    }
    fputc('"', out);
}

static void failed(const char *fmt, ...) {
    char text[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    fputs("{\"failed\":", stdout);
    json_string(stdout, text);
    fputs("}\n", stdout);
    fflush(stdout);
    exit(0);
}

static void usage(const char *why) {
    fprintf(stderr, "loadgen: %s\n", why);
    exit(2);
}

struct errors {
    pthread_mutex_t lock;
    long count;
    char first[KEPT_ERRORS][200];
};

static void error_add(struct errors *e, const char *fmt, ...) {
    char text[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&e->lock);
    if (e->count < KEPT_ERRORS)
        memcpy(e->first[e->count], text, sizeof text);
    e->count++;
    pthread_mutex_unlock(&e->lock);
}

struct latencies {
    double *v;
    size_t n, cap;
};

static void latency_add(struct latencies *l, double seconds) {
    if (l->n == l->cap) {
        l->cap = l->cap ? l->cap * 2 : 4096;
        l->v = realloc(l->v, l->cap * sizeof *l->v);
        if (!l->v)
            failed("out of memory");
    }
    l->v[l->n++] = seconds * 1e6;
}

/* The result line: counts, the first errors, every latency in µs, the client's own CPU. */
static void print_result(const char *extra, long done, struct errors *e, struct latencies *l,
                         double seconds, double cpu) {
    printf("{\"done\":%ld,\"errors\":%ld,\"seconds\":%.6f,\"client_cpu_s\":%.6f,", done,
           e->count, seconds, cpu);
    if (extra)
        fputs(extra, stdout);
    fputs("\"first_errors\":[", stdout);
    for (long i = 0; i < e->count && i < KEPT_ERRORS; i++) {
        if (i)
            fputc(',', stdout);
        json_string(stdout, e->first[i]);
    }
    fputs("],\"latencies_us\":[", stdout);
    for (size_t i = 0; l && i < l->n; i++)
        printf(i ? ",%.1f" : "%.1f", l->v[i]);
    fputs("]}\n", stdout);
    fflush(stdout);
}

/* {"ready":true}, then true when the harness answers "go". */
static int ready_then_go(void) {
    char line[64];
    fputs("{\"ready\":true}\n", stdout);
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin))
        return 0;
    return strncmp(line, "go", 2) == 0;
}

static struct sockaddr_in loopback_at(uint32_t address, int port) {
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(address);
    return a;
}

static struct sockaddr_in loopback(int port) { return loopback_at(INADDR_LOOPBACK, port); }

static int tcp_socket(int nonblocking) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | (nonblocking ? SOCK_NONBLOCK : 0), 0);
    if (fd >= 0) {
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    }
    return fd;
}

static void set_timeouts(int fd, double seconds) {
    struct timeval tv = {(time_t)seconds, (suseconds_t)((seconds - (double)(time_t)seconds) * 1e6)};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

/* -- targets: [u16 host length][host][u16 ClientHello length][ClientHello], repeated ---------- */

static void load_targets(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f)
        usage("cannot open the targets file");
    opt.targets = calloc(MAX_TARGETS, sizeof *opt.targets);
    unsigned char len[2];
    while (opt.ntargets < MAX_TARGETS && fread(len, 1, 2, f) == 2) {
        struct target *t = &opt.targets[opt.ntargets];
        size_t n = (size_t)len[0] << 8 | len[1];
        if (n == 0 || n >= sizeof t->host || fread(t->host, 1, n, f) != n ||
            fread(len, 1, 2, f) != 2)
            usage("malformed targets file (host)");
        t->host[n] = 0;
        t->hello_len = (size_t)len[0] << 8 | len[1];
        t->hello = malloc(t->hello_len + 1);
        if (!t->hello || fread(t->hello, 1, t->hello_len, f) != t->hello_len)
            usage("malformed targets file (ClientHello)");
        opt.ntargets++;
    }
    fclose(f);
    if (!opt.ntargets)
        usage("no targets in the targets file");
}

static void prepare_targets(void) {
    for (size_t i = 0; i < opt.ntargets; i++) {
        struct target *t = &opt.targets[i];
        size_t n = strlen(t->host);
        t->head_len = (size_t)snprintf(t->head, sizeof t->head,
                                       "CONNECT %s:%d HTTP/1.1\r\nHost: %s:%d\r\n\r\n", t->host,
                                       opt.port, t->host, opt.port);
        if (n > 255)
            usage("host name too long for SOCKS5");
        unsigned char *s = t->socks;
        *s++ = 5, *s++ = 1, *s++ = 0, *s++ = 3, *s++ = (unsigned char)n;
        memcpy(s, t->host, n);
        s += n;
        *s++ = (unsigned char)(opt.port >> 8), *s++ = (unsigned char)opt.port;
        t->socks_len = (size_t)(s - t->socks);
    }
}

static int connect_port(void) { return opt.proxy == PROXY_NONE ? opt.port : opt.proxy_port; }

/* Where a client connects: the proxy on 127.0.0.1, or the target at --address (127.0.0.1 by
 * default; another loopback address a network namespace redirects). */
static struct sockaddr_in connect_address(void) {
    return loopback_at(opt.proxy == PROXY_NONE ? opt.address : INADDR_LOOPBACK, connect_port());
}

static const unsigned char SOCKS_GREETING[3] = {5, 1, 0};

/* The end of an HTTP head in buf[0..n), or -1. */
static long head_end(const unsigned char *buf, size_t n) {
    for (size_t i = 3; i < n; i++)
        if (buf[i] == '\n' && buf[i - 1] == '\r' && buf[i - 2] == '\n' && buf[i - 3] == '\r')
            return (long)i + 1;
    return -1;
}

static int status_is_200(const unsigned char *buf, size_t n) {
    return n >= 12 && memcmp(buf, "HTTP/1.", 7) == 0 && memcmp(buf + 8, " 200", 4) == 0;
}

/* The length of a SOCKS5 reply starting with buf[0..n) once known (n >= 5), or 0. */
static size_t socks_reply_len(const unsigned char *buf, size_t n) {
    if (n < 5)
        return 0;
    switch (buf[3]) {
    case 1: return 10;
    case 4: return 22;
    case 3: return 7 + (size_t)buf[4];
    default: return 0;
    }
}

/* -- tunnels: one epoll loop, `concurrency` slots ------------------------------------------ */

enum state { IDLE, CONNECTING, SOCKS_METHOD, SOCKS_REPLY, HEAD, ANSWER };
static const char *STATE_NAMES[] = {"idle",          "connecting", "the SOCKS5 method reply",
                                    "the SOCKS5 reply", "the CONNECT answer", "the upstream's answer"};

struct slot {
    int fd;
    enum state state;
    struct target *t;
    double t0, deadline;
    unsigned char buf[1024];
    size_t got;
    const unsigned char *out;
    size_t out_len;
};

struct run {
    int ep;
    long started, done, active, count;
    double stop_starting, timeout, last_end;
    struct errors errors;
    struct latencies *lat;
};

static void slot_send(struct slot *s, const unsigned char *data, size_t len, enum state next) {
    s->state = next;
    s->out = data;
    s->out_len = len;
    while (s->out_len) {
        ssize_t n = send(s->fd, s->out, s->out_len, MSG_NOSIGNAL);
        if (n < 0)
            return; /* EAGAIN: the rest on EPOLLOUT; an error shows on the next read */
        s->out += n;
        s->out_len -= (size_t)n;
    }
}

static void slot_connected(struct slot *s) {
    if (opt.proxy == PROXY_CONNECT)
        slot_send(s, (const unsigned char *)s->t->head, s->t->head_len, HEAD);
    else if (opt.proxy == PROXY_SOCKS5)
        slot_send(s, SOCKS_GREETING, sizeof SOCKS_GREETING, SOCKS_METHOD);
    else
        slot_send(s, s->t->hello, s->t->hello_len, ANSWER);
}

static void slot_start(struct run *r, struct slot *s) {
    s->t = &opt.targets[r->started % (long)opt.ntargets];
    r->started++;
    r->active++;
    s->got = 0;
    s->out_len = 0;
    s->t0 = now();
    s->deadline = s->t0 + r->timeout;
    s->fd = tcp_socket(1);
    if (s->fd < 0) {
        error_add(&r->errors, "socket: %s", strerror(errno));
        s->state = IDLE;
        r->active--;
        return;
    }
    struct sockaddr_in a = connect_address();
    int rc = connect(s->fd, (struct sockaddr *)&a, sizeof a);
    struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET, .data.ptr = s};
    epoll_ctl(r->ep, EPOLL_CTL_ADD, s->fd, &ev);
    if (rc == 0)
        slot_connected(s);
    else if (errno == EINPROGRESS)
        s->state = CONNECTING;
    else {
        error_add(&r->errors, "connect: %s", strerror(errno));
        close(s->fd);
        s->state = IDLE;
        r->active--;
    }
}

static void slot_end(struct run *r, struct slot *s, const char *error) {
    if (error)
        error_add(&r->errors, "%s in %s", error, STATE_NAMES[s->state]);
    else {
        r->done++;
        if (r->lat)
            latency_add(r->lat, now() - s->t0);
    }
    close(s->fd);
    s->fd = -1;
    s->state = IDLE;
    r->active--;
    r->last_end = now();
}

/* What the bytes in s->buf complete; NULL while the slot is fine, else why it failed. */
static const char *slot_advance(struct slot *s, int *finished) {
    switch (s->state) {
    case HEAD: {
        long end = head_end(s->buf, s->got);
        if (end < 0)
            return s->got == sizeof s->buf ? "oversized CONNECT answer" : NULL;
        if (!status_is_200(s->buf, s->got))
            return "CONNECT refused (not 200)";
        if ((size_t)end != s->got)
            return "bytes after the CONNECT answer";
        s->got = 0;
        slot_send(s, s->t->hello, s->t->hello_len, ANSWER);
        return NULL;
    }
    case SOCKS_METHOD:
        if (s->got < 2)
            return NULL;
        if (s->got > 2 || s->buf[0] != 5 || s->buf[1] != 0)
            return "SOCKS5 method refused";
        s->got = 0;
        slot_send(s, s->t->socks, s->t->socks_len, SOCKS_REPLY);
        return NULL;
    case SOCKS_REPLY: {
        size_t need = socks_reply_len(s->buf, s->got);
        if (s->got >= 2 && (s->buf[0] != 5 || s->buf[1] != 0))
            return "SOCKS5 CONNECT refused";
        if (!need || s->got < need)
            return s->got >= 5 && !need ? "malformed SOCKS5 reply" : NULL;
        if (s->got > need)
            return "bytes after the SOCKS5 reply";
        s->got = 0;
        slot_send(s, s->t->hello, s->t->hello_len, ANSWER);
        return NULL;
    }
    case ANSWER:
        if (!s->got)
            return NULL;
        if (s->buf[0] != READY_BYTE)
            return "unexpected answer to the first flight";
        *finished = 1;
        return NULL;
    default:
        return "bytes before the tunnel was set up";
    }
}

static void slot_event(struct run *r, struct slot *s, uint32_t events) {
    if (s->state == CONNECTING) {
        int err = 0;
        socklen_t len = sizeof err;
        getsockopt(s->fd, SOL_SOCKET, SO_ERROR, &err, &len);
        if (err) {
            errno = err;
            slot_end(r, s, strerror(err));
            return;
        }
        if (!(events & EPOLLOUT))
            return;
        slot_connected(s);
    } else if (s->out_len && (events & EPOLLOUT)) {
        slot_send(s, s->out, s->out_len, s->state);
    }
    if (!(events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)))
        return;
    for (;;) {
        ssize_t n = recv(s->fd, s->buf + s->got, sizeof s->buf - s->got, 0);
        if (n == 0) {
            slot_end(r, s, "closed");
            return;
        }
        if (n < 0) {
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                slot_end(r, s, strerror(errno));
            return;
        }
        s->got += (size_t)n;
        int finished = 0;
        const char *error = slot_advance(s, &finished);
        if (error || finished) {
            slot_end(r, s, error);
            return;
        }
        if (s->got == sizeof s->buf) {
            slot_end(r, s, "oversized answer");
            return;
        }
    }
}

static int may_start(struct run *r) {
    return r->started < r->count && now() < r->stop_starting && r->errors.count < ERROR_LIMIT;
}

/* `count` tunnels (or as many as `seconds` allow) by `concurrency` slots; the wall time. */
static double run_tunnels(struct run *r, long concurrency, long count, double seconds) {
    struct slot *slots = calloc((size_t)concurrency, sizeof *slots);
    struct epoll_event events[256];
    double t0 = now();
    double hard_stop = t0 + seconds + r->timeout + 5;
    r->count = count;
    r->stop_starting = t0 + seconds;
    r->ep = epoll_create1(EPOLL_CLOEXEC);
    for (long i = 0; i < concurrency; i++)
        if (may_start(r))
            slot_start(r, &slots[i]);
    double next_scan = t0 + 0.1;
    while (r->active > 0 || may_start(r)) {
        int n = epoll_wait(r->ep, events, 256, 50);
        for (int i = 0; i < n; i++)
            slot_event(r, events[i].data.ptr, events[i].events);
        double t = now();
        if (t >= next_scan || t > hard_stop) {
            next_scan = t + 0.1;
            for (long i = 0; i < concurrency; i++)
                if (slots[i].state != IDLE && (t > slots[i].deadline || t > hard_stop))
                    slot_end(r, &slots[i], "timeout");
        }
        for (long i = 0; i < concurrency; i++)
            if (slots[i].state == IDLE && may_start(r))
                slot_start(r, &slots[i]);
    }
    close(r->ep);
    free(slots);
    return r->last_end > t0 ? r->last_end - t0 : 0.0;
}

static int tunnels_main(void) {
    prepare_targets();
    if (opt.warmup > 0) {
        struct run warm = {.errors = {PTHREAD_MUTEX_INITIALIZER, 0, {{0}}}, .timeout = opt.timeout};
        run_tunnels(&warm, 1, opt.warmup, 10.0);
        if (warm.errors.count || !warm.done)
            failed("warm-up tunnels failed: %s", warm.errors.count ? warm.errors.first[0] : "none done");
    }
    if (!ready_then_go())
        return 0;
    struct latencies lat = {0};
    struct run r = {.errors = {PTHREAD_MUTEX_INITIALIZER, 0, {{0}}}, .timeout = opt.timeout,
                    .lat = &lat};
    double cpu0 = cpu_self();
    double wall = run_tunnels(&r, opt.concurrency, opt.count, opt.seconds);
    print_result(NULL, r.done, &r.errors, &lat, wall, cpu_self() - cpu0);
    return 0;
}

/* -- blocking tunnels (bulk, https) -------------------------------------------------------- */

static int send_all(int fd, const void *data, size_t len) {
    const char *p = data;
    while (len) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n <= 0)
            return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static int recv_exact(int fd, void *data, size_t len) {
    char *p = data;
    while (len) {
        ssize_t n = recv(fd, p, len, 0);
        if (n <= 0)
            return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

/* A connected socket through the proxy to the target (before any byte of the ClientHello), or
 * -1 with `why` set. */
static int open_tunnel(struct target *t, char *why, size_t why_len) {
    unsigned char buf[HEAD_LIMIT];
    int fd = tcp_socket(0);
    if (fd < 0) {
        snprintf(why, why_len, "socket: %s", strerror(errno));
        return -1;
    }
    set_timeouts(fd, opt.timeout);
    struct sockaddr_in a = connect_address();
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        snprintf(why, why_len, "connect: %s", strerror(errno));
        goto fail;
    }
    if (opt.proxy == PROXY_CONNECT) {
        size_t got = 0;
        long end = -1;
        if (send_all(fd, t->head, t->head_len) != 0)
            goto io;
        while (end < 0 && got < sizeof buf) {
            ssize_t n = recv(fd, buf + got, sizeof buf - got, 0);
            if (n <= 0)
                goto io;
            got += (size_t)n;
            end = head_end(buf, got);
        }
        if (end < 0 || !status_is_200(buf, got) || (size_t)end != got) {
            snprintf(why, why_len, "CONNECT refused or malformed answer");
            goto fail;
        }
    } else if (opt.proxy == PROXY_SOCKS5) {
        if (send_all(fd, SOCKS_GREETING, 3) || recv_exact(fd, buf, 2))
            goto io;
        if (buf[0] != 5 || buf[1] != 0 || send_all(fd, t->socks, t->socks_len) ||
            recv_exact(fd, buf, 5)) {
            snprintf(why, why_len, "SOCKS5 refused");
            goto fail;
        }
        size_t need = socks_reply_len(buf, 5);
        if (buf[1] != 0 || !need || recv_exact(fd, buf + 5, need - 5)) {
            snprintf(why, why_len, "SOCKS5 CONNECT refused");
            goto fail;
        }
    }
    return fd;
io:
    snprintf(why, why_len, "tunnel set-up: %s", errno ? strerror(errno) : "closed");
fail:
    close(fd);
    return -1;
}

/* The tunnel with the ClientHello sent and the upstream's READY read (bulk). */
static int open_raw_tunnel(struct target *t, char *why, size_t why_len) {
    int fd = open_tunnel(t, why, why_len);
    char answer;
    if (fd < 0)
        return -1;
    if (send_all(fd, t->hello, t->hello_len) || recv_exact(fd, &answer, 1) ||
        answer != READY_BYTE) {
        snprintf(why, why_len, "no READY after the ClientHello: %s", strerror(errno));
        close(fd);
        return -1;
    }
    return fd;
}

/* -- bulk ---------------------------------------------------------------------------------- */

struct transfer {
    pthread_t thread;
    int fd;
    long size;
    double deadline, t0, t1;
    long moved;
    char error[200];
};

static unsigned char bulk_buffer[CHUNK];

static void *transfer_run(void *arg) {
    struct transfer *x = arg;
    unsigned char command[9];
    unsigned char *buf = malloc(CHUNK);
    command[0] = opt.up ? 'U' : 'D';
    for (int i = 0; i < 8; i++)
        command[1 + i] = (unsigned char)((uint64_t)x->size >> (56 - 8 * i));
    x->t0 = now();
    if (send_all(x->fd, command, sizeof command) != 0)
        snprintf(x->error, sizeof x->error, "command: %s", strerror(errno));
    while (!x->error[0] && x->moved < x->size && now() < x->deadline) {
        size_t n = (size_t)(x->size - x->moved < CHUNK ? x->size - x->moved : CHUNK);
        ssize_t got = opt.up ? send(x->fd, bulk_buffer, n, MSG_NOSIGNAL) : recv(x->fd, buf, CHUNK, 0);
        if (got <= 0)
            snprintf(x->error, sizeof x->error, "%s after %ld bytes: %s", opt.up ? "send" : "recv",
                     x->moved, got ? strerror(errno) : "closed");
        else
            x->moved += got;
    }
    if (!x->error[0] && opt.up && x->moved == x->size) {
        unsigned char count[8];
        uint64_t received = 0;
        if (recv_exact(x->fd, count, 8) != 0)
            snprintf(x->error, sizeof x->error, "no byte count from the upstream");
        for (int i = 0; i < 8; i++)
            received = received << 8 | count[i];
        if (!x->error[0] && received != (uint64_t)x->moved)
            snprintf(x->error, sizeof x->error, "upstream received %llu of %ld bytes",
                     (unsigned long long)received, x->moved);
    }
    x->t1 = now();
    if (!x->error[0] && x->moved != x->size)
        snprintf(x->error, sizeof x->error, "moved %ld of %ld bytes within the time", x->moved,
                 x->size);
    free(buf);
    return NULL;
}

static int bulk_main(void) {
    long tunnels = opt.concurrency;
    char why[200];
    struct transfer *x = calloc((size_t)tunnels, sizeof *x);
    if (tunnels < 1 || tunnels > MAX_BULK_TUNNELS || opt.bytes < 1)
        usage("bulk needs 1..256 tunnels and --bytes >= 1");
    prepare_targets();
    /* A first transfer in a fresh process runs slow: warm up on a tunnel of its own. */
    struct transfer warm = {.size = opt.bytes / tunnels < BULK_WARMUP ? opt.bytes / tunnels : BULK_WARMUP};
    if (warm.size < 1)
        warm.size = 1;
    warm.fd = open_raw_tunnel(&opt.targets[0], why, sizeof why);
    if (warm.fd < 0)
        failed("bulk warm-up tunnel: %s", why);
    warm.deadline = now() + opt.seconds;
    transfer_run(&warm);
    close(warm.fd);
    if (warm.error[0])
        failed("bulk warm-up: %s", warm.error);
    for (long i = 0; i < tunnels; i++) {
        x[i].size = opt.bytes / tunnels + (i < opt.bytes % tunnels);
        x[i].fd = open_raw_tunnel(&opt.targets[0], why, sizeof why);
        if (x[i].fd < 0)
            failed("bulk tunnel %ld: %s", i, why);
    }
    if (!ready_then_go())
        return 0;
    double cpu0 = cpu_self();
    double deadline = now() + opt.seconds;
    for (long i = 0; i < tunnels; i++) {
        x[i].deadline = deadline;
        pthread_create(&x[i].thread, NULL, transfer_run, &x[i]);
    }
    long moved = 0;
    double first = 0, last = 0;
    struct errors errors = {PTHREAD_MUTEX_INITIALIZER, 0, {{0}}};
    for (long i = 0; i < tunnels; i++) {
        pthread_join(x[i].thread, NULL);
        close(x[i].fd);
        moved += x[i].moved;
        if (x[i].error[0])
            error_add(&errors, "%s", x[i].error);
        if (i == 0 || x[i].t0 < first)
            first = x[i].t0;
        if (x[i].t1 > last)
            last = x[i].t1;
    }
    char extra[160];
    snprintf(extra, sizeof extra, "\"bytes\":%ld,\"tunnels\":%ld,\"direction\":\"%s\",", moved,
             tunnels, opt.up ? "up" : "down");
    print_result(extra, errors.count ? 0 : tunnels, &errors, NULL, last - first, cpu_self() - cpu0);
    return 0;
}

/* -- https: TLS inside the tunnel, HTTP/1.1 requests --------------------------------------- */

#ifdef BENCH_TLS
static SSL_CTX *tls_context;

static long errors_seen(struct errors *e) {
    pthread_mutex_lock(&e->lock);
    long n = e->count;
    pthread_mutex_unlock(&e->lock);
    return n;
}

struct worker {
    pthread_t thread;
    struct latencies lat;
    long tunnels, requests;
};

static struct {
    pthread_mutex_t lock;
    long started;
    double stop_starting;
    struct errors errors;
} https_state = {PTHREAD_MUTEX_INITIALIZER, 0, 0, {PTHREAD_MUTEX_INITIALIZER, 0, {{0}}}};

static int read_tls(SSL *ssl, unsigned char *buf, size_t len) {
    int n = SSL_read(ssl, buf, (int)len);
    return n > 0 ? n : -1;
}

/* Appends the next TLS read to buf[*got..HEAD_LIMIT); -1 with `why` (naming `what`) when the
 * buffer is full or the connection ends. */
static int read_more(SSL *ssl, unsigned char *buf, size_t *got, const char *what, char *why,
                     size_t why_len) {
    int n = *got < HEAD_LIMIT ? read_tls(ssl, buf + *got, HEAD_LIMIT - *got) : -1;
    if (n < 0) {
        snprintf(why, why_len, "%s: %s", what, *got < HEAD_LIMIT ? "cut short" : "too long");
        return -1;
    }
    *got += (size_t)n;
    return 0;
}

static const char *find_crlf(const char *p, const char *end) {
    for (; p + 1 < end; p++)
        if (p[0] == '\r' && p[1] == '\n')
            return p;
    return NULL;
}

/* Whether b[0..n) holds a whole chunked body: 1, 0 (not yet), -1 (malformed). */
static int chunked_complete(const char *b, size_t n) {
    const char *p = b, *end = b + n;
    for (;;) {
        const char *line = find_crlf(p, end);
        if (!line)
            return 0;
        char *stop;
        long size = strtol(p, &stop, 16);
        if (stop == p || size < 0)
            return -1;
        if (size == 0) {
            /* The last chunk, optional trailers, and the empty line. */
            const char *q = line + 2;
            for (;;) {
                const char *next = find_crlf(q, end);
                if (!next)
                    return 0;
                if (next == q)
                    return next + 2 == end ? 1 : -1;
                q = next + 2;
            }
        }
        if (end - (line + 2) < size + 2)
            return 0;
        p = line + 2 + size;
        if (p[0] != '\r' || p[1] != '\n')
            return -1;
        p += 2;
    }
}

/* Reads one HTTP/1.1 response (Content-Length or chunked); 0 when it was a 200. */
static int read_response(SSL *ssl, char *why, size_t why_len) {
    unsigned char buf[HEAD_LIMIT + 1];
    size_t got = 0;
    long end = -1;
    while (end < 0) {
        if (read_more(ssl, buf, &got, "response head", why, why_len))
            return -1;
        end = head_end(buf, got);
    }
    if (!status_is_200(buf, got)) {
        snprintf(why, why_len, "response %.12s", buf);
        return -1;
    }
    unsigned char first = buf[end]; /* the head is searched as a string: end it there a moment */
    buf[end] = 0;
    const char *cl = strcasestr((char *)buf, "\r\ncontent-length:");
    int chunked = strcasestr((char *)buf, "\r\ntransfer-encoding: chunked") != NULL;
    long want = cl ? strtol(cl + 17, NULL, 10) : 0;
    buf[end] = first;
    size_t rest = got - (size_t)end;
    if (cl && !chunked) {
        long have = (long)rest;
        while (have < want) {
            int n = read_tls(ssl, buf, sizeof buf - 1);
            if (n < 0) {
                snprintf(why, why_len, "body cut short");
                return -1;
            }
            have += n;
        }
        return have == want ? 0 : (snprintf(why, why_len, "bytes past the body"), -1);
    }
    if (!chunked) {
        snprintf(why, why_len, "response without a length");
        return -1;
    }
    /* Chunked: bodies here are small, so the whole body is buffered until it is complete. */
    memmove(buf, buf + end, rest);
    got = rest;
    for (;;) {
        int complete = chunked_complete((const char *)buf, got);
        if (complete < 0) {
            snprintf(why, why_len, "malformed chunked body");
            return -1;
        }
        if (complete)
            return 0;
        if (read_more(ssl, buf, &got, "chunked body", why, why_len))
            return -1;
    }
}

static long claim_tunnel(void) {
    pthread_mutex_lock(&https_state.lock);
    long i = -1;
    if (https_state.started < opt.count && now() < https_state.stop_starting &&
        errors_seen(&https_state.errors) < ERROR_LIMIT)
        i = https_state.started++;
    pthread_mutex_unlock(&https_state.lock);
    return i;
}

/* One tunnel: CONNECT, TLS handshake, `requests` requests; the latency of each request, or of
 * the whole tunnel when it carries one request. */
static void https_tunnel(struct worker *w, struct target *t, long requests) {
    char why[200], request[600];
    double t0 = now();
    int fd = open_tunnel(t, why, sizeof why);
    if (fd < 0) {
        error_add(&https_state.errors, "%s", why);
        return;
    }
    SSL *ssl = SSL_new(tls_context);
    SSL_set_fd(ssl, fd);
    SSL_set_tlsext_host_name(ssl, t->host);
    SSL_set1_host(ssl, t->host);
    if (SSL_connect(ssl) != 1) {
        unsigned long e = ERR_get_error();
        error_add(&https_state.errors, "TLS handshake: %s",
                  e ? ERR_reason_error_string(e) : "closed");
        ERR_clear_error();
        goto done;
    }
    w->tunnels++;
    char authority[300];
    if (opt.port == 443)
        snprintf(authority, sizeof authority, "%s", t->host);
    else /* as a client writes it: the port when it is not the scheme's default */
        snprintf(authority, sizeof authority, "%s:%d", t->host, opt.port);
    int len = snprintf(request, sizeof request, "GET %s HTTP/1.1\r\nHost: %s\r\n\r\n", opt.path,
                       authority);
    for (long i = 0; i < requests; i++) {
        double r0 = now();
        if (i && r0 > https_state.stop_starting)
            break;
        if (SSL_write(ssl, request, len) != len) {
            error_add(&https_state.errors, "request: TLS write failed");
            break;
        }
        if (read_response(ssl, why, sizeof why) != 0) {
            error_add(&https_state.errors, "%s", why);
            break;
        }
        w->requests++;
        latency_add(&w->lat, now() - (requests == 1 ? t0 : r0));
    }
done:
    SSL_free(ssl);
    close(fd);
}

static void *https_worker(void *arg) {
    struct worker *w = arg;
    long i;
    while ((i = claim_tunnel()) >= 0)
        https_tunnel(w, &opt.targets[i % (long)opt.ntargets], opt.requests);
    return NULL;
}

static int https_main(void) {
    if (!opt.ca)
        usage("https needs --ca FILE");
    if (opt.concurrency > MAX_THREADS)
        usage("https takes at most 1024 concurrent tunnels");
    prepare_targets();
    tls_context = SSL_CTX_new(TLS_client_method());
    SSL_CTX_set_verify(tls_context, SSL_VERIFY_PEER, NULL);
    SSL_CTX_set_session_cache_mode(tls_context, SSL_SESS_CACHE_OFF);
    if (SSL_CTX_load_verify_locations(tls_context, opt.ca, NULL) != 1)
        usage("cannot load the --ca file");
    struct worker warm = {0};
    https_state.stop_starting = now() + 10.0;
    for (long i = 0; i < opt.warmup; i++) /* a request each: the handshake is what warms up */
        https_tunnel(&warm, &opt.targets[0], 1);
    if (https_state.errors.count || (opt.warmup && !warm.requests))
        failed("https warm-up failed: %s", https_state.errors.count ? https_state.errors.first[0] : "no request");
    if (!ready_then_go())
        return 0;
    struct worker *w = calloc((size_t)opt.concurrency, sizeof *w);
    double cpu0 = cpu_self(), t0 = now();
    https_state.stop_starting = t0 + opt.seconds;
    for (long i = 0; i < opt.concurrency; i++)
        pthread_create(&w[i].thread, NULL, https_worker, &w[i]);
    struct latencies all = {0};
    long tunnels = 0, requests = 0;
    for (long i = 0; i < opt.concurrency; i++) {
        pthread_join(w[i].thread, NULL);
        tunnels += w[i].tunnels;
        requests += w[i].requests;
        for (size_t j = 0; j < w[i].lat.n; j++)
            latency_add(&all, w[i].lat.v[j] / 1e6);
    }
    double wall = now() - t0;
    char extra[96];
    snprintf(extra, sizeof extra, "\"tunnels\":%ld,\"requests\":%ld,", tunnels, requests);
    print_result(extra, requests, &https_state.errors, &all, wall, cpu_self() - cpu0);
    return 0;
}
#else
static int https_main(void) {
    failed("https: this load generator was built without OpenSSL (libssl-dev)");
    return 0;
}
#endif

/* -- the upstream -------------------------------------------------------------------------- */

struct upstream_conn {
    unsigned char header[5]; /* the TLS record header: its length is in bytes 3 and 4 */
    size_t got, need;
    int answered;
    int line; /* the opaque port's: answered once a line (up to LF) has been read */
};

static void *stdin_watch(void *arg) {
    (void)arg;
    char buf[256];
    while (read(0, buf, sizeof buf) > 0) {
    }
    _exit(0); /* the harness closed our stdin (or ended) */
}

static int listen_loopback(int nonblocking) {
    int fd = tcp_socket(nonblocking);
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = loopback(0);
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) || listen(fd, 4096))
        failed("upstream listen: %s", strerror(errno));
    return fd;
}

static int port_of(int fd) {
    struct sockaddr_in a;
    socklen_t len = sizeof a;
    getsockname(fd, (struct sockaddr *)&a, &len);
    return ntohs(a.sin_port);
}

static void *bulk_connection(void *arg) {
    int fd = (int)(intptr_t)arg;
    unsigned char head[5], command[9], *buf = malloc(CHUNK);
    set_timeouts(fd, 30.0);
    if (recv_exact(fd, head, 5) || recv_exact(fd, buf, (size_t)head[3] << 8 | head[4]) ||
        send_all(fd, "R", 1) || recv_exact(fd, command, 9))
        goto done;
    uint64_t size = 0, total = 0;
    for (int i = 1; i < 9; i++)
        size = size << 8 | command[i];
    set_timeouts(fd, 0); /* blocking without a timeout: the client's deadline bounds it */
    if (command[0] == 'U') {
        ssize_t n;
        while (total < size && (n = recv(fd, buf, CHUNK, 0)) > 0)
            total += (uint64_t)n;
        unsigned char count[8];
        for (int i = 0; i < 8; i++)
            count[i] = (unsigned char)(total >> (56 - 8 * i));
        send_all(fd, count, 8);
    } else if (command[0] == 'D') {
        while (total < size) {
            size_t n = size - total < CHUNK ? (size_t)(size - total) : CHUNK;
            if (send_all(fd, bulk_buffer, n))
                break;
            total += n;
        }
    }
    set_timeouts(fd, 30.0);
    while (recv(fd, buf, CHUNK, 0) > 0) {
    }
done:
    free(buf);
    close(fd);
    return NULL;
}

static void *bulk_server(void *arg) {
    int listener = (int)(intptr_t)arg;
    for (;;) {
        int fd = accept4(listener, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0)
            continue;
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &attr, bulk_connection, (void *)(intptr_t)fd) != 0)
            close(fd);
        pthread_attr_destroy(&attr);
    }
    return NULL;
}

static void upstream_read(struct upstream_conn *c, int fd) {
    unsigned char buf[16384];
    for (;;) {
        ssize_t n = recv(fd, buf, sizeof buf, 0);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
            close(fd);
            return;
        }
        if (n < 0)
            return;
        if (c->answered)
            continue;
        if (c->line) {
            c->got += (size_t)n;
            if (memchr(buf, '\n', (size_t)n)) {
                c->answered = 1;
                send(fd, "R", 1, MSG_NOSIGNAL);
            } else if (c->got > 65536) {
                close(fd);
                return;
            }
            continue;
        }
        for (ssize_t i = 0; i < n && c->got + (size_t)i < 5; i++)
            c->header[c->got + (size_t)i] = buf[i];
        c->got += (size_t)n;
        if (!c->need && c->got >= 5)
            c->need = 5 + ((size_t)c->header[3] << 8 | c->header[4]);
        if (c->need && c->got >= c->need) {
            c->answered = 1;
            send(fd, "R", 1, MSG_NOSIGNAL);
        } else if (c->got > 65536) {
            close(fd);
            return;
        }
    }
}

static int upstream_main(void) {
    int tunnel = listen_loopback(1), opaque = listen_loopback(1), bulk = listen_loopback(0);
    struct rlimit nofile;
    getrlimit(RLIMIT_NOFILE, &nofile);
    size_t max_fd = nofile.rlim_cur < 1048576 ? (size_t)nofile.rlim_cur : 1048576;
    struct upstream_conn *conns = calloc(max_fd, sizeof *conns);
    pthread_t t;
    pthread_create(&t, NULL, stdin_watch, NULL);
    pthread_create(&t, NULL, bulk_server, (void *)(intptr_t)bulk);
    alarm(UPSTREAM_LIFETIME);
    printf("{\"pid\":%d,\"tunnel\":%d,\"opaque\":%d,\"bulk\":%d,\"tls\":%s}\n", getpid(),
           port_of(tunnel), port_of(opaque), port_of(bulk),
#ifdef BENCH_TLS
           "true"
#else
           "false"
#endif
    );
    fflush(stdout);
    int ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN | EPOLLET, .data.fd = tunnel}, events[256];
    epoll_ctl(ep, EPOLL_CTL_ADD, tunnel, &ev);
    ev.data.fd = opaque;
    epoll_ctl(ep, EPOLL_CTL_ADD, opaque, &ev);
    for (;;) {
        int n = epoll_wait(ep, events, 256, -1);
        for (int i = 0; i < n; i++) {
            int fd = events[i].data.fd;
            if (fd != tunnel && fd != opaque) {
                upstream_read(&conns[fd], fd);
                continue;
            }
            int c;
            while ((c = accept4(fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC)) >= 0) {
                if ((size_t)c >= max_fd) {
                    close(c);
                    continue;
                }
                int one = 1;
                setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                conns[c] = (struct upstream_conn){{0}, 0, 0, 0, fd == opaque};
                struct epoll_event cev = {.events = EPOLLIN | EPOLLRDHUP | EPOLLET, .data.fd = c};
                epoll_ctl(ep, EPOLL_CTL_ADD, c, &cev);
            }
        }
    }
    return 0;
}

/* -- options ------------------------------------------------------------------------------- */

static long number(const char *text, long lo, long hi, const char *what) {
    char *end;
    long v = strtol(text, &end, 10);
    if (*end || v < lo || v > hi) {
        fprintf(stderr, "loadgen: %s must be %ld..%ld\n", what, lo, hi);
        exit(2);
    }
    return v;
}

static double seconds_of(const char *text, const char *what) {
    char *end;
    double v = strtod(text, &end);
    if (*end || !(v > 0 && v <= 3600)) {
        fprintf(stderr, "loadgen: %s must be a number of seconds in (0, 3600]\n", what);
        exit(2);
    }
    return v;
}

int main(int argc, char **argv) {
    static const struct option options[] = {
        {"proxy", required_argument, 0, 'x'},     {"proxy-port", required_argument, 0, 'P'},
        {"port", required_argument, 0, 'p'},      {"targets", required_argument, 0, 'T'},
        {"concurrency", required_argument, 0, 'c'}, {"count", required_argument, 0, 'n'},
        {"seconds", required_argument, 0, 's'},   {"warmup", required_argument, 0, 'w'},
        {"timeout", required_argument, 0, 't'},   {"direction", required_argument, 0, 'd'},
        {"bytes", required_argument, 0, 'b'},     {"ca", required_argument, 0, 'C'},
        {"path", required_argument, 0, 'u'},      {"requests", required_argument, 0, 'r'},
        {"address", required_argument, 0, 'a'},   {0, 0, 0, 0}};
    if (argc < 2)
        usage("usage: loadgen upstream|tunnels|bulk|https [options]");
    const char *mode = argv[1];
    const char *targets = NULL;
    int c;
    optind = 2;
    while ((c = getopt_long(argc, argv, "", options, NULL)) != -1) {
        switch (c) {
        case 'x':
            if (!strcmp(optarg, "none")) opt.proxy = PROXY_NONE;
            else if (!strcmp(optarg, "connect")) opt.proxy = PROXY_CONNECT;
            else if (!strcmp(optarg, "socks5")) opt.proxy = PROXY_SOCKS5;
            else usage("--proxy is none, connect or socks5");
            break;
        case 'P': opt.proxy_port = (int)number(optarg, 1, 65535, "--proxy-port"); break;
        case 'p': opt.port = (int)number(optarg, 1, 65535, "--port"); break;
        case 'T': targets = optarg; break;
        case 'c': opt.concurrency = number(optarg, 1, MAX_THREADS, "--concurrency"); break;
        case 'n': opt.count = number(optarg, 1, MAX_COUNT, "--count"); break;
        case 's': opt.seconds = seconds_of(optarg, "--seconds"); break;
        case 'w': opt.warmup = number(optarg, 0, 100000, "--warmup"); break;
        case 't': opt.timeout = seconds_of(optarg, "--timeout"); break;
        case 'd':
            if (strcmp(optarg, "up") && strcmp(optarg, "down")) usage("--direction is up or down");
            opt.up = !strcmp(optarg, "up");
            break;
        case 'b': opt.bytes = number(optarg, 1, 1L << 40, "--bytes"); break;
        case 'C': opt.ca = optarg; break;
        case 'u': opt.path = optarg; break;
        case 'r': opt.requests = number(optarg, 1, 1000000, "--requests"); break;
        case 'a': {
            struct in_addr in;
            if (inet_pton(AF_INET, optarg, &in) != 1 || (ntohl(in.s_addr) >> 24) != 127)
                usage("--address is an IPv4 address in 127.0.0.0/8");
            opt.address = ntohl(in.s_addr);
            break;
        }
        default: usage("unknown option");
        }
    }
    if (!strcmp(mode, "upstream"))
        return upstream_main();
    if (!targets || !opt.port || (opt.proxy != PROXY_NONE && !opt.proxy_port))
        usage("a client needs --targets, --port and (through a proxy) --proxy-port");
    if (strlen(opt.path) > 400 || opt.path[0] != '/')
        usage("--path is an absolute path of at most 400 bytes");
    load_targets(targets);
    if (!strcmp(mode, "tunnels"))
        return tunnels_main();
    if (!strcmp(mode, "bulk"))
        return bulk_main();
    if (!strcmp(mode, "https"))
        return https_main();
    usage("the mode is upstream, tunnels, bulk or https");
    return 2;
}
