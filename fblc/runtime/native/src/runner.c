#include "runner.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "program.h"
#include "util.h"

/* --- textures ------------------------------------------------------------------------------------------ */

static cl_image_format image_format(int format) {
    cl_image_format f;
    f.image_channel_order = format_is_mask(format) ? CL_R : CL_RGBA;
    f.image_channel_data_type = format == FORMAT_F16 ? CL_HALF_FLOAT : format == FORMAT_I32 ? CL_SIGNED_INT32
                              : format_is_mask(format) ? CL_UNSIGNED_INT8 : CL_FLOAT;
    return f;
}

static void check_formats(runner *r) {
    cl_uint count = 0;
    check_cl(cl.GetSupportedImageFormats(r->context, CL_MEM_READ_WRITE, CL_MEM_OBJECT_IMAGE2D, 0, NULL, &count),
             "clGetSupportedImageFormats");
    cl_image_format *formats = xcalloc(count, sizeof *formats);
    check_cl(cl.GetSupportedImageFormats(r->context, CL_MEM_READ_WRITE, CL_MEM_OBJECT_IMAGE2D, count, formats, NULL),
             "clGetSupportedImageFormats");
    for (size_t i = 0; i < r->b->texture_count; ++i) {
        cl_image_format want = image_format(r->b->textures[i].format);
        int found = 0;
        for (cl_uint k = 0; k < count && !found; ++k)
            found = formats[k].image_channel_order == want.image_channel_order &&
                    formats[k].image_channel_data_type == want.image_channel_data_type;
        if (!found)
            die(EXIT_OPENCL, "%s has no read-write %s images, which texture '%s' needs%s", r->device.device_name,
                format_name(r->b->textures[i].format), r->b->textures[i].name,
                r->b->textures[i].format == FORMAT_F16 ? "; compile the bundle with --dtype fp32" : "");
    }
    free(formats);
}

static size_t texture_size(const texture *t) { return t->width * t->height * format_texel_bytes(t->format); }

static void write_texture(runner *r, cl_mem image, const texture *t, const void *data, cl_bool blocking) {
    size_t origin[3] = {0, 0, 0}, region[3] = {t->width, t->height, 1};
    check_cl(cl.EnqueueWriteImage(r->queue, image, blocking, origin, region, 0, 0, data, 0, NULL, NULL),
             "clEnqueueWriteImage");
}

void runner_write_initial(runner *r, size_t id, const void *data) {
    write_texture(r, r->images[r->binding[id]], &r->b->textures[id], data, CL_TRUE);
}

static void read_texture(runner *r, size_t id, void *out) {
    const texture *t = &r->b->textures[id];
    size_t origin[3] = {0, 0, 0}, region[3] = {t->width, t->height, 1};
    check_cl(cl.EnqueueReadImage(r->queue, r->images[r->binding[id]], CL_TRUE, origin, region, 0, 0, out, 0, NULL,
                                 NULL), "clEnqueueReadImage");
}

static void check_limits(runner *r) {
    for (size_t i = 0; i < r->b->texture_count; ++i) {
        const texture *t = &r->b->textures[i];
        if (t->width > r->device.image_max_width || t->height > r->device.image_max_height)
            die(EXIT_USAGE, "texture of '%s' is %zu x %zu, beyond %s's image limit %zu x %zu; compile for a target "
                            "with this device's limits", t->name, t->width, t->height, r->device.device_name,
                r->device.image_max_width, r->device.image_max_height);
    }
}

/* --- setup and steps ------------------------------------------------------------------------------------ */

/* cl_khr_image2d_from_buffer's device queries (CL_DEVICE_IMAGE_PITCH_ALIGNMENT_KHR, ..._BASE_ADDRESS_...) */
#define IMAGE_PITCH_ALIGNMENT 0x104A
#define IMAGE_BASE_ADDRESS_ALIGNMENT 0x104B

/* Why the runner cannot make the plan's images over one arena on this device (NULL: it can), as LocalRunner's
   arena_problem: the extension, sub-buffer origins at the plan's alignment, image rows at the device's pitch. */
