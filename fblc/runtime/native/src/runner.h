/* The training loop of the fblc runner: OpenCL objects for one bundle on one device. */
#ifndef FBLC_RUNNER_H
#define FBLC_RUNNER_H

#include "bundle.h"
#include "device.h"
#include "opencl.h"

typedef struct {
    const bundle *b;
    device_choice device;
    cl_context context;
    cl_command_queue queue;
    cl_mem *images;          /* one per plan image */
    size_t *binding;         /* texture id -> index into images; swapped after each step */
    cl_program program;
    cl_kernel *kernels;      /* one per launch (shared between launches of the same function) */
    cl_event *events;        /* one per launch the current step enqueues (a loop's once a repetition), when kernel_times */
    size_t *event_launch;    /* the plan's launch of each event */
    size_t enqueued;         /* launches a step enqueues */
    int kernel_times;        /* a profiling queue: each launch's device time (queues without it run leaner) */
    void **staging;          /* one host buffer per data input, zero padded to the texture */
    unsigned char *readback; /* large enough for any texture */
    size_t texture_bytes;    /* device memory in textures */
    size_t host_bytes;       /* host staging and read-back buffers */
    int program_from_cache;
    double build_ms;
    double submit_ms;        /* host time of the last step's uploads and launches (until the last enqueue returned) */
    double *metrics;         /* the bundle's metrics after the last step, one per b->metric_names */
    size_t specialist_bytes; /* texels a --specialist wrote over initial data (0: none) */
} runner;

/* Create textures (filled from params.bin), build or load the program (cache in the bundle folder unless
 * `use_cache` is 0), create kernels; a profiling queue only with `kernel_times`. */
void runner_setup(runner *r, const bundle *b, const device_choice *device, int use_cache, int kernel_times);

/* One step: upload `inputs` (one pointer per manifest input, already in the texture's element type),
 * launch every kernel, read the loss, swap states. With kernel_times, `kernel_ms` (launch_count entries)
 * receives the device time of each launch. Returns the loss. */
double runner_step(runner *r, const void *const *inputs, double *kernel_ms);

/* The parameter `index` as float32 (its tensor's elements) into `out`. */
void runner_read_parameter(runner *r, size_t index, float *out);

/* A forward bundle's output `index` after the last step: its texture's elements (texture.elements, which value_maps
 * and value_shapes of plan.json view; fblc decodes them), float32, or int32 for an integer texture. */
void runner_read_output(runner *r, size_t index, void *out);

/* Write texture `id`'s image with `data`, packed as its initial data in params.bin is (blocking). */
void runner_write_initial(runner *r, size_t id, const void *data);

/* Refuse the specialist file `path` (specialist.c) whose fingerprint is not the bundle's, before any device work;
 * warn where one side has none. */
void specialist_check(const bundle *b, const char *path);
/* Write each texture of the specialist file `path` (specialist.c) over its initial data; returns the bytes. */
size_t runner_load_specialist(runner *r, const char *path);

#endif
