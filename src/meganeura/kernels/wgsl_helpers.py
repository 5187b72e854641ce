"""WGSL helper functions that pointwise expressions call by name (``lowering.Pointwise.helpers``).

All take and return ``f32``; f16 instructions call them through ``f32(…)`` conversions (the
pointwise emitter does that).  They avoid the driver's built-ins where those are inaccurate or
unsafe: lavapipe's ``tanh(1e-5)`` is off by 1.4e-3 relative and some drivers return NaN for
``tanh`` of large arguments; ``pow`` of a negative base is undefined in WGSL.

Accuracy (measured on lavapipe against float64, see tests/codegen/test_helpers.py):
``mn_erf`` ≤ 2e-7 absolute and ~1e-6 relative near 0 (Cephes ``erff``/``erfcf`` rational forms),
``mn_tanh`` ~3e-7 relative (Cephes ``tanhf``), ``mn_sigmoid`` ~3e-7 relative for |x| ≤ 80.
"""

from __future__ import annotations

from ..errors import MeganeuraError

# Infinities and NaN come from a private variable: WGSL has no literal for them, and Dawn's
# Tint rejects a constant expression such as bitcast<f32>(0x7f800000u) ("value inf cannot be
# represented as 'f32'"); a variable read is a runtime value for every compiler.
_INF = "mn_inf()"
_NAN = "mn_nan()"

# name -> (source, dependencies)
HELPERS: dict[str, tuple[str, tuple[str, ...]]] = {}


def _def(name: str, src: str, deps: tuple[str, ...] = ()) -> None:
    HELPERS[name] = (src.strip() + "\n", deps)


_def(
    "mn_inf",
    """
var<private> mn_inf_bits: u32 = 0x7f800000u;

fn mn_inf() -> f32 {
    return bitcast<f32>(mn_inf_bits);
}
""",
)

_def(
    "mn_nan",
    """
fn mn_nan() -> f32 {
    return bitcast<f32>(mn_inf_bits | 0x00400000u);
}
""",
    ("mn_inf",),
)

_def(
    "mn_sigmoid",
    """
fn mn_sigmoid(x: f32) -> f32 {
    // 1/(1+e^-x) for x >= 0, e^x/(1+e^x) below: never exp of a large positive number.
    let e = exp(-abs(x));
    let s = 1.0 / (1.0 + e);
    return select(e * s, s, x >= 0.0);
}
""",
)

_def(
    "mn_tanh",
    """
fn mn_tanh(x: f32) -> f32 {
    let a = abs(x);
    if (a < 0.625) {
        // Cephes tanhf: odd polynomial, full relative accuracy near 0.
        let z = x * x;
        let p = (((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z
                 + 1.33314422036e-1) * z - 3.33332819422e-1;
        return x + x * z * p;
    }
    if (a >= 9.0) {
        // tanh(9) rounds to 1 in f32; also keeps exp() far from overflow.
        return select(1.0, -1.0, x < 0.0);
    }
    let t = 1.0 - 2.0 / (exp(2.0 * a) + 1.0);
    return select(t, -t, x < 0.0);
}
""",
)

# Cephes ndtrf.c: erf(x) = x T(x^2) on |x| < 1; erfc(x) = exp(-x^2)/x P(1/x^2) on [1, 2),
# exp(-x^2)/x R(1/x^2) on [2, ~10] (float64 check: relative errors 1.2e-9, 3.0e-8, 2.4e-8).
_def(
    "mn_erfc_tail",
    """
fn mn_erfc_tail(a: f32) -> f32 {
    // erfc(a) for a >= 1 (a finite or +inf).
    let y = 1.0 / (a * a);
    var p: f32;
    if (a < 2.0) {
        p = ((((((((2.326819970068386e-2 * y - 1.387039388740657e-1) * y
            + 3.687424674597105e-1) * y - 5.824733027278666e-1) * y
            + 6.210004621745983e-1) * y - 4.944515323274145e-1) * y
            + 3.404879937665872e-1) * y - 2.741127028184656e-1) * y
            + 5.638259427386472e-1);
    } else {
        p = (((((((-1.047766399936249e1 * y + 1.297719955372516e1) * y
            - 7.495518717768503e0) * y + 2.921019019210786e0) * y
            - 1.015265279202700e0) * y + 4.218463358204948e-1) * y
            - 2.820767439740514e-1) * y + 5.641895067754075e-1);
    }
    if (a > 10.0) {
        return 0.0;  // below f32's smallest normal number
    }
    return exp(-a * a) / a * p;
}
""",
)

