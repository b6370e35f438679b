/* The runner's profile mode: time the launches of a measurement plan that `fblc profile` wrote. */
#ifndef FBLC_PROFILE_H
#define FBLC_PROFILE_H

#include <signal.h>

/* Run the plan in `plan_path` on the device `device_spec` ("P:D", or NULL for the first with images) and
 * write the raw timings to `out_path` (atomically, only when every launch ran). Progress lines go to
 * stdout unless `quiet`. Stops (writing nothing) when `*interrupted` becomes set. Dies on any error. */
void profile_run(const char *plan_path, const char *out_path, const char *device_spec, int quiet,
                 const char *runner_version, volatile sig_atomic_t *interrupted);

#endif
