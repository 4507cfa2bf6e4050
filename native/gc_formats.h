/* gc_formats.h -- GENERATED from giftcomm/formats.py by `python -m giftcomm.formats_header`.
 * Do not edit: change the table in giftcomm/formats.py and regenerate
 * (python -m giftcomm.formats_header > native/gc_formats.h); tests/test_format_table.py fails
 * when this file differs from the table. The CUDA loader serves the same text to NVRTC.
 * Valid C99, C++ and CUDA; docs/native.md (the format table) describes the scheme. */
#ifndef GC_FORMATS_H
#define GC_FORMATS_H

/* format codes: giftcomm.formats.Format.code */
#define GC_E4M3 1
#define GC_E5M2 2
#define GC_BF16 3
#define GC_FP16 4
#define GC_FP32 5
#define GC_NVFP4 6
#define GC_MXFP4 7
#define GC_MXFP8 8
#define GC_MXFP8_E5M2 9
#define GC_ADA4_5 10
#define GC_ADA4 11
#define GC_FORMAT_CODE_LIMIT 12 /* codes are 1 .. GC_FORMAT_CODE_LIMIT - 1 */

/* scale kinds (Format.scale_kind) */
#define GC_SCALE_NONE 0
#define GC_SCALE_F32 1
#define GC_SCALE_E8M0 2
#define GC_SCALE_NVFP4 3
#define GC_SCALE_ADAPTIVE 4

/* element kinds of the scaled formats (the kernels' `ek`), by element dtype */
#define GC_ELEM_E4M3 0
#define GC_ELEM_E5M2 1
#define GC_ELEM_E2M1 2
/* element facts by kind (ek: a constant expression): mantissa bits, exponent of the smallest
 * normal, float32 bits of the largest value and their mantissa field, exponent of the largest
 * power of two (the MX rules' emax), position of the sign bit, the code of a non-finite block */
#define GC_ELEM_MANT(ek) ((ek) == 0 ? 3 : (ek) == 1 ? 2 : 1)
#define GC_ELEM_EMIN(ek) ((ek) == 0 ? -6 : (ek) == 1 ? -14 : 0)
#define GC_ELEM_MAXB(ek) ((ek) == 0 ? 0x43e00000u : (ek) == 1 ? 0x47600000u : 0x40c00000u)
#define GC_ELEM_MAXMANT(ek) ((ek) == 0 ? 0x600000u : (ek) == 1 ? 0x600000u : 0x400000u)
#define GC_ELEM_EMAX(ek) ((ek) == 0 ? 8u : (ek) == 1 ? 15u : 2u)
#define GC_ELEM_SBIT(ek) ((ek) == 0 ? 7 : (ek) == 1 ? 7 : 3)
#define GC_ELEM_NAN(ek) ((ek) == 0 ? 0x7fu : (ek) == 1 ? 0x7fu : 0x00u)

/* shared-exponent rules of the E8M0 formats (giftcomm.formats.SCALE_RULES); a variant code is
 * code | rule << GC_SCALE_RULE_SHIFT (Format.variant_code) */
#define GC_RULE_CEIL 0
#define GC_RULE_FLOOR 1
#define GC_SCALE_RULE_SHIFT 8
#define GC_VARIANT_FORMAT(v) ((v) & 0xff)
#define GC_VARIANT_RULE(v) ((v) >> GC_SCALE_RULE_SHIFT)

/* per-format facts: GC_<NAME>_{SCALE, ELEM, VALUE_BITS, ITEMSIZE, FIXED_BLOCK (0: any), MAX_BITS,
 * NAN_CODE, EMAX, FACTS} */
