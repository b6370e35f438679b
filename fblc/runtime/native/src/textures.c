/* The plan's texture formats (bytes and elements of a texel, names) and where texel t of a texture sits in its
 * image (texel_xy: flat, or fblc/texel_layout.py's R-Tile addressing); declared in bundle.h. */
#include "bundle.h"

#include <string.h>

/* The plan's texture formats (fblc/bundle_format.py), by FORMAT_*. */
static const struct {
    const char *name;
    size_t element_bytes, texel_bytes, texel_elements;
} FORMATS[FORMAT_COUNT] = {
    [FORMAT_F32] = {"rgba_f32", 4, 16, 4}, [FORMAT_F16] = {"rgba_f16", 2, 8, 4}, [FORMAT_I32] = {"rgba_i32", 4, 16, 4},
    [FORMAT_MASK4] = {"r_mask4", 1, 1, 4}, [FORMAT_MASK8] = {"r_mask8", 1, 1, 8},
};

size_t format_element_bytes(int format) { return FORMATS[format].element_bytes; }

size_t format_texel_bytes(int format) { return FORMATS[format].texel_bytes; }

size_t format_texel_elements(int format) { return FORMATS[format].texel_elements; }

int format_is_mask(int format) { return format == FORMAT_MASK4 || format == FORMAT_MASK8; }

const char *format_name(int format) { return FORMATS[format].name; }

int format_of_name(const char *name) {
    for (int format = 0; format < FORMAT_COUNT; ++format)
        if (strcmp(FORMATS[format].name, name) == 0) return format;
    return -1;
}

void texel_xy(const texture *tex, size_t t, size_t *x, size_t *y) {
    if (!tex->rtile) {
        *x = t % tex->width;
        *y = t / tex->width;
        return;
    }
    size_t r = t / tex->c4, q = t % tex->c4;
    size_t tr = r / tex->tile_h, ir = r % tex->tile_h, tc = q / tex->tile_w4, iq = q % tex->tile_w4;
    size_t tile = tex->by_columns ? tc * tex->tile_rows + tr : tr * tex->tile_cols + tc;
    size_t gx = tile % tex->tiles_per_row, gy = tile / tex->tiles_per_row;
    if (tex->strip) {
        *x = gx * tex->tile_h * tex->tile_w4 + ir * tex->tile_w4 + iq;
        *y = gy;
    } else {
        *x = gx * tex->tile_w4 + iq;
        *y = gy * tex->tile_h + ir;
    }
}
