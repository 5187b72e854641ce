"""The op registry's families.  Importing this package registers every op; the functions below
are the public builders (``mn.ops.relu(x)`` and ``x.relu()`` are the same)."""

from . import elementwise, nn, reduce, shape  # noqa: F401  (registration; .matmul below)
from .attention import attention, attention_with_lse  # noqa: F401
from .conv import (  # noqa: F401
    avg_pool2d,
    conv1d,
    conv2d,
    conv2d_input_grad,
    conv2d_weight_grad,
    max_pool2d,
    max_pool2d_with_indices,
)
from .elementwise import (  # noqa: F401
    abs,
    add,
    cast,
    cos,
    div,
    equal,
    erf,
    exp,
    expm1,
    floor,
    gelu,
    greater,
    greater_equal,
    less,
    less_equal,
    log,
    logical_and,
    logical_not,
    logical_or,
    maximum,
    minimum,
    mul,
    neg,
    not_equal,
    ones_like,
    pow,
    reciprocal,
    relu,
    rsqrt,
    sigmoid,
    sign,
    silu,
    sin,
    sqrt,
    square,
    stop_gradient,
    sub,
    tanh,
    where,
    zeros_like,
)
from .index import (  # noqa: F401
    dynamic_slice,
    dynamic_update_slice,
    embedding,
    embedding_grad,
    take,
)
from .matmul import matmul  # noqa: F401
from .nn import (  # noqa: F401
    bce_with_logits,
    cross_entropy,
    l1_loss,
    log_softmax,
    mse_loss,
    softmax,
)
from .reduce import logsumexp, max, mean, min, sum, sum_to  # noqa: F401
from .shape import (  # noqa: F401
    broadcast_to,
    concat,
    flip,
    getitem,
    matrix_transpose,
    permute,
    reshape,
    slice_,
    split,
    squeeze,
    transpose,
    unsqueeze,
)
