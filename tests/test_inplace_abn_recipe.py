"""The inplace_abn recipe: which pairs convert, what the converted model computes, what it refuses,
and kill -9 / --resume with it (issue 21, acceptances 1-5 for the recipe)."""
import copy
import os
import signal

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models import resnet50
from torchvision.models.resnet import Bottleneck

from engine.config import ConfigError
from models.inplace_abn import InPlaceABN, InPlaceAGN
from recipes.inplace_abn import InPlaceABNRecipe, convert_inplace_abn
from helpers import one_thread  # noqa: F401  (autouse: one torch thread)
from helpers import assert_same_weights, run_main, script, wait_for, weights


class LeakyPairsBottleneck(Bottleneck):
    """What the conversion must compute: leaky ReLU 0.01 after bn1, bn2 and the shortcut's sum."""

    def forward(self, x):
        out = F.leaky_relu(self.bn1(self.conv1(x)), 0.01)
        out = F.leaky_relu(self.bn2(self.conv2(out)), 0.01)
        out = self.bn3(self.conv3(out))
        return F.leaky_relu(out + (x if self.downsample is None else self.downsample(x)), 0.01)


@pytest.mark.slow
def test_resnet50_converts_its_block_pairs_and_computes_batchnorm_with_leaky_relu():
    torch.manual_seed(0)
    plain = resnet50(num_classes=10).double()  # float64: 50 layers deep, rounding would hide a real difference
    converted, reference = copy.deepcopy(plain), copy.deepcopy(plain)
    done, kept = convert_inplace_abn(converted)
    # bn1 / bn2 / bn3 (+ shortcut) of the 16 bottlenecks, and the 4 shortcut BNs (identity: their output is kept)
    assert len(done) == 16 * 3 + 4
    assert ("bn1", "not in a layout this recipe knows to be safe") in kept  # ResNet.forward's stem: not a Sequential
    assert {n for n, what in done if "identity" in what} == {f"layer{i}.0.downsample.1" for i in range(1, 5)}
    assert all("leaky ReLU 0.01" in what for n, what in done if "downsample" not in n)  # the model change, per pair
    converted.load_state_dict(plain.state_dict())  # the BN parameters map one to one
    assert converted.state_dict().keys() == plain.state_dict().keys()
    for m in reference.modules():
        if type(m) is Bottleneck:
            m.__class__ = LeakyPairsBottleneck
            with torch.no_grad():  # InPlace-ABN's documented scale |w| + eps (w = 1 here)
                for bn in (m.bn1, m.bn2, m.bn3) + ((m.downsample[1],) if m.downsample is not None else ()):
                    bn.weight += bn.eps
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    for model in (converted, reference):
        model.train()
        model(x).square().sum().backward()
    for (name, a), b in zip(converted.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-8, msg=name)
    for (name, a), b in zip(converted.named_buffers(), reference.buffers()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8, msg=name)
    converted.eval(), reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(converted(x), reference(x), rtol=1e-6, atol=1e-8)


def test_panoptic_mobilenet_converts_only_its_relu_pairs():
    from engine.registry import MODELS
    model = MODELS.build("panoptic_fpn_mobilenet_v3_large", num_classes=4, num_stuff_classes=3, min_size=64,
                         max_size=64, fpn_channels=32)
    state = copy.deepcopy(model.state_dict())
    done, kept = convert_inplace_abn(model)
    bns = [n for n, what in done if "InPlaceABN" in what]
    # the expand and depthwise Conv-BN-ReLU of blocks 1-6 (block 1 has no expansion); Hardswish does not invert
    assert len(bns) == 11 and all(n.startswith("backbone.body.") and n.split(".")[2] in "123456" for n in bns)
    hardswish = {n for n, why in kept if why == "Hardswish is not invertible"}
    assert "backbone.body.0.1" in hardswish and len(hardswish) == 20
    assert sum(why == "no activation follows it" for _, why in kept) == 15  # the projections
    # the semantic head's Conv-GN-ReLU stages: 1 + 1 + 2 + 3 for the levels of stride 4, 8, 16, 32
    gns = [n for n, what in done if "InPlaceAGN" in what]
    assert len(gns) == 7 and all(n.startswith("semantic_head.scale_heads.") for n in gns)
    model.load_state_dict(state)
    assert sum(isinstance(m, InPlaceABN) for m in model.modules()) == 11
    assert sum(isinstance(m, InPlaceAGN) for m in model.modules()) == 7


