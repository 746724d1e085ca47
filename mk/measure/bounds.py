"""Index bounds of a Pallas kernel, checked on its traced jaxpr: every semaphore, scratch,
SMEM and HBM index the kernel can take, against the shape the kernel allocated.

Interpret mode cannot see a semaphore index out of range (it clamps), nor can the race
detector or the TPU compile; this module walks the kernel's jaxpr instead (every branch
and loop body, taken or not), carries an integer interval for each scalar it can bound,
and checks every ref index of every primitive that takes one. A value read from a ref
has no bound here; an interval over-approximates what a run can take, so "out of range"
means the analysis could not exclude it.

Here: `Access` (one checked index), `kernel_jaxprs` (the pallas_call kernel bodies in a
traced function), `accesses` (every index of one kernel body), `check` (the out-of-range
ones as a `ValueError`), `describe` (counts). tests/test_bounds.py runs it on the
megakernel of every model family. Not here: the interval arithmetic (`mk.measure.intervals`), what
the kernel computes (the kernel tests), races (`mk.kernels.backend`). What bounds a dynamic index,
rule by rule: docs/design/mk.measure.bounds.md.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from mk.kernels.jax_private import NDIndexer, Slice, TransformedRef, core, source_info_util
from mk.measure.intervals import (TOP, Interval, add, const, empty, floordiv, join, meet, mod,
                          scalar)

_FLIP = {"gt": "lt", "ge": "le"}  # a > b is b < a



@dataclasses.dataclass(frozen=True)
class Access:
    """One index of one ref dimension: what indexes (primitive), the ref (its name in the
    kernel's arguments when known, else its type), the dimension and its size, the
    index's interval (`TOP`: unbounded) and span (1, or a slice's size), and where (the
    source line and its caller's)."""

    primitive: str
    ref: str
    dim: int
    size: int
    interval: Interval
    span: int
    where: str

    @property
    def bounded(self) -> bool:
        return None not in self.interval

    @property
    def in_range(self) -> bool:
        """False when the index can fall outside [0, size) per its interval (an unbounded
        side counts as in range: nothing is known)."""
        lo, hi = self.interval
        return (lo is None or lo >= 0) and (hi is None or hi + self.span <= self.size)

    def __str__(self) -> str:
        lo, hi = ("?" if v is None else v for v in self.interval)
        what = f"[{lo}, {hi}]" + (f" + {self.span}" if self.span != 1 else "")
        return (f"{self.primitive} {self.ref} dim {self.dim} (size {self.size}): index "
                f"{what} at {self.where}")


def kernel_jaxprs(fn, *args, axis_env=(), **kwargs) -> list[tuple[str, core.Jaxpr,
                                                                    list[str]]]:
    """(name, kernel body jaxpr, argument names) of every pallas_call traced by
    fn(*args, **kwargs) (nothing runs; arguments may be `jax.ShapeDtypeStruct`s);
    axis_env: [(mesh axis, size)] a kernel inside `shard_map` reads (`lax.axis_index`)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                body = eqn.params["jaxpr"]
                info = body.debug_info
                names = list(info.arg_names) if info and info.arg_names else []
                found.append((str(eqn.params.get("name")), body, names))
                continue
            for sub in core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn, axis_env=list(axis_env))(*args, **kwargs).jaxpr)
    return found


def accesses(jaxpr: core.Jaxpr, names=()) -> list[Access]:
    """Every ref index of the kernel body `jaxpr` (its invars named by `names`)."""
    out: list[Access] = []
    _Walker(out).run(jaxpr, [TOP] * len(jaxpr.invars),
                     dict(zip(jaxpr.invars, names)) if names else {})
    return out


def check(fn, *args, axis_env=(), **kwargs) -> list[Access]:
    """Every index of every kernel fn(*args, **kwargs) traces (`kernel_jaxprs`); raises
    ValueError listing the ones that can fall out of range."""
    found = [a for _, body, names in kernel_jaxprs(fn, *args, axis_env=axis_env, **kwargs)
             for a in accesses(body, names)]
    bad = [a for a in found if not a.in_range]
    if bad:
        raise ValueError("ref indices out of range:\n" + "\n".join(map(str, bad)))
    return found


def describe(found: list[Access]) -> dict[str, int]:
    """Counts of `found`: indices, bounded ones (static or of a known interval),
    unbounded ones, those out of range, and the refs they index."""
    return dict(indices=len(found), bounded=sum(a.bounded for a in found),
                unbounded=sum(not a.bounded for a in found),
                out_of_range=sum(not a.in_range for a in found),
                refs=len({a.ref for a in found}))


class _Walker:
    """Interval propagation over one kernel body, recording `Access`es."""

    def __init__(self, out: list[Access]):
        self.out = out

    def run(self, jaxpr: core.Jaxpr, values, names, consts=()) -> list[Interval]:
        env: dict = {}
        defs: dict = {}
        for v, c in zip(jaxpr.constvars, consts):
            env[v] = c
        for v, val in zip(jaxpr.invars, values):
            env[v] = val
        names = dict(names)

        def read(x):
            if isinstance(x, core.Literal):
                return const(x.val)
            if isinstance(x, (int, np.integer)):
                return (int(x), int(x))
            return env.get(x, TOP)

        for eqn in jaxpr.eqns:
            ins = [read(x) for x in eqn.invars]
            self._indices(eqn, read, names)
            outs = self._eqn(eqn, ins, read, names, defs, env)
            for v, val in zip(eqn.outvars, outs):
                env[v] = val
                defs[v] = eqn
        return [read(v) for v in jaxpr.outvars]

    # -- index checks ---------------------------------------------------------------------
    def _indices(self, eqn, read, names):
        for tree in eqn.params.values():
            if not isinstance(tree, jax.tree_util.PyTreeDef) or not tree.num_leaves \
                    or tree.num_leaves > len(eqn.invars):
                continue
            leaves = eqn.invars[len(eqn.invars) - tree.num_leaves:]
            try:
                args = jax.tree.unflatten(tree, leaves)
            except (TypeError, ValueError):
                continue
            base = eqn.invars[0] if len(leaves) < len(eqn.invars) else None
            self._find(args, base, eqn, read, names)

    def _find(self, node, ref, eqn, read, names):
        if isinstance(node, TransformedRef):
            self._find(node.transforms, node.ref, eqn, read, names)
        elif isinstance(node, NDIndexer):
            self._check(node, ref, eqn, read, names)
        elif isinstance(node, (tuple, list)):
            for child in node:
                self._find(child, ref, eqn, read, names)
        elif isinstance(node, dict):
            for child in node.values():
                self._find(child, ref, eqn, read, names)

    def _check(self, indexer: NDIndexer, ref, eqn, read, names):
        name = names.get(ref) if isinstance(ref, core.Var) else None
        if name is None:
            name = str(getattr(ref, "aval", "ref"))
        where = " > ".join(source_info_util.summarize(eqn.source_info, 2).splitlines())
        for dim, (index, size) in enumerate(zip(indexer.indices, indexer.shape)):
            if isinstance(index, Slice):
                span = index.size if isinstance(index.size, int) else None
                if span is None:
                    continue  # a dynamic-size slice: not checked
                if span == 0:
                    continue
                interval = read(index.start)
                span = (span - 1) * index.stride + 1
                if span == size and interval == (0, 0):
                    continue  # the whole dimension
            else:
                interval, span = read(index), 1
            if empty(interval):
                continue  # code no run reaches (a loop of no trips)
            self.out.append(Access(eqn.primitive.name, name, dim, int(size), interval,
                                   int(span), where))

    # -- propagation ----------------------------------------------------------------------
    def _eqn(self, eqn, ins, read, names, defs, env) -> list[Interval]:
        p, n = eqn.primitive.name, len(eqn.outvars)
        if p in ("cond",):
            return self._cond(eqn, ins, names, defs, env)
        if len(ins) == 3 and (p == "select_n" or p in ("pjit", "jit")
                              and eqn.params.get("name") == "_where"):
            # select_n(pred, if_false, if_true), or jnp.where(pred, if_true, if_false) (its
            # jit: the predicate's definition is out here)
            cases = [2, 1] if p != "select_n" else [1, 2]
            return [self._select(eqn.invars[0], [(ins[k], eqn.invars[k]) for k in cases],
                                 defs, env)]
        if p == "scan":
            return self._scan(eqn, ins, names)
        if p == "while":
            return self._while(eqn, ins, names)
        jaxpr = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
        if p in ("pjit", "jit", "custom_jvp_call", "custom_vjp_call", "closed_call",
                 "run_scoped", "remat") and jaxpr is not None:
            name = eqn.params.get("name", "")
            if name in ("floor_divide", "remainder") and len(ins) == 2:
                # jnp's // and % (their jaxprs adjust signs; the results are these)
                return [floordiv(*ins) if name == "floor_divide" else mod(*ins)]
            closed = jaxpr if isinstance(jaxpr, core.ClosedJaxpr) else None
            body = closed.jaxpr if closed else jaxpr
            consts = [const(c) if np.ndim(c) == 0 or isinstance(c, np.ndarray) else TOP
                      for c in (closed.consts if closed else ())]
            sub_names = {v: names[x] for v, x in zip(body.invars, eqn.invars)
                         if isinstance(x, core.Var) and x in names}
            outs = self.run(body, ins + [TOP] * (len(body.invars) - len(ins)), sub_names,
                            consts)
            return (outs + [TOP] * n)[:n]
        if n != 1:
            for sub in core.jaxprs_in_params(eqn.params):  # unknown: still check its indices
                self.run(sub, [TOP] * len(sub.invars), {})
            return [TOP] * n
        return [scalar(p, eqn, ins)]

    # -- control flow ---------------------------------------------------------------------
    def _cond(self, eqn, ins, names, defs, env) -> list[Interval]:
        branches = eqn.params["branches"]
        index, operands = ins[0], ins[1:]
        refined = [None] * len(branches)
        if len(branches) == 2:
            for truth in (0, 1):
                refined[truth] = _refine(eqn.invars[0], bool(truth), defs, env)
        outs = None
        for i, branch in enumerate(branches):
            if index[0] is not None and index == (index[0], index[0]) \
                    and min(max(index[0], 0), len(branches) - 1) != i:
                continue  # a static index takes one branch
            values = list(operands)
            if refined[i] is False:
                continue  # the predicate cannot be this branch's
            if refined[i]:
                known = _Reeval(refined[i], defs, env)
                values = [known(x) if isinstance(x, core.Var) else v
                          for v, x in zip(values, eqn.invars[1:])]
                if any(empty(v) for v in values):
                    continue
            sub_names = {v: names[x] for v, x in zip(branch.jaxpr.invars, eqn.invars[1:])
                         if isinstance(x, core.Var) and x in names}
            result = self.run(branch.jaxpr, values, sub_names,
                              [const(c) for c in branch.consts])
            outs = result if outs is None else [join(a, b) for a, b in zip(outs, result)]
        return outs if outs is not None else [TOP] * len(eqn.outvars)

    @staticmethod
    def _select(pred, cases, defs, env) -> Interval:
        """The join of cases [(interval, var)] (pred false, then true), each where `pred`
        takes its value (`_refine`)."""
        out = None
        for truth, (case, x) in enumerate(cases):
            refined = _refine(pred, bool(truth), defs, env)
            if refined is False:
                continue  # the predicate cannot take this value
            if refined and isinstance(x, core.Var):
                case = meet(case, _Reeval(refined, defs, env)(x))
            out = case if out is None else join(out, case)
        return TOP if out is None else out

    def _scan(self, eqn, ins, names) -> list[Interval]:
        closed = eqn.params["jaxpr"]
        body = closed.jaxpr
        nc, nk, length = eqn.params["num_consts"], eqn.params["num_carry"], \
            eqn.params["length"]
        consts, carry, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
        if length == 0:
            return carry + [TOP] * (len(eqn.outvars) - nk)
        steps = _inductions(body, nc, nk)
        carry = [(add(c, (0, s * (length - 1))) if s > 0 else
                  add(c, (s * (length - 1), 0))) if s else c
                 for c, s in zip(carry, steps)]
        sub_names = {v: names[x] for v, x in zip(body.invars, eqn.invars)
                     if isinstance(x, core.Var) and x in names}
        carry = self._fixpoint(body, consts, carry, xs, steps, sub_names, closed.consts, nk)
        outs = self.run(body, consts + carry + xs, sub_names,
                        [const(c) for c in closed.consts])
        final = [(add(c, (s, s)) if s else o) for c, o, s in zip(carry, outs[:nk], steps)]
        return final + [TOP] * (len(eqn.outvars) - nk)

    def _fixpoint(self, body, consts, carry, xs, steps, names, closed_consts, nk):
        """Carry intervals that hold on every trip: the non-induction carries joined with
        the body's outputs until stable. After a few rounds, a carry still growing (a
        panel counted up over the trips) is unbounded and the rounds go on: the others
        (a slot that wraps around) may still settle, each carry widened at most once."""
        quiet = _Walker([])  # exploratory rounds record nothing
        for round_ in range(4 + nk):
            outs = quiet.run(body, consts + carry + xs, names,
                             [const(c) for c in closed_consts])[:nk]
            new = [c if s else join(c, o) for c, o, s in zip(carry, outs, steps)]
            if new == carry:
                return carry
            if round_ >= 3:  # widen the carries that grew this round
                new = [TOP if n != c else n for c, n in zip(carry, new)]
            carry = new
        return [c if s else TOP for c, s in zip(carry, steps)]

    def _while(self, eqn, ins, names) -> list[Interval]:
        p = eqn.params
        cond, body = p["cond_jaxpr"].jaxpr, p["body_jaxpr"].jaxpr
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cond_consts, body_consts, carry = ins[:nc], ins[nc:nc + nb], ins[nc + nb:]
        nk = len(carry)
        steps = _inductions(body, nb, nk)
        invariant = [o is i for o, i in zip(body.outvars, body.invars[nb:])]
        carry = list(carry)
        for k, s in enumerate(steps):  # a fori_loop: i < upper, i + 1
            if s == 1:
                upper = _upper_bound(cond, nc, k, cond_consts, carry, invariant)
                carry[k] = (carry[k][0], None if upper is None else upper - 1)
            elif s:
                carry[k] = TOP
        if any(empty(c) for c in carry):
            return [TOP] * nk  # no trips
        sub_names = {v: names[x] for v, x in zip(body.invars, eqn.invars[nc:])
                     if isinstance(x, core.Var) and x in names}
        carry = self._fixpoint(body, body_consts, carry, [], steps, sub_names,
                               p["body_jaxpr"].consts, nk)
        self.run(cond, cond_consts + carry, {}, [const(c) for c in p["cond_jaxpr"].consts])
        self.run(body, body_consts + carry, sub_names,
                 [const(c) for c in p["body_jaxpr"].consts])
        return [(c[0], None if c[1] is None else c[1] + 1) if s == 1 else c if s == 0
                else TOP for c, s in zip(carry, steps)]


class _Reeval:
    """The interval of a var recomputed from its defining scalar ops once some vars are
    known to lie in narrower intervals (`refined`): what a branch's predicate says about
    the values computed from the vars it compares (`t = local - start` given `start <=
    local < end`)."""

    def __init__(self, refined: dict, defs: dict, env: dict):
        self.refined, self.defs, self.env, self.memo = refined, defs, env, {}

    def __call__(self, x, depth: int = 0) -> Interval:
        if isinstance(x, core.Literal):
            return const(x.val)
        if x in self.memo:
            return self.memo[x]
        value = self.env.get(x, TOP)
        eqn = self.defs.get(x)
        if eqn is not None and depth < 16 and len(eqn.outvars) == 1:
            name = eqn.primitive.name
            ins = [self(y, depth + 1) for y in eqn.invars]
            if name in ("pjit", "jit") and eqn.params.get("name") in ("floor_divide",
                                                                        "remainder"):
                value = meet(value, floordiv(*ins) if eqn.params["name"] == "floor_divide"
                              else mod(*ins))
            elif name not in ("pjit", "jit", "cond", "scan", "while", "get", "swap"):
                value = meet(value, scalar(name, eqn, ins))
        value = meet(value, self.refined.get(x, TOP))
        self.memo[x] = value
        return value


def _inductions(body: core.Jaxpr, nconsts: int, ncarry: int) -> list[int]:
    """For each carry of a loop body: its step when the body returns it plus a literal
    (a loop counter), else 0."""
    defs = {v: e for e in body.eqns for v in e.outvars}
    steps = []
    for k in range(ncarry):
        out, inp = body.outvars[k], body.invars[nconsts + k]
        eqn = defs.get(out)
        step = 0
        if eqn is not None and eqn.primitive.name == "add":
            a, b = eqn.invars
            if a is inp and isinstance(b, core.Literal):
                step = int(b.val)
            elif b is inp and isinstance(a, core.Literal):
                step = int(a.val)
        steps.append(step)
    return steps


def _upper_bound(cond: core.Jaxpr, nconsts: int, k: int, consts, carry, invariant):
    """The bound `upper.hi` of a while loop whose cond is `carry[k] < upper` (upper a
    constant or a loop-invariant carry), else None."""
    if len(cond.eqns) < 1:
        return None
    out = cond.outvars[0]
    eqn = next((e for e in cond.eqns if out in e.outvars), None)
    if eqn is None or eqn.primitive.name != "lt" \
            or eqn.invars[0] is not cond.invars[nconsts + k]:
        return None
    upper = eqn.invars[1]
    if isinstance(upper, core.Literal):
        return const(upper.val)[1]
    if upper in cond.invars[:nconsts]:
        return consts[cond.invars.index(upper)][1]
    j = cond.invars.index(upper) - nconsts if upper in cond.invars else -1
    if j >= 0 and invariant[j]:
        return carry[j][1]
    return None


def _refine(pred, truth: bool, defs, env):
    """{var: interval} that holds where `pred` (a bool or its int32 index) is `truth`;
    False when it cannot be; None when nothing is known."""
    found: dict = {}

    def leaf(x):
        return const(x.val) if isinstance(x, core.Literal) else env.get(x, TOP)

    def bound(x, interval):  # x lies in interval; push it back through +/- literals
        if not isinstance(x, core.Var):
            return
        found[x] = meet(found.get(x, TOP), interval)
        eqn = defs.get(x)
        if eqn is None:
            return
        name = eqn.primitive.name
        if name in ("convert_element_type", "multiple_of"):
            bound(eqn.invars[0], interval)
        elif name in ("add", "sub") and isinstance(eqn.invars[1], core.Literal):
            c = int(eqn.invars[1].val) * (1 if name == "add" else -1)
            bound(eqn.invars[0], add(interval, (-c, -c)))
        elif name == "add" and isinstance(eqn.invars[0], core.Literal):
            c = int(eqn.invars[0].val)
            bound(eqn.invars[1], add(interval, (-c, -c)))

    def walk(x, want: bool) -> None:
        eqn = defs.get(x) if isinstance(x, core.Var) else None
        if eqn is None:
            return
        name = eqn.primitive.name
        if name == "convert_element_type":
            walk(eqn.invars[0], want)
        elif name == "not":
            walk(eqn.invars[0], not want)
        elif name == "and" and want or name == "or" and not want:
            for y in eqn.invars:
                walk(y, want)
        elif name in ("lt", "le", "gt", "ge"):
            a, b = eqn.invars
            if name in _FLIP:
                a, b, name = b, a, _FLIP[name]
            strict = (name == "lt") == want  # a < b, or (not) b <= a
            if not want:
                a, b = b, a  # not (a < b): b <= a; not (a <= b): b < a
            ia, ib = leaf(a), leaf(b)
            gap = 1 if strict else 0
            bound(a, (None, None if ib[1] is None else ib[1] - gap))
            bound(b, (None if ia[0] is None else ia[0] + gap, None))
        elif name == "eq" and want:
            a, b = eqn.invars
            bound(a, leaf(b))
            bound(b, leaf(a))
        elif name in ("eq", "ne") and want == (name == "ne"):  # a != constant c: an end
            for a, b in (eqn.invars, eqn.invars[::-1]):  # of a's interval at c moves in
                ia, (lo, hi) = leaf(a), leaf(b)
                if lo is not None and lo == hi and lo in ia:
                    bound(a, (None, lo - 1) if ia[1] == lo else (lo + 1, None))

    walk(pred, truth)
    for v, interval in found.items():
        lo, hi = meet(env.get(v, TOP), interval)
        if lo is not None and hi is not None and lo > hi:
            return False
    return found or None
