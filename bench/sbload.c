/*
 * sbload: an open-loop HTTP/1.1 load whose clients behave like real ones under overload.
 *
 * h2load (bench.native) is the benches' generator, but two of its habits measure itself
 * rather than the gateway once the gateway refuses (docs/performance-results.md, "Clients
 * held, and h2load pipelining after a close"): a client whose connect is refused is gone for
 * the run, and a client whose connection the server closed pipelines every request it owes
 * on the next one. Here each client holds one request at a time, never pipelines, and
 * reconnects on its own after a refused connect (after a jittered backoff, 50 ms doubling
 * to 1 s), a reset, or a close; the clients connect evenly over the ramp and each sends its
 * share of the requests at its rate, a request due while the previous one is unanswered
 * going as soon as it is, until its schedule ends (its share / its rate after its start):
 * an arrival not sent by then is shed (started < total), never sent late.
 *
 * It prints h2load's summary lines and writes h2load's per-request log (start in µs since
 * the epoch, status or -1, µs until the end), so bench.native reads either tool.
 *
 *   sbload HOST PORT PATH BODY_FILE CLIENTS REQUESTS RATE_PER_CLIENT RAMP_S TIMEOUT_S
 *          DEADLINE_S LOG_FILE [HEADER...]
 *
 * Single-threaded, epoll; loopback benches only. Exits by itself: when every request was
 * answered or failed, or at DEADLINE_S (what is in flight is then started, not done).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum { DOWN, CONNECTING, IDLE, BUSY };

typedef struct {
    int fd;
    int state;
    double start;     /* when this client connects first (its place in the ramp) */
    long share;       /* requests this client sends in all */
    long sent;        /* requests started */
    double retry_at;  /* DOWN: not before then */
    double backoff;   /* the next reconnect's delay */
    double req_mono;  /* BUSY: when the request went */
    double req_wall;  /* the same, µs since the epoch */
    size_t woff;      /* BUSY: bytes of the request written */
    char *rbuf;
    size_t rlen, rcap;
} client;

static struct sockaddr_in addr;
static char *request;
static size_t request_len;
static client *clients;
static long nclients, requests_total;
static double rate, ramp, timeout_s;
static int ep;
static FILE *logf;
static long started, done, ok2, c3, c4, c5, failed, timedout, connect_failed;

static double mono(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static double wall_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

static double jitter(double d) { return d * (0.5 + (double)rand() / RAND_MAX); }

static void *must(void *p) {
    if (p == NULL) {
        perror("sbload");
        exit(1);
    }
    return p;
}

static void drop(client *c, double now, double delay) {
    if (c->fd >= 0) {
        epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
        close(c->fd);
    }
    c->fd = -1;
    c->state = DOWN;
    c->rlen = 0;
    c->retry_at = now + delay;
}

static void log_request(client *c, int status, double now) {
    fprintf(logf, "%.0f\t%d\t%.0f\n", c->req_wall, status, (now - c->req_mono) * 1e6);
    done++;
}

/* The request in flight failed (reset, closed, timed out): logged -1, and the client
 * reconnects after its backoff. */
static void fail(client *c, double now, int timed_out) {
    if (c->state == BUSY) {
        log_request(c, -1, now);
        failed++;
        timedout += timed_out;
    }
    drop(c, now, jitter(c->backoff));
    c->backoff = c->backoff * 2 > 1.0 ? 1.0 : c->backoff * 2;
}

static void connect_client(client *c, double now) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (fd < 0) {
        c->retry_at = now + 0.05;
        return;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    c->fd = fd;
    c->state = CONNECTING;
    struct epoll_event ev = {.events = EPOLLOUT | EPOLLIN, .data.ptr = c};
    epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0 && errno != EINPROGRESS) {
        connect_failed++;
        fail(c, now, 0);
    }
}

static void try_write(client *c, double now) {
    while (c->woff < request_len) {
        ssize_t n = write(c->fd, request + c->woff, request_len - c->woff);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT, .data.ptr = c};
                epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &ev);
                return;
            }
            fail(c, now, 0);
            return;
        }
        c->woff += (size_t)n;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
    epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &ev);
}

