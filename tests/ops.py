"""One adapter per public op, for the properties that every op has (``test_contract.py``,
and the sharded ones in ``test_sharding.py``): how to draw its arguments for rows of a
given leading shape, row length and dtype; how to call it without its options and with
them; which arguments are per row and which are shared by the rows (a weight, a bias);
which are differentiable; its float64 reference (the op's test module's, here given the
same arguments); and its bad arguments with the error each raises, which names the
argument.

An op's arguments are a dict of arrays, its cotangents among them: ``results(op,
options)`` is the op's outputs and, through ``jax.vjp``, its gradients ("d" + the
argument's name), which ``op.reference`` gives in float64 with the magnitude of the
terms that make each element (what ``checks.assert_close`` judges its error against).
"""

import dataclasses
import functools
import inspect
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import test_cross_entropy
import test_linear_cross_entropy
import test_norm
import test_softmax
import test_token_logprobs
from checks import assert_close

import quack_jax

IGNORE = -100
SCALE = test_linear_cross_entropy.SCALE  # the cotangent of a "mean" loss: not 1
D = 16  # the hidden size of the linear ops' h


@dataclasses.dataclass(frozen=True)
class Want:
    """An expected result: its float64 value, the magnitude of its terms, its dtype, and
    the dtype whose tolerance applies (by default its own)."""

    value: np.ndarray
    mag: np.ndarray
    dtype: str
    tol: str | None = None


def _rng(key):
    return np.random.default_rng(np.asarray(jax.random.key_data(key)))


def _normal(rng, shape, dtype, scale=1.0, shift=0.0):
    x = shift + scale * np.asarray(rng.standard_normal(shape, np.float32))
    return np.asarray(x, np.float32).astype(jnp.dtype(dtype))


def _count(lead):
    """The number of rows of leading shape ``lead``."""
    return int(np.prod(lead, dtype=int))


def _loss_dtype(x):
    return "float64" if np.asarray(x).dtype == np.float64 else "float32"


class Op:
    """An op's adapter: see the module's docstring. ``rows`` name the per-row arguments
    (split by vmap, scan and shard_map), ``params`` those the rows share."""

    rows: tuple[str, ...] = ()
    params: tuple[str, ...] = ()
    # the row length of the properties' inputs
    n: ClassVar[dict[str, int]] = {"cpu": 40, "gpu": 1000}
    gpu_float64 = True  # whether float64 runs on the GPU (XLA's float64 GEMM does not)

    def __init__(self, name):
        self.name = name
        self.fn = getattr(quack_jax, name)

    def __repr__(self):
        return self.name

    def draw(self, lead, n, dtype, key) -> dict:
        """The arguments (numpy) for rows of shape ``lead`` and length ``n``."""
        raise NotImplementedError

    def forward(self, a, options) -> dict:
        """The op's outputs, by name."""
        raise NotImplementedError

    def grads(self, options) -> tuple[str, ...]:
        """The arguments differentiated."""
        raise NotImplementedError

    def cotangent(self, output, options) -> str | None:
        """The argument that is ``output``'s cotangent (None: SCALE)."""
        raise NotImplementedError

    def reference(self, a, options) -> dict[str, Want]:
        """float64 outputs and gradients of numpy arguments ``a``."""
        raise NotImplementedError

    def bad_arguments(self) -> dict:
        """Valid arguments, which each bad case changes."""
        raise NotImplementedError

    def bad(self) -> list[tuple[dict, type, str]]:
        """(change, error, message): the call with ``change`` raises ``error`` with
        "<op>: <message>", which begins with the argument's name."""
        raise NotImplementedError


def results(op, options, remat=False):
    """(arguments) -> the op's outputs and the gradients of ``op.grads(options)`` (named
    "d" + the argument) along the cotangents; with ``remat``, through jax.checkpoint."""

    def f(a):
        diff = {k: a[k] for k in op.grads(options)}

        def forward(diff):
            return op.forward({**a, **diff}, options)

        outs, pull = jax.vjp(jax.checkpoint(forward) if remat else forward, diff)
        cts = {}
        for k, out in outs.items():
            name = op.cotangent(k, options)
            cts[k] = jnp.full_like(out, SCALE) if name is None else a[name].astype(out.dtype)
        (grads,) = pull(cts)
        return {**outs, **{f"d{k}": g for k, g in grads.items()}}

    return f


