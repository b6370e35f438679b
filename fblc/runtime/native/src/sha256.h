/* SHA-256 (FIPS 180-4), for the bundle checksums. */
#ifndef FBLC_SHA256_H
#define FBLC_SHA256_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint32_t state[8];
    uint64_t length;
    unsigned char block[64];
    size_t used;
} sha256_context;

void sha256_init(sha256_context *context);
void sha256_update(sha256_context *context, const void *data, size_t size);
void sha256_final(sha256_context *context, unsigned char digest[32]);
/* Lower-case hex digest of `data` into `hex` (65 bytes). */
void sha256_hex(const void *data, size_t size, char hex[65]);

#endif
