/* The test bed's second Grid Engine execution host on this one machine: an identity of its own on loopback.
 *
 * Preloaded into that host's sge_execd with HPCDL_SGE_HOST_NAME=NAME and HPCDL_SGE_HOST_ADDR=127.0.0.N (NAME is
 * that address's in /etc/hosts). In Grid Engine's own programs (those in /usr/lib/gridengine: the daemon and the
 * shepherds it starts, which inherit the library) it
 *   - answers gethostname() and uname() with NAME: the host Grid Engine names in queues and $PE_HOSTFILE;
 *   - binds what they bind to "any address" to that address instead, so two execds listen on the same port (Grid
 *     Engine has one execd port for every host) at two addresses;
 *   - binds their outgoing TCP connections to that address: Grid Engine checks that the host name a program says
 *     it runs on is the name of the address it connects from.
 * The jobs' own programs run without it (the shepherd gives a job an environment without LD_PRELOAD): they are
 * this machine, under its own name and address, as Grid Engine's clients they start (qstat, qrsh) say.
 * IPv4 only: Grid Engine 8.1.9's communication library binds and connects IPv4 sockets.
 * The first host's execd is preloaded with its address alone, so that it does not take the port on every address.
 * (Measured in ../shared/notes/gridengine.md: two execds on one machine need separate host identities.) */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/utsname.h>
#include <unistd.h>

static struct in_addr host_addr;
static int have_addr;
static const char *host_name;

typedef int (*sock_call)(int, const struct sockaddr *, socklen_t);

/* The C library's own bind/connect, looked up when first needed (a constructor of another library may call them
 * before this one's has run). */
static sock_call next_call(sock_call *cached, const char *name)
{
    if (!*cached)
        *cached = (sock_call)dlsym(RTLD_NEXT, name);
    return *cached;
}

static int real_bind(int fd, const struct sockaddr *sa, socklen_t len)
{
    static sock_call call;
    sock_call f = next_call(&call, "bind");
    if (!f) {
        errno = ENOSYS;
        return -1;
    }
    return f(fd, sa, len);
}

static int real_connect(int fd, const struct sockaddr *sa, socklen_t len)
{
    static sock_call call;
    sock_call f = next_call(&call, "connect");
    if (!f) {
        errno = ENOSYS;
        return -1;
    }
    return f(fd, sa, len);
}

__attribute__((constructor)) static void init(void)
{
    static const char sge_programs[] = "/usr/lib/gridengine/";
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    const char *addr = getenv("HPCDL_SGE_HOST_ADDR"), *name = getenv("HPCDL_SGE_HOST_NAME");
    if (n <= 0)
        return;
    exe[n] = '\0';
    if (strncmp(exe, sge_programs, sizeof sge_programs - 1) != 0)
        return;
    have_addr = addr && inet_pton(AF_INET, addr, &host_addr) == 1;
    if (name && *name && strlen(name) < sizeof ((struct utsname *)0)->nodename)
        host_name = name;
}

int gethostname(char *out, size_t len)
{
    static int (*real)(char *, size_t);
    if (!host_name) {
        if (!real)
            real = (int (*)(char *, size_t))dlsym(RTLD_NEXT, "gethostname");
        return real(out, len);
    }
    if (strlen(host_name) >= len) {
        errno = ENAMETOOLONG;
        return -1;
    }
    strcpy(out, host_name);
    return 0;
}

int uname(struct utsname *buf)
{
    static int (*real)(struct utsname *);
    int rc;
    if (!real)
        real = (int (*)(struct utsname *))dlsym(RTLD_NEXT, "uname");
    rc = real(buf);
    if (rc == 0 && host_name)
        strcpy(buf->nodename, host_name);
    return rc;
}

int bind(int fd, const struct sockaddr *sa, socklen_t len)
{
    if (have_addr && sa && sa->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in in;
        memcpy(&in, sa, sizeof in);
        if (in.sin_addr.s_addr == htonl(INADDR_ANY)) {
            in.sin_addr = host_addr;
            return real_bind(fd, (const struct sockaddr *)&in, sizeof in);
        }
    }
    return real_bind(fd, sa, len);
}

int connect(int fd, const struct sockaddr *sa, socklen_t len)
{
    if (have_addr && sa && sa->sa_family == AF_INET) {
        struct sockaddr_in local;
        socklen_t local_len = sizeof local;
        int type = 0;
        socklen_t type_len = sizeof type;
        if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &type_len) == 0 && type == SOCK_STREAM &&
            getsockname(fd, (struct sockaddr *)&local, &local_len) == 0 && local.sin_family == AF_INET &&
            local.sin_port == 0) { /* not bound yet: from this host's address */
            struct sockaddr_in from;
            memset(&from, 0, sizeof from);
            from.sin_family = AF_INET;
            from.sin_addr = host_addr;
            if (real_bind(fd, (const struct sockaddr *)&from, sizeof from) != 0) /* the qmaster will not know us */
                fprintf(stderr, "sge-hostaddr: binding a connection to this host's address: %s\n", strerror(errno));
        }
    }
    return real_connect(fd, sa, len);
}
