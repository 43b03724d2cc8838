"""Prepare a dataset for nanodepth: token ids in flat binary files plus meta.json.

    python data/prepare.py synthetic [--seed=1337] [--num_tokens=2000000]
        [--mix=copy=0.3,count=0.2,noise=0.2,add=0.3]
    python data/prepare.py synthetic_lookup [--mix=copy=0.2,count=0.1,noise=0.1,add=0.2,lookup=0.4]
    python data/prepare.py shakespeare_char [--input=FILE]
        # default ../shared/data/tinyshakespeare.txt, else download
    python data/prepare.py enwik8 [--input=enwik8|enwik8.zip]
        # else download mattmahoney.net/dc/enwik8.zip
    python data/prepare.py fineweb_edu [--input=F.parquet|F.jsonl|F.txt] [--max_docs=100000]
        [--val_fraction=0.005]
    python data/prepare.py text --input=FILE [--tokenizer=char|byte|gpt2] [--val_fraction=0.1]
        [--name=NAME]
    common options: --out_dir=DIR (default data/<dataset>, or data/<name>),
        --dtype=auto|uint16|uint32, --quiet=True (no progress bar over the tokenisation; there is
        none off a terminal either), --overwrite=True (replace a dataset in the folder that other
        options prepared; the same options just rewrite the same files)

Writes train.bin, val.bin (and test.bin for enwik8): raw little-endian token ids, uint16 unless
vocab_size > 65535 (then uint32); read with np.memmap(path, dtype=meta["dtype"], mode="r").
meta.json is written last and lists every file with its byte size and sha256, so a folder without
a meta.json, or whose files do not match it, is incomplete: check_prepared(folder) says so and
prints the command to run; verify_checksums(folder) also compares the sha256s, check_token_ids the
token ids with a vocabulary size. Every file is written to a temporary name and renamed into place,
and prepares into one folder take turns (a lock on <out>/.prepare.lock while one writes, where
fcntl exists); a rerun with the same arguments and input gives byte-identical files (nothing
time-based is stored).

Documents (fineweb_edu, text with --tokenizer gpt2): a .parquet gives its `text` column, a .jsonl
the `text` field of each line, a .txt file is split into documents at lines that hold only
<|endoftext|> (no such line: the whole file is one document). GPT-2 BPE (tiktoken, encode_ordinary)
with the EOT token 50256 appended after every document. fineweb_edu puts the last val_fraction of
the documents (at least one) in val; `text` cuts its token stream at (1 - val_fraction).

Synthetic grammar (34 one-character tokens: digits 0-9, letters a-p, and | C N R A > + =).
The stream is a sequence of segments, each followed by the separator "|". A segment starts with
a kind letter and a length digit L in 1..9 (both sampled: the kind from --mix, L uniformly):
    copy   C L x1..xL > x1..xL            x: uniform random letters; after ">" they are repeated
    count  N L s t1..tL                   s: uniform random digit; t_i = (s + i) mod 10
    noise  R L x1..xL                     x: uniform random letters
    add    A L a1..aL + b1..bL = c1..cL+1 a, b: uniform random digits; c = a + b; all three numbers
                                          are written least-significant digit first, c has L+1
                                          digits (the last is the final carry, possibly 0)
    lookup L L k1 k1' v1 .. kL kL' vL     k, k': uniform random letters a-h; v = table[k][k'], a
                                          fixed letter table drawn from the corpus seed
                                          (lookup_table)
e.g. "C3kap>kap|N478901|R2fp|A247+38=751|" (74 + 83 = 157). The lookup kind is in the mix of
synthetic_lookup only (`python data/prepare.py synthetic_lookup`; 35 tokens with "L"), whose values
only a memorised 64-entry table predicts: work for a full-width FFN that a low-rank one cannot do.
Each split is its own stream of whole segments (train from seed (seed, 0), val from (seed, 1)),
stopped once it holds >= its share
(90/10) of --num_tokens. train_difficulty.bin / val_difficulty.bin (uint8, one per token) give the
class of the TARGET token i, i.e. how hard token i is to predict from tokens < i:
    0 structure  "|", ">", "+", "=": their place is fixed by the kind and L
    1 trivial    copied letters and counting digits t_i: a lookup of earlier tokens
    2 noise      the random letters x and digits s, a, b: best loss is log 16 resp. log 10
    3 hard       the sum digits c: multi-digit addition with carries
    4 header     the kind letter and L: sampled from the mix and from 1..9
    5 recall     the lookup values v (synthetic_lookup only): a function of the two letters before
"""
import argparse
import hashlib
import io
import json
import os
import re
import shlex
import sys
import urllib.request
import zipfile
from pathlib import Path

import numpy as np

DATA_DIR = Path(__file__).resolve().parent
REPO_ROOT = DATA_DIR.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: the repository's modules are its parent's
    sys.path.append(str(REPO_ROOT))
from configurator import ConfigError, writable_folder  # noqa: E402
from files import remove_stale_temps, run_file_in, taking_turns, write_whole  # noqa: E402
from progress import progress  # noqa: E402
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
SHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
ENWIK8_URL = "http://mattmahoney.net/dc/enwik8.zip"
GPT2_EOT = 50256
TIKTOKEN_FILES = {"vocab.bpe": "6d1cbeee0f20b3d9449abfede4726ed8212e3aee",
                  "encoder.json": "6c7ea1a7e38e3a7f062df639a5b80947f075ffe6"}
COMMON_DEFAULTS = {"dtype": "auto"}
DEFAULTS = {
    "synthetic": {
        "seed": 1337,
        "num_tokens": 2_000_000,
        "mix": "copy=0.3,count=0.2,noise=0.2,add=0.3",
    },
    # the same grammar with lookup segments, whose values only a memorised table predicts: the FFN's
    # job
    "synthetic_lookup": {
        "seed": 1337,
        "num_tokens": 2_000_000,
        "mix": "copy=0.2,count=0.1,noise=0.1,add=0.2,lookup=0.4",
    },
    "shakespeare_char": {"input": None},
    "enwik8": {"input": None},
    "fineweb_edu": {"input": None, "max_docs": 100_000, "val_fraction": 0.005},
    "text": {"input": None, "tokenizer": "char", "val_fraction": 0.1, "name": None},
    "arith": {"seed": 1337, "digits": 3, "ops": "+-", "num_problems": 20_000, "answer": "plain",
              "pad": False, "vocab_from": None, "tokenizer": None},
}


