/* A power cut, simulated for one process (LD_PRELOAD): it keeps, beside the data directory
 * it watches, the directory's *durable image*: every file as of its last fsync, and the
 * directory's names as of its last fsync. A power cut is then: SIGKILL the process, and
 * put the image in place of the directory (tests/powercut/harness.py).
 *
 *   POWERCUT_DIR    the watched directory (absolute); only its direct children count
 *   POWERCUT_IMAGE  where the image is kept: files/<inode> (each file's synced content)
 *                   and names ("<inode> <name>" lines, as of the directory's last fsync)
 *   POWERCUT_FAULT  once the file POWERCUT_IMAGE/arm exists: "lying-fsync": fsync and
 *                   fdatasync answer success and do nothing (a disk that acknowledges
 *                   writes it has not stored); "eio-fsync": every fsync fails with EIO;
 *                   "enospc-write": every write that grows a file fails with ENOSPC
 *
 * What it sees: write, pwrite, pwrite64, writev, pwritev, ftruncate (the ranges each
 * changes, per inode, since the inode's last fsync), fsync and fdatasync (of a file:
 * those ranges copied to its image, the image cut to the file's size; of the directory:
 * its names recorded), open with O_CREAT of a new file (its image starts empty), and a
 * shared writable mmap of a watched file other than a -shm (recorded in
 * POWERCUT_IMAGE/violations: writes through it would bypass this shim). Renames and
 * unlinks change only the live directory: the image's names follow at the next
 * directory fsync, as POSIX promises. What it does not model: writes reordered or lost
 * inside the device, a flush the device drops, a torn sector.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#define MAX_FILES 256
#define FD_CACHE 65536
#define MAX_RANGES 65536
#define WHOLE INT64_MAX

enum { UNKNOWN = 0, IGNORED, WATCHED_FILE, WATCHED_DIR };

typedef struct { int64_t start, end; } Range;

typedef struct {
    ino_t ino;
    int used;
    int whole;      /* too many ranges: copy the whole file at its next fsync */
    size_t count, cap;
    Range *ranges;
} Dirty;

static pthread_mutex_t lock = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;
static char watched[PATH_MAX], image[PATH_MAX - 64];  /* room for the names beside it */
static size_t watched_len;
static int active, lying_fsync, eio_fsync, enospc_write;
static unsigned char fd_class[FD_CACHE];
static Dirty dirty[MAX_FILES];

static ssize_t (*real_write)(int, const void *, size_t);
static ssize_t (*real_pwrite)(int, const void *, size_t, off_t);
static ssize_t (*real_pwrite64)(int, const void *, size_t, off64_t);
static ssize_t (*real_writev)(int, const struct iovec *, int);
static ssize_t (*real_pwritev)(int, const struct iovec *, int, off_t);
static int (*real_ftruncate)(int, off_t);
static int (*real_ftruncate64)(int, off64_t);
static int (*real_fsync)(int);
static int (*real_fdatasync)(int);
static int (*real_open)(const char *, int, ...);
static int (*real_open64)(const char *, int, ...);
static int (*real_openat)(int, const char *, int, ...);
static int (*real_openat64)(int, const char *, int, ...);
static int (*real_close)(int);
static void *(*real_mmap)(void *, size_t, int, int, int, off_t);
static void *(*real_mmap64)(void *, size_t, int, int, int, off64_t);

static void die(const char *what) {
    fprintf(stderr, "powercut shim: %s: %s\n", what, strerror(errno));
    _exit(70);
}

/* The file, beside the image, that holds inode ino's synced content. */
static void image_path(char *out, ino_t ino) {
    snprintf(out, PATH_MAX, "%s/files/%llu", image, (unsigned long long)ino);
}

