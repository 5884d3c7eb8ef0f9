"""TensorBoard and console logging; silent on every process but rank 0."""
import glob
import logging
import os
import sys
import time

from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm
from torch.utils.tensorboard.summary import hparams

from engine import dist


def setup_console():
    logging.basicConfig(level=logging.INFO if dist.is_main() else logging.WARNING, stream=sys.stdout,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", force=True)


def progress(iterable=None, disable=False, tty_only=False, **kwargs):
    """tqdm with ETA on a terminal; sparse lines in logs and CI; nothing on ranks > 0."""
    tty = sys.stderr.isatty()
    return tqdm(iterable, disable=disable or not dist.is_main() or (tty_only and not tty), dynamic_ncols=True,
                mininterval=0.2 if tty else 30, **kwargs)


def wait_for_a_later_second(log_dir, clock=time.time, sleep=time.sleep):
    """TensorBoard reads a folder's event files in name order, and a name orders by its second, then by
    a counter written without leading zeros ('10' < '9'): a file opened in the same second as an older one
    (a resume in one process) could be read first, and the purge of the crashed steps undone."""
    names = glob.glob(os.path.join(glob.escape(log_dir), "events.out.tfevents.*"))
    seconds = [int(part) for part in (os.path.basename(n).split(".")[3] for n in names) if part.isdigit()]
    later = max(seconds, default=0) + 1
    while clock() < later:
        sleep(later - clock())


class TensorBoard:
    """Silent until it has a folder (given here, or to open: a run's, once its folder is ready)."""

    def __init__(self, log_dir=None, purge_step=None):
        self.writer = None
        self.open(log_dir, purge_step)

    def open(self, log_dir, purge_step=None):
        # purge_step on resume: events logged after the checkpoint, before the crash, are dropped
        if log_dir and dist.is_main():
            wait_for_a_later_second(log_dir)
            self.writer = SummaryWriter(log_dir, purge_step=purge_step)

    def scalars(self, values, step, prefix):
        if self.writer:
            for k, v in values.items():
                self.writer.add_scalar(f"{prefix}/{k}", v, step)

    def text(self, tag, text):
        if self.writer:
            self.writer.add_text(tag, text.replace("\n", "  \n"))

    def hparams(self, params, metrics):
        """Into the run's own event file; metric tags must be scalar tags logged elsewhere."""
        if self.writer:
            for event in hparams(params, metrics):
                self.writer.file_writer.add_summary(event)

    def evaluator_extras(self, evaluator, step, prefix):
        if self.writer:
            evaluator.log_extras(self.writer, step, prefix)

    def close(self):
        if self.writer:
            self.writer.close()
