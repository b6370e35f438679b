/* fblc-runner: train with an fblc bundle on an OpenCL device, without Python.
 *
 *   fblc-runner BUNDLE --data DATA.bin --steps N --out DIR [--device P:D] [--no-cache] [--kernel-times] [--quiet]
 *               [--specialist SPECIALIST.bin]
 *   fblc-runner --profile PLAN.json --out RESULTS.json [--device P:D] [--quiet]
 *   fblc-runner --devices
 *   fblc-runner --version
 *
 * DATA.bin (written by fblc from an .npz): "FBLCDAT1", u32 batches, u32 inputs, u32 bytes per batch of
 * each input (manifest order), then the batches one after the other, each the inputs in manifest order,
 * already in their textures' element type (float32, float16 or int32, little-endian), unpadded. Step s
 * trains on batch s mod batches.
 *
 * stdout: one JSON object per line: first {"device": ...}, then {"step": s, "loss": ..., "ms": ...}, with the
 * bundle's metrics (ES's "reward_mean") after the loss; a forward bundle's steps (--trainer none) have no loss.
 * DIR receives params.bin (the trained parameters, float32, manifest order) and results.json (losses,
 * step times, the host time of each step's uploads and launches, with --kernel-times per-kernel device times
 * from profiling events (a profiling queue costs time on some drivers: off unless asked), bytes allocated, the parameters' names, shapes and offsets); both appear atomically,
 * results.json last, and only when every step ran. A forward bundle's run also writes outputs.bin (before them):
 * each step's model outputs (an ES bundle's: its output "rewards", each step's member rewards), step after step, each output its texture's elements (float32, int32 for an integer
 * texture) in manifest order; results.json's "outputs" says where each sits in a step (fblc decodes them with
 * plan.json's value_maps and value_shapes, as LocalRunner.read does).
 * Errors: one line "fblc-runner: error: ..." on stderr and exit codes from util.h.
 *
 * --specialist writes adapter tensors over their textures' initial data before the first step (specialist.c: a
 * forward bundle with adapter sites serves that specialist); results.json's "specialist_bytes" says how many.
 *
 * --profile times the launches of a measurement plan from `fblc profile` and writes their raw timings
 * (profile.c); fblc turns them into a target profile.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bundle.h"
#include "json.h"
#include "opencl.h"
#include "profile.h"
#include "results.h"
#include "runner.h"
#include "util.h"

#define DATA_MAGIC "FBLCDAT1"

static volatile sig_atomic_t interrupted = 0;

static void on_signal(int signal_number) {
    (void)signal_number;
    interrupted = 1;
}

static void usage(void) {
    fputs("usage: fblc-runner BUNDLE --data DATA.bin --steps N --out DIR [--device P:D] [--no-cache] [--kernel-times]\n"
          "                   [--quiet] [--specialist SPECIALIST.bin] [--params PARAMS.bin]\n"
          "       fblc-runner --profile PLAN.json --out RESULTS.json [--device P:D] [--quiet]\n"
          "       fblc-runner --devices | --version\n", stderr);
    exit(EXIT_USAGE);
}

typedef struct {
    unsigned char *bytes;
    size_t batches;
    size_t batch_bytes;
    size_t *offsets; /* of each input inside a batch */
} data_file;

