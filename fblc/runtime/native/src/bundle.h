/* An fblc bundle as the runner reads it: manifest.json, plan.json, kernels.cl, params.bin.
 * The format is fblc/bundle_format.py's; the runner knows nothing about ONNX or models. */
#ifndef FBLC_BUNDLE_H
#define FBLC_BUNDLE_H

#include <stddef.h>
#include <stdint.h>

#define FBLC_FORMAT_NAME "fblc-bundle"
#define FBLC_FORMAT_VERSION 6

/* R uint8 masks: MASK8 holds 8 elements a byte (bit i & 7 of byte i >> 3), MASK4 4 (its fallback) */
enum { FORMAT_F32 = 0, FORMAT_F16 = 1, FORMAT_I32 = 2, FORMAT_MASK4 = 3, FORMAT_MASK8 = 4, FORMAT_COUNT };

typedef struct {
    char *name;
    int format;              /* FORMAT_* */
    size_t width, height;    /* texels */
    size_t elements;         /* product of the tensor shape: the leading scalars that hold the value */
    int has_init;            /* filled from params.bin */
    uint64_t init_offset, init_nbytes;
    size_t image;            /* the plan image that holds it: textures with disjoint lifetimes share one */
    size_t offset, slot;     /* its bytes in plan.json's arena (codegen/arena.py) */
    size_t pitch;            /* row pitch (bytes) of the image made over its slot; 0: the plan made none */
    /* plan.json's R-Tile layout (fblc/texel_layout.py): texel t of the tensor sits at texel_xy(t) */
    int rtile;               /* 0: flat, texel t at (t % width, t / width) */
    size_t c4, tile_h, tile_w4, tile_rows, tile_cols, tiles_per_row;
    int strip, by_columns;
} texture;

/* One of plan.json's images, which the runner allocates as they are: textures of its format and width
 * whose lifetimes do not overlap share it, and it is as tall as the tallest of them. */
typedef struct {
    int format;              /* FORMAT_* */
    size_t width, height;    /* texels */
} image_spec;

/* Image coordinates of texel `t` of texture `tex` (its layout: flat or R-Tile). */
void texel_xy(const texture *tex, size_t t, size_t *x, size_t *y);

typedef struct {
    char *name;              /* the plan's launch name, e.g. k3_MatMul */
    char *function;          /* the __kernel function */
    unsigned work_dim;
    size_t global_size[3];
    size_t local_size[3];    /* the plan's work-group size; all 0: none recorded, the driver picks */
    size_t *arguments;       /* texture ids: outputs, then inputs */
    size_t argument_count;
    long first_line, last_line; /* where it is in kernels.cl (0 if unknown) */
} launch;

/* plan.json's loops: launches [begin, end) run `count` times in a row; after each repetition the (carried, next)
 * texture pairs in `swaps` swap images, so the next repetition reads what this one made (ES members in a loop) */
typedef struct {
    size_t begin, end, count;
    size_t (*swaps)[2];
    size_t swap_count;
} loop_spec;

typedef struct {
    char *name;
    size_t texture;
    size_t elements;
    size_t *shape;
    size_t rank;
} tensor; /* a data input, a trained parameter or a forward bundle's output */

typedef struct {
    char *folder;
    char *target;
    char *fingerprint;       /* manifest "fingerprint" "id" of a bundle with an adapter (a specialist's must equal it);
                                NULL: none recorded */
    texture *textures;
    size_t texture_count;
    image_spec *images;      /* plan.json's images */
    size_t image_count;
    size_t arena_bytes;      /* plan.json's arena: 0 when it has none or made no images over it */
    size_t arena_alignment;  /* every texture's offset is a multiple of it */
    launch *launches;
    size_t launch_count;
    size_t (*swaps)[2];
    size_t swap_count;
    loop_spec *loops;        /* in launch order, none overlapping */
    size_t loop_count;
    size_t (*finite_swaps)[2]; /* swapped only after a step whose finite_flag texture reads 0 (loss scaling) */
    size_t finite_swap_count;
    size_t finite_flag;        /* SIZE_MAX: none */
    tensor *inputs;
    size_t input_count;
    tensor *parameters;
    size_t parameter_count;
    int forward;             /* manifest "step": "forward" (--trainer none): no loss; `outputs` read after each step */
    size_t loss_texture;     /* SIZE_MAX in a forward bundle */
    tensor *outputs;         /* a forward bundle's model outputs (manifest "outputs"); none in a training bundle */
    size_t output_count;
    char **metric_names;     /* scalars reported with the loss each step (manifest "metrics"; ES's reward_mean) */
    size_t *metric_textures;
    size_t metric_count;
    char *kernels_source;
    size_t kernels_length;
    char kernels_sha256[65];
    unsigned char *params;   /* params.bin */
    size_t params_length;
} bundle;

/* Read and check `folder`: format name and version, the manifest's digest of itself (manifest_sha256), the
 * sha256 of every checksummed file, and that every id and size in the plan is consistent. Dies with
 * EXIT_USAGE and a message naming the problem and what to do. */
void bundle_load(const char *folder, bundle *out);

size_t format_element_bytes(int format);  /* 4, 2, 4, 1, 1 */
size_t format_texel_bytes(int format);    /* bytes of an image texel: 16, 8, 16, 1, 1 */
size_t format_texel_elements(int format); /* tensor elements an image texel holds: 4, 4, 4, 4, 8 */
int format_is_mask(int format);
const char *format_name(int format);
int format_of_name(const char *name);     /* FORMAT_*, or -1 */

#endif
