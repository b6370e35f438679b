#include "device.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json.h"
#include "util.h"

/* a device with cl_khr_fp16 builds the bundle's half kernels in half (the kernels' `real`; without it, float) */
#define HALF_OPTION "-DFBLC_HALF"
#define MAX_OPTIONS 1024

/* whether `device` lists the extension `name` (a whole word of its extension list) */
int has_extension(cl_device_id device, const char *name) {
    size_t size = 0;
    if (cl.GetDeviceInfo(device, CL_DEVICE_EXTENSIONS, 0, NULL, &size) != CL_SUCCESS) return 0;
    char *extensions = xcalloc(size + 1, 1);
    int found = 0;
    if (cl.GetDeviceInfo(device, CL_DEVICE_EXTENSIONS, size, extensions, NULL) == CL_SUCCESS) {
        const char *at = extensions;
        size_t length = strlen(name);
        while (!found && (at = strstr(at, name)) != NULL) {
            found = (at == extensions || at[-1] == ' ') && (at[length] == ' ' || at[length] == '\0');
            at += length;
        }
    }
    free(extensions);
    return found;
}

const char *build_options(const device_choice *device) {
    static char options[MAX_OPTIONS];
    const char *extra = getenv("FBLC_CL_BUILD_OPTIONS");
    const char *half = has_extension(device->device, "cl_khr_fp16") ? " " HALF_OPTION : "";
    if (extra && *extra) snprintf(options, sizeof options, "%s%s %s", device->language_standard, half, extra);
    else snprintf(options, sizeof options, "%s%s", device->language_standard, half);
    return options;
}

/* OpenCL C 1.2, which every device fblc targets compiles, or on a device with sub-groups (cl_khr_subgroups) of
   OpenCL 2.x / 3.x that version's, whose compilers declare the sub-group built-ins the group reductions call
   (FBLC_SUBGROUPS); as fblc.runtime.local.language_standard */
static void language_standard(cl_device_id device, const char *version, char *out, size_t size) {
    int major = 1;
    sscanf(version, "OpenCL %d.", &major);
    int sub_groups = has_extension(device, "cl_khr_subgroups");
    snprintf(out, size, "-cl-std=%s", !sub_groups || major < 2 ? "CL1.2" : major >= 3 ? "CL3.0" : "CL2.0");
}

static void device_string(cl_device_id device, cl_device_info what, char *out, size_t size) {
    out[0] = '\0';
    if (cl.GetDeviceInfo(device, what, size, out, NULL) != CL_SUCCESS) snprintf(out, size, "?");
    out[size - 1] = '\0';
    /* drivers pad names with spaces */
    size_t length = strlen(out);
    while (length && (out[length - 1] == ' ' || out[length - 1] == '\n')) out[--length] = '\0';
}

static cl_platform_id *platforms_of(cl_uint *count) {
    cl_int status = cl.GetPlatformIDs(0, NULL, count);
    if (status == -1001 /* CL_PLATFORM_NOT_FOUND_KHR */ || (status == CL_SUCCESS && *count == 0))
        die(EXIT_OPENCL, "no OpenCL platform found through %s: install an OpenCL driver (on Debian: apt-get install "
                         "pocl-opencl-icd), or point OCL_ICD_FILENAMES at one", cl.library);
    check_cl(status, "clGetPlatformIDs");
    cl_platform_id *platforms = xcalloc(*count, sizeof *platforms);
    check_cl(cl.GetPlatformIDs(*count, platforms, NULL), "clGetPlatformIDs");
    return platforms;
}

static cl_device_id *devices_of(cl_platform_id platform, cl_uint *count) {
    cl_int status = cl.GetDeviceIDs(platform, CL_DEVICE_TYPE_ALL, 0, NULL, count);
    if (status == CL_DEVICE_NOT_FOUND) {
        *count = 0;
        return NULL;
    }
    check_cl(status, "clGetDeviceIDs");
    cl_device_id *devices = xcalloc(*count, sizeof *devices);
    check_cl(cl.GetDeviceIDs(platform, CL_DEVICE_TYPE_ALL, *count, devices, NULL), "clGetDeviceIDs");
    return devices;
}

