/* fblc-runner --profile PLAN.json --out RESULTS.json: time the launches of a measurement plan.
 *
 * The plan (fblc/profiles/profiler.py, measurement_plan) holds OpenCL C source, the images and buffers
 * to create, and the launches to time, in order: kernel, arguments ({"image": NAME}, {"buffer": NAME} or
 * {"int": N}), global and local sizes, repeats. The runner builds the source, creates the images (filled
 * with the plan's "uniform" pattern, bit for bit fblc's fill_texels), runs each launch `repeats` times and
 * keeps its shortest device time from profiling events. It knows nothing of what a launch measures: fblc
 * reads the timings with the same code as those of its pyopencl backend (profiler.py, interpret), so a
 * phone's profile and a local one mean the same.
 *
 * A launch whose local size is more than the kernel takes on this device is skipped ("too_large":
 * "skip", the reason is written) or given the driver's local size ("driver"), as the pyopencl backend does.
 *
 * stdout: one JSON object per line: {"device": ...} once the source is built, then {"done": STEP, ...}
 * after the last launch of each step. RESULTS.json: device facts (clGetDeviceInfo), each kernel's
 * work-group facts, each launch's best seconds or why it was skipped; written atomically, and only when
 * every launch ran. Errors: one line "fblc-runner: error: ..." (a build failure adds the compiler's log). */
#include "profile.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json.h"
#include "opencl.h"
#include "runner.h"
#include "util.h"

#define PLAN_FORMAT "fblc-profile-plan"
#define RESULTS_FORMAT "fblc-profile-results"
#define PLAN_VERSION 1
#define MAX_DIMS 3

static const char *plan_file = "";

static void bad_plan(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2), noreturn))
#endif
    ;

static void bad_plan(const char *fmt, ...) {
    char problem[1024];
    va_list args;
    va_start(args, fmt);
    vsnprintf(problem, sizeof problem, fmt, args);
    va_end(args);
    die(EXIT_USAGE, "measurement plan '%s': %s; write it again with 'fblc profile' of the fblc this runner was built "
                    "from", plan_file, problem);
}

static const json_value *member(const json_value *object, const char *key, json_type type, const char *where) {
    const json_value *value = json_get(object, key);
    if (!value || value->type != type) bad_plan("%s has no '%s' of the right type", where, key);
    return value;
}

static const char *text_of(const json_value *object, const char *key, const char *where) {
    return member(object, key, JSON_STRING, where)->string;
}

static long integer_of(const json_value *value, long least, const char *what, const char *where) {
    if (!value || value->type != JSON_NUMBER || value->number != (double)(long)value->number ||
        value->number < (double)least)
        bad_plan("%s: '%s' must be an integer of at least %ld", where, what, least);
    return (long)value->number;
}

typedef struct {
    const char *name;
    cl_mem memory;
} named_memory;

typedef struct {
    const json_value *plan, *kernels_json, *launches;
    device_choice device;
    size_t max_work_group_size;
    cl_context context;
    cl_command_queue queue;
    cl_program program;
    cl_kernel *kernels;
    size_t *kernel_group, *kernel_multiple; /* CL_KERNEL_WORK_GROUP_SIZE, ..._PREFERRED_..._MULTIPLE */
    named_memory *memory;
    size_t memory_count;
    double build_ms;
} profiler;

/* --- the program ------------------------------------------------------------------------------------------ */

static void die_with_build_log(profiler *p) {
    char *log = opencl_build_log(p->program, p->device.device);
    long line = opencl_log_line(log);
    char where[512];
    if (line) snprintf(where, sizeof where, "the plan's source (line %ld, outside its kernels)", line);
    else snprintf(where, sizeof where, "the plan's source (see the log)");
    for (size_t i = 0; line && i < p->kernels_json->count; ++i) {
        const json_value *k = json_at(p->kernels_json, i);
        if (integer_of(json_get(k, "first_line"), 1, "first_line", "a kernel") <= line &&
            line <= integer_of(json_get(k, "last_line"), 1, "last_line", "a kernel")) {
            snprintf(where, sizeof where, "kernel '%s' (line %ld)", text_of(k, "name", "a kernel"), line);
            break;
        }
    }
    size_t length = strlen(log);
    die(EXIT_USAGE, "the OpenCL compiler of %s rejected the benchmark %s:\n%s", p->device.device_name, where,
        length > 3000 ? log + length - 3000 : log);
}

