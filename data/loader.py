"""
Reading a prepared dataset (data/<dataset>/, written by data/prepare.py): its meta.json and checks,
the reproducible batch sampler, and the tokenizer. Shared by train.py, eval.py, sample.py and
bench.py.

    from data.loader import Batches, load_dataset_meta, open_splits
"""
import hashlib
import json
import os
import time

import numpy as np
import torch

from configurator import ConfigError, UserError, writable_folder
from data import prepare as prep

DATA_DIR = os.path.dirname(os.path.abspath(__file__))   # where dataset folders live unless
                                                        # --data_dir says


class DataError(UserError):
    """Data that is missing, incomplete, corrupt or not the run's own; the message says what to
    do."""


BUILTIN = ('synthetic', 'synthetic_lookup')      # generated here, so prepared on first use


def dataset_folder(cfg):
    """data_dir/dataset (data_dir defaults to this package's folder); dataset is a folder's name."""
    name = cfg.dataset
    if not name or name != os.path.basename(name) or name in ('.', '..'):
        raise ConfigError(f"--dataset={name} is not a dataset name: give the name of a prepared "
                          "data folder "
                          f"(e.g. --dataset=synthetic) and its parent with --data_dir")
    return os.path.join(cfg.data_dir or DATA_DIR, name)


def needs_preparing(cfg):
    """Training on a built-in synthetic corpus prepares it on first use (the quickstart's first
    run)."""
    meta = os.path.join(dataset_folder(cfg), 'meta.json')
    return cfg.dataset in BUILTIN and not os.path.exists(meta)


def check_data_folder(cfg):
    """The dataset is named properly and, where a run will prepare it, its folder can be written."""
    folder = dataset_folder(cfg)
    if needs_preparing(cfg):
        writable_folder(folder, 'data_dir' if cfg.data_dir else 'dataset')


def load_dataset_meta(cfg, master, prepare_missing=True):
    """Check data_dir/<dataset> is completely prepared and return its meta.json. Training
    (prepare_missing) prepares a built-in synthetic corpus that is absent; nothing else prepares
    data: eval and sample name the command that would."""
    folder = dataset_folder(cfg)
    if prepare_missing and needs_preparing(cfg):
        if master:
            print(
                f"no {cfg.dataset} corpus at {folder}: preparing it (python data/prepare.py "
                f"{cfg.dataset})"
            )
            prep.prepare(cfg.dataset, out_dir=folder)
        else:                        # DDP: rank 0 prepares (meta.json is written last); the others
                                     # wait
            deadline = time.time() + 600
            while not os.path.exists(os.path.join(folder, 'meta.json')) and time.time() < deadline:
                time.sleep(0.5)
    try:
        meta = prep.check_prepared(folder)
    except prep.PrepareError as e:
        raise DataError(str(e)) from None
    meta['folder'] = folder
    return meta


def check_data(cfg, meta, ckpt, skip_option=True):
    """Token ids within the vocabulary and, with verify_data, the files' bytes equal to meta.json's
    sha256 (a same-size corruption or a half-finished re-prepare passes the size check alone).
    skip_option: the caller takes --verify_data (train.py), so the error may offer it."""
    if not cfg.verify_data:
        return
    try:
        prep.verify_checksums(meta['folder'], meta)
        prep.check_token_ids(meta['folder'], meta, meta['vocab_size'], "meta.json's vocab_size")
    except prep.PrepareError as e:
        skip = ' (or skip this check with --verify_data=False)' if skip_option else ''
        raise DataError(f"{e}{skip}") from None


def data_identity(meta):
    """What a checkpoint records of its data, to recognise it on resume, stage 2 and eval."""
    out = {k: meta.get(k) for k in ('dataset', 'tokenizer', 'vocab_size', 'source_sha256')}
    out['train_sha256'] = (meta.get('files') or {}).get('train.bin', {}).get('sha256')
    out['vocab_sha256'] = vocab_sha256(meta)
    return out


def vocab_sha256(meta):
    """What token ids mean: the tokenizer and, for char and synthetic data, its symbol list."""
    vocab = [meta.get('tokenizer'), meta.get('chars') or meta.get('itos')]
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()


