"""InPlaceABN against BatchNorm + the same activation (issue 21, acceptance 1)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models.inplace_abn import InPlaceABN, InPlaceAGN, SyncBatchNormCPU, inplace_abn, inplace_agn

ACTS = [("leaky_relu", 0.01), ("leaky_relu", 0.2), ("elu", 1.0), ("identity", 0.0)]
EPS = 1e-5


def activation(y, name, param):
    return {"leaky_relu": lambda: F.leaky_relu(y, param), "elu": lambda: F.elu(y, param),
            "identity": lambda: y}[name]()


def reference(x, weight, bias, name, param, running=None, training=True):
    """BatchNorm with the documented scale |weight| + eps, then the activation (not in place)."""
    mean, var = running if running else (None, None)
    return activation(F.batch_norm(x, mean, var, weight.abs() + EPS, bias, training, 0.1, EPS), name, param)


def inputs(weight_values):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 4, 5, 5, generator=g, dtype=torch.float64) * 2 + 0.5)
    w = torch.tensor(weight_values, dtype=torch.float64)
    b = torch.randn(4, generator=g, dtype=torch.float64)
    return x, w, b


@pytest.mark.parametrize("name,param", ACTS)
def test_gradcheck_float64(name, param):
    x, w, b = inputs([1.3, -0.7, 1e-4, 2.0])  # 1e-4: near zero, further than gradcheck's step from it
    args = [t.clone().requires_grad_() for t in (x, w, b)]
    fn = lambda x, w, b: inplace_abn(x.clone(), w, b, training=True, eps=EPS, activation=name, activation_param=param)  # noqa: E731
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("name,param", ACTS)
def test_matches_batchnorm_and_activation_with_weights_near_zero(name, param, training):
    x, w, b = inputs([1.3, 1e-7, -1e-7, 0.0])  # the inversion divides by |w| + eps, never by w
    running = (torch.randn(4, dtype=torch.float64), torch.rand(4, dtype=torch.float64) + 0.5)
    grad_out = torch.randn(3, 4, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    results = []
    for impl in ("abn", "ref"):
        xi, wi, bi = (t.clone().requires_grad_() for t in (x, w, b))
        rm, rv = (t.clone() for t in running)
        h = xi * 1.0  # a non-leaf, as a convolution's output
        if impl == "abn":
            y = inplace_abn(h, wi, bi, rm, rv, training, 0.1, EPS, name, param)
            assert y.data_ptr() == h.data_ptr()  # written over its input
        else:
            y = reference(h, wi, bi, name, param, (rm, rv), training)
        y.backward(grad_out)
        results.append((y.detach(), xi.grad, wi.grad, bi.grad, rm, rv))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_module_running_stats_match_batchnorm_after_10_steps():
    for momentum in (0.1, None):
        torch.manual_seed(0)
        bn, abn = nn.BatchNorm2d(6, momentum=momentum), InPlaceABN(6, momentum=momentum, activation="identity")
        abn.load_state_dict(bn.state_dict())
        for step in range(10):
            x = torch.randn(4, 6, 7, 7) * (step + 1) + step
            expected = bn(x)
            got = abn(x.clone())
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)  # scale 1 + eps vs 1
        for key in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(getattr(abn, key), getattr(bn, key), atol=1e-5, rtol=1e-5)
        bn.eval(), abn.eval()
        x = torch.randn(2, 6, 7, 7)
        torch.testing.assert_close(abn(x.clone()), bn(x), atol=1e-4, rtol=1e-4)


def saved_bytes(module):
    x = torch.randn(4, 8, 16, 16, requires_grad=True)
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x * 2).sum().backward()
    return sum(storages.values())


ACTIVATION_BYTES = 4 * 8 * 16 * 16 * 4


def test_module_saves_one_buffer_where_batchnorm_and_activation_save_two():
    plain = saved_bytes(nn.Sequential(nn.BatchNorm2d(8), nn.LeakyReLU(0.01)))
    fused = saved_bytes(InPlaceABN(8))
    assert plain >= 2 * ACTIVATION_BYTES and fused < 1.1 * ACTIVATION_BYTES


def test_bad_activation_is_refused():
    with pytest.raises(ValueError, match="invertible"):
        InPlaceABN(4, activation="leaky_relu", activation_param=0.0)  # ReLU loses the negative half
    with pytest.raises(ValueError, match="one of"):
        InPlaceABN(4, activation="hardswish")


def test_sync_batchnorm_cpu_is_batchnorm_in_one_process():
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3)
    nn.init.normal_(bn.weight)  # negative weights too: this one is not inverted
    sync = SyncBatchNormCPU(3)
    sync.load_state_dict(bn.state_dict())
    x = torch.randn(4, 3, 5, 5, requires_grad=True)
    y1, y2 = bn(x), sync(x)
    torch.testing.assert_close(y2, y1)
    g = torch.randn_like(y1)
    torch.testing.assert_close(torch.autograd.grad(y2, x, g)[0], torch.autograd.grad(y1, x, g)[0])
    torch.testing.assert_close(sync.running_var, bn.running_var)


def test_residual_inside_matches_batchnorm_plus_shortcut_then_activation():
    """act(BN(x) + shortcut), a ResNet block's end, with only the output and the shortcut kept."""
    x, w, b = inputs([1.3, -0.7, 1e-4, 2.0])
    r = torch.randn_like(x)
    args = [t.clone().requires_grad_() for t in (x, w, b, r)]
    fn = lambda x, w, b, r: inplace_abn(x.clone(), w, b, eps=EPS, residual=r)  # noqa: E731
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-6, rtol=1e-5)
    a = [t.clone().requires_grad_() for t in (x, w, b, r)]
    ref = F.leaky_relu(F.batch_norm(a[0], None, None, a[1].abs() + EPS, a[2], True, 0.1, EPS) + a[3], 0.01)
    out = fn(*args)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    g = torch.randn_like(ref)
    for got, want in zip(torch.autograd.grad(out, args, g), torch.autograd.grad(ref, a, g)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


# ---------------------------------------------------------------- InPlace-AGN: GroupNorm + activation

def group_inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, 5, 4, generator=g, dtype=torch.float64) * 2 + 0.5
    b = torch.randn(8, generator=g, dtype=torch.float64)
    return x, b


