"""Shared pytest fixtures for nanodepth."""
import os
import shutil
from pathlib import Path

import pytest

SHARED_GPT2 = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gpt2"
TIKTOKEN_FILES = {"vocab.bpe": "6d1cbeee0f20b3d9449abfede4726ed8212e3aee",
                  "encoder.json": "6c7ea1a7e38e3a7f062df639a5b80947f075ffe6"}


@pytest.fixture(scope="session", autouse=True)
def tiktoken_cache(tmp_path_factory):
    """Serve tiktoken's gpt2 files offline from <repo>/../shared/data/gpt2 via TIKTOKEN_CACHE_DIR.

    Yields the cache folder, or None when the shared files are absent; tests that need the gpt2
    encoding should then skip (`if tiktoken_cache is None: pytest.skip(...)`).
    """
    if not all((SHARED_GPT2 / name).is_file() for name in TIKTOKEN_FILES):
        yield None
        return
    cache = tmp_path_factory.mktemp("tiktoken_cache")
    for name, key in TIKTOKEN_FILES.items():
        shutil.copyfile(SHARED_GPT2 / name, cache / key)
    old = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
    yield cache
    if old is None:
        os.environ.pop("TIKTOKEN_CACHE_DIR", None)
    else:
        os.environ["TIKTOKEN_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def one_thread():
    """Tiny ops: intra-op threads only add synchronisation (10-100x slower on a loaded 2-core box).
    Modules opt in with `pytestmark = pytest.mark.usefixtures('one_thread')`."""
    import torch
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
