"""Integer intervals: what `mk.measure.bounds` knows of a scalar of a kernel body.

An interval is (lo, hi), inclusive, None on a side meaning unbounded (`TOP`: nothing
known). Here: joins and meets, the arithmetic `mk.measure.bounds` propagates (+ - * // % rem),
and `scalar`, the interval of one scalar primitive's output from its operands'. Not here:
walking a jaxpr, control flow and predicates (`mk.measure.bounds`).
"""

from __future__ import annotations

import numpy as np

Interval = tuple  # (lo, hi), inclusive; None on a side means unbounded
TOP = (None, None)


def join(a: Interval, b: Interval) -> Interval:
    lo = None if a[0] is None or b[0] is None else min(a[0], b[0])
    hi = None if a[1] is None or b[1] is None else max(a[1], b[1])
    return lo, hi


def meet(a: Interval, b: Interval) -> Interval:
    lo = b[0] if a[0] is None else a[0] if b[0] is None else max(a[0], b[0])
    hi = b[1] if a[1] is None else a[1] if b[1] is None else min(a[1], b[1])
    return lo, hi


def const(x) -> Interval:
    v = np.asarray(x)
    if v.size == 0 or not (np.issubdtype(v.dtype, np.integer) or v.dtype == bool):
        return TOP
    return int(v.min()), int(v.max())


def corners(f, a: Interval, b: Interval) -> Interval:
    if None in a or None in b:
        return TOP
    values = [f(x, y) for x in a for y in b]
    return min(values), max(values)


def add(a, b):
    return (None if None in (a[0], b[0]) else a[0] + b[0],
            None if None in (a[1], b[1]) else a[1] + b[1])


def neg(a):
    return (None if a[1] is None else -a[1], None if a[0] is None else -a[0])


def floordiv(a, b):  # Python's // by a positive divisor
    if b[0] is None or b[0] < 1 or None in a:
        return TOP
    if b[1] is None:  # a divisor of b[0] or more: between a // b[0] and 0
        return min(a[0] // b[0], 0), max(a[1] // b[0], 0)
    return corners(lambda x, y: x // y, a, b)


def mod(a, b):  # Python's %: for a positive divisor in [0, d)
    if b[0] is None or b[0] < 1:
        return TOP
    if a[0] is not None and a[1] is not None and 0 <= a[0] and b[1] is not None \
            and a[1] < b[0]:
        return a
    return (0, None if b[1] is None else b[1] - 1)


def rem(a, b):  # lax.rem: the dividend's sign
    if b[0] is None or b[0] < 1:
        return TOP
    if a[0] is not None and a[0] >= 0:
        return mod(a, b)
    limit = None if b[1] is None else b[1] - 1
    return (None if limit is None else -limit, limit)


BOOL = (0, 1)
PASS = {"convert_element_type", "broadcast_in_dim", "reshape", "squeeze", "copy",
         "multiple_of", "reduce_max", "reduce_min", "expand_dims", "transpose",
         "slice", "dynamic_slice", "optimization_barrier"}
BOOLEAN = {"lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not", "xor", "is_finite"}
#          (and, or, not, xor on integers are bitwise: `scalar`)


def scalar(p: str, eqn, ins) -> Interval:
    """The interval of a one-output primitive `p` of operand intervals `ins`."""
    if p in PASS and ins:
        return ins[0]
    if p in BOOLEAN and eqn.outvars[0].aval.dtype == np.bool_:
        return BOOL
    if p == "and":  # bitwise: at most a non-negative operand (its bound, if it has one)
        highs = [b for a, b in ins if a is not None and a >= 0]
        bounded = [b for b in highs if b is not None]
        return (0, min(bounded) if bounded else None) if highs else TOP
    if p == "add":
        return add(*ins)
    if p == "sub":
        return add(ins[0], neg(ins[1]))
    if p == "neg":
        return neg(ins[0])
    if p == "mul":
        return corners(lambda x, y: x * y, *ins)
    if p == "max":
        (alo, ahi), (blo, bhi) = ins
        return (alo if blo is None else blo if alo is None else max(alo, blo),
                None if None in (ahi, bhi) else max(ahi, bhi))
    if p == "min":
        (alo, ahi), (blo, bhi) = ins
        return (None if None in (alo, blo) else min(alo, blo),
                ahi if bhi is None else bhi if ahi is None else min(ahi, bhi))
    if p == "clamp":
        return meet(ins[1], (ins[0][0], ins[2][1]))
    if p == "div":
        a, b = ins
        if None in a or b[0] is None or b[0] < 1 or b[1] is None:
            return TOP
        return corners(lambda x, y: int(x / y), a, b)
    if p == "rem":
        return rem(*ins)
    if p == "sign":
        return (-1, 1)
    if p == "select_n":
        cases = ins[1:]
        if ins[0][0] is not None and ins[0][0] == ins[0][1] \
                and 0 <= ins[0][0] < len(cases):
            return cases[ins[0][0]]
        out = cases[0]
        for c in cases[1:]:
            out = join(out, c)
        return out
    if p == "iota":
        dim = eqn.params["dimension"]
        return (0, eqn.params["shape"][dim] - 1)
    if p == "abs":
        a = ins[0]
        if a[0] is not None and a[0] >= 0:
            return a
        return (0, None if None in a else max(-a[0], a[1]))
    return TOP


def empty(a: Interval) -> bool:
    return None not in a and a[0] > a[1]
