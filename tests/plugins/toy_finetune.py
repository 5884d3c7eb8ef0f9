"""A toy model family kept outside the repository's packages that declares its class-dependent
parameters at registration (tests/test_finetune_weights.py): its builder takes no `weights`, yet
model.weights, model.new_classes and model.class_map apply to it as to the zoo's families."""
import torch.nn.functional as F
from torch import nn

from engine.registry import MODELS, Range
from engine.transfer import Rows


class TinyPixelClassifier(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, num_classes, 1))

    def forward(self, images, masks=None):
        logits = self.body(images)
        if self.training:
            return {"loss_ce": F.cross_entropy(logits, masks)}
        return logits


# "_": a test's own model (tests/test_structure.py leaves its declarations alone)
@MODELS.register("_toy_finetune_net", task="semantic_segmentation", quantizable=False, exports=(),
                 ranges={"num_classes": Range(ge=2)}, class_params={"body.2": Rows()})
def toy_finetune_net(num_classes=2):
    return TinyPixelClassifier(num_classes)
