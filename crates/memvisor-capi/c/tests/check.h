/* The C tests' few helpers: CHECK fails the test with the line, the expression and memvisor's
 * last error; OK(call) checks a call returned 0. */
#ifndef MEMVISOR_TEST_CHECK_H
#define MEMVISOR_TEST_CHECK_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "memvisor.h"

#define CHECK(cond)                                                                          \
    do {                                                                                     \
        if (!(cond)) {                                                                       \
            fprintf(stderr, "%s:%d: check failed: %s\n  last error: %s\n", __FILE__, __LINE__, \
                    #cond, memvisor_last_error());                                           \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)

#define OK(call)                                                                             \
    do {                                                                                     \
        int rc_ = (call);                                                                    \
        if (rc_ != 0) {                                                                      \
            fprintf(stderr, "%s:%d: %s returned %d: %s\n", __FILE__, __LINE__, #call, rc_,   \
                    memvisor_last_error());                                                  \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)

/* The call fails with -errno and its message names `word`. */
#define FAILS(call, errno_, word)                                                            \
    do {                                                                                     \
        int rc_ = (call);                                                                    \
        if (rc_ != -(errno_) || strstr(memvisor_last_error(), (word)) == NULL) {             \
            fprintf(stderr, "%s:%d: %s returned %d (want %d), message \"%s\" (want \"%s\")\n", \
                    __FILE__, __LINE__, #call, rc_, -(errno_), memvisor_last_error(), (word)); \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)

#define KIB 1024ull
#define MIB (1024ull * 1024ull)
#define PAGE 4096ull

#endif
