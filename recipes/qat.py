"""The `qat` recipe: quantization-aware training, torchvision's flow (references/classification/
train_quantization.py), eager mode:

  fuse_model(is_qat=True) -> backend's default QAT qconfig -> prepare_qat -> train with fake
  quantization; observers frozen from `freeze_observers_epoch`, BatchNorm statistics from
  `freeze_bn_epoch` -> convert to int8.

The torch.ao calls, post-training quantization and the int8 artifact live in artifacts.quantization
(shared with quantize.py, export.py and benchmark.py); the model must be quantizable
(`model.quantize: true`, see there).
"""
import contextlib
import logging
import os

from artifacts.quantization import (OnCPU, check_backend, convert_int8, enable_observers, example_inputs,
                                    freeze_bn_stats, freeze_observers, int8_spec, prepare_int8, write_int8_artifact)
from engine import dist
from engine.config import ConfigError
from engine.hooks import Recipe
from engine.registry import RECIPES

log = logging.getLogger(__name__)


@RECIPES.register("qat")
class QAT(Recipe):
    """Quantization-aware training (see the module docstring). Logs val/... for the fake-quantized
    model and val_int8/... for a converted int8 copy evaluated on CPU; at the end writes
    `<output_dir>/<artifact>` (TorchScript + description, artifacts.quantization)."""
    order = 10  # before syncbn, channels_last, amp, ema, ddp, compile: they see the prepared model

    def __init__(self, backend="x86", freeze_observers_epoch=4, freeze_bn_epoch=3, eval_int8=True,
                 artifact="model_int8.pt"):
        self.backend = check_backend(backend, "recipe_args.qat.backend")
        self.freeze_observers_epoch, self.freeze_bn_epoch = freeze_observers_epoch, freeze_bn_epoch
        self.eval_int8, self.artifact = eval_int8, artifact
        self.observers_frozen = self.bn_frozen = False
        self.model = None
        self._int8 = (None, None)  # (step, model): converted once per evaluation

    INCOMPATIBLE = {
        "precise_bn": "precise_bn resets and recomputes BatchNorm statistics, which qat freezes from "
                      "freeze_bn_epoch on (QAT starts from an fp32 checkpoint whose statistics are converged)",
        "amp": "fake quantization runs in float32 (autocast fails in its observers)",
    }

    def setup(self, run):
        for name, why in self.INCOMPATIBLE.items():
            if name in run.cfg.recipes:
                raise ConfigError(f"recipes: qat and {name} do not combine: {why}")
        run.model = prepare_int8(run.model, self.backend, qat=True).to(run.device)
        self.model = run.model
        log.info("qat: %s backend, observers frozen from epoch %d, BatchNorm statistics from epoch %d",
                 self.backend, self.freeze_observers_epoch + 1, self.freeze_bn_epoch + 1)

    def forward_context(self, run):
        # FakeQuantize observers record whatever passes in eval mode too: keep validation data
        # out of the quantization ranges (torchvision's script lets it in for the epochs before
        # the freeze), and evaluation from changing the model.
        if self.model is None or self.model.training or self.observers_frozen:
            return contextlib.nullcontext()
        return self._observers_paused()

    @contextlib.contextmanager
    def _observers_paused(self):
        freeze_observers(self.model)
        try:
            yield
        finally:
            enable_observers(self.model)

    def _apply_freezing(self):
        if self.observers_frozen:
            freeze_observers(self.model)
        if self.bn_frozen:
            freeze_bn_stats(self.model)

    def before_epoch(self, run):
        # Frozen after `freeze_*_epoch` epochs, i.e. from the epoch with that 0-based index on.
        # (torchvision's train_quantization.py sets its flags after training epoch index N, so its
        # observers see one more epoch: its 4/3 are 5/4 here.)
        if run.epoch >= self.freeze_observers_epoch and not self.observers_frozen:
            log.info("qat: freezing quantization observers (epoch %d)", run.epoch + 1)
            self.observers_frozen = True
        if run.epoch >= self.freeze_bn_epoch and not self.bn_frozen:
            log.info("qat: freezing BatchNorm statistics (epoch %d)", run.epoch + 1)
            self.bn_frozen = True
        self._apply_freezing()

    def int8_model(self, run):
        step, model = self._int8
        if step != run.step or model is None:
            model = convert_int8(self.model)
            self._int8 = (run.step, model)
        return model

    def eval_models(self, run):
        return {"int8": OnCPU(self.int8_model(run))} if self.eval_int8 else {}

    def finish(self, run):
        if not dist.is_main() or not self.artifact:
            return
        path = os.path.join(run.output_dir, self.artifact)
        spec = int8_spec(run, method="qat", backend=self.backend, epoch=run.epoch + 1,
                         metrics={k: v for k, v in run.metrics.items() if k.startswith("val_int8/")})
        write_int8_artifact(convert_int8(self.model), path, example_inputs(run.val_loader), spec, run.data)
        log.info("qat: int8 model saved to %s", path)

    def state_dict(self):
        return {"observers_frozen": self.observers_frozen, "bn_frozen": self.bn_frozen, "backend": self.backend}

    def load_state_dict(self, state):
        if state.get("backend", self.backend) != self.backend:
            raise ConfigError(f"qat: the checkpoint was trained for backend {state['backend']!r}, "
                              f"the config asks for {self.backend!r}")
        # Observer flags are buffers and come back with the model; BatchNorm freezing is a plain
        # attribute of the fused modules and does not: re-apply both.
        self.observers_frozen = bool(state.get("observers_frozen", False))
        self.bn_frozen = bool(state.get("bn_frozen", False))
        if self.model is not None:
            self._apply_freezing()