class PrepareError(Exception):
    """Bad input or an incomplete dataset folder; the message says what to do."""


# ----------------------------------------------------------------------------- synthetic corpus
SYMBOLS = list("0123456789abcdefghijklmnop|CNRA>+=")
SEP, GT, PLUS, EQ = (SYMBOLS.index(c) for c in "|>+=")
KINDS = ["copy", "count", "noise", "add", "lookup"]
# 'L' (the lookup kind) and the 'recall' class exist only in corpora whose mix has lookup segments,
# so the default corpus keeps its 34 tokens and 5 classes
KIND_TOKENS = [SYMBOLS.index(c) for c in "CNRA"] + [len(SYMBOLS)]
LOOKUP_SYMBOLS = SYMBOLS + ["L"]
LOOKUP_KEYS = 8          # key letters a-h: a table of 8 x 8 = 64 pairs, small enough to memorise on
                         # a CPU
DIFFICULTY_CLASSES = ["structure", "trivial", "noise", "hard", "header"]
LOOKUP_CLASSES = DIFFICULTY_CLASSES + ["recall"]
STRUCT, TRIVIAL, NOISE, HARD, HEADER, RECALL = range(6)


def parse_mix(mix):
    """'copy=0.3,count=0.2,...' -> probabilities in KINDS order (missing kinds get 0)."""
    weights, given = dict.fromkeys(KINDS, 0.0), set()
    for item in filter(None, (s.strip() for s in str(mix).split(","))):
        key, _, value = item.partition("=")
        if key.strip() not in weights:
            raise PrepareError(
                f"--mix: unknown segment kind {key.strip()!r}; kinds are {', '.join(KINDS)}"
            )
        if key.strip() in given:
            raise PrepareError(f"--mix: kind {key.strip()!r} is given twice in {mix!r}; give "
                               "each kind once")
        given.add(key.strip())
        try:
            weights[key.strip()] = float(value)
        except ValueError:
            raise PrepareError(f"--mix: {item!r} is not kind=weight (e.g. copy=0.3)") from None
    w = np.array([weights[k] for k in KINDS])
    if not np.all(np.isfinite(w)) or (w < 0).any() or w.sum() <= 0:
        raise PrepareError(f"--mix {mix!r}: weights must be >= 0 and not all 0")
    return w / w.sum()


def lookup_table(seed):
    """The lookup kind's fixed table: a pair of letters -> a letter, the same in every split of a
    corpus."""
    return np.random.default_rng([seed, 7]).integers(10, 26, size=(26, 26)).tolist()


def generate_synthetic(num_tokens, seed, mix=DEFAULTS["synthetic"]["mix"], table=None):
    """Whole segments until >= num_tokens tokens; seed is an int or a list of ints (numpy
    SeedSequence); table: lookup_table(...) for mixes with lookup segments. Returns (tokens,
    difficulty), two uint8 arrays of the same length."""
    probs, rng = parse_mix(mix), np.random.default_rng(seed)
    if probs[4] > 0 and table is None:
        table = lookup_table(0)
    toks, cls = [], []
    while len(toks) < num_tokens:
        n_seg = 16 + (num_tokens - len(toks)) // 8  # more than needed; unused draws are dropped
        kinds, lens = (
            rng.choice(5, size=n_seg, p=probs).tolist(),
            rng.integers(1, 10, size=n_seg).tolist(),
        )
        letters, pl = rng.integers(10, 26, size=9 * n_seg).tolist(), 0
        digits, pd = rng.integers(0, 10, size=18 * n_seg).tolist(), 0
        # drawn last and only for lookup mixes, so the other mixes' streams are what they always
        # were
        keys, pk = (
            (rng.integers(10, 10 + LOOKUP_KEYS, size=18 * n_seg).tolist() if probs[4] > 0 else []),
            0,
        )
        for kind, n in zip(kinds, lens):
            if kind == 0:    # copy
                x, pl = letters[pl:pl + n], pl + n
                body, c = x + [GT] + x, [NOISE] * n + [STRUCT] + [TRIVIAL] * n
            elif kind == 1:  # count
                s, pd = digits[pd], pd + 1
                body, c = [s] + [(s + i) % 10 for i in range(1, n + 1)], [NOISE] + [TRIVIAL] * n
            elif kind == 2:  # noise
                body, pl, c = letters[pl:pl + n], pl + n, [NOISE] * n
            elif kind == 4:  # lookup: n key pairs, each followed by its value in the fixed table
                body, c = [], []
                for a, b in zip(keys[pk:pk + 2 * n:2], keys[pk + 1:pk + 2 * n:2]):
                    body += [a, b, table[a][b]]
                    c += [NOISE, NOISE, RECALL]
                pk += 2 * n
            else:            # add, least-significant digit first
                a, b, pd = digits[pd:pd + n], digits[pd + n:pd + 2 * n], pd + 2 * n
                total, carry = [], 0
                for da, db in zip(a, b):
                    carry, d = divmod(da + db + carry, 10)
                    total.append(d)
                body = a + [PLUS] + b + [EQ] + total + [carry]
                c = [NOISE] * n + [STRUCT] + [NOISE] * n + [STRUCT] + [HARD] * (n + 1)
            toks += [KIND_TOKENS[kind], n] + body + [SEP]
            cls += [HEADER, HEADER] + c + [STRUCT]
            if len(toks) >= num_tokens:
                break
    return np.array(toks, dtype=np.uint8), np.array(cls, dtype=np.uint8)


