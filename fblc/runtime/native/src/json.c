#include "json.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

#define MAX_DEPTH 64

typedef struct {
    const char *at;
    const char *start;
    char *error;
    size_t error_size;
    int failed;
} parser;

static void fail(parser *p, const char *what) {
    if (!p->failed) {
        snprintf(p->error, p->error_size, "%s at character %ld", what, (long)(p->at - p->start));
        p->failed = 1;
    }
}

static void skip_space(parser *p) {
    while (*p->at == ' ' || *p->at == '\t' || *p->at == '\n' || *p->at == '\r') p->at++;
}

static int hex4(parser *p, unsigned *out) {
    unsigned value = 0;
    for (int i = 0; i < 4; ++i) {
        char c = p->at[i];
        value <<= 4;
        if (c >= '0' && c <= '9') value |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') value |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') value |= (unsigned)(c - 'A' + 10);
        else {
            fail(p, "bad \\u escape");
            return 0;
        }
    }
    p->at += 4;
    *out = value;
    return 1;
}

static void put_utf8(char **out, unsigned code) {
    char *o = *out;
    if (code < 0x80) {
        *o++ = (char)code;
    } else if (code < 0x800) {
        *o++ = (char)(0xc0 | (code >> 6));
        *o++ = (char)(0x80 | (code & 0x3f));
    } else if (code < 0x10000) {
        *o++ = (char)(0xe0 | (code >> 12));
        *o++ = (char)(0x80 | ((code >> 6) & 0x3f));
        *o++ = (char)(0x80 | (code & 0x3f));
    } else {
        *o++ = (char)(0xf0 | (code >> 18));
        *o++ = (char)(0x80 | ((code >> 12) & 0x3f));
        *o++ = (char)(0x80 | ((code >> 6) & 0x3f));
        *o++ = (char)(0x80 | (code & 0x3f));
    }
    *out = o;
}

static char *parse_string(parser *p) {
    /* p->at is on the opening quote; the decoded string is never longer than the literal */
    const char *end = p->at + 1;
    while (*end && *end != '"') end += (*end == '\\' && end[1]) ? 2 : 1;
    if (*end != '"') {
        fail(p, "unterminated string");
        return NULL;
    }
    char *result = xmalloc((size_t)(end - p->at) + 1), *o = result;
    p->at++;
    while (*p->at != '"') {
        char c = *p->at++;
        if ((unsigned char)c < 0x20) {
            fail(p, "control character in string");
            free(result);
            return NULL;
        }
        if (c != '\\') {
            *o++ = c;
            continue;
        }
        c = *p->at++;
        switch (c) {
        case '"': *o++ = '"'; break;
        case '\\': *o++ = '\\'; break;
        case '/': *o++ = '/'; break;
        case 'b': *o++ = '\b'; break;
        case 'f': *o++ = '\f'; break;
        case 'n': *o++ = '\n'; break;
        case 'r': *o++ = '\r'; break;
        case 't': *o++ = '\t'; break;
        case 'u': {
            unsigned code, low;
            if (!hex4(p, &code)) {
                free(result);
                return NULL;
            }
            if (code >= 0xd800 && code < 0xdc00 && p->at[0] == '\\' && p->at[1] == 'u') {
                p->at += 2;
                if (!hex4(p, &low)) {
                    free(result);
                    return NULL;
                }
                if (low >= 0xdc00 && low < 0xe000) code = 0x10000 + ((code - 0xd800) << 10) + (low - 0xdc00);
                else {
                    put_utf8(&o, code);
                    code = low;
                }
            }
            put_utf8(&o, code);
            break;
        }
        default:
            fail(p, "bad escape in string");
            free(result);
            return NULL;
        }
    }
    p->at++;
    *o = '\0';
    return result;
}

static int parse_value(parser *p, json_value *out, int depth);

