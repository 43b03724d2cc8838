"""
Export a trained dense nanodepth model as a Hugging Face transformers GPT-2 folder.

    python export_hf.py --out_dir=out/quickstart_dense --to=hf/quickstart_dense
    python -c "from transformers import AutoModelForCausalLM as M; M.from_pretrained('hf/...')"

Writes config.json, model.safetensors and generation_config.json (what transformers'
save_pretrained writes for GPT2LMHeadModel) into a temporary folder beside --to (inside it where
it is a mount point: the files move in by os.replace, within one filesystem), loads them back
with AutoModelForCausalLM and prints the largest logit difference from nanodepth's forward on a
random batch (--check=False skips that), then moves them into --to; a difference past 1e-4 of the
largest logit is an error that leaves --to as it was. A --to that holds files is refused unless
--overwrite=True (files of the same names are replaced), and a run folder (one holding ckpt.pt,
metrics.jsonl or run_info.json, whose config.json is the run's own) or one holding a PEFT adapter
(adapter_config.json: transformers would load that adapter instead) always. The mapping is
model.py's GPT.from_pretrained run backwards: the same names, and HF's Conv1D weights
transposed. What GPT-2 cannot hold is mapped exactly or refused:
  bias=False   HF GPT-2 always has biases: they are written as zeros (the same function)
  gelu         'none' (exact) -> activation_function 'gelu'; 'tanh' -> 'gelu_new'
  pos='rope'   refused: GPT-2 has learned absolute positions only
  block_size   -> n_positions; vocab_size as the model has it (padding rows included)
The tokenizer is not written: a run on GPT-2 BPE data (tokenizer 'gpt2') reads with
AutoTokenizer.from_pretrained('gpt2'); the char and synthetic vocabularies are in the data's
meta.json.

A routed model (route != 'none') is refused: no transformers architecture holds its routing.
--dense_backbone=True exports its dense backbone instead (embeddings, blocks' attention and full
FFNs, ln_f, LM head), dropping every family's own modules. That is the model with every routed
decision forced open (model(idx, force='full')), not the routed model:
  ffn       the cheap low-rank FFNs and the gates go; every token takes the full FFN in every layer
  mod       the routers (and predictors) go; every token runs every block, unscaled by the router
  halt      the halting routers go; no block is skipped or scaled
  exit      the exit heads go; no token exits early: the logits are the last layer's
  ensemble  the per-layer norms and the mixing router go; the logits are the last layer's, ln_f
The export prints which tensors it dropped.
"""
import os
import re
import shutil
import tempfile

import torch

from checkpoint import load_checkpoint, load_model
from configurator import (ConfigError, asks_help, load_config, print_help, run_cli, source_group,
                          writable_folder)
from files import run_file_in

DEFAULTS = dict(
    out_dir='out/quickstart',       # the run folder holding ckpt.pt
    to='',                          # the folder to write the Hugging Face model into
    dense_backbone=False,           # a routed model: export its dense backbone (see above)
    overwrite=False,                # write into a --to that already holds files
    check=True,                     # load the export back and compare its logits with ours
)
# nanodepth's dense weights, the names GPT-2 has too (model.py's from_pretrained reads the same)
DENSE_KEY = re.compile(r'(lm_head|transformer\.(wte|wpe|ln_f|h\.\d+\.(ln_1|attn|ln_2|mlp)))\.')
# HF's Conv1D stores these as (in, out), nn.Linear as (out, in)
TRANSPOSED = ('attn.c_attn.weight', 'attn.c_proj.weight', 'mlp.c_fc.weight', 'mlp.c_proj.weight')
GPT2_EOS = 50256                    # '<|endoftext|>' of the GPT-2 tokenizer