static int classify(int fd) {
    if (fd >= 0 && fd < FD_CACHE && fd_class[fd] != UNKNOWN) return fd_class[fd];
    char link[64], path[PATH_MAX];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    int kind = IGNORED;
    struct stat st;
    if (n > 0 && fstat(fd, &st) == 0) {
        path[n] = 0;
        if (S_ISDIR(st.st_mode) && strcmp(path, watched) == 0) {
            kind = WATCHED_DIR;
        } else if (S_ISREG(st.st_mode) && (size_t)n > watched_len + 1
                   && strncmp(path, watched, watched_len) == 0 && path[watched_len] == '/'
                   && strchr(path + watched_len + 1, '/') == NULL) {
            size_t len = (size_t)n;
            int shm = len > 4 && strcmp(path + len - 4, "-shm") == 0;
            kind = shm ? IGNORED : WATCHED_FILE;
        }
    }
    if (fd >= 0 && fd < FD_CACHE) fd_class[fd] = (unsigned char)kind;
    return kind;
}

static Dirty *dirty_of(ino_t ino) {
    Dirty *free_slot = NULL;
    for (int i = 0; i < MAX_FILES; i++) {
        if (dirty[i].used && dirty[i].ino == ino) return &dirty[i];
        if (!dirty[i].used && free_slot == NULL) free_slot = &dirty[i];
    }
    if (free_slot == NULL) { errno = EMFILE; die("too many watched files"); }
    free_slot->used = 1;
    free_slot->ino = ino;
    free_slot->whole = 0;
    free_slot->count = 0;
    return free_slot;
}

static void mark(int fd, int64_t start, int64_t end) {
    if (end <= start) return;
    struct stat st;
    if (fstat(fd, &st) != 0) return;
    pthread_mutex_lock(&lock);
    Dirty *d = dirty_of(st.st_ino);
    if (d->count > 0) {  /* an append or a rewrite of the last range: widen it */
        Range *last = &d->ranges[d->count - 1];
        if (start <= last->end && end >= last->start) {
            if (start < last->start) last->start = start;
            if (end > last->end) last->end = end;
            pthread_mutex_unlock(&lock);
            return;
        }
    }
    if (d->count >= MAX_RANGES) {
        d->whole = 1;
        d->count = 0;
    }
    if (!d->whole) {
        if (d->count == d->cap) {
            d->cap = d->cap ? d->cap * 2 : 64;
            d->ranges = realloc(d->ranges, d->cap * sizeof(Range));
            if (d->ranges == NULL) die("realloc");
        }
        d->ranges[d->count++] = (Range){start, end};
    }
    pthread_mutex_unlock(&lock);
}

/* An fsync of a watched file: what changed since its last one goes into its image. */
static void record_file(int fd) {
    struct stat st;
    if (fstat(fd, &st) != 0) return;
    pthread_mutex_lock(&lock);
    Dirty *d = dirty_of(st.st_ino);
    char path[PATH_MAX];
    image_path(path, st.st_ino);
    int out = real_open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    if (out < 0) die(path);
    char self[64];  /* read through a descriptor of our own: fd may be write-only */
    snprintf(self, sizeof self, "/proc/self/fd/%d", fd);
    int in = real_open(self, O_RDONLY | O_CLOEXEC);
    if (in < 0) die(self);
    char buffer[1 << 16];
    size_t count = d->whole ? 1 : d->count;
    for (size_t i = 0; i < count; i++) {
        int64_t start = d->whole ? 0 : d->ranges[i].start;
        int64_t end = d->whole ? st.st_size : d->ranges[i].end;
        if (end > st.st_size) end = st.st_size;
        while (start < end) {
            size_t want = (size_t)(end - start) < sizeof buffer ? (size_t)(end - start)
                                                                 : sizeof buffer;
            ssize_t got = pread(in, buffer, want, start);
            if (got <= 0) break;
            if (real_pwrite(out, buffer, (size_t)got, start) != got) die("image write");
            start += got;
        }
    }
    if (real_ftruncate(out, st.st_size) != 0) die("image truncate");
    real_close(out);
    real_close(in);
    d->count = 0;
    d->whole = 0;
    pthread_mutex_unlock(&lock);
}

