"""In-Place Activated BatchNorm (Rota Bulò, Porzi and Kontschieder, CVPR 2018), in pure PyTorch.

`InPlaceABN` is BatchNorm followed by an invertible activation (leaky ReLU, ELU or identity) in one
op that writes its output over its input. The backward keeps only that output: it inverts the
activation (z = act^-1(y)) and the affine transform (x_hat = (z - bias) / scale) to recover the
normalised input, so neither the BN input nor the activation's input stays alive for backward.

The inversion trap: with a scale near zero, x_hat = (z - bias) / scale is lost (every output is
`bias`). As in the paper (and the authors' `inplace-abn` package), the scale used in the forward
is `|weight| + eps` (eps: the BN eps), never below eps, so the inversion is always defined. The
module therefore computes BatchNorm with weight |w| + eps (its gradient is the BN gradient times
sign(w)): a model trained with it learns through that, and a BatchNorm with w >= 0 converts to it
with outputs changed by eps * x_hat only (see recipes/inplace_abn.py, which refuses w < 0).

`forward(x, residual)` computes act(BN(x) + residual), a ResNet block's end: the residual (the
block's input, kept for backward by the block's first convolution anyway) is subtracted again in
the backward.

`InPlaceABNSync` computes the batch statistics over every process of the job (gloo or nccl),
combining each process's count, mean and sum of squared deviations with Chan et al.'s parallel
algorithm in float64, so processes may hold different numbers of samples, zero included. Its
backward all-reduces the two per-channel gradient sums; parameter gradients stay per process (DDP
averages them), as torch's SyncBatchNorm does.

`InPlaceAGN` is the same idea for GroupNorm + activation (Panoptic FPN's semantic head uses GN):
statistics per (sample, group), so nothing to synchronise and the same maths in train and eval; the
scale is |weight| + eps as well, and the backward recovers x_hat from the output alone.

`SyncBatchNormCPU` (the syncbn recipe under gloo) is the same synchronised statistics with the
ordinary BatchNorm forward: not in place, weight as it is, the normalised input saved for backward.
"""
import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = ("leaky_relu", "elu", "identity")


def _check_activation(activation, param):
    if activation not in ACTIVATIONS:
        raise ValueError(f"InPlaceABN activation must be one of {ACTIVATIONS}, got {activation!r}")
    if activation in ("leaky_relu", "elu") and not param > 0:  # slope 0 (ReLU) is not invertible
        raise ValueError(f"InPlaceABN {activation} needs activation_param > 0 to be invertible, got {param}")


def _channel_view(t, x):
    return t.view((1, -1) + (1,) * (x.dim() - 2))


def _batch_stats(x, group):
    """Per-channel (count, mean, biased variance) over dims 0, 2, 3..., in float64, over the
    processes of `group` (None: this process only). Chan et al.: each process's count n, mean m and
    M2 (sum of squared deviations) combine as N = sum n, mean = sum n m / N,
    M2 = sum (M2_i + n_i (m_i - mean)^2)."""
    channels = x.shape[1]
    n = x.numel() // channels if channels else 0
    if n:
        var, mean = torch.var_mean(x.transpose(0, 1).reshape(channels, -1).double(), dim=1, unbiased=False)
    else:
        var = mean = torch.zeros(channels, dtype=torch.float64, device=x.device)
    if group is None:
        return n, mean, var
    local = torch.cat([torch.full((1,), float(n), dtype=torch.float64, device=x.device), mean, var * n])
    parts = [torch.empty_like(local) for _ in range(tdist.get_world_size(group))]
    tdist.all_gather(parts, local, group=group)
    stats = torch.stack(parts)  # world x (1 + 2C)
    counts, means, m2 = stats[:, :1], stats[:, 1:1 + channels], stats[:, 1 + channels:]
    total = counts.sum()
    if total == 0:
        return 0, mean, var
    mean = (counts * means).sum(0) / total
    m2 = (m2 + counts * (means - mean) ** 2).sum(0)
    return int(total.item()), mean, m2 / total


def _activate_(y, activation, param):
    if activation == "leaky_relu":
        F.leaky_relu_(y, param)
    elif activation == "elu":
        F.elu_(y, param)


