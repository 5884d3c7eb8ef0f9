"""Measuring a model's variants on this machine (benchmark.py's library): precision, memory format,
compile, int8 and TorchScript variants of a config's (or a checkpoint's) model, the real training loop
against a bare one, and the data loader. benchmark.py's docstring says what each figure means."""
import itertools
import os
import statistics
import tempfile
import time

import torch

from artifacts.load import load_int8, open_checkpoint
from artifacts.quantization import check_quantizable, int8_spec, ptq, write_int8_artifact
from commands.cli import run_or_exit
from engine import dist
from engine.build import build_data, build_run, cpu_name, release_freed_memory, to_device
from engine.checkpoint import load_model_state
from engine.config import load_config
from engine.epoch import steps_per_epoch, train_one_epoch
from engine.errors import UserError
from engine.files import write_json
from engine.optim import build_optimizer, build_scheduler
from engine.registry import MODELS
from engine.seeding import torch_seeded
from recipes.activation_checkpointing import record_kept_inputs

PRECISION_RECIPES = ("amp", "channels_last", "compile", "qat")
MEMORY_RECIPES = ("inplace_abn", "inplace_abn_sync", "activation_checkpointing")  # their args are kept
TOKENS = ("fp32", "bf16", "fp16", "channels_last", "fp32_depthwise", "compile", "int8", "script", "inplace_abn",
          "checkpoint")


def add_arguments(p):
    """benchmark.py's options (also benchmarks/quant_latency.py's, which sets them)."""
    p.add_argument("--config", help="YAML config (with --checkpoint: instead of the one saved in it)")
    p.add_argument("--checkpoint", help="a checkpoint of train.py: its config and weights")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="override config keys")
    p.add_argument("--force", action="store_true", help="with --checkpoint: measure although --config or --set "
                   "differ from the checkpoint's config in model, data or preprocessing")
    p.add_argument("--variants", default="fp32,channels_last,bf16,bf16+channels_last",
                   help="comma-separated; tokens joined by '+': " + ", ".join(TOKENS))
    p.add_argument("--mode", choices=("train", "infer", "both"), default="both")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant and round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (median and spread over them)")
    p.add_argument("--loop", action="store_true", help="also time the real loop, a bare loop and the loader")
    p.add_argument("--loop-steps", type=int, help="steps per round of --loop (default: one whole epoch, as "
                   "training runs it: an epoch's start-up costs are spread over its steps)")
    p.add_argument("--json", help="write the results here too")
    return p


class BenchmarkError(UserError, ValueError):
    """A variant that cannot be measured as asked."""


def parse_variant(text):
    tokens = [t for t in text.strip().split("+") if t]
    unknown = [t for t in tokens if t not in TOKENS]
    if unknown or not tokens:
        raise BenchmarkError(f"--variants: unknown token(s) {unknown or [text]} in {text!r} (known: {', '.join(TOKENS)})")
    return tokens


def variant_config(cfg, tokens):
    names = [r for r in cfg.recipes if r not in PRECISION_RECIPES + MEMORY_RECIPES]
    args = {k: v for k, v in cfg.recipe_args.items() if k not in PRECISION_RECIPES}
    for dtype in ("bf16", "fp16"):
        if dtype in tokens:
            names.append("amp")
            args["amp"] = {"dtype": {"bf16": "bfloat16", "fp16": "float16"}[dtype],
                           "fp32_depthwise": "fp32_depthwise" in tokens}
    names += [t for t in ("channels_last", "compile", "inplace_abn") if t in tokens]
    names += ["activation_checkpointing"] if "checkpoint" in tokens else []
    return cfg.model_copy(update={"recipes": names, "recipe_args": args})


# ---------------------------------------------------------------- peak memory

def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif os.path.exists("/proc/self/clear_refs"):
        release_freed_memory()  # what the last variant freed and malloc kept is not this one's peak
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the peak resident set size


def peak_mb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
    except (OSError, StopIteration):
        return float("nan")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def saved_activation_bytes(run, batch):
    """Bytes of the unique storages one training step keeps for backward: what autograd saves
    (torch.autograd.graph.saved_tensors_hooks) plus the inputs activation checkpointing keeps itself;
    the model's parameters and buffers are not activations and are left out. The step's backward runs
    (so the graph is freed), its optimizer step does not."""
    model = run.model
    model.train()
    state = {t.untyped_storage().data_ptr() for t in itertools.chain(model.parameters(), model.buffers())}
    storages = {}

    def count(t):
        s = t.untyped_storage()
        if s.data_ptr() not in state and s.device.type != "meta":
            storages[s.data_ptr()] = s.nbytes()

    def pack(t):
        count(t)
        return t
    inputs, targets = batch
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), record_kept_inputs([]) as kept, \
            run.recipes.forward_context(run):
        losses = model(run.recipes.prepare_inputs(inputs), targets)
    for t in kept:
        count(t)
    run.optimizer.zero_grad(set_to_none=True)
    run.scaler.scale(sum(losses.values())).backward()
    run.optimizer.zero_grad(set_to_none=True)
    return sum(storages.values())