static void data_load(const char *path, const bundle *b, data_file *out) {
    size_t length;
    out->bytes = (unsigned char *)read_file(path, &length);
    if (!out->bytes) die(EXIT_USAGE, "cannot read data file '%s' (%s)", path, strerror(errno));
    if (length < 16 || memcmp(out->bytes, DATA_MAGIC, 8) != 0)
        die(EXIT_USAGE, "'%s' is not an fblc data file (fblc writes it from an .npz)", path);
    out->batches = read_u32le(out->bytes + 8);
    size_t inputs = read_u32le(out->bytes + 12);
    if (inputs != b->input_count || length < 16 + 4 * inputs)
        die(EXIT_USAGE, "data file '%s' holds %zu inputs, the bundle takes %zu; write it again for this bundle", path,
            inputs, b->input_count);
    out->offsets = xcalloc(inputs, sizeof *out->offsets);
    out->batch_bytes = 0;
    for (size_t i = 0; i < inputs; ++i) {
        const texture *t = &b->textures[b->inputs[i].texture];
        size_t want = b->inputs[i].elements * format_element_bytes(t->format), have = read_u32le(out->bytes + 16 + 4 * i);
        if (have != want)
            die(EXIT_USAGE, "data file '%s' has %zu bytes per batch of '%s', the bundle takes %zu (%s); write it again "
                            "for this bundle", path, have, b->inputs[i].name, want, format_name(t->format));
        out->offsets[i] = out->batch_bytes;
        out->batch_bytes += want;
    }
    size_t header = 16 + 4 * inputs;
    if (out->batches == 0 || length != header + out->batches * out->batch_bytes)
        die(EXIT_USAGE, "data file '%s' is truncated or has no batch (%zu bytes for %zu batches of %zu)", path, length,
            out->batches, out->batch_bytes);
    out->bytes += header; /* never freed */
}

static void interrupted_exit(void) {
    partial_unlink_all();
    fputs("fblc-runner: interrupted\n", stderr);
    exit(EXIT_INTERRUPTED);
}

