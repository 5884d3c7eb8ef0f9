"""The hook interface and the stack that calls hooks in order."""
import contextlib

from engine.registry import RECIPES


class Recipe:
    """Hooks the loop calls. `run` carries model, optimizer, device, loaders, scaler, epoch, step."""
    order = 50  # lower runs first

    def restore_before_setup(self, state):
        """A checkpoint's state of this recipe (what its state_dict() returned), given before setup when
        a run is built for a checkpoint (evaluation, benchmark, resume): what setup would otherwise decide
        by measuring (amp's precision). load_state_dict still follows on resume."""

    def setup(self, run):
        """After the model is on its device, before the optimizer is built. May replace run.model."""

    def as_trained(self, model):
        """A model built from a trained run's config (evaluate, predict, export), before the checkpoint's
        weights load: change it in place as setup did where that changes what the weights compute."""

    def for_inference(self, model):
        """After those weights loaded: the model in place as ordinary inference layers."""

    def forward_context(self, run):
        return contextlib.nullcontext()

    def prepare_inputs(self, inputs):
        return inputs

    def before_epoch(self, run):
        pass

    def after_step(self, run):
        pass

    def before_eval(self, run):
        pass

    def eval_models(self, run):
        """Extra models to evaluate next to the trained one: {suffix: model}."""
        return {}

    def finish(self, run):
        """After the last epoch."""

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class RecipeStack:
    def __init__(self, names, args):
        built = [RECIPES.build(name, **args.get(name, {})) for name in names]
        self.recipes = sorted(built, key=lambda r: r.order)
        self.names = {id(r): n for r, n in zip(built, names)}

    def __iter__(self):
        return iter(self.recipes)

    def restore_before_setup(self, states):
        for r in self.recipes:
            if self.names[id(r)] in states:
                r.restore_before_setup(states[self.names[id(r)]])

    def setup(self, run):
        for r in self.recipes:
            r.setup(run)

    def as_trained(self, model):
        for r in self.recipes:
            r.as_trained(model)

    def for_inference(self, model):
        for r in self.recipes:
            r.for_inference(model)

    @contextlib.contextmanager
    def forward_context(self, run):
        with contextlib.ExitStack() as stack:
            for r in self.recipes:
                stack.enter_context(r.forward_context(run))
            yield

    def prepare_inputs(self, inputs):
        for r in self.recipes:
            inputs = r.prepare_inputs(inputs)
        return inputs

    def before_epoch(self, run):
        for r in self.recipes:
            r.before_epoch(run)

    def after_step(self, run):
        for r in self.recipes:
            r.after_step(run)

    def before_eval(self, run):
        for r in self.recipes:
            r.before_eval(run)

    def eval_models(self, run):
        extra = {}
        for r in self.recipes:
            extra.update(r.eval_models(run))
        return extra

    def finish(self, run):
        for r in self.recipes:
            r.finish(run)

    def state_dict(self):
        return {self.names[id(r)]: r.state_dict() for r in self.recipes}

    def load_state_dict(self, state):
        for r in self.recipes:
            if self.names[id(r)] in state:
                r.load_state_dict(state[self.names[id(r)]])