def check_config(argv):
    """The options, each checked before any work: the checkpoint exists, --to can be written."""
    cfg = load_config(DEFAULTS, argv)
    to = cfg['to']
    if not to:
        raise ConfigError("--to is empty; name the folder to write, e.g. --to=hf/mymodel")
    if os.path.islink(to) and not os.path.exists(to):
        raise ConfigError(f"--to={to} is a link to {os.readlink(to)}, a path that does not "
                          "exist; create that folder or name another --to")
    writable_folder(to, 'to')
    # export() writes first in a temporary folder there: a writable --to is not enough
    staging = staging_folder(to)
    where = 'inside' if staging == os.path.realpath(to) else 'beside'     # (a mount point: inside)
    writable_folder(staging, 'to', label=f"--to={to} (written first in a temporary folder {where} "
                                         "it)")
    run_file = run_file_in(to)
    if run_file:                                        # --overwrite or not
        raise ConfigError(f"--to={to} holds a training run ({run_file}), whose config.json "
                          "the export would replace; export into a folder of its own, e.g. "
                          f"--to={os.path.join(to, 'hf')}")
    # (an export stopped in a mount point leaves its temporary folder there: not the user's files)
    held = [n for n in os.listdir(to) if not n.startswith(STAGING_PREFIX)] if os.path.isdir(to) \
        else []
    if held and not cfg['overwrite']:
        raise ConfigError(f"--to={to} already holds files; pick another folder or pass "
                          "--overwrite=True (files of the same names are replaced)")
    if 'adapter_config.json' in held:       # transformers would load that adapter's base model
        raise ConfigError(f"--to={to} holds a PEFT adapter (adapter_config.json), which "
                          "transformers loads in place of the exported model (on its own base "
                          "model); remove it or export into another folder")
    if os.path.isfile(cfg['out_dir']):        # e.g. the checkpoint file itself
        raise ConfigError(f"--out_dir={cfg['out_dir']} is a file; --out_dir names the run's "
                          f"folder: --out_dir={os.path.dirname(cfg['out_dir']) or '.'}")
    path = os.path.join(cfg['out_dir'], 'ckpt.pt')
    if not os.path.isfile(path):
        raise ConfigError(f"no checkpoint at {path}; --out_dir names a run folder, e.g. "
                          "--out_dir=out/quickstart")
    return cfg


STAGING_PREFIX = '.export-'          # export()'s temporary folder


def staging_folder(to):
    """Where export() makes its temporary folder: on the filesystem of `to`, as os.replace, which
    moves the files in, cannot cross filesystems. Beside the folder `to` names (beside a link's
    target, not the link), or inside it where it is a mount point, beside which lies another
    filesystem."""
    real = os.path.realpath(to)
    return real if os.path.ismount(real) else os.path.dirname(real)


def import_transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError("export_hf.py needs transformers: pip install transformers "
                          "safetensors") from None
    return transformers


def check_exportable(model_args, dense_backbone):
    """One line naming what GPT-2 cannot hold, or None."""
    route = model_args.get('route', 'none')
    if route != 'none' and not dense_backbone:
        return (f"route={route}: no transformers architecture holds this family's routing, so "
                "the routed model cannot be exported; --dense_backbone=True exports its dense "
                "backbone (every routed decision forced open, see export_hf.py's docstring)")
    if model_args.get('pos', 'learned') != 'learned':
        return (f"pos={model_args['pos']!r}: GPT-2 has learned absolute positions only, so a "
                "model trained with rotary positions has no GPT-2 equivalent")
    return None


def gpt2_config(transformers, c, tokenizer):
    """The GPT-2 config of nanodepth config c; bos/eos are GPT-2's own only on GPT-2 BPE data."""
    eos = GPT2_EOS if tokenizer == 'gpt2' and c.vocab_size > GPT2_EOS else None
    return transformers.GPT2Config(
        vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer,
        n_head=c.n_head, n_inner=4 * c.n_embd,
        activation_function='gelu_new' if c.gelu == 'tanh' else 'gelu',
        resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.dropout,
        layer_norm_epsilon=1e-5, tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos)