def check(op, got, want, what):
    """The results ``got`` (a dict) against the reference's: the same names, shapes,
    dtypes, and values within tolerance (NaN and inf where the reference has them)."""
    got = jax.device_get(got)
    assert set(got) == set(want), (what, sorted(got), sorted(want))
    for k, w in want.items():
        g = np.asarray(got[k])
        where = f"{op.name} {k} {what}"
        assert g.shape == np.shape(w.value) and g.dtype == jnp.dtype(w.dtype), (
            where,
            g.shape,
            g.dtype,
            np.shape(w.value),
            w.dtype,
        )
        mag = np.broadcast_to(np.asarray(w.mag, np.float64), g.shape)
        assert_close(g, np.asarray(w.value, np.float64), mag, w.tol or w.dtype, where)


def reference_of_parts(op, a, options, parts, combine):
    """The reference of each part of the rows (``parts``: indices or slices of their
    leading axis; the shared arguments whole), combined: ``combine`` "stack" stacks every
    result (vmap), "scan" stacks the per-row ones and sums the others (the shared
    arguments' gradients and scalar losses), "concat" joins the per-row ones and sums the
    others (rows split over devices)."""
    refs = []
    for part in parts:
        piece = {k: (v[part] if k in op.rows else v) for k, v in a.items()}
        refs.append(op.reference(piece, options))
    out = {}
    for k, w in refs[0].items():
        values, mags = [r[k].value for r in refs], [r[k].mag for r in refs]
        mags = [np.broadcast_to(m, np.shape(v)) for m, v in zip(mags, values, strict=True)]
        summed = k in {f"d{p}" for p in op.params} or np.ndim(w.value) == 0
        if combine == "stack" or (combine == "scan" and not summed):
            value, mag = np.stack(values), np.stack(mags)
        elif summed:
            value, mag = np.sum(values, axis=0), np.sum(mags, axis=0)
        else:
            value, mag = np.concatenate(values), np.concatenate(mags)
        out[k] = Want(value, mag, w.dtype, w.tol)
    return out


def as_device(a):
    return {k: jnp.asarray(v) for k, v in a.items()}


def structs(a):
    return {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) for k, v in a.items()}


# -- softmax, log_softmax ---------------------------------------------------------------------


class Softmax(Op):
    """Options: ``where``, a mask with its first row masked whole."""

    rows = ("x", "dy", "where")
    n: ClassVar[dict[str, int]] = {"cpu": 40, "gpu": 1024}

    def draw(self, lead, n, dtype, key):
        rng = _rng(key)
        shape = (*lead, n)
        where = rng.random(shape) > 0.2
        if _count(lead) > 1:  # a row masked whole
            where.reshape(-1, n)[0] = False
        return dict(x=_normal(rng, shape, dtype, 3.0), dy=_normal(rng, shape, dtype), where=where)

    def forward(self, a, options):
        return {"y": self.fn(a["x"], where=a["where"] if options else None)}

    def grads(self, options):
        return ("x",)

    def cotangent(self, output, options):
        return "dy"

    def reference(self, a, options):
        x, dy, where = a["x"], a["dy"], a["where"]
        if options:
            x = np.where(where, x, -np.inf).astype(x.dtype)
            dy = np.where(where, dy, 0).astype(dy.dtype)
            ref = test_softmax.masked(where, test_softmax.reference_vjp(x, dy))
        else:
            ref = test_softmax.reference_vjp(x, dy)
        y, y_mag, d, d_mag = ref[self.name]
        dtype = x.dtype.name
        return {"y": Want(y, y_mag, dtype), "dx": Want(d, d_mag, dtype)}

    def bad_arguments(self):
        return {"x": jnp.ones((2, 3))}

    def bad(self):
        axis_types = "axis must be an int, a tuple of ints or None, got float"
        return [
            (dict(x=[1.0, 2.0]), TypeError, "x must be an array"),
            (dict(x="abc"), TypeError, "x must be an array"),
            (dict(x=np.arange(4)), TypeError, "x must have a floating dtype"),
            (dict(x=jnp.ones(4, jnp.int32)), TypeError, "x must have a floating dtype"),
            (dict(x=jnp.ones(4, jnp.complex64)), TypeError, "x must have a floating dtype"),
            (dict(x=jnp.ones(4, bool)), TypeError, "x must have a floating dtype"),
            (dict(x=jnp.float32(1.0)), ValueError, "x must have at least one dimension"),
            (dict(axis=2), ValueError, "axis 2 is out of range"),
            (dict(axis=-3), ValueError, "axis -3 is out of range"),
            (dict(axis=1.0), TypeError, axis_types),
            (dict(axis=(0, 1.0)), TypeError, axis_types),
            (dict(axis=(0, 2)), ValueError, "axis 2 is out of range"),
            (dict(axis=(1, -1)), ValueError, "axis must name each axis once"),
            (dict(axis=()), ValueError, "axis must name each axis once, and at least one"),
            (
                dict(where=jnp.ones((3, 3), bool)),
                ValueError,
                "where must broadcast to x's shape (2, 3)",
            ),
            (
                dict(where=jnp.ones((2, 3), jnp.int32)),
                TypeError,
                "where must be a boolean array, got dtype",
            ),
            (dict(where=[True, False, True]), TypeError, "where must be a boolean array, got list"),
        ]


