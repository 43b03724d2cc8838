"""
Where a training run's records go besides metrics.jsonl: `--log=tensorboard`, `--log=wandb` or
`--log=tensorboard,wandb` (default '': nowhere else). metrics.jsonl stays the source of truth and is
written whatever this option says; each record train.py writes there ('train' every log_interval,
'eval' every eval_interval, the final 'summary') is also sent, at its iteration as the step, as
scalars named <type>/<key> (a list adds /<index>, a dict /<key>: 'train/loss', 'eval/val_loss',
'train/full_frac/0', 'summary/best_val_loss'); text, booleans and None are left out.

  tensorboard  event files in out_dir (torch.utils.tensorboard): tensorboard --logdir=out_dir.
               A fresh run removes the event files of the run it replaces; a resume hides the
               steps after its checkpoint that the killed run had logged (purge_step), as
               metrics.jsonl drops them.
  wandb        a W&B run of project --wandb_project named --wandb_run_name ('' : W&B picks one),
               its config the run's config.json, written under $WANDB_DIR or else out_dir/wandb.
               WANDB_MODE=offline needs no network or account (`wandb sync` uploads it later);
               online, log in first (`wandb login`). A resumed run is a new W&B run.

Only rank 0 logs under DDP (it alone writes metrics.jsonl). The packages are optional: a --log
naming one that is not installed is refused before any work, naming the pip install. W&B is asked
for its run before the model and data are built (its config gains the built model's fields once
they are known): a run that W&B refuses to start (no login, a bad project, no network) is one error
line, before any work and before --overwrite=True removes the run in out_dir; under DDP every rank
stops at once, the others saying that rank 0's error is above (train.setup). A run that fails
after W&B started is finished there with exit code 1. TensorBoard starts once the model is built,
before the run files are opened, and removes the old run's events only once those have replaced
its checkpoint and metrics, so that a failure of either keeps the old run whole.
"""
import glob
import importlib.util
import os

from configurator import ConfigError

SINKS = {'tensorboard': 'tensorboard', 'wandb': 'wandb'}      # --log name -> the package it needs


def check_options(cfg):
    """train.py's logging options, before any work."""
    parse_log(cfg.log)
    if not cfg.wandb_project.strip():
        raise ConfigError("wandb_project is empty; name a W&B project, e.g. "
                          "--wandb_project=nanodepth")


def parse_log(value):
    """The sink names of a --log value ('' : none), each valid and installed, else ConfigError."""
    names = [n.strip() for n in str(value).split(',') if n.strip()]
    for name in names:
        if name not in SINKS:
            raise ConfigError(f"--log={value}: unknown logger {name!r}; give '' (none) or any of "
                              f"{', '.join(SINKS)}, comma-separated")
        if importlib.util.find_spec(SINKS[name]) is None:
            raise ConfigError(f"--log={name} needs the {SINKS[name]} package: "
                              f"pip install {SINKS[name]}")
    return list(dict.fromkeys(names))


def scalars(record):
    """{'<type>/<key>[/<index or key>...]': float} of a metrics record's numbers."""
    out = {}

    def walk(tag, value):
        if isinstance(value, bool) or value is None or isinstance(value, str):
            return
        if isinstance(value, (int, float)):
            out[tag] = float(value)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f'{tag}/{i}', v)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f'{tag}/{k}', v)

    for key, value in record.items():
        if key not in ('type', 'iter'):
            walk(f"{record.get('type', 'record')}/{key}", value)
    return out


class TensorBoard:
    def __init__(self, cfg, iter_num):
        from torch.utils.tensorboard import SummaryWriter
        resumed = cfg.init_from == 'resume'
        # the event files of the run this one replaces, removed once its run files are (replace)
        self.old = [] if resumed else glob.glob(
            os.path.join(glob.escape(cfg.out_dir), 'events.out.tfevents.*'))
        # any resume, an eval-only one too, drops the killed run's records past the checkpoint
        # from metrics.jsonl (train_report.open_run_files): hide the same steps here
        self.writer = SummaryWriter(cfg.out_dir, purge_step=iter_num + 1 if resumed else None)

    def replace(self):
        for old in self.old:
            os.remove(old)
        self.old = []

    def write(self, step, values):
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self, failed=False):
        self.writer.close()


class WandB:
    def __init__(self, cfg, cfg_dict):
        import wandb
        folder = os.environ.get('WANDB_DIR') or cfg.out_dir
        os.makedirs(folder, exist_ok=True)
        try:
            self.run = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name or None,
                                  config=cfg_dict, dir=folder)
        except Exception as e:         # no login, a bad project, no network: W&B's own errors
            reason = (str(e).strip().splitlines() or [''])[0][:200]
            raise ConfigError(f"--log=wandb: W&B could not start a run in project "
                              f"{cfg.wandb_project!r} ({type(e).__name__}: {reason}); check the "
                              f"project name and `wandb login`, or log offline with "
                              f"WANDB_MODE=offline") from None

    def update_config(self, fields):
        self.run.config.update(fields, allow_val_change=True)

    def write(self, step, values):
        self.run.log(values, step=step)

    def close(self, failed=False):
        self.run.finish(exit_code=1 if failed else 0)     # (W&B marks a failed run so)


class Loggers:
    """The sinks --log names (rank 0): W&B, which may refuse the run, starts at construction, before
    any work; open_local(fields, iter_num), once the model is built, gives W&B the built model's
    fields and starts TensorBoard; replace(), once the run files have replaced the old run's,
    removes its TensorBoard events too. write(record) sends a metrics record to each, close(failed)
    ends them (a W&B run that failed is marked so)."""

    def __init__(self, cfg, cfg_dict):
        self.cfg, self.names = cfg, parse_log(cfg.log)
        self.sinks = [WandB(cfg, cfg_dict)] if 'wandb' in self.names else []

    def open_local(self, fields, iter_num):
        for sink in self.sinks:
            sink.update_config(fields)
        if 'tensorboard' in self.names:
            self.sinks.append(TensorBoard(self.cfg, iter_num))

    def replace(self):
        for sink in self.sinks:
            if isinstance(sink, TensorBoard):
                sink.replace()

    def write(self, record):
        values = scalars(record)
        for sink in self.sinks:
            sink.write(record.get('iter', 0), values)

    def close(self, failed=False):
        for sink in self.sinks:
            sink.close(failed)
        self.sinks = []
