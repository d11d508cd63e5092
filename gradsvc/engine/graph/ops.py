"""The op allow-list for graph models: which ATen overloads a graph may call, how each one's arguments
are checked (its own torch schema) and what runs in its place (zero-filled `empty*`, no-op asserts).

Every entry is a name as `torch.export` prints it ("aten.linear.default") or one of the few Python
operators export emits on sizes ("operator.mul"). Nothing here touches the host: no op with a file
name, a pointer or a storage, no printing, and no op returning uninitialised memory (the `empty*`
family runs as its `zeros*` twin). In-place ops run on intermediates, or on buffers (running
statistics) under no_grad; on a parameter or an input they are refused.

A graph means what its program says on any device and kernel: `view`, `_unsafe_view` and `view_as` run as
`reshape` (a view wherever the input's layout allows one), because the layout a kernel returned at
capture (which made a `.contiguous()` a no-op there) is not the worker's. Random ops draw from the
job's seed (devices.seeded), as dropout does. Every op of PyTorch's core ATen opset that has a
derivative formula is allowed except REFUSED_CORE (docs/graph-ops.md says why for each).
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable

import torch

aten = torch.ops.aten

# Argument types, as small tuples: ("tensor",) ("int",) ("float",) ("bool",) ("number",) ("str",)
# ("dtype",) ("layout",) ("memory_format",) ("device",) ("optional", T) ("list", T) ("any",).
ArgType = tuple


@dataclass(frozen=True)
class Param:
    name: str
    type: ArgType
    kwarg_only: bool
    has_default: bool
    is_write: bool = False  # the op writes this argument in place (Tensor(a!))
    default: Any = None


@dataclass(frozen=True)
class Op:
    """One allowed op: `fn` runs it, `params` check its arguments, `returns` is what a node holds
    ("tensor", "tensors", "scalar" or "none"), `aliases_input` whether the result is a view of (or the
    same tensor as) its first argument."""

    name: str
    fn: Callable
    params: tuple[Param, ...]
    returns: str
    aliases_input: bool = False
    inplace: bool = False  # writes its first argument
    is_assert: bool = False  # a metadata check: skipped (dtypes change from the graph's when run in float64)
    along_dim: bool = False  # combines values along its `dim`/`dims` argument (the batch-mixing check)
    reshapes: bool = False  # reinterprets the row-major order (view/reshape/flatten)
    recurrent: bool = False  # runs each row of its batch dim on its own, combining time steps (gru, lstm, rnn)
    n_outputs: int | None = None  # a multi-output op's fixed count (None: a list of any length)
    random: bool = False  # draws random numbers (besides dropout's masks): replayed from the job's seed


_SPECIAL = re.compile(r"(ScalarType|Layout|MemoryFormat)\??(?:\[\])? (\w+)")


def _arg_type(t: Any, special: str | None) -> ArgType:
    kind = t.kind()
    if kind == "OptionalType":
        return ("optional", _arg_type(t.getElementType(), special))
    if kind == "ListType":
        return ("list", _arg_type(t.getElementType(), special))
    if special is not None and kind == "IntType":
        return ({"ScalarType": "dtype", "Layout": "layout", "MemoryFormat": "memory_format"}[special],)
    simple = {"TensorType": "tensor", "IntType": "int", "SymIntType": "int", "FloatType": "float",
              "BoolType": "bool", "SymBoolType": "bool", "NumberType": "number", "StringType": "str",
              "DeviceObjType": "device", "GeneratorType": "generator"}  # a generator: only None (the job's seed)
    if kind not in simple:
        raise TypeError(f"argument type {t} is not allowed in a graph")
    return (simple[kind],)


def _returns(schema: Any) -> str:
    rets = schema.returns
    if not rets:
        return "none"
    if len(rets) > 1 or rets[0].type.kind() == "ListType":
        return "tensors"
    return "tensor" if rets[0].type.kind() in ("TensorType", "OptionalType") else "scalar"


# Arguments an op may write besides its first: batch norm's running statistics (the compiler checks that
# they are buffers).
_STAT_ARGS = frozenset({"running_mean", "running_var"})


def _from_schema(name: str, overload: Any, fn: Callable | None = None, **flags: Any) -> Op:
    schema = overload._schema
    special = {arg: kind for kind, arg in _SPECIAL.findall(str(schema))}
    params = tuple(Param(a.name, _arg_type(a.type, special.get(a.name)), a.kwarg_only, a.has_default_value(),
                         bool(a.alias_info is not None and a.alias_info.is_write),
                         a.default_value if a.has_default_value() else None) for a in schema.arguments)
    aliases = bool(schema.returns and schema.returns[0].alias_info is not None)
    inplace = bool(params and params[0].is_write)
    if any(p.is_write and p.name not in _STAT_ARGS for p in params[1:]):
        raise TypeError(f"{name} writes an argument other than its first")
    n_outputs = len(schema.returns) if len(schema.returns) > 1 else None
    return Op(name, fn or overload, params, _returns(schema), aliases_input=aliases, inplace=inplace,
              n_outputs=n_outputs, **flags)


# ---- The table ----------------------------------------------------------------------------------
# "name.overload" under torch.ops.aten; grouped by what they do. An entry missing from the running
# torch is skipped (the project pins 2.13; tests/engine/test_graph.py checks that every entry resolves).

_MATMUL = """linear.default addmm.default mm.default bmm.default matmul.default baddbmm.default addmv.default
mv.default dot.default outer.default einsum.default"""
_CONV = """conv1d.default conv2d.default conv3d.default convolution.default conv_transpose1d.default
conv_transpose2d.input conv_transpose3d.input conv1d.padding conv2d.padding conv3d.padding"""
_NORM = """batch_norm.default layer_norm.default group_norm.default instance_norm.default rms_norm.default
native_layer_norm.default native_group_norm.default native_batch_norm.default
_native_batch_norm_legit_no_training.default _native_batch_norm_legit.default _native_batch_norm_legit.no_stats"""
_ATTENTION = "scaled_dot_product_attention.default embedding.default"
_ACTIVATIONS = """relu.default relu_.default gelu.default gelu_.default silu.default silu_.default
sigmoid.default sigmoid_.default tanh.default tanh_.default elu.default elu_.default leaky_relu.default
leaky_relu_.default hardtanh.default hardtanh_.default hardswish.default hardswish_.default
hardsigmoid.default mish.default softplus.default celu.default selu.default prelu.default glu.default
log_sigmoid.default logit.default acosh.default asinh.default atanh.default"""
_ELEMENTWISE = """add.Tensor add.Scalar add_.Tensor add_.Scalar sub.Tensor sub.Scalar sub_.Tensor rsub.Scalar
rsub.Tensor mul.Tensor mul.Scalar mul_.Tensor mul_.Scalar div.Tensor div.Scalar div.Tensor_mode div_.Tensor
div_.Scalar neg.default abs.default exp.default exp2.default log.default log2.default log10.default
log1p.default expm1.default sqrt.default rsqrt.default square.default pow.Tensor_Scalar pow.Tensor_Tensor
pow.Scalar reciprocal.default sin.default cos.default tan.default asin.default acos.default atan.default
atan2.default sinh.default cosh.default erf.default erfc.default erfinv.default clamp.default clamp.Tensor
clamp_.default clamp_min.default clamp_max.default clamp_min.Tensor clamp_max.Tensor minimum.default maximum.default min.other max.other sign.default
sgn.default floor.default ceil.default round.default round.decimals trunc.default frac.default
fmod.Tensor fmod.Scalar remainder.Tensor remainder.Scalar floor_divide.default lerp.Scalar lerp.Tensor
addcmul.default addcdiv.default where.self where.ScalarOther where.ScalarSelf where.Scalar nan_to_num.default
eq.Tensor eq.Scalar ne.Tensor ne.Scalar lt.Tensor lt.Scalar le.Tensor le.Scalar gt.Tensor gt.Scalar
ge.Tensor ge.Scalar logical_not.default logical_and.default logical_or.default logical_xor.default
__and__.Tensor __or__.Tensor __xor__.Tensor bitwise_not.default bitwise_and.Tensor bitwise_or.Tensor
isnan.default isinf.default isfinite.default masked_fill.Scalar masked_fill.Tensor masked_fill_.Scalar
masked_fill_.Tensor fill_.Scalar fill_.Tensor fill.Scalar zero_.default copy_.default logaddexp.default
hypot.default bitwise_and.Scalar bitwise_or.Scalar bitwise_xor.Tensor bitwise_xor.Scalar div.Scalar_mode
copy.default masked_scatter.default cosine_similarity.default _cdist_forward.default _pdist_forward.default"""
_REDUCTIONS = """sum.dim_IntList sum.default mean.dim mean.default amax.default amin.default max.dim min.dim
max.default min.default argmax.default argmin.default var.correction var.dim var.default std.correction std.dim
std.default var_mean.correction std_mean.correction var_mean.dim std_mean.dim var_mean.default std_mean.default
prod.default prod.dim_int logsumexp.default norm.ScalarOpt_dim
norm.Scalar linalg_vector_norm.default cumsum.default cumprod.default any.dim any.default all.dim
all.default softmax.int log_softmax.int _softmax.default _log_softmax.default sort.default topk.default
diff.default any.dims"""
_INDEXING = """cat.default stack.default split.Tensor split_with_sizes.default chunk.default unbind.int
slice.Tensor select.int index.Tensor index_select.default gather.default narrow.default
take_along_dim.default scatter.src scatter.value scatter_add.default flip.default roll.default
tril.default triu.default repeat.default repeat_interleave.self_int tile.default constant_pad_nd.default
pad.default meshgrid.default meshgrid.indexing index_put.default index_put_.default slice_scatter.default
select_scatter.default index_add.default unfold.default scatter_reduce.two diag.default diag_embed.default
_embedding_bag.default grid_sampler_2d.default col2im.default reflection_pad1d.default reflection_pad2d.default
reflection_pad3d.default replication_pad1d.default replication_pad2d.default replication_pad3d.default"""
_VIEWS = """view.default reshape.default _unsafe_view.default flatten.using_ints unflatten.int view_as.default
reshape_as.default"""
_LAYOUT = """permute.default transpose.int t.default numpy_T.default mT.default expand.default expand_as.default squeeze.dim squeeze.dims
squeeze.default unsqueeze.default contiguous.default clone.default alias.default detach.default
detach_.default lift_fresh_copy.default movedim.int movedim.intlist diagonal.default
broadcast_tensors.default"""
# Complex values (rotary embeddings, spectral layers): views between a real (..., 2) and a complex tensor.
_COMPLEX = """view_as_complex.default view_as_real.default polar.default complex.default real.default imag.default
angle.default conj.default conj_physical.default _conj.default _fft_r2c.default _fft_c2r.default
_fft_c2c.default"""
_POOLING = """max_pool1d.default max_pool2d.default max_pool3d.default max_pool1d_with_indices.default
max_pool2d_with_indices.default max_pool3d_with_indices.default avg_pool1d.default avg_pool2d.default
avg_pool3d.default adaptive_avg_pool1d.default
adaptive_avg_pool2d.default adaptive_avg_pool3d.default adaptive_max_pool1d.default
adaptive_max_pool2d.default upsample_nearest1d.vec upsample_nearest2d.vec upsample_nearest3d.vec
upsample_linear1d.vec upsample_bilinear2d.vec upsample_bicubic2d.vec upsample_trilinear3d.vec
pixel_shuffle.default pixel_unshuffle.default _adaptive_avg_pool2d.default _adaptive_avg_pool3d.default"""
# Backward kernels, which a forward may call (a custom backward written with them; double backward has formulas).
_BACKWARDS = """_adaptive_avg_pool2d_backward.default avg_pool2d_backward.default convolution_backward.default
embedding_dense_backward.default max_pool2d_with_indices_backward.default native_layer_norm_backward.default
native_group_norm_backward.default"""
# nn.GRU / nn.LSTM / nn.RNN inside a custom module: a list of weight tensors in, (output, h_n[, c_n]) out.
_RECURRENT = "gru.input lstm.input rnn_tanh.input rnn_relu.input"
# nn.LSTMCell / GRUCell / RNNCell: one time step, called in the user's own loop.
_CELLS = "lstm_cell.default gru_cell.default rnn_tanh_cell.default rnn_relu_cell.default"
_RANDOM = "dropout.default dropout_.default native_dropout.default feature_dropout.default"
# Random numbers in forward (a VAE's noise, diffusion noise, stochastic depth): replayed from the job's seed.
_DRAWS = """rand.default rand_like.default randn.default randn_like.default bernoulli.default bernoulli.p
bernoulli.Tensor bernoulli_.float normal.Tensor_float normal.float_Tensor normal.Tensor_Tensor normal.float_float
normal_.default uniform.default uniform_.default randint.default randint.low randint_like.default
randint_like.low_dtype multinomial.default randperm.default"""
_FACTORIES = """arange.default arange.start arange.start_step full.default full_like.default ones.default
ones_like.default zeros.default zeros_like.default new_ones.default new_zeros.default new_full.default
scalar_tensor.default"""
_CASTS = """_to_copy.default to.dtype to.dtype_layout to.device to.other type_as.default"""
_SIZES = "sym_size.int sym_numel.default sym_stride.int"
_ASSERTS = """_assert_tensor_metadata.default _assert_scalar.default sym_constrain_range_for_size.default
_assert_async.msg sym_constrain_range.default"""
# Ops whose output's size depends on values (a boolean mask): in a graph captured on one batch the node
# carries the size it had (OpNode.shape, sized.py), which the shape check takes and the run checks.
_DATA_DEPENDENT = """nonzero.default argwhere.default masked_select.default"""
_LOSSES = """cross_entropy_loss.default nll_loss.default nll_loss_nd.default mse_loss.default
binary_cross_entropy_with_logits.default binary_cross_entropy.default"""

# Ops without a gradient that forward passes call (index builders, encodings, checks, comparisons): allowed in
# forward; their outputs carry no gradient, as in eager.
_FORWARD_ONLY = """_is_all_true.default _is_any_true.default one_hot.default bucketize.Tensor searchsorted.Tensor
argsort.default argsort.stable sort.stable histc.default bincount.default count_nonzero.dim_IntList
count_nonzero.default isin.Tensor_Tensor isin.Tensor_Scalar isneginf.default isposinf.default signbit.default
logical_not_.default eq_.Tensor tril_indices.default triu_indices.default linspace.default logspace.default
eye.default eye.m _unsafe_index.Tensor lift_fresh.default resolve_conj.default resolve_neg.default
bitwise_left_shift.Tensor bitwise_right_shift.Tensor kthvalue.default mode.default median.default
median.dim nanmedian.default cummax.default cummin.default"""
# Ops outside the core opset that capture leaves in a graph for public modules and functions (below autograd:
# what nn.functional calls run as), each with its derivative formula.
_EMITTED = """nll_loss_forward.default nll_loss2d_forward.default smooth_l1_loss.default huber_loss.default
soft_margin_loss.default multi_margin_loss.default multilabel_margin_loss_forward.default l1_loss.default
kl_div.default poisson_nll_loss.default margin_ranking_loss.default hinge_embedding_loss.default
triplet_margin_loss.default cosine_embedding_loss.default ctc_loss.IntList _ctc_loss.default
native_dropout.default _softmax_backward_data.default _log_softmax_backward_data.default
max_pool2d_with_indices.default max_pool3d_with_indices.default _native_batch_norm_legit_functional.default
_to_copy.default _unsafe_view.default split_with_sizes.default index_put_.default index_fill.int_Scalar
index_fill.int_Tensor index_fill_.int_Scalar index_copy.default index_reduce.default masked_scatter_.default
scatter_.src scatter_.value scatter_add_.default put.default take.default addr.default addbmm.default
xlogy.Tensor xlogy.Scalar_Other special_xlog1py.default special_entr.default special_erfcx.default
special_ndtr.default special_ndtri.default special_log_ndtr.default special_i0e.default special_i1.default
special_i1e.default i0.default lgamma.default digamma.default polygamma.default mvlgamma.default sinc.default
logcumsumexp.default logaddexp2.default nextafter.default copysign.Tensor copysign.Scalar heaviside.default
fmin.default fmax.default float_power.Tensor_Scalar float_power.Tensor_Tensor float_power.Scalar deg2rad.default
rad2deg.default sigmoid_backward.default tanh_backward.default threshold.default threshold_backward.default
_prelu_kernel.default hardshrink.default softshrink.default log_sigmoid_forward.default
_weight_norm_interface.default linalg_vector_norm.default linalg_cross.default cross.default
_linalg_det.default _linalg_slogdet.default _linalg_eigh.default _linalg_svd.default linalg_cholesky_ex.default
linalg_inv_ex.default linalg_solve_ex.default _linalg_solve_ex.default triangular_solve.default
linalg_solve_triangular.default cholesky_solve.default cholesky_inverse.default linalg_qr.default
linalg_lu_factor_ex.default linalg_lu.default lu_unpack.default linalg_householder_product.default
logdet.default trace.default kron.default cumsum_.default renorm.default dist.default _euclidean_dist.default
native_channel_shuffle.default channel_shuffle.default im2col.default _upsample_nearest_exact1d.vec
_upsample_nearest_exact2d.vec _upsample_nearest_exact3d.vec _upsample_bilinear2d_aa.vec
_upsample_bicubic2d_aa.vec upsample_nearest1d.default upsample_nearest2d.default upsample_bilinear2d.default
reflection_pad1d.default adaptive_max_pool3d.default fractional_max_pool2d.default
fractional_max_pool3d.default max_unpool2d.default max_unpool3d.default avg_pool1d.default
_adaptive_avg_pool3d.default native_layer_norm.default _fused_rms_norm.default
_scaled_dot_product_flash_attention_for_cpu.default _scaled_dot_product_efficient_attention.default
_embedding_bag_forward_only.default embedding_renorm_.default alias_copy.default view_copy.default
expand_copy.default permute_copy.default t_copy.default transpose_copy.int unsqueeze_copy.default
squeeze_copy.dim squeeze_copy.dims select_copy.int slice_copy.Tensor detach_copy.default diagonal_copy.default
as_strided_scatter.default diagonal_scatter.default narrow_copy.default unfold_copy.default pdist.default
cdist.default _cdist_forward.default std.correction var.correction
nan_to_num_.default clamp_min_.default clamp_max_.default sub_.Scalar exp_.default log_.default sqrt_.default
neg_.default abs_.default pow_.Scalar pow_.Tensor addcmul_.default addcdiv_.default lerp_.Scalar lerp_.Tensor
tril_.default triu_.default index_add_.default masked_scatter_.default sigmoid.default square_.default
rsqrt_.default reciprocal_.default floor_.default ceil_.default round_.default trunc_.default sign_.default
fmod_.Scalar remainder_.Scalar hardsigmoid_.default mish_.default celu_.default selu_.default
logit_.default erfinv_.default cos_.default sin_.default frac_.default sgn_.default atan2_.default
_conj_physical.default _ctc_loss.Tensor _linalg_check_errors.default _safe_softmax.default _trilinear.default
_unsafe_masked_index.default _unsafe_masked_index_put_accumulate.default _upsample_bilinear2d_aa.default
_upsample_nearest_exact1d.default _upsample_nearest_exact2d.default _upsample_nearest_exact3d.default
aminmax.default block_diag.default cholesky.default clamp_min_.Tensor clamp_max_.Tensor frexp.Tensor
grid_sampler_3d.default ldexp.Tensor linalg_eig.default linalg_lstsq.default linalg_lu_solve.default
linalg_matrix_exp.default linalg_pinv.atol_rtol_tensor nanmedian.dim nansum.default native_dropout_backward.default
ormqr.default rot90.default segment_reduce.default split_with_sizes_copy.default squeeze_.dim squeeze_.dims
squeeze_.default unsqueeze_.default transpose_.default squeeze_copy.default unbind_copy.int unsafe_split.Tensor
unsafe_split_with_sizes.default upsample_bicubic2d.default upsample_linear1d.default upsample_trilinear3d.default
upsample_nearest3d.default vdot.default _batch_norm_with_update.default fft_fft.default fft_ifft.default fft_rfft.default
fft_irfft.default fft_fft2.default fft_ifft2.default fft_rfft2.default fft_irfft2.default fft_fftn.default fft_ifftn.default
fft_rfftn.default fft_irfftn.default fft_hfft.default fft_ihfft.default fft_fftshift.default fft_ifftshift.default _sparse_mm.default _sparse_addmm.default bilinear.default pairwise_distance.default
frobenius_norm.dim nuclear_norm.default linalg_norm.default linalg_norm.ord_str linalg_matrix_norm.default
linalg_matrix_norm.str_ord nuclear_norm.dim
stft.default istft.default embedding_bag.padding_idx embedding_bag.default
linalg_det.default linalg_slogdet.default slogdet.default det.default logdet.default linalg_inv.default inverse.default
linalg_solve.default linalg_cholesky.default linalg_eigh.default linalg_svd.default svd.default linalg_pinv.default
linalg_matrix_power.default matrix_power.default trapezoid.x trapz.x cumulative_trapezoid.x cov.default corrcoef.default"""

# Combine values along `dim`/`dims` (the batch-mixing check looks at that argument).
_ALONG_DIM = frozenset("""sum.dim_IntList mean.dim amax.default amin.default max.dim min.dim argmax.default
argmin.default var.correction var.dim std.correction std.dim var_mean.correction std_mean.correction
var_mean.dim std_mean.dim
prod.dim_int logsumexp.default norm.ScalarOpt_dim linalg_vector_norm.default cumsum.default cumprod.default
any.dim all.dim softmax.int log_softmax.int _softmax.default _log_softmax.default sort.default topk.default
diff.default index_select.default gather.default take_along_dim.default scatter.src scatter.value
scatter_add.default flip.default roll.default slice_scatter.default select_scatter.default index_add.default
scatter_reduce.two any.dims cosine_similarity.default _fft_r2c.default _fft_c2r.default _fft_c2c.default
""".split())

# Core ATen ops with a derivative formula that a graph may not call, and why (docs/graph-ops.md says the same).
REFUSED_CORE = MappingProxyType({
    "as_strided.default": "reads the input's memory through the strides it had at capture, which another "
                          "device's or kernel's layout does not reproduce; export emits it for no public module, "
                          "and a program that calls x.as_strided is rewritten with view/reshape/unfold",
})


# Ops the capture can emit that a graph may not call, and why (docs/graph-ops.md says the same): the core
# refusals, then the rest. tests/support/emitted_ops.py counts every op op_db and module_db programs emit.
_SPARSE_MADE = ("makes or reduces a sparse tensor inside the graph, whose number of stored values depends on the "
                "values, so the shape and memory checks before the queue cannot bound it; sparse tensors may be "
                "inputs, buffers and parameters (they travel as their indices and values), and torch.sparse.mm / "
                "torch.spmm on them run")
REFUSED = MappingProxyType({
    **{f"aten.{k}": v for k, v in REFUSED_CORE.items()},
    "aten.as_strided_copy.default": REFUSED_CORE["as_strided.default"],
    "aten.rrelu_with_noise.default": "writes its `noise` argument, a tensor of its own, besides its result; the "
                                     "allow-list checks writes to the first argument and to running statistics "
                                     "only. F.rrelu in training mode calls it: use leaky_relu, or rrelu in eval mode",
    "aten._to_sparse.default": _SPARSE_MADE,
    "aten._sparse_mm_reduce_impl.default": _SPARSE_MADE,
    "aten.sparse_sampled_addmm.default": _SPARSE_MADE,
})


def _zeros_like_empty(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return torch.zeros(size, dtype=dtype, layout=layout, device=device)


def _zeros_empty_like(self, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return torch.zeros_like(self, dtype=dtype, layout=layout, device=device)


def _zeros_new_empty(self, size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return self.new_zeros(size, dtype=dtype, layout=layout, device=device)


def _zeros_empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return torch.zeros(size, dtype=dtype, layout=layout, device=device)


# The `empty*` family returns whatever the allocator hands back (on a shared GPU, another caller's
# tensors); here each runs as its zero-filled twin, checked against the original's schema.
_ZERO_FILLED = MappingProxyType({
    "empty.memory_format": _zeros_like_empty,
    "empty_like.default": _zeros_empty_like,
    "new_empty.default": _zeros_new_empty,
    "empty_strided.default": _zeros_empty_strided,
    "new_empty_strided.default": lambda self, size, stride, **kw: _zeros_new_empty(self, size, **kw),
})


def _reshape(self: torch.Tensor, size: list) -> torch.Tensor:
    return torch.reshape(self, size)  # a view wherever the input's layout allows one, a copy elsewhere


def _reshape_as(self: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    return torch.reshape(self, other.shape)


# Layout facts that held at capture only: these run as what they mean on any device.
_AS_RESHAPE = MappingProxyType({"view.default": _reshape, "_unsafe_view.default": _reshape,
                                "view_as.default": _reshape_as})


def drawn_in(op: Op, draw: torch.dtype) -> Callable:
    """`op` drawing its floating random numbers in `draw` (the dtype the graph was captured in) and cast to the
    dtype the run asks for. torch draws other numbers in float64 than in float32 from the same seed, so the
    numerical check's float64 copy would otherwise see other noise than the run it checks."""

    def run(*args: Any, **kwargs: Any) -> Any:
        asked = kwargs.get("dtype")
        if asked is not None:  # a factory (randn(size, dtype=...), randn_like(x, dtype=...))
            if not asked.is_floating_point or asked == draw:
                return op.fn(*args, **kwargs)
            return op.fn(*args, **{**kwargs, "dtype": draw}).to(asked)
        like = next((a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
        if like is None or like.dtype == draw:
            return op.fn(*args, **kwargs)
        cast = [a.to(draw) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        out = op.fn(*cast, **kwargs)
        if op.inplace:  # bernoulli_, normal_, uniform_: the numbers land in the tensor the graph named
            return args[0].copy_(out)
        return out.to(like.dtype) if out.is_floating_point() else out

    return run


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


_INT_LIMIT = 2**62


def _checked(fn: Callable) -> Callable:
    """A Python operator on sizes, refusing results beyond int64 (chained squaring would otherwise
    build integers of gigabytes)."""

    def run(*args: Any) -> Any:
        out = fn(*args)
        if isinstance(out, int) and not -_INT_LIMIT < out < _INT_LIMIT:
            raise ValueError(f"integer result {str(out)[:20]}... is out of range")
        return out

    return run


def _python_op(name: str, fn: Callable, arity: int, returns: str = "scalar") -> Op:
    params = tuple(Param(f"arg{i}", ("number",), False, False) for i in range(arity))
    return Op(f"operator.{name}", _checked(fn), params, returns)


def _truediv(a: Any, b: Any) -> float:
    return a / b


PYTHON_OPS = MappingProxyType({
    op.name: op for op in [
        _python_op("add", operator.add, 2), _python_op("sub", operator.sub, 2), _python_op("mul", operator.mul, 2),
        _python_op("floordiv", operator.floordiv, 2), _python_op("truediv", _truediv, 2),
        _python_op("mod", operator.mod, 2), _python_op("neg", operator.neg, 1),
        _python_op("eq", operator.eq, 2), _python_op("ne", operator.ne, 2), _python_op("lt", operator.lt, 2),
        _python_op("le", operator.le, 2), _python_op("gt", operator.gt, 2), _python_op("ge", operator.ge, 2),
    ]
})
# getitem picks one tensor out of a multi-output op (split, max.dim, native_batch_norm, ...).
GETITEM = Op("operator.getitem", operator.getitem,
             (Param("seq", ("tensors",), False, False), Param("index", ("int",), False, False)), "tensor")


def _build_table() -> tuple[MappingProxyType, tuple[str, ...]]:
    """(the allowed ops by name, the entries this torch lacks or gives a schema the checks cannot read)."""
    table: dict[str, Op] = {"operator.getitem": GETITEM, **PYTHON_OPS}
    skipped = []
    groups = [_MATMUL, _CONV, _NORM, _ATTENTION, _ACTIVATIONS, _ELEMENTWISE, _REDUCTIONS, _INDEXING, _VIEWS,
              _LAYOUT, _COMPLEX, _POOLING, _BACKWARDS, _RECURRENT, _CELLS, _RANDOM, _DRAWS, _FACTORIES, _CASTS,
              _SIZES, _ASSERTS, _LOSSES, _DATA_DEPENDENT, _FORWARD_ONLY, _EMITTED]
    reshapes = set(_VIEWS.split())
    asserts = set(_ASSERTS.split())
    recurrent = set(_RECURRENT.split())
    draws = set(_DRAWS.split())
    for entry in [e for g in groups for e in g.split()] + list(_ZERO_FILLED):
        base, overload = entry.rsplit(".", 1)
        packet = getattr(aten, base, None)
        ovl = getattr(packet, overload, None) if packet is not None else None
        name = f"aten.{entry}"
        try:
            if ovl is None:
                raise TypeError("not in this torch")
            fn = _no_op if entry in asserts else _AS_RESHAPE.get(entry) or _ZERO_FILLED.get(entry)
            table[name] = _from_schema(name, ovl, fn=fn, is_assert=entry in asserts, along_dim=entry in _ALONG_DIM,
                                       reshapes=entry in reshapes, recurrent=entry in recurrent, random=entry in draws)
        except TypeError as exc:  # a newer torch's schema (a Generator argument, ...): left out, not a crash
            skipped.append(f"{name}: {exc}")
    return MappingProxyType(table), tuple(skipped)


OPS, SKIPPED = _build_table()  # SKIPPED: none on torch 2.13

ALLOWED_OPS_DOC = "docs/graph-ops.md (the list: gradsvc/engine/graph/ops.py, and GET /schema)"


def op_catalogue() -> list[str]:
    """Every allowed op name, sorted (for GET /schema and the README)."""
    return sorted(OPS)
