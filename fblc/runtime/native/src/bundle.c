#include "bundle.h"

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checksums.h"
#include "json.h"
#include "util.h"

static const char *folder_of_error;

static void bad(const char *what) {
    die(EXIT_USAGE, "'%s' is not a valid fblc bundle: %s; compile the bundle again", folder_of_error, what);
}

static const json_value *need(const json_value *object, const char *key, json_type type, const char *where) {
    const json_value *value = json_get(object, key);
    if (!value || value->type != type) {
        char message[256];
        snprintf(message, sizeof message, "%s has no valid '%s'", where, key);
        bad(message);
    }
    return value;
}

static size_t need_size(const json_value *object, const char *key, const char *where) {
    const json_value *value = need(object, key, JSON_NUMBER, where);
    if (value->number < 0 || value->number != floor(value->number) || value->number > 9.0e15) {
        char message[256];
        snprintf(message, sizeof message, "%s has a bad '%s'", where, key);
        bad(message);
    }
    return (size_t)value->number;
}

static size_t as_size(const json_value *value, const char *where) {
    if (!value || value->type != JSON_NUMBER || value->number < 0 || value->number != floor(value->number) ||
        value->number > 9.0e15)
        bad(where);
    return (size_t)value->number;
}

/* plan.json's (state, .new) texture pairs */
static size_t (*read_swaps(const json_value *swaps, size_t texture_count, size_t *count))[2] {
    size_t (*pairs)[2] = xcalloc(swaps->count ? swaps->count : 1, sizeof *pairs);
    *count = swaps->count;
    for (size_t i = 0; i < swaps->count; ++i) {
        const json_value *pair = json_at(swaps, i);
        if (!pair || pair->type != JSON_ARRAY || pair->count != 2) bad("a swap is not a pair of texture ids");
        for (int k = 0; k < 2; ++k) {
            pairs[i][k] = as_size(json_at(pair, (size_t)k), "a swap is not a pair of texture ids");
            if (pairs[i][k] >= texture_count) bad("a swap names a texture the plan does not have");
        }
    }
    return pairs;
}

/* plan.json's optional loops: each a range of launches after the previous loop, repeated `count` >= 1 times */
static void read_loops(const json_value *loops, bundle *out) {
    if (!loops) return;
    if (loops->type != JSON_ARRAY) bad("plan.json's loops is not a list");
    out->loop_count = loops->count;
    out->loops = xcalloc(loops->count ? loops->count : 1, sizeof *out->loops);
    size_t after = 0; /* the first launch the next loop may begin at */
    for (size_t i = 0; i < loops->count; ++i) {
        const json_value *entry = json_at(loops, i);
        if (!entry || entry->type != JSON_OBJECT) bad("a loop of plan.json is not an object");
        loop_spec *l = &out->loops[i];
        l->begin = need_size(entry, "begin", "a loop");
        l->end = need_size(entry, "end", "a loop");
        l->count = need_size(entry, "count", "a loop");
        if (l->begin < after || l->end <= l->begin || l->end > out->launch_count || l->count < 1)
            bad("a loop of plan.json is not a range of launches after the previous loop, repeated at least once");
        after = l->end;
        const json_value *swaps = need(entry, "swaps", JSON_ARRAY, "a loop");
        l->swaps = read_swaps(swaps, out->texture_count, &l->swap_count);
    }
}

/* a * b, or the bundle is refused: sizes come from JSON, and a wrapped product would pass the checks below */
static size_t mul_size(size_t a, size_t b, const char *where) {
    if (b != 0 && a > SIZE_MAX / b) bad(where);
    return a * b;
}

static json_value *parse_file(const char *folder, const char *name, char **text_out, size_t *length_out) {
    char *path = path_join(folder, name);
    size_t length;
    char *text = read_file(path, &length);
    if (!text) die(EXIT_USAGE, "cannot read '%s' (%s); compile the bundle again", path, strerror(errno));
    char error[256];
    json_value *root = json_parse(text, error, sizeof error);
    if (!root) die(EXIT_USAGE, "'%s' is not valid JSON (%s); compile the bundle again", path, error);
    free(path);
    if (text_out) *text_out = text;
    else free(text);
    if (length_out) *length_out = length;
    return root;
}