def build_synthetic(a):
    n, seed = int(a["num_tokens"]), int(a["seed"])
    n_train = int(n * 0.9)
    if n_train < 1 or n - n_train < 1:
        raise PrepareError(f"--num_tokens {n}: a split would be empty; use at least 10")
    if seed < 0:
        raise PrepareError(f"--seed {seed}: must be >= 0")
    lookup = parse_mix(a["mix"])[4] > 0
    itos, classes = (LOOKUP_SYMBOLS, LOOKUP_CLASSES) if lookup else (SYMBOLS, DIFFICULTY_CLASSES)
    splits, diff, h = {}, {}, hashlib.sha256()
    for i, (split, target) in enumerate([("train", n_train), ("val", n - n_train)]):
        splits[split], diff[split] = generate_synthetic(
            target, [seed, i], a["mix"], table=lookup_table(seed)
        )
        h.update(to_array(splits[split], len(itos), a["dtype"]).tobytes())
    meta = {
        "tokenizer": "synthetic",
        "vocab_size": len(itos),
        "itos": itos,
        "source": "builtin",
        "source_sha256": h.hexdigest(),
        "split": "90/10: train and val are separate streams of whole segments, seeds (seed,0) and "
                 "(seed,1)",
        "difficulty_classes": classes,
        "difficulty_counts": {
            s: dict(zip(classes, np.bincount(d, minlength=len(classes)).tolist()))
            for s, d in diff.items()
        },
    }
    extra = {f"{s}_difficulty": d for s, d in diff.items()}
    return splits, extra, meta


# ---------------------------------------------------------------------------- inputs and tokenizers
def read_input(path):
    p = Path(path)
    if not p.is_file():
        raise PrepareError(f"input file not found: {p}")
    raw = p.read_bytes()
    if not raw:
        raise PrepareError(f"input file is empty: {p}")
    return raw


def fetch(url, cache):
    """Download url once into the file `cache` (reused on later runs)."""
    if cache.is_file() and cache.stat().st_size > 0:
        return cache.read_bytes()
    print(f"downloading {url} ...", file=sys.stderr)
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            raw = r.read()
    except OSError as e:
        raise PrepareError(
            f"could not download {url} ({e}); pass --input FILE with a local copy"
        ) from None
    cache.parent.mkdir(parents=True, exist_ok=True)
    write_file(cache, raw)
    return raw


def decode_utf8(raw, path, byte_option=False):
    """raw as UTF-8 text; else a PrepareError whose fix this dataset accepts: --tokenizer=byte where
    it has that option (the text dataset), else converting the file or preparing it as bytes."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        fix = ("use --tokenizer=byte for binary data" if byte_option else
               "convert it (iconv -f <its encoding> -t utf-8) and pass the converted file as "
               "--input, "
               "or prepare it as bytes: python data/prepare.py text "
               f"--input={shlex.quote(str(path))} "
               f"--tokenizer=byte")
        raise PrepareError(f"{path} is not valid UTF-8 (byte offset {e.start}); {fix}") from None


def ensure_tiktoken_cache():
    """Serve tiktoken's gpt2 files from <repo>/../shared/data/gpt2 when TIKTOKEN_CACHE_DIR is
    unset."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        return os.environ["TIKTOKEN_CACHE_DIR"]
    src = SHARED_DATA / "gpt2"
    if not all((src / f).is_file() for f in TIKTOKEN_FILES):
        return None  # tiktoken downloads as usual
    cache = Path.home() / ".cache" / "nanodepth" / "tiktoken"
    cache.mkdir(parents=True, exist_ok=True)
    for name, key in TIKTOKEN_FILES.items():  # file names are sha1(url) of tiktoken's download urls
        data = (src / name).read_bytes()        # ~1 MB each: compared whole, not by size
        if not (cache / key).is_file() or (cache / key).read_bytes() != data:
            write_whole(cache / key, lambda f: f.write(data), binary=True)
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
    return str(cache)


def gpt2_encoding():
    ensure_tiktoken_cache()
    import tiktoken
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:
        raise PrepareError(
            f"could not load tiktoken's gpt2 encoding ({e}); put the BPE files in "
            "../shared/data/gpt2 or set TIKTOKEN_CACHE_DIR (see its README.txt)"
        ) from None


# Tokenisation runs a chunk of about this many characters at a time, so its progress bar moves
CHUNK_CHARS = 1 << 20
# where GPT-2's pre-tokeniser always splits: after a newline between two printable ASCII
# characters. No piece of its pattern holds a newline with anything else, and a lone newline before
# a non-space is a piece of its own, so BPE of the text equals BPE of the two sides joined.
BPE_CUT = re.compile(r"(?<=[!-~]\n)(?=[!-~])")


def bpe_pieces(doc, size=None):
    """doc cut at BPE_CUT points into pieces of about `size` characters (at least one piece, "" for
    an empty document): a long document's BPE, piece by piece, is its BPE whole."""
    size, pieces, start = size or CHUNK_CHARS, [], 0
    while len(doc) - start > size:
        cut = BPE_CUT.search(doc, start + size)
        if cut is None:
            break
        pieces.append(doc[start:cut.start()])
        start = cut.start()
    return pieces + [doc[start:]]


def encode_docs(docs, quiet=False):
    """GPT-2 BPE of each document followed by EOT, as one uint32 array; encoded about CHUNK_CHARS
    characters at a time (long documents in bpe_pieces) under a progress bar (see progress.py)."""
    enc = gpt2_encoding()
    batches, batch, chars = [], [], 0    # batches of (piece, whether it ends its document)
    for doc in docs:
        pieces = bpe_pieces(doc)
        for i, piece in enumerate(pieces):
            batch.append((piece, i == len(pieces) - 1))
            chars += len(piece)
            if chars >= CHUNK_CHARS:
                batches, batch, chars = batches + [batch], [], 0
    batches += [batch] if batch else []
    out = []
    for batch in progress(batches, desc="tokenise (gpt2)", quiet=quiet):
        ids = enc.encode_ordinary_batch([piece for piece, _ in batch])
        out += [np.array(piece_ids + [GPT2_EOT] * ends, dtype=np.uint32)
                for piece_ids, (_, ends) in zip(ids, batch)]
    return np.concatenate(out) if out else np.zeros(0, dtype=np.uint32)


def split_txt_docs(text):
    # "\r": a CRLF file's separator line is "<|endoftext|>\r\n" ($ matches before "\n" only)
    docs = re.split(r"^<\|endoftext\|>[ \t\r]*$\n?", text, flags=re.M)
    return [d for d in docs if d.strip()]


