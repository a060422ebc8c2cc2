"""The GEMM kernels' launch signatures as NVRTC and the Metal type-check take them: (spec,
input name -> dtype, output name -> dtype, template constants) for a choice of the template's
knobs. tests/test_kernels.py compiles them; scripts/gemv_registers.py and
scripts/sass_counts.py count what NVRTC makes of them."""

from __future__ import annotations

from dsv41_mlx.kernels import FP4_EXPERTS, FP8_GEMV, FP8_MMA, FP8_MMA_HC, MMA_X_PREP


def gemv_case(RB, T, C, QX=0, SW=0, AP=0, SPLIT=0):  # noqa: N803 (the kernel's template names)
    inputs = {"x": "bfloat16", "w": "uint32", "scales": "uint8", "sizes": "int32", "swiglu": "float32",
              "parts": "bfloat16"}
    return FP8_GEMV, inputs, {"y": "bfloat16"}, {"RB": RB, "T": T, "C": C, "QX": QX, "SW": SW, "AP": AP,
                                                 "SPLIT": SPLIT}


def experts_case(NH, QX=0, SW=0, ONE=0, U=None, PX=0):  # noqa: N803
    inputs = {"x": "uint16" if PX else "bfloat16", "xs": "float32", "w": "uint32", "scales": "uint8", "ids": "uint32",
              "sizes": "int32", "swiglu": "float32", "weights": "float32"}
    if U is None:  # Layout.experts_loads_ahead's at a short K
        U = 1 if ONE else 2
    return FP4_EXPERTS, inputs, {"y": "bfloat16"}, {"NH": NH, "QX": QX, "SW": SW, "ONE": ONE, "U": U, "PX": PX}


def x_prep_case(QX):  # noqa: N803
    return MMA_X_PREP, {"x": "bfloat16", "sizes": "int32"}, {"xh": "uint16", "xs": "float32"}, {"QX": QX}


def mma_case(NH, QX=0, SW=0, AP=0, ONE=0, U=6, TR=32):  # noqa: N803
    inputs = {"x": "bfloat16", "w": "uint32", "scales": "uint8", "sizes": "int32", "swiglu": "float32",
              "parts": "bfloat16", "after": "float32"}
    return FP8_MMA, inputs, {"y": "bfloat16"}, {"NH": NH, "QX": QX, "SW": SW, "AP": AP, "ONE": ONE, "U": U, "TR": TR}


def mma_hc_case(NH, QX=0, AP=0, ONE=0, U=6):  # noqa: N803
    inputs = {"x": "bfloat16", "w": "uint32", "scales": "uint8", "sizes": "int32", "parts": "bfloat16",
              "residual": "bfloat16", "post": "float32", "comb": "float32", "fn": "float32"}
    return FP8_MMA_HC, inputs, {"h": "bfloat16", "mix_parts": "float32"}, {"NH": NH, "QX": QX, "AP": AP, "ONE": ONE,
                                                                           "HC": 4, "U": U, "TR": 32}
