/* The OpenCL API, opened at run time with dlopen: the runner links no OpenCL library, so one binary
 * runs on any phone whose vendor ships libOpenCL.so (or exposes OpenCL through its GLES driver). */
#ifndef FBLC_OPENCL_H
#define FBLC_OPENCL_H

#define CL_TARGET_OPENCL_VERSION 120
#define CL_USE_DEPRECATED_OPENCL_1_2_APIS
#include <CL/cl.h>

typedef struct {
    char library[512]; /* the path that was opened */
    cl_int (CL_API_CALL *GetPlatformIDs)(cl_uint, cl_platform_id *, cl_uint *);
    cl_int (CL_API_CALL *GetPlatformInfo)(cl_platform_id, cl_platform_info, size_t, void *, size_t *);
    cl_int (CL_API_CALL *GetDeviceIDs)(cl_platform_id, cl_device_type, cl_uint, cl_device_id *, cl_uint *);
    cl_int (CL_API_CALL *GetDeviceInfo)(cl_device_id, cl_device_info, size_t, void *, size_t *);
    cl_context (CL_API_CALL *CreateContext)(const cl_context_properties *, cl_uint, const cl_device_id *,
                                            void (CL_CALLBACK *)(const char *, const void *, size_t, void *), void *,
                                            cl_int *);
    cl_command_queue (CL_API_CALL *CreateCommandQueue)(cl_context, cl_device_id, cl_command_queue_properties, cl_int *);
    cl_mem (CL_API_CALL *CreateBuffer)(cl_context, cl_mem_flags, size_t, void *, cl_int *);
    cl_mem (CL_API_CALL *CreateSubBuffer)(cl_mem, cl_mem_flags, cl_buffer_create_type, const void *, cl_int *);
    cl_int (CL_API_CALL *GetSupportedImageFormats)(cl_context, cl_mem_flags, cl_mem_object_type, cl_uint,
                                                   cl_image_format *, cl_uint *);
    cl_mem (CL_API_CALL *CreateImage)(cl_context, cl_mem_flags, const cl_image_format *, const cl_image_desc *, void *,
                                      cl_int *);
    cl_program (CL_API_CALL *CreateProgramWithSource)(cl_context, cl_uint, const char **, const size_t *, cl_int *);
    cl_program (CL_API_CALL *CreateProgramWithBinary)(cl_context, cl_uint, const cl_device_id *, const size_t *,
                                                      const unsigned char **, cl_int *, cl_int *);
    cl_int (CL_API_CALL *BuildProgram)(cl_program, cl_uint, const cl_device_id *, const char *,
                                       void (CL_CALLBACK *)(cl_program, void *), void *);
    cl_int (CL_API_CALL *GetProgramBuildInfo)(cl_program, cl_device_id, cl_program_build_info, size_t, void *, size_t *);
    cl_int (CL_API_CALL *GetProgramInfo)(cl_program, cl_program_info, size_t, void *, size_t *);
    cl_kernel (CL_API_CALL *CreateKernel)(cl_program, const char *, cl_int *);
    cl_int (CL_API_CALL *GetKernelWorkGroupInfo)(cl_kernel, cl_device_id, cl_kernel_work_group_info, size_t, void *,
                                                 size_t *);
    cl_int (CL_API_CALL *SetKernelArg)(cl_kernel, cl_uint, size_t, const void *);
    cl_int (CL_API_CALL *EnqueueNDRangeKernel)(cl_command_queue, cl_kernel, cl_uint, const size_t *, const size_t *,
                                               const size_t *, cl_uint, const cl_event *, cl_event *);
    cl_int (CL_API_CALL *EnqueueWriteImage)(cl_command_queue, cl_mem, cl_bool, const size_t *, const size_t *, size_t,
                                            size_t, const void *, cl_uint, const cl_event *, cl_event *);
    cl_int (CL_API_CALL *EnqueueReadImage)(cl_command_queue, cl_mem, cl_bool, const size_t *, const size_t *, size_t,
                                           size_t, void *, cl_uint, const cl_event *, cl_event *);
    cl_int (CL_API_CALL *Finish)(cl_command_queue);
    cl_int (CL_API_CALL *GetEventProfilingInfo)(cl_event, cl_profiling_info, size_t, void *, size_t *);
    cl_int (CL_API_CALL *ReleaseEvent)(cl_event);
    cl_int (CL_API_CALL *ReleaseKernel)(cl_kernel);
    cl_int (CL_API_CALL *ReleaseProgram)(cl_program);
    cl_int (CL_API_CALL *ReleaseMemObject)(cl_mem);
    cl_int (CL_API_CALL *ReleaseCommandQueue)(cl_command_queue);
    cl_int (CL_API_CALL *ReleaseContext)(cl_context);
} opencl_api;

extern opencl_api cl;

/* Open the OpenCL library: $FBLC_OPENCL_LIBRARY if set (and only it), else the Android vendor and
 * system paths, else libOpenCL.so.1 / libOpenCL.so. Dies with EXIT_OPENCL naming what was tried. */
void opencl_load(void);
const char *opencl_error(cl_int code);

/* The build log of `program` on `device` (malloc'd, "" when the driver gives none). */
char *opencl_build_log(cl_program program, cl_device_id device);
/* The line of the first "file:LINE:COLUMN:" in a compiler log (".cl:" preferred), or 0. */
long opencl_log_line(const char *log);

/* Die with EXIT_OPENCL if `status` is not CL_SUCCESS: "<what>: <CL error name>". */
void check_cl(cl_int status, const char *what);

#endif