# -- rms_norm, layer_norm ----------------------------------------------------------------------

NORM_OPTIONS = dict(prenorm=True, weight_offset=0.5, eps=1e-3)


class Norm(Op):
    """Options: a residual, prenorm (h is returned), weight_offset and eps."""

    rows = ("x", "residual", "dy", "dh")
    n: ClassVar[dict[str, int]] = {"cpu": 64, "gpu": 1000}

    def __init__(self, name):
        super().__init__(name)
        self.params = ("weight",) if name == "rms_norm" else ("weight", "bias")
        self.eps = inspect.signature(self.fn).parameters["eps"].default

    def draw(self, lead, n, dtype, key):
        rng = _rng(key)
        shape = (*lead, n)
        a = dict(
            x=_normal(rng, shape, dtype, 2.0, 0.5),
            weight=_normal(rng, (n,), dtype, 0.2, 1.0),
            residual=_normal(rng, shape, dtype),
            dy=_normal(rng, shape, dtype),
            dh=_normal(rng, shape, dtype),
        )
        if "bias" in self.params:
            a["bias"] = _normal(rng, (n,), dtype, 0.5)
        return a

    def forward(self, a, options):
        params = [a[p] for p in self.params]
        if not options:
            return {"y": self.fn(a["x"], *params)}
        y, h = self.fn(a["x"], *params, residual=a["residual"], **NORM_OPTIONS)
        return {"y": y, "h": h}

    def grads(self, options):
        return ("x", *self.params, *(("residual",) if options else ()))

    def cotangent(self, output, options):
        return {"y": "dy", "h": "dh"}[output]

    def reference(self, a, options):
        x, w, b, dtype = a["x"], a["weight"], a.get("bias"), a["x"].dtype.name
        if options:
            h = test_norm.np_h(x, a["residual"])
            eps, offset, dh = NORM_OPTIONS["eps"], NORM_OPTIONS["weight_offset"], a["dh"]
        else:
            h, eps, offset, dh = x, self.eps, 0.0, None
        ref = test_norm.reference(self.name, h, w, b, a["dy"], dh, eps=eps, offset=offset)
        out = {"y": Want(*ref["y"], dtype), "dx": Want(*ref["dx"], dtype)}
        out["dweight"] = Want(*ref["dweight"], w.dtype.name)
        if b is not None:
            out["dbias"] = Want(*ref["dbias"], b.dtype.name)
        if options:
            out["h"] = Want(h, 0.0, dtype)  # equal, but for subnormals
            out["dresidual"] = out["dx"]
        return out

    def bad_arguments(self):
        return {"x": jnp.ones((4, 8), jnp.bfloat16)}

    def bad(self):
        x = jnp.ones((4, 8), jnp.bfloat16)
        cases = [
            (dict(weight=jnp.ones((7,), jnp.bfloat16)), ValueError, "weight must have shape (8,)"),
            (
                dict(weight=jnp.ones((4, 8), jnp.bfloat16)),
                ValueError,
                "weight must have shape (8,)",
            ),
            (dict(weight=jnp.ones((8,), jnp.int32)), TypeError, "weight must have a floating"),
            (
                dict(weight=jnp.ones((8,), jnp.float16)),
                TypeError,
                "weight must be float32 or x's dtype",
            ),
            (dict(weight=[1.0] * 8), TypeError, "weight must be an array"),
            (
                dict(residual=jnp.ones((4, 7), jnp.bfloat16)),
                ValueError,
                "residual must have x's shape",
            ),
            (
                dict(residual=jnp.ones((8,), jnp.bfloat16)),
                ValueError,
                "residual must have x's shape",
            ),
            (
                dict(residual=jnp.ones((4, 8), jnp.float32)),
                TypeError,
                "residual must have x's dtype",
            ),
            (dict(eps=0.0), ValueError, "eps must be positive and finite"),
            (dict(eps=-1e-5), ValueError, "eps must be positive and finite"),
            (dict(eps=float("nan")), ValueError, "eps must be positive and finite"),
            (dict(eps=float("inf")), ValueError, "eps must be positive and finite"),
            (dict(eps=jnp.float32(1e-5)), TypeError, "eps must be a Python float"),
            (dict(eps=True), TypeError, "eps must be a Python float"),
            (dict(eps="1e-5"), TypeError, "eps must be a Python float"),
            (dict(weight_offset=1.0), ValueError, "weight_offset=1.0 needs a weight"),
            (
                dict(weight=x[0], weight_offset=float("nan")),
                ValueError,
                "weight_offset must be finite",
            ),
            (
                dict(weight=x[0], weight_offset=jnp.float32(1.0)),
                TypeError,
                "weight_offset must be a",
            ),
            (dict(prenorm=1), TypeError, "prenorm must be a bool"),
            (dict(prenorm=jnp.bool_(True)), TypeError, "prenorm must be a bool"),
            (dict(out_dtype=jnp.int32), TypeError, "out_dtype must be float32, bfloat16"),
            (dict(out_dtype="complex64"), TypeError, "out_dtype must be float32, bfloat16"),
            (dict(out_dtype="not a dtype"), TypeError, "out_dtype must be a dtype"),
            (dict(x=jnp.ones((4, 8), jnp.int32)), TypeError, "x must have a floating dtype"),
            (dict(x=np.ones((4, 8), np.int64)), TypeError, "x must have a floating dtype"),
            (dict(x=jnp.ones((4, 8), bool)), TypeError, "x must have a floating dtype"),
            (dict(x=jnp.float32(1.0)), ValueError, "x must have at least one dimension"),
            (dict(x=[[1.0, 2.0]]), TypeError, "x must be an array"),
        ]
        if self.name == "layer_norm":
            cases += [
                (dict(bias=jnp.ones((9,), jnp.bfloat16)), ValueError, "bias must have shape (8,)"),
                (
                    dict(bias=jnp.ones((8,), jnp.float16)),
                    TypeError,
                    "bias must be float32 or x's dtype",
                ),
                (dict(bias=jnp.ones((8,), jnp.int8)), TypeError, "bias must have a floating dtype"),
            ]
        return cases


