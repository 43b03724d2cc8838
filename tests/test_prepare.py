"""Tests for data/prepare.py: every dataset end to end on small inputs, the synthetic grammar
(checked by an independent parser), errors, idempotence, atomic and serialised writes, and the
checksum and token-id checks."""
import hashlib
import io
import json
import os
import re
import sys
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from conftest import run_group  # noqa: E402
from data import prepare as P  # noqa: E402
import files  # noqa: E402
from files import pid_alive  # noqa: E402

SHARED = REPO.parent / "shared" / "data"
SHAKESPEARE = SHARED / "tinyshakespeare.txt"
FINEWEB = SHARED / "fineweb_sample_legal.parquet"
CLASS_CHARS = "STNHhR"  # structure, trivial, noise, hard, header, recall (index = class id)


def load(folder, name, meta):
    return np.fromfile(
        Path(folder) / name, dtype=meta["dtype"] if "difficulty" not in name else np.uint8
    )


def folder_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir())}


def need_gpt2(cache):
    if cache is None:
        pytest.skip("../shared/data/gpt2 is absent: no offline tiktoken files")


# ----------------------------------------------------------------------------- synthetic
def expected_classes(text):
    """Independent parser of the synthetic grammar. Checks every segment's content and
    returns the class of every position as a string over CLASS_CHARS."""
    assert text.endswith("|"), "a split ends with a whole segment"
    out = []
    for seg in text[:-1].split("|"):
        kind, n, body = seg[0], int(seg[1]), seg[2:]
        assert 1 <= n <= 9
        if kind == "C":
            m = re.fullmatch(f"([a-p]{{{n}}})>([a-p]{{{n}}})", body)
            assert m and m[1] == m[2], f"copy not copied: {seg}"
            cls = "N" * n + "S" + "T" * n
        elif kind == "N":
            assert re.fullmatch(f"[0-9]{{{n + 1}}}", body), seg
            assert all(int(body[i]) == (int(body[0]) + i) % 10 for i in range(1, n + 1)), (
                f"bad count: {seg}"
            )
            cls = "N" + "T" * n
        elif kind == "R":
            assert re.fullmatch(f"[a-p]{{{n}}}", body), seg
            cls = "N" * n
        elif kind == "A":
            m = re.fullmatch(f"([0-9]{{{n}}})\\+([0-9]{{{n}}})=([0-9]{{{n + 1}}})", body)
            assert m, seg
            a, b = int(m[1][::-1]), int(m[2][::-1])  # least-significant digit first
            assert m[3] == str(a + b).zfill(n + 1)[::-1], f"wrong sum: {seg}"
            cls = "N" * n + "S" + "N" * n + "S" + "H" * (n + 1)
        elif kind == "L":
            assert re.fullmatch(f"([a-p]{{3}}){{{n}}}", body), seg
            for i in range(0, 3 * n, 3):         # one value per key pair, the same wherever it
                                                 # occurs
                assert LOOKUP_SEEN.setdefault(body[i : i + 2], body[i + 2]) == body[i + 2], (
                    f"two values: {seg}"
                )
            cls = "NNR" * n
        else:
            raise AssertionError(f"unknown segment kind in {seg!r}")
        out.append("hh" + cls + "S")
    return "".join(out)


def decode_synth(tokens, diff):
    return "".join(P.LOOKUP_SYMBOLS[t] for t in tokens.tolist()), "".join(
        CLASS_CHARS[c] for c in diff.tolist()
    )


LOOKUP_SEEN = {}     # expected_classes' record of each key pair's value (one corpus seed per test)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**63), n=st.integers(1, 3000),
       weights=st.lists(st.integers(0, 5), min_size=5, max_size=5).filter(lambda w: w[4] > 0))
def test_synthetic_lookup_grammar_property(seed, n, weights):
    """Lookup segments: key pairs each followed by the fixed table's value (the 'recall' class), the
    same value for a pair in every segment and split of a corpus."""
    LOOKUP_SEEN.clear()
    mix = ",".join(f"{k}={w}" for k, w in zip(P.KINDS, weights))
    table = P.lookup_table(seed % 1000)
    for split in (0, 1):
        tokens, diff = P.generate_synthetic(n, [seed, split], mix, table=table)
        text, classes = decode_synth(tokens, diff)
        assert classes == expected_classes(text)
    for pair, value in LOOKUP_SEEN.items():
        assert P.LOOKUP_SYMBOLS[table[P.SYMBOLS.index(pair[0])][P.SYMBOLS.index(pair[1])]] == value


def test_lookup_corpus_end_to_end_and_the_default_corpus_unchanged(tmp_path):
    meta = P.prepare("synthetic_lookup", tmp_path / "lk", num_tokens=20_000)
    assert (
        meta["vocab_size"] == 35
        and meta["itos"][-1] == "L"
        and meta["difficulty_classes"][-1] == "recall"
    )
    tokens, diff = (
        load(tmp_path / "lk", "val.bin", meta),
        load(tmp_path / "lk", "val_difficulty.bin", meta),
    )
    LOOKUP_SEEN.clear()
    assert decode_synth(tokens, diff)[1] == expected_classes(decode_synth(tokens, diff)[0])
    assert meta["difficulty_counts"]["val"]["recall"] > 0
    # lookup keys are drawn after everything else and only for lookup mixes: the default corpus is
    # byte-for-byte what it was before the lookup kind existed (this digest was taken then)
    t, d = P.generate_synthetic(200_000, [1337, 0])
    assert hashlib.sha256(t.tobytes() + d.tobytes()).hexdigest()[:16] == "a60b6c40f67d1d95"
    assert P.prepare("synthetic", tmp_path / "s", num_tokens=2000)["vocab_size"] == 34


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**63), n=st.integers(1, 3000),
       weights=st.lists(st.integers(0, 5), min_size=4, max_size=4).filter(any))
def test_synthetic_grammar_property(seed, n, weights):
    mix = ",".join(f"{k}={w}" for k, w in zip(P.KINDS, weights))
    tokens, diff = P.generate_synthetic(n, seed, mix)
    assert len(tokens) == len(diff) >= n
    text, classes = decode_synth(tokens, diff)
    assert classes == expected_classes(text)
    last_segment = text[:-1].rsplit("|", 1)[-1] + "|"
    assert len(text) - len(last_segment) < n, "stops right after reaching n tokens"
    present_kinds = {seg[0] for seg in text[:-1].split("|")}
    assert present_kinds <= {"CNRA"[i] for i, w in enumerate(weights) if w > 0}