static const char *arena_problem(const runner *r) {
    const bundle *b = r->b;
    if (!b->arena_bytes) return "the plan made no images over an arena";
    if (!has_extension(r->device.device, "cl_khr_image2d_from_buffer")) return "no cl_khr_image2d_from_buffer";
    cl_uint base_bits = 0, pitch = 0, base = 0;
    if (cl.GetDeviceInfo(r->device.device, CL_DEVICE_MEM_BASE_ADDR_ALIGN, sizeof base_bits, &base_bits, NULL) != CL_SUCCESS
        || cl.GetDeviceInfo(r->device.device, IMAGE_PITCH_ALIGNMENT, sizeof pitch, &pitch, NULL) != CL_SUCCESS
        || cl.GetDeviceInfo(r->device.device, IMAGE_BASE_ADDRESS_ALIGNMENT, sizeof base, &base, NULL) != CL_SUCCESS)
        return "the device does not say its alignments";
    if (base_bits < 8 || b->arena_alignment % (base_bits / 8)) return "sub-buffer origins more aligned than the plan's";
    size_t pixels = pitch > base ? pitch : base;
    for (size_t i = 0; i < b->texture_count; ++i) {
        size_t row = (pixels ? pixels : 1) * format_texel_bytes(b->textures[i].format);
        if (b->textures[i].pitch % row || b->arena_alignment % row) return "image rows more aligned than the plan's";
    }
    return NULL;
}

/* One buffer of the plan's arena bytes; each texture an image over its slot (a sub-buffer), at the plan's pitch. */
/* A 2-D image of `format`, `width` x `height` texels: over `buffer` at `row_pitch` bytes a row
 * (cl_khr_image2d_from_buffer) where `buffer` is given, else of its own. */
static cl_mem create_image(runner *r, int format, size_t width, size_t height, size_t row_pitch, cl_mem buffer,
                           cl_int *status) {
    cl_image_format image = image_format(format);
    cl_image_desc desc;
    memset(&desc, 0, sizeof desc);
    desc.image_type = CL_MEM_OBJECT_IMAGE2D;
    desc.image_width = width;
    desc.image_height = height;
    desc.image_row_pitch = row_pitch;
    desc.buffer = buffer;
    return cl.CreateImage(r->context, CL_MEM_READ_WRITE, &image, &desc, NULL, status);
}

static void allocate_arena(runner *r) {
    const bundle *b = r->b;
    cl_int status;
    cl_mem arena = cl.CreateBuffer(r->context, CL_MEM_READ_WRITE, b->arena_bytes, NULL, &status);
    if (status == CL_MEM_OBJECT_ALLOCATION_FAILURE || status == CL_OUT_OF_RESOURCES)
        die(EXIT_OPENCL, "%s is out of memory for the arena of %zu bytes", r->device.device_name, b->arena_bytes);
    check_cl(status, "clCreateBuffer (the arena)");
    r->images = xcalloc(b->texture_count + 1, sizeof *r->images);
    for (size_t i = 0; i < b->texture_count; ++i) {
        const texture *t = &b->textures[i];
        cl_buffer_region region = {t->offset, t->slot};
        cl_mem slot = cl.CreateSubBuffer(arena, CL_MEM_READ_WRITE, CL_BUFFER_CREATE_TYPE_REGION, &region, &status);
        check_cl(status, "clCreateSubBuffer (a texture's slot of the arena)");
        r->images[i] = create_image(r, t->format, t->width, t->height, t->pitch, slot, &status);
        check_cl(status, "clCreateImage (an image over the arena, cl_khr_image2d_from_buffer)");
    }
    r->texture_bytes = b->arena_bytes;
}