# -- cross_entropy, token_logprobs ---------------------------------------------------------------


def _labels(rng, lead, n):
    """Labels in [0, n), and which rows are ignored (every fourth from the second: each
    split of the rows in two or more keeps one)."""
    labels = np.asarray(rng.integers(0, n, lead), np.int32)
    ignored = (np.arange(_count(lead)) % 4 == 1).reshape(lead)
    return labels, ignored


def _with_ignored(a):
    return jnp.where(a["ignored"], IGNORE, a["labels"])


def _flat(a, *names):
    """The arguments ``names`` with their rows in one axis (numpy)."""
    n = np.shape(a[names[0]])[-1]
    return [np.asarray(a[k]).reshape(-1, n) for k in names]


CE_OPTIONS = dict(label_smoothing=0.1, z_loss=1e-3, logit_softcap=20.0)


class CrossEntropy(Op):
    """Without options the mean loss (the rows ignored by the default ignore_index left
    out); with them per-row losses and lse, label smoothing, z-loss and a softcap."""

    rows = ("logits", "labels", "ignored", "g", "g_lse")

    def draw(self, lead, n, dtype, key):
        rng = _rng(key)
        labels, ignored = _labels(rng, lead, n)
        return dict(
            logits=_normal(rng, (*lead, n), dtype, 4.0),
            labels=labels,
            ignored=ignored,
            g=np.asarray(rng.standard_normal(lead), np.float32),
            g_lse=np.asarray(0.1 * rng.standard_normal(lead), np.float32),
        )

    def forward(self, a, options):
        labels = _with_ignored(a)
        if not options:
            return {"loss": self.fn(a["logits"], labels)}
        loss, lse = self.fn(a["logits"], labels, reduction="none", return_lse=True, **CE_OPTIONS)
        return {"loss": loss, "lse": lse}

    def grads(self, options):
        return ("logits",)

    def cotangent(self, output, options):
        return {"loss": "g" if options else None, "lse": "g_lse"}[output]

    def reference(self, a, options):
        lead, dtype, shape = np.shape(a["labels"]), a["logits"].dtype.name, a["logits"].shape
        (logits,) = _flat(a, "logits")
        labels = np.where(a["ignored"], IGNORE, a["labels"]).reshape(-1)
        loss_dtype = _loss_dtype(logits)
        if options:
            g, g_lse = (np.reshape(a[k], -1) for k in ("g", "g_lse"))
            loss, lse, grad, mag, row_mag = test_cross_entropy.reference(
                logits, labels, g, g_lse, CE_OPTIONS
            )
            return {
                "loss": Want(loss.reshape(lead), row_mag.reshape(lead), loss_dtype),
                "lse": Want(lse.reshape(lead), row_mag.reshape(lead), loss_dtype),
                "dlogits": Want(grad.reshape(shape), mag.reshape(shape), dtype),
            }
        kept = labels != IGNORE
        count = int(np.sum(kept))
        w = SCALE * kept / max(count, 1)
        opts = dict(label_smoothing=0.0, z_loss=0.0, logit_softcap=None)
        loss, _, grad, mag, row_mag = test_cross_entropy.reference(logits, labels, w, 0 * w, opts)
        with np.errstate(invalid="ignore"):
            mean = np.sum(loss) / count if count else np.nan
        return {
            "loss": Want(np.float64(mean), np.sum(row_mag) / max(count, 1), loss_dtype),
            "dlogits": Want(grad.reshape(shape), mag.reshape(shape), dtype),
        }

    def bad_arguments(self):
        return {"logits": jnp.zeros((4, 8)), "labels": jnp.zeros((4,), jnp.int32)}

    def bad(self):
        return [
            (
                dict(labels=jnp.zeros((4,), jnp.float32)),
                TypeError,
                "labels must have an integer dtype",
            ),
            (
                dict(labels=jnp.zeros((5,), jnp.int32)),
                ValueError,
                "labels must have the logits' leading shape",
            ),
            (dict(labels=[0, 1, 2, 3]), TypeError, "labels must be an integer array"),
            (
                dict(logits=jnp.zeros((4, 8), jnp.int32)),
                TypeError,
                "logits must have a floating dtype",
            ),
            (dict(reduction="avg"), ValueError, "reduction must be one of"),
            (dict(label_smoothing=1.0), ValueError, "label_smoothing must be in"),
            (dict(label_smoothing=-0.1), ValueError, "label_smoothing must be in"),
            (
                dict(label_smoothing=jnp.float32(0.1)),
                TypeError,
                "label_smoothing must be a Python float",
            ),
            (dict(z_loss=-1.0), ValueError, "z_loss must be"),
            (dict(logit_softcap=0.0), ValueError, "logit_softcap must be positive"),
            (
                dict(logit_softcap=-1.0),
                ValueError,
                "logit_softcap must be positive and finite, got",
            ),
            (
                dict(labels=jnp.zeros((4,), jnp.float16)),
                TypeError,
                "labels must have an integer dtype (any width)",
            ),
            (dict(logit_softcap=float("inf")), ValueError, "logit_softcap must be"),
            (dict(ignore_index=1.5), TypeError, "ignore_index must be a Python int"),
            (dict(ignore_index=2**40), ValueError, "ignore_index must fit in int32"),
            (dict(return_lse=1), TypeError, "return_lse must be a bool"),
            (dict(temperature=0.0), ValueError, "temperature must be positive"),
        ]