@pytest.mark.parametrize("name,param", ACTS)
def test_group_norm_gradcheck_float64(name, param):
    x, b = group_inputs()
    w = torch.tensor([1.3, -0.7, 1e-4, 2.0, 0.5, 0.3, 2e-4, 1.0], dtype=torch.float64)  # 4 groups of 2 channels
    args = [t.clone().requires_grad_() for t in (x, w, b)]
    fn = lambda x, w, b: inplace_agn(x.clone(), w, b, 4, EPS, name, param)  # noqa: E731
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name,param", ACTS)
def test_group_norm_matches_group_norm_and_activation_with_weights_near_zero(name, param):
    x, b = group_inputs()
    w = torch.tensor([1.3, 1e-7, -1e-7, 0.0, 0.5, 0.3, 0.0, 1.0], dtype=torch.float64)
    grad_out = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    results = []
    for impl in ("agn", "ref"):
        xi, wi, bi = (t.clone().requires_grad_() for t in (x, w, b))
        h = xi * 1.0  # a non-leaf, as a convolution's output
        if impl == "agn":
            y = inplace_agn(h, wi, bi, 4, EPS, name, param)
            assert y.data_ptr() == h.data_ptr()  # written over its input
        else:
            y = activation(F.group_norm(h, 4, wi.abs() + EPS, bi, EPS), name, param)
        y.backward(grad_out)
        results.append((y.detach(), xi.grad, wi.grad, bi.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_group_norm_module_matches_group_norm_in_train_and_eval_and_saves_one_buffer():
    torch.manual_seed(0)
    gn, agn = nn.GroupNorm(4, 8), InPlaceAGN(4, 8, activation="identity")
    agn.load_state_dict(gn.state_dict())
    x = torch.randn(2, 8, 6, 6) * 3 + 1
    for mode in (True, False):
        gn.train(mode), agn.train(mode)
        torch.testing.assert_close(agn(x.clone()), gn(x), atol=1e-4, rtol=1e-4)  # scale 1 + eps vs 1
    with pytest.raises(ValueError, match="expected input \\(N, 8"):
        agn(torch.randn(2, 6, 3, 3))
    plain = saved_bytes(nn.Sequential(nn.GroupNorm(4, 8), nn.LeakyReLU(0.01)))
    fused = saved_bytes(InPlaceAGN(4, 8))
    assert plain >= 2 * ACTIVATION_BYTES and fused < 1.1 * ACTIVATION_BYTES
