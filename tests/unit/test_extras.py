"""The optional extras in pyproject.toml: each one-line "pip install 'ddpgpt[X]'" names an extra
that holds what the message asks for, and no more than it needs; README's GPU install line
installs what its web-scale commands need; `make setup`'s dev extra holds every other one."""

import re
import sys

import pytest

from ddpgpt.errors import UserError
from tests.helpers import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

EXTRAS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def packages(extra: str) -> set[str]:
    return {re.split(r"[<>=!;\[ ]", req, maxsplit=1)[0].lower() for req in EXTRAS[extra]}


def named_extra(message: str) -> str:
    return re.search(r"pip install 'ddpgpt\[(\w+)\]'", message).group(1)


def test_the_gpt2_tokenizer_asks_for_tiktoken_alone(monkeypatch):
    from ddpgpt.data.tokenizer import GPT2Tokenizer

    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import fails as if not installed
    with pytest.raises(UserError) as e:
        GPT2Tokenizer()
    extra = packages(named_extra(str(e.value)))
    assert "tiktoken" in extra and "datasets" not in extra, extra


def test_parquet_asks_for_pyarrow(monkeypatch):
    from ddpgpt.data.formats import parquet

    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(UserError) as e:
        parquet._pyarrow()
    assert "pyarrow" in packages(named_extra(str(e.value)))


def test_readmes_gpu_install_line_installs_what_its_commands_need():
    """parquet and .zst sources, the gpt2 tokenizer, and plot's charts."""
    (line,) = re.findall(r"pip install -e '\.\[([\w,]+)\]'", (REPO / "README.md").read_text())
    installed = set().union(*(packages(x) for x in line.split(",")))
    assert {"pyarrow", "zstandard", "tiktoken", "matplotlib"} <= installed, installed


def test_the_dev_extra_holds_every_other_but_hfs_datasets_eval_and_gcsfs():
    """gcsfs: no GCS server runs in the tests; what gs:// asks for is checked below."""
    others = set().union(*(packages(x) for x in EXTRAS if x not in ("dev", "eval")))
    assert others - {"datasets", "gcsfs"} <= packages("dev"), others - packages("dev")
    assert "moto" in packages("dev")  # the S3 server of the object-storage tests


@pytest.mark.parametrize("url, package, extra", [("s3://bucket/data", "s3fs", "cloud"),
                                                 ("gs://bucket/data", "gcsfs", "gcs")])
def test_a_url_asks_for_its_filesystem(monkeypatch, url, package, extra):
    from fsspec.registry import _registry

    from ddpgpt.data import storage

    monkeypatch.setitem(sys.modules, package, None)
    # A filesystem class another test already loaded stays in fsspec's registry: drop it too.
    monkeypatch.delitem(_registry, url.split("://")[0], raising=False)
    with pytest.raises(UserError) as e:
        storage.filesystem(url)
    assert named_extra(str(e.value)) == extra and package in packages(extra), str(e.value)
    assert str(e.value) == f"{url} needs {package}: pip install 'ddpgpt[{extra}]'"


def test_fsspec_itself_asks_for_the_cloud_extra(monkeypatch):
    from ddpgpt.data import storage

    monkeypatch.setitem(sys.modules, "fsspec", None)
    with pytest.raises(UserError, match=r"^s3://b/x needs fsspec: pip install 'ddpgpt\[cloud\]'$"):
        storage.filesystem("s3://b/x")