#define GC_E4M3_SCALE GC_SCALE_F32
#define GC_E4M3_ELEM 0
#define GC_E4M3_VALUE_BITS 8
#define GC_E4M3_ITEMSIZE 1
#define GC_E4M3_FIXED_BLOCK 0
#define GC_E4M3_MAX_BITS 0x43e00000u
#define GC_E4M3_NAN_CODE 0x7fu
#define GC_E4M3_EMAX 8
#define GC_E4M3_FACTS "e4m3:1:f32:0:8:1:0:0x43e00000:0x7f:8"
#define GC_E5M2_SCALE GC_SCALE_F32
#define GC_E5M2_ELEM 1
#define GC_E5M2_VALUE_BITS 8
#define GC_E5M2_ITEMSIZE 1
#define GC_E5M2_FIXED_BLOCK 0
#define GC_E5M2_MAX_BITS 0x47600000u
#define GC_E5M2_NAN_CODE 0x7fu
#define GC_E5M2_EMAX 15
#define GC_E5M2_FACTS "e5m2:2:f32:1:8:1:0:0x47600000:0x7f:15"
#define GC_BF16_SCALE GC_SCALE_NONE
#define GC_BF16_ELEM -1
#define GC_BF16_VALUE_BITS 16
#define GC_BF16_ITEMSIZE 2
#define GC_BF16_FIXED_BLOCK 0
#define GC_BF16_MAX_BITS 0x00000000u
#define GC_BF16_NAN_CODE 0x00u
#define GC_BF16_EMAX 0
#define GC_BF16_FACTS "bf16:3:none:-1:16:2:0:0x0:0x0:0"
#define GC_FP16_SCALE GC_SCALE_NONE
#define GC_FP16_ELEM -1
#define GC_FP16_VALUE_BITS 16
#define GC_FP16_ITEMSIZE 2
#define GC_FP16_FIXED_BLOCK 0
#define GC_FP16_MAX_BITS 0x00000000u
#define GC_FP16_NAN_CODE 0x00u
#define GC_FP16_EMAX 0
#define GC_FP16_FACTS "fp16:4:none:-1:16:2:0:0x0:0x0:0"
#define GC_FP32_SCALE GC_SCALE_NONE
#define GC_FP32_ELEM -1
#define GC_FP32_VALUE_BITS 32
#define GC_FP32_ITEMSIZE 4
#define GC_FP32_FIXED_BLOCK 0
#define GC_FP32_MAX_BITS 0x00000000u
#define GC_FP32_NAN_CODE 0x00u
#define GC_FP32_EMAX 0
#define GC_FP32_FACTS "fp32:5:none:-1:32:4:0:0x0:0x0:0"
#define GC_NVFP4_SCALE GC_SCALE_NVFP4
#define GC_NVFP4_ELEM 2
#define GC_NVFP4_VALUE_BITS 4
#define GC_NVFP4_ITEMSIZE 1
#define GC_NVFP4_FIXED_BLOCK 16
#define GC_NVFP4_MAX_BITS 0x40c00000u
#define GC_NVFP4_NAN_CODE 0x00u
#define GC_NVFP4_EMAX 2
#define GC_NVFP4_FACTS "nvfp4:6:nvfp4:2:4:1:16:0x40c00000:0x0:2"
#define GC_MXFP4_SCALE GC_SCALE_E8M0
#define GC_MXFP4_ELEM 2
#define GC_MXFP4_VALUE_BITS 4
#define GC_MXFP4_ITEMSIZE 1
#define GC_MXFP4_FIXED_BLOCK 32
#define GC_MXFP4_MAX_BITS 0x40c00000u
#define GC_MXFP4_NAN_CODE 0x00u
#define GC_MXFP4_EMAX 2
#define GC_MXFP4_FACTS "mxfp4:7:e8m0:2:4:1:32:0x40c00000:0x0:2"
#define GC_MXFP8_SCALE GC_SCALE_E8M0
#define GC_MXFP8_ELEM 0
#define GC_MXFP8_VALUE_BITS 8
#define GC_MXFP8_ITEMSIZE 1
#define GC_MXFP8_FIXED_BLOCK 32
#define GC_MXFP8_MAX_BITS 0x43e00000u
#define GC_MXFP8_NAN_CODE 0x7fu
#define GC_MXFP8_EMAX 8
#define GC_MXFP8_FACTS "mxfp8:8:e8m0:0:8:1:32:0x43e00000:0x7f:8"
#define GC_MXFP8_E5M2_SCALE GC_SCALE_E8M0
#define GC_MXFP8_E5M2_ELEM 1
#define GC_MXFP8_E5M2_VALUE_BITS 8
#define GC_MXFP8_E5M2_ITEMSIZE 1
#define GC_MXFP8_E5M2_FIXED_BLOCK 32
#define GC_MXFP8_E5M2_MAX_BITS 0x47600000u
#define GC_MXFP8_E5M2_NAN_CODE 0x7fu
#define GC_MXFP8_E5M2_EMAX 15
#define GC_MXFP8_E5M2_FACTS "mxfp8_e5m2:9:e8m0:1:8:1:32:0x47600000:0x7f:15"
#define GC_ADA4_5_SCALE GC_SCALE_ADAPTIVE
#define GC_ADA4_5_ELEM -1
#define GC_ADA4_5_VALUE_BITS 0
#define GC_ADA4_5_ITEMSIZE 1
#define GC_ADA4_5_FIXED_BLOCK 256
#define GC_ADA4_5_MAX_BITS 0x43e00000u
#define GC_ADA4_5_NAN_CODE 0x00u
#define GC_ADA4_5_EMAX 8
#define GC_ADA4_5_FACTS "ada4_5:10:adaptive:-1:0:1:256:0x43e00000:0x0:8"
#define GC_ADA4_SCALE GC_SCALE_ADAPTIVE
#define GC_ADA4_ELEM -1
#define GC_ADA4_VALUE_BITS 0
#define GC_ADA4_ITEMSIZE 1
#define GC_ADA4_FIXED_BLOCK 256
#define GC_ADA4_MAX_BITS 0x43e00000u
#define GC_ADA4_NAN_CODE 0x00u
#define GC_ADA4_EMAX 8
#define GC_ADA4_FACTS "ada4:11:adaptive:-1:0:1:256:0x43e00000:0x0:8"