/* An fsync of the watched directory: its names, as they are now, become the image's. */
static void record_names(void) {
    pthread_mutex_lock(&lock);
    char path[PATH_MAX], temporary[PATH_MAX];
    snprintf(path, sizeof path, "%s/names", image);
    snprintf(temporary, sizeof temporary, "%s/names.new", image);
    FILE *out = fopen(temporary, "we");
    DIR *dir = opendir(watched);
    if (out == NULL || dir == NULL) die("names");
    struct dirent *entry;
    while ((entry = readdir(dir)) != NULL) {
        if (entry->d_type == DT_REG) {
            fprintf(out, "%llu %s\n", (unsigned long long)entry->d_ino, entry->d_name);
        }
    }
    closedir(dir);
    if (fclose(out) != 0 || rename(temporary, path) != 0) die("names");
    pthread_mutex_unlock(&lock);
}

static int armed(void) {
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/arm", image);
    return access(path, F_OK) == 0;
}

static void violation(const char *what, int fd) {
    char path[PATH_MAX], link[64], target[PATH_MAX] = "";
    snprintf(path, sizeof path, "%s/violations", image);
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, sizeof target - 1);
    if (n > 0) target[n] = 0;
    FILE *out = fopen(path, "ae");
    if (out != NULL) {
        fprintf(out, "%s %s\n", what, target);
        fclose(out);
    }
}

static void resolve(void) {
    real_write = dlsym(RTLD_NEXT, "write");
    real_pwrite = dlsym(RTLD_NEXT, "pwrite");
    real_pwrite64 = dlsym(RTLD_NEXT, "pwrite64");
    real_writev = dlsym(RTLD_NEXT, "writev");
    real_pwritev = dlsym(RTLD_NEXT, "pwritev");
    real_ftruncate = dlsym(RTLD_NEXT, "ftruncate");
    real_ftruncate64 = dlsym(RTLD_NEXT, "ftruncate64");
    real_fsync = dlsym(RTLD_NEXT, "fsync");
    real_fdatasync = dlsym(RTLD_NEXT, "fdatasync");
    real_open = dlsym(RTLD_NEXT, "open");
    real_open64 = dlsym(RTLD_NEXT, "open64");
    real_openat = dlsym(RTLD_NEXT, "openat");
    real_openat64 = dlsym(RTLD_NEXT, "openat64");
    real_close = dlsym(RTLD_NEXT, "close");
    real_mmap = dlsym(RTLD_NEXT, "mmap");
    real_mmap64 = dlsym(RTLD_NEXT, "mmap64");
}

static pthread_once_t resolved = PTHREAD_ONCE_INIT;
#define REAL() pthread_once(&resolved, resolve)

__attribute__((constructor)) static void start(void) {
    REAL();
    const char *dir = getenv("POWERCUT_DIR"), *img = getenv("POWERCUT_IMAGE");
    if (dir == NULL || img == NULL) return;
    if (realpath(dir, watched) == NULL) die("POWERCUT_DIR (it must exist)");
    watched_len = strlen(watched);
    snprintf(image, sizeof image, "%s", img);
    const char *fault = getenv("POWERCUT_FAULT");
    lying_fsync = fault && strcmp(fault, "lying-fsync") == 0;
    eio_fsync = fault && strcmp(fault, "eio-fsync") == 0;
    enospc_write = fault && strcmp(fault, "enospc-write") == 0;
    /* What the directory holds when the process starts is durable: the image starts as
     * a copy of it (the harness gives a restart the image of the last cut). */
    char files[PATH_MAX];
    snprintf(files, sizeof files, "%s/files", image);
    mkdir(image, 0755);
    mkdir(files, 0755);
    DIR *d = opendir(watched);
    if (d != NULL) {
        struct dirent *entry;
        while ((entry = readdir(d)) != NULL) {
            if (entry->d_type != DT_REG) continue;
            char path[PATH_MAX];
            snprintf(path, sizeof path, "%s/%s", watched, entry->d_name);
            int fd = real_open(path, O_RDONLY | O_CLOEXEC);
            if (fd < 0) continue;
            Dirty *slot = dirty_of(entry->d_ino);
            slot->whole = 1;
            record_file(fd);
            real_close(fd);
        }
        closedir(d);
    }
    record_names();
    active = 1;
}