def test_synthetic_end_to_end(tmp_path):
    out = tmp_path / "synthetic"
    meta = P.prepare("synthetic", out, num_tokens=20_000)
    assert meta == json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"] == "synthetic" and meta["vocab_size"] == len(meta["itos"]) < 64
    assert meta["dtype"] == "uint16" and meta["source"] == "builtin"
    assert meta["difficulty_classes"][:4] == ["structure", "trivial", "noise", "hard"]
    assert set(meta["files"]) == {
        "train.bin",
        "val.bin",
        "train_difficulty.bin",
        "val_difficulty.bin",
    }
    raw = b""
    for split in ("train", "val"):
        tokens, diff = load(out, f"{split}.bin", meta), load(out, f"{split}_difficulty.bin", meta)
        assert len(tokens) == len(diff) == meta[f"{split}_tokens"]
        counts = np.bincount(diff, minlength=len(meta["difficulty_classes"]))
        assert (counts > 0).all(), "every class is present"
        assert (
            dict(zip(meta["difficulty_classes"], counts.tolist()))
            == meta["difficulty_counts"][split]
        )
        text, classes = decode_synth(tokens, diff)
        assert classes == expected_classes(text)
        raw += tokens.tobytes()
    assert meta["train_tokens"] >= 18_000 and meta["val_tokens"] >= 2_000
    assert meta["source_sha256"] == hashlib.sha256(raw).hexdigest()
    for name, info in meta["files"].items():
        data = (out / name).read_bytes()
        assert info == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert P.check_prepared(out) == meta


def test_synthetic_determinism(tmp_path):
    a = P.prepare("synthetic", tmp_path / "a", num_tokens=5000, seed=7)
    b = P.prepare("synthetic", tmp_path / "b", num_tokens=5000, seed=7)
    c = P.prepare("synthetic", tmp_path / "c", num_tokens=5000, seed=8)
    assert folder_bytes(tmp_path / "a")["train.bin"] == folder_bytes(tmp_path / "b")["train.bin"]
    assert a["files"] == b["files"] and a["source_sha256"] == b["source_sha256"]
    assert (tmp_path / "a" / "train.bin").read_bytes() != (
        tmp_path / "c" / "train.bin"
    ).read_bytes()
    assert a["source_sha256"] != c["source_sha256"]
    train, val = (
        (tmp_path / "a" / "train.bin").read_bytes(),
        (tmp_path / "a" / "val.bin").read_bytes(),
    )
    assert val not in train, "val is its own stream"


def test_synthetic_mix():
    tokens, diff = P.generate_synthetic(500, 0, "add=1")
    text, _ = decode_synth(tokens, diff)
    assert {seg[0] for seg in text[:-1].split("|")} == {"A"}
    assert list(P.parse_mix("copy=1, noise=3")) == [0.25, 0, 0.75, 0, 0]
    for bad in ["copy=1,foo=2", "copy=x", "copy=0,add=0", "copy=-1,add=2"]:
        with pytest.raises(P.PrepareError, match="--mix"):
            P.parse_mix(bad)


def test_a_mix_naming_a_kind_twice_is_refused():
    """copy=0.3,...,copy=0.5 is a slip (which share was meant?): refused, not the last one kept."""
    for bad in ["copy=1,noise=1,copy=0", "add=0.5, add=0.5"]:
        with pytest.raises(P.PrepareError, match=r"--mix: kind '(copy|add)' is given twice"):
            P.parse_mix(bad)
    assert list(P.parse_mix("copy=1,noise=1")) == [0.5, 0, 0.5, 0, 0]


def test_synthetic_default_is_fast_enough():
    tokens, _ = P.generate_synthetic(200_000, 1337)
    assert len(tokens) >= 200_000


# ----------------------------------------------------------------------------- file datasets
@pytest.mark.skipif(not SHAKESPEARE.is_file(), reason="../shared/data/tinyshakespeare.txt absent")
def test_shakespeare_char_from_shared_default(tmp_path):
    meta = P.prepare("shakespeare_char", tmp_path / "sc")
    text = SHAKESPEARE.read_text()
    assert meta["source"] == str(SHAKESPEARE.resolve())
    assert meta["vocab_size"] == 65 == len(meta["chars"]) and meta["chars"] == sorted(set(text))
    assert meta["train_tokens"] == int(len(text) * 0.9) and meta["val_tokens"] == len(text) - int(
        len(text) * 0.9
    )
    assert meta["split"] == "90/10 by characters" and meta["tokenizer"] == "char"
    train = load(tmp_path / "sc", "train.bin", meta)
    assert "".join(meta["chars"][i] for i in train[:200]) == text[:200]
    assert meta["source_sha256"] == hashlib.sha256(SHAKESPEARE.read_bytes()).hexdigest()


def test_enwik8_small_raw_and_zip(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 2000, dtype=np.uint8).tobytes()
    (tmp_path / "enwik8").write_bytes(data)
    with zipfile.ZipFile(tmp_path / "enwik8.zip", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("enwik8", data)
    metas = []
    for name in ("enwik8", "enwik8.zip"):
        out = tmp_path / f"out_{name}"
        meta = P.prepare("enwik8", out, input=str(tmp_path / name))
        assert (meta["vocab_size"], meta["tokenizer"], meta["dtype"]) == (256, "byte", "uint16")
        assert (meta["train_tokens"], meta["val_tokens"], meta["test_tokens"]) == (1800, 100, 100)
        assert "proportional" in meta["split"]
        got = b"".join(
            load(out, f"{s}.bin", meta).astype(np.uint8).tobytes() for s in ("train", "val", "test")
        )
        assert got == data
        assert meta["source_sha256"] == hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()
        metas.append(meta)
    assert metas[0]["files"] == metas[1]["files"]


@pytest.mark.skipif(not FINEWEB.is_file(), reason="../shared/data/fineweb_sample_legal.parquet "
                                                  "absent")
def test_fineweb_edu_from_parquet(tmp_path, tiktoken_cache):
    need_gpt2(tiktoken_cache)
    import pyarrow.parquet as pq
    import tiktoken
    meta = P.prepare("fineweb_edu", tmp_path / "fw", input=str(FINEWEB), max_docs=50)
    assert (meta["vocab_size"], meta["eot_token"], meta["dtype"], meta["documents"]) == (
        50257,
        50256,
        "uint16",
        50,
    )
    train, val = load(tmp_path / "fw", "train.bin", meta), load(tmp_path / "fw", "val.bin", meta)
    assert (train == 50256).sum() == 49 and (val == 50256).sum() == 1, (
        "one EOT per document, 1 val doc"
    )
    assert train[-1] == val[-1] == 50256
    first = pq.read_table(FINEWEB, columns=["text"]).column("text")[0].as_py()
    end = int(np.argmax(train == 50256))
    assert tiktoken.get_encoding("gpt2").decode(train[:end].tolist()) == first


def test_fineweb_edu_jsonl_and_txt(tmp_path, tiktoken_cache):
    need_gpt2(tiktoken_cache)
    docs = [
        "first doc\nwith two lines",
        "second <|endoftext|> inline stays text",
        "third",
        "fourth",
    ]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tmp_path / "d.txt").write_text("".join(d + "\n<|endoftext|>\n" for d in docs))
    for name, max_docs in (("d.jsonl", 3), ("d.txt", 3)):
        meta = P.prepare(
            "fineweb_edu",
            tmp_path / name.replace(".", "_"),
            input=str(tmp_path / name),
            max_docs=max_docs,
        )
        train = load(tmp_path / name.replace(".", "_"), "train.bin", meta)
        val = load(tmp_path / name.replace(".", "_"), "val.bin", meta)
        assert meta["documents"] == 3 and (train == 50256).sum() == 2 and (val == 50256).sum() == 1
        import tiktoken

        texts = (
            tiktoken.get_encoding("gpt2")
            .decode(np.concatenate([train, val]).tolist())
            .split("<|endoftext|>")
        )
        sep = "\n" if name.endswith("txt") else ""
        assert texts[0] == docs[0] + sep and texts[-1] == ""


