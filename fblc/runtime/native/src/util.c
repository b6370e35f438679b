#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_PARTIALS 8
#define MAX_PATH_CHARS 4096
static char partials[MAX_PARTIALS][MAX_PATH_CHARS];

void partial_add(const char *path) {
    for (int i = 0; i < MAX_PARTIALS; ++i) {
        if (partials[i][0] == '\0') {
            if (strlen(path) >= MAX_PATH_CHARS) die(EXIT_USAGE, "path too long: %s", path);
            strcpy(partials[i], path);
            return;
        }
    }
    die(EXIT_INTERNAL, "too many partial files");
}

void partial_remove(const char *path) {
    for (int i = 0; i < MAX_PARTIALS; ++i)
        if (strcmp(partials[i], path) == 0) partials[i][0] = '\0';
}

void partial_unlink_all(void) {
    for (int i = 0; i < MAX_PARTIALS; ++i)
        if (partials[i][0] != '\0') {
            unlink(partials[i]);
            partials[i][0] = '\0';
        }
}

void die(int code, const char *fmt, ...) {
    va_list args;
    fflush(stdout);
    fputs("fblc-runner: error: ", stderr);
    va_start(args, fmt);
    vfprintf(stderr, fmt, args);
    va_end(args);
    fputc('\n', stderr);
    partial_unlink_all();
    exit(code);
}

void warn(const char *fmt, ...) {
    va_list args;
    fputs("fblc-runner: warning: ", stderr);
    va_start(args, fmt);
    vfprintf(stderr, fmt, args);
    va_end(args);
    fputc('\n', stderr);
}

void *xmalloc(size_t size) {
    void *pointer = malloc(size ? size : 1);
    if (!pointer) die(EXIT_INTERNAL, "out of host memory (%zu bytes)", size);
    return pointer;
}

void *xcalloc(size_t count, size_t size) {
    void *pointer = calloc(count ? count : 1, size ? size : 1);
    if (!pointer) die(EXIT_INTERNAL, "out of host memory (%zu x %zu bytes)", count, size);
    return pointer;
}

void *xrealloc(void *pointer, size_t size) {
    void *grown = realloc(pointer, size ? size : 1);
    if (!grown) die(EXIT_INTERNAL, "out of host memory (%zu bytes)", size);
    return grown;
}

char *xstrdup(const char *text) {
    size_t length = strlen(text);
    char *copy = xmalloc(length + 1);
    memcpy(copy, text, length + 1);
    return copy;
}

char *path_join(const char *folder, const char *name) {
    size_t a = strlen(folder), b = strlen(name);
    char *path = xmalloc(a + b + 2);
    memcpy(path, folder, a);
    size_t at = a;
    if (a && folder[a - 1] != '/') path[at++] = '/';
    memcpy(path + at, name, b + 1);
    return path;
}

char *read_file(const char *path, size_t *length) {
    FILE *file = fopen(path, "rb");
    if (!file) return NULL;
    size_t capacity = 1 << 16, used = 0;
    char *data = xmalloc(capacity + 1);
    for (;;) {
        size_t got = fread(data + used, 1, capacity - used, file);
        used += got;
        if (used < capacity) {
            if (ferror(file)) {
                int saved = errno ? errno : EIO;
                free(data);
                fclose(file);
                errno = saved;
                return NULL;
            }
            break;
        }
        capacity *= 2;
        data = xrealloc(data, capacity + 1);
    }
    fclose(file);
    data[used] = '\0';
    if (length) *length = used;
    return data;
}

int write_atomically(const char *path, const void *data, size_t size) {
    char *partial = xmalloc(strlen(path) + 32);
    sprintf(partial, "%s.partial-%ld", path, (long)getpid());
    partial_add(partial);
    int error = 0;
    FILE *file = fopen(partial, "wb");
    if (!file) {
        error = errno;
    } else {
        if (size && fwrite(data, 1, size, file) != size) error = errno ? errno : EIO;
        if (fflush(file) != 0 && !error) error = errno ? errno : EIO;
        if (!error && fsync(fileno(file)) != 0 && errno != EINVAL && errno != EROFS) error = errno;
        if (fclose(file) != 0 && !error) error = errno ? errno : EIO;
    }
    if (!error && rename(partial, path) != 0) error = errno;
    if (error) unlink(partial);
    partial_remove(partial);
    free(partial);
    return error;
}

double now_ms(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec * 1e3 + (double)now.tv_nsec * 1e-6;
}

uint16_t read_u16le(const unsigned char *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

uint32_t read_u32le(const unsigned char *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

uint64_t read_u64le(const unsigned char *p) { return (uint64_t)read_u32le(p) | ((uint64_t)read_u32le(p + 4) << 32); }

float half_to_float(uint16_t half) {
    uint32_t sign = (uint32_t)(half & 0x8000u) << 16, exponent = (half >> 10) & 0x1fu, mantissa = half & 0x3ffu, bits;
    if (exponent == 0) {
        if (mantissa == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exponent = 127 - 15 + 1;
            while (!(mantissa & 0x400u)) {
                mantissa <<= 1;
                exponent--;
            }
            bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
        }
    } else if (exponent == 31) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
    }
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}