_def(
    "mn_erf",
    """
fn mn_erf(x: f32) -> f32 {
    let a = abs(x);
    if (a < 1.0) {
        let z = x * x;
        return x * ((((((7.853861353153693e-5 * z - 8.010193625184903e-4) * z
            + 5.188327685732524e-3) * z - 2.685381193529856e-2) * z
            + 1.128358514861418e-1) * z - 3.761262582423300e-1) * z
            + 1.128379165726710e0);
    }
    if (a >= 4.0) {
        // 1 - erfc(4) rounds to 1 in f32.
        return select(1.0, -1.0, x < 0.0);
    }
    let r = 1.0 - mn_erfc_tail(a);
    return select(r, -r, x < 0.0);
}
""",
    ("mn_erfc_tail",),
)

_def(
    "mn_erfc",
    """
fn mn_erfc(x: f32) -> f32 {
    let a = abs(x);
    var r: f32;
    if (a < 1.0) {
        r = 1.0 - mn_erf(a);
    } else {
        r = mn_erfc_tail(a);
    }
    return select(r, 2.0 - r, x < 0.0);
}
""",
    ("mn_erf", "mn_erfc_tail"),
)

_def(
    "mn_gelu_erf",
    """
fn mn_gelu_erf(x: f32) -> f32 {
    // 0.5 x erfc(-u), u = x/sqrt 2: for |u| < 1 as 1 + erf(u) (erf's odd polynomial), else
    // from erfc's tail, 2 - erfc(|u|) for x > 0 — the same arithmetic as 1 + mn_erf(u) and
    // mn_erfc(-u), but one polynomial and one tail per call instead of erf's and erfc's
    // nested branches twice over.  A matmul epilogue inlines this for every result it stores:
    // Whisper's fc1 + bias + gelu (H200, Dawn) 98 -> 82 µs per call with this form.
    let u = x * 0.70710678118654752;
    let a = abs(u);
    if (a < 1.0) {
        let z = u * u;
        return 0.5 * x * (1.0 + u * ((((((7.853861353153693e-5 * z - 8.010193625184903e-4) * z
            + 5.188327685732524e-3) * z - 2.685381193529856e-2) * z
            + 1.128358514861418e-1) * z - 3.761262582423300e-1) * z
            + 1.128379165726710e0));
    }
    let t = mn_erfc_tail(a);
    return 0.5 * x * select(t, 2.0 - t, x > 0.0);
}
""",
    ("mn_erfc_tail",),
)

_def(
    "mn_gelu_tanh",
    """
fn mn_gelu_tanh(x: f32) -> f32 {
    // 0.5 x (1 + tanh(u)) == x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3).
    let u = 0.79788456080286536 * (x + 0.044715 * x * x * x);
    return x * mn_sigmoid(2.0 * u);
}
""",
    ("mn_sigmoid",),
)

_def(
    "mn_pow",
    f"""
fn mn_pow(a: f32, b: f32) -> f32 {{
    // numpy/torch semantics: x^0 = 1 (also for NaN x), 1^y = 1, negative bases with integer
    // exponents keep their sign, non-integer exponents of negative bases give NaN.
    if (b == 0.0 || a == 1.0) {{
        return 1.0;
    }}
    let is_int = floor(b) == b;
    if (is_int && abs(b) <= 16.0) {{
        // Exact-ish binary powering (a few roundings) for small integer exponents.
        var n = u32(abs(b));
        var base = a;
        var r = 1.0;
        loop {{
            if ((n & 1u) != 0u) {{
                r = r * base;
            }}
            n = n >> 1u;
            if (n == 0u) {{
                break;
            }}
            base = base * base;
        }}
        return select(r, 1.0 / r, b < 0.0);
    }}
    let odd = is_int && fract(b * 0.5) != 0.0;
    if (a == 0.0) {{
        // 0^b: 0 or inf; (-0)^odd keeps the sign (as numpy and torch do).
        let r = select(0.0, {_INF}, b < 0.0);
        return select(r, -r, odd && (bitcast<u32>(a) & 0x80000000u) != 0u);
    }}
    let m = pow(abs(a), b);
    if (a < 0.0) {{
        if (!is_int) {{
            return {_NAN};
        }}
        return select(m, -m, odd);
    }}
    return m;
}}
""",
    ("mn_inf", "mn_nan"),
)


def resolve(names) -> list[str]:
    """``names`` plus their dependencies, each once, dependencies first."""
    out: list[str] = []
    seen: set[str] = set()

    def visit(n: str) -> None:
        if n in seen:
            return
        if n not in HELPERS:
            raise MeganeuraError(
                f"unknown WGSL helper {n!r}; codegen/wgsl_helpers.py defines {sorted(HELPERS)}"
            )
        seen.add(n)
        for d in HELPERS[n][1]:
            visit(d)
        out.append(n)

    for n in names:
        visit(n)
    return out


def helper_source(names) -> str:
    """The WGSL source of the helpers ``names`` (with dependencies), ready to prepend."""
    return "\n".join(HELPERS[n][0] for n in resolve(names))
