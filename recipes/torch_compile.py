"""torch.compile of the model, in place (`model.compile()`: the state-dict keys stay the same) and
before DDP wraps it, as torch's "Where to apply torch.compile?" recommends. The first step carries
the compilation; it is logged apart from the step time that follows."""
import logging
import time

from engine.hooks import Recipe
from engine.registry import RECIPES

log = logging.getLogger(__name__)


@RECIPES.register("compile")
class Compile(Recipe):
    order = 75  # after ema (which copies the plain model), before ddp

    def __init__(self, mode=None, dynamic=None, backend="inductor"):
        self.kwargs = dict(mode=mode, dynamic=dynamic, backend=backend)
        self.times = []

    def setup(self, run):
        run.model.compile(**self.kwargs)

    def before_epoch(self, run):
        self.start = time.perf_counter()

    def after_step(self, run):
        if len(self.times) < 2:  # the first step (compilation) and the second (a compiled step)
            now = time.perf_counter()
            self.times.append(now - self.start)
            self.start = now
            if len(self.times) == 2:
                log.info("compile: first step %.1f s (compilation included), then %.3f s per step",
                         *self.times)
