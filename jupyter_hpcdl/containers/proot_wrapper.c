/* proot wrapper for udocker with Debian's proot 5.1.0 (see docs/udocker-offline.md).
 *
 * 1. Drops "-k RELEASE" / "--kernel-release=RELEASE" before "-r": with proot 5.1.0 the faked kernel release
 *    breaks the loading of glibc >= 2.33 inside the container.
 * 2. Makes statx and faccessat2 fail with ENOSYS (seccomp filter, inherited by proot and the container):
 *    proot 5.1.0 does not translate their paths, glibc then falls back to newfstatat/faccessat, which it does.
 * Then execs the real proot, found beside this program as "<own path>.real". */
#include <errno.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef __NR_statx
#define __NR_statx 332
#endif
#ifndef __NR_faccessat2
#define __NR_faccessat2 439
#endif

static int install_filter(void) {
    struct sock_filter filter[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_statx, 2, 0),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_faccessat2, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (ENOSYS & SECCOMP_RET_DATA)),
    };
    struct sock_fprog prog = {.len = sizeof(filter) / sizeof(filter[0]), .filter = filter};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return -1;
    return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog);
}

int main(int argc, char **argv) {
    char self[4096], real[4200];
    ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n <= 0) { perror("hpcdl proot wrapper: readlink /proc/self/exe"); return 127; }
    self[n] = '\0';
    snprintf(real, sizeof(real), "%s.real", self);

    char **args = calloc((size_t)argc + 1, sizeof(char *));
    if (!args) return 127;
    int j = 0, before_root = 1;
    args[j++] = real;
    for (int i = 1; i < argc; i++) {
        if (before_root && strcmp(argv[i], "-r") == 0) before_root = 0;
        if (before_root && strcmp(argv[i], "-k") == 0 && i + 1 < argc) { i++; continue; }
        if (before_root && strncmp(argv[i], "--kernel-release=", 17) == 0) continue;
        args[j++] = argv[i];
    }
    args[j] = NULL;
    if (install_filter() != 0) { perror("hpcdl proot wrapper: seccomp filter"); return 127; }
    execv(real, args);
    fprintf(stderr, "hpcdl proot wrapper: cannot run %s: %s\n", real, strerror(errno));
    return 127;
}
