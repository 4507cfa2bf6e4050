/* Shared between native/gc_module.c and native/gc_channel.c (the plan channel). */
#ifndef GC_CHANNEL_H
#define GC_CHANNEL_H

#include <Python.h>

#include "gc_codec.h"

/* The kernel variant in use (chosen at import, or by _set_isa). */
const gc_kernels *gc_active_kernels(void);

/* Bytes of a wire message of n values (v: a variant code), or SIZE_MAX for a format these kernels
 * do not implement, a scale rule it does not take, or a block the format does not take. */
size_t gc_message_nbytes(size_t n, int fmt, size_t block);

/* 1 when variant code v names a block-scaled format (stochastic rounding allowed), else 0. */
int gc_is_scaled(int v);

/* Add the Channel type to the module (nothing where the platform has no channel); -1 on error. */
int gc_channel_register(PyObject *module);

#endif