static int image_support(cl_device_id device) {
    cl_bool images = CL_FALSE;
    return cl.GetDeviceInfo(device, CL_DEVICE_IMAGE_SUPPORT, sizeof images, &images, NULL) == CL_SUCCESS && images;
}

static void describe(cl_platform_id platform, cl_device_id device, device_choice *out) {
    out->platform = platform;
    out->device = device;
    if (cl.GetPlatformInfo(platform, CL_PLATFORM_NAME, sizeof out->platform_name, out->platform_name, NULL) != CL_SUCCESS)
        snprintf(out->platform_name, sizeof out->platform_name, "?");
    out->platform_name[sizeof out->platform_name - 1] = '\0';
    device_string(device, CL_DEVICE_NAME, out->device_name, sizeof out->device_name);
    device_string(device, CL_DEVICE_VERSION, out->device_version, sizeof out->device_version);
    device_string(device, CL_DRIVER_VERSION, out->driver_version, sizeof out->driver_version);
    language_standard(device, out->device_version, out->language_standard, sizeof out->language_standard);
    check_cl(cl.GetDeviceInfo(device, CL_DEVICE_IMAGE2D_MAX_WIDTH, sizeof out->image_max_width, &out->image_max_width,
                              NULL), "clGetDeviceInfo(IMAGE2D_MAX_WIDTH)");
    check_cl(cl.GetDeviceInfo(device, CL_DEVICE_IMAGE2D_MAX_HEIGHT, sizeof out->image_max_height,
                              &out->image_max_height, NULL), "clGetDeviceInfo(IMAGE2D_MAX_HEIGHT)");
}

void device_select(const char *spec, device_choice *out) {
    cl_uint platform_count;
    cl_platform_id *platforms = platforms_of(&platform_count);
    if (spec) {
        unsigned p, d;
        char tail;
        if (sscanf(spec, "%u:%u%c", &p, &d, &tail) != 2)
            die(EXIT_USAGE, "unknown device '%s'; use P:D (platform and device index, see --devices)", spec);
        cl_uint device_count = 0;
        cl_device_id *devices = p < platform_count ? devices_of(platforms[p], &device_count) : NULL;
        if (d >= device_count) die(EXIT_USAGE, "device '%s' does not exist; list them with --devices", spec);
        if (!image_support(devices[d])) die(EXIT_USAGE, "device '%s' has no image support, which fblc's kernels need", spec);
        describe(platforms[p], devices[d], out);
        free(devices);
        free(platforms);
        return;
    }
    for (cl_uint p = 0; p < platform_count; ++p) {
        cl_uint device_count;
        cl_device_id *devices = devices_of(platforms[p], &device_count);
        for (cl_uint d = 0; d < device_count; ++d)
            if (image_support(devices[d])) {
                describe(platforms[p], devices[d], out);
                free(devices);
                free(platforms);
                return;
            }
        free(devices);
    }
    die(EXIT_OPENCL, "no OpenCL device with image support found through %s", cl.library);
}

void device_list(void) {
    cl_uint platform_count;
    cl_platform_id *platforms = platforms_of(&platform_count);
    for (cl_uint p = 0; p < platform_count; ++p) {
        cl_uint device_count;
        cl_device_id *devices = devices_of(platforms[p], &device_count);
        for (cl_uint d = 0; d < device_count; ++d) {
            device_choice info;
            describe(platforms[p], devices[d], &info);
            printf("{\"id\": \"%u:%u\", \"name\": ", p, d);
            json_write_string(stdout, info.device_name);
            printf(", \"platform\": ");
            json_write_string(stdout, info.platform_name);
            printf(", \"version\": ");
            json_write_string(stdout, info.device_version);
            printf(", \"images\": %s, \"image2d_max\": [%zu, %zu]}\n", image_support(devices[d]) ? "true" : "false",
                   info.image_max_width, info.image_max_height);
        }
        free(devices);
    }
    free(platforms);
}