static void build(profiler *p) {
    double started = now_ms();
    const char *source = text_of(p->plan, "source", "the plan");
    size_t length = strlen(source);
    cl_int status;
    p->program = cl.CreateProgramWithSource(p->context, 1, &source, &length, &status);
    check_cl(status, "clCreateProgramWithSource");
    status = cl.BuildProgram(p->program, 1, &p->device.device, build_options(&p->device), NULL, NULL);
    if (status == CL_BUILD_PROGRAM_FAILURE) die_with_build_log(p);
    check_cl(status, "clBuildProgram");
    size_t count = p->kernels_json->count;
    p->kernels = xcalloc(count, sizeof *p->kernels);
    p->kernel_group = xcalloc(count, sizeof *p->kernel_group);
    p->kernel_multiple = xcalloc(count, sizeof *p->kernel_multiple);
    for (size_t i = 0; i < count; ++i) {
        const char *name = text_of(json_at(p->kernels_json, i), "name", "a kernel");
        p->kernels[i] = cl.CreateKernel(p->program, name, &status);
        if (status == CL_INVALID_KERNEL_NAME) bad_plan("its source has no kernel '%s'", name);
        check_cl(status, "clCreateKernel");
        check_cl(cl.GetKernelWorkGroupInfo(p->kernels[i], p->device.device, CL_KERNEL_WORK_GROUP_SIZE,
                                           sizeof p->kernel_group[i], &p->kernel_group[i], NULL),
                 "clGetKernelWorkGroupInfo(WORK_GROUP_SIZE)");
        check_cl(cl.GetKernelWorkGroupInfo(p->kernels[i], p->device.device,
                                           CL_KERNEL_PREFERRED_WORK_GROUP_SIZE_MULTIPLE,
                                           sizeof p->kernel_multiple[i], &p->kernel_multiple[i], NULL),
                 "clGetKernelWorkGroupInfo(PREFERRED_WORK_GROUP_SIZE_MULTIPLE)");
    }
    p->build_ms = now_ms() - started;
}

/* --- images and buffers ----------------------------------------------------------------------------------- */

/* Element k: (scramble(k ^ seed) >> 8) / 2^23 - 1, in [-1, 1); exact in float, so fblc's numpy fill matches. */
static float *fill_uniform(size_t count, uint32_t seed) {
    float *data = xmalloc(count * sizeof *data);
    for (size_t k = 0; k < count; ++k) {
        uint32_t v = (uint32_t)k ^ seed;
        v ^= v >> 16;
        v *= 0x7feb352dU;
        v ^= v >> 15;
        v *= 0x846ca68bU;
        v ^= v >> 16;
        data[k] = (float)(v >> 8) * (1.0f / 8388608.0f) - 1.0f;
    }
    return data;
}