/* the rows the C and CUDA kernels implement (Format.native), all and by family, in code order:
 * X(NAME, name) per row; the kernels' dispatch switches and CUDA entry points expand these */
#define GC_NATIVE_ROWS(X) X(E4M3, e4m3) X(E5M2, e5m2) X(BF16, bf16) X(FP16, fp16) X(FP32, fp32) X(NVFP4, nvfp4) X(MXFP4, mxfp4) X(MXFP8, mxfp8) X(MXFP8_E5M2, mxfp8_e5m2) X(ADA4_5, ada4_5) X(ADA4, ada4)
/* FP8 elements, float32 block scales */
#define GC_F32_ROWS(X) X(E4M3, e4m3) X(E5M2, e5m2)
/* MX: E8M0 scale per 32 values */
#define GC_E8M0_ROWS(X) X(MXFP4, mxfp4) X(MXFP8, mxfp8) X(MXFP8_E5M2, mxfp8_e5m2)
/* adaptive precision: tiers per super-block (the spec registered at run time) */
#define GC_ADAPTIVE_ROWS(X) X(ADA4_5, ada4_5) X(ADA4, ada4)

/* the same facts by code (c: any int expression; an unknown code gives 0 / -1) */
#define GC_FMT_SCALE(c) ((c) == GC_E4M3 ? GC_E4M3_SCALE : (c) == GC_E5M2 ? GC_E5M2_SCALE : (c) == GC_BF16 ? GC_BF16_SCALE : (c) == GC_FP16 ? GC_FP16_SCALE : (c) == GC_FP32 ? GC_FP32_SCALE : (c) == GC_NVFP4 ? GC_NVFP4_SCALE : (c) == GC_MXFP4 ? GC_MXFP4_SCALE : (c) == GC_MXFP8 ? GC_MXFP8_SCALE : (c) == GC_MXFP8_E5M2 ? GC_MXFP8_E5M2_SCALE : (c) == GC_ADA4_5 ? GC_ADA4_5_SCALE : (c) == GC_ADA4 ? GC_ADA4_SCALE : 0)
#define GC_FMT_ELEM(c) ((c) == GC_E4M3 ? GC_E4M3_ELEM : (c) == GC_E5M2 ? GC_E5M2_ELEM : (c) == GC_BF16 ? GC_BF16_ELEM : (c) == GC_FP16 ? GC_FP16_ELEM : (c) == GC_FP32 ? GC_FP32_ELEM : (c) == GC_NVFP4 ? GC_NVFP4_ELEM : (c) == GC_MXFP4 ? GC_MXFP4_ELEM : (c) == GC_MXFP8 ? GC_MXFP8_ELEM : (c) == GC_MXFP8_E5M2 ? GC_MXFP8_E5M2_ELEM : (c) == GC_ADA4_5 ? GC_ADA4_5_ELEM : (c) == GC_ADA4 ? GC_ADA4_ELEM : -1)
#define GC_FMT_VALUE_BITS(c) ((c) == GC_E4M3 ? GC_E4M3_VALUE_BITS : (c) == GC_E5M2 ? GC_E5M2_VALUE_BITS : (c) == GC_BF16 ? GC_BF16_VALUE_BITS : (c) == GC_FP16 ? GC_FP16_VALUE_BITS : (c) == GC_FP32 ? GC_FP32_VALUE_BITS : (c) == GC_NVFP4 ? GC_NVFP4_VALUE_BITS : (c) == GC_MXFP4 ? GC_MXFP4_VALUE_BITS : (c) == GC_MXFP8 ? GC_MXFP8_VALUE_BITS : (c) == GC_MXFP8_E5M2 ? GC_MXFP8_E5M2_VALUE_BITS : (c) == GC_ADA4_5 ? GC_ADA4_5_VALUE_BITS : (c) == GC_ADA4 ? GC_ADA4_VALUE_BITS : 0)
#define GC_FMT_ITEMSIZE(c) ((c) == GC_E4M3 ? GC_E4M3_ITEMSIZE : (c) == GC_E5M2 ? GC_E5M2_ITEMSIZE : (c) == GC_BF16 ? GC_BF16_ITEMSIZE : (c) == GC_FP16 ? GC_FP16_ITEMSIZE : (c) == GC_FP32 ? GC_FP32_ITEMSIZE : (c) == GC_NVFP4 ? GC_NVFP4_ITEMSIZE : (c) == GC_MXFP4 ? GC_MXFP4_ITEMSIZE : (c) == GC_MXFP8 ? GC_MXFP8_ITEMSIZE : (c) == GC_MXFP8_E5M2 ? GC_MXFP8_E5M2_ITEMSIZE : (c) == GC_ADA4_5 ? GC_ADA4_5_ITEMSIZE : (c) == GC_ADA4 ? GC_ADA4_ITEMSIZE : 0)
#define GC_FMT_FIXED_BLOCK(c) ((c) == GC_E4M3 ? GC_E4M3_FIXED_BLOCK : (c) == GC_E5M2 ? GC_E5M2_FIXED_BLOCK : (c) == GC_BF16 ? GC_BF16_FIXED_BLOCK : (c) == GC_FP16 ? GC_FP16_FIXED_BLOCK : (c) == GC_FP32 ? GC_FP32_FIXED_BLOCK : (c) == GC_NVFP4 ? GC_NVFP4_FIXED_BLOCK : (c) == GC_MXFP4 ? GC_MXFP4_FIXED_BLOCK : (c) == GC_MXFP8 ? GC_MXFP8_FIXED_BLOCK : (c) == GC_MXFP8_E5M2 ? GC_MXFP8_E5M2_FIXED_BLOCK : (c) == GC_ADA4_5 ? GC_ADA4_5_FIXED_BLOCK : (c) == GC_ADA4 ? GC_ADA4_FIXED_BLOCK : 0)

