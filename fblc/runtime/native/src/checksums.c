#include "checksums.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "sha256.h"
#include "util.h"

static const char *const CHECKSUMMED[] = {"plan.json", "kernels.cl", "params.bin", "report.json"};

static int is_json_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* Whether the manifest `text` holds exactly one "manifest_sha256": "<64 hex>" field whose value is the
 * sha256 of the text with that value written as 64 zeros (fblc/bundle_format.py's sealed_manifest). */
int manifest_seal_holds(char *text, size_t length) {
    static const char key[] = "\"manifest_sha256\"";
    char *value = NULL;
    size_t found = 0;
    for (char *at = strstr(text, key); at; at = strstr(at + 1, key)) {
        char *p = at + strlen(key);
        while (is_json_space(*p)) ++p;
        if (*p++ != ':') continue;
        while (is_json_space(*p)) ++p;
        if (*p++ != '"') continue;
        size_t hex = 0;
        while (hex < 64 && ((p[hex] >= '0' && p[hex] <= '9') || (p[hex] >= 'a' && p[hex] <= 'f'))) ++hex;
        if (hex == 64 && p[64] == '"') {
            value = p;
            ++found;
        }
    }
    if (found != 1) return 0;
    char want[65], digest[65];
    memcpy(want, value, 64);
    want[64] = '\0';
    memset(value, '0', 64);
    sha256_hex(text, length, digest);
    memcpy(value, want, 64);
    return strcmp(digest, want) == 0;
}

void check_checksums(const char *folder, const json_value *manifest, bundle *out) {
    const json_value *checksums = json_get(manifest, "checksums");
    for (size_t i = 0; i < sizeof CHECKSUMMED / sizeof *CHECKSUMMED; ++i) {
        const char *name = CHECKSUMMED[i];
        char *path = path_join(folder, name);
        size_t length;
        char *data = read_file(path, &length);
        if (!data) {
            if (errno == ENOENT) die(EXIT_USAGE, "'%s' is incomplete: %s is missing; compile the bundle again", folder, name);
            die(EXIT_USAGE, "cannot read '%s' (%s)", path, strerror(errno));
        }
        const json_value *want = json_get(checksums, name);
        char digest[65];
        sha256_hex(data, length, digest);
        if (!want || want->type != JSON_STRING || strcmp(want->string, digest) != 0)
            die(EXIT_USAGE, "'%s/%s' does not match the checksum in manifest.json (corrupt or edited); "
                            "compile the bundle again", folder, name);
        if (strcmp(name, "kernels.cl") == 0) {
            out->kernels_source = data;
            out->kernels_length = length;
            memcpy(out->kernels_sha256, digest, sizeof digest);
        } else if (strcmp(name, "params.bin") == 0) {
            out->params = (unsigned char *)data;
            out->params_length = length;
        } else {
            free(data);
        }
        free(path);
    }
}