static void create_memory(profiler *p) {
    const json_value *images = member(p->plan, "images", JSON_ARRAY, "the plan");
    const json_value *buffers = member(p->plan, "buffers", JSON_ARRAY, "the plan");
    p->memory = xcalloc(images->count + buffers->count, sizeof *p->memory);
    cl_int status;
    for (size_t i = 0; i < images->count; ++i) {
        const json_value *image = json_at(images, i);
        const char *name = text_of(image, "name", "an image");
        size_t width = (size_t)integer_of(json_get(image, "width"), 1, "width", name);
        size_t height = (size_t)integer_of(json_get(image, "height"), 1, "height", name);
        if (strcmp(text_of(image, "order", name), "RGBA") != 0 || strcmp(text_of(image, "type", name), "FLOAT") != 0 ||
            strcmp(text_of(image, "fill", name), "uniform") != 0)
            bad_plan("image '%s' is not RGBA FLOAT with the \"uniform\" fill, the only kind this runner makes", name);
        if (width > p->device.image_max_width || height > p->device.image_max_height)
            die(EXIT_OPENCL, "image '%s' of the plan is %zu x %zu, beyond %s's image limit %zu x %zu", name, width,
                height, p->device.device_name, p->device.image_max_width, p->device.image_max_height);
        cl_image_format format = {CL_RGBA, CL_FLOAT};
        cl_image_desc desc;
        memset(&desc, 0, sizeof desc);
        desc.image_type = CL_MEM_OBJECT_IMAGE2D;
        desc.image_width = width;
        desc.image_height = height;
        cl_mem memory = cl.CreateImage(p->context, CL_MEM_READ_ONLY, &format, &desc, NULL, &status);
        if (status == CL_MEM_OBJECT_ALLOCATION_FAILURE || status == CL_OUT_OF_RESOURCES)
            die(EXIT_OPENCL, "%s is out of memory for the plan's %zu x %zu image '%s'", p->device.device_name, width,
                height, name);
        check_cl(status, "clCreateImage");
        float *texels = fill_uniform(width * height * 4,
                                     (uint32_t)integer_of(json_get(image, "seed"), 0, "seed", name));
        size_t origin[3] = {0, 0, 0}, region[3] = {width, height, 1};
        check_cl(cl.EnqueueWriteImage(p->queue, memory, CL_TRUE, origin, region, 0, 0, texels, 0, NULL, NULL),
                 "clEnqueueWriteImage");
        free(texels);
        p->memory[p->memory_count++] = (named_memory){name, memory};
    }
    for (size_t i = 0; i < buffers->count; ++i) {
        const json_value *buffer = json_at(buffers, i);
        const char *name = text_of(buffer, "name", "a buffer");
        size_t bytes = (size_t)integer_of(json_get(buffer, "bytes"), 1, "bytes", name);
        cl_mem memory = cl.CreateBuffer(p->context, CL_MEM_WRITE_ONLY, bytes, NULL, &status);
        check_cl(status, "clCreateBuffer");
        p->memory[p->memory_count++] = (named_memory){name, memory};
    }
}

static cl_mem memory_named(const profiler *p, const char *name, const char *launch_id) {
    for (size_t i = 0; i < p->memory_count; ++i)
        if (strcmp(p->memory[i].name, name) == 0) return p->memory[i].memory;
    bad_plan("launch '%s' reads '%s', which the plan does not create", launch_id, name);
}

/* --- launches --------------------------------------------------------------------------------------------- */

static size_t kernel_index(const profiler *p, const char *name, const char *launch_id) {
    for (size_t i = 0; i < p->kernels_json->count; ++i)
        if (strcmp(text_of(json_at(p->kernels_json, i), "name", "a kernel"), name) == 0) return i;
    bad_plan("launch '%s' runs kernel '%s', which the plan does not list", launch_id, name);
}

static cl_uint sizes_of(const json_value *list, size_t *out, const char *what, const char *launch_id) {
    if (!list || list->type != JSON_ARRAY || list->count == 0 || list->count > MAX_DIMS)
        bad_plan("launch '%s': '%s' must list 1 to %d sizes", launch_id, what, MAX_DIMS);
    for (size_t d = 0; d < list->count; ++d) out[d] = (size_t)integer_of(json_at(list, d), 1, what, launch_id);
    return (cl_uint)list->count;
}

static void set_arguments(const profiler *p, cl_kernel kernel, const json_value *launch, const char *id) {
    const json_value *args = member(launch, "args", JSON_ARRAY, id);
    for (size_t a = 0; a < args->count; ++a) {
        const json_value *arg = json_at(args, a), *integer = json_get(arg, "int"), *image = json_get(arg, "image");
        const json_value *named = image ? image : json_get(arg, "buffer");
        cl_int status;
        if (integer) {
            cl_int value = (cl_int)integer_of(integer, -2147483647L, "int", id);
            status = cl.SetKernelArg(kernel, (cl_uint)a, sizeof value, &value);
        } else if (named && named->type == JSON_STRING) {
            cl_mem memory = memory_named(p, named->string, id);
            status = cl.SetKernelArg(kernel, (cl_uint)a, sizeof memory, &memory);
        } else {
            bad_plan("launch '%s': argument %zu is none of {\"int\": N}, {\"image\": NAME}, {\"buffer\": NAME}", id, a);
        }
        if (status != CL_SUCCESS)
            die(EXIT_USAGE, "argument %zu of launch '%s' does not fit its kernel: %s (%d)", a, id,
                opencl_error(status), (int)status);
    }
}