def load_docs(path, max_docs):
    """Documents (strings) from a .parquet, .jsonl or .txt file: the first max_docs that hold more
    than whitespace, in every format (an empty one is skipped, not counted)."""
    raw, suffix = read_input(path), Path(path).suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq
        try:
            table = pq.read_table(io.BytesIO(raw), columns=["text"])
        except Exception as e:
            raise PrepareError(
                f"{path}: cannot read a `text` column from this parquet file ({e})"
            ) from None
        texts = (t for chunk in table.column("text").chunks for t in chunk.to_pylist()
                 if t is not None)      # a null is an empty document
        wrong = lambda t: f"{path}: its `text` column holds {type(t).__name__}, not strings"
    elif suffix == ".jsonl":
        texts = (
            json_text(line, f"{path} line {n}")
            # JSON Lines end at "\n" only: str.splitlines would also cut at U+2028, U+0085 etc.,
            # which JSON strings may hold unescaped
            for n, line in enumerate(decode_utf8(raw, path).split("\n"), 1)
            if line.strip()
        )
        wrong = None
    else:
        texts, wrong = split_txt_docs(decode_utf8(raw, path)), None
    docs = first_documents(texts, max_docs, wrong)
    if not docs:
        raise PrepareError(f"{path} holds no documents")
    return raw, docs


def first_documents(texts, max_docs, wrong=None):
    """The first max_docs of texts that hold more than whitespace (the --max_docs rule of every
    source); a text that is not a string: PrepareError(wrong(text))."""
    docs = []
    for text in texts:
        if len(docs) == max_docs:
            break
        if not isinstance(text, str):
            raise PrepareError(wrong(text))
        if text.strip():
            docs.append(text)
    return docs


def json_text(line, where):
    try:
        text = json.loads(line)["text"]
    except (ValueError, KeyError, TypeError):
        text = None
    if not isinstance(text, str):
        raise PrepareError(f"{where}: not a JSON object with a string 'text' field")
    return text


def stream_fineweb_edu(max_docs):
    try:
        from datasets import load_dataset
    except ImportError:
        raise PrepareError(
            "fineweb_edu without --input needs the `datasets` package: pip install datasets, "
            "or pass --input with a local .parquet/.jsonl/.txt file, e.g. "
            "--input ../shared/data/fineweb_sample_legal.parquet"
        ) from None
    ds = load_dataset(
        "HuggingFaceFW/fineweb-edu", name="sample-10BT", split="train", streaming=True
    )
    docs = first_documents((row["text"] for row in ds if row["text"] is not None), max_docs,
                           lambda t: f"fineweb-edu: a `text` of {type(t).__name__}, not a string")
    return "\n<|endoftext|>\n".join(docs).encode("utf-8"), docs


# ----------------------------------------------------------------------------- dataset builders
def check_fraction(f):
    if not 0 < float(f) < 1:
        raise PrepareError(f"--val_fraction {f}: must be between 0 and 1")
    return float(f)


def split_tokens(ids, val_fraction, what):
    n_train = int(len(ids) * (1 - check_fraction(val_fraction)))
    if n_train < 1 or n_train >= len(ids):
        raise PrepareError(
            f"{what}: {len(ids)} tokens with --val_fraction {val_fraction} would leave the "
            f"{'train' if n_train < 1 else 'val'} split empty; use a larger input or fraction"
        )
    return {"train": ids[:n_train], "val": ids[n_train:]}


def tokenize_text(raw, path, tokenizer, byte_option=False, quiet=False):
    """-> (ids, vocab_size, extra meta) for the char, byte or gpt2 tokenizer; quiet: no progress
    bar."""
    if tokenizer == "byte":
        return np.frombuffer(raw, dtype=np.uint8), 256, {}
    text = decode_utf8(raw, path, byte_option)
    if tokenizer == "gpt2":
        docs = split_txt_docs(text) or [text]
        return encode_docs(docs, quiet), GPT2_EOT + 1, {"eot_token": GPT2_EOT}
    if tokenizer != "char":
        raise PrepareError(f"--tokenizer {tokenizer!r}: choose char, byte or gpt2")
    return char_ids(text, quiet)


def char_ids(text, quiet=False):
    """Each character's index in the sorted set of the text's characters (int64), in two passes
    over CHUNK_CHARS-character chunks: the set, then the indices (np.unique's inverse, chunked)."""
    chunks = range(0, len(text), CHUNK_CHARS)
    codepoints = lambda i: np.frombuffer(text[i:i + CHUNK_CHARS].encode("utf-32-le"), dtype="<u4")
    vocab = np.unique(np.concatenate(
        [np.unique(codepoints(i)) for i in progress(chunks, desc="characters", quiet=quiet)]))
    ids = np.concatenate([np.searchsorted(vocab, codepoints(i)).astype(np.int64)
                          for i in progress(chunks, desc="tokenise (char)", quiet=quiet)])
    return ids, len(vocab), {"chars": [chr(c) for c in vocab.tolist()]}


def build_text(a, default_input=None, url=None):
    tokenizer = a.get("tokenizer", "char")
    path = a["input"] or default_input
    if path is None and url is None:
        raise PrepareError("dataset text needs --input FILE")
    if path is not None:
        raw, source = read_input(path), str(Path(path).resolve())
    else:
        raw, source = fetch(url, a["_out"] / "input.txt"), url
    ids, vocab, extra = tokenize_text(raw, path or url, tokenizer, byte_option="tokenizer" in a,
                                      quiet=a.get("_quiet", False))
    splits = split_tokens(ids, a.get("val_fraction", 0.1), source)
    val_pct = 100 * float(a.get("val_fraction", 0.1))
    meta = {
        "tokenizer": tokenizer,
        "vocab_size": vocab,
        **extra,
        "source": source,
        "source_sha256": hashlib.sha256(raw).hexdigest(),
        "split": f"{100 - val_pct:.6g}/{val_pct:.6g} by "
                 f"{'characters' if tokenizer == 'char' else tokenizer + ' tokens'}",
    }
    return splits, {}, meta


def build_shakespeare_char(a):
    local = SHARED_DATA / "tinyshakespeare.txt"
    return build_text(a, default_input=local if local.is_file() else None, url=SHAKESPEARE_URL)