TL_OPTIONS = dict(temperature=0.7, logit_softcap=20.0)


class TokenLogprobs(Op):
    """Without options each row's log-probability of its label; with them the entropy
    too, ignored rows, a temperature and a softcap."""

    rows = ("logits", "labels", "ignored", "g_logp", "g_h")

    def draw(self, lead, n, dtype, key):
        rng = _rng(key)
        labels, ignored = _labels(rng, lead, n)
        return dict(
            logits=_normal(rng, (*lead, n), dtype, 4.0),
            labels=labels,
            ignored=ignored,
            g_logp=np.asarray(rng.standard_normal(lead), np.float32),
            g_h=np.asarray(rng.standard_normal(lead), np.float32),
        )

    def forward(self, a, options):
        if not options:
            return {"logp": self.fn(a["logits"], a["labels"])}
        logp, entropy = self.fn(
            a["logits"], _with_ignored(a), return_entropy=True, ignore_index=IGNORE, **TL_OPTIONS
        )
        return {"logp": logp, "entropy": entropy}

    def grads(self, options):
        return ("logits",)

    def cotangent(self, output, options):
        return {"logp": "g_logp", "entropy": "g_h"}[output]

    def reference(self, a, options):
        lead, dtype, shape = np.shape(a["labels"]), a["logits"].dtype.name, a["logits"].shape
        (logits,) = _flat(a, "logits")
        g_logp, g_h = (np.reshape(a[k], -1) for k in ("g_logp", "g_h"))
        if options:
            labels = np.where(a["ignored"], IGNORE, a["labels"]).reshape(-1)
            ref = test_token_logprobs.reference(logits, labels, g_logp, g_h, **TL_OPTIONS)
        else:
            labels = np.reshape(a["labels"], -1)
            ref = test_token_logprobs.reference(logits, labels, g_logp, 0 * g_h, 1.0, None, None)
        logp, entropy, grad, mag, mag_grad = ref
        loss_dtype = _loss_dtype(logits)
        out = {
            "logp": Want(logp.reshape(lead), mag.reshape(lead), loss_dtype),
            "dlogits": Want(grad.reshape(shape), mag_grad.reshape(shape), dtype),
        }
        if options:
            out["entropy"] = Want(entropy.reshape(lead), mag.reshape(lead), loss_dtype)
        return out

    def bad_arguments(self):
        return {"logits": jnp.zeros((3, 10)), "labels": jnp.zeros((3,), jnp.int32)}

    def bad(self):
        positive = "temperature must be positive and finite"
        return [
            (dict(temperature=0.0), ValueError, positive),
            (dict(temperature=-1.0), ValueError, positive),
            (dict(temperature=float("inf")), ValueError, positive),
            (dict(temperature=float("nan")), ValueError, positive),
            (dict(temperature=1e-40), ValueError, "temperature must be at least 3e-38"),
            (dict(temperature=jnp.float32(1.0)), TypeError, "temperature must be a Python float"),
            (dict(return_entropy=1), TypeError, "return_entropy must be a bool"),
            (dict(ignore_index=1.5), TypeError, "ignore_index must be a Python int"),
            (dict(logit_softcap=0.0), ValueError, "logit_softcap must be positive"),
            (
                dict(labels=jnp.zeros((2,), jnp.int32)),
                ValueError,
                "labels must have the logits' leading shape",
            ),
        ]


