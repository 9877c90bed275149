"""nn.Conv1d/2d/3d, nn.BatchNorm1d/2d (batch statistics, running statistics as buffers
that the compiled training step updates, eval mode), nn.MaxPool2d, nn.AvgPool2d,
nn.Flatten, against NumPy written from PyTorch's definitions; against PyTorch itself
when it is installed."""
import numpy as np
import pytest

import tercomp as tc
from tercomp import nn
from test_conv import naive_conv, naive_pool

rng = np.random.default_rng(5)


def f32(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def np_batch_norm(x, weight, bias, mean, var, eps=1e-5):
    shape = (1, -1) + (1,) * (x.ndim - 2)
    return (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + eps) * weight.reshape(shape) \
        + bias.reshape(shape)


@pytest.mark.parametrize("cls, x_shape, kw, meaning", [
    (nn.Conv1d, (2, 4, 9), dict(stride=2, padding=1, groups=2), ([2], [[1, 1]], [1], 2)),
    (nn.Conv2d, (2, 3, 7, 6), dict(padding="same", dilation=2), ([1, 1], [[2, 2], [2, 2]], [2, 2], 1)),
    (nn.Conv3d, (1, 2, 4, 5, 4), dict(stride=(1, 2, 1)), ([1, 2, 1], [[0, 0]] * 3, [1, 1, 1], 1)),
])
def test_conv_layers_match_the_definition(cls, x_shape, kw, meaning):
    nn.manual_seed(0)
    layer = cls(x_shape[1], 4, 3, **kw)
    assert layer.weight.shape == (4, x_shape[1] // kw.get("groups", 1)) + (3,) * (len(x_shape) - 2)
    bound = 1 / np.sqrt(layer.weight[0].size)                     # PyTorch's default init
    assert np.abs(layer.weight).max() <= bound and np.abs(layer.bias).max() <= bound
    x = f32(*x_shape)
    want = naive_conv(x, layer.weight, *meaning) + layer.bias.reshape((1, -1) + (1,) * (len(x_shape) - 2))
    np.testing.assert_allclose(layer(x), want, rtol=1e-5, atol=1e-5)
    assert set(layer.parameters()) == {"weight", "bias"}


def test_pool_and_flatten_layers():
    x = f32(2, 3, 6, 7)
    np.testing.assert_allclose(nn.MaxPool2d(2)(x), naive_pool(x, [2, 2], [2, 2], [0, 0], "max"))
    np.testing.assert_allclose(nn.AvgPool2d(3, stride=2, padding=1)(x),
                               naive_pool(x, [3, 3], [2, 2], [1, 1], "avg"), rtol=1e-5, atol=1e-6)
    assert nn.Flatten()(x).shape == (2, 126)
    assert nn.Flatten(0, 1)(x).shape == (6, 6, 7)
    g = tc.trace(lambda x: nn.Flatten()(x), tc.spec(("B", 3, 6, 7)))
    assert str(g.outputs[0].type.shape[0]) == "B" and g.outputs[0].type.shape[1] == 126
    with pytest.raises(tc.TercompError, match=r"MaxPool2d expects an input \[N, C, H, W\]"):
        nn.MaxPool2d(2)(x[0])


def test_batch_norm_training_and_eval_eagerly():
    bn = nn.BatchNorm2d(3)
    bn.weight, bn.bias = f32(3), f32(3)
    assert set(bn.parameters()) == {"weight", "bias"}
    assert set(bn.buffers()) == {"running_mean", "running_var"}
    x = f32(4, 3, 5, 5) * 2 + 1
    mean, var = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))
    np.testing.assert_allclose(bn(x), np_batch_norm(x, bn.weight, bn.bias, mean, var), rtol=1e-4, atol=1e-5)
    # PyTorch's update: momentum 0.1, the unbiased variance
    np.testing.assert_allclose(bn.running_mean, 0.1 * mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bn.running_var, 0.9 + 0.1 * x.var(axis=(0, 2, 3), ddof=1), rtol=1e-5)
    assert bn.running_mean.dtype == np.float32
    assert bn.eval() is bn and not bn.training
    np.testing.assert_allclose(bn(x), np_batch_norm(x, bn.weight, bn.bias, bn.running_mean, bn.running_var),
                               rtol=1e-4, atol=1e-5)
    bn1 = nn.BatchNorm1d(3)
    x1 = f32(8, 3)
    np.testing.assert_allclose(bn1(x1), np_batch_norm(x1, bn1.weight, bn1.bias, x1.mean(0), x1.var(0)),
                               rtol=1e-4, atol=1e-5)
    with pytest.raises(tc.TercompError, match=r"BatchNorm2d\(3\) got an input of shape \[4, 2, 5, 5\]"):
        bn(x[:, :2])