def build_enwik8(a):
    raw = read_input(a["input"]) if a["input"] else fetch(ENWIK8_URL, a["_out"] / "enwik8.zip")
    data = raw
    if raw[:4] == b"PK\x03\x04":
        try:  # the member named enwik8, else the first one
            with zipfile.ZipFile(io.BytesIO(raw)) as z:
                member = z.getinfo("enwik8" if "enwik8" in z.namelist() else z.namelist()[0])
                data = unzip(z, member, a.get("_quiet", False))
        except (zipfile.BadZipFile, IndexError) as e:
            raise PrepareError(
                f"{a['input'] or ENWIK8_URL}: not a readable enwik8 zip ({e})"
            ) from None
        if not data:
            raise PrepareError(f"{a['input'] or ENWIK8_URL}: the enwik8 member is empty")
    n = len(data)
    if n == 100_000_000:
        cuts, split = (90_000_000, 95_000_000), "90M/5M/5M bytes"
    else:
        cuts = (int(n * 0.9), int(n * 0.9) + int(n * 0.05))
        split = f"90/5/5 by bytes, proportional ({n} bytes, not the standard 100M)"
    ids = np.frombuffer(data, dtype=np.uint8)
    splits = {"train": ids[:cuts[0]], "val": ids[cuts[0]:cuts[1]], "test": ids[cuts[1]:]}
    if any(len(v) == 0 for v in splits.values()):
        raise PrepareError(f"enwik8 input of {n} bytes is too small: the val split would be empty")
    meta = {
        "tokenizer": "byte",
        "vocab_size": 256,
        "source": str(Path(a["input"]).resolve()) if a["input"] else ENWIK8_URL,
        "source_sha256": hashlib.sha256(raw).hexdigest(),
        "split": split,
    }
    return splits, {}, meta


def unzip(z, member, quiet=False, chunk=1 << 24):
    """The member's bytes, read `chunk` bytes at a time under a progress bar."""
    with z.open(member) as f:
        steps = range(0, member.file_size, chunk)
        data = [f.read(chunk) for _ in progress(steps, desc="unzip", quiet=quiet)]
        return b"".join(data) + f.read()


def build_fineweb_edu(a):
    max_docs, frac = int(a["max_docs"]), check_fraction(a["val_fraction"])
    if a["input"]:
        (raw, docs), source = load_docs(a["input"], max_docs), str(Path(a["input"]).resolve())
    else:
        (raw, docs), source = (
            stream_fineweb_edu(max_docs),
            "hf://HuggingFaceFW/fineweb-edu/sample-10BT",
        )
    n_val = max(1, int(len(docs) * frac))
    if len(docs) - n_val < 1:
        raise PrepareError(
            f"{source}: {len(docs)} document(s) cannot fill both train and val; need at least 2"
        )
    quiet = a.get("_quiet", False)
    splits = {"train": encode_docs(docs[:-n_val], quiet), "val": encode_docs(docs[-n_val:], quiet)}
    meta = {
        "tokenizer": "gpt2",
        "vocab_size": GPT2_EOT + 1,
        "eot_token": GPT2_EOT,
        "source": source,
        "source_sha256": hashlib.sha256(raw).hexdigest(),
        "split": f"by documents: first {len(docs) - n_val} train, last {n_val} val",
        "documents": len(docs),
    }
    return splits, {}, meta


# ----------------------------------------------------------------------------- arithmetic task
ARITH_SYMBOLS = "0123456789+-*=\n"
# where a backbone's character vocabulary lacks a symbol: the digits as a group, then each operator
ARITH_FALLBACK = {"digits": "abcdefghij", "+": "&", "-": "~", "*": "x", "=": ":"}
ARITH_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def arith_pair_split(seed, a, b):
    """'train', 'val' or 'test' for the unordered operand pair {a, b}, by a hash of (seed, pair):
    the splits share no operand pair, whatever the operator or the order (80/10/10 of the
    pairs)."""
    lo, hi = min(a, b), max(a, b)
    u = int(hashlib.sha256(f"{seed}:{lo},{hi}".encode()).hexdigest()[:8], 16) / 16**8
    return "test" if u < 0.1 else "val" if u < 0.2 else "train"


def arith_problems(seed, digits, ops, counts):
    """{split: [(a, op, b, answer)]} with counts[split] problems each. Each operand has 1..digits
    digits (the length uniform, then the value); subtraction puts the larger operand first (answers
    are >= 0). val and test hold distinct problems; train may repeat one."""
    rng = np.random.default_rng([seed, 11])
    out, seen = {s: [] for s in counts}, {s: set() for s in counts}
    need, tries = sum(counts.values()), 0
    while sum(len(v) for v in out.values()) < need:
        tries += 1
        if tries > 20 * need + 1000:     # a pair space too small for the counts
            short = ", ".join(f"{s} {len(out[s])}/{n}" for s, n in counts.items())
            raise PrepareError(f"arith: too few distinct problems with --digits={digits} "
                               f"({short}); use more --digits or fewer problems")
        op = ops[int(rng.integers(len(ops)))]
        a, b = (int(rng.integers(10 ** (n - 1) if n > 1 else 0, 10**n))
                for n in rng.integers(1, digits + 1, size=2))
        if op == "-" and a < b:
            a, b = b, a
        split = arith_pair_split(seed, a, b)
        if len(out[split]) >= counts[split] or (split != "train" and (a, op, b) in seen[split]):
            continue
        seen[split].add((a, op, b))
        out[split].append((a, op, b, ARITH_OPS[op](a, b)))
    return out


def arith_symbols(chars):
    """{task symbol: the character standing for it} in a backbone's character vocabulary `chars`:
    itself where present, else ARITH_FALLBACK's; PrepareError where neither is there."""
    have = set(chars)
    digits = "0123456789"
    if not set(digits) <= have:
        digits = ARITH_FALLBACK["digits"]
    mapping = dict(zip("0123456789", digits))
    for sym in "+-*=\n":
        mapping[sym] = sym if sym in have else ARITH_FALLBACK.get(sym, sym)
    missing = sorted({c for c in mapping.values() if c not in have})
    if missing or len(set(mapping.values())) != len(mapping):
        raise PrepareError(f"arith: the vocabulary of --vocab_from has no characters for "
                           f"{', '.join(map(repr, missing)) or 'distinct symbols'}; use a "
                           f"corpus with digits or letters a-j, '&~x:' and newlines, or leave "
                           f"--vocab_from out for the task's own vocabulary")
    return mapping