static int parse_container(parser *p, json_value *out, int depth, int object) {
    char close = object ? '}' : ']';
    size_t capacity = 0;
    out->type = object ? JSON_OBJECT : JSON_ARRAY;
    p->at++;
    skip_space(p);
    if (*p->at == close) {
        p->at++;
        return 1;
    }
    for (;;) {
        if (out->count == capacity) {
            capacity = capacity ? capacity * 2 : 8;
            out->items = xrealloc(out->items, capacity * sizeof *out->items);
            if (object) out->keys = xrealloc(out->keys, capacity * sizeof *out->keys);
        }
        json_value *item = &out->items[out->count];
        memset(item, 0, sizeof *item);
        if (object) {
            skip_space(p);
            if (*p->at != '"') {
                fail(p, "expected a key");
                return 0;
            }
            char *key = parse_string(p);
            if (!key) return 0;
            out->keys[out->count] = key;
            skip_space(p);
            if (*p->at != ':') {
                out->count++;
                fail(p, "expected ':'");
                return 0;
            }
            p->at++;
        }
        out->count++;
        if (!parse_value(p, item, depth + 1)) return 0;
        skip_space(p);
        if (*p->at == ',') {
            p->at++;
            continue;
        }
        if (*p->at == close) {
            p->at++;
            return 1;
        }
        fail(p, object ? "expected ',' or '}'" : "expected ',' or ']'");
        return 0;
    }
}

static int parse_value(parser *p, json_value *out, int depth) {
    if (depth > MAX_DEPTH) {
        fail(p, "nested too deeply");
        return 0;
    }
    skip_space(p);
    char c = *p->at;
    if (c == '{' || c == '[') return parse_container(p, out, depth, c == '{');
    if (c == '"') {
        out->type = JSON_STRING;
        out->string = parse_string(p);
        return out->string != NULL;
    }
    if (strncmp(p->at, "true", 4) == 0 || strncmp(p->at, "false", 5) == 0) {
        out->type = JSON_BOOL;
        out->number = c == 't';
        p->at += c == 't' ? 4 : 5;
        return 1;
    }
    if (strncmp(p->at, "null", 4) == 0) {
        out->type = JSON_NULL;
        p->at += 4;
        return 1;
    }
    if (strncmp(p->at, "NaN", 3) == 0) { /* Python's json writes these */
        out->type = JSON_NUMBER;
        out->number = NAN;
        p->at += 3;
        return 1;
    }
    if (strncmp(p->at, "Infinity", 8) == 0 || strncmp(p->at, "-Infinity", 9) == 0) {
        out->type = JSON_NUMBER;
        out->number = c == '-' ? -INFINITY : INFINITY;
        p->at += c == '-' ? 9 : 8;
        return 1;
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
        char *end;
        out->type = JSON_NUMBER;
        out->number = strtod(p->at, &end);
        if (end == p->at) {
            fail(p, "bad number");
            return 0;
        }
        p->at = end;
        return 1;
    }
    fail(p, c ? "unexpected character" : "unexpected end");
    return 0;
}

static void free_inside(json_value *value) {
    free(value->string);
    for (size_t i = 0; i < value->count; ++i) {
        free_inside(&value->items[i]);
        if (value->keys) free(value->keys[i]);
    }
    free(value->items);
    free(value->keys);
}

json_value *json_parse(const char *text, char *error, size_t error_size) {
    parser p = {text, text, error, error_size, 0};
    json_value *root = xcalloc(1, sizeof *root);
    if (parse_value(&p, root, 0)) {
        skip_space(&p);
        if (*p.at == '\0') return root;
        fail(&p, "trailing characters");
    }
    free_inside(root);
    free(root);
    return NULL;
}

void json_free(json_value *value) {
    if (!value) return;
    free_inside(value);
    free(value);
}

const json_value *json_get(const json_value *object, const char *key) {
    if (!object || object->type != JSON_OBJECT) return NULL;
    for (size_t i = 0; i < object->count; ++i)
        if (strcmp(object->keys[i], key) == 0) return &object->items[i];
    return NULL;
}

const json_value *json_at(const json_value *array, size_t index) {
    if (!array || array->type != JSON_ARRAY || index >= array->count) return NULL;
    return &array->items[index];
}

void json_write_string(FILE *out, const char *text) {
    fputc('"', out);
    for (const unsigned char *c = (const unsigned char *)text; *c; ++c) {
        if (*c == '"' || *c == '\\') fprintf(out, "\\%c", *c);
        else if (*c == '\n') fputs("\\n", out);
        else if (*c == '\t') fputs("\\t", out);
        else if (*c < 0x20) fprintf(out, "\\u%04x", *c);
        else fputc(*c, out);
    }
    fputc('"', out);
}

void json_write_float(FILE *out, double value) {
    if (isnan(value)) fputs("NaN", out);
    else if (isinf(value)) fputs(value > 0 ? "Infinity" : "-Infinity", out);
    else fprintf(out, "%.9g", value);
}