def hf_state_dict(model, hf_keys):
    """nanodepth's dense weights under HF GPT-2's names (hf_keys: what GPT2LMHeadModel holds), and
    the names of the tensors left out (the family's own modules)."""
    sd = model.state_dict()
    out = {}
    for k in hf_keys:
        if k in sd:
            out[k] = sd[k].t().contiguous() if k.endswith(TRANSPOSED) else sd[k]
        elif k.endswith('.bias') and k[:-len('bias')] + 'weight' in sd:
            out[k] = torch.zeros(sd[k[:-len('bias')] + 'weight'].shape[0])   # bias=False
    unused = sorted(k for k in sd if DENSE_KEY.match(k) and k not in out)
    if unused or set(hf_keys) - set(out):
        raise RuntimeError(f"export_hf: names do not match: ours {unused[:4]}, HF's "
                           f"{sorted(set(hf_keys) - set(out))[:4]}")
    return out, sorted(k for k in sd if not DENSE_KEY.match(k))


def export(model, to, tokenizer=None, check=None):
    """Write model's dense backbone to folder `to` as a GPT-2 model; returns the names dropped.
    Written in a temporary folder on the filesystem of `to` (staging_folder), then moved in file
    by file; check (optional): a function of that folder called first, whose
    exception leaves `to` as it was."""
    transformers = import_transformers()
    hf = transformers.GPT2LMHeadModel(gpt2_config(transformers, model.config, tokenizer))
    state, dropped = hf_state_dict(model, list(hf.state_dict()))
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != 'lm_head.weight']:     # lm_head: tied to wte
        raise RuntimeError(f"export_hf: GPT-2 did not take {missing + unexpected}")
    parent = staging_folder(to)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=parent)
    try:
        hf.save_pretrained(tmp, safe_serialization=True)
        if check is not None:
            check(tmp)
        os.makedirs(to, exist_ok=True)
        for name in os.listdir(tmp):
            os.replace(os.path.join(tmp, name), os.path.join(to, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dropped


@torch.no_grad()
def largest_difference(model, to, seed=0):
    """max |HF logits - nanodepth logits| (routed models: every decision forced full) on a random
    batch of 2 full-length rows, and the largest |logit| for scale."""
    transformers = import_transformers()
    hf = transformers.AutoModelForCausalLM.from_pretrained(to).eval()
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, model.config.vocab_size, (2, model.config.block_size), generator=g)
    ours = model.eval()(idx, last_only=False, force='full')[0].float()
    theirs = hf(idx).logits.float()
    return (ours - theirs).abs().max().item(), ours.abs().max().item()


def main(argv):
    if asks_help(argv):
        return print_help(__doc__, 'python export_hf.py --out_dir=RUN --to=DIR [--key=value ...]',
                          [source_group('export_hf.py options', DEFAULTS, (__file__, 'DEFAULTS'))])
    cfg = check_config(argv)
    ckpt_path = os.path.join(cfg['out_dir'], 'ckpt.pt')
    ckpt = load_checkpoint(ckpt_path)
    refusal = check_exportable(ckpt['model_args'], cfg['dense_backbone'])
    if refusal:
        raise ConfigError(refusal)
    # before any work: a missing package is one line; its progress bars would only add noise here
    import_transformers().utils.logging.disable_progress_bar()
    model = load_model(ckpt, 'cpu', ckpt_path).float().eval()
    tokenizer = (ckpt.get('data_meta') or {}).get('tokenizer')
    checked = []

    def check(folder):          # before the files replace anything in --to
        diff, scale = largest_difference(model, folder)
        if diff > 1e-4 * max(1.0, scale):
            raise RuntimeError(f"the exported model's logits differ from nanodepth's by {diff}; "
                               f"--to={cfg['to']} is left as it was")
        checked.append((diff, scale))

    dropped = export(model, cfg['to'], tokenizer, check if cfg['check'] else None)
    print(f"wrote {cfg['to']} ({', '.join(sorted(os.listdir(cfg['to'])))}): GPT-2, "
          f"{model.config.n_layer} layers, d={model.config.n_embd}, "
          f"vocab {model.config.vocab_size}, n_positions {model.config.block_size}")
    if dropped:
        print(f"dense backbone of route={model.config.route}: dropped {len(dropped)} tensors of "
              f"its routing ({', '.join(dropped[:3])}{', ...' if len(dropped) > 3 else ''})")
    for diff, scale in checked:
        print(f"check: AutoModelForCausalLM loads it; max |logit difference| {diff:.2e} "
              f"(largest |logit| {scale:.1f})")
    return 0


if __name__ == '__main__':
    run_cli(main)