def test_parquet_text_column_of_non_strings_is_refused(tmp_path):
    """A parquet `text` column of numbers or bytes is bad input (PrepareError naming the file),
    as a .jsonl line without a string 'text' is; not a TypeError inside the tokenizer."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    for name, column in (("ints", [1, 2, 3]), ("bytes", [b"ab", b"cd", b"ef"])):
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table({"text": column}), path)
        with pytest.raises(P.PrepareError, match=f"{name}.parquet: its `text` column holds "
                           f"{type(column[0]).__name__}, not strings"):
            P.load_docs(path, 10)
    path = tmp_path / "ok.parquet"
    pq.write_table(pa.table({"text": ["one", None, "", "two"]}), path)
    assert P.load_docs(path, 10)[1] == ["one", "two"]


def test_max_docs_counts_only_documents_with_text_in_every_format(tmp_path):
    """--max_docs takes the first N documents that hold more than whitespace: an empty or blank
    document (a null, "", "  ") is skipped and not counted, whatever the file's format."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    column = ["", None, "  \n", "one", "", "two", "three"]
    pq.write_table(pa.table({"text": column}), tmp_path / "d.parquet")
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t or ""}) + "\n"
                                              for t in column))
    (tmp_path / "d.txt").write_text("".join((t or "") + "\n<|endoftext|>\n" for t in column))
    for name in ("d.parquet", "d.jsonl", "d.txt"):
        docs = [d.strip() for d in P.load_docs(tmp_path / name, 2)[1]]
        assert docs == ["one", "two"], name


def test_max_docs_counts_only_documents_with_text_when_streamed(monkeypatch):
    """The hub stream (fineweb_edu without --input) takes --max_docs by the same rule."""
    import types
    rows = [{"text": t} for t in ["", None, " \n", "one", "two", "three"]]
    stub = types.SimpleNamespace(load_dataset=lambda *a, **k: iter(rows))
    monkeypatch.setitem(sys.modules, "datasets", stub)
    raw, docs = P.stream_fineweb_edu(2)
    assert docs == ["one", "two"] and raw == b"one\n<|endoftext|>\ntwo"


def test_jsonl_lines_end_at_newlines_only(tmp_path):
    """JSON may hold U+2028, U+0085 or U+001C unescaped inside a string (json.dumps with
    ensure_ascii=False writes them so): they are text, not line ends."""
    docs = ["one\u2028two", "three\x85four", "five\x1csix", "seven"]
    (tmp_path / "d.jsonl").write_bytes(
        "".join(json.dumps({"text": d}, ensure_ascii=False) + "\r\n" for d in docs).encode()
    )
    assert P.load_docs(tmp_path / "d.jsonl", 10)[1] == docs
    (tmp_path / "bad.jsonl").write_text('{"text": "a\u2028b"}\n\nnot json\n', encoding="utf-8")
    with pytest.raises(P.PrepareError, match="bad.jsonl line 3: not a JSON object"):
        P.load_docs(tmp_path / "bad.jsonl", 10)


def test_txt_documents_split_at_crlf_separator_lines(tmp_path):
    (tmp_path / "d.txt").write_bytes(b"doc one\r\n<|endoftext|>\r\ndoc two\r\n<|endoftext|> \r\n"
                                     b"doc three\r\n")
    assert P.load_docs(tmp_path / "d.txt", 10)[1] == ["doc one\r\n", "doc two\r\n",
                                                       "doc three\r\n"]
    assert P.split_txt_docs("a\n<|endoftext|>\nb\n") == ["a\n", "b\n"]


@pytest.mark.parametrize("tokenizer", ["char", "byte", "gpt2"])
def test_text_each_tokenizer(tmp_path, tiktoken_cache, tokenizer):
    if tokenizer == "gpt2":
        need_gpt2(tiktoken_cache)
    text = "héllo wörld, nanodepth 🚀\n" * 40
    (tmp_path / "in.txt").write_text(text, encoding="utf-8")
    meta = P.prepare("text", tmp_path / "t", input=str(tmp_path / "in.txt"), tokenizer=tokenizer)
    ids = np.concatenate([load(tmp_path / "t", f"{s}.bin", meta) for s in ("train", "val")])
    assert meta["val_tokens"] == len(ids) - int(len(ids) * 0.9) > 0
    if tokenizer == "char":
        assert (
            meta["vocab_size"] == len(set(text)) and "".join(meta["chars"][i] for i in ids) == text
        )
    elif tokenizer == "byte":
        assert meta["vocab_size"] == 256 and ids.astype(np.uint8).tobytes() == text.encode()
    else:
        import tiktoken
        assert meta["eot_token"] == 50256 and ids[-1] == 50256 and (ids == 50256).sum() == 1
        assert tiktoken.get_encoding("gpt2").decode(ids[:-1].tolist()) == text


def test_text_name_sets_default_folder_and_command(tmp_path, monkeypatch):
    monkeypatch.setattr(P, "DATA_DIR", tmp_path)
    (tmp_path / "in.txt").write_text("abcdefghij" * 5)
    meta = P.prepare("text", input=str(tmp_path / "in.txt"), name="mine", val_fraction=0.2)
    assert (tmp_path / "mine" / "meta.json").is_file()
    assert (
        meta["command"]
        == f"python data/prepare.py text --input={tmp_path / 'in.txt'} --val_fraction=0.2 "
           "--name=mine"
    )
    assert meta["split"] == "80/20 by characters"


@pytest.mark.parametrize("fraction, split", [(0.005, "99.5/0.5"), (0.004, "99.6/0.4"),
                                              (0.1, "90/10"), (0.3, "70/30"), (0.125, "87.5/12.5")])
