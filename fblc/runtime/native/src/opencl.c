#include "opencl.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

opencl_api cl;

#if defined(__LP64__) || defined(_LP64)
#define LIBDIR "lib64"
#else
#define LIBDIR "lib"
#endif

/* Where phones keep their OpenCL driver: Qualcomm (Adreno) and most others ship libOpenCL.so under
 * /vendor; Arm Mali drivers are often only reachable through libGLES_mali.so; PowerVR ships libPVROCL.so. */
static const char *const CANDIDATES[] = {
    "/vendor/" LIBDIR "/libOpenCL.so",
    "/system/vendor/" LIBDIR "/libOpenCL.so",
    "/system/" LIBDIR "/libOpenCL.so",
    "/vendor/" LIBDIR "/egl/libGLES_mali.so",
    "/system/vendor/" LIBDIR "/egl/libGLES_mali.so",
    "/vendor/" LIBDIR "/libPVROCL.so",
    "/system/vendor/" LIBDIR "/libPVROCL.so",
    "libOpenCL.so.1",
    "libOpenCL.so",
};

#define LOAD(name)                                                                                                     \
    do {                                                                                                               \
        *(void **)(&cl.name) = dlsym(handle, "cl" #name);                                                              \
        if (!cl.name) missing = "cl" #name;                                                                            \
    } while (0)

static const char *load_symbols(void *handle) {
    const char *missing = NULL;
    LOAD(GetPlatformIDs);
    LOAD(GetPlatformInfo);
    LOAD(GetDeviceIDs);
    LOAD(GetDeviceInfo);
    LOAD(CreateContext);
    LOAD(CreateCommandQueue);
    LOAD(CreateBuffer);
    LOAD(CreateSubBuffer);
    LOAD(GetSupportedImageFormats);
    LOAD(CreateImage);
    LOAD(CreateProgramWithSource);
    LOAD(CreateProgramWithBinary);
    LOAD(BuildProgram);
    LOAD(GetProgramBuildInfo);
    LOAD(GetProgramInfo);
    LOAD(CreateKernel);
    LOAD(GetKernelWorkGroupInfo);
    LOAD(SetKernelArg);
    LOAD(EnqueueNDRangeKernel);
    LOAD(EnqueueWriteImage);
    LOAD(EnqueueReadImage);
    LOAD(Finish);
    LOAD(GetEventProfilingInfo);
    LOAD(ReleaseEvent);
    LOAD(ReleaseKernel);
    LOAD(ReleaseProgram);
    LOAD(ReleaseMemObject);
    LOAD(ReleaseCommandQueue);
    LOAD(ReleaseContext);
    return missing;
}

void opencl_load(void) {
    const char *forced = getenv("FBLC_OPENCL_LIBRARY");
    char tried[2048] = "";
    size_t count = forced && *forced ? 1 : sizeof CANDIDATES / sizeof *CANDIDATES;
    for (size_t i = 0; i < count; ++i) {
        const char *path = forced && *forced ? forced : CANDIDATES[i];
        void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (!handle) {
            const char *why = dlerror();
            if (forced && *forced) die(EXIT_OPENCL, "cannot open FBLC_OPENCL_LIBRARY=%s (%s)", path, why ? why : "?");
            if (strlen(tried) + strlen(path) + 3 < sizeof tried) {
                if (*tried) strcat(tried, ", ");
                strcat(tried, path);
            }
            continue;
        }
        const char *missing = load_symbols(handle);
        if (missing) {
            if (forced && *forced) die(EXIT_OPENCL, "%s is no OpenCL 1.2 library: it lacks %s", path, missing);
            dlclose(handle);
            continue;
        }
        snprintf(cl.library, sizeof cl.library, "%s", path);
        return;
    }
    die(EXIT_OPENCL, "no OpenCL library found (tried %s); on Linux install an ICD loader and a driver "
                     "(Debian: apt-get install ocl-icd-libopencl1 pocl-opencl-icd), or set FBLC_OPENCL_LIBRARY", tried);
}

const char *opencl_error(cl_int code) {
    switch (code) {
#define NAME(c)                                                                                                        \
    case c: return #c;
        NAME(CL_SUCCESS) NAME(CL_DEVICE_NOT_FOUND) NAME(CL_DEVICE_NOT_AVAILABLE) NAME(CL_COMPILER_NOT_AVAILABLE)
        NAME(CL_MEM_OBJECT_ALLOCATION_FAILURE) NAME(CL_OUT_OF_RESOURCES) NAME(CL_OUT_OF_HOST_MEMORY)
        NAME(CL_PROFILING_INFO_NOT_AVAILABLE) NAME(CL_MEM_COPY_OVERLAP) NAME(CL_IMAGE_FORMAT_MISMATCH)
        NAME(CL_IMAGE_FORMAT_NOT_SUPPORTED) NAME(CL_BUILD_PROGRAM_FAILURE) NAME(CL_MAP_FAILURE)
        NAME(CL_INVALID_VALUE) NAME(CL_INVALID_DEVICE_TYPE) NAME(CL_INVALID_PLATFORM) NAME(CL_INVALID_DEVICE)
        NAME(CL_INVALID_CONTEXT) NAME(CL_INVALID_QUEUE_PROPERTIES) NAME(CL_INVALID_COMMAND_QUEUE)
        NAME(CL_INVALID_HOST_PTR) NAME(CL_INVALID_MEM_OBJECT) NAME(CL_INVALID_IMAGE_FORMAT_DESCRIPTOR)
        NAME(CL_INVALID_IMAGE_SIZE) NAME(CL_INVALID_SAMPLER) NAME(CL_INVALID_BINARY) NAME(CL_INVALID_BUILD_OPTIONS)
        NAME(CL_INVALID_PROGRAM) NAME(CL_INVALID_PROGRAM_EXECUTABLE) NAME(CL_INVALID_KERNEL_NAME)
        NAME(CL_INVALID_KERNEL_DEFINITION) NAME(CL_INVALID_KERNEL) NAME(CL_INVALID_ARG_INDEX)
        NAME(CL_INVALID_ARG_VALUE) NAME(CL_INVALID_ARG_SIZE) NAME(CL_INVALID_KERNEL_ARGS)
        NAME(CL_INVALID_WORK_DIMENSION) NAME(CL_INVALID_WORK_GROUP_SIZE) NAME(CL_INVALID_WORK_ITEM_SIZE)
        NAME(CL_INVALID_GLOBAL_OFFSET) NAME(CL_INVALID_EVENT_WAIT_LIST) NAME(CL_INVALID_EVENT)
        NAME(CL_INVALID_OPERATION) NAME(CL_INVALID_BUFFER_SIZE) NAME(CL_INVALID_GLOBAL_WORK_SIZE)
        NAME(CL_INVALID_IMAGE_DESCRIPTOR) NAME(CL_INVALID_COMPILER_OPTIONS)
#undef NAME
    case -1001: return "CL_PLATFORM_NOT_FOUND_KHR (no OpenCL driver is installed)";
    default: return "unknown OpenCL error";
    }
}

char *opencl_build_log(cl_program program, cl_device_id device) {
    size_t size = 0;
    if (cl.GetProgramBuildInfo(program, device, CL_PROGRAM_BUILD_LOG, 0, NULL, &size) != CL_SUCCESS)
        return xstrdup("");
    char *log = xcalloc(size + 1, 1);
    if (cl.GetProgramBuildInfo(program, device, CL_PROGRAM_BUILD_LOG, size, log, NULL) != CL_SUCCESS)
        log[0] = '\0';
    return log;
}

long opencl_log_line(const char *log) {
    for (int pass = 0; pass < 2; ++pass) {
        for (const char *at = log; (at = strchr(at, ':')) != NULL; ++at) {
            if (pass == 0 && (at - log < 3 || strncmp(at - 3, ".cl", 3) != 0)) continue;
            char *end;
            long line = strtol(at + 1, &end, 10);
            if (end == at + 1 || *end != ':' || line <= 0) continue;
            char *column_end;
            strtol(end + 1, &column_end, 10);
            if (column_end != end + 1 && *column_end == ':') return line;
        }
    }
    return 0;
}

void check_cl(cl_int status, const char *what) {
    if (status != CL_SUCCESS) die(EXIT_OPENCL, "%s failed: %s (%d)", what, opencl_error(status), (int)status);
}