int main(int argc, char **argv) {
    const char *bundle_dir = NULL, *data_path = NULL, *out_dir = NULL, *device_spec = NULL, *plan_path = NULL;
    const char *specialist_path = NULL;
    const char *params_path = NULL; /* initial values in params.bin's form (a fleet round's global model) */
    long steps = -1;
    int use_cache = 1, quiet = 0, list = 0, kernel_times = 0;
    for (int i = 1; i < argc; ++i) {
        const char *arg = argv[i];
        if (strcmp(arg, "--version") == 0) {
            printf("fblc-runner %s (bundle format %s %d)\n", RUNNER_VERSION, FBLC_FORMAT_NAME, FBLC_FORMAT_VERSION);
            return 0;
        } else if (strcmp(arg, "--devices") == 0) list = 1;
        else if (strcmp(arg, "--no-cache") == 0) use_cache = 0;
        else if (strcmp(arg, "--quiet") == 0) quiet = 1;
        else if (strcmp(arg, "--kernel-times") == 0) kernel_times = 1;
        else if (i + 1 < argc && strcmp(arg, "--data") == 0) data_path = argv[++i];
        else if (i + 1 < argc && strcmp(arg, "--profile") == 0) plan_path = argv[++i];
        else if (i + 1 < argc && strcmp(arg, "--specialist") == 0) specialist_path = argv[++i];
        else if (i + 1 < argc && strcmp(arg, "--out") == 0) out_dir = argv[++i];
        else if (i + 1 < argc && strcmp(arg, "--params") == 0) params_path = argv[++i];
        else if (i + 1 < argc && strcmp(arg, "--device") == 0) device_spec = argv[++i];
        else if (i + 1 < argc && strcmp(arg, "--steps") == 0) {
            char *end;
            steps = strtol(argv[++i], &end, 10);
            if (*end || steps < 1) die(EXIT_USAGE, "--steps takes a positive number, not '%s'", argv[i]);
        } else if (arg[0] == '-') {
            fprintf(stderr, "fblc-runner: error: unknown or incomplete option '%s'\n", arg);
            usage();
        } else if (!bundle_dir) bundle_dir = arg;
        else usage();
    }
    if (list) {
        opencl_load();
        device_list();
        return 0;
    }
    if (plan_path ? (bundle_dir || data_path || !out_dir || steps != -1 || !use_cache || kernel_times || specialist_path
                     || params_path)
                  : (!bundle_dir || !data_path || !out_dir || steps < 1))
        usage();

    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_handler = on_signal;
    sigaction(SIGINT, &action, NULL);
    sigaction(SIGTERM, &action, NULL);
    sigaction(SIGHUP, &action, NULL);
    signal(SIGPIPE, SIG_IGN); /* a closed stdout (adb gone) must not kill the run before cleanup */
    if (plan_path) {
        profile_run(plan_path, out_dir, device_spec, quiet, RUNNER_VERSION, &interrupted);
        return 0;
    }

    struct stat folder;
    if (stat(out_dir, &folder) != 0 || !S_ISDIR(folder.st_mode))
        die(EXIT_USAGE, "output folder '%s' does not exist", out_dir);

    bundle b;
    bundle_load(bundle_dir, &b);
    if (specialist_path) specialist_check(&b, specialist_path); /* a wrong one refused before the device is used */
    if (params_path) { /* same offsets as the bundle's params.bin, other values: the bundle's checksums stay */
        size_t length;
        unsigned char *values = (unsigned char *)read_file(params_path, &length);
        if (!values) die(EXIT_USAGE, "cannot read params file '%s' (%s)", params_path, strerror(errno));
        if (length != b.params_length)
            die(EXIT_USAGE, "params file '%s' holds %zu bytes, the bundle's params.bin %zu: write it for this bundle",
                params_path, length, b.params_length);
        b.params = values;
    }
    data_file data;
    data_load(data_path, &b, &data);
    opencl_load();
    device_choice device;
    device_select(device_spec, &device);
    runner r;
    runner_setup(&r, &b, &device, use_cache, kernel_times);
    if (specialist_path) r.specialist_bytes = runner_load_specialist(&r, specialist_path);
    if (interrupted) interrupted_exit();

    if (!quiet) {
        printf("{\"device\": ");
        json_write_string(stdout, device.device_name);
        printf(", \"platform\": ");
        json_write_string(stdout, device.platform_name);
        printf(", \"program_from_cache\": %s, \"build_ms\": ", r.program_from_cache ? "true" : "false");
        json_write_float(stdout, r.build_ms);
        printf(", \"textures_bytes\": %zu, \"kernels\": %zu, \"batches\": %zu, \"specialist_bytes\": %zu}\n",
               r.texture_bytes, b.launch_count, data.batches, r.specialist_bytes);
        fflush(stdout);
    }
    timings record;
    memset(&record, 0, sizeof record);
    record.launch_total = xcalloc(b.launch_count, sizeof *record.launch_total);
    record.launch_min = xcalloc(b.launch_count, sizeof *record.launch_min);
    record.launch_now = xcalloc(b.launch_count, sizeof *record.launch_now);
    const void **inputs = xcalloc(b.input_count, sizeof *inputs);
    output_record produced;
    outputs_prepare(&produced, &b, b.output_count ? (size_t)steps : 0);
    for (long s = 0; s < steps; ++s) {
        const unsigned char *batch = data.bytes + (size_t)(s % (long)data.batches) * data.batch_bytes;
        for (size_t i = 0; i < b.input_count; ++i) inputs[i] = batch + data.offsets[i];
        double started = now_ms();
        double loss = runner_step(&r, inputs, record.launch_now);
        double elapsed = now_ms() - started;
        timings_add(&record, b.launch_count, loss, elapsed, r.submit_ms);
        for (size_t i = 0; i < b.output_count; ++i)
            runner_read_output(&r, i, produced.bytes + (size_t)s * produced.step_bytes + produced.offsets[i]);
        if (!quiet) {
            printf("{\"step\": %ld", s + 1);
            if (!b.forward) {
                printf(", \"loss\": ");
                json_write_float(stdout, loss);
            }
            for (size_t m = 0; m < b.metric_count; ++m) {
                printf(", ");
                json_write_string(stdout, b.metric_names[m]);
                printf(": ");
                json_write_float(stdout, r.metrics[m]);
            }
            printf(", \"ms\": ");
            json_write_float(stdout, elapsed);
            printf("}\n");
            fflush(stdout);
        }
        if (interrupted) interrupted_exit();
    }
    write_outputs(out_dir, &r, &b, &record, &produced);
    if (interrupted) { /* the outputs are complete: keep them, but say so */
        fputs("fblc-runner: interrupted after the last step; results were written\n", stderr);
    }
    return 0;
}