/* The shortest device time of `repeats` runs, in seconds. */
static double time_launch(profiler *p, cl_kernel kernel, cl_uint dims, const size_t *global, const size_t *local,
                          long repeats, const char *id) {
    double best = -1;
    for (long r = 0; r < repeats; ++r) {
        cl_event event;
        cl_int status = cl.EnqueueNDRangeKernel(p->queue, kernel, dims, NULL, global, local, 0, NULL, &event);
        if (status != CL_SUCCESS)
            die(EXIT_OPENCL, "launching '%s' failed: %s (%d)", id, opencl_error(status), (int)status);
        status = cl.Finish(p->queue);
        if (status != CL_SUCCESS)
            die(EXIT_OPENCL, "'%s' failed on %s: %s (%d)", id, p->device.device_name, opencl_error(status),
                (int)status);
        cl_ulong start = 0, end = 0;
        if (cl.GetEventProfilingInfo(event, CL_PROFILING_COMMAND_START, sizeof start, &start, NULL) != CL_SUCCESS ||
            cl.GetEventProfilingInfo(event, CL_PROFILING_COMMAND_END, sizeof end, &end, NULL) != CL_SUCCESS)
            die(EXIT_OPENCL, "%s gives no profiling times for '%s', which the benchmarks need", p->device.device_name,
                id);
        cl.ReleaseEvent(event);
        double seconds = end > start ? (double)(end - start) * 1e-9 : 0.0;
        if (best < 0 || seconds < best) best = seconds;
    }
    return best;
}

/* --- results ---------------------------------------------------------------------------------------------- */

static void device_text(cl_device_id device, cl_device_info what, char *out, size_t size) {
    if (cl.GetDeviceInfo(device, what, size, out, NULL) != CL_SUCCESS) snprintf(out, size, "?");
    out[size - 1] = '\0';
    size_t length = strlen(out);
    while (length && (out[length - 1] == ' ' || out[length - 1] == '\n')) out[--length] = '\0';
}

static unsigned long long device_ulong(cl_device_id device, cl_device_info what) {
    cl_ulong value = 0;
    check_cl(cl.GetDeviceInfo(device, what, sizeof value, &value, NULL), "clGetDeviceInfo");
    return (unsigned long long)value;
}

static unsigned long long device_uint(cl_device_id device, cl_device_info what) {
    cl_uint value = 0;
    check_cl(cl.GetDeviceInfo(device, what, sizeof value, &value, NULL), "clGetDeviceInfo");
    return (unsigned long long)value;
}

