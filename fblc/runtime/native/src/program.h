/* The bundle's OpenCL program: built from kernels.cl (a rejected kernel named with the compiler's log), or loaded
 * from the binary the runner cached in the bundle folder (kernels.cache, keyed by the source's digest, the build
 * options, platform, device and driver). */
#ifndef FBLC_PROGRAM_H
#define FBLC_PROGRAM_H

#include "runner.h"

/* r->program for r's device (r->program_from_cache, r->build_ms); the cache is read and written only with
 * `use_cache`. */
void build_program(runner *r, int use_cache);

#endif
