"""OneHot emitter vs numpy: out-of-range and negative labels give zero rows; i32/u32 labels,
strided labels, f32/bool/i32 outputs."""

import numpy as np
import pytest

from meganeura import kernels as codegen
from meganeura.dtypes import bool_, f32, i32
from meganeura.kernels import CodegenError, OneHotKernel, Strided

from ._util import view_of


def _ref(y, c, dtype):
    return (y[..., None] == np.arange(c)).astype(dtype)


@pytest.mark.parametrize("out", [f32, bool_, i32])
def test_one_hot_i32(run, rng, out):
    y = rng.integers(-2, 12, (4, 7)).astype(np.int32)  # includes negative and >= C
    k = OneHotKernel(Strided.contiguous(i32, y.shape), 10, out)
    (o,) = run(k, [y], [((4, 7, 10), out)])
    np.testing.assert_array_equal(o, _ref(y, 10, out.np))


def test_one_hot_u32_strided(run, rng):
    base = rng.integers(0, 6, (5, 8)).astype(np.uint32)
    v = base.T[1:7:2]  # (3, 5) strided view
    k = OneHotKernel(view_of(base, v), 5, f32)
    (o,) = run(k, [base], [((3, 5, 5), f32)])
    np.testing.assert_array_equal(o, _ref(v, 5, np.float32))


def test_one_hot_errors():
    with pytest.raises(CodegenError, match="labels must be"):
        codegen.emit(OneHotKernel(Strided.contiguous(f32, (3,)), 4, f32))
    with pytest.raises(CodegenError, match="num_classes"):
        codegen.emit(OneHotKernel(Strided.contiguous(i32, (3,)), 0, f32))
