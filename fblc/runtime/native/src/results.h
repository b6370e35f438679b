/* What a run leaves in its output folder: each step's loss and times gathered as it runs (timings), a forward
 * bundle's outputs (output_record, outputs.bin), then params.bin and results.json, written atomically and in that
 * order, results.json last (write_outputs). */
#ifndef FBLC_RESULTS_H
#define FBLC_RESULTS_H

#include <stddef.h>

#include "bundle.h"
#include "runner.h"

#define RUNNER_VERSION "6" /* 3: forward bundles (outputs.bin); 4: --specialist; 5: --params, an ES step's rewards in outputs.bin;
                            6: a --specialist file carries its fingerprint's id (specialist.c) */

typedef struct {
    size_t steps, capacity;
    double *losses, *step_ms, *kernel_ms, *submit_ms; /* per step */
    double *launch_total, *launch_min;    /* per launch, over the steps */
    double *launch_now;                   /* per launch, this step */
} timings;

void timings_add(timings *t, size_t launches, double loss, double step_ms, double submit_ms);

/* a forward bundle's model outputs, every step's (outputs.bin) */
typedef struct {
    unsigned char *bytes;
    size_t step_bytes;
    size_t *offsets; /* of each output inside a step */
} output_record;

void outputs_prepare(output_record *o, const bundle *b, size_t steps);

/* outputs.bin (a forward bundle's), params.bin, then results.json into `folder`, each atomically; results.json last,
 * as it says that the run is complete */
void write_outputs(const char *folder, runner *r, const bundle *b, const timings *t, const output_record *o);

#endif