def test_text_split_in_meta_states_the_fraction_given(tmp_path, fraction, split):
    """meta.json's split names the shares --val_fraction made, not a rounding of them to whole
    percents (0.005 held out is not '100/0')."""
    (tmp_path / "in.txt").write_text("abcdefghij" * 100)
    meta = P.prepare("text", tmp_path / "out", input=str(tmp_path / "in.txt"),
                     val_fraction=fraction)
    assert meta["split"] == f"{split} by characters"
    assert meta["val_tokens"] == 1000 - int(1000 * (1 - fraction))


# ----------------------------------------------------------------------------- dtype
def test_dtype_choice():
    ids = np.array([0, 65535, 69999])
    assert (
        P.to_array(ids, 70000).dtype == np.dtype("<u4")
        and P.to_array(ids, 70000).tolist() == ids.tolist()
    )
    assert P.to_array(ids[:2], 65535).dtype == np.dtype("<u2")
    assert P.to_array(ids[:2], 100, "uint32").dtype == np.dtype("<u4")
    with pytest.raises(P.PrepareError, match="uint16"):
        P.to_array(ids, 70000, "uint16")
    with pytest.raises(P.PrepareError, match="--dtype"):
        P.to_array(ids, 100, "int8")


def test_large_char_vocab_uses_uint32(tmp_path):
    chars = [chr(c) for c in range(0x21, 0x21 + 70_000) if not 0xD800 <= c < 0xE000]
    (tmp_path / "wide.txt").write_text("".join(chars), encoding="utf-8")
    meta = P.prepare("text", tmp_path / "w", input=str(tmp_path / "wide.txt"))
    assert meta["vocab_size"] == len(chars) > 65535 and meta["dtype"] == "uint32"
    assert (tmp_path / "w" / "train.bin").stat().st_size == 4 * meta["train_tokens"]
    with pytest.raises(P.PrepareError, match="does not fit --dtype uint16"):
        P.prepare("text", tmp_path / "w16", input=str(tmp_path / "wide.txt"), dtype="uint16")
    assert not (tmp_path / "w16").exists()


# ----------------------------------------------------------------------------- errors
def error_cases(tmp):
    (tmp / "empty.txt").write_bytes(b"")
    (tmp / "bad.txt").write_bytes(b"good text\xff\xfe more")
    (tmp / "tiny.txt").write_text("abc")
    (tmp / "one.txt").write_text("a")
    (tmp / "tiny.bin").write_bytes(b"0123456789")
    (tmp / "one.jsonl").write_text(json.dumps({"text": "only one doc"}) + "\n")
    (tmp / "broken.jsonl").write_text('{"text": "ok"}\nnot json\n')
    return [
        (("text",), dict(input=str(tmp / "nope.txt")), f"input file not found: {tmp / 'nope.txt'}"),
        (("enwik8",), dict(input=str(tmp / "nope.zip")), "not found"),
        (("text",), dict(input=str(tmp / "empty.txt")), "empty"),
        (("text",), dict(input=str(tmp / "bad.txt")), "not valid UTF-8 (byte offset 9)"),
        (("text",), dict(input=str(tmp / "bad.txt"), tokenizer="gpt2"), "byte offset 9"),
        (("text",), {}, "needs --input"),
        (
            ("wikipedia",),
            {},
            "unknown dataset 'wikipedia'; valid datasets: synthetic, synthetic_lookup, "
            "shakespeare_char",
        ),
        (("text",), dict(input=str(tmp / "one.txt")), "would leave the train split empty"),
        (("text",), dict(input=str(tmp / "tiny.txt"), val_fraction=1.5), "between 0 and 1"),
        (("text",), dict(input=str(tmp / "tiny.txt"), tokenizer="bpe"), "char, byte or gpt2"),
        (("enwik8",), dict(input=str(tmp / "tiny.bin")), "val split would be empty"),
        (("synthetic",), dict(num_tokens=1), "a split would be empty"),
        (("synthetic",), dict(tokenizer="char"), "--tokenizer do not apply to dataset synthetic"),
        (("synthetic",), dict(dtype="float"), "--dtype"),
        (("fineweb_edu",), dict(input=str(tmp / "one.jsonl")), "at least 2"),
        (("fineweb_edu",), dict(input=str(tmp / "broken.jsonl")), "line 2"),
        (("fineweb_edu",), dict(input=str(tmp / "tiny.txt"), val_fraction=0), "between 0 and 1"),
    ]


def test_errors_are_clear_and_write_nothing(tmp_path, tiktoken_cache):
    for args, opts, message in error_cases(tmp_path):
        out = tmp_path / "out"
        with pytest.raises(P.PrepareError) as e:
            P.prepare(*args, out, **opts)
        assert message in str(e.value), (args, opts, str(e.value))
        assert not out.exists(), f"{args} {opts} wrote something"


