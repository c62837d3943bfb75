"""`train --print-config`: a file that `--config` can be given on any later start, on any
machine; and data that is there but will not do is an error, not a config to print. (That the
printed config is the resolved one, read back the same: tests/unit/test_config.py.)"""

import numpy as np
import pytest

from ddpgpt import cli
from ddpgpt.config.io import build
from tests.helpers import write_dataset

SMALL = ["--preset", "tiny", "--model.block-size", "16", "--data.global-batch", "4",
         "--data.micro-batch", "2"]


def _printed(argv, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        cli.main(["train", *argv, "--print-config"])
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_what_belongs_to_this_start_is_printed_at_its_default(tmp_path, capsys):
    """The threads resolved here and a --reset are this start's: printed as 0 and auto, with
    this start's values beside them in comments; read back, they stay unpinned."""
    tokens = np.arange(500) % 100
    data = write_dataset(tmp_path / "d", tokens, tokens[:200], vocab_size=100)
    code, out, _ = _printed(["--data", str(data), "--run-dir", str(tmp_path / "r"), *SMALL,
                             "--run.threads", "3", "--reset"], capsys)
    assert code == 0
    assert "\nthreads = 0  # this start's: 3 (each start decides its own)\n" in out
    assert "\nresume = \"auto\"  # this start's: 'reset' (each start decides its own)\n" in out
    (tmp_path / "printed.toml").write_text(out)
    again = build(None, str(tmp_path / "printed.toml"), {})
    assert (again.run.threads, again.run.resume) == (0, "auto")


def test_a_mixture_that_will_not_do_is_an_error_not_a_config(tmp_path, capsys):
    """Two datasets of other vocabularies (tokenizers): exit 2 and the mixture's one line; a
    dataset not prepared yet still prints the config as given, with a comment."""
    tokens = np.arange(500) % 100
    a = write_dataset(tmp_path / "a", tokens, tokens[:200], vocab_size=100)
    b = write_dataset(tmp_path / "b", tokens, tokens[:200], vocab_size=100, kind="gpt2")
    code, out, err = _printed(["--data", f"{a}:0.5,{b}:0.5", *SMALL], capsys)
    assert (code, out) == (2, "")
    assert err.startswith(f"ddpgpt: error: data.dir: {a} and {b} have different tokenizers")
    code, out, _ = _printed(["--data", f"{a}:0.5,{tmp_path / 'c'}:0.5", *SMALL], capsys)
    assert code == 0
    assert out.startswith("# not resolved (model.vocab_size, data.seq_len, run.*: auto): "
                          f"dataset {tmp_path / 'c'} does not exist")


def test_a_url_is_looked_at_through_the_storage(s3, tmp_path, capsys):
    """--data s3://...: objects under the prefix that are not a dataset are an error, as a
    local directory that is there; an empty prefix is a dataset not prepared yet (the config is
    printed as given); a bucket that is not there is its own line."""
    url = s3.bucket("print") + "/half"
    argv = ["--run-dir", str(tmp_path / "r"), *SMALL]
    code, out, _ = _printed(["--data", url, *argv], capsys)
    assert code == 0
    assert out.startswith("# not resolved (model.vocab_size, data.seq_len, run.*: auto): "
                          f"dataset {url} does not exist")
    s3.fs().pipe_file(f"{url[5:]}/train_000000.bin", b"x")
    code, out, err = _printed(["--data", url, *argv], capsys)
    assert (code, out) == (2, "")
    assert err.startswith(f"ddpgpt: error: dataset {url} has no meta.json"), err
    code, out, err = _printed(["--data", "s3://no-such-bucket/x", *argv], capsys)
    assert (code, out) == (2, "")
    assert err.startswith("ddpgpt: error: listing s3://no-such-bucket/x: the bucket "
                          "no-such-bucket does not exist at "), err