# -- linear_cross_entropy, linear_token_logprobs, linear_token_loss --------------------------------


def _precision(h):
    """The GPU's float32 GEMMs run TF32 by default: "highest" for h of float32 (or
    float64 with x64 off)."""
    return "highest" if jnp.result_type(h) == jnp.float32 else None


class Linear(Op):
    """The ops of ``h @ weight + bias``: h is (rows, D), the weight (D, n)."""

    params = ("weight", "bias")
    n: ClassVar[dict[str, int]] = {"cpu": 50, "gpu": 1000}
    gpu_float64 = False  # XLA's float64 GEMM fails on the H200 (cublasLt)

    def draw(self, lead, n, dtype, key):
        rng = _rng(key)
        labels, ignored = _labels(rng, lead, n)
        a = dict(
            h=_normal(rng, (*lead, D), dtype),
            weight=_normal(rng, (D, n), dtype, 2.0 / np.sqrt(D)),
            bias=_normal(rng, (n,), dtype, 0.5),
            labels=labels,
            ignored=ignored,
        )
        for k in self.rows[3:]:
            a[k] = np.asarray(rng.standard_normal(lead), np.float32)
        return a

    def grads(self, options):
        return ("h", "weight", *(("bias",) if options else ()))

    def grad_tol(self, h):
        """float64 gradients: the op's GEMMs and sums accumulate in float32."""
        return "float32" if np.dtype(h.dtype) == np.float64 else None

    def bad_arguments(self):
        return dict(
            h=np.ones((4, 8), np.float32),
            weight=np.ones((8, 30), np.float32),
            labels=np.zeros(4, np.int32),
            bias=np.ones(30, np.float32),
        )

    def bad(self):
        h, w, labels = (self.bad_arguments()[k] for k in ("h", "weight", "labels"))
        d_v = "weight must have shape (d, V) with d = 8"
        return [
            (dict(h=[[0.0] * 8] * 4), TypeError, "h must be an array"),
            (dict(h=h.astype(np.int32)), TypeError, "h must have a floating dtype"),
            (dict(weight=3.0), TypeError, "weight must be an array"),
            (dict(weight=w.astype(jnp.bfloat16)), TypeError, "weight must have h's dtype"),
            (
                dict(bias=np.ones(30, jnp.bfloat16)),
                TypeError,
                "bias must have the weight's dtype",
            ),
            (
                dict(labels=labels.astype(np.float32)),
                TypeError,
                "labels must have an integer dtype",
            ),
            (dict(chunk_size=2.5), TypeError, "chunk_size must be a positive int or None"),
            (dict(chunk_size=True), TypeError, "chunk_size must be a positive int or None"),
            (dict(weight=np.ones((9, 30), np.float32)), ValueError, d_v),
            (dict(weight=np.ones(8, np.float32)), ValueError, d_v),
            (dict(weight=w.T), ValueError, f"{d_v} (h's last axis); a (V, d) table needs"),
            (
                dict(transpose_weight=True),
                ValueError,
                "weight must have shape (V, d) with d = 8",
            ),
            (dict(bias=np.ones(31, np.float32)), ValueError, "bias must have shape (30,)"),
            (dict(bias=np.ones((1, 30), np.float32)), ValueError, "bias must have shape (30,)"),
            (
                dict(labels=np.zeros(5, np.int32)),
                ValueError,
                "labels must have the logits' leading shape",
            ),
            (dict(chunk_size=0), ValueError, "chunk_size must be positive"),
            (dict(chunk_size=-1), ValueError, "chunk_size must be positive"),
            (dict(logit_softcap=0.0), ValueError, "logit_softcap must be positive"),
            (dict(temperature=0.0), ValueError, "temperature must be positive and finite"),
            (dict(ignore_index=1.5), TypeError, "ignore_index must be a Python int"),
            (dict(precision="fastest"), ValueError, "precision must be None"),
            (
                dict(preferred_element_type=jnp.int32),
                TypeError,
                "preferred_element_type must be None or a floating dtype",
            ),
        ]


