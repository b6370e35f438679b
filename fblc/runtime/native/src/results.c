#include "results.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "json.h"
#include "util.h"

static void write_shape(FILE *out, const tensor *t) {
    fputc('[', out);
    for (size_t k = 0; k < t->rank; ++k) fprintf(out, "%s%zu", k ? ", " : "", t->shape[k]);
    fputc(']', out);
}

void timings_add(timings *t, size_t launches, double loss, double step_ms, double submit_ms) {
    if (t->steps == t->capacity) {
        t->capacity = t->capacity ? 2 * t->capacity : 1024;
        t->losses = xrealloc(t->losses, t->capacity * sizeof *t->losses);
        t->step_ms = xrealloc(t->step_ms, t->capacity * sizeof *t->step_ms);
        t->kernel_ms = xrealloc(t->kernel_ms, t->capacity * sizeof *t->kernel_ms);
        t->submit_ms = xrealloc(t->submit_ms, t->capacity * sizeof *t->submit_ms);
    }
    double sum = 0;
    for (size_t k = 0; k < launches; ++k) {
        double ms = t->launch_now[k];
        sum += ms;
        t->launch_total[k] += ms;
        if (t->steps == 0 || ms < t->launch_min[k]) t->launch_min[k] = ms;
    }
    t->losses[t->steps] = loss;
    t->step_ms[t->steps] = step_ms;
    t->kernel_ms[t->steps] = sum;
    t->submit_ms[t->steps] = submit_ms;
    t->steps++;
}

static void write_list(FILE *out, const double *values, size_t count) {
    fputc('[', out);
    for (size_t i = 0; i < count; ++i) {
        if (i) fputs(", ", out);
        json_write_float(out, values[i]);
    }
    fputc(']', out);
}

void outputs_prepare(output_record *o, const bundle *b, size_t steps) {
    o->offsets = xcalloc(b->output_count + 1, sizeof *o->offsets);
    o->step_bytes = 0;
    for (size_t i = 0; i < b->output_count; ++i) {
        o->offsets[i] = o->step_bytes;
        o->step_bytes += b->textures[b->outputs[i].texture].elements * 4; /* float32 or int32 */
    }
    o->bytes = xcalloc(steps * o->step_bytes + 1, 1);
}

