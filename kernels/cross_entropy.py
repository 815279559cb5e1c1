"""Cross-entropy over the last axis (the vocabulary) with integer labels.

Forward: one read of the logits, per-row results only. Each thread keeps its slice of
the row in registers (the CTAs of a cluster share a long row, as in softmax), or on a
streamed tiling (``RowTiling.group``: long rows) takes it a group of vectors at a time
with a running max, so that its registers hold one group and several CTAs share an SM;
the row max and the sum of exponentials travel together in one reduction round trip, with the sum of
the logits for label smoothing. One thread per row then reads the target logit from
global memory (just loaded, so it is in L2; with ``grad`` the thread that holds it in
registers takes it from there instead, see below) and writes the row's statistics
    shift = max (0 where the max is infinite),  logsum = log(sum(exp(x - shift)))
    loss  = logsum + (1 - smoothing) * (shift - x[label]) + smoothing * (shift - mean(x))
            + z_loss * lse**2,  lse = shift + logsum
with loss 0 for a row whose label is ``ignore_index`` and NaN for a label outside
[0, V). With a softcap, x is ``cap * tanh(logits / cap)`` throughout; with a temperature
T, everything above is of z = x / T (the kernels take 1 / T, ``inv_temperature``, and
scale the exponent: exp((x - max) / T) costs what exp(x - max) does). With ``entropy``
the row's softmax entropy ``H = lse - sum(p * z)`` is an output too: the sum of
``p * x`` travels in the same reduction round trip (its -inf logits count 0), and
``H = logsum - (sum(p * x) - max) / T``. With ``grad`` the
forward also writes the gradient of ``sum(w * loss)`` for per-row weights w (an input),
from the row still in registers, by the backward's formula below with
``a = w * (1 + 2 * z_loss * lse)``, ``b = w * (1 - smoothing)``, ``c = w * smoothing / V``.
That variant reads nothing of the row after its own registers, so the gradient may be
written over the logits (in place: the caller aliases the two buffers).

Backward: given the statistics, no reduction is left, so the kernel is elementwise: one
read of the logits and one write of their gradient. The caller folds the cotangents and
options into three per-row coefficients (a for the softmax, b for the one-hot, c for the
uniform smoothing term; all 0 on ignored rows, c NaN where an out-of-range label has a
cotangent):
    dx = (a * p + d * p * u - b * [j == label] - c) / T,  u = z - shift,  p = exp(u - logsum)
times ``1 - (x / cap)**2`` with a softcap; the term in d (the entropy's cotangent, with
``entropy``) is 0 where p is. A zero ``a`` drops the softmax term, so an ignored row's
gradient is 0 even where its logits are NaN. Column blocks of a long row go to separate
CTAs (no cluster); on a streamed tiling each thread takes its columns a group at a time.

The statistics are the pair (shift, logsum), not their sum lse: ``x - shift`` is exact
(shift is one of the row's logits) and logsum is small, so the softmax and the loss keep
their precision however large the logits are, where ``x - lse`` would lose the bits of
lse's rounding (a whole unit at 1e7).
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from quack_jax.cross_entropy import config as configs

from .rowwise import LN_2, LOG2_E, RowKernel, finite_or_zero_inf, per_row


class _CrossEntropy(RowKernel):
    def __init__(self, dtype, tiling, *, softcap=False):
        super().__init__(dtype, tiling)
        self.softcap = softcap

    def capped(self, x: cute.TensorSSA, cap) -> cute.TensorSSA:
        """``cap * tanh(x / cap)`` with a softcap, else x."""
        if const_expr(self.softcap):
            return cute.math.tanh(x * (1.0 / cap)) * cap
        return x

    @cute.jit
    def store_gradient(self, cta, x, label, stats, coefficients, inv_t, cap, out, pick=False):
        """Write ``(a * p + d * p * u - b * [j == label] - c) / T`` (times the softcap's
        derivative) for this thread's elements of x (softcapped logits), with
        ``u = x / T - shift``, ``p = exp(u - logsum)`` and ``coefficients`` (a, b, c, d),
        d None without the entropy term; a zero ``a`` drops the softmax term, and zero
        coefficients give a zero row. With ``pick``, returns whether this thread holds
        column ``label`` and x there if so (taken in the same pass over the elements,
        from registers)."""
        shift, logsum = stats
        a, b, c, d = (v if v is None else v * inv_t for v in coefficients)
        log2sum = logsum * LOG2_E
        frag = cute.make_rmem_tensor(x.shape, Float32)
        held, target = cutlass.Boolean(False), Float32(0.0)
        if const_expr(pick):
            # element by element, each logit read once and replaced by its gradient, so
            # that the logits and the gradients are never both live
            frag.store(x)
            for i in cutlass.range_constexpr(cute.size(frag)):
                hit = cta.col0 + cta.tXcX[i][1] == label
                held = held | hit
                target = cutlass.select_(hit, frag[i], target)
                u = frag[i] * inv_t - shift
                e = a * cute.math.exp2(u * LOG2_E - log2sum, fastmath=True)
                g = cutlass.select_(a == 0.0, Float32(0.0), e) - c
                frag[i] = cutlass.select_(hit, g - b, g)
        else:
            frag.fill(-c)
            u = x * inv_t - shift
            if const_expr(d is None):
                if a != 0.0:
                    frag.store(a * cute.math.exp2(u * LOG2_E - log2sum, fastmath=True) - c)
            else:  # element by element, u replaced by its gradient: one fragment live
                frag.store(u)
                for i in cutlass.range_constexpr(cute.size(frag)):
                    p = cute.math.exp2(frag[i] * LOG2_E - log2sum, fastmath=True)
                    g = cutlass.select_(p == 0.0, Float32(0.0), p * (a + d * frag[i]))
                    frag[i] = g - c
            for i in cutlass.range_constexpr(cute.size(frag)):
                hit = cta.col0 + cta.tXcX[i][1] == label
                frag[i] = cutlass.select_(hit, frag[i] - b, frag[i])
        if const_expr(self.softcap):
            frag.store(frag.load() * (1.0 - (x * (1.0 / cap)) * (x * (1.0 / cap))))
            dead = (a == 0.0) & (b == 0.0) & (c == 0.0)
            if const_expr(d is not None):
                dead = dead & (d == 0.0)
            if dead:  # a NaN logit must not leak in
                frag.fill(0.0)
        self.store(cta, frag.load(), out)
        return held, target


class CrossEntropyForward(_CrossEntropy):
    """With ``grad``, also the gradient of ``sum(w * loss)`` for per-row weights w given
    as an input (what "sum" and "mean" give the rows), written from the row still in
    registers: one read of the logits and one write of their gradient in all. With
    ``entropy`` (not with ``smoothing`` or ``grad``), also the rows' entropy."""

    scalars = configs.CrossEntropyForward.scalar_types()

    def __init__(self, dtype, tiling, *, smoothing=False, softcap=False, grad=False, entropy=False):
        assert not (entropy and (smoothing or grad))
        assert not (grad and tiling.group), "the gradient needs the whole row in registers"
        # max, sum of exp[, sum of x or of p * x]: one st.async
        self.words = 4 if smoothing or entropy else 2
        super().__init__(dtype, tiling, softcap=softcap)
        self.smoothing, self.grad, self.entropy = smoothing, grad, entropy

    def compile_args(self):
        stat = Float32, False
        row_weights = (self.pointer(*stat),) if self.grad else (None,)
        outputs = (self.pointer(*stat), self.pointer(*stat), self.pointer(*stat))
        outputs += (self.pointer(*stat),) if self.entropy else (None,)
        outputs += (self.pointer(self.dtype),) if self.grad else (None,)
        labels = self.pointer(Int32, False)
        return (self.pointer(self.dtype), labels, *row_weights, *outputs, *self.scalar_args())

    @cute.jit
    def row_values(self, cta, cap):
        """This thread's logits of ``cta`` as float32 (-inf past the end of the row),
        softcapped, and the reduction's second operand: the logits (0 outside the row)
        with ``smoothing``, the logits with -inf raised to the lowest finite float with
        ``entropy`` (whose p * x is then 0, not NaN), else None."""
        (x,) = self.load(cta, (-float("inf"),))
        if const_expr(self.softcap):
            x = self.fill_outside(cta, self.capped(x, cap), -float("inf"))
        t = None
        if const_expr(self.smoothing):
            t = self.fill_outside(cta, x)
        if const_expr(self.entropy):
            finite = cute.make_rmem_tensor(x.shape, Float32)
            finite.store(x)
            lowest = Float32(-3.4028234663852886e38)  # float32's lowest finite value
            for i in cutlass.range_constexpr(cute.size(finite)):
                finite[i] = cute.arch.fmax(finite[i], lowest)
            t = finite.load()
        return x, t

    def row_loss(
        self, ploss, m, row, stats, total, ignored, outside, target, label_smoothing, z_loss
    ):
        """Write the loss of ``row`` from its statistics, the target logit and the sum of its
        logits (both of z)."""
        n = self.tiling.n
        shift, logsum = stats
        lse = shift + logsum
        loss = logsum + (1.0 - label_smoothing) * (shift - target)
        loss = loss + cutlass.select_(z_loss == 0.0, Float32(0.0), z_loss * lse * lse)
        if const_expr(self.smoothing):
            loss = loss + label_smoothing * (shift - (1.0 / n) * total)
        loss = cutlass.select_(outside, Float32.nan, loss)
        per_row(ploss, m)[row] = cutlass.select_(ignored, Float32(0.0), loss)

    @cute.kernel
    def kernel(
        self,
        px,
        plabels,
        pw,
        ploss,
        pshift,
        plogsum,
        pentropy,
        pdx,
        m: Int32,
        ignore_index: Int32,
        label_smoothing,
        z_loss,
        logit_softcap,
        inv_temperature,
    ):
        n = self.tiling.n
        inv_t = inv_temperature
        first = 0 if const_expr(self.tiling.group) else None  # a streamed row's first step
        cta, reduction = self.setup(m, [px], [pdx] if const_expr(self.grad) else [], step=first)
        x = None
        if const_expr(self.tiling.group):

            def values(step):
                block = cute.arch.block_idx()[0]
                return self.row_values(self.view(m, block, [px], [], step=step), logit_softcap)

            with_t = self.smoothing or self.entropy
            row_max, row_sum, total = self.streamed_softmax(
                values, reduction, with_t, self.entropy, finite_or_zero_inf, inv_t
            )
        else:
            x, t = self.row_values(cta, logit_softcap)
            row_max, row_sum, _, total = self.row_softmax(
                x, reduction, t=t, t_times_e=self.entropy, shift=finite_or_zero_inf, scale=inv_t
            )
        top = finite_or_zero_inf(row_max)
        stats = top * inv_t, cute.math.log2(row_sum, fastmath=True) * LN_2
        lse = stats[0] + stats[1]
        label = Int32(ignore_index)
        if cta.in_rows:
            label = per_row(plabels, m)[cta.row]
        ignored, outside = label == ignore_index, (label < 0) | (label >= n)
        if const_expr(self.smoothing):
            total = total * inv_t
        row_loss = functools.partial(
            self.row_loss, ploss, m, cta.row, stats, total, ignored, outside
        )
        if const_expr(self.grad):
            for p, value in zip((pshift, plogsum), stats, strict=True):
                self.store_stat(cta, p, m, value)
        elif cta.in_rows and cta.first_col:
            col = cutlass.select_(outside, Int32(0), label)
            row = cute.make_tensor(
                cute.make_ptr(
                    self.dtype,
                    px.toint() + (cutlass.Int64(cta.row) * n + col) * (self.dtype.width // 8),
                    cute.AddressSpace.gmem,
                ),
                cute.make_layout(1),
            )
            target = Float32(row[0].to(Float32))
            if const_expr(self.softcap):
                target = cute.math.tanh(target * (1.0 / logit_softcap)) * logit_softcap
            row_loss(target * inv_t, label_smoothing, z_loss)
            for p, value in zip((pshift, plogsum), stats, strict=True):
                per_row(p, m)[cta.row] = value
            if const_expr(self.entropy):
                h = stats[1] - inv_t * (total * cute.arch.rcp_approx(row_sum) - top)
                per_row(pentropy, m)[cta.row] = h  # of every row, ignored ones too
        if const_expr(self.grad):
            w = self.load_stat(cta, pw, m)
            w = cutlass.select_(ignored, Float32(0.0), w)
            zterm = cutlass.select_(z_loss == 0.0, Float32(0.0), 2.0 * z_loss * lse)
            c = w * (label_smoothing * (1.0 / n))
            c = cutlass.select_(outside & (w != 0.0), Float32.nan, c)
            a = cutlass.select_(w == 0.0, Float32(0.0), w * (1.0 + zterm))  # lse may be NaN
            # the target logit comes from registers: other threads may have overwritten
            # the row in memory by now
            coefficients = (a, w * (1.0 - label_smoothing), c, None)
            held, target = self.store_gradient(
                cta, x, label, stats, coefficients, inv_t, logit_softcap, cta.destinations[0], True
            )
            if cta.in_rows and cutlass.select_(outside, cta.first_col, held):
                row_loss(target * inv_t, label_smoothing, z_loss)


class CrossEntropyBackward(_CrossEntropy):
    """With ``entropy``, also the entropy's term: a fourth coefficient d per row."""

    scalars = configs.CrossEntropyBackward.scalar_types()

    def __init__(self, dtype, tiling, *, softcap=False, entropy=False):
        super().__init__(dtype, tiling, softcap=softcap)
        self.entropy = entropy
        self.smem_bytes = 0  # no reduction

    def compile_args(self):
        stats = tuple(self.pointer(Float32, row=False) for _ in range(5))
        d = (self.pointer(Float32, row=False),) if self.entropy else (None,)
        labels = self.pointer(Int32, row=False)
        x, dx = self.pointer(self.dtype), self.pointer(self.dtype)
        return (x, labels, *stats, *d, dx, *self.scalar_args())

    def launch_args(self, m):
        return {**super().launch_args(m), "cluster": None}  # column blocks, no cluster

    @cute.kernel
    def kernel(
        self,
        px,
        plabels,
        pshift,
        plogsum,
        pa,
        pb,
        pc,
        pd,
        pdx,
        m: Int32,
        logit_softcap,
        inv_temperature,
    ):
        block = cute.arch.block_idx()[0]
        cta = self.view(m, block, [px], [pdx], step=0 if const_expr(self.tiling.group) else None)
        label = Int32(-1)
        shift, logsum, a, b, c = (Float32(0.0),) * 5
        d = Float32(0.0) if const_expr(self.entropy) else None
        if cta.in_rows:
            label = per_row(plabels, m)[cta.row]
            shift, logsum, a, b, c = (per_row(p, m)[cta.row] for p in (pshift, plogsum, pa, pb, pc))
            if const_expr(self.entropy):
                d = per_row(pd, m)[cta.row]
        row = (label, (shift, logsum), (a, b, c, d), inv_temperature, logit_softcap)
        if const_expr(self.tiling.group):  # streamed: a group of vectors a thread per step
            for step in cutlass.range(self.tiling.steps, unroll=1):
                self.gradient_of(self.view(m, block, [px], [pdx], step=step), *row)
        else:
            self.gradient_of(cta, *row)

    @cute.jit
    def gradient_of(self, cta, label, stats, coefficients, inv_t, cap):
        """Read this thread's logits of ``cta`` and write their gradient."""
        (x,) = self.load(cta, (0.0,))
        x = self.capped(x, cap)
        self.store_gradient(cta, x, label, stats, coefficients, inv_t, cap, cta.destinations[0])
