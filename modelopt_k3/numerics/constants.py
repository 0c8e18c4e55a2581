"""Format constants shared by the numerics modules (values from docs/FORMATS.md)."""

FP4_MAX = 6.0  # largest E2M1 magnitude
FP8_E4M3_MAX = 448.0  # largest float8_e4m3fn magnitude
FP8_E4M3_MIN_SUBNORMAL = 2.0**-9  # smallest positive float8_e4m3fn (lower clamp of NVFP4 block scales)
FP8_E4M3_MAX_POW2_EXP = 8  # 2**8 = 256 is the largest power of two <= 448
FP8_E4M3_MIN_POW2_EXP = -9  # 2**-9, a subnormal, is the smallest power of two in E4M3

E8M0_BIAS = 127  # MXFP4 scale byte s means 2**(s - 127)
E8M0_NAN = 255  # the OCP MX spec reserves 0xFF as NaN
E8M0_MAX_EXP = 127  # largest finite E8M0 exponent (byte 254)
E8M0_MIN_EXP = -127  # smallest E8M0 exponent (byte 0)

MXFP4_BLOCK = 32
NVFP4_BLOCK = 16
FP8_BLOCK = 128

# OCP MX: shared exponent = floor(log2(block amax)) - emax_elem, emax_elem = floor(log2(6)) = 2 for E2M1.
E2M1_EMAX = 2