void write_outputs(const char *folder, runner *r, const bundle *b, const timings *t, const output_record *o) {
    size_t steps = t->steps;
    char *outputs_path = path_join(folder, "outputs.bin");
    if (b->output_count) { /* first: results.json, written last, says that the run is complete */
        int failed = write_atomically(outputs_path, o->bytes, steps * o->step_bytes);
        if (failed) die(EXIT_OUTPUT, "cannot write %s (%s)", outputs_path, strerror(failed));
    }
    /* parameters */
    size_t total = 0;
    for (size_t i = 0; i < b->parameter_count; ++i) total += b->parameters[i].elements;
    float *values = xcalloc(total, sizeof *values);
    size_t at = 0;
    for (size_t i = 0; i < b->parameter_count; ++i) {
        runner_read_parameter(r, i, values + at);
        at += b->parameters[i].elements;
    }
    char *params_path = path_join(folder, "params.bin");
    int error = write_atomically(params_path, values, total * sizeof *values);
    if (error) die(EXIT_OUTPUT, "cannot write %s (%s)", params_path, strerror(error));

    /* results.json, in memory first */
    char *text = NULL;
    size_t text_length = 0;
    FILE *out = open_memstream(&text, &text_length);
    if (!out) die(EXIT_INTERNAL, "open_memstream failed");
    fprintf(out, "{\n \"format\": \"fblc-runner-results\", \"version\": 2, \"runner_version\": \"%s\",\n \"bundle\": ",
            RUNNER_VERSION);
    json_write_string(out, b->folder);
    fprintf(out, ", \"target\": ");
    json_write_string(out, b->target);
    fprintf(out, ",\n \"device\": {\"name\": ");
    json_write_string(out, r->device.device_name);
    fprintf(out, ", \"platform\": ");
    json_write_string(out, r->device.platform_name);
    fprintf(out, ", \"version\": ");
    json_write_string(out, r->device.device_version);
    fprintf(out, ", \"driver\": ");
    json_write_string(out, r->device.driver_version);
    fprintf(out, ", \"library\": ");
    json_write_string(out, cl.library);
    fprintf(out, "},\n \"program\": {\"from_cache\": %s, \"build_ms\": ", r->program_from_cache ? "true" : "false");
    json_write_float(out, r->build_ms);
    fprintf(out, "},\n \"bytes_allocated\": {\"textures\": %zu, \"host_staging\": %zu},\n", r->texture_bytes,
            r->host_bytes);
    fprintf(out, " \"specialist_bytes\": %zu,\n", r->specialist_bytes);
    fprintf(out, " \"steps\": %zu,\n \"losses\": ", steps);
    write_list(out, t->losses, b->forward ? 0 : steps); /* a forward bundle has no loss */
    fputs(",\n \"step_ms\": ", out);
    write_list(out, t->step_ms, steps);
    fputs(",\n \"kernel_ms\": ", out);
    if (r->kernel_times) write_list(out, t->kernel_ms, steps);
    else fputs("null", out);
    fputs(",\n \"submit_ms\": ", out);
    write_list(out, t->submit_ms, steps);
    fputs(",\n \"kernels\": [", out);
    for (size_t k = 0; r->kernel_times && k < b->launch_count; ++k) {
        double sum = t->launch_total[k], least = t->launch_min[k];
        fprintf(out, "%s\n  {\"name\": ", k ? "," : "");
        json_write_string(out, b->launches[k].name);
        fprintf(out, ", \"function\": ");
        json_write_string(out, b->launches[k].function);
        fprintf(out, ", \"calls\": %zu, \"total_ms\": ", steps);
        json_write_float(out, sum);
        fprintf(out, ", \"mean_ms\": ");
        json_write_float(out, steps ? sum / (double)steps : 0.0);
        fprintf(out, ", \"min_ms\": ");
        json_write_float(out, least);
        fputc('}', out);
    }
    fputs("],\n \"params_file\": \"params.bin\", \"params_dtype\": \"float32\",\n \"parameters\": [", out);
    at = 0;
    for (size_t i = 0; i < b->parameter_count; ++i) {
        fprintf(out, "%s\n  {\"name\": ", i ? "," : "");
        json_write_string(out, b->parameters[i].name);
        fputs(", \"shape\": ", out);
        write_shape(out, &b->parameters[i]);
        fprintf(out, ", \"offset\": %zu, \"nbytes\": %zu}", at * sizeof(float), b->parameters[i].elements * sizeof(float));
        at += b->parameters[i].elements;
    }
    fputc(']', out);
    if (b->output_count) {
        fprintf(out, ",\n \"outputs_file\": \"outputs.bin\", \"step_bytes\": %zu,\n \"outputs\": [", o->step_bytes);
        for (size_t i = 0; i < b->output_count; ++i) {
            const texture *tex = &b->textures[b->outputs[i].texture];
            fprintf(out, "%s\n  {\"name\": ", i ? "," : "");
            json_write_string(out, b->outputs[i].name);
            fprintf(out, ", \"texture\": %zu, \"dtype\": \"%s\", \"elements\": %zu, \"offset\": %zu}",
                    b->outputs[i].texture, tex->format == FORMAT_I32 ? "int32" : "float32", tex->elements,
                    o->offsets[i]);
        }
        fputc(']', out);
    }
    fputs("\n}\n", out);
    if (fclose(out) != 0) die(EXIT_INTERNAL, "building results.json failed");
    char *results_path = path_join(folder, "results.json");
    error = write_atomically(results_path, text, text_length);
    if (error) {
        unlink(params_path);
        if (b->output_count) unlink(outputs_path);
        die(EXIT_OUTPUT, "cannot write %s (%s)", results_path, strerror(error));
    }
    free(text);
    free(values);
    free(params_path);
    free(results_path);
    free(outputs_path);
}