def build_arith(a):
    digits, ops, seed = int(a["digits"]), str(a["ops"]), int(a["seed"])
    if not 1 <= digits <= 9:
        raise PrepareError(f"--digits {digits}: must be between 1 and 9")
    if not ops or any(o not in ARITH_OPS for o in ops) or len(set(ops)) != len(ops):
        raise PrepareError(f"--ops {ops!r}: give some of '+-*' once each, e.g. --ops=+-")
    if a["answer"] not in ("plain", "reversed"):
        raise PrepareError(f"--answer {a['answer']!r}: plain (123+45=168) or reversed "
                           "(123+45=861, the least significant digit first)")
    # reversed: a small model adds digit by digit, each carry known before the digit it changes
    # (Lee et al., "Teaching Arithmetic to Small Transformers", arXiv 2307.03381)
    order = (lambda text: text[::-1]) if a["answer"] == "reversed" else (lambda text: text)
    # pad: every operand and answer zero-filled to one width (07+35=042), so each digit sits at a
    # fixed distance from the digits it depends on and attention need not find it
    if not isinstance(a["pad"], bool):
        raise PrepareError(f"--pad {a['pad']!r}: True or False")
    widths = {"+": digits + 1, "-": digits, "*": 2 * digits}
    num = lambda v, w: str(v).zfill(w) if a["pad"] else str(v)
    n_eval = max(1, int(a["num_problems"]) // 10)
    counts = {"train": int(a["num_problems"]), "val": n_eval, "test": n_eval}
    problems = arith_problems(seed, digits, ops, counts)
    backbone = None
    if a["vocab_from"]:
        backbone = check_prepared(a["vocab_from"])
        if backbone.get("tokenizer") not in ("char", "gpt2"):
            raise PrepareError(f"--vocab_from {a['vocab_from']}: its tokenizer is "
                               f"{backbone.get('tokenizer')!r}; arith speaks char or gpt2")
    tok = a["tokenizer"] or (backbone["tokenizer"] if backbone is not None else "char")
    if tok not in ("char", "gpt2") or backbone is not None and tok != backbone["tokenizer"]:
        raise PrepareError(f"--tokenizer {tok!r}: arith speaks char or gpt2, and a --vocab_from "
                           f"backbone's own ({backbone['tokenizer'] if backbone else 'any'})")
    if tok == "gpt2":           # GPT-2's BPE whole: a GPT-2 backbone (init_from=gpt2) reads it
        tokenizer, vocab, extra = "gpt2", GPT2_EOT + 1, {"eot_token": GPT2_EOT}
        symbols = {c: c for c in ARITH_SYMBOLS}
        encode = gpt2_encoding().encode_ordinary
    else:
        chars = backbone["chars"] if backbone is not None else sorted(ARITH_SYMBOLS)
        symbols = arith_symbols(chars)
        stoi = {c: i for i, c in enumerate(chars)}
        tokenizer, vocab, extra = "char", len(chars), {"chars": list(chars)}
        encode = lambda text: [stoi[c] for c in text]
    spell = lambda text: "".join(symbols[c] for c in text)
    splits, masks, h = {}, {}, hashlib.sha256()
    for split, rows in problems.items():
        ids, mask = [], []
        for x, op, y, answer in rows:    # prompt and answer encoded apart: the mask is exact
            prompt = encode(spell(f"{num(x, digits)}{op}{num(y, digits)}="))
            reply = encode(spell(f"{order(num(answer, widths[op]))}\n"))
            ids += prompt + reply
            mask += [0] * len(prompt) + [1] * len(reply)
        splits[split] = np.array(ids, dtype=np.int64)
        masks[f"{split}_loss_mask"] = np.array(mask, dtype=np.uint8)
        h.update(splits[split].tobytes())
    meta = {
        "tokenizer": tokenizer,
        "vocab_size": vocab,
        **extra,
        "source": "builtin",
        "source_sha256": h.hexdigest(),
        "split": "by operand pair: 80/10/10 of the unordered pairs {a, b} (a hash of seed and "
                 "pair); val and test hold distinct problems",
        "problems": {s: len(v) for s, v in problems.items()},
        "symbols": symbols,
        "vocab_from": str(Path(a["vocab_from"]).resolve()) if a["vocab_from"] else None,
        "loss_mask": "answer",
        "pad": a["pad"],
    }
    return splits, masks, meta


BUILDERS = {
    "synthetic": build_synthetic,
    "synthetic_lookup": build_synthetic,
    "shakespeare_char": build_shakespeare_char,
    "enwik8": build_enwik8,
    "fineweb_edu": build_fineweb_edu,
    "text": build_text,
    "arith": build_arith,
}


# ----------------------------------------------------------------------------- writing and checking
def to_array(ids, vocab_size, dtype="auto"):
    """Token ids as little-endian uint16 (vocab_size <= 65535) or uint32."""
    if dtype not in ("auto", "uint16", "uint32"):
        raise PrepareError(f"--dtype {dtype!r}: choose auto, uint16 or uint32")
    if dtype == "uint16" and vocab_size > 65535:
        raise PrepareError(
            f"vocab_size {vocab_size} does not fit --dtype uint16; use uint32 or auto"
        )
    big = dtype == "uint32" or (dtype == "auto" and vocab_size > 65535)
    return np.asarray(ids).astype("<u4" if big else "<u2")


def write_file(path, data):
    """Write bytes (or a contiguous array) to path whole (files.write_whole)."""
    write_whole(path, lambda f: write_chunks(f, memoryview(data).cast("B")), binary=True)


def write_chunks(f, view, chunk=1 << 26):
    for i in range(0, len(view), chunk):
        f.write(view[i:i + chunk])


def command_for(dataset, args, out):
    parts = ["python", "data/prepare.py", dataset]
    defaults = {**COMMON_DEFAULTS, **DEFAULTS[dataset]}
    parts += [f"--{k}={v}" for k, v in args.items() if v is not None and v != defaults[k]]
    if out.resolve() != (DATA_DIR / (args.get("name") or dataset)).resolve():
        parts.append(f"--out_dir={out}")
    return shlex.join(parts)


def output_dir(dataset, out_dir=None, name=None):
    return Path(out_dir) if out_dir else DATA_DIR / (name or dataset)


def prepare(dataset, out_dir=None, quiet=False, overwrite=False, **opts):
    """Build `dataset` in memory, check it, then write it atomically to out_dir. Returns meta.
    quiet: no progress bar over the tokenisation (there is none off a terminal either); not an
    option of the data, so not in meta.json. A folder holding a dataset prepared with other
    options is replaced only with overwrite (runs trained on it would then refuse it); the same
    options rewrite the same files."""
    if dataset not in BUILDERS:
        raise PrepareError(f"unknown dataset {dataset!r}; valid datasets: {', '.join(BUILDERS)}")
    args = {**COMMON_DEFAULTS, **DEFAULTS[dataset]}
    unknown = sorted(k for k, v in opts.items() if k not in args and v is not None)
    if unknown:
        raise PrepareError(
            f"option(s) {', '.join('--' + k for k in unknown)} do not apply to dataset {dataset}; "
            f"its options: {', '.join('--' + k for k in args)}"
        )
    args.update({k: v for k, v in opts.items() if v is not None})
    check_options(args, out_dir)
    out = output_dir(dataset, out_dir, args.get("name"))
    if not overwrite:
        check_replaces_nothing(out, dataset, args)
    splits, extra, meta = BUILDERS[dataset]({**args, "_out": out, "_quiet": quiet})
    arrays = {k: to_array(v, meta["vocab_size"], args["dtype"]) for k, v in splits.items()}
    arrays.update(extra)
    meta = {"dataset": dataset, **meta, "dtype": np.dtype(arrays["train"].dtype).name,
            **{f"{k}_tokens": len(v) for k, v in splits.items()}, "prepare_args": args,
            "command": command_for(dataset, args, out), "files": {}}
    out.mkdir(parents=True, exist_ok=True)
    with taking_turns(out / ".prepare.lock"):  # a second prepare into out waits, then rewrites
                                               # every file itself
        remove_stale_temps(out)
        (out / "meta.json").unlink(missing_ok=True)  # the folder is incomplete until meta.json is
                                                     # back
        for name, arr in arrays.items():
            write_file(out / f"{name}.bin", arr)
            meta["files"][f"{name}.bin"] = {
                "bytes": arr.nbytes,
                "sha256": hashlib.sha256(arr).hexdigest(),
            }
        write_file(out / "meta.json", (json.dumps(meta, indent=2) + "\n").encode())
    return meta


def check_replaces_nothing(out, dataset, args):
    """Refuse to write into a folder whose meta.json records another dataset or other options (the
    checkpoints of runs trained on it record its hashes, not its command)."""
    try:
        old = json.loads((out / "meta.json").read_text())
    except (OSError, ValueError):       # nothing there, or an incomplete folder: nothing to keep
        return
    if not isinstance(old, dict) or (old.get("dataset"), old.get("prepare_args")) == (dataset,
                                                                                       args):
        return
    made_by = prepare_command(out, old)
    raise PrepareError(f"{out} holds a dataset prepared with other options ({made_by}); runs "
                       "trained on it would no longer read it: give another --out_dir, or "
                       "--overwrite=True to replace it")


MAX_TOKENS = 10**10     # the corpus is built in memory


def check_options(args, out_dir):
    """Every option's range and the output folder, before anything is built, read or written."""
    if out_dir is not None and not str(out_dir):
        raise PrepareError("--out_dir is empty; name a folder, or leave it out for data/<dataset>")
    ranges = {"seed": (0, 2**63 - 1), "num_tokens": (1, MAX_TOKENS), "max_docs": (1, 2**63 - 1),
              "num_problems": (1, 10**8), "digits": (1, 9)}
    for key, (lo, hi) in ranges.items():
        if key in args and not lo <= args[key] <= hi:
            raise PrepareError(f"--{key} {args[key]}: must be between {lo} and {hi:,}")
    if "val_fraction" in args:
        check_fraction(args["val_fraction"])
    if args["dtype"] not in ("auto", "uint16", "uint32"):
        raise PrepareError(f"--dtype {args['dtype']!r}: choose auto, uint16 or uint32")
    if args.get("tokenizer") not in (None, "char", "byte", "gpt2"):
        raise PrepareError(f"--tokenizer {args['tokenizer']!r}: choose char, byte or gpt2")
    if "mix" in args:
        parse_mix(args["mix"])
    name = args.get("name")
    if name is not None and (not name or name != Path(name).name or name in (".", "..")):
        raise PrepareError(f"--name {name!r}: give a folder name (no '/'), e.g. --name=mytext")
    source = args.get("input")
    if source is not None and not (Path(source).is_file() and Path(source).stat().st_size):
        raise PrepareError(f"input file {'is empty' if Path(source).is_file() else 'not found'}: "
                           f"{source}")
    try:
        writable_folder(str(out_dir) if out_dir is not None else str(DATA_DIR), "out_dir")
    except ConfigError as e:
        raise PrepareError(str(e)) from None
    run_file = run_file_in(out_dir) if out_dir is not None else None
    if run_file:            # a dataset's files beside a run's would be taken for part of it
        raise PrepareError(f"--out_dir {out_dir} holds a training run ({run_file}); prepare the "
                           f"data into a folder of its own, e.g. --out_dir=data/<name>")


def check_prepared(folder):
    """Load folder/meta.json and check that every listed file exists with its recorded size."""
    folder = Path(folder)
    cmd = prepare_command(folder)
    try:
        meta = json.loads((folder / "meta.json").read_text())
        files = meta["files"]
        cmd = prepare_command(folder, meta)
        if not isinstance(files, dict):
            raise TypeError(f"its 'files' is {type(files).__name__}, not a listing of the files")
    except (OSError, ValueError, KeyError, TypeError) as e:
        why = f"it lists no {e}" if isinstance(e, KeyError) else str(e)    # (KeyError: the key)
        raise PrepareError(
            f"{folder} is not a prepared dataset (meta.json missing or unreadable: {why}); run: "
            f"{cmd}"
        ) from None
    problems = [f"{n} not listed in meta.json" for n in ("train.bin", "val.bin") if n not in files]
    for n, info in files.items():
        size = (folder / n).stat().st_size if (folder / n).is_file() else None
        expected = info.get("bytes") if isinstance(info, dict) else None
        if size is None or size != expected:
            problems.append(
                f"{n} missing"
                if size is None
                else f"{n} has {size} bytes, meta.json says {expected}"
            )
    if problems:
        raise PrepareError(f"{folder} is incomplete ({'; '.join(problems)}); run: {cmd}")
    return meta


def prepare_command(folder, meta=None):
    """The command that rewrites folder: meta.json's own options with --out_dir this folder (a
    copied or moved folder must not send the user to re-prepare the original), else a guess from its
    name."""
    folder = Path(folder)
    dataset = meta.get("dataset") if isinstance(meta, dict) else None
    if dataset in BUILDERS and isinstance(meta.get("prepare_args"), dict):
        known = {**COMMON_DEFAULTS, **DEFAULTS[dataset]}
        args = {k: v for k, v in meta["prepare_args"].items() if k in known}
        return command_for(dataset, args, folder)
    if isinstance(meta, dict) and meta.get("command"):
        return meta["command"]
    cmd = f"python data/prepare.py {folder.name if folder.name in BUILDERS else '<dataset>'}"
    if folder.resolve() != (DATA_DIR / folder.name).resolve():
        cmd += f" --out_dir={shlex.quote(str(folder))}"
    return cmd


def file_sha256(path, chunk=1 << 24):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def verify_checksums(folder, meta=None, chunk=1 << 24):
    """Check every file listed in meta.json (loaded with check_prepared if meta is None) against its
    sha256: a same-size corruption or a mix of two prepares passes the size check alone. Returns
    meta."""
    folder = Path(folder)
    meta = check_prepared(folder) if meta is None else meta
    cmd = prepare_command(folder, meta)
    for name, info in meta["files"].items():
        try:
            digest = file_sha256(folder / name, chunk)
        except OSError as e:
            raise PrepareError(f"cannot read {folder / name} ({e.strerror}); run: {cmd}") from None
        if digest != info.get("sha256"):
            raise PrepareError(
                f"{folder / name} does not match its sha256 in meta.json (changed or corrupted "
                f"since it was prepared); run: {cmd}"
            )
    return meta


def max_token_id(path, dtype, chunk=1 << 24):
    """Largest token id in a .bin file (-1 if it is empty), read `chunk` ids at a time so a large
    file needs little memory."""
    dtype, size = np.dtype(dtype).newbyteorder("<"), Path(path).stat().st_size
    if size % dtype.itemsize:
        raise PrepareError(f"{path} has {size} bytes, not a whole number of {dtype.name} ids; "
                           "re-run the prepare command that wrote it")
    if size == 0:
        return -1  # np.memmap cannot map an empty file
    ids = np.memmap(path, dtype=dtype, mode="r")
    return max(int(ids[i:i + chunk].max()) for i in range(0, len(ids), chunk))


def check_token_ids(folder, meta, vocab_size, what="meta.json's vocab_size", chunk=1 << 24):
    """Raise PrepareError if a split (train.bin, val.bin, test.bin) holds a token id >= vocab_size;
    `what` names where vocab_size comes from, e.g. "the model's vocabulary"."""
    folder, cmd = Path(folder), prepare_command(folder, meta)
    for name in meta["files"]:
        if f"{name.removesuffix('.bin')}_tokens" not in meta:
            continue  # not token ids (e.g. the difficulty classes)
        try:
            top = max_token_id(folder / name, meta["dtype"], chunk)
        except OSError as e:
            raise PrepareError(f"cannot read {folder / name} ({e.strerror}); run: {cmd}") from None
        if top < vocab_size:
            continue
        if top >= meta.get("vocab_size", vocab_size):
            fix = f"the data and meta.json disagree; run: {cmd}"
        else:
            fix = f"too small for this data; use a model with vocab_size >= {meta['vocab_size']}"
        raise PrepareError(
            f"{folder / name} holds token id {top} but {what} is {vocab_size}: {fix}"
        )
    return meta


def true_or_false(text):
    if text not in ("True", "False"):
        raise argparse.ArgumentTypeError(f"give True or False, not {text!r}")
    return text == "True"


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):      # argparse's usage block would bury the one line that matters
        print(f"error: {message}; see python data/prepare.py --help", file=sys.stderr)
        sys.exit(2)