def _invert(y, grad, activation, param):
    """(z, dL/dz) from the activation's output y = act(z) and dL/dy."""
    if activation == "identity":
        return y, grad
    negative = y < 0
    if activation == "leaky_relu":
        return torch.where(negative, y / param, y), torch.where(negative, grad * param, grad)
    return torch.where(negative, torch.log1p(y / param), y), torch.where(negative, grad * (y + param), grad)


class _ABN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, training, momentum, eps, activation, param,
                group, exact, residual=None):
        channels = x.shape[1]
        if training:
            count, mean, var = _batch_stats(x, group)
            if count <= 1:
                raise ValueError(f"Expected more than 1 value per channel when training, got input size {tuple(x.shape)}"
                                 + (" on all processes together" if group is not None else ""))
            if running_mean is not None:
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_((var * count / (count - 1)).to(running_var.dtype), alpha=momentum)
        else:
            count, mean, var = 0, running_mean.double(), running_var.double()
        invstd = (var + eps).rsqrt()
        w = torch.ones(channels, dtype=torch.float64, device=x.device) if weight is None else weight.double()
        scale = w if exact else w.abs() + eps
        shift = torch.zeros_like(scale) if bias is None else bias.double()
        a, b = scale * invstd, shift - mean * scale * invstd
        if exact:  # ordinary BatchNorm: the normalised input is saved
            x_hat = (x - _channel_view(mean.to(x.dtype), x)) * _channel_view(invstd.to(x.dtype), x)
            y = x_hat * _channel_view(scale.to(x.dtype), x) + _channel_view(shift.to(x.dtype), x)
            ctx.save_for_backward(x_hat, weight, scale, shift, invstd, None)
        else:
            y = x.mul_(_channel_view(a.to(x.dtype), x)).add_(_channel_view(b.to(x.dtype), x))
            if residual is not None:  # act(BN(x) + shortcut): the shortcut is kept anyway by whoever saved it
                y.add_(residual)
            _activate_(y, activation, param)
            ctx.mark_dirty(x)
            ctx.save_for_backward(y, weight, scale, shift, invstd, residual)
        ctx.training, ctx.count, ctx.activation, ctx.param = training, count, activation, param
        ctx.group, ctx.exact = group, exact
        return y

    @staticmethod
    def backward(ctx, grad):
        saved, weight, scale, shift, invstd, residual = ctx.saved_tensors
        dtype = torch.float64 if saved.dtype == torch.float64 else torch.float32
        grad = grad.to(dtype)
        if ctx.exact:
            x_hat, dz = saved.to(dtype), grad
        else:  # recover z = act^-1(y), then x_hat = (z - shift) / scale
            z, dz = _invert(saved.to(dtype), grad, ctx.activation, ctx.param)
            if residual is not None:
                z = z - residual.to(dtype)
            x_hat = (z - _channel_view(shift.to(dtype), z)) / _channel_view(scale.to(dtype), z)
        dims = [0] + list(range(2, dz.dim()))
        sum_dz = dz.sum(dims).double()
        sum_dz_xhat = (dz * x_hat).sum(dims).double()
        a = _channel_view((scale * invstd).to(dtype), dz)
        if ctx.training:
            sums = torch.stack([sum_dz, sum_dz_xhat])
            if ctx.group is not None:
                sums = sums.clone()
                tdist.all_reduce(sums, group=ctx.group)
            mean_dz = _channel_view((sums[0] / ctx.count).to(dtype), dz)
            mean_dz_xhat = _channel_view((sums[1] / ctx.count).to(dtype), dz)
            dx = (dz - mean_dz - x_hat * mean_dz_xhat) * a
        else:
            dx = dz * a
        dweight = dbias = None
        if weight is not None and ctx.needs_input_grad[1]:
            dweight = sum_dz_xhat if ctx.exact else sum_dz_xhat * weight.double().sign()
            dweight = dweight.to(weight.dtype)
        if shift is not None and ctx.needs_input_grad[2]:
            dbias = sum_dz.to(weight.dtype if weight is not None else dtype)
        dres = dz.to(residual.dtype) if residual is not None and ctx.needs_input_grad[12] else None
        return dx.to(saved.dtype), dweight, dbias, None, None, None, None, None, None, None, None, None, dres