static void read_tensor(const json_value *entry, tensor *out, size_t texture_count, const char *where) {
    out->name = xstrdup(need(entry, "name", JSON_STRING, where)->string);
    out->texture = need_size(entry, "texture", where);
    if (out->texture >= texture_count) bad("a tensor names a texture the plan does not have");
    const json_value *shape = need(entry, "shape", JSON_ARRAY, where);
    out->rank = shape->count;
    out->shape = xcalloc(shape->count, sizeof *out->shape);
    out->elements = 1;
    for (size_t i = 0; i < shape->count; ++i) {
        out->shape[i] = as_size(json_at(shape, i), "a tensor shape is not a list of sizes");
        out->elements = mul_size(out->elements, out->shape[i], "a tensor has more elements than a size holds");
    }
}

void bundle_load(const char *folder, bundle *out) {
    memset(out, 0, sizeof *out);
    folder_of_error = folder;
    out->folder = xstrdup(folder);
    char *manifest_path = path_join(folder, "manifest.json");
    FILE *probe = fopen(manifest_path, "rb");
    if (!probe)
        die(EXIT_USAGE, "'%s' is not an fblc bundle: manifest.json is missing; compile one with "
                        "'fblc compile MODEL -o DIR'", folder);
    fclose(probe);
    free(manifest_path);
    char *manifest_text;
    size_t manifest_length;
    json_value *manifest = parse_file(folder, "manifest.json", &manifest_text, &manifest_length);
    const json_value *format = json_get(manifest, "format"), *version = json_get(manifest, "format_version");
    if (!format || format->type != JSON_STRING || strcmp(format->string, FBLC_FORMAT_NAME) != 0 || !version ||
        version->type != JSON_NUMBER || version->number != FBLC_FORMAT_VERSION) {
        char found[128];
        if (version && version->type == JSON_NUMBER) snprintf(found, sizeof found, "%g", version->number);
        else snprintf(found, sizeof found, "None");
        die(EXIT_USAGE, "'%s' has format '%s' version %s; this runner reads %s version %d: compile it again with "
                        "the fblc that built this runner", folder,
            format && format->type == JSON_STRING ? format->string : "None", found, FBLC_FORMAT_NAME,
            FBLC_FORMAT_VERSION);
    }
    if (!manifest_seal_holds(manifest_text, manifest_length))
        die(EXIT_USAGE, "'%s/manifest.json' does not match its own checksum (manifest_sha256): corrupt or edited; "
                        "compile the bundle again", folder);
    free(manifest_text);
    check_checksums(folder, manifest, out);
    const json_value *target = json_get(manifest, "target");
    out->target = xstrdup(target && target->type == JSON_STRING ? target->string : "?");
    const json_value *fingerprint = json_get(manifest, "fingerprint");
    const json_value *identity = fingerprint ? json_get(fingerprint, "id") : NULL;
    out->fingerprint = identity && identity->type == JSON_STRING ? xstrdup(identity->string) : NULL;

    json_value *plan = parse_file(folder, "plan.json", NULL, NULL);
    const json_value *images = need(plan, "images", JSON_ARRAY, "plan.json");
    out->image_count = images->count;
    out->images = xcalloc(images->count + 1, sizeof *out->images);
    for (size_t i = 0; i < images->count; ++i) {
        const json_value *entry = json_at(images, i);
        image_spec *im = &out->images[i];
        im->format = format_of_name(need(entry, "format", JSON_STRING, "an image")->string);
        if (im->format < 0) bad("an image has an unknown format");
        im->width = need_size(entry, "width", "an image");
        im->height = need_size(entry, "height", "an image");
        if (!im->width || !im->height) bad("an image has no texels");
    }
    /* the arena's images (cl_khr_image2d_from_buffer), where the target made them; the runner checks the device */
    const json_value *arena = json_get(plan, "arena");
    const json_value *arena_images = arena && arena->type == JSON_OBJECT ? json_get(arena, "images") : NULL;
    if (arena_images && arena_images->type == JSON_BOOL && arena_images->number != 0) {
        out->arena_bytes = need_size(arena, "bytes", "the arena");
        out->arena_alignment = need_size(arena, "alignment", "the arena");
        if (!out->arena_alignment) bad("the arena has no alignment");
    }
    const json_value *textures = need(plan, "textures", JSON_ARRAY, "plan.json");
    out->texture_count = textures->count;
    out->textures = xcalloc(textures->count, sizeof *out->textures);
    for (size_t i = 0; i < textures->count; ++i) {
        const json_value *entry = json_at(textures, i);
        texture *t = &out->textures[i];
        const json_value *id = json_get(entry, "id");
        if (id && as_size(id, "a texture id is not a number") != i) bad("texture ids are not in order");
        t->name = xstrdup(need(entry, "name", JSON_STRING, "a texture")->string);
        const char *format = need(entry, "format", JSON_STRING, "a texture")->string;
        t->format = format_of_name(format);
        if (t->format < 0) {
            char message[512];
            snprintf(message, sizeof message, "texture '%.200s' has the unknown format '%.100s'", t->name, format);
            bad(message);
        }
        t->width = need_size(entry, "width", "a texture");
        t->height = need_size(entry, "height", "a texture");
        if (!t->width || !t->height) bad("a texture has no texels");
        const json_value *shape = need(entry, "shape", JSON_ARRAY, "a texture");
        t->elements = 1;
        for (size_t k = 0; k < shape->count; ++k)
            t->elements = mul_size(t->elements, as_size(json_at(shape, k), "a texture shape is bad"),
                                   "a texture's tensor has more elements than a size holds");
        size_t texels = mul_size(t->width, t->height, "a texture has more texels than a size holds");
        if (t->elements > mul_size(texels, format_texel_elements(t->format), "a texture is too large"))
            bad("a texture is smaller than its tensor");
        const json_value *layout = json_get(entry, "layout");  /* absent: flat */
        const json_value *kind = layout ? json_get(layout, "kind") : NULL;
        if (kind && kind->type == JSON_STRING && strcmp(kind->string, "rtile") == 0) {
            size_t rows = need_size(layout, "rows", "an R-Tile layout"), cols = need_size(layout, "cols", "an R-Tile layout");
            t->rtile = 1;
            t->c4 = cols / 4;
            t->tile_h = need_size(layout, "tile_h", "an R-Tile layout");
            t->tile_w4 = need_size(layout, "tile_w", "an R-Tile layout") / 4;
            t->tiles_per_row = need_size(layout, "tiles_per_row", "an R-Tile layout");
            if (!t->c4 || cols % 4 || !t->tile_h || !t->tile_w4 || !t->tiles_per_row) bad("an R-Tile layout is empty");
            t->tile_rows = (rows + t->tile_h - 1) / t->tile_h;
            t->tile_cols = (t->c4 + t->tile_w4 - 1) / t->tile_w4;
            t->strip = strcmp(need(layout, "packing", JSON_STRING, "an R-Tile layout")->string, "strip") == 0;
            t->by_columns = strcmp(need(layout, "arrangement", JSON_STRING, "an R-Tile layout")->string, "columns") == 0;
            if (mul_size(rows, t->c4, "an R-Tile layout is too large") * 4 < t->elements)
                bad("an R-Tile layout holds fewer elements than its tensor");
        }
        t->image = need_size(entry, "image", "a texture");
        if (t->image >= out->image_count) bad("a texture names an image the plan does not have");
        const image_spec *im = &out->images[t->image];
        if (im->format != t->format || im->width != t->width || im->height < t->height) {
            char message[512];
            snprintf(message, sizeof message,
                     "texture '%.200s' (%s, %zu x %zu) does not fit its image %zu (%s, %zu x %zu)", t->name,
                     format_name(t->format), t->width, t->height, t->image, format_name(im->format), im->width,
                     im->height);
            bad(message);
        }
        if (out->arena_bytes) {
            t->offset = need_size(entry, "offset", "a texture");
            t->slot = need_size(entry, "slot", "a texture");
            t->pitch = need_size(entry, "pitch", "a texture");
            if (t->slot > out->arena_bytes || t->offset > out->arena_bytes - t->slot || t->offset % out->arena_alignment)
                bad("a texture's slot lies outside the arena or off its alignment");
            if (t->pitch < t->width * format_texel_bytes(t->format) || t->pitch * t->height > t->slot)
                bad("a texture's image rows do not fit its slot of the arena");
        }
        const json_value *init = json_get(entry, "init");
        if (init && init->type == JSON_OBJECT) {
            t->has_init = 1;
            t->init_offset = need_size(init, "offset", "a texture's init");
            t->init_nbytes = need_size(init, "nbytes", "a texture's init");
            if (t->init_nbytes != mul_size(texels, format_texel_bytes(t->format), "a texture is too large"))
                bad("a texture's init is not one full texture");
            if (t->init_nbytes > out->params_length || t->init_offset > out->params_length - t->init_nbytes) bad("a texture's init lies past the end of params.bin");
        }
    }

    const json_value *kernels = need(plan, "kernels", JSON_ARRAY, "plan.json");
    out->launch_count = kernels->count;
    out->launches = xcalloc(kernels->count, sizeof *out->launches);
    for (size_t i = 0; i < kernels->count; ++i) {
        const json_value *entry = json_at(kernels, i);
        launch *l = &out->launches[i];
        l->name = xstrdup(need(entry, "name", JSON_STRING, "a kernel launch")->string);
        const json_value *function = json_get(entry, "function");
        l->function = xstrdup(function && function->type == JSON_STRING ? function->string : l->name);
        const json_value *global = need(entry, "global_size", JSON_ARRAY, "a kernel launch");
        if (global->count < 1 || global->count > 3) bad("a kernel launch has a global size of 1 to 3 dimensions");
        l->work_dim = (unsigned)global->count;
        for (size_t k = 0; k < global->count; ++k) l->global_size[k] = as_size(json_at(global, k), "bad global size");
        const json_value *local = json_get(entry, "local_size");
        if (local && local->type == JSON_ARRAY) {
            if (local->count != global->count) bad("a kernel launch's local size has another rank than its global size");
            for (size_t k = 0; k < local->count; ++k) {
                l->local_size[k] = as_size(json_at(local, k), "bad local size");
                if (l->local_size[k] == 0 || l->global_size[k] % l->local_size[k] != 0)
                    bad("a kernel launch's global size is not a multiple of its local size");
            }
        }
        const json_value *outputs = need(entry, "outputs", JSON_ARRAY, "a kernel launch");
        const json_value *inputs = need(entry, "inputs", JSON_ARRAY, "a kernel launch");
        l->argument_count = outputs->count + inputs->count;
        l->arguments = xcalloc(l->argument_count, sizeof *l->arguments);
        for (size_t k = 0; k < l->argument_count; ++k) {
            const json_value *id = k < outputs->count ? json_at(outputs, k) : json_at(inputs, k - outputs->count);
            l->arguments[k] = as_size(id, "a kernel argument is not a texture id");
            if (l->arguments[k] >= out->texture_count) bad("a kernel argument names a texture the plan does not have");
        }
        const json_value *lines = json_get(entry, "lines");
        if (lines && lines->type == JSON_ARRAY && lines->count == 2) {
            l->first_line = (long)as_size(json_at(lines, 0), "bad kernel lines");
            l->last_line = (long)as_size(json_at(lines, 1), "bad kernel lines");
        }
    }

    out->swaps = read_swaps(need(plan, "swaps", JSON_ARRAY, "plan.json"), out->texture_count, &out->swap_count);
    read_loops(json_get(plan, "loops"), out);
    /* under dynamic loss scaling: pairs swapped only after a step whose flag texture (metric `skipped`) reads 0 */
    const json_value *gated = json_get(plan, "swaps_if_finite");
    out->finite_flag = SIZE_MAX;
    if (gated) {
        out->finite_flag = as_size(need(gated, "flag", JSON_NUMBER, "swaps_if_finite"), "bad swaps_if_finite flag");
        if (out->finite_flag >= out->texture_count) bad("swaps_if_finite names a texture the plan does not have");
        out->finite_swaps = read_swaps(need(gated, "pairs", JSON_ARRAY, "swaps_if_finite"), out->texture_count,
                                       &out->finite_swap_count);
    }

    const json_value *inputs = need(manifest, "inputs", JSON_ARRAY, "manifest.json");
    out->input_count = inputs->count;
    out->inputs = xcalloc(inputs->count, sizeof *out->inputs);
    for (size_t i = 0; i < inputs->count; ++i) {
        read_tensor(json_at(inputs, i), &out->inputs[i], out->texture_count, "a manifest input");
        const texture *t = &out->textures[out->inputs[i].texture];
        if (out->inputs[i].elements > mul_size(mul_size(t->width, t->height, "a texture is too large"), 4,
                                                 "a texture is too large")) bad("an input is larger than its texture");
        if (t->rtile) bad("an input's texture has an R-Tile layout: the runner uploads inputs flat");
    }
    const json_value *parameters = need(manifest, "parameters", JSON_ARRAY, "manifest.json");
    out->parameter_count = parameters->count;
    out->parameters = xcalloc(parameters->count, sizeof *out->parameters);
    for (size_t i = 0; i < parameters->count; ++i) {
        read_tensor(json_at(parameters, i), &out->parameters[i], out->texture_count, "a manifest parameter");
        const texture *t = &out->textures[out->parameters[i].texture];
        if (out->parameters[i].elements > mul_size(mul_size(t->width, t->height, "a texture is too large"), 4,
                                                     "a texture is too large")) bad("a parameter is larger than its texture");
    }
    const json_value *step = json_get(manifest, "step");
    out->forward = step && step->type == JSON_STRING && strcmp(step->string, "forward") == 0;
    if (step && !out->forward) bad("manifest.json's step is not \"forward\", the one kind the runner knows besides training");
    out->loss_texture = SIZE_MAX;
    if (!out->forward) {
        out->loss_texture = need_size(manifest, "loss", "manifest.json");
        if (out->loss_texture >= out->texture_count) bad("the loss names a texture the plan does not have");
        /* an ES step's member rewards, read back after each step like a forward bundle's outputs: a fleet client
           sends them instead of its model (fblc.fleet.es_seeds) */
        const json_value *outputs = need(manifest, "outputs", JSON_ARRAY, "manifest.json");
        out->outputs = xcalloc(2, sizeof *out->outputs);
        for (size_t i = 0; i < outputs->count; ++i) {
            const json_value *name = json_get(json_at(outputs, i), "name");
            if (name && name->type == JSON_STRING && strcmp(name->string, "rewards") == 0) {
                read_tensor(json_at(outputs, i), &out->outputs[0], out->texture_count, "a manifest output");
                out->output_count = 1;
            }
        }
    } else { /* read back after each step: floats as float32, integers as int32 (runner_read_output) */
        const json_value *outputs = need(manifest, "outputs", JSON_ARRAY, "manifest.json");
        out->output_count = outputs->count;
        out->outputs = xcalloc(outputs->count + 1, sizeof *out->outputs);
        for (size_t i = 0; i < outputs->count; ++i) {
            read_tensor(json_at(outputs, i), &out->outputs[i], out->texture_count, "a manifest output");
            const texture *t = &out->textures[out->outputs[i].texture];
            if (format_is_mask(t->format))
                die(EXIT_USAGE, "'%s': output '%s' is a boolean mask (%s), which the runner does not read back; run "
                    "the bundle with fblc run --infer on a local device", folder_of_error, out->outputs[i].name,
                    format_name(t->format));
        }
    }
    if (json_get(manifest, "external_rewards"))
        die(EXIT_USAGE, "'%s' takes its ES rewards from the application (--reward external), which the runner cannot "
            "compute; train it with fblc.runtime.LocalRunner and a reward function, or compile with --reward neg-loss",
            folder_of_error);
    const json_value *metrics = need(manifest, "metrics", JSON_ARRAY, "manifest.json");
    out->metric_count = metrics->count;
    out->metric_names = xcalloc(out->metric_count + 1, sizeof *out->metric_names);
    out->metric_textures = xcalloc(out->metric_count + 1, sizeof *out->metric_textures);
    for (size_t i = 0; i < out->metric_count; ++i) {
        const json_value *entry = json_at(metrics, i);
        out->metric_names[i] = xstrdup(need(entry, "name", JSON_STRING, "a manifest metric")->string);
        out->metric_textures[i] = need_size(entry, "texture", "a manifest metric");
        if (out->metric_textures[i] >= out->texture_count) bad("a metric names a texture the plan does not have");
    }
    json_free(manifest);
    json_free(plan);
}