def test_fineweb_without_input_or_datasets(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(P.PrepareError, match="pip install datasets.*fineweb_sample_legal.parquet"):
        P.prepare("fineweb_edu", tmp_path / "fw")
    assert not (tmp_path / "fw").exists()


def test_download_failure_says_pass_input(tmp_path, monkeypatch):
    def offline(*a, **k):
        raise OSError("network is unreachable")
    monkeypatch.setattr(P.urllib.request, "urlopen", offline)
    with pytest.raises(P.PrepareError, match="could not download http://mattmahoney.net.*pass "
                                             "--input FILE"):
        P.prepare("enwik8", tmp_path / "e")
    monkeypatch.setattr(P, "SHARED_DATA", tmp_path / "no_shared")
    with pytest.raises(P.PrepareError, match="could not download "
                                             "https://raw.githubusercontent.com.*--input FILE"):
        P.prepare("shakespeare_char", tmp_path / "s")
    assert not (tmp_path / "e").exists() and not (tmp_path / "s").exists()


def test_cli(tmp_path):
    def run(*args):
        return run_group([sys.executable, REPO / "data" / "prepare.py", *args], 60)
    r = run("nope")
    assert r.returncode == 2 and "unknown dataset 'nope'" in r.stderr and "synthetic" in r.stderr
    r = run("text", "--input", str(tmp_path / "missing.txt"), "--out_dir", str(tmp_path / "x"))
    assert r.returncode == 2 and "missing.txt" in r.stderr and not (tmp_path / "x").exists()
    r = run("synthetic", "--num_tokens", "3000", "--seed", "3", "--out_dir", str(tmp_path / "s"))
    assert r.returncode == 0, r.stderr
    assert "synthetic" in r.stdout and "vocab 34" in r.stdout and str(tmp_path / "s") in r.stdout
    meta = P.check_prepared(tmp_path / "s")
    assert meta["prepare_args"] == {"dtype": "auto", "seed": 3, "num_tokens": 3000,
                                    "mix": P.DEFAULTS["synthetic"]["mix"]}
    from_cli = folder_bytes(tmp_path / "s")
    P.prepare("synthetic", tmp_path / "s", num_tokens=3000, seed=3)
    assert folder_bytes(tmp_path / "s") == from_cli


# -------------------------------------------------------------------- idempotence, atomicity, check
def test_idempotent(tmp_path):
    (tmp_path / "in.txt").write_text("some text to tokenize, twice\n" * 50)
    for dataset, opts in [
        ("synthetic", dict(num_tokens=4000)),
        ("text", dict(input=str(tmp_path / "in.txt"))),
    ]:
        out = tmp_path / dataset
        m1 = P.prepare(dataset, out, **opts)
        first = folder_bytes(out)
        m2 = P.prepare(dataset, out, **opts)
        assert m1 == m2 and folder_bytes(out) == first
        assert not [p for p in out.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("run_file", ["ckpt.pt", "metrics.jsonl", "run_info.json"])
def test_a_training_runs_folder_is_refused_as_the_data_folder(tmp_path, run_file):
    """A dataset's files written beside a run's (train.bin beside ckpt.pt) would be taken for
    part of it: refused before any work, with --overwrite too, the run's files kept."""
    (tmp_path / run_file).write_text("the run's")
    for extra in ({}, dict(overwrite=True)):
        with pytest.raises(P.PrepareError, match=re.escape(
                f"--out_dir {tmp_path} holds a training run ({run_file}); prepare the data into "
                "a folder of its own")):
            P.prepare("synthetic", tmp_path, num_tokens=3000, **extra)
    assert sorted(p.name for p in tmp_path.iterdir()) == [run_file]


def test_a_dataset_of_other_options_is_replaced_only_with_overwrite(tmp_path):
    """The same options rewrite the same files; others are refused before any work, naming the
    command that made the folder, unless --overwrite=True (runs trained on a replaced dataset
    refuse it by its hashes, and their checkpoints do not record its command)."""
    out = tmp_path / "syn"
    meta = P.prepare("synthetic", out, num_tokens=3000, seed=1)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert P.prepare("synthetic", out, num_tokens=3000, seed=1)["files"] == meta["files"]
    for other in (dict(num_tokens=3000, seed=2), dict(num_tokens=4000, seed=1)):
        with pytest.raises(P.PrepareError) as e:
            P.prepare("synthetic", out, **other)
        assert str(e.value) == (
            f"{out} holds a dataset prepared with other options (python data/prepare.py synthetic "
            f"--seed=1 --num_tokens=3000 --out_dir={out}); runs trained on it would no longer "
            "read it: give another --out_dir, or --overwrite=True to replace it")
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    with pytest.raises(P.PrepareError, match="holds a dataset prepared with other options"):
        P.prepare("synthetic_lookup", out, num_tokens=3000, seed=1)
    assert P.prepare("synthetic", out, num_tokens=3000, seed=2, overwrite=True)["files"] != \
        meta["files"]


def test_crash_between_files_leaves_nothing_acceptable(tmp_path, monkeypatch):
    out = tmp_path / "synthetic"
    P.prepare("synthetic", out, num_tokens=3000, seed=1)  # an older complete dataset in the folder
    real, calls = P.write_file, []

    def crashing(path, data):
        calls.append(path.name)
        if len(calls) == 2:
            raise RuntimeError("simulated crash")
        real(path, data)
    monkeypatch.setattr(P, "write_file", crashing)
    with pytest.raises(RuntimeError, match="simulated"):
        P.prepare("synthetic", out, num_tokens=3000, seed=2, overwrite=True)
    assert calls == ["train.bin", "val.bin"]
    assert not (out / "meta.json").exists()
    with pytest.raises(P.PrepareError, match="python data/prepare.py synthetic"):
        P.check_prepared(out)
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]


def test_crash_inside_a_file_leaves_no_partial_file(tmp_path, monkeypatch):
    def half_then_crash(f, view):
        f.write(view[: len(view) // 2])
        raise OSError("disk full")
    monkeypatch.setattr(P, "write_chunks", half_then_crash)
    out = tmp_path / "synthetic"
    with pytest.raises(OSError, match="disk full"):
        P.prepare("synthetic", out, num_tokens=3000)
    assert [p.name for p in out.iterdir()] == []
    with pytest.raises(P.PrepareError):
        P.check_prepared(out)


def test_check_prepared_messages(tmp_path, monkeypatch):
    monkeypatch.setattr(P, "DATA_DIR", tmp_path)
    with pytest.raises(P.PrepareError) as e:
        P.check_prepared(tmp_path / "enwik8")
    assert str(e.value).endswith("run: python data/prepare.py enwik8")
    with pytest.raises(P.PrepareError) as e:
        P.check_prepared(tmp_path / "elsewhere" / "shakespeare_char")
    assert (
        "run: python data/prepare.py shakespeare_char "
        f"--out_dir={tmp_path / 'elsewhere' / 'shakespeare_char'}"
        in str(e.value)
    )

    meta = P.prepare("synthetic", num_tokens=3000, seed=5)
    folder = tmp_path / "synthetic"
    assert meta["command"] == "python data/prepare.py synthetic --seed=5 --num_tokens=3000"
    assert P.check_prepared(folder)["files"] == meta["files"]
    with open(folder / "val.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(P.PrepareError, match="val.bin has .* bytes, meta.json says") as e:
        P.check_prepared(folder)
    assert str(e.value).endswith(f"run: {meta['command']}")
    (folder / "train_difficulty.bin").unlink()
    with pytest.raises(P.PrepareError, match="train_difficulty.bin missing"):
        P.check_prepared(folder)
    (folder / "meta.json").write_text("{not json")
    with pytest.raises(P.PrepareError, match="python data/prepare.py synthetic"):
        P.check_prepared(folder)
    (folder / "meta.json").write_text('{"dataset": "synthetic"}')    # no file listing
    with pytest.raises(P.PrepareError, match=r"\(meta.json missing or unreadable: it lists no "
                                             r"'files'\); run: "):
        P.check_prepared(folder)


@pytest.mark.parametrize("files", [None, [], ["train.bin", "val.bin"], "train.bin", 7,
                                   {"train.bin": 4, "val.bin": [4]}])
def test_check_prepared_refuses_a_meta_json_whose_files_are_not_a_listing(tmp_path, files):
    """A meta.json that parses but whose `files` is no {name: {bytes, sha256}} mapping is a folder
    to re-prepare (PrepareError with the command), not a crash."""
    (tmp_path / "meta.json").write_text(json.dumps({"dataset": "synthetic", "files": files}))
    with pytest.raises(P.PrepareError, match="run: python data/prepare.py") as e:
        P.check_prepared(tmp_path)
    assert str(tmp_path) in str(e.value)


def test_ensure_tiktoken_cache(tmp_path, monkeypatch, tiktoken_cache):
    need_gpt2(tiktoken_cache)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "/some/where")
    assert P.ensure_tiktoken_cache() == "/some/where"
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    cache = Path(P.ensure_tiktoken_cache())
    assert cache == tmp_path / ".cache" / "nanodepth" / "tiktoken"
    assert P.os.environ["TIKTOKEN_CACHE_DIR"] == str(cache)
    for name, key in P.TIKTOKEN_FILES.items():
        assert (cache / key).read_bytes() == (P.SHARED_DATA / "gpt2" / name).read_bytes()
    # a cached copy damaged in place (same size, other bytes) is written again from the source
    key = P.TIKTOKEN_FILES["vocab.bpe"]
    good = (cache / key).read_bytes()
    (cache / key).write_bytes(bytes([good[0] ^ 1]) + good[1:])
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR")
    assert P.ensure_tiktoken_cache() == str(cache) and (cache / key).read_bytes() == good
    monkeypatch.setattr(P, "SHARED_DATA", tmp_path / "absent")
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR")
    assert P.ensure_tiktoken_cache() is None and "TIKTOKEN_CACHE_DIR" not in P.os.environ


# ------------------------------------------------------------ concurrent prepares, stale temp files
def assert_consistent(folder):
    meta = json.loads((Path(folder) / "meta.json").read_text())
    for name, info in meta["files"].items():
        assert hashlib.sha256((Path(folder) / name).read_bytes()).hexdigest() == info["sha256"], (
            name
        )
    return meta


def test_two_prepares_into_one_folder_take_turns(tmp_path, monkeypatch):
    """A pauses right after writing train.bin and starts B; B must wait for A's lock, then rewrite
    everything (without the lock B would finish inside A's pause and A's meta.json would describe
    B's train.bin)."""
    out, real, main = tmp_path / "synthetic", P.write_file, threading.current_thread()
    b_done, errors = threading.Event(), []

    def b():
        try:
            P.prepare("synthetic", out, num_tokens=3000, seed=2)
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
        b_done.set()
    thread = threading.Thread(target=b)

    def pausing(path, data):
        real(path, data)
        if threading.current_thread() is main and path.name == "train.bin":
            thread.start()
            assert not b_done.wait(0.5), "B finished while A held the folder"
    monkeypatch.setattr(P, "write_file", pausing)
    P.prepare("synthetic", out, num_tokens=3000, seed=1)
    thread.join(10)
    assert not thread.is_alive() and not errors, errors
    meta = assert_consistent(out)
    assert meta["prepare_args"]["seed"] == 2, "the second writer rewrote every file"
    assert P.verify_checksums(out) == meta


def test_prepare_without_fcntl(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "fcntl", None)
    P.prepare("synthetic", tmp_path / "s", num_tokens=3000)
    assert_consistent(tmp_path / "s")


def test_stale_tmp_files_of_dead_processes_are_removed(tmp_path):
    # a process that exited and was reaped: its pid no longer exists
    dead_pid = int(run_group([sys.executable, "-c", "import os; print(os.getpid())"], 60).stdout)
    assert not pid_alive(dead_pid) and pid_alive(os.getppid())
    out = tmp_path / "synthetic"
    out.mkdir()
    stale, live = out / f"train.bin.tmp-{dead_pid}", out / f"input.txt.tmp-{os.getppid()}"
    other = out / "notes.tmp-abc"
    for p in (stale, live, other):
        p.write_bytes(b"leftover")
    P.prepare("synthetic", out, num_tokens=3000)
    assert not stale.exists() and live.exists() and other.exists()
    assert_consistent(out)


# -------------------------------------------------------------------------- checksums and token ids
def test_verify_checksums_catches_same_size_corruption(tmp_path):
    out = tmp_path / "synthetic"
    meta = P.prepare("synthetic", out, num_tokens=3000, seed=4)
    assert P.verify_checksums(out) == meta and P.verify_checksums(out, meta, chunk=7) == meta
    data = bytearray((out / "train.bin").read_bytes())
    data[1001] ^= 1
    (out / "train.bin").write_bytes(bytes(data))
    assert P.check_prepared(out) == meta, "the size check alone passes"
    for chunk in (7, 1 << 20):
        with pytest.raises(P.PrepareError) as e:
            P.verify_checksums(out, chunk=chunk)
        assert str(e.value).startswith(f"{out / 'train.bin'} does not match its sha256")
        assert str(e.value).endswith(f"run: {meta['command']}") and "\n" not in str(e.value)
    (out / "train.bin").unlink()
    with pytest.raises(P.PrepareError, match="cannot read .*train.bin.*run: python "
                                             "data/prepare.py"):
        P.verify_checksums(out, meta)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_max_token_id_chunks_and_empty(tmp_path, dtype):
    path = tmp_path / "x.bin"
    path.write_bytes(b"")
    assert P.max_token_id(path, dtype) == -1
    ids = (
        np.random.default_rng(0)
        .integers(0, 1000, 100)
        .astype("<u2" if dtype == "uint16" else "<u4")
    )
    for where in (0, 9, 10, 11, 99):  # the maximum at and around the chunk boundaries
        arr = ids.copy()
        arr[where] = 5000
        arr.tofile(path)
        for chunk in (1, 3, 10, 100, 1000):
            assert P.max_token_id(path, dtype, chunk=chunk) == 5000
    assert isinstance(P.max_token_id(path, dtype), int)
    path.write_bytes(b"\0" * (np.dtype(dtype).itemsize + 1))
    with pytest.raises(P.PrepareError, match=f"x.bin has .* bytes, not a whole number of {dtype} "
                                             "ids"):
        P.max_token_id(path, dtype)


def test_check_token_ids(tmp_path):
    out = tmp_path / "synthetic"
    meta = P.prepare("synthetic", out, num_tokens=3000, seed=4)
    top = P.max_token_id(out / "train.bin", meta["dtype"])
    assert top < meta["vocab_size"] == 34
    assert P.check_token_ids(out, meta, meta["vocab_size"], chunk=5) == meta
    with pytest.raises(P.PrepareError) as e:
        P.check_token_ids(out, meta, 10, "the model's vocabulary")
    assert str(e.value) == (
        f"{out / 'train.bin'} holds token id {top} but the model's vocabulary is 10: "
        "too small for this data; use a model with vocab_size >= 34"
    )
    ids = np.fromfile(out / "val.bin", dtype="<u2")
    ids[len(ids) // 2] = 40
    ids.tofile(out / "val.bin")  # same size: only the ids show it
    for chunk in (1, 4, 1 << 20):
        with pytest.raises(P.PrepareError) as e:
            P.check_token_ids(out, meta, 34, "meta.json's vocab_size", chunk=chunk)
        assert str(e.value) == (
            f"{out / 'val.bin'} holds token id 40 but meta.json's vocab_size is 34: "
            f"the data and meta.json disagree; run: {meta['command']}"
        )
    ids[:] = 0
    ids[-1] = 33
    ids.tofile(out / "val.bin")
    P.check_token_ids(out, meta, 34)  # difficulty files (uint8 classes) are not token ids
    (out / "val.bin").write_bytes(b"")
    P.check_token_ids(out, meta, 34)


def test_help_gives_each_option_its_description_and_per_dataset_defaults(capsys):
    """--help exits 0, on stdout: every option described, with the datasets that take it and their
    defaults read from DEFAULTS."""
    with pytest.raises(SystemExit) as e:
        P.main(['--help'])
    out = ' '.join(capsys.readouterr().out.split())
    assert e.value.code == 0
    assert '--max_docs MAX_DOCS documents to read (fineweb_edu: 100000)' in out
    assert "the share held out for val (fineweb_edu: 0.005; text: 0.1)" in out


# --------------------------------------------------------------------------------------------------
# arith: a task with answers, its splits disjoint in operand pairs

def arith_lines(folder, split):
    meta = json.loads((Path(folder) / "meta.json").read_text())
    ids = load(folder, f"{split}.bin", meta)
    mask = np.fromfile(Path(folder) / f"{split}_loss_mask.bin", dtype=np.uint8)
    text = "".join(meta["chars"][i] for i in ids)
    return meta, text, mask


def pairs_of(text, symbols):
    back = {v: k for k, v in symbols.items()}
    out = set()
    for line in "".join(back[c] for c in text).splitlines():
        a, b = re.match(r"(\d+)[-+*](\d+)=", line).groups()
        out.add(frozenset((int(a), int(b))))
    return out


@pytest.mark.parametrize("ops", ["+-", "*"])
def test_arith_splits_share_no_operand_pair_and_answers_are_right(tmp_path, ops):
    P.prepare("arith", out_dir=tmp_path / "a", num_problems=400, digits=2, ops=ops)
    pairs = {}
    for split in ("train", "val", "test"):
        meta, text, _ = arith_lines(tmp_path / "a", split)
        for line in text.splitlines():
            a, op, b, c = re.fullmatch(r"(\d+)([-+*])(\d+)=(\d+)", line).groups()
            assert op in ops and int(c) == {"+": int(a) + int(b), "-": int(a) - int(b),
                                            "*": int(a) * int(b)}[op]
        pairs[split] = pairs_of(text, meta["symbols"])
    assert meta["problems"] == {"train": 400, "val": 40, "test": 40}
    assert len(pairs["test"]) > 20 and len(pairs["train"]) > 200
    assert not pairs["train"] & pairs["val"] and not pairs["train"] & pairs["test"]
    assert not pairs["val"] & pairs["test"]


def test_arith_reversed_answers_are_the_plain_answers_digits_backwards(tmp_path):
    P.prepare("arith", out_dir=tmp_path / "p", num_problems=200, digits=3, ops="+-")
    P.prepare("arith", out_dir=tmp_path / "r", num_problems=200, digits=3, ops="+-",
              answer="reversed")
    for split in ("train", "test"):
        plain, rev = arith_lines(tmp_path / "p", split)[1], arith_lines(tmp_path / "r", split)[1]
        pairs = list(zip(plain.splitlines(), rev.splitlines()))
        assert len(pairs) >= 20
        for p_line, r_line in pairs:
            prompt, answer = p_line.split("=")
            assert r_line == f"{prompt}={answer[::-1]}"
        assert any(len(a.split("=")[1]) > 1 and a != b for a, b in pairs)
    with pytest.raises(P.PrepareError, match="--answer"):
        P.prepare("arith", out_dir=tmp_path / "x", num_problems=10, answer="backwards")


@pytest.mark.parametrize("ops, width", [("+", 4), ("-", 3), ("*", 6)])
def test_arith_padded_problems_have_one_width_and_the_unpadded_values(tmp_path, ops, width):
    """--pad=True zero-fills each operand to --digits and the answer to the most digits the
    operator can give (+: digits + 1, -: digits, *: 2 digits), reversed after padding; the
    problems are the unpadded ones, number for number."""
    kw = dict(num_problems=200, digits=3, ops=ops, answer="reversed")
    P.prepare("arith", out_dir=tmp_path / "u", **kw)
    P.prepare("arith", out_dir=tmp_path / "p", pad=True, **kw)
    for split in ("train", "test"):
        plain, padded = arith_lines(tmp_path / "u", split)[1], arith_lines(tmp_path / "p", split)[1]
        pairs = list(zip(plain.splitlines(), padded.splitlines()))
        assert len(pairs) >= 20
        for u_line, p_line in pairs:
            a, op, b, c = re.fullmatch(r"(\d{3})([-+*])(\d{3})=(\d+)", p_line).groups()
            assert len(c) == width
            assert u_line == f"{int(a)}{op}{int(b)}={str(int(c[::-1]))[::-1]}"
        assert any(p.startswith("0") for p in padded.splitlines())
    with pytest.raises(P.PrepareError, match="--pad"):
        P.prepare("arith", out_dir=tmp_path / "x", num_problems=10, pad="yes")


def test_arith_in_gpt2_bpe_encodes_each_problem_and_masks_its_answer(tmp_path, tiktoken_cache):
    """--tokenizer=gpt2 (a GPT-2 backbone's data): each problem is its prompt's tokens then its
    answer's, as GPT-2's encoder gives them; the mask is 1 on the answer's tokens only."""
    need_gpt2(tiktoken_cache)
    import tiktoken
    enc = tiktoken.get_encoding("gpt2")
    P.prepare("arith", out_dir=tmp_path / "g", num_problems=100, digits=2, ops="+",
              answer="reversed", pad=True, tokenizer="gpt2")
    meta = json.loads((tmp_path / "g" / "meta.json").read_text())
    assert meta["tokenizer"] == "gpt2" and meta["vocab_size"] == 50257
    P.prepare("arith", out_dir=tmp_path / "c", num_problems=100, digits=2, ops="+",
              answer="reversed", pad=True)
    want_ids, want_mask = [], []
    for line in arith_lines(tmp_path / "c", "train")[1].splitlines():
        prompt, answer = line.split("=")
        p, a = enc.encode_ordinary(prompt + "="), enc.encode_ordinary(answer + "\n")
        want_ids += p + a
        want_mask += [0] * len(p) + [1] * len(a)
    assert load(tmp_path / "g", "train.bin", meta).tolist() == want_ids
    mask = np.fromfile(tmp_path / "g" / "train_loss_mask.bin", dtype=np.uint8)
    assert mask.tolist() == want_mask and 100 <= sum(want_mask) < len(want_mask) / 2
    for opts in (dict(tokenizer="byte"), dict(tokenizer="gpt2", vocab_from=str(tmp_path / "c"))):
        with pytest.raises(P.PrepareError, match="--tokenizer"):
            P.prepare("arith", out_dir=tmp_path / "x", num_problems=10, **opts)


def test_arith_is_deterministic_given_a_seed(tmp_path):
    for name, seed in (("a", 5), ("b", 5), ("c", 6)):
        P.prepare("arith", out_dir=tmp_path / name, num_problems=200, seed=seed)
    a, b = folder_bytes(tmp_path / "a"), folder_bytes(tmp_path / "b")
    meta = [json.loads(m.pop("meta.json")) for m in (a, b)]
    assert a == b and len(a) == 6                  # 3 splits, 3 masks
    for m in meta:
        m.pop("command")                           # names the folder it was written to
    assert meta[0] == meta[1]
    train_bin = [(tmp_path / f / "train.bin").read_bytes() for f in ("a", "c")]
    assert train_bin[0] != train_bin[1]                   # another seed, other problems


def test_arith_mask_covers_exactly_the_answers_and_their_newline(tmp_path):
    P.prepare("arith", out_dir=tmp_path / "a", num_problems=100)
    for split in ("train", "val", "test"):
        _, text, mask = arith_lines(tmp_path / "a", split)
        want = "".join("0" * (line.index("=") + 1) + "1" * (len(line) - line.index("="))
                       for line in text.splitlines())         # the answer digits and the newline
        assert "".join(map(str, mask)) == want


@pytest.mark.skipif(not SHAKESPEARE.is_file(), reason="no tinyshakespeare.txt in ../shared/data")
def test_arith_in_the_shakespeare_vocabulary_maps_missing_symbols(tmp_path):
    P.prepare("shakespeare_char", out_dir=tmp_path / "sc")
    P.prepare("arith", out_dir=tmp_path / "a", num_problems=100, vocab_from=str(tmp_path / "sc"))
    back = json.loads((tmp_path / "sc" / "meta.json").read_text())
    meta, text, _ = arith_lines(tmp_path / "a", "train")
    assert meta["chars"] == back["chars"] and meta["vocab_size"] == 65   # the same token ids
    assert meta["symbols"]["7"] == "h" and meta["symbols"]["="] == ":"  # no digits, '+', '=' there
    assert meta["symbols"]["-"] == "-" and set(text) <= set(back["chars"])
    assert pairs_of(text, meta["symbols"])


@pytest.mark.parametrize("opts, needle", [
    (dict(ops="+/"), "--ops"), (dict(digits=0), "--digits"),
    (dict(digits=1, num_problems=600), "too few distinct problems"),
])
def test_arith_refuses_bad_options(tmp_path, opts, needle):
    with pytest.raises(P.PrepareError, match=needle):
        P.prepare("arith", out_dir=tmp_path / "a", **opts)
    assert not (tmp_path / "a" / "meta.json").exists()


# ----------------------------------------------------------------------------- progress bars
class FakeTTY(io.StringIO):
    def isatty(self):
        return True


# newlines next to spaces, tabs, \r, non-ASCII, digits, apostrophes and punctuation: the places
# where GPT-2's pre-tokeniser would give other pieces if a text were cut there
TRICKY = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"
          + "it's\n'tis a \nb\t\nc x\r\ny é\nü 12\n34 ...\n!!\n  \n\nz\n" * 3)


@pytest.mark.parametrize("chunk", [1, 5, 1 << 20])
def test_chunked_char_ids_are_np_uniques_inverse(monkeypatch, chunk):
    monkeypatch.setattr(P, "CHUNK_CHARS", chunk)
    ids, vocab, extra = P.char_ids(TRICKY, quiet=True)
    codepoints = np.frombuffer(TRICKY.encode("utf-32-le"), dtype="<u4")
    ref_vocab, ref_ids = np.unique(codepoints, return_inverse=True)   # the unchunked tokeniser
    assert ids.dtype == ref_ids.dtype and ids.tolist() == ref_ids.tolist()
    assert vocab == len(ref_vocab) == 42 and extra["chars"] == [chr(c) for c in ref_vocab]


@pytest.mark.parametrize("chunk", [1, 8, 64])
def test_gpt2_encoded_in_pieces_is_the_bpe_of_the_whole_documents(monkeypatch, tiktoken_cache,
                                                                  chunk):
    need_gpt2(tiktoken_cache)
    import tiktoken
    enc = tiktoken.get_encoding("gpt2")
    monkeypatch.setattr(P, "CHUNK_CHARS", chunk)
    pieces = P.bpe_pieces(TRICKY)
    cuts = len(P.BPE_CUT.findall(TRICKY))          # 14 places to cut
    assert "".join(pieces) == TRICKY and len(pieces) == {1: cuts + 1, 8: 9, 64: 4}[chunk]
    docs = [TRICKY, "", " \n x", "x" * 100]
    ids = P.encode_docs(docs, quiet=True)
    ref = [t for doc in docs for t in enc.encode_ordinary(doc) + [P.GPT2_EOT]]   # unchunked
    assert ids.dtype == np.uint32 and ids.tolist() == ref


def test_prepare_draws_a_bar_only_on_a_terminal_and_writes_the_same_bytes(tmp_path, monkeypatch,
                                                                         capsys):
    pytest.importorskip("tqdm")
    monkeypatch.setattr(P, "CHUNK_CHARS", 64)      # many chunks: the bar moves
    src, folder = tmp_path / "in.txt", tmp_path / "d"
    src.write_text(TRICKY * 10)                    # 35 chunks of 64 characters
    args = ["text", f"--input={src}", f"--out_dir={folder}"]
    assert P.main(args) == 0                       # captured: not a terminal
    assert capsys.readouterr().err == ""
    before = folder_bytes(folder)
    out, err = FakeTTY(), FakeTTY()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    assert P.main(args) == 0
    assert "characters:   0%" in err.getvalue() and "tokenise (char):   0%" in err.getvalue()
    assert "0/35 " in err.getvalue() and "tokenise" not in out.getvalue()
    assert folder_bytes(folder) == before          # meta.json too: the bar is no option of the data
    err.seek(0)
    err.truncate()
    assert P.main(args + ["--quiet=True"]) == 0
    assert err.getvalue() == "" and folder_bytes(folder) == before