def inplace_abn(x, weight, bias, running_mean=None, running_var=None, training=True, momentum=0.1, eps=1e-5,
                activation="leaky_relu", activation_param=0.01, group=None, residual=None):
    """BatchNorm (scale |weight| + eps) [+ residual] and the activation, written over `x`; returns `x`.
    group: a torch.distributed process group to compute the statistics over (InPlaceABNSync)."""
    _check_activation(activation, activation_param)
    return _ABN.apply(x, weight, bias, running_mean, running_var, training, momentum, eps, activation,
                      activation_param, group, False, residual)


class InPlaceABN(nn.BatchNorm2d):
    """nn.BatchNorm2d + activation in one in-place op. Same parameters, buffers and state-dict keys
    as nn.BatchNorm2d (a BatchNorm's state dict loads as it is); train / eval, momentum (None:
    cumulative average) and running statistics as nn.BatchNorm2d. The input is overwritten: it
    must not be used by anything else (the recipe checks that before converting)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 activation="leaky_relu", activation_param=0.01, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        _check_activation(activation, activation_param)
        self.activation, self.activation_param = activation, activation_param

    def _group(self):
        return None

    _exact = False

    def forward(self, x, residual=None):
        """residual: added after the affine transform, before the activation (a ResNet block's shortcut)."""
        self._check_input_dim(x)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        track = not self.training or self.track_running_stats
        if x.requires_grad and x.is_leaf and not self._exact:
            x = x.clone()  # a leaf cannot be written in place
        return _ABN.apply(x, self.weight, self.bias, self.running_mean if track else None,
                          self.running_var if track else None, batch_stats, factor, self.eps, self.activation,
                          self.activation_param, self._group() if batch_stats else None, self._exact, residual)

    def extra_repr(self):
        return f"{super().extra_repr()}, activation={self.activation}, activation_param={self.activation_param}"


class InPlaceABNSync(InPlaceABN):
    """InPlaceABN with the batch statistics of every process in `process_group` (default: the whole
    torchrun job; a single process behaves as InPlaceABN)."""

    def __init__(self, *args, process_group=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.process_group = process_group

    def _group(self):
        if not (tdist.is_available() and tdist.is_initialized()):
            return None
        group = self.process_group or tdist.group.WORLD
        return group if tdist.get_world_size(group) > 1 else None


class SyncBatchNormCPU(InPlaceABNSync):
    """nn.SyncBatchNorm's maths on any backend (gloo included): BatchNorm with statistics over the
    processes, weight used as it is, output in a new tensor, no activation."""
    _exact = True

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 process_group=None, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, activation="identity",
                         activation_param=0.0, process_group=process_group, device=device, dtype=dtype)

    def _check_input_dim(self, x):
        if x.dim() < 2:
            raise ValueError(f"expected at least 2-D input (N, C, ...), got {x.dim()}-D")

    def extra_repr(self):
        return nn.BatchNorm2d.extra_repr(self)


def from_batchnorm(bn, cls=InPlaceABN, **kwargs):
    """`cls` with `bn`'s configuration, parameters and buffers (shared tensors, not copies)."""
    like = bn.weight if bn.affine else bn.running_mean
    factory = {} if like is None else {"device": like.device, "dtype": like.dtype}
    new = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, **kwargs, **factory)
    new.load_state_dict(bn.state_dict())
    new.train(bn.training)
    if bn.affine:
        new.weight, new.bias = bn.weight, bn.bias
    return new