def test_semantic_head_group_norm_pairs_compute_group_norm_with_leaky_relu():
    """Panoptic FPN's semantic head (Conv -> GN -> ReLU stages) converted: the same outputs and
    gradients as GN (scale |w| + eps) + leaky ReLU 0.01, a GroupNorm state dict loads, and
    `group_norm=False` keeps every GN."""
    from models.panoptic import SemanticHead
    torch.manual_seed(0)
    plain = SemanticHead(16, 5, channels=16, groups=4).double()
    with torch.no_grad():
        for m in plain.modules():
            if isinstance(m, nn.GroupNorm):
                m.weight.uniform_(0.5, 1.5), m.bias.uniform_(-0.5, 0.5)
    converted, reference = copy.deepcopy(plain), copy.deepcopy(plain)
    assert convert_inplace_abn(copy.deepcopy(plain), group_norm=False)[0] == []
    done, kept = convert_inplace_abn(converted)
    assert len(done) == 7 and kept == [] and all("ReLU became leaky ReLU 0.01" in what for _, what in done)
    converted.load_state_dict(plain.state_dict())
    for m in reference.modules():
        if isinstance(m, nn.Sequential):
            for i, child in enumerate(m):
                if isinstance(child, nn.ReLU):
                    m[i] = nn.LeakyReLU(0.01)
                elif isinstance(child, nn.GroupNorm):
                    with torch.no_grad():
                        child.weight += child.eps
    feats = [torch.randn(2, 16, 32 // 2 ** i, 32 // 2 ** i, dtype=torch.float64) for i in range(4)]
    outs = [model([f.clone() for f in feats]) for model in (converted, reference)]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-9, atol=1e-10)
    for out in outs:
        out.square().sum().backward()
    for (name, a), b in zip(converted.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-7, atol=1e-9, msg=name)


def test_fpn_output_blocks_convert_to_identity_and_compute_batchnorm():
    """torchvision's FPN with BatchNorm (maskrcnn_resnet50_fpn_v2's): the output blocks' BNs become
    InPlace-ABN(identity); the lateral ones (their output is summed, not kept) stay."""
    from torchvision.ops.feature_pyramid_network import FeaturePyramidNetwork
    torch.manual_seed(0)
    plain = FeaturePyramidNetwork([8, 16], 8, norm_layer=nn.BatchNorm2d).double()
    converted = copy.deepcopy(plain)
    done, kept = convert_inplace_abn(converted)
    assert [n for n, _ in done] == ["layer_blocks.0.1", "layer_blocks.1.1"]
    assert {n for n, why in kept if why == "no activation follows it"} == {"inner_blocks.0.1", "inner_blocks.1.1"}
    with torch.no_grad():
        for block in plain.layer_blocks:
            block[1].weight += block[1].eps
    x = {"a": torch.randn(2, 8, 16, 16, dtype=torch.float64), "b": torch.randn(2, 16, 8, 8, dtype=torch.float64)}
    for model in (plain, converted):
        sum(v.square().sum() for v in model(x).values()).backward()
    for (name, a), b in zip(converted.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-8, msg=name)


def test_unsafe_pairs_are_refused():
    seq = nn.Sequential(nn.BatchNorm2d(3), nn.ReLU(),                   # input not a convolution's
                        nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3), nn.ReLU6(),  # not invertible
                        nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3), nn.ReLU(),   # negative weight
                        nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3), nn.ELU())    # converts
    with torch.no_grad():
        seq[6].weight[1] = -0.5
    done, kept = convert_inplace_abn(seq)
    assert [n for n, _ in done] == ["9"] and isinstance(seq[9], InPlaceABN) and seq[9].activation == "elu"
    assert [n for n, _ in kept] == ["0", "3", "6"]
    assert "not a convolution" in kept[0][1] and "ReLU6" in kept[1][1] and "negative" in kept[2][1]


def test_recipe_refuses_a_model_without_pairs():
    class FakeRun:
        model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3), nn.Hardswish())
        cfg = type("C", (), {"model": type("M", (), {"name": "toy"})})
        recipes = None
    with pytest.raises(ConfigError, match="no norm layer \\+ activation pair.*Hardswish"):
        InPlaceABNRecipe().setup(FakeRun)


@pytest.mark.process
@pytest.mark.parametrize("recipes", ["inplace_abn,channels_last", "activation_checkpointing,inplace_abn"])
def test_train_with_the_memory_recipes_resumes_after_kill9_bit_identical(tmp_path, recipes):
    """acceptance 5: a real kill -9 mid epoch 2, then --resume, equals the straight run bit for bit."""
    common = [f"recipes=[_fault,{recipes}]", "checkpoint.every_n_steps=2"]
    assert run_main(tmp_path / "straight", *common, "recipe_args._fault={kind: none}") is None
    fault = f"recipe_args._fault={{kind: block, rank: 0, step: 11, pid_file: {tmp_path / 'pid'}}}"
    proc = script(tmp_path / "run", *common, fault)
    os.kill(wait_for(tmp_path / "pid", proc, timeout=600), signal.SIGKILL)  # a loaded machine
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert run_main(tmp_path / "run", *common, fault, flags=["--resume"]) is None
    assert_same_weights(weights(tmp_path / "straight" / "last.pt"), weights(tmp_path / "run" / "last.pt"))


