/* A small JSON reader (RFC 8259) for manifest.json and plan.json, and string escaping for the results. */
#ifndef FBLC_JSON_H
#define FBLC_JSON_H

#include <stddef.h>
#include <stdio.h>

typedef enum { JSON_NULL, JSON_BOOL, JSON_NUMBER, JSON_STRING, JSON_ARRAY, JSON_OBJECT } json_type;

typedef struct json_value {
    json_type type;
    double number;            /* JSON_NUMBER; JSON_BOOL: 0 or 1 */
    char *string;             /* JSON_STRING: UTF-8, NUL-terminated */
    size_t count;             /* JSON_ARRAY / JSON_OBJECT: number of items */
    struct json_value *items; /* the items (object values) */
    char **keys;              /* JSON_OBJECT: the keys */
} json_value;

/* Parse `text` (NUL-terminated). NULL on error, with a message in `error`. */
json_value *json_parse(const char *text, char *error, size_t error_size);
void json_free(json_value *value);

const json_value *json_get(const json_value *object, const char *key); /* NULL when absent or not an object */
const json_value *json_at(const json_value *array, size_t index);      /* NULL when out of range */

/* Write `text` as a JSON string literal (with quotes). */
void json_write_string(FILE *out, const char *text);
/* Write a float so that it reads back exactly (NaN and infinities as Python's json writes them). */
void json_write_float(FILE *out, double value);

#endif