class _AGN(torch.autograd.Function):
    """GroupNorm (scale |weight| + eps) and the activation, in place: InPlace-ABN's inversion with
    per-(sample, group) statistics. Only the output is saved, with the (N, G) inverse std."""

    @staticmethod
    def forward(ctx, x, weight, bias, groups, eps, activation, param):
        n, channels = x.shape[:2]
        var, mean = torch.var_mean(x.reshape(n, groups, -1).double(), dim=2, unbiased=False)  # (N, G)
        invstd = (var + eps).rsqrt()
        w = torch.ones(channels, dtype=torch.float64, device=x.device) if weight is None else weight.double()
        scale = w.abs() + eps
        shift = torch.zeros_like(scale) if bias is None else bias.double()
        a = scale.view(1, groups, -1) * invstd[..., None]  # (N, G, C/G)
        b = shift.view(1, groups, -1) - mean[..., None] * a
        view = (n, channels) + (1,) * (x.dim() - 2)
        y = x.mul_(a.reshape(view).to(x.dtype)).add_(b.reshape(view).to(x.dtype))
        _activate_(y, activation, param)
        ctx.mark_dirty(x)
        ctx.save_for_backward(y, weight, scale, shift, invstd)
        ctx.groups, ctx.activation, ctx.param = groups, activation, param
        return y

    @staticmethod
    def backward(ctx, grad):
        y, weight, scale, shift, invstd = ctx.saved_tensors
        dtype = torch.float64 if y.dtype == torch.float64 else torch.float32
        z, dz = _invert(y.to(dtype), grad.to(dtype), ctx.activation, ctx.param)
        x_hat = (z - _channel_view(shift.to(dtype), z)) / _channel_view(scale.to(dtype), z)
        dims = [0] + list(range(2, dz.dim()))
        dweight = dbias = None
        if weight is not None and ctx.needs_input_grad[1]:
            dweight = ((dz * x_hat).sum(dims).double() * weight.double().sign()).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            dbias = dz.sum(dims).to(weight.dtype if weight is not None else dtype)
        n, groups = dz.shape[0], ctx.groups
        dx_hat = (dz * _channel_view(scale.to(dtype), dz)).reshape(n, groups, -1)
        x_hat = x_hat.reshape(n, groups, -1)
        mean_dx_hat = dx_hat.mean(2, keepdim=True)  # in the working dtype, as InPlaceABN's sums: no float64 copy
        mean_dx_hat_x_hat = (dx_hat * x_hat).mean(2, keepdim=True)
        dx = (dx_hat - mean_dx_hat - x_hat * mean_dx_hat_x_hat) * invstd[..., None].to(dtype)
        return dx.reshape(dz.shape).to(y.dtype), dweight, dbias, None, None, None, None


def inplace_agn(x, weight, bias, groups, eps=1e-5, activation="leaky_relu", activation_param=0.01):
    """GroupNorm (scale |weight| + eps) and the activation, written over `x`; returns `x`."""
    _check_activation(activation, activation_param)
    return _AGN.apply(x, weight, bias, groups, eps, activation, activation_param)


class InPlaceAGN(nn.GroupNorm):
    """nn.GroupNorm + activation in one in-place op (InPlace-ABN with GroupNorm's per-sample
    statistics: nothing to synchronise, the same in train and eval). Same parameters and state-dict
    keys as nn.GroupNorm. The input is overwritten."""

    def __init__(self, num_groups, num_channels, eps=1e-5, affine=True, activation="leaky_relu",
                 activation_param=0.01, device=None, dtype=None):
        super().__init__(num_groups, num_channels, eps, affine, device=device, dtype=dtype)
        _check_activation(activation, activation_param)
        self.activation, self.activation_param = activation, activation_param

    def forward(self, x):
        if x.dim() < 2 or x.shape[1] != self.num_channels:
            raise ValueError(f"InPlaceAGN expected input (N, {self.num_channels}, ...), got {tuple(x.shape)}")
        if x.requires_grad and x.is_leaf:
            x = x.clone()  # a leaf cannot be written in place
        return _AGN.apply(x, self.weight, self.bias, self.num_groups, self.eps, self.activation,
                          self.activation_param)

    def extra_repr(self):
        return f"{super().extra_repr()}, activation={self.activation}, activation_param={self.activation_param}"


def from_groupnorm(gn, **kwargs):
    """InPlaceAGN with `gn`'s configuration and parameters (shared tensors, not copies)."""
    factory = {"device": gn.weight.device, "dtype": gn.weight.dtype} if gn.affine else {}
    new = InPlaceAGN(gn.num_groups, gn.num_channels, gn.eps, gn.affine, **kwargs, **factory)
    new.train(gn.training)
    if gn.affine:
        new.weight, new.bias = gn.weight, gn.bias
    return new
