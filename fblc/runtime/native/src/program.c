#include "program.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

#define CACHE_FILE "kernels.cache"
#define CACHE_MAGIC "FBLCBIN1"

/* --- the program ---------------------------------------------------------------------------------------- */

static char *cache_key(runner *r) {
    const char *options = build_options(&r->device);
    size_t size = 256 + strlen(options) + strlen(r->device.platform_name) + strlen(r->device.device_name) +
                  strlen(r->device.device_version) + strlen(r->device.driver_version) + sizeof r->b->kernels_sha256;
    char *key = xmalloc(size);
    snprintf(key, size, "fblc-runner program cache 1\nkernels.cl %s\noptions %s\nplatform %s\ndevice %s\n"
                        "version %s\ndriver %s\n", r->b->kernels_sha256, options, r->device.platform_name,
             r->device.device_name, r->device.device_version, r->device.driver_version);
    return key;
}

static void die_with_build_log(runner *r, cl_program program) {
    char *log = opencl_build_log(program, r->device.device);
    long line = opencl_log_line(log);
    char where[512] = "(see the log)";
    for (size_t i = 0; line && i < r->b->launch_count; ++i)
        if (r->b->launches[i].first_line <= line && line <= r->b->launches[i].last_line) {
            snprintf(where, sizeof where, "'%s' (kernels.cl line %ld)", r->b->launches[i].name, line);
            break;
        }
    size_t length = strlen(log);
    const char *tail = length > 3000 ? log + length - 3000 : log;
    die(EXIT_USAGE, "the OpenCL compiler of %s rejected kernel %s:\n%s", r->device.device_name, where, tail);
}

static int load_cached_program(runner *r, const char *path, const char *key) {
    size_t length;
    unsigned char *data = (unsigned char *)read_file(path, &length);
    if (!data) return 0;
    size_t key_length = strlen(key);
    int ok = 0;
    if (length >= 8 + 4 + key_length + 8 && memcmp(data, CACHE_MAGIC, 8) == 0 && read_u32le(data + 8) == key_length &&
        memcmp(data + 12, key, key_length) == 0) {
        size_t binary_length = (size_t)read_u64le(data + 12 + key_length);
        const unsigned char *binary = data + 12 + key_length + 8;
        if (binary_length && binary_length == length - (12 + key_length + 8)) {
            cl_int status, binary_status;
            cl_program program = cl.CreateProgramWithBinary(r->context, 1, &r->device.device, &binary_length, &binary,
                                                            &binary_status, &status);
            if (status == CL_SUCCESS && binary_status == CL_SUCCESS &&
                cl.BuildProgram(program, 1, &r->device.device, build_options(&r->device), NULL, NULL) == CL_SUCCESS) {
                r->program = program;
                ok = 1;
            } else if (status == CL_SUCCESS) {
                cl.ReleaseProgram(program);
            }
        }
    }
    free(data);
    return ok;
}

static void save_program(runner *r, const char *path, const char *key) {
    size_t binary_length = 0;
    if (cl.GetProgramInfo(r->program, CL_PROGRAM_BINARY_SIZES, sizeof binary_length, &binary_length, NULL) !=
            CL_SUCCESS || binary_length == 0)
        return; /* the driver gives no binary: nothing to cache */
    size_t key_length = strlen(key), total = 12 + key_length + 8 + binary_length;
    unsigned char *file = xmalloc(total), *binary = file + 12 + key_length + 8;
    memcpy(file, CACHE_MAGIC, 8);
    for (int i = 0; i < 4; ++i) file[8 + i] = (unsigned char)(key_length >> (8 * i));
    memcpy(file + 12, key, key_length);
    for (int i = 0; i < 8; ++i) file[12 + key_length + i] = (unsigned char)((uint64_t)binary_length >> (8 * i));
    unsigned char *binaries[1] = {binary};
    if (cl.GetProgramInfo(r->program, CL_PROGRAM_BINARIES, sizeof binaries, binaries, NULL) == CL_SUCCESS) {
        int error = write_atomically(path, file, total);
        if (error) warn("cannot cache the program binary in %s (%s); the next run builds the kernels again", path,
                        strerror(error));
    }
    free(file);
}

void build_program(runner *r, int use_cache) {
    double started = now_ms();
    char *path = path_join(r->b->folder, CACHE_FILE), *key = cache_key(r);
    if (use_cache && load_cached_program(r, path, key)) {
        r->program_from_cache = 1;
    } else {
        cl_int status;
        const char *source = r->b->kernels_source;
        size_t length = r->b->kernels_length;
        r->program = cl.CreateProgramWithSource(r->context, 1, &source, &length, &status);
        check_cl(status, "clCreateProgramWithSource");
        status = cl.BuildProgram(r->program, 1, &r->device.device, build_options(&r->device), NULL, NULL);
        if (status == CL_BUILD_PROGRAM_FAILURE) die_with_build_log(r, r->program);
        check_cl(status, "clBuildProgram");
        if (use_cache) save_program(r, path, key);
    }
    r->build_ms = now_ms() - started;
    free(path);
    free(key);
}