#ifndef __CUDACC__
/* one row by code (host C and C++): name, facts string; NULL for a code no format has */
typedef struct {
    const char *name, *facts;
    int code, scale, elem, value_bits, itemsize, fixed_block;
} gc_format_row;

static inline const gc_format_row *gc_format_row_of(int code)
{
    static const gc_format_row rows[] = {
        {"e4m3", GC_E4M3_FACTS, GC_E4M3, GC_E4M3_SCALE, GC_E4M3_ELEM, GC_E4M3_VALUE_BITS, GC_E4M3_ITEMSIZE, GC_E4M3_FIXED_BLOCK},
        {"e5m2", GC_E5M2_FACTS, GC_E5M2, GC_E5M2_SCALE, GC_E5M2_ELEM, GC_E5M2_VALUE_BITS, GC_E5M2_ITEMSIZE, GC_E5M2_FIXED_BLOCK},
        {"bf16", GC_BF16_FACTS, GC_BF16, GC_BF16_SCALE, GC_BF16_ELEM, GC_BF16_VALUE_BITS, GC_BF16_ITEMSIZE, GC_BF16_FIXED_BLOCK},
        {"fp16", GC_FP16_FACTS, GC_FP16, GC_FP16_SCALE, GC_FP16_ELEM, GC_FP16_VALUE_BITS, GC_FP16_ITEMSIZE, GC_FP16_FIXED_BLOCK},
        {"fp32", GC_FP32_FACTS, GC_FP32, GC_FP32_SCALE, GC_FP32_ELEM, GC_FP32_VALUE_BITS, GC_FP32_ITEMSIZE, GC_FP32_FIXED_BLOCK},
        {"nvfp4", GC_NVFP4_FACTS, GC_NVFP4, GC_NVFP4_SCALE, GC_NVFP4_ELEM, GC_NVFP4_VALUE_BITS, GC_NVFP4_ITEMSIZE, GC_NVFP4_FIXED_BLOCK},
        {"mxfp4", GC_MXFP4_FACTS, GC_MXFP4, GC_MXFP4_SCALE, GC_MXFP4_ELEM, GC_MXFP4_VALUE_BITS, GC_MXFP4_ITEMSIZE, GC_MXFP4_FIXED_BLOCK},
        {"mxfp8", GC_MXFP8_FACTS, GC_MXFP8, GC_MXFP8_SCALE, GC_MXFP8_ELEM, GC_MXFP8_VALUE_BITS, GC_MXFP8_ITEMSIZE, GC_MXFP8_FIXED_BLOCK},
        {"mxfp8_e5m2", GC_MXFP8_E5M2_FACTS, GC_MXFP8_E5M2, GC_MXFP8_E5M2_SCALE, GC_MXFP8_E5M2_ELEM, GC_MXFP8_E5M2_VALUE_BITS, GC_MXFP8_E5M2_ITEMSIZE, GC_MXFP8_E5M2_FIXED_BLOCK},
        {"ada4_5", GC_ADA4_5_FACTS, GC_ADA4_5, GC_ADA4_5_SCALE, GC_ADA4_5_ELEM, GC_ADA4_5_VALUE_BITS, GC_ADA4_5_ITEMSIZE, GC_ADA4_5_FIXED_BLOCK},
        {"ada4", GC_ADA4_FACTS, GC_ADA4, GC_ADA4_SCALE, GC_ADA4_ELEM, GC_ADA4_VALUE_BITS, GC_ADA4_ITEMSIZE, GC_ADA4_FIXED_BLOCK},
    };
    for (unsigned i = 0; i < sizeof rows / sizeof rows[0]; i++)
        if (rows[i].code == code)
            return &rows[i];
    return 0;
}
#endif

#endif
