/* A specialist (fblc run --infer --specialist): adapter tensors written over their textures' initial data.
 *
 * SPECIALIST.bin (written by fblc.runtime.specialist.write_native after checking the tensors' names and shapes
 * against the manifest's adapter sites): "FBLCSPEC", u32 count, then per texture u32 texture id, u64 bytes, and
 * its texels packed as params.bin holds that texture. Only textures filled from params.bin can be replaced, each
 * with exactly as many bytes: the frozen weights stay as uploaded. */
#include <stdlib.h>
#include <string.h>

#include "runner.h"
#include "util.h"

#define SPECIALIST_MAGIC "FBLCSPEC"

size_t runner_load_specialist(runner *r, const char *path) {
    size_t length = 0;
    unsigned char *data = (unsigned char *)read_file(path, &length);
    if (!data) die(EXIT_USAGE, "cannot read the specialist '%s'", path);
    if (length < 12 || memcmp(data, SPECIALIST_MAGIC, 8) != 0)
        die(EXIT_USAGE, "'%s' is not a specialist file of fblc (fblc run --specialist writes it)", path);
    size_t count = read_u32le(data + 8), at = 12, written = 0;
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