void runner_setup(runner *r, const bundle *b, const device_choice *device, int use_cache, int kernel_times) {
    memset(r, 0, sizeof *r);
    r->b = b;
    r->kernel_times = kernel_times;
    r->device = *device;
    check_limits(r);
    cl_int status;
    r->context = cl.CreateContext(NULL, 1, &device->device, NULL, NULL, &status);
    check_cl(status, "clCreateContext");
    r->queue = cl.CreateCommandQueue(r->context, device->device, kernel_times ? CL_QUEUE_PROFILING_ENABLE : 0, &status);
    check_cl(status, "clCreateCommandQueue");
    check_formats(r);

    const char *why = arena_problem(r);
    if (!why) {
        allocate_arena(r);
    } else if (b->arena_bytes) {
        fprintf(stderr, "fblc-runner: the plan's images over one arena are not made here (%s): textures of one format "
                        "and width share images instead\n", why);
    }
    /* else plan.json's images, as the compiler shared them out (bundle_load checked that every texture fits its own) */
    r->images = why ? xcalloc(b->image_count + 1, sizeof *r->images) : r->images;
    for (size_t i = 0; why && i < b->image_count; ++i) {
        const image_spec *im = &b->images[i];
        r->images[i] = create_image(r, im->format, im->width, im->height, 0, NULL, &status);
        if (status == CL_MEM_OBJECT_ALLOCATION_FAILURE || status == CL_OUT_OF_RESOURCES)
            die(EXIT_OPENCL, "%s is out of memory for image %zu (%zu x %zu) after %zu bytes of textures",
                device->device_name, i, im->width, im->height, r->texture_bytes);
        check_cl(status, "clCreateImage");
        r->texture_bytes += im->width * im->height * format_texel_bytes(im->format);
    }
    size_t largest = 0;
    r->binding = xcalloc(b->texture_count, sizeof *r->binding);
    for (size_t i = 0; i < b->texture_count; ++i) {
        const texture *t = &b->textures[i];
        r->binding[i] = why ? t->image : i;
        if (texture_size(t) > largest) largest = texture_size(t);
        if (t->has_init) write_texture(r, r->images[r->binding[i]], t, b->params + t->init_offset, CL_TRUE);
    }
    r->readback = xmalloc(largest);
    r->metrics = xcalloc(b->metric_count + 1, sizeof *r->metrics);
    r->host_bytes = largest;

    build_program(r, use_cache);
    r->kernels = xcalloc(b->launch_count, sizeof *r->kernels);
    for (size_t i = 0; i < b->launch_count; ++i) {
        for (size_t k = 0; k < i && !r->kernels[i]; ++k)
            if (strcmp(b->launches[k].function, b->launches[i].function) == 0) r->kernels[i] = r->kernels[k];
        if (r->kernels[i]) continue;
        r->kernels[i] = cl.CreateKernel(r->program, b->launches[i].function, &status);
        if (status == CL_INVALID_KERNEL_NAME)
            die(EXIT_USAGE, "kernels.cl has no kernel '%s' that plan.json launches; compile the bundle again",
                b->launches[i].function);
        check_cl(status, "clCreateKernel");
    }
    r->enqueued = b->launch_count; /* a loop's launches once per repetition */
    for (size_t k = 0; k < b->loop_count; ++k)
        r->enqueued += (b->loops[k].count - 1) * (b->loops[k].end - b->loops[k].begin);
    r->events = xcalloc(r->enqueued, sizeof *r->events);
    r->event_launch = xcalloc(r->enqueued, sizeof *r->event_launch);
    r->staging = xcalloc(b->input_count, sizeof *r->staging);
    for (size_t i = 0; i < b->input_count; ++i)
    {
        r->staging[i] = xcalloc(1, texture_size(&b->textures[b->inputs[i].texture]));
        r->host_bytes += texture_size(&b->textures[b->inputs[i].texture]);
    }
}

/* Element 0 of a texture (the loss, a metric), as a double. */
static double read_scalar(runner *r, size_t texture_id) {
    read_texture(r, texture_id, r->readback);
    const texture *t = &r->b->textures[texture_id];
    if (t->format == FORMAT_F16) return half_to_float(read_u16le(r->readback));
    if (t->format == FORMAT_I32) return (double)(int32_t)read_u32le(r->readback);
    float value;
    memcpy(&value, r->readback, sizeof value);
    return value;
}

/* the next step reads each pair's .new texture as its state */
static void swap(runner *r, size_t (*pairs)[2], size_t count) {
    for (size_t i = 0; i < count; ++i) {
        size_t state = pairs[i][0], fresh = pairs[i][1], kept = r->binding[state];
        r->binding[state] = r->binding[fresh];
        r->binding[fresh] = kept;
    }
}

/* launch `i` of the plan with its textures as bound now, the step's `n`th enqueued; its event kept for kernel_ms */
static void enqueue_launch(runner *r, size_t i, size_t n) {
    const launch *l = &r->b->launches[i];
    for (size_t a = 0; a < l->argument_count; ++a)
        check_cl(cl.SetKernelArg(r->kernels[i], (cl_uint)a, sizeof(cl_mem), &r->images[r->binding[l->arguments[a]]]),
                 "clSetKernelArg");
    const size_t *local = l->local_size[0] ? l->local_size : NULL;
    cl_int status = cl.EnqueueNDRangeKernel(r->queue, r->kernels[i], l->work_dim, NULL, l->global_size, local, 0,
                                            NULL, r->kernel_times ? &r->events[n] : NULL);
    r->event_launch[n] = i;
    if (status == CL_INVALID_WORK_GROUP_SIZE && local)
        die(EXIT_OPENCL, "launching kernel '%s' failed: %s cannot run it in work-groups of %zu (%s); compile for a "
            "target with a smaller max_work_group_size", l->name, r->device.device_name, l->local_size[0],
            opencl_error(status));
    if (status != CL_SUCCESS)
        die(EXIT_OPENCL, "launching kernel '%s' failed: %s (%d)", l->name, opencl_error(status), (int)status);
}

