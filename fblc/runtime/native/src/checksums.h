/* A bundle's integrity: manifest.json's seal over itself (manifest_sha256) and the checksums it lists for the
 * other files (fblc/bundle_format.py writes both). */
#ifndef FBLC_CHECKSUMS_H
#define FBLC_CHECKSUMS_H

#include <stddef.h>

#include "bundle.h"
#include "json.h"

/* Whether the manifest `text` holds exactly one "manifest_sha256": "<64 hex>" field whose value is the
 * sha256 of the text with that value written as 64 zeros (fblc/bundle_format.py's sealed_manifest). */
int manifest_seal_holds(char *text, size_t length);

/* Read every checksummed file of `folder` and check it against the manifest's "checksums" (exit EXIT_USAGE naming
 * the file that is missing or differs); kernels.cl and params.bin stay in `out`. */
void check_checksums(const char *folder, const json_value *manifest, bundle *out);

#endif
