"""hvd.SyncBatchNorm: batch normalization with statistics over every rank's batch.

Training forward, per channel c over the N_r samples (times spatial positions)
of every rank r, M = sum_r N_r:
    mean = sum x / M,  var = sum x^2 / M - mean^2 (biased, used to normalize),
    y = (x - mean) / sqrt(var + eps) * weight + bias,
    running_mean <- (1 - momentum) running_mean + momentum mean,
    running_var  <- (1 - momentum) running_var + momentum var M / (M - 1).
One allreduce (sum) of [sum x, sum x^2, count] per forward. Backward, with
xhat the normalized input and sums over all ranks (one allreduce):
    dx = weight / sqrt(var + eps) * (dy - sum dy / M - xhat sum(dy xhat) / M);
dweight = sum(dy xhat) and dbias = sum dy stay local, as in Horovod (the
DistributedOptimizer reduces them). Ranks may have different batch sizes.
In eval mode, or with one rank, it is torch's BatchNorm.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm


from .mpi_ops import Sum, allreduce, size
from .process_sets import global_process_set, _group


def _stats_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, process_set):
        C = x.shape[1]
        sd = _stats_dtype(x.dtype)
        xc = x.transpose(0, 1).reshape(C, -1).to(sd)
        local = torch.cat([xc.sum(1), (xc * xc).sum(1), torch.tensor([float(xc.shape[1])], dtype=sd)])
        total = allreduce(local, op=Sum, name="SyncBatchNorm.stats", process_set=process_set)
        count = total[2 * C]
        if count <= 1:
            raise ValueError(f"hvd.SyncBatchNorm: {int(count)} value(s) per channel over all ranks; batch "
                             "normalization needs more than one")
        mean = total[:C] / count
        var = (total[C:2 * C] / count - mean * mean).clamp_min(0)
        invstd = torch.rsqrt(var + eps)
        shape = [1, C] + [1] * (x.dim() - 2)
        xhat = (x.to(sd) - mean.view(shape)) * invstd.view(shape)
        w = weight.to(sd).view(shape) if weight is not None else None
        y = xhat * w + bias.to(sd).view(shape) if weight is not None else xhat
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_((var * count / (count - 1)).to(running_var.dtype),
                                                    alpha=momentum)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.count, ctx.process_set, ctx.has_bias = count, process_set, bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        xhat, invstd, weight = ctx.saved_tensors
        C = xhat.shape[1]
        shape = [1, C] + [1] * (xhat.dim() - 2)
        dyc = dy.to(xhat.dtype)
        dims = [0] + list(range(2, xhat.dim()))
        sum_dy = dyc.sum(dims)
        sum_dy_xhat = (dyc * xhat).sum(dims)
        total = allreduce(torch.cat([sum_dy, sum_dy_xhat]), op=Sum, name="SyncBatchNorm.grad",
                          process_set=ctx.process_set)
        g_dy, g_dy_xhat = total[:C] / ctx.count, total[C:] / ctx.count
        scale = invstd if weight is None else invstd * weight.to(xhat.dtype)
        dx = scale.view(shape) * (dyc - g_dy.view(shape) - xhat * g_dy_xhat.view(shape))
        dw = sum_dy_xhat.to(weight.dtype) if weight is not None else None
        db = sum_dy.to(weight.dtype) if ctx.has_bias else None
        return dx.to(dy.dtype), dw, db, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization synchronized over all ranks (or a process set); Horovod's signature."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 process_set=global_process_set):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"hvd.SyncBatchNorm: expected at least 2D input (got {input.dim()}D)")

    def _run_bn(self, input):
        return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                            self.training or not self.track_running_stats, self.momentum, self.eps)

    def forward(self, input):
        self._check_input_dim(input)
        n = size() if self.process_set is global_process_set else self.process_set.size()
        if not self.training or n == 1:
            return self._run_bn(input)
        if self.momentum is None:
            raise ValueError("hvd.SyncBatchNorm: momentum=None (cumulative average) is not supported; give a "
                             "momentum")
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
        _group(self.process_set, "SyncBatchNorm")
        return _SyncBatchNorm.apply(input, self.weight, self.bias,
                                    self.running_mean if self.track_running_stats else None,
                                    self.running_var if self.track_running_stats else None,
                                    self.eps, self.momentum, self.process_set)