# a fine-tuning task written in a backbone's vocabulary (prepare.py arith --vocab_from) is other
# data than the backbone's: starting from the backbone needs only the same token ids
VOCAB_IDENTITY = ('tokenizer', 'vocab_size', 'vocab_sha256')


def check_checkpoint_data(cfg, meta, ckpt, keys=None):
    """The data is the one the checkpoint was trained on (what data_identity recorded; `keys`: only
    these of its fields, e.g. VOCAB_IDENTITY); else one line naming the first field that
    differs."""
    cmeta = ckpt.get('data_meta') or {}
    keys = keys or ('dataset', 'tokenizer', 'vocab_size', 'source_sha256', 'train_sha256',
                    'vocab_sha256')
    for k in keys:
        if cmeta.get(k) is not None and cmeta[k] != data_identity(meta).get(k):
            raise DataError(
                f"data field '{k}' differs from the checkpoint's data: checkpoint has "
                f"{cmeta[k]!r}, {meta.get('folder', cfg.dataset)} has "
                f"{data_identity(meta).get(k)!r}; "
                f"use the run's own data (--data_dir/--dataset)"
            )


# which windows Batches.eval_batches draws: raised when that changes, so that an eval figure cached
# under another value (sweep.py's room and score caches) is computed again
EVAL_WINDOWS = 2