static int watched_file(int fd) { return active && classify(fd) == WATCHED_FILE; }

static int refuse_write(int fd, int64_t end) {
    if (!enospc_write || !armed()) return 0;
    struct stat st;
    if (fstat(fd, &st) != 0 || end <= st.st_size) return 0;
    errno = ENOSPC;
    return 1;
}

ssize_t write(int fd, const void *buf, size_t n) {
    REAL();
    if (!watched_file(fd)) return real_write(fd, buf, n);
    off_t at = lseek(fd, 0, SEEK_CUR);
    if (refuse_write(fd, (int64_t)at + (int64_t)n)) return -1;
    ssize_t done = real_write(fd, buf, n);
    if (done > 0) {
        off_t after = lseek(fd, 0, SEEK_CUR);  /* right for O_APPEND too */
        mark(fd, (int64_t)after - done, (int64_t)after);
    }
    return done;
}

ssize_t pwrite(int fd, const void *buf, size_t n, off_t at) {
    REAL();
    if (!watched_file(fd)) return real_pwrite(fd, buf, n, at);
    if (refuse_write(fd, (int64_t)at + (int64_t)n)) return -1;
    ssize_t done = real_pwrite(fd, buf, n, at);
    if (done > 0) mark(fd, at, (int64_t)at + done);
    return done;
}

ssize_t pwrite64(int fd, const void *buf, size_t n, off64_t at) {
    REAL();
    if (!watched_file(fd)) return real_pwrite64(fd, buf, n, at);
    if (refuse_write(fd, (int64_t)at + (int64_t)n)) return -1;
    ssize_t done = real_pwrite64(fd, buf, n, at);
    if (done > 0) mark(fd, at, (int64_t)at + done);
    return done;
}

static size_t total(const struct iovec *iov, int count) {
    size_t sum = 0;
    for (int i = 0; i < count; i++) sum += iov[i].iov_len;
    return sum;
}

ssize_t writev(int fd, const struct iovec *iov, int count) {
    REAL();
    if (!watched_file(fd)) return real_writev(fd, iov, count);
    off_t at = lseek(fd, 0, SEEK_CUR);
    if (refuse_write(fd, (int64_t)at + (int64_t)total(iov, count))) return -1;
    ssize_t done = real_writev(fd, iov, count);
    if (done > 0) {
        off_t after = lseek(fd, 0, SEEK_CUR);
        mark(fd, (int64_t)after - done, (int64_t)after);
    }
    return done;
}

ssize_t pwritev(int fd, const struct iovec *iov, int count, off_t at) {
    REAL();
    if (!watched_file(fd)) return real_pwritev(fd, iov, count, at);
    if (refuse_write(fd, (int64_t)at + (int64_t)total(iov, count))) return -1;
    ssize_t done = real_pwritev(fd, iov, count, at);
    if (done > 0) mark(fd, at, (int64_t)at + done);
    return done;
}

/* A truncation changes everything from the new length on: a later fsync copies what is
 * there then (zeros, or nothing past the file's end). */
int ftruncate(int fd, off_t length) {
    REAL();
    int done = real_ftruncate(fd, length);
    if (done == 0 && watched_file(fd)) mark(fd, length, WHOLE);
    return done;
}

int ftruncate64(int fd, off64_t length) {
    REAL();
    int done = real_ftruncate64(fd, length);
    if (done == 0 && watched_file(fd)) mark(fd, length, WHOLE);
    return done;
}

