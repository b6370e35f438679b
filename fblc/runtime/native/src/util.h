/* Small helpers of the fblc runner: errors with exit codes, files, partial outputs, time. */
#ifndef FBLC_UTIL_H
#define FBLC_UTIL_H

#include <stddef.h>
#include <stdint.h>

/* Exit codes: what fblc (the Python side) tells apart. */
enum {
    EXIT_OK = 0,
    EXIT_INTERNAL = 1,    /* a bug in the runner */
    EXIT_USAGE = 2,       /* bad arguments, a bundle or data file that is missing, corrupt or of another version */
    EXIT_OPENCL = 3,      /* no OpenCL library or device, or the driver failed */
    EXIT_OUTPUT = 4,      /* the results could not be written (full disk, read-only folder) */
    EXIT_INTERRUPTED = 130
};

/* Print "fblc-runner: error: ..." on stderr, remove every partial output file, exit with `code`. */
void die(int code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3), noreturn))
#endif
    ;
void warn(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;

void *xmalloc(size_t size);
void *xcalloc(size_t count, size_t size);
void *xrealloc(void *pointer, size_t size);
char *xstrdup(const char *text);
char *path_join(const char *folder, const char *name);

/* The whole file, NUL-terminated (the NUL is not counted in *length); NULL with errno set on failure. */
char *read_file(const char *path, size_t *length);

/* Partial outputs: files being written that must not survive a failure or an interruption. */
void partial_add(const char *path);
void partial_remove(const char *path);  /* forget it (it was renamed into place) */
void partial_unlink_all(void);          /* async-signal-safe */

/* Write `size` bytes to `path` through `path`.partial and an atomic rename; 0 on success, else errno. */
int write_atomically(const char *path, const void *data, size_t size);

double now_ms(void);
uint16_t read_u16le(const unsigned char *p);
uint32_t read_u32le(const unsigned char *p);
uint64_t read_u64le(const unsigned char *p);
float half_to_float(uint16_t half);

#endif
