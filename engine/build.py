"""From a config to a run: the device, the data and its loaders, the model and its recipes.
train.py, evaluate.py and benchmark.py all start from `build_run`."""
import ctypes
import dataclasses
import itertools
import logging
import os
import platform
import signal
import sys
import threading
from typing import Any, Optional

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler

from engine import dist
from engine.agent_watch import watch_agent
from engine.config import Config, ConfigError
from engine.errors import UserError
from engine.files import write_json
from engine.hooks import RecipeStack
from engine.logger import TensorBoard, setup_console
from engine.registry import DATASETS, MODELS
from engine.seeding import SeededSamples, seed_everything
from engine.transfer import ClassMapError, report_of

log = logging.getLogger(__name__)


def pick_device(name):
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def start_device(name):
    """This process's device for cfg.device, once per run: the process group joined under torchrun,
    and on CUDA the process's own GPU (LOCAL_RANK) made current. A torchrun worker stops when its agent is gone."""
    watch_agent()
    device = pick_device(name)
    _, local_rank, _ = dist.init_distributed(device.type)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    return device


def cpu_name():
    """The CPU's model name (/proc/cpuinfo), else what platform knows of it."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
_malloc_tuned = None


def keep_freed_memory():
    """Let glibc's malloc keep the memory a CPU step frees, for the next step. By default every block
    over 32 MB is mmap'ed when allocated and unmapped when freed, so a step whose activations are that
    large has the kernel fault in (and zero) their pages again at every step: SSDlite at 512 px,
    batch 16, spent 43% of its step in 1.4 M page faults (docs/performance.md, "SSDlite at 512 px").
    Large blocks then come from the heap, and up to 2 GB of freed heap is kept rather than returned,
    as PyTorch's CUDA caching allocator keeps GPU memory: the resident memory stays near its peak.
    Once per process, glibc only (an LD_PRELOADed jemalloc / tcmalloc is left alone: it caches
    already); ZOO_MALLOC=system leaves malloc as it is. Returns whether the setting was applied."""
    global _malloc_tuned
    if _malloc_tuned is None:
        _malloc_tuned = False
        if os.environ.get("ZOO_MALLOC", "").lower() != "system" and sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL("libc.so.6")
                _malloc_tuned = bool(libc.gnu_get_libc_version() and libc.mallopt(_M_MMAP_MAX, 0)
                                     and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
            except (OSError, AttributeError):  # not glibc (musl, ...)
                pass
    return _malloc_tuned


def release_freed_memory():
    """Give the memory kept by keep_freed_memory back to the kernel now (malloc_trim), e.g. before
    measuring a peak resident size. No-op where the setting was not applied."""
    if _malloc_tuned:
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def to_device(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def build_data(cfg, output_dir):
    kwargs = dict(cfg.data.model_extra)
    if "output_dir" in (DATASETS.arguments(cfg.data.name) or []):
        kwargs["output_dir"] = output_dir  # e.g. a tokenizer saved next to the checkpoints
    return DATASETS.build(cfg.data.name, **kwargs)


def build_model(cfg, data):
    """The model of cfg.model, the data's defaults filled in, with model.weights loaded (judged against
    the data's class names: engine.transfer, whose report_of(model) says what was loaded)."""
    kwargs = dict(cfg.model.model_extra)
    accepted = MODELS.arguments(cfg.model.name) or []
    for key, value in data.model_defaults.items():
        if key in accepted and key not in kwargs:
            kwargs[key] = value
    need, given = data.model_defaults.get("num_classes"), kwargs.get("num_classes")
    if need is not None and isinstance(given, int) and given < need:  # labels would index past the outputs
        raise ConfigError(f"model.num_classes is {given} but data set '{cfg.data.name}' needs {need} "
                          f"(its labels); leave model.num_classes unset to take it from the data")
    classes = getattr(data, "classes", None)
    try:
        return MODELS.build_reported(cfg.model.name, kwargs, classes=list(classes) if classes else None)[0]
    except ClassMapError as e:
        raise ConfigError(str(e)) from None


WEIGHTS_REPORT = "weights.json"  # in the run folder: what model.weights loaded, reset and kept


# ---------------------------------------------------------------- samplers and loaders

class ShardSampler(Sampler):
    """Evaluation sharding without the padding DistributedSampler would add: every sample counted once."""

    def __init__(self, n):
        self.indices = range(dist.rank(), n, dist.world_size())

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