static void send_request(client *c, double now) {
    c->state = BUSY;
    c->woff = 0;
    c->rlen = 0;
    c->req_mono = now;
    c->req_wall = wall_us();
    c->sent++;
    started++;
    try_write(c, now);
}

/* A whole response in the buffer: its status, and whether the server closes after it;
 * 0 while incomplete. */
static int parse(client *c, int *closes) {
    char *end = memmem(c->rbuf, c->rlen, "\r\n\r\n", 4);
    if (end == NULL || c->rlen < 12)
        return 0;
    size_t head = (size_t)(end - c->rbuf) + 4;
    long length = 0;
    *closes = 0;
    for (char *line = c->rbuf; line < end;) {
        char *eol = memmem(line, (size_t)(end + 2 - line), "\r\n", 2);
        if (eol == NULL)
            break;
        if (eol - line > 15 && strncasecmp(line, "content-length:", 15) == 0)
            length = strtol(line + 15, NULL, 10);
        else if (eol - line >= 17 && strncasecmp(line, "connection:", 11) == 0 &&
                 memmem(line, (size_t)(eol - line), "close", 5) != NULL)
            *closes = 1;
        line = eol + 2;
    }
    if (c->rlen < head + (size_t)length)
        return 0;
    return atoi(c->rbuf + 9);
}

static void on_readable(client *c, double now) {
    int eof = 0;
    for (;;) {
        if (c->rcap - c->rlen < 4096) {
            c->rcap = c->rcap * 2 + 8192;
            c->rbuf = must(realloc(c->rbuf, c->rcap));
        }
        ssize_t n = read(c->fd, c->rbuf + c->rlen, c->rcap - c->rlen);
        if (n == 0) {
            eof = 1;
            break;
        }
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                break;
            if (c->state == BUSY && c->rlen > 0) {
                eof = 1; /* a reset after the answer: read what came first */
                break;
            }
            fail(c, now, 0);
            return;
        }
        c->rlen += (size_t)n;
    }
    if (c->state != BUSY) {
        if (eof) /* an idle keep-alive closed by the server: reconnect when due */
            drop(c, now, 0.0);
        return;
    }
    int closes = 0;
    int status = parse(c, &closes);
    if (status == 0) {
        if (eof) /* closed before a whole answer: the request failed */
            fail(c, now, 0);
        return;
    }
    log_request(c, status, now);
    if (status >= 200 && status < 300)
        ok2++;
    else if (status < 400)
        c3++;
    else if (status < 500)
        c4++;
    else
        c5++;
    c->backoff = 0.05;
    c->rlen = 0;
    if (closes || eof)
        drop(c, now, 0.0); /* its next request goes on a new connection */
    else
        c->state = IDLE;
}

static long due(client *c, double now) {
    if (now < c->start)
        return 0;
    long n = (long)((now - c->start) * rate) + 1;
    return n < c->share ? n : c->share;
}