def main(argv=None):
    p = OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("dataset", help=", ".join(BUILDERS))
    p.add_argument("--out_dir", help="where to write (default data/<dataset>, or data/<name>)")
    for key, kind, text in [
        ("dtype", str, "token id type: auto (uint16 unless vocab_size > 65535), uint16, uint32"),
        ("seed", int, "the corpus's seed"),
        ("num_tokens", int, "tokens in train + val"),
        ("mix", str, "the segment kinds' shares"),
        ("input", str, "the local file to read (else the default file or a download)"),
        ("max_docs", int, "documents to read"),
        ("val_fraction", float, "the share held out for val"),
        ("tokenizer", str, "char, byte or gpt2"),
        ("name", str, "the dataset's name, its folder data/<name>"),
        ("digits", int, "arith: the most digits of an operand"),
        ("ops", str, "arith: the operators, from +, - and *"),
        ("num_problems", int, "arith: training problems (val and test get a tenth each)"),
        ("answer", str, "arith: the answer's digits, plain (168) or reversed (861)"),
        ("pad", true_or_false, "arith: zero-fill operands and answers to fixed widths (07+35=042)"),
        ("vocab_from", str, "arith: a prepared dataset whose vocabulary to write it in"),
    ]:
        # where each dataset takes the option, with its default there (DEFAULTS above)
        used = [f"{d}: {opts[key]}" if opts[key] is not None else d
                for d, opts in DEFAULTS.items() if key in opts]
        p.add_argument(f"--{key}", type=kind, help=text + (f" ({'; '.join(used)})" if used else ""))
    p.add_argument("--quiet", type=true_or_false, default=False,
                   help="True: no progress bar (there is none off a terminal either)")
    p.add_argument("--overwrite", type=true_or_false, default=False,
                   help="True: replace a dataset the folder holds that other options prepared")
    a = vars(p.parse_args(argv))
    try:
        meta = prepare(**a)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)   # as every script says it
        return 2
    counts = ", ".join(
        f"{s} {meta[s + '_tokens']:,}" for s in ("train", "val", "test") if s + "_tokens" in meta
    )
    where = output_dir(meta["dataset"], a["out_dir"], a["name"])
    print(
        f"{meta['dataset']}: {meta['tokenizer']} tokenizer, vocab {meta['vocab_size']}, "
        f"{meta['dtype']}; "
        f"tokens: {counts}; written to {where}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