class GlobalStepBatches(Sampler):
    """This process's share of a stream of batches that does not depend on the process count: one
    shuffle of the whole training set per epoch (seeded by seed and epoch), cut into batches of
    data.batch_size, and each optimizer step takes the next `per_step` of them (global batch /
    data.batch_size); process r trains on batches r, r + W, ... of the step, one per accumulation
    micro-step. Every global step therefore trains on the same samples on any number of processes
    (with the same global batch); what differs is only how they are split into micro-batches."""

    def __init__(self, batches, world, accumulate):
        self.batches, self.world, self.accumulate = batches, world, accumulate
        self.per_step = world * accumulate

    def __iter__(self):
        steps, rank = len(self.batches) // self.per_step, dist.rank()
        for i, batch in enumerate(self.batches):
            if i >= steps * self.per_step:
                return
            if i % self.world == rank:
                yield batch

    def __len__(self):  # this process's batches: whole steps only
        return len(self.batches) // self.per_step * self.accumulate


class ResumableBatches(Sampler):
    """The epoch's batches, as (epoch seed, index) keys for SeededSamples. On a resume in the middle
    of an epoch the first `skip` are passed over (indices only, no data loaded), so the run sees
    exactly the samples it had not seen yet; the batches from `stop` on (train.max_steps_per_epoch)
    are not drawn, so no sample past the epoch's last step is read. Both hold until reset: DataLoader
    may call iter() more than once per epoch (with workers, it does)."""

    def __init__(self, batches, sampler):
        self.batches, self.sampler, self.skip, self.stop, self.epoch_seed = batches, sampler, 0, None, 0

    def __iter__(self):
        seed = self.epoch_seed
        return ([(seed, i) for i in batch] for batch in itertools.islice(iter(self.batches), self.skip, self.stop))

    def __len__(self):
        return len(self.batches)

    def start_epoch(self, epoch_seed):
        """The epoch's shuffle (the sampler's generator) and its samples' seeds, both from epoch_seed."""
        self.epoch_seed = epoch_seed
        self.sampler.generator.manual_seed(epoch_seed)


def all_skipped(batch):
    """A batch whose every sample was unreadable (data.skip_bad_samples: datasets.base.SkippedBatch)."""
    return getattr(batch, "all_skipped", False)


class NothingReadable(UserError):
    """data.skip_bad_samples left out every batch of a pass over a split: nothing to evaluate on."""


class SkippingLoader(DataLoader):
    """A DataLoader that leaves out the batches whose every sample was unreadable (each sample is
    logged where it is read), for the evaluation and the recipes; the training epoch sets
    `keep_skipped` and counts them at their step (engine.epoch). A pass that leaves out every batch
    is an error naming the files, never an evaluation of nothing."""
    keep_skipped = False

    def __iter__(self):
        batches = super().__iter__()
        return batches if self.keep_skipped else self._readable(batches)

    def start_epoch(self, epoch_seed):
        """The training loader's epoch: its ResumableBatches reseeded (engine.seeding.start_epoch_data)."""
        self.batch_sampler.start_epoch(epoch_seed)

    @staticmethod
    def _readable(batches):
        left_out, kept = [], 0
        for batch in batches:
            if all_skipped(batch):
                left_out += batch.skipped
            else:
                kept += 1
                yield batch
        if left_out and not kept:
            raise NothingReadable(f"every sample read is unreadable (data.skip_bad_samples left them all out): "
                                  f"{'; '.join(f'{s.where} ({s.reason})' for s in left_out)}")