LCE_OPTIONS = dict(reduction="none", return_lse=True, chunk_size=4, **CE_OPTIONS)


class LinearCrossEntropy(Linear):
    """Without options the mean loss; with them a bias, per-row losses and lse in chunks
    of 4 rows, label smoothing, z-loss and a softcap."""

    rows = ("h", "labels", "ignored", "g", "g_lse")

    def forward(self, a, options):
        h, w, labels = a["h"], a["weight"], _with_ignored(a)
        if not options:
            return {"loss": self.fn(h, w, labels, precision=_precision(h))}
        loss, lse = self.fn(h, w, labels, bias=a["bias"], precision=_precision(h), **LCE_OPTIONS)
        return {"loss": loss, "lse": lse}

    def cotangent(self, output, options):
        return {"loss": "g" if options else None, "lse": "g_lse"}[output]

    def reference(self, a, options):
        h, w = a["h"], a["weight"]
        labels = np.where(a["ignored"], IGNORE, a["labels"])
        bias, opts = (a["bias"], LCE_OPTIONS) if options else (None, {})
        out, grads, mags = test_linear_cross_entropy.reference(
            h, w, bias, labels, a["g"], a["g_lse"], opts
        )
        loss_dtype, tol = _loss_dtype(h), self.grad_tol(h)
        loss, lse = out if options else (out, None)
        want = {"loss": Want(loss, mags["loss"], loss_dtype)}
        if options:
            want["lse"] = Want(lse, mags["lse"], loss_dtype)
        for k in self.grads(options):
            want[f"d{k}"] = Want(grads[k], mags[k], a[k].dtype.name, tol)
        return want

    def bad(self):
        return [
            *super().bad(),
            (dict(reduction="avg"), ValueError, "reduction must be one of"),
            (dict(label_smoothing=1.0), ValueError, "label_smoothing must be in"),
            (dict(z_loss=-0.1), ValueError, "z_loss must be >= 0.0"),
            (dict(return_lse=1), TypeError, "return_lse must be a bool"),
        ]


LTL_OPTIONS = dict(return_entropy=True, ignore_index=IGNORE, chunk_size=4, **TL_OPTIONS)


class LinearTokenLogprobs(Linear):
    """Without options each row's log-probability of its label; with them a bias, the
    entropy, ignored rows, chunks of 4 rows, a temperature and a softcap."""

    rows = ("h", "labels", "ignored", "g_logp", "g_h")

    def forward(self, a, options):
        h, w = a["h"], a["weight"]
        if not options:
            return {"logp": self.fn(h, w, a["labels"], precision=_precision(h))}
        logp, entropy = self.fn(
            h, w, _with_ignored(a), bias=a["bias"], precision=_precision(h), **LTL_OPTIONS
        )
        return {"logp": logp, "entropy": entropy}

    def cotangent(self, output, options):
        return {"logp": "g_logp", "entropy": "g_h"}[output]

    def reference(self, a, options):
        """token_logprobs' reference of the float64 logits; the gradients of h, the
        weight and the bias by the chain rule, each with its terms' magnitudes."""
        h, w = np.asarray(a["h"], np.float64), np.asarray(a["weight"], np.float64)
        h2 = h.reshape(-1, h.shape[-1])
        logits = h2 @ w + (np.asarray(a["bias"], np.float64) if options else 0.0)
        lead = np.shape(a["labels"])
        sub = dict(logits=logits.reshape(*lead, w.shape[-1]), **{k: a[k] for k in self.rows[1:]})
        ref = TOKEN_LOGPROBS.reference(sub, options)
        dz = ref.pop("dlogits")
        dz_value, dz_mag = (np.reshape(v, (-1, w.shape[-1])) for v in (dz.value, dz.mag))
        tol = self.grad_tol(a["h"])
        grads = {
            "h": (dz_value @ w.T, dz_mag @ np.abs(w).T),
            "weight": (h2.T @ dz_value, np.abs(h2).T @ dz_mag),
            "bias": (dz_value.sum(0), dz_mag.sum(0)),
        }
        for k in Linear.grads(self, options):
            value, mag = grads[k]
            shape = a[k].shape
            ref[f"d{k}"] = Want(value.reshape(shape), mag.reshape(shape), a[k].dtype.name, tol)
        for k in ("logp", "entropy"):
            if k in ref:
                ref[k] = dataclasses.replace(ref[k], dtype=_loss_dtype(a["h"]))
        return ref

    def bad(self):
        return [
            *super().bad(),
            (dict(return_entropy=1), TypeError, "return_entropy must be a bool"),
        ]


