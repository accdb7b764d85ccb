"""Suite-wide: a private AMK cache directory per test session, so runs are hermetic."""
import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _private_amk_cache(tmp_path_factory):
    old = os.environ.get("AMK_CACHE_DIR")
    os.environ["AMK_CACHE_DIR"] = str(tmp_path_factory.mktemp("amk-cache"))
    yield
    if old is None:
        os.environ.pop("AMK_CACHE_DIR", None)
    else:
        os.environ["AMK_CACHE_DIR"] = old