double runner_step(runner *r, const void *const *inputs, double *kernel_ms) {
    const bundle *b = r->b;
    double started = now_ms();
    for (size_t i = 0; i < b->input_count; ++i) {
        const tensor *input = &b->inputs[i];
        const texture *t = &b->textures[input->texture];
        /* the staging buffer is free again: the previous step ended with a blocking read */
        memcpy(r->staging[i], inputs[i], input->elements * format_element_bytes(t->format));
        write_texture(r, r->images[r->binding[input->texture]], t, r->staging[i], CL_FALSE);
    }
    size_t next_loop = 0, n = 0;
    for (size_t i = 0; i < b->launch_count;) {
        if (next_loop < b->loop_count && b->loops[next_loop].begin == i) {
            /* a loop: its launches `count` times, the carried pairs swapped after each repetition */
            const loop_spec *l = &b->loops[next_loop++];
            for (size_t repetition = 0; repetition < l->count; ++repetition) {
                for (size_t k = l->begin; k < l->end; ++k) enqueue_launch(r, k, n++);
                swap(r, l->swaps, l->swap_count);
            }
            i = l->end;
            continue;
        }
        enqueue_launch(r, i++, n++);
    }
    r->submit_ms = now_ms() - started;
    double loss = b->forward ? 0.0 : read_scalar(r, b->loss_texture); /* a forward bundle has none */
    for (size_t i = 0; i < b->metric_count; ++i) r->metrics[i] = read_scalar(r, b->metric_textures[i]);
    for (size_t i = 0; r->kernel_times && i < b->launch_count; ++i) kernel_ms[i] = 0.0;
    for (size_t e = 0; r->kernel_times && e < n; ++e) { /* a launch's time: all its repetitions' */
        cl_ulong start = 0, end = 0;
        if (cl.GetEventProfilingInfo(r->events[e], CL_PROFILING_COMMAND_START, sizeof start, &start, NULL) !=
                CL_SUCCESS ||
            cl.GetEventProfilingInfo(r->events[e], CL_PROFILING_COMMAND_END, sizeof end, &end, NULL) != CL_SUCCESS)
            start = end = 0;
        kernel_ms[r->event_launch[e]] += end > start ? (double)(end - start) * 1e-6 : 0.0;
        cl.ReleaseEvent(r->events[e]);
        r->events[e] = NULL;
    }
    swap(r, b->swaps, b->swap_count);
    /* a step loss scaling skipped leaves its updates in the .new textures: the states stay as they were */
    if (b->finite_flag != SIZE_MAX && read_scalar(r, b->finite_flag) == 0.0) swap(r, b->finite_swaps, b->finite_swap_count);
    return loss;
}

void runner_read_parameter(runner *r, size_t index, float *out) {
    const tensor *p = &r->b->parameters[index];
    const texture *t = &r->b->textures[p->texture];
    read_texture(r, p->texture, r->readback);
    for (size_t i = 0; i < p->elements; ++i) {
        size_t x, y;
        texel_xy(t, i / 4, &x, &y);  /* element i is lane i % 4 of texel i / 4, wherever its layout puts it */
        size_t at = (y * t->width + x) * 4 + i % 4;
        if (t->format == FORMAT_F16) out[i] = half_to_float(read_u16le(r->readback + 2 * at));
        else if (t->format == FORMAT_I32) out[i] = (float)(int32_t)read_u32le(r->readback + 4 * at);
        else memcpy(&out[i], r->readback + 4 * at, sizeof(float));
    }
}

void runner_read_output(runner *r, size_t index, void *out) {
    const texture *t = &r->b->textures[r->b->outputs[index].texture];
    read_texture(r, r->b->outputs[index].texture, r->readback);
    float *floats = out;
    int32_t *ints = out; /* an integer output (argmax, say) stays exact: int32, not a float's 24 bits */
    for (size_t i = 0; i < t->elements; ++i) {
        size_t x, y;
        texel_xy(t, i / 4, &x, &y);
        size_t at = (y * t->width + x) * 4 + i % 4;
        if (t->format == FORMAT_F16) floats[i] = half_to_float(read_u16le(r->readback + 2 * at));
        else if (t->format == FORMAT_I32) ints[i] = (int32_t)read_u32le(r->readback + 4 * at);
        else memcpy(&floats[i], r->readback + 4 * at, sizeof(float));
    }
}