# ---------------------------------------------------------------- what is timed

def first(inputs, n=1):
    """The first n samples of a batch of inputs (a tensor, or a list/tuple of per-image tensors)."""
    return inputs[:n] if isinstance(inputs, torch.Tensor) else type(inputs)(inputs[:n])


def bare_train_steps(run, batches, n):
    """The bare loop: forward, backward, optimizer step on pre-loaded batches; seconds for n steps."""
    model = run.model
    model.train()
    sync(run.device)
    start = time.perf_counter()
    for i in range(n):
        inputs, targets = batches[i % len(batches)]
        with run.recipes.forward_context(run):
            losses = model(run.recipes.prepare_inputs(inputs), targets)
        loss = sum(losses.values())
        run.optimizer.zero_grad(set_to_none=True)
        run.scaler.scale(loss).backward()
        run.scaler.step(run.optimizer)
        run.scaler.update()
    sync(run.device)
    return time.perf_counter() - start


@torch.inference_mode()
def infer_steps(run, model, batches, n, batch_size=None, plain=False):
    """Seconds for n eval-mode forwards (of the first batch_size samples); plain: no recipes."""
    model.eval()
    sync(run.device)
    start = time.perf_counter()
    for i in range(n):
        inputs = batches[i % len(batches)][0]
        inputs = first(inputs, batch_size) if batch_size else inputs
        if plain:
            model(inputs)
        else:
            with run.recipes.forward_context(run):
                model(run.recipes.prepare_inputs(inputs))
    sync(run.device)
    return time.perf_counter() - start


def int8_model(run, batches):
    """A post-training quantized copy (x86 backend), for models with a quantizable variant."""
    cfg = run.cfg
    check_quantizable(cfg.model.name)
    kwargs = {**run.data.model_defaults, **cfg.model.model_extra, "quantize": True}
    q = MODELS.build(cfg.model.name, **kwargs)
    q.load_state_dict(run.model.state_dict())
    return ptq(q, [(b[0], None) for b in batches[:2]], "x86")[0]


def torchscript_model(run, model, batches, int8):
    """The model as its TorchScript file runs it (an int8 one exactly as quantize.py writes it)."""
    example = first(batches[0][0], 2)
    if not isinstance(example, torch.Tensor):
        raise BenchmarkError("script: the model takes a list of inputs (a detector?): only tensor-input models trace")
    if int8:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "int8.pt")
            write_int8_artifact(model, path, example.cpu(), int8_spec(run, "ptq", "x86"), run.data)
            return load_int8(path)[0]
    with torch.no_grad():
        return torch.jit.freeze(torch.jit.trace(model.eval(), example))


class Variant:
    def __init__(self, name, cfg, data, batches, workdir, weights=None):
        self.name, self.tokens = name, parse_variant(name)
        self.run = build_run(variant_config(cfg, self.tokens), workdir, data=data)
        if weights is not None:
            load_model_state(dist.unwrap(self.run.model), weights, "--checkpoint")
        self.run.optimizer = build_optimizer(self.run.model, cfg.optim)
        self.batches = [to_device(b, self.run.device) for b in batches]
        self.infer_only = "int8" in self.tokens or "script" in self.tokens  # no training, no recipes
        self.model = int8_model(self.run, self.batches) if "int8" in self.tokens else self.run.model
        if "script" in self.tokens:
            self.model = torchscript_model(self.run, self.model, self.batches, "int8" in self.tokens)
        self.times = {"train": [], "infer_batch": [], "infer_1": []}
        self.peak = {"train": 0.0, "infer": 0.0}
        self.first_step_s = self.saved_mb = None

    def train(self, n):
        return bare_train_steps(self.run, self.batches, n)

    def infer(self, n, batch_size=None):
        return infer_steps(self.run, self.model, self.batches, n, batch_size, plain=self.infer_only)


def batch_len(batch):
    return len(batch[1])


def spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure_variants(args, cfg, data, batches, workdir, weights=None):
    variants = [Variant(v.strip(), cfg, data, batches, workdir, weights) for v in args.variants.split(",")
                if v.strip()]
    bs = batch_len(batches[0])
    train = args.mode in ("train", "both")
    infer = args.mode in ("infer", "both")
    for v in variants:  # warm-up (the first step of compile is its compile time)
        if train and not v.infer_only:
            v.first_step_s = v.train(1)
            v.train(args.warmup)
            # the same random draws for every variant (a detector samples proposals): the bytes compare
            v.saved_mb = torch_seeded(0, saved_activation_bytes, v.run, v.batches[0]) / 2**20
        if infer:
            v.infer(args.warmup)
            v.infer(args.warmup, 1)
    for _ in range(args.rounds):
        for v in variants:
            if train and not v.infer_only:
                reset_peak(v.run.device)
                v.times["train"].append(args.steps * bs / v.train(args.steps))
                v.peak["train"] = max(v.peak["train"], peak_mb(v.run.device))
            if infer:
                reset_peak(v.run.device)
                v.times["infer_batch"].append(v.infer(args.steps) / args.steps * 1000)
                v.times["infer_1"].append(v.infer(args.steps, 1) / args.steps * 1000)
                v.peak["infer"] = max(v.peak["infer"], peak_mb(v.run.device))
    results = {}
    for v in variants:
        results[v.name] = {k: spread(t) for k, t in v.times.items() if t}
        results[v.name].update(peak_mb=v.peak, first_train_step_s=v.first_step_s, saved_for_backward_mb=v.saved_mb,
                               batch=bs)
    return results


class BareStepBeforeEachBatch:
    """The real train loader, which runs one bare step (timed apart) before handing over each of an
    epoch's `steps` batches: the real loop and the bare loop interleaved step by step, so that both
    see the same machine (a small cloud CPU's speed drifts by 2x within seconds; whole-epoch
    alternation left the ratio's rounds between 0.77 and 1.19)."""

    def __init__(self, loader, run, bare, steps):
        self.loader, self.run, self.bare, self.steps = loader, run, bare, steps
        self.seconds, self.count = 0.0, 0  # bare steps run, and their time, since the last reset

    def __getattr__(self, name):  # batch_sampler, num_workers, ...: the real loader's
        return getattr(self.loader, name)

    def __len__(self):
        return len(self.loader)

    def __iter__(self):  # no more than the epoch's steps: no bare step for a batch the loop won't train on
        for i, batch in enumerate(itertools.islice(self.loader, self.steps)):
            self.seconds += bare_train_steps(self.run, [self.bare[i % len(self.bare)]], 1)
            self.count += 1
            yield batch


def measure_loop(args, cfg, data, workdir, weights=None, recipe_states=None):
    """The real loop (train_one_epoch: loader, recipes, logging, progress) against a bare loop on
    pre-loaded batches, same model and optimizer, interleaved step by step; then the loader alone.
    recipe_states: a checkpoint's (amp runs with its stored precision, nothing timed)."""
    run = build_run(cfg, workdir, data=data, recipe_states=recipe_states)
    if weights is not None:
        load_model_state(dist.unwrap(run.model), weights, "--checkpoint")
    epoch_steps = steps_per_epoch(run)
    steps = args.loop_steps or epoch_steps
    cfg = run.cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"max_steps_per_epoch": steps})})
    if getattr(data.train, "cache", None) is not None and run.train_loader.num_workers == 0:
        for i in range(len(data.train)):  # the in-memory image cache, as a run has it after its first epoch
            data.train[i]
    run.optimizer = build_optimizer(run.model, cfg.optim)
    # the run's schedule (a config with train.budget alone: one epoch's)
    run.scheduler = build_scheduler(run.optimizer, cfg.sched, cfg.train.epochs or 1, epoch_steps)
    real_loader = run.train_loader
    loader = iter(real_loader)
    bare = [to_device(next(loader), run.device) for _ in range(min(steps, 16))]  # the bare loop cycles these
    del loader
    samples = steps * batch_len(bare[0])
    interleaved = run.train_loader = BareStepBeforeEachBatch(real_loader, run, bare, steps)
    loop_rate, bare_rate = [], []
    for r in range(args.rounds + 1):  # the first round warms up
        run.epoch, interleaved.seconds, interleaved.count = r, 0.0, 0
        start = time.perf_counter()
        train_one_epoch(run)
        sync(run.device)
        if r:
            loop_rate.append(samples / (time.perf_counter() - start - interleaved.seconds))
            bare_rate.append(samples / interleaved.seconds)
    run.train_loader = real_loader
    loader_rate = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        n = sum(batch_len(b) for b, _ in zip(run.train_loader, range(steps)))
        loader_rate.append(n / (time.perf_counter() - start))
    ratio = [a / b for a, b in zip(loop_rate, bare_rate)]
    return {"loop_samples_per_s": spread(loop_rate), "bare_samples_per_s": spread(bare_rate),
            "loop_over_bare": spread(ratio), "loader_samples_per_s": spread(loader_rate),
            "loader_over_training": statistics.median(loader_rate) / statistics.median(loop_rate),
            "workers": run.train_loader.num_workers, "steps": steps, "bare_steps_per_round": interleaved.count}