static void write_device(FILE *out, const profiler *p) {
    cl_device_id d = p->device.device;
    char vendor[256];
    device_text(d, CL_DEVICE_VENDOR, vendor, sizeof vendor);
    size_t size = 0;
    check_cl(cl.GetDeviceInfo(d, CL_DEVICE_EXTENSIONS, 0, NULL, &size), "clGetDeviceInfo(EXTENSIONS)");
    char *extensions = xcalloc(size + 2, 1);
    check_cl(cl.GetDeviceInfo(d, CL_DEVICE_EXTENSIONS, size, extensions, NULL), "clGetDeviceInfo(EXTENSIONS)");
    strcat(extensions, " ");
    fputs(" \"device\": {\"name\": ", out);
    json_write_string(out, p->device.device_name);
    fputs(", \"vendor\": ", out);
    json_write_string(out, vendor);
    fputs(", \"version\": ", out);
    json_write_string(out, p->device.device_version);
    fputs(", \"driver_version\": ", out);
    json_write_string(out, p->device.driver_version);
    fputs(", \"platform\": ", out);
    json_write_string(out, p->device.platform_name);
    fprintf(out, ",\n  \"image2d_max_width\": %zu, \"image2d_max_height\": %zu, \"max_work_group_size\": %zu,\n",
            p->device.image_max_width, p->device.image_max_height, p->max_work_group_size);
    fprintf(out, "  \"global_mem_cache_size\": %llu, \"global_mem_cacheline_size\": %llu, \"global_mem_size\": %llu, "
                 "\"local_mem_size\": %llu,\n  \"max_compute_units\": %llu, \"max_clock_frequency\": %llu, "
                 "\"fp16\": %s, \"cpu\": %s, \"simd_floats\": %llu, \"subgroups\": %s},\n",
            device_ulong(d, CL_DEVICE_GLOBAL_MEM_CACHE_SIZE), device_uint(d, CL_DEVICE_GLOBAL_MEM_CACHELINE_SIZE),
            device_ulong(d, CL_DEVICE_GLOBAL_MEM_SIZE), device_ulong(d, CL_DEVICE_LOCAL_MEM_SIZE),
            device_uint(d, CL_DEVICE_MAX_COMPUTE_UNITS), device_uint(d, CL_DEVICE_MAX_CLOCK_FREQUENCY),
            strstr(extensions, "cl_khr_fp16 ") ? "true" : "false",
            device_ulong(d, CL_DEVICE_TYPE) & CL_DEVICE_TYPE_CPU ? "true" : "false",
            device_uint(d, CL_DEVICE_NATIVE_VECTOR_WIDTH_FLOAT), strstr(extensions, "cl_khr_subgroups ") ? "true" : "false");
    free(extensions);
}

static void write_kernels(FILE *out, const profiler *p) {
    fputs(" \"kernels\": {", out);
    for (size_t i = 0; i < p->kernels_json->count; ++i) {
        fputs(i ? ",\n  " : "\n  ", out);
        json_write_string(out, text_of(json_at(p->kernels_json, i), "name", "a kernel"));
        fprintf(out, ": {\"work_group_size\": %zu, \"preferred_work_group_size_multiple\": %zu}", p->kernel_group[i],
                p->kernel_multiple[i]);
    }
    fputs("},\n", out);
}

/* --- the mode --------------------------------------------------------------------------------------------- */

static void interrupted_exit(void) {
    partial_unlink_all();
    fputs("fblc-runner: interrupted\n", stderr);
    exit(EXIT_INTERRUPTED);
}

