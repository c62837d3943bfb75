"""model.attention flex on CUDA (skipped without): torch's own FlexAttention backward, which a CPU
lacks (there tests/unit/test_flex_cpu.py checks model/flex_cpu.py's). Gradients under the block
mask against the dense mask's, and a training run on rows that start at documents, through flex,
against the same run through SDPA, resumed across the two."""

import pytest
import torch

from tests.helpers import read_metrics, tiny_train_args
from tests.processes import run_cli
from tests.unit.test_flex import compare_layer, layer_pair, rows

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.timeout(600)]


@pytest.mark.parametrize("window", [0, 70], ids=["documents", "documents+band"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_the_gradients_are_the_dense_mask_s(heads, window):
    """fp32 at full precision (no TF32): the two kernels differ in the order they sum."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        diffs = compare_layer(layer_pair(*heads, "cuda"), rows(3, 300, 40).cuda(), window,
                              grads=True)
    finally:
        torch.set_float32_matmul_precision(before)
    assert max(diffs) <= 1e-4, diffs


def _losses(run):
    return [row["loss"] for row in read_metrics(run)[0]]


@pytest.mark.parametrize("nproc", [1, 2])
def test_flex_trains_as_sdpa_and_resumes_with_it(tiny_data, tmp_path, nproc):
    """Six steps of bos-aligned rows (the document mask) in fp32: through flex, through sdpa,
    and three through flex then three more through sdpa from its checkpoint."""
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    losses = {}
    for name, attention in (("sdpa", ["sdpa"]), ("flex", ["flex"]), ("resumed", ["flex", "sdpa"])):
        run = tmp_path / name
        for steps, kind in zip((6,) if len(attention) == 1 else (3, 6), attention):
            args = tiny_train_args(tiny_data, run, steps=steps, device="cuda",
                                   run__precision="fp32", data__align="bos",
                                   model__attention=kind)[3:]
            r = run_cli("train", "--nproc", str(nproc), *args, timeout=500)
            assert r.returncode == 0, r.stderr
        losses[name] = _losses(run)
    assert len(losses["sdpa"]) == len(losses["flex"]) == len(losses["resumed"]) == 6
    for name in ("flex", "resumed"):
        torch.testing.assert_close(torch.tensor(losses[name]), torch.tensor(losses["sdpa"]),
                                   rtol=1e-3, atol=0)