class Net(nn.Module):
    def __init__(self):
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.pool = nn.MaxPool2d(2)
        self.flat = nn.Flatten()
        self.fc = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc(self.flat(self.pool(tc.relu(self.bn(self.conv(x))))))


def test_compiled_training_step_updates_the_running_statistics():
    nn.manual_seed(1)
    model = Net()
    x, y = f32(6, 2, 4, 4) + 0.5, np.arange(6, dtype=np.int32) % 3

    def loss(m, x, y):
        return tc.cross_entropy(m(x), y)

    ref = Net()
    ref.load_state_dict(model.state_dict())
    step = tc.compile_train_step(loss, model, tc.optim.SGD(0.0), tc.spec(("B", 2, 4, 4)),
                                 tc.spec(("B",), "int32"))
    for _ in range(3):
        step(x, y)
        ref(x)                       # the eager forward updates ref's buffers as the step does
    # the step's buffers stay on the device; the model keeps its own until sync_to
    np.testing.assert_array_equal(model.bn.running_mean, np.zeros(4, np.float32))
    np.testing.assert_allclose(step.buffers()["bn.running_mean"], ref.bn.running_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(step.buffers()["bn.running_var"], ref.bn.running_var, rtol=1e-5)
    assert not np.allclose(ref.bn.running_mean, 0)
    step.sync_to(model)
    np.testing.assert_allclose(model.bn.running_var, ref.bn.running_var, rtol=1e-5)
    assert all(isinstance(v, np.ndarray) for v in model.buffers().values())
    # eval: the compiled forward normalizes by the running statistics
    model.eval()
    ref.eval()
    exe = tc.compile(model, tc.spec(("B", 2, 4, 4)))
    np.testing.assert_allclose(exe(x[:2]), ref(x[:2]), rtol=1e-4, atol=1e-5)
    # a traced training-mode forward outside a training step leaves the buffers alone
    model.train()
    before = model.bn.running_mean.copy()
    tc.grad(lambda m, x: tc.sum(m(x)))(model, x)
    np.testing.assert_array_equal(model.bn.running_mean, before)


def test_batch_norm_against_pytorch():
    torch = pytest.importorskip("torch")
    bn, tbn = nn.BatchNorm2d(3), torch.nn.BatchNorm2d(3)
    x = f32(4, 3, 5, 5)
    np.testing.assert_allclose(bn(x), tbn(torch.from_numpy(x)).detach().numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(bn.running_var, tbn.running_var.numpy(), rtol=1e-5)
    conv = nn.Conv2d(3, 4, 3, stride=2, padding=1, groups=1)
    tconv = torch.nn.Conv2d(3, 4, 3, stride=2, padding=1)
    with torch.no_grad():
        tconv.weight.copy_(torch.from_numpy(conv.weight))
        tconv.bias.copy_(torch.from_numpy(conv.bias))
    np.testing.assert_allclose(conv(x), tconv(torch.from_numpy(x)).detach().numpy(), rtol=1e-4, atol=1e-5)


def test_checkpoints_keep_the_running_statistics(tmp_path):
    nn.manual_seed(2)
    model = Net()
    x, y = f32(6, 2, 4, 4), np.arange(6, dtype=np.int32) % 3

    def loss(m, x, y):
        return tc.cross_entropy(m(x), y)

    step = tc.compile_train_step(loss, model, tc.optim.SGD(0.1), x, y)
    step(x, y)
    path = str(tmp_path / "ckpt.safetensors")
    tc.save_checkpoint(path, step)
    trained = step.buffers()["bn.running_var"]
    fresh = Net()
    tc.load_checkpoint(path, fresh)
    np.testing.assert_array_equal(fresh.bn.running_var, trained)
    step(x, y)                                   # moves on; loading puts the saved ones back
    tc.load_checkpoint(path, step)
    np.testing.assert_array_equal(step.buffers()["bn.running_var"], trained)
    np.testing.assert_array_equal(model.bn.running_var, trained)
