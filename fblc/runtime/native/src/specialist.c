/* A specialist (fblc run --infer --specialist): adapter tensors written over their textures' initial data.
 *
 * SPECIALIST.bin (written by fblc.runtime.specialist.write_native after checking the tensors' names, shapes and
 * fingerprint against the manifest): "FBLCSPC2", u32 length and the bytes of the id of the fingerprint the
 * specialist carries (0: none), u32 count, then per texture u32 texture id, u64 bytes, and its texels packed as
 * params.bin holds that texture. Only textures filled from params.bin can be replaced, each with exactly as many
 * bytes: the frozen weights stay as uploaded. The id must equal the bundle's manifest "fingerprint" "id": a
 * specialist trained against other frozen factors or base weights has the right sizes and wrong outputs. Where
 * either side has none (runner 5's "FBLCSPEC" file, which had no fingerprint, or a bundle compiled before
 * fingerprints) it loads with a warning. */
#include <stdlib.h>
#include <string.h>

#include "runner.h"
#include "util.h"

#include <stdio.h>

#define SPECIALIST_MAGIC "FBLCSPC2"
#define SPECIALIST_MAGIC_UNCHECKED "FBLCSPEC" /* runner 5's file: no fingerprint */

/* The specialist file at `path` read whole, checked for its magic; `*at` set to its count (past the fingerprint),
 * `*id` / `*id_length` to the fingerprint id (length 0: none). Dies naming the file when it is none of fblc's. */
static unsigned char *read_header(const char *path, size_t *length, size_t *at, const unsigned char **id,
                                  size_t *id_length) {
    unsigned char *data = (unsigned char *)read_file(path, length);
    if (!data) die(EXIT_USAGE, "cannot read the specialist '%s'", path);
    int unchecked = *length >= 12 && memcmp(data, SPECIALIST_MAGIC_UNCHECKED, 8) == 0;
    if (*length < 12 || (!unchecked && memcmp(data, SPECIALIST_MAGIC, 8) != 0))
        die(EXIT_USAGE, "'%s' is not a specialist file of fblc (fblc run --specialist writes it)", path);
    *at = 8;
    *id_length = 0;
    if (!unchecked) {
        *id_length = read_u32le(data + 8);
        if (*length < 16 || *id_length > *length - 16) die(EXIT_USAGE, "the specialist '%s' is truncated", path);
        *at = 12 + *id_length;
    }
    *id = data + (unchecked ? 8 : 12);
    return data;
}

void specialist_check(const bundle *b, const char *path) {
    size_t length, at, id_length;
    const unsigned char *id;
    unsigned char *data = read_header(path, &length, &at, &id, &id_length);
    const char *own = b->fingerprint;
    if (!id_length && own) {
        fprintf(stderr, "warning: the specialist '%s' carries no fingerprint (written before fblc recorded them), so "
                        "whether it was trained on the base weights and frozen factors of '%s' is not checked; export "
                        "it again with fblc export --keep-adapters\n", path, b->folder);
    } else if (id_length && !own) {
        fprintf(stderr, "warning: '%s' records no fingerprint (compiled before fblc recorded them), so whether the "
                        "specialist '%s' was trained on its base weights and frozen factors is not checked; compile "
                        "it again\n", b->folder, path);
    } else if (id_length && (id_length != strlen(own) || memcmp(id, own, id_length) != 0)) {
        die(EXIT_USAGE, "the specialist '%s' was trained against other frozen factors or base weights (fingerprint "
                        "%.*s) than '%s' holds (%s); serve it from a bundle compiled from the same model with the "
                        "training bundle's --adapter/--seed options ('fblc run --specialist' names what differs)",
            path, (int)(id_length < 64 ? id_length : 64), (const char *)id, b->folder, own);
    }
    free(data);
}

size_t runner_load_specialist(runner *r, const char *path) {
    size_t length = 0, at, fingerprint_length; /* the fingerprint: specialist_check compared it */
    const unsigned char *fingerprint;
    unsigned char *data = read_header(path, &length, &at, &fingerprint, &fingerprint_length);
    size_t count = read_u32le(data + at), written = 0;
    at += 4;
    for (size_t k = 0; k < count; ++k) {
        if (at + 12 > length) die(EXIT_USAGE, "the specialist '%s' is truncated", path);
        size_t id = read_u32le(data + at);
        uint64_t bytes = read_u64le(data + at + 4);
        at += 12;
        if (id >= r->b->texture_count || !r->b->textures[id].has_init)
            die(EXIT_USAGE, "the specialist '%s' replaces texture %zu, which holds no initial data in this bundle",
                path, id);
        const texture *t = &r->b->textures[id];
        if (bytes != t->init_nbytes || bytes > length - at)
            die(EXIT_USAGE, "the specialist '%s' gives %llu bytes for texture '%s', which holds %llu", path,
                (unsigned long long)bytes, t->name, (unsigned long long)t->init_nbytes);
        runner_write_initial(r, id, data + at);
        at += (size_t)bytes;
        written += (size_t)bytes;
    }
    if (at != length) die(EXIT_USAGE, "the specialist '%s' has %zu bytes after its last texture", path, length - at);
    free(data);
    return written;
}
