"""The activation_checkpointing recipe: the same gradients and BN statistics with fewer saved bytes,
composed with inplace_abn, and kill -9 / --resume with it (issue 21)."""
import copy

import pytest
import torch
from torchvision.models import resnet18

from engine.config import ConfigError
from recipes.activation_checkpointing import ActivationCheckpointing, apply_checkpointing, default_modules
from recipes.inplace_abn import convert_inplace_abn
from helpers import one_thread  # noqa: F401  (autouse: one torch thread)


def saved_bytes(model, x):
    """Bytes of the unique storages saved for backward during one training forward, and the grads."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).square().sum()
    loss.backward()
    return sum(storages.values())


@pytest.mark.slow
@pytest.mark.parametrize("abn", [False, True])
def test_checkpointed_stages_give_the_same_gradients_and_statistics_with_fewer_saved_bytes(abn):
    torch.manual_seed(0)
    plain = resnet18(num_classes=5)
    if abn:
        convert_inplace_abn(plain)
    model = copy.deepcopy(plain)
    names = apply_checkpointing(model, ["layer1", "layer2", "BasicBlock"])
    assert names == ["layer1", "layer2", "layer3.0", "layer3.1", "layer4.0", "layer4.1"]  # outermost only
    x = torch.randn(2, 3, 64, 64)
    plain_bytes, ckpt_bytes = saved_bytes(plain, x), saved_bytes(model, x)
    assert ckpt_bytes < 0.5 * plain_bytes
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    for (name, a), b in zip(plain.named_buffers(), model.buffers()):  # the recomputation counts no batch twice
        torch.testing.assert_close(b, a, msg=name)
    assert model.state_dict().keys() == plain.state_dict().keys()
    model.eval(), plain.eval()
    torch.testing.assert_close(model(x), plain(x))


def test_family_defaults_and_bad_names():
    from engine.registry import MODELS
    panoptic = MODELS.build("panoptic_fpn_resnet50", num_classes=3, num_stuff_classes=2, min_size=64, max_size=64)
    assert default_modules(panoptic) == [f"backbone.body.layer{i}" for i in range(1, 5)]
    classifier = MODELS.build("mobilenet_v3_small", num_classes=3)
    assert default_modules(classifier)[0] == "net.features.0" and len(default_modules(classifier)) == 13
    with pytest.raises(ConfigError, match="'layer9' is neither a module name nor a module class"):
        apply_checkpointing(panoptic, ["layer9"])
    with pytest.raises(ConfigError, match="list of module names"):
        ActivationCheckpointing(modules="layer1")


def test_benchmark_reports_saved_activation_bytes_per_memory_variant(tmp_path, capsys):
    import json
    import benchmark
    out = tmp_path / "bench.json"
    benchmark.main(["--config", "tests/configs/tiny.yaml", "--set", "data.train_size=16", "data.val_size=8",
                    "data.image_size=32", "data.batch_size=8", "--variants",
                    "fp32,inplace_abn,checkpoint", "--mode", "train", "--steps", "1", "--warmup", "1",
                    "--rounds", "1", "--json", str(out)])
    table = capsys.readouterr().out
    saved = {k: v["saved_for_backward_mb"] for k, v in json.loads(out.read_text())["variants"].items()}
    assert 0 < saved["inplace_abn"] < saved["fp32"] and 0 < saved["checkpoint"] < 0.5 * saved["fp32"]
    assert "saved for backward MB" in table and "train step ms" in table


def test_a_checkpointed_module_with_a_dict_input_reports_the_tensors_it_keeps():
    """torchvision's FPN takes a dict of features: each of them is kept for the recomputation, and
    benchmark.py's saved bytes must count them (record_kept_inputs)."""
    from collections import OrderedDict
    from torchvision.ops.feature_pyramid_network import FeaturePyramidNetwork
    from recipes.activation_checkpointing import record_kept_inputs
    torch.manual_seed(0)
    model = torch.nn.Sequential(FeaturePyramidNetwork([4, 8], 4))
    plain = copy.deepcopy(model)
    apply_checkpointing(model, ["0"])
    feats = OrderedDict(a=torch.randn(1, 4, 8, 8, requires_grad=True), b=torch.randn(1, 8, 4, 4, requires_grad=True))
    with record_kept_inputs([]) as kept:
        out = model(feats)
    assert {t.data_ptr() for t in kept} == {feats["a"].data_ptr(), feats["b"].data_ptr()}
    sum(v.sum() for v in out.values()).backward()
    # the inputs' gradients through the recomputation equal those of the module without checkpointing
    ref = OrderedDict((k, v.detach().clone().requires_grad_()) for k, v in feats.items())
    sum(v.sum() for v in plain(ref).values()).backward()
    for k in feats:
        assert ref[k].grad.abs().sum() > 0
        torch.testing.assert_close(feats[k].grad, ref[k].grad, msg=k)