void profile_run(const char *plan_path, const char *out_path, const char *device_spec, int quiet,
                 const char *runner_version, volatile sig_atomic_t *interrupted) {
    double started = now_ms();
    plan_file = plan_path;
    char *text = read_file(plan_path, NULL), error[256];
    if (!text) die(EXIT_USAGE, "cannot read the measurement plan '%s'", plan_path);
    json_value *plan = json_parse(text, error, sizeof error);
    if (!plan || plan->type != JSON_OBJECT) bad_plan("is not a JSON object (%s)", plan ? "another value" : error);
    if (strcmp(text_of(plan, "format", "the plan"), PLAN_FORMAT) != 0 ||
        integer_of(json_get(plan, "version"), 0, "version", "the plan") != PLAN_VERSION)
        bad_plan("is not an %s of version %d", PLAN_FORMAT, PLAN_VERSION);
    profiler p;
    memset(&p, 0, sizeof p);
    p.plan = plan;
    p.kernels_json = member(plan, "kernels", JSON_ARRAY, "the plan");
    p.launches = member(plan, "launches", JSON_ARRAY, "the plan");

    opencl_load();
    device_select(device_spec, &p.device);
    check_cl(cl.GetDeviceInfo(p.device.device, CL_DEVICE_MAX_WORK_GROUP_SIZE, sizeof p.max_work_group_size,
                              &p.max_work_group_size, NULL), "clGetDeviceInfo(MAX_WORK_GROUP_SIZE)");
    cl_int status;
    p.context = cl.CreateContext(NULL, 1, &p.device.device, NULL, NULL, &status);
    check_cl(status, "clCreateContext");
    p.queue = cl.CreateCommandQueue(p.context, p.device.device, CL_QUEUE_PROFILING_ENABLE, &status);
    check_cl(status, "clCreateCommandQueue");
    build(&p);
    create_memory(&p);
    if (*interrupted) interrupted_exit();
    size_t count = p.launches->count;
    if (!quiet) {
        printf("{\"device\": ");
        json_write_string(stdout, p.device.device_name);
        printf(", \"platform\": ");
        json_write_string(stdout, p.device.platform_name);
        printf(", \"build_ms\": ");
        json_write_float(stdout, p.build_ms);
        printf(", \"launches\": %zu}\n", count);
        fflush(stdout);
    }

    char *body = NULL;
    size_t body_length = 0;
    FILE *out = open_memstream(&body, &body_length);
    if (!out) die(EXIT_INTERNAL, "open_memstream failed");
    fprintf(out, "{\n \"format\": \"%s\", \"version\": %d, \"backend\": \"fblc-runner %s\",\n", RESULTS_FORMAT,
            PLAN_VERSION, runner_version);
    write_device(out, &p);
    write_kernels(out, &p);
    fputs(" \"build_ms\": ", out);
    json_write_float(out, p.build_ms);
    fputs(",\n \"launches\": [", out);
    for (size_t i = 0; i < count; ++i) {
        const json_value *launch = json_at(p.launches, i);
        const char *id = text_of(launch, "id", "a launch"), *step = text_of(launch, "step", id);
        size_t k = kernel_index(&p, text_of(launch, "kernel", id), id);
        size_t global[MAX_DIMS], local[MAX_DIMS], limit = p.max_work_group_size, group = 1;
        cl_uint dims = sizes_of(json_get(launch, "global"), global, "global", id);
        const json_value *local_json = json_get(launch, "local");
        int has_local = local_json && local_json->type != JSON_NULL;
        if (has_local && sizes_of(local_json, local, "local", id) != dims)
            bad_plan("launch '%s': 'local' and 'global' differ in dimensions", id);
        for (cl_uint d = 0; has_local && d < dims; ++d) group *= local[d];
        if (p.kernel_group[k] < limit) limit = p.kernel_group[k];
        fprintf(out, "%s\n  {\"id\": ", i ? "," : "");
        json_write_string(out, id);
        if (has_local && group > limit && strcmp(text_of(launch, "too_large", id), "skip") == 0) {
            fprintf(out, ", \"skipped\": \"local size %zu > %zu, the most '%s' takes\"}", group, limit,
                    text_of(launch, "kernel", id));
        } else {
            if (group > limit) has_local = 0; /* "driver": the driver picks the local size */
            set_arguments(&p, p.kernels[k], launch, id);
            long repeats = integer_of(json_get(launch, "repeats"), 1, "repeats", id);
            double seconds = time_launch(&p, p.kernels[k], dims, global, has_local ? local : NULL, repeats, id);
            fputs(", \"seconds\": ", out);
            json_write_float(out, seconds);
            fputc('}', out);
        }
        if (*interrupted) interrupted_exit();
        const json_value *next = json_at(p.launches, i + 1);
        if (!quiet && (!next || strcmp(text_of(next, "step", "a launch"), step) != 0)) {
            printf("{\"done\": ");
            json_write_string(stdout, step);
            printf(", \"launches\": %zu, \"of\": %zu, \"seconds\": ", i + 1, count);
            json_write_float(stdout, (now_ms() - started) * 1e-3);
            printf("}\n");
            fflush(stdout);
        }
    }
    fputs("],\n \"seconds\": ", out);
    json_write_float(out, (now_ms() - started) * 1e-3);
    fputs("\n}\n", out);
    if (fclose(out) != 0) die(EXIT_INTERNAL, "building the results failed");
    int failed = write_atomically(out_path, body, body_length);
    if (failed) die(EXIT_OUTPUT, "cannot write %s (%s)", out_path, strerror(failed));
    free(body);
    json_free(plan);
    free(text);
}