def test_inference_form_computes_what_the_converted_model_computes_in_eval():
    """inplace_abn's model in eval as ordinary layers (BN / GN with weight |w| + eps, then the leaky
    ReLU): the ResNet blocks with the shortcut inside, the Sequential pairs and the GN pairs."""
    from engine.registry import MODELS
    from recipes.inplace_abn import inference_form
    torch.manual_seed(0)
    models = [resnet50(num_classes=10),
              MODELS.build("panoptic_fpn_mobilenet_v3_large", num_classes=4, num_stuff_classes=3, min_size=64,
                           max_size=64, fpn_channels=32).backbone]
    from models.panoptic import SemanticHead
    models.append(SemanticHead(16, 5, channels=16, groups=4))
    inputs = [torch.randn(2, 3, 64, 64), torch.randn(2, 3, 64, 64),
              [torch.randn(2, 16, 32 // 2 ** i, 32 // 2 ** i) for i in range(4)]]
    for model, x in zip(models, inputs):
        model = model.double()
        convert_inplace_abn(model)
        with torch.no_grad():  # statistics and weights away from their initial values, some near zero
            for m in model.modules():
                if isinstance(m, (InPlaceABN, InPlaceAGN)):
                    m.weight.uniform_(0.0, 1.5), m.bias.uniform_(-0.5, 0.5)
                    m.weight[0] = 0.0
                    if isinstance(m, InPlaceABN):
                        m.running_mean.uniform_(-0.5, 0.5), m.running_var.uniform_(0.5, 2.0)
        model.eval()
        x = [t.double() for t in x] if isinstance(x, list) else x.double()
        with torch.no_grad():
            want = model([t.clone() for t in x] if isinstance(x, list) else x.clone())
            assert inference_form(model) > 0
            got = model([t.clone() for t in x] if isinstance(x, list) else x.clone())
        assert not any(isinstance(m, (InPlaceABN, InPlaceAGN)) for m in model.modules())
        for a, b in zip(*(list(o.values()) if isinstance(o, dict) else [o] for o in (got, want))):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_a_checkpoint_trained_with_inplace_abn_loads_into_the_model_it_was_trained_in(tmp_path):
    """evaluate.py / predict.py / export.py build the model from the checkpoint's config: with
    inplace_abn that is the converted model (leaky ReLU 0.01), not the unconverted one (ReLU)."""
    import tiny_runs
    from artifacts.load import load_run
    from engine.build import build_model
    from engine.config import config_from_data
    checkpoint = tiny_runs._train(tmp_path, {"name": "mobilenet_v3_small", "dropout": 0.0},
                                  {"name": "synthetic_classification", "num_classes": 4, "train_size": 32,
                                   "val_size": 8, "image_size": 32}, recipes=["inplace_abn", "precise_bn"])
    cfg_dict, state, data, model = load_run(checkpoint)
    assert not any(isinstance(m, (InPlaceABN, InPlaceAGN)) for m in model.modules())
    assert any(isinstance(m, nn.LeakyReLU) for m in model.modules())
    cfg = config_from_data(cfg_dict)
    trained = build_model(cfg, data)
    convert_inplace_abn(trained)
    trained.load_state_dict(state["model"])
    unconverted = build_model(cfg, data)
    unconverted.load_state_dict(state["model"])
    x = torch.stack([data.val[i][0] for i in range(8)])
    with torch.no_grad():
        got, want, relu = model(x), trained.eval()(x.clone()), unconverted.eval()(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # float32, another order of operations
    print("max |unconverted - trained| logit", (relu - want).abs().max().item())
    assert (relu - want).abs().max() > 1e-2  # what evaluating the wrong model would give


def test_group_norm_false_keeps_every_group_norm_even_where_its_output_is_kept():
    """An FPN with GroupNorm output blocks: identity InPlace-AGN by default, untouched with group_norm=False."""
    import functools
    from torchvision.ops.feature_pyramid_network import FeaturePyramidNetwork
    fpn = FeaturePyramidNetwork([8, 16], 8, norm_layer=functools.partial(nn.GroupNorm, 4))
    done, kept = convert_inplace_abn(copy.deepcopy(fpn), group_norm=False)
    assert done == [] and {n for n, why in kept if "group_norm: false" in why} >= {"layer_blocks.0.1", "layer_blocks.1.1"}
    done, _ = convert_inplace_abn(fpn)
    assert [n for n, what in done if what.startswith("InPlaceAGN(identity)")] == ["layer_blocks.0.1", "layer_blocks.1.1"]