static int sync_with(int (*real)(int), int fd) {
    if (!active) return real(fd);
    int kind = classify(fd);
    if (kind != WATCHED_FILE && kind != WATCHED_DIR) return real(fd);
    if (lying_fsync && armed()) return 0;
    if (eio_fsync && armed()) {
        errno = EIO;
        return -1;
    }
    int done = real(fd);
    if (done != 0) return done;
    if (kind == WATCHED_FILE) record_file(fd);
    else record_names();
    return 0;
}

int fsync(int fd) {
    REAL();
    return sync_with(real_fsync, fd);
}
int fdatasync(int fd) {
    REAL();
    return sync_with(real_fdatasync, fd);
}

/* A new file's image starts empty (an inode may be reused after an unlink). */
static void opened(int fd, const char *path, int flags, int existed) {
    if (fd < 0 || !active) return;
    if (fd < FD_CACHE) fd_class[fd] = UNKNOWN;
    if ((flags & O_CREAT) && !existed && classify(fd) == WATCHED_FILE) {
        struct stat st;
        if (fstat(fd, &st) != 0) return;
        pthread_mutex_lock(&lock);
        char image_file[PATH_MAX];
        image_path(image_file, st.st_ino);
        unlink(image_file);
        Dirty *d = dirty_of(st.st_ino);
        d->count = 0;
        d->whole = 0;
        pthread_mutex_unlock(&lock);
    }
    (void)path;
}

#define OPEN_MODE(flags) \
    mode_t mode = 0; \
    if ((flags) & (O_CREAT | O_TMPFILE)) { \
        va_list args; \
        va_start(args, flags); \
        mode = va_arg(args, mode_t); \
        va_end(args); \
    }

int open(const char *path, int flags, ...) {
    REAL();
    OPEN_MODE(flags);
    int existed = (flags & O_CREAT) ? access(path, F_OK) == 0 : 1;
    int fd = real_open(path, flags, mode);
    opened(fd, path, flags, existed);
    return fd;
}

int open64(const char *path, int flags, ...) {
    REAL();
    OPEN_MODE(flags);
    int existed = (flags & O_CREAT) ? access(path, F_OK) == 0 : 1;
    int fd = real_open64(path, flags, mode);
    opened(fd, path, flags, existed);
    return fd;
}

int openat(int dirfd, const char *path, int flags, ...) {
    REAL();
    OPEN_MODE(flags);
    int existed = (flags & O_CREAT) ? faccessat(dirfd, path, F_OK, 0) == 0 : 1;
    int fd = real_openat(dirfd, path, flags, mode);
    opened(fd, path, flags, existed);
    return fd;
}

int openat64(int dirfd, const char *path, int flags, ...) {
    REAL();
    OPEN_MODE(flags);
    int existed = (flags & O_CREAT) ? faccessat(dirfd, path, F_OK, 0) == 0 : 1;
    int fd = real_openat64(dirfd, path, flags, mode);
    opened(fd, path, flags, existed);
    return fd;
}

int close(int fd) {
    REAL();
    if (fd >= 0 && fd < FD_CACHE) fd_class[fd] = UNKNOWN;
    return real_close(fd);
}

void *mmap(void *addr, size_t length, int prot, int flags, int fd, off_t offset) {
    REAL();
    if (fd >= 0 && (prot & PROT_WRITE) && (flags & MAP_SHARED) && watched_file(fd)) {
        violation("mmap", fd);
    }
    return real_mmap(addr, length, prot, flags, fd, offset);
}

void *mmap64(void *addr, size_t length, int prot, int flags, int fd, off64_t offset) {
    REAL();
    if (fd >= 0 && (prot & PROT_WRITE) && (flags & MAP_SHARED) && watched_file(fd)) {
        violation("mmap", fd);
    }
    return real_mmap64(addr, length, prot, flags, fd, offset);
}