def _args_by_keyword(fn):
    """``fn(h, weight, labels, loss_fn, *args, **options)`` called with ``args=`` (a
    tuple) as a keyword, as the contract calls every op; its signature is ``fn``'s."""

    @functools.wraps(fn)
    def call(h, weight, labels, loss_fn=None, args=(), **options):
        return fn(h, weight, labels, loss_fn, *args, **options)

    return call


def _weighted(logp, entropy, a, b):
    """A token loss whose gradients are linear_token_logprobs' for cotangents a and b."""
    return a * logp + b * entropy


def _weighted_logp(logp, entropy, a):
    return a * logp


LTLOSS_OPTIONS = {k: v for k, v in LTL_OPTIONS.items() if k != "return_entropy"}


class LinearTokenLoss(LinearTokenLogprobs):
    """The sum of ``g_logp * logp`` (without options) and ``+ g_h * entropy`` (with
    them, and a bias, ignored rows, chunks of 4 rows, a temperature and a softcap), whose
    gradients by h, the weight and the bias are linear_token_logprobs' for those
    cotangents (times SCALE), and by g_logp and g_h are logp and the entropy."""

    def __init__(self, name):
        super().__init__(name)
        self.fn = _args_by_keyword(self.fn)

    def forward(self, a, options):
        h, w = a["h"], a["weight"]
        precision = _precision(h)
        if not options:
            loss = self.fn(h, w, a["labels"], _weighted_logp, (a["g_logp"],), precision=precision)
        else:
            args = (a["g_logp"], a["g_h"])
            loss = self.fn(
                h,
                w,
                _with_ignored(a),
                _weighted,
                args,
                bias=a["bias"],
                precision=precision,
                **LTLOSS_OPTIONS,
            )
        return {"loss": loss}

    def grads(self, options):
        return (*super().grads(options), "g_logp", *(("g_h",) if options else ()))

    def cotangent(self, output, options):
        return None

    def reference(self, a, options):
        scaled = dict(a, g_logp=SCALE * a["g_logp"], g_h=SCALE * a["g_h"] * options)
        ref = super().reference(scaled, options)
        logp, entropy = ref.pop("logp"), ref.pop("entropy", None)
        g = {k: np.asarray(a[k], np.float64) for k in ("g_logp", "g_h")}
        value, mag = np.sum(g["g_logp"] * logp.value), np.sum(np.abs(g["g_logp"]) * logp.mag)
        if options:
            value = value + np.sum(g["g_h"] * entropy.value)
            mag = mag + np.sum(np.abs(g["g_h"]) * entropy.mag)
        ref["loss"] = Want(value, mag, logp.dtype)
        dtype = a["g_logp"].dtype.name
        ref["dg_logp"] = Want(SCALE * logp.value, SCALE * logp.mag, dtype)
        if options:
            ref["dg_h"] = Want(SCALE * entropy.value, SCALE * entropy.mag, dtype)
        return ref

    def bad_arguments(self):
        return dict(super().bad_arguments(), loss_fn=_weighted_logp, args=(np.ones(4, np.float32),))

    def bad(self):
        inherited = [case for case in super().bad() if "return_entropy" not in case[0]]
        one = np.ones(4, np.float32)
        return [
            *inherited,
            (dict(loss_fn=3), TypeError, "loss_fn must be callable, got int"),
            (
                dict(loss_fn=lambda logp, entropy, a: jnp.stack([a, logp])),
                TypeError,
                "loss_fn(logp, entropy, *args) must return a float scalar for one token, "
                "got shape (2,), float32",
            ),
            (
                dict(loss_fn=lambda logp, entropy, a: a > logp),
                TypeError,
                "loss_fn(logp, entropy, *args) must return a float scalar for one token, "
                "got shape (), bool",
            ),
            (
                dict(args=(np.ones(5, np.float32),)),
                ValueError,
                "args[0] must have labels' shape (4,) (one value per token), got (5,)",
            ),
            (dict(args=([1.0] * 4,)), TypeError, "args[0] must be an array of labels' shape"),
            (
                dict(args=(one, one)),
                TypeError,
                "loss_fn(logp, entropy, *args) failed on one token's scalars, with 2 "
                "per-token argument(s): TypeError: _weighted_logp() takes 3 positional",
            ),
        ]


TOKEN_LOGPROBS = TokenLogprobs("token_logprobs")
OPS = [
    Softmax("softmax"),
    Softmax("log_softmax"),
    Norm("rms_norm"),
    Norm("layer_norm"),
    CrossEntropy("cross_entropy"),
    TOKEN_LOGPROBS,
    LinearCrossEntropy("linear_cross_entropy"),
    LinearTokenLogprobs("linear_token_logprobs"),
    LinearTokenLoss("linear_token_loss"),
]