# ---------------------------------------------------------------- report

def fmt(s, digits=1):
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def markdown(results, loop, header):
    names = list(results)
    base = results[names[0]]
    lines = [header, "", "| variant | train samples/s | vs first | train step ms | saved for backward MB | vs first "
             "| peak MB train / infer | infer ms (batch) | infer ms (1) | vs first (1) | first step s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in names:
        r = results[name]
        tr, ib, i1 = r.get("train"), r.get("infer_batch"), r.get("infer_1")
        saved, base_saved = r.get("saved_for_backward_mb"), base.get("saved_for_backward_mb")
        cells = [name, fmt(tr, 3 if tr and tr["median"] < 1 else 1) if tr else "-",
                 f"{tr['median'] / base['train']['median']:.2f}x" if tr and base.get("train") else "-",
                 f"{1000 * r['batch'] / tr['median']:.0f}" if tr else "-",
                 f"{saved:.1f}" if saved is not None else "-",
                 f"{saved / base_saved:.2f}x" if saved is not None and base_saved else "-",
                 f"{r['peak_mb']['train']:.0f} / {r['peak_mb']['infer']:.0f}",
                 fmt(ib, 2) if ib else "-", fmt(i1, 2) if i1 else "-",
                 f"{base['infer_1']['median'] / i1['median']:.2f}x" if i1 and base.get("infer_1") else "-",
                 f"{r['first_train_step_s']:.2f}" if r["first_train_step_s"] is not None else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Median over rounds (min-max). Ratios: speed-up over the first variant; saved for backward: "
              "the activation bytes one training step keeps for backward (unique storages), against the first."]
    if loop:
        lines += ["", "| real loop samples/s | bare loop samples/s | loop / bare | loader samples/s | "
                  "loader / training |", "|---|---|---|---|---|",
                  f"| {fmt(loop['loop_samples_per_s'])} | {fmt(loop['bare_samples_per_s'])} | "
                  f"{fmt(loop['loop_over_bare'], 3)} | {fmt(loop['loader_samples_per_s'])} | "
                  f"{loop['loader_over_training']:.1f}x |"]
    return "\n".join(lines) + "\n"


def config_and_weights(args):
    """(config, weights or None, recipe states or None): --config, or a checkpoint's config
    (artifacts.config), weights and recipes' saved states."""
    if not args.checkpoint:
        if not args.config:
            raise BenchmarkError("give --config, or --checkpoint to measure a trained model")
        return load_config(args.config, args.set), None, None
    state, cfg = open_checkpoint(args.checkpoint, args.config, args.set, args.force)
    return cfg, state["model"], state.get("recipes")


def measure(args, cfg, weights, recipe_states=None):
    """(results, loop results or None, the first batch) of every variant (and --loop)."""
    with tempfile.TemporaryDirectory() as workdir:
        data = build_data(cfg, workdir)
        run = build_run(variant_config(cfg, ["fp32"]), workdir, data=data)
        loader = iter(run.train_loader)
        batches = [next(loader) for _ in range(min(4, len(run.train_loader)))]
        del loader, run
        results = measure_variants(args, cfg, data, batches, workdir, weights)
        loop = measure_loop(args, cfg, data, workdir, weights, recipe_states) if args.loop else None
    return results, loop, batches[0]


def run_benchmark(args):
    """Measure, print the table, write --json: (results, loop results or None). UserError on a bad request."""
    cfg, weights, recipe_states = config_and_weights(args)
    for v in args.variants.split(","):
        parse_variant(v)
    results, loop, batch = measure(args, cfg, weights, recipe_states)
    device = "cuda" if torch.cuda.is_available() and cfg.device != "cpu" else "cpu"
    cpu = cpu_name()
    header = (f"**{cfg.model.name}** on {cfg.data.name}, batch {batch_len(batch)}, {device}, {cpu}, "
              f"{torch.get_num_threads()} threads, torch {torch.__version__}; {args.rounds} rounds x "
              f"{args.steps} steps after {args.warmup} warm-up")
    text = markdown(results, loop, header)
    print(text)
    if args.json:
        write_json(args.json, {"config": args.config, "checkpoint": args.checkpoint, "overrides": args.set, "cpu": cpu,
                               "device": device, "threads": torch.get_num_threads(), "torch": torch.__version__,
                               "variants": results, "loop": loop}, indent=2)
    dist.cleanup()
    return results, loop


def main(args):
    """benchmark.py's parsed arguments (add_arguments): run_benchmark, a UserError as one `error:` line."""
    return run_or_exit(run_benchmark, args)