int main(int argc, char **argv) {
    if (argc < 12) {
        fprintf(stderr, "usage: sbload HOST PORT PATH BODY_FILE CLIENTS REQUESTS "
                        "RATE_PER_CLIENT RAMP_S TIMEOUT_S DEADLINE_S LOG_FILE [HEADER...]\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    memset(&addr, 0, sizeof addr);
    addr.sin_family = AF_INET;
    addr.sin_port = htons((uint16_t)atoi(argv[2]));
    if (inet_pton(AF_INET, argv[1], &addr.sin_addr) != 1) {
        fprintf(stderr, "sbload: HOST must be an IPv4 address\n");
        return 2;
    }
    FILE *bf = fopen(argv[4], "rb");
    if (bf == NULL) {
        perror("sbload: BODY_FILE");
        return 2;
    }
    fseek(bf, 0, SEEK_END);
    long body_len = ftell(bf);
    fseek(bf, 0, SEEK_SET);
    char *body = must(malloc((size_t)body_len + 1));
    if (fread(body, 1, (size_t)body_len, bf) != (size_t)body_len) {
        perror("sbload: BODY_FILE");
        return 2;
    }
    fclose(bf);
    nclients = atol(argv[5]);
    requests_total = atol(argv[6]);
    rate = atof(argv[7]);
    ramp = atof(argv[8]);
    timeout_s = atof(argv[9]);
    double deadline_s = atof(argv[10]);
    if (nclients < 1 || requests_total < 0 || rate <= 0) {
        fprintf(stderr, "sbload: CLIENTS >= 1, REQUESTS >= 0, RATE_PER_CLIENT > 0\n");
        return 2;
    }
    logf = fopen(argv[11], "w");
    if (logf == NULL) {
        perror("sbload: LOG_FILE");
        return 2;
    }
    size_t headers_len = 0;
    for (int i = 12; i < argc; i++)
        headers_len += strlen(argv[i]) + 2;
    request = must(
        malloc(strlen(argv[3]) + strlen(argv[1]) + headers_len + (size_t)body_len + 256));
    int at = sprintf(request, "POST %s HTTP/1.1\r\nHost: %s:%s\r\nContent-Length: %ld\r\n",
                     argv[3], argv[1], argv[2], body_len);
    for (int i = 12; i < argc; i++)
        at += sprintf(request + at, "%s\r\n", argv[i]);
    at += sprintf(request + at, "\r\n");
    memcpy(request + at, body, (size_t)body_len);
    request_len = (size_t)at + (size_t)body_len;

    ep = epoll_create1(0);
    clients = must(calloc((size_t)nclients, sizeof(client)));
    double t0 = mono();
    srand((unsigned)t0);
    for (long i = 0; i < nclients; i++) {
        client *c = &clients[i];
        c->fd = -1;
        c->state = DOWN;
        c->start = t0 + ramp * (double)i / (double)nclients;
        c->share = requests_total / nclients + (i < requests_total % nclients);
        c->retry_at = c->start;
        c->backoff = 0.05;
    }
    struct epoll_event events[512];
    double deadline = t0 + deadline_s, last_scan = 0;
    for (;;) {
        int n = epoll_wait(ep, events, 512, 1);
        double now = mono();
        for (int i = 0; i < n; i++) {
            client *c = events[i].data.ptr;
            if (c->fd < 0)
                continue;
            if (c->state == CONNECTING) {
                int err = 0;
                socklen_t len = sizeof err;
                getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &len);
                if (err != 0 || (events[i].events & (EPOLLERR | EPOLLHUP))) {
                    connect_failed++;
                    fail(c, now, 0);
                    continue;
                }
                c->state = IDLE;
                struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
                epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &ev);
                continue;
            }
            if (events[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP))
                on_readable(c, now);
            if (c->fd >= 0 && c->state == BUSY && (events[i].events & EPOLLOUT))
                try_write(c, now);
        }
        if (now - last_scan < 0.001 && n > 0)
            continue;
        last_scan = now;
        int active = 0;
        for (long i = 0; i < nclients; i++) {
            client *c = &clients[i];
            /* Open loop: arrivals come until the client's schedule ends (its share at its
             * rate); one not sent by then is shed, never sent late. */
            int sending = c->sent < c->share && now < c->start + (double)c->share / rate;
            if (sending || c->state == BUSY || c->state == CONNECTING)
                active = 1;
            if (c->state == BUSY && now - c->req_mono > timeout_s)
                fail(c, now, 1);
            else if (c->state == DOWN && sending && now >= c->retry_at && now >= c->start)
                connect_client(c, now);
            else if (c->state == IDLE && sending && due(c, now) > c->sent)
                send_request(c, now);
        }
        if (!active || now >= deadline)
            break;
    }
    double wall = mono() - t0;
    fclose(logf);
    printf("finished in %.2fs, %.2f req/s, 0B/s\n", wall, wall > 0 ? (double)done / wall : 0);
    printf("requests: %ld total, %ld started, %ld done, %ld succeeded, %ld failed, %ld errored, "
           "%ld timeout\n",
           requests_total, started, done, ok2 + c3, failed + c4 + c5, failed - timedout,
           timedout);
    printf("status codes: %ld 2xx, %ld 3xx, %ld 4xx, %ld 5xx\n", ok2, c3, c4, c5);
    printf("connects failed: %ld\n", connect_failed);
    return 0;
}