class Batches:
    """Stateless, exactly reproducible sampler. Training windows are the (block_size+1)-token
    slices of the token file that start every block_size tokens (their inputs are disjoint; one
    window's last target is the next one's first input), visited in a fresh random order each
    epoch (plus a random shift per epoch); micro-batch j takes rows j·B .. j·B+B-1 of that endless
    sequence. Since a batch is a pure function of (seed, j), resume needs only the iteration
    number, and DDP rank r at micro-step m of iteration i reads j = (i·accum + m)·world + r: ranks
    read disjoint windows, and 1 process with accumulation 2 reads the same batches as 2 processes
    with accumulation 1."""

    def __init__(self, path, np_dtype, block_size, batch_size, seed, device, mask_path=None):
        self.path, self.np_dtype, self.mask_path = path, np_dtype, mask_path
        self.T, self.B, self.seed, self.device = block_size, batch_size, seed, device
        self.n = n = len(np.memmap(path, dtype=np_dtype, mode='r'))
        # window k reads tokens k·T + shift .. k·T + shift + T, shift < T: n ≥ (k + 2)·T
        self.n_windows = (n - block_size) // block_size
        if self.n_windows < 1:
            raise DataError(f"{path} holds {n} tokens, too few for block_size={block_size} "
                            f"(a window at every shift needs {2 * block_size}): lower "
                            "--block_size or prepare a larger split")
        self._perm = {}

    def _epoch(self, e):
        if e not in self._perm:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + e)
            self._perm = {e: (torch.randperm(self.n_windows, generator=g).numpy(),
                              int(torch.randint(0, self.T, (1,), generator=g)))}
        return self._perm[e]

    def starts(self, j):
        rows = np.arange(j * self.B, (j + 1) * self.B)
        out = np.empty(self.B, dtype=np.int64)
        for i, r in enumerate(rows):
            perm, shift = self._epoch(int(r // self.n_windows))
            out[i] = perm[r % self.n_windows] * self.T + shift
        return out

    def fetch(self, starts):
        data = np.memmap(self.path, dtype=self.np_dtype, mode='r')   # re-open: avoids a memmap leak
        x = torch.from_numpy(np.stack([data[s:s + self.T].astype(np.int64) for s in starts]))
        y = torch.from_numpy(
            np.stack([data[s + 1 : s + 1 + self.T].astype(np.int64) for s in starts])
        )
        if self.mask_path is not None:
            y[~torch.from_numpy(self.counted(starts))] = -1          # the loss ignores target -1
        if self.device.type == 'cuda':
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(
                self.device, non_blocking=True
            )
        return x.to(self.device), y.to(self.device)

    def counted(self, starts):
        """(B, T) bool: the targets a loss mask counts (a task's answer tokens, mask 1) whose
        prompt (the mask-0 run before them) starts inside the window: a window cut through a
        problem would otherwise ask for an answer to a prompt it cannot see."""
        mask = np.memmap(self.mask_path, dtype=np.uint8, mode='r')
        rows = []
        for s in starts:
            before = mask[s - 1] if s > 0 else 1                   # token s starts a prompt?
            m = np.concatenate([[before], mask[s : s + 1 + self.T]]).astype(bool)
            prompt_start = ~m[1:-1] & m[:-2]                        # x positions 0..T-1
            rows.append(m[2:] & (np.cumsum(prompt_start) > 0))      # y: tokens s+1..s+T
        return np.stack(rows)

    def get(self, j):
        return self.fetch(self.starts(j))

    def eval_batches(self, n, split_seed, eval_seed=1337):
        """n fixed random batches, the same at every eval and, for a given eval_seed, in every run
        whatever its training seed, so evals and runs are comparable. Their windows start anywhere
        a (block_size+1)-token window fits, so every token of the split can be a target."""
        g = torch.Generator().manual_seed(eval_seed * 7919 + split_seed)
        return [torch.randint(0, self.n - self.T, (self.B,), generator=g).numpy()
                for _ in range(n)]


def open_splits(meta, block_size, batch_size, seed, device):
    """The samplers of a prepared dataset's train and val token files."""
    np_dtype = np.uint32 if meta.get('dtype') == 'uint32' else np.uint16
    return tuple(
        Batches(
            os.path.join(meta['folder'], f'{split}.bin'),
            np_dtype,
            block_size,
            batch_size,
            seed,
            device,
            # a task's loss mask (data/prepare.py arith): the loss counts its answer tokens only
            loss_mask_path(meta, split),
        )
        for split in ('train', 'val')
    )


def loss_mask_path(meta, split):
    """The split's loss mask file (uint8 per token, 1: counted as a target), where the data has
    one."""
    return os.path.join(meta['folder'], f'{split}_loss_mask.bin') if meta.get('loss_mask') else None


def load_tokenizer(meta):
    """(encode, decode) for the tokenizer named in a dataset's meta.json. encode(text, where)
    refuses characters outside a char or synthetic vocabulary with a ConfigError naming `where`
    (e.g. '--start')."""
    tok = meta.get('tokenizer')
    if tok == 'gpt2':
        prep.ensure_tiktoken_cache()
        import tiktoken
        enc = tiktoken.get_encoding('gpt2')
        return (lambda s, where='': enc.encode(s, allowed_special={'<|endoftext|>'})), enc.decode
    if tok == 'byte':
        return (lambda s, where='': list(s.encode('utf-8'))), (
            lambda ids: bytes(ids).decode('utf-8', errors='replace')
        )
    itos = meta['chars'] if tok == 'char' else meta['itos']
    stoi = {s: i for i, s in enumerate(itos)}
    syms = sorted(stoi, key=len, reverse=True)     # synthetic symbols may be multi-character:
                                                   # longest match
    listing = repr(''.join(itos)) if tok == 'char' else ' '.join(itos)
    has = (f"the {tok} vocabulary has {len(itos)} {'characters' if tok == 'char' else 'symbols'}: "
           f"{listing if len(listing) <= 100 else listing[:100] + '...'}")

    def encode(s, where='the prompt'):
        out, unknown, i = [], [], 0
        while i < len(s):
            m = next((t for t in syms if s.startswith(t, i)), None)
            if m is None:
                unknown.append(s[i])
                i += 1
                continue
            out.append(stoi[m])
            i += len(m)
        if unknown:
            unknown = list(dict.fromkeys(unknown))
            shown = ', '.join(map(repr, unknown[:5])) + (
                f' and {len(unknown) - 5} more' if len(unknown) > 5 else ''
            )
            raise ConfigError(
                f"{where} has characters outside the vocabulary: {shown} ({has}); use only those"
            )
        return out
    return encode, (lambda ids: ''.join(itos[i] for i in ids))
