/* The OpenCL device a run uses: chosen by "P:D" or the first with image support, described (names, versions,
 * image limits), listed for --devices, and the build options it takes. */
#ifndef FBLC_DEVICE_H
#define FBLC_DEVICE_H

#include "opencl.h"

typedef struct {
    cl_platform_id platform;
    cl_device_id device;
    char platform_name[256], device_name[256], device_version[256], driver_version[256];
    char language_standard[16]; /* -cl-std=CL1.2, or the device's OpenCL 2.0 / 3.0 where it has sub-groups */
    size_t image_max_width, image_max_height;
} device_choice;

/* the device's -cl-std (device_choice.language_standard), "-DFBLC_HALF" where the device has cl_khr_fp16
   (LocalRunner's too), then $FBLC_CL_BUILD_OPTIONS if set (appended, as PYOPENCL_BUILD_OPTIONS is by pyopencl) */
const char *build_options(const device_choice *device);

/* "P:D" or NULL for the first device with image support (what `fblc run --device local` takes). */
void device_select(const char *spec, device_choice *out);
void device_list(void); /* one JSON object per line */

/* whether `device` lists the extension `name` (a whole word of its extension list) */
int has_extension(cl_device_id device, const char *name);

#endif