def loader_workers(setting, device):
    """data.workers: a number, or auto. On CPU the intra-op threads spin on every core and a worker
    process preempts them (docs/performance.md, "Loader workers"), so small CPUs load in the main
    process; GPUs get a worker per spare core."""
    if setting != "auto":
        return setting
    cores = len(os.sched_getaffinity(0)) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if device.type == "cuda":
        return min(8, max(1, cores - 1))
    return 0 if cores <= 4 else min(4, cores // 8)


def ignore_stop_signals(worker_id):
    """A loader worker leaves stop requests to the main process, which decides when to stop: SLURM
    and Kubernetes send SIGTERM to the whole process group, and a worker killed by it would fail the
    run. SIGINT is ignored; SIGTERM is waited for by a thread, and ends the worker only when its main
    process sent it (DataLoader's and multiprocessing's way of ending workers)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    main = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads started later inherit it

    def wait():
        while True:
            if signal.sigwaitinfo({signal.SIGTERM}).si_pid == main:
                os._exit(0)  # a clean exit: not a worker failure to the DataLoader

    threading.Thread(target=wait, name="sigterm", daemon=True).start()


def build_loaders(cfg, data, seed, device=torch.device("cpu")):
    # one shuffle for all processes, its generator reseeded every epoch (engine.seeding.start_epoch_data):
    # the stream of global steps survives a resume, on any number of processes
    sampler = RandomSampler(data.train, generator=torch.Generator())
    if data.train_batch_sampler:
        batches = data.train_batch_sampler(data.train, sampler, cfg.data.batch_size)
    else:
        batches = BatchSampler(sampler, cfg.data.batch_size, drop_last=True)
    batches = GlobalStepBatches(batches, dist.world_size(), cfg.optim.accumulate_steps)
    workers = loader_workers(cfg.data.workers, device)
    # each loader draws its workers' base seed from its own generator, not from the global RNG
    # (dropout's), so that the training's random draws do not depend on data.workers
    common = dict(num_workers=workers, collate_fn=data.collate_fn, pin_memory=device.type == "cuda",
                  persistent_workers=workers > 0, worker_init_fn=ignore_stop_signals if workers else None)
    train = SkippingLoader(SeededSamples(data.train), batch_sampler=ResumableBatches(batches, sampler),
                           generator=torch.Generator().manual_seed(seed), **common)
    val = SkippingLoader(data.val, batch_size=cfg.data.eval_batch_size or cfg.data.batch_size,
                         sampler=ShardSampler(len(data.val)), generator=torch.Generator().manual_seed(seed), **common)
    return train, val


# ---------------------------------------------------------------- the run

@dataclasses.dataclass(eq=False)
class Run:
    """What a run holds. Recipes read and may replace `model` (in setup) and `scaler`; the loop owns
    the rest. `optimizer` and `scheduler` exist once training starts (not in evaluate.py)."""
    cfg: Config
    device: torch.device
    data: Any                        # datasets.base.DataSplits
    output_dir: str
    model: torch.nn.Module
    recipes: RecipeStack
    train_loader: DataLoader
    val_loader: DataLoader
    scaler: torch.amp.GradScaler
    tb: TensorBoard
    optimizer: Optional[torch.optim.Optimizer] = None
    scheduler: Optional[torch.optim.lr_scheduler.LRScheduler] = None
    epoch: int = 0                   # the epoch running (0-based)
    step: int = 0                    # optimizer steps done
    batches_done: int = 0            # batches of this epoch done (a step checkpoint mid-epoch)
    skip: int = 0                    # batches of the resumed epoch to pass over
    best: Optional[float] = None     # the best val/<train.best_metric> so far
    metrics: dict = dataclasses.field(default_factory=dict)  # the last evaluation's
    stop: bool = False               # a stop was requested on some process: all stop at this step
    stop_signal: Optional[str] = None  # the signal this process received
    eval_pending: bool = False       # resumed from the checkpoint written before an evaluation
    inference: bool = False          # built to evaluate or infer only: recipes time no training step
    limits: Any = None               # engine.limits.Limits: epochs, early stopping, a time budget (training only)
    weights: Optional[dict] = None   # what model.weights loaded, reset and kept (engine.transfer; weights.json)
    batch_split: Optional[list] = None  # data.batch_size, optim.accumulate_steps as configured (engine.world)

    def training_forward(self, model, batch):
        return training_forward(model, batch, self)


def training_forward(model, batch, run):
    """The loss dict of one batch: on the device, under the recipes' forward context."""
    inputs, targets = to_device(batch, run.device)
    with run.recipes.forward_context(run):
        return model(run.recipes.prepare_inputs(inputs), targets)


def build_run(cfg, output_dir, data=None, recipe_states=None, inference=False, device=None):
    """Device, data, model, recipes and loaders for a config. `data`: DataSplits already built from
    the same config (benchmark.py reuses them). `recipe_states`: a checkpoint's state["recipes"],
    given to the recipes before their setup (amp applies the precision stored there instead of
    measuring). `inference`: the run only evaluates or infers (a recipe that must measure times
    inference, not training steps). `device`: start_device's, when the caller started it already
    (train: the run folder is prepared under the process group first). The run's TensorBoard is
    silent until opened (engine.loop opens it in the run folder)."""
    device = device or start_device(cfg.device)
    rank, world = dist.rank(), dist.world_size()
    setup_console()
    if device.type == "cpu":
        keep_freed_memory()
    if cfg.seed is not None:
        seed_everything(cfg.seed, rank)
        torch.backends.cudnn.benchmark = False
    data = data or build_data(cfg, output_dir)
    recipe_names = cfg.recipes + (["ddp"] if world > 1 and "ddp" not in cfg.recipes else [])
    recipes = RecipeStack(recipe_names, cfg.recipe_args)
    model = build_model(cfg, data)
    weights = report_of(model)
    model = model.to(device)
    if weights and not inference and output_dir:
        dist.on_main(write_json, os.path.join(output_dir, WEIGHTS_REPORT), weights)
    train_loader, val_loader = build_loaders(cfg, data, cfg.seed or 0, device)
    run = Run(cfg=cfg, device=device, data=data, output_dir=output_dir, model=model, recipes=recipes,
              train_loader=train_loader, val_loader=val_loader, tb=TensorBoard(),
              scaler=torch.amp.GradScaler(device.type, enabled=False), inference=inference, weights=weights)
    if recipe_states:
        run.recipes.restore_before_setup(recipe_states)
    run.recipes.setup(run)
    return run
